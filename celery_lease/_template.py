"""Resource and identity names from a task's arguments: templates and callables.

``"browser/account-{account_id}"`` is a ``str.format`` template over the task's arguments bound
through its signature (positional or keyword, defaults applied, ``**kwargs`` keys, ``{obj.attr}``
and ``{obj[key]}``). A callable gets the task's arguments and returns the name. A template is
compiled once per task; the common case (plain argument names, a plain signature) binds the
call's arguments without ``inspect.Signature.bind``.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable, Mapping
from typing import Any

from ._errors import LeaseConfigError
from ._names import show_value
from ._settings import did_you_mean

__all__ = ["NameTemplate"]

_formatter = string.Formatter()
_SIMPLE_KINDS = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


class NameTemplate:
    """A compiled resource or identity spec of one task.

    Args:
        spec: the template string or callable.
        signature: the signature of the task's ``run`` (what the task is called with).
        what: "resource" or "identity", for messages.
        task: the task name, for messages.
    """

    def __init__(
        self, spec: str | Callable[..., Any], signature: inspect.Signature, what: str, task: str
    ) -> None:
        self.spec = spec
        self.signature = signature
        self.what = what
        self.task = task
        self.fields: list[str] = []
        if callable(spec):
            return
        if not isinstance(spec, str):
            raise LeaseConfigError(
                f"the lease {what} of task {task!r} must be a template string or a callable, "
                f"got {show_value(spec)}"
            )
        try:
            parsed = list(_formatter.parse(spec))
        except ValueError as exc:
            raise LeaseConfigError(
                f"lease {what} template {spec!r} of task {task!r} is malformed: {exc}"
            ) from None
        for _, field, _, _ in parsed:
            if field is None:
                continue
            if field == "" or field.split(".")[0].split("[")[0].isdigit():
                raise LeaseConfigError(
                    f"lease {what} template {spec!r} of task {task!r} uses a positional field; "
                    "name the argument instead, e.g. {account_id}"
                )
            self.fields.append(field)
        params = list(signature.parameters.values())
        # The fast path: every parameter plain, every field a plain name.
        self.simple = all(p.kind in _SIMPLE_KINDS for p in params) and all(
            f.isidentifier() for f in self.fields
        )
        self.names = [p.name for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        self.known = {p.name for p in params}
        # Every parameter can come by position: a call giving them all so binds them all.
        self.all_positional = len(self.names) == len(self.known)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            # Refused when the task is defined: no call could ever provide this argument.
            for field in self.fields:
                root = field.split(".")[0].split("[")[0]
                if root not in self.known:
                    raise LeaseConfigError(
                        f"lease {what} template {spec!r} of task {task!r} names {root!r}"
                        f"{did_you_mean(root, self.known)}, which is not a parameter of the "
                        f"task function {signature}"
                    )
        self.defaults = {p.name: p.default for p in params if p.default is not p.empty}

    def render(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        """The name for one call.

        Raises:
            LeaseConfigError: an argument the template needs is missing or None, the arguments
                do not fit the signature, or a callable returned None.
        """
        spec = self.spec
        if callable(spec):
            value = spec(*args, **kwargs)
            if value is None:
                raise LeaseConfigError(
                    f"the lease {self.what} callable of task {self.task!r} returned None"
                )
            return str(value)
        fields = self.fields
        if not self.simple:
            mapping = self._bound_mapping(args, kwargs)
        else:
            if not kwargs and self.all_positional and len(args) == len(self.names):
                # Every parameter given by position (the usual .delay(a, b)): bound as is.
                mapping = dict(zip(self.names, args, strict=True))
            else:
                mapping = self._fast_mapping(args, kwargs)  # type: ignore[assignment]
            if mapping is None:
                mapping = self._bound_mapping(args, kwargs)
            else:
                # Plain names all given: Formatter.get_field would only look each up in the
                # mapping, at several times the cost. (Else it says what is missing.)
                for field in fields:
                    if mapping.get(field) is None:
                        break
                else:
                    fields = []
        for field in fields:
            try:
                value, _ = _formatter.get_field(field, (), mapping)
            except (KeyError, AttributeError, IndexError, TypeError) as exc:
                raise LeaseConfigError(
                    f"lease {self.what} template {spec!r} of task {self.task!r} needs "
                    f"{field!r}, which this call does not provide ({type(exc).__name__}: {exc}); "
                    f"arguments given: {sorted(mapping)}"
                ) from None
            if value is None:
                raise LeaseConfigError(
                    f"lease {self.what} template {spec!r} of task {self.task!r}: argument "
                    f"{field!r} is None; pass a value or make the {self.what} a callable"
                )
        try:
            return spec.format_map(mapping)
        except (ValueError, KeyError) as exc:
            raise LeaseConfigError(
                f"lease {self.what} template {spec!r} of task {self.task!r} is malformed: {exc}"
            ) from None

    def _fast_mapping(
        self, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Bind a plain call without Signature.bind; None when the call is not plain."""
        if len(args) > len(self.names) or not self.known.issuperset(kwargs):
            return None
        if kwargs and any(name in kwargs for name in self.names[: len(args)]):
            return None  # given twice: let bind() report it
        mapping = dict(self.defaults)
        mapping.update(zip(self.names, args, strict=False))  # args may be fewer than names
        mapping.update(kwargs)
        return mapping

    def _bound_mapping(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise LeaseConfigError(
                f"task {self.task!r} was called with arguments that do not match its "
                f"signature {self.signature}: {exc}"
            ) from None
        bound.apply_defaults()
        mapping: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            if self.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
                mapping.update(value)
            else:
                mapping[name] = value
        return mapping
