"""Validation of the names and numbers users hand to celery_lease.

Resource names become Redis keys and SQL parameters, so they come from a small documented safe
set; anything else is refused with a :class:`LeaseConfigError` that names the value and the rule.
Owner labels are free text from host names and task ids, so they are cleaned, never refused.

A lease task's owner label reads ``host:pid:task-id``, then, after a space, the task's name and
the arguments its sender recorded (Celery's ``argsrepr`` and ``kwargsrepr``, shortened):

```text
celery@w1:4121:6f1c0b9e-... proj.drive_browser (42,) {'mode': 'fast'}
```

The task id ends at the first space: a space or ``%`` inside a task id is written ``%20`` or
``%25`` (:func:`label_task_id`), so the label names one task id, however odd, and readers cut the
note off (:func:`parse_holder`). Labels written before the note existed are read the same way.
"""

from __future__ import annotations

import difflib
import math
import re
from collections.abc import Iterable
from urllib.parse import unquote

from ._errors import LeaseConfigError

__all__ = [
    "MAX_FENCE",
    "MAX_LABEL_LENGTH",
    "MAX_RESOURCE_LENGTH",
    "RESOURCE_PATTERN",
    "RESOURCE_RULE",
    "clean_label",
    "holder_task_id",
    "label_task_id",
    "parse_holder",
    "show_value",
    "validate_identifier",
    "validate_resource",
    "validate_ttl",
]

MAX_RESOURCE_LENGTH = 200
#: The largest fence any store takes from a caller (2**53 - 1). Redis compares fences in Lua,
#: whose numbers are doubles: above 2**53 two fences can compare equal (an older one would be
#: admitted after a newer one), so every store refuses them alike. The fences the stores grant
#: stay far below: SQL and memory count from 1, and a Redis fence is about the server clock in
#: microseconds (2**53 us after 1970 is in the year 2255).
MAX_FENCE = 2**53 - 1
MAX_LABEL_LENGTH = 200
RESOURCE_RULE = "1..200 characters from A-Z a-z 0-9 and _ . : / - (no spaces, braces or globs)"
_RESOURCE_RE = re.compile(r"[A-Za-z0-9_.:/\-]{1,200}")
#: The compiled rule (``RESOURCE_PATTERN.fullmatch(name)``), for hot paths.
RESOURCE_PATTERN = _RESOURCE_RE
#: A task identity follows the resource-name rule; this is how messages state it.
IDENTITY_RULE = "1..200 of A-Z a-z 0-9 _ . : / -"
_LABEL_BAD = re.compile(r"[^\x21-\x7e ]")
_IDENTIFIER_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,39}")


def show_value(value: object, limit: int = 60) -> str:
    """Return ``repr(value)`` cut to ``limit`` characters, for error messages."""
    text = repr(value)
    if len(text) > limit:
        text = f"{text[: limit - 15]}...<{len(text)} chars>"
    return text


def validate_resource(resource: object) -> str:
    """Return ``resource`` if it is a valid resource name, else raise LeaseConfigError.

    Raises:
        LeaseConfigError: naming the bad value and the rule.
    """
    if isinstance(resource, str) and _RESOURCE_RE.fullmatch(resource):
        return resource
    raise LeaseConfigError(
        f"invalid lease resource {show_value(resource)}: a resource name must be "
        f"{RESOURCE_RULE}; build it from ids (e.g. 'browser/account-42') or hash free text"
    )


def validate_fence(fence: object, shown: object = None) -> int:
    """Return ``fence`` if it is an integer (not a bool) of at most :data:`MAX_FENCE`, else
    raise LeaseConfigError.

    ``shown`` is what the message quotes (the caller's argument, e.g. a lease), default ``fence``.
    """
    if isinstance(fence, bool) or not isinstance(fence, int):
        quoted = fence if shown is None else shown
        raise LeaseConfigError(f"a fence is an integer, got {show_value(quoted)}")
    if fence > MAX_FENCE:
        raise LeaseConfigError(
            f"fence {fence} is above {MAX_FENCE} (2**53 - 1), the largest fence a store "
            "compares exactly (Redis compares fences as doubles); no store grants one that "
            "large: pass the fence the lease store granted (lease.fence)"
        )
    return fence


