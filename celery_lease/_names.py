"""Validation of the names and numbers users hand to celery_lease.

Resource names become Redis keys and SQL parameters, so they come from a small documented safe
set; anything else is refused with a :class:`LeaseConfigError` that names the value and the rule.
Owner labels are free text from host names and task ids, so they are cleaned, never refused.
"""

from __future__ import annotations

import math
import re

from ._errors import LeaseConfigError

__all__ = [
    "MAX_LABEL_LENGTH",
    "MAX_RESOURCE_LENGTH",
    "RESOURCE_PATTERN",
    "RESOURCE_RULE",
    "clean_label",
    "holder_task_id",
    "show_value",
    "validate_identifier",
    "validate_resource",
    "validate_ttl",
]

MAX_RESOURCE_LENGTH = 200
MAX_LABEL_LENGTH = 200
RESOURCE_RULE = "1..200 characters from A-Z a-z 0-9 and _ . : / - (no spaces, braces or globs)"
_RESOURCE_RE = re.compile(r"[A-Za-z0-9_.:/\-]{1,200}")
#: The compiled rule (``RESOURCE_PATTERN.fullmatch(name)``), for hot paths.
RESOURCE_PATTERN = _RESOURCE_RE
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
    text = _LABEL_BAD.sub("?", str(label))
    return text[:MAX_LABEL_LENGTH] or "?"


def holder_task_id(label: str) -> str | None:
    """The task id in a lease task's holder label ``worker@host:pid:task-id``, or None."""
    parts = label.rsplit(":", 2)
    if len(parts) == 3 and parts[1].isdigit() and parts[2] and parts[2] != "direct":
        return parts[2]
    return None


def validate_identifier(value: object, name: str) -> str:
    """Validate a configurable SQL table prefix or Redis key prefix part."""
    if isinstance(value, str) and _IDENTIFIER_RE.fullmatch(value):
        return value
    raise LeaseConfigError(
        f"{name}={show_value(value)} is not allowed: use 1..40 characters of A-Z a-z 0-9 _ "
        "starting with a letter or underscore"
    )