def validate_ttl(ttl: object, max_ttl: float, name: str = "ttl") -> float:
    """Return ``ttl`` as a float if ``0 < ttl <= max_ttl``, else raise LeaseConfigError."""
    if isinstance(ttl, bool) or not isinstance(ttl, (int, float)):
        raise LeaseConfigError(f"{name} must be a number of seconds, got {show_value(ttl)}")
    value = float(ttl)
    if not math.isfinite(value) or value <= 0 or value > max_ttl:
        raise LeaseConfigError(
            f"{name}={show_value(ttl)} is out of range: it must be > 0 and <= {max_ttl:g} "
            "seconds (the store's max_ttl); renewal keeps a long task's lease alive, so keep "
            "the ttl short"
        )
    return value


def clean_label(label: object) -> str:
    """Make a printable owner label of at most MAX_LABEL_LENGTH characters."""
    text = str(label)
    # (printable ASCII is exactly what _LABEL_BAD lets through; the look is C-speed, the
    # regex's scan of a 200-character label about a microsecond: it runs once per claim)
    if not (text.isascii() and text.isprintable()):
        text = _LABEL_BAD.sub("?", text)
    return text[:MAX_LABEL_LENGTH] or "?"


def label_task_id(task_id: str) -> str:
    """A task id as an owner label writes it: ``%`` and space percent-encoded, else as it is.

    Celery's task ids (UUIDs) come out unchanged. The encoding keeps a label's first space
    the end of its task id for any task id, so matching a task id against a label (compare
    this to the label's task-id part) cannot be fooled by a task id that contains a space.
    """
    if "%" in task_id or " " in task_id:
        return task_id.replace("%", "%25").replace(" ", "%20")
    return task_id


def parse_holder(label: str) -> tuple[str | None, str | None, str | None]:
    """The (task id, task name, arguments) a lease task's holder label carries.

    The label reads ``host:pid:task-id[ task-name[ arguments]]`` (see the module docstring).
    Each part is None when the label does not carry it: a label given to ``Owner.new()``,
    one written before task names were added, a task that was called directly (``direct``),
    a message whose sender recorded no arguments. ``arguments`` is Celery's ``argsrepr`` and
    ``kwargsrepr`` joined by a space, as shortened at claim time (it may end in ``...``).
    """
    parts = label.split(":", 2)  # (a task id may hold colons, a host name not)
    if len(parts) != 3 or not parts[1].isdigit():
        return None, None, None
    written, _, note = parts[2].partition(" ")
    task_id = None if written in ("", "direct") else written
    if task_id is not None and "%" in task_id:
        task_id = unquote(task_id)  # (only '%' and ' ' are encoded: see label_task_id)
    name, _, arguments = note.partition(" ")
    return task_id, name or None, arguments or None


def holder_task_id(label: str) -> str | None:
    """The task id in a lease task's holder label ``worker@host:pid:task-id ...``, or None."""
    return parse_holder(label)[0]


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    """``" (did you mean 'ttl'?)"`` for the candidate closest to a misspelt ``name``, or ``""``."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean {matches[0]!r}?)" if matches else ""


def validate_identifier(value: object, name: str) -> str:
    """Validate a configurable SQL table prefix or Redis key prefix part."""
    if isinstance(value, str) and _IDENTIFIER_RE.fullmatch(value):
        return value
    raise LeaseConfigError(
        f"{name}={show_value(value)} is not allowed: use 1..40 characters of A-Z a-z 0-9 _ "
        "starting with a letter or underscore"
    )


# -- URLs and names in messages -------------------------------------------------------------------
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
# A query parameter's value runs to the next "&name=" (a raw '&' inside a password must not
# leak its tail). Names may be percent-encoded: drivers decode them (pass%77ord is password).
_QUERY_FIRST = re.compile(r"(\?)([A-Za-z0-9_.%\-]+)=")
_QUERY_KEY = re.compile(r"(&)([A-Za-z0-9_.%\-]+)=")
# Any parameter whose decoded name says secret: password, ssl_password, sslpassword, passwd...
_SECRET_KEY = re.compile(r"pass|pwd|secret|token", re.IGNORECASE)


def _mask_query(text: str) -> str:
    start = text.find("?")
    if start < 0:
        return text
    first = _QUERY_FIRST.match(text, start)
    keys = [first] if first else []
    keys += _QUERY_KEY.finditer(text, first.end() if first else start)
    if not keys:
        return text
    out = [text[: keys[0].start()]]
    for number, key in enumerate(keys):
        end = keys[number + 1].start() if number + 1 < len(keys) else len(text)
        out.append(key.group(0))
        secret = _SECRET_KEY.search(unquote(key.group(2)))
        out.append("***" if secret else text[key.end() : end])
    return "".join(out)


def _password_span(text: str) -> tuple[int, int] | None:
    """Where the userinfo password of a URL is, by the widest reading any driver makes.

    redis-py (``urllib.parse``) reads the password up to the *last* ``@`` of the host part,
    SQLAlchemy up to the *first* ``@``; a password holding an unencoded ``/``, ``?`` or ``#``
    moves where ``urllib`` thinks the host part ends. So: from the first ``:`` after ``//``
    (the user name before it holds no ``/?#``) to the last ``@`` of the URL. This may mask
    more than the password (an ``@`` in a query), never less.

    A URL with an empty host part (``sqlite:///path``, ``sqlite://``, ``unix:///socket``) has
    no user info for any driver to read: what follows is a path, which may hold ``:`` and
    ``@``. Which schemes those are is not decided here (``stores/urls.py`` alone knows schemes).
    """
    lead = len(text) - len(text.lstrip())  # store_from_url strips; so must the mask
    scheme = _SCHEME.match(text, lead)
    if scheme is None or text[scheme.end() :].rstrip()[:1] in ("", "/"):
        return None  # no URL, or no host part: a path (or nothing), not a password
    start = scheme.end()
    at = text.rfind("@", start)
    colon = text.find(":", start, at) if at >= 0 else -1
    if colon < 0:  # a ':' anywhere before the last '@' may start a password: mask it
        return None
    return colon + 1, at


#: A query or fragment after a URL or an absolute path (up to a space or quote), as a driver's
#: or HTTP client's error quotes it: ``for url: http://h/x?api_key=...``, ``url: /x?api_key=``.
_QUERY_IN_TEXT = re.compile(r"((?:[A-Za-z][A-Za-z0-9+.\-]*://|/)[^\s?#'\"<>]*)[?#][^\s'\"<>]*")
_URL_IN_TEXT = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://\S+")


def without_queries(text: object) -> str:
    """``text`` with every query string and fragment after a URL or an absolute path left out
    and every URL's password masked: for a URL or an error message of the user's (a gate's
    client), whose query may carry an API key under any name (``?api_key=``, ``?key=``)."""
    shown = str(text)
    if "?" in shown or "#" in shown:
        shown = _QUERY_IN_TEXT.sub(r"\1", shown)
    if "://" in shown and "@" in shown:
        shown = _URL_IN_TEXT.sub(lambda m: mask_url(m.group(0)), shown)
    return shown


def mask_url(url: object) -> str:
    """Return the URL with any password replaced by ``***`` (safe to log or show)."""
    text = str(url)
    span = _password_span(text)
    if span is not None:
        text = f"{text[: span[0]]}***{text[span[1] :]}"
    return _mask_query(text)


def check_credentials(url: str) -> None:
    """Refuse a SQL URL whose password SQLAlchemy would misread.

    SQLAlchemy ends the password at the first ``@``: ``user:p@ss@host`` connects as password
    ``p`` to host ``ss@host``, and the driver's errors then quote the rest of the password.

    Raises:
        LeaseConfigError: naming the fix (percent-encode the password), quoting none of it.
    """
    span = _password_span(url)
    if span is not None and "@" in url[span[0] : span[1]]:
        raise LeaseConfigError(
            f"the password in lease store URL {mask_url(url)!r} contains an unencoded '@': "
            "SQLAlchemy would read the text after it as the host name. Percent-encode the "
            "password (urllib.parse.quote(password, safe='') writes '@' as %40, '/' as %2F, "
            "'?' as %3F, '#' as %23, '%' as %25)"
        )
