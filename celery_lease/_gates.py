"""Fence gates a task admits its new fence at right after its claim (``gates=``).

A gate that shares the lease store can know every fence the store granted. A gate elsewhere (an
HTTP gateway of another service, a database of its own: a :class:`FenceGate` on another URL)
knows only the fences it was shown. Until the newer owner's first write reaches it, an older
owner frozen past its lease can still write there, and its write is accepted. With
``@lease_task(gates=[...])`` each listed gate admits the new fence right after the claim, before
``reconcile`` and the body, so from then on the gate refuses every older fence, whether or not
the new owner has written yet.

Each entry of ``gates=`` (or the ``lease_gates`` attribute of a LeaseTask) is:

* a gate: anything with an ``admit(key, fence)`` method (a :class:`FenceGate`, a client of your
  own HTTP gateway); its key is the task's resource;
* or a ``(gate, key)`` pair: ``key`` is a ``str.format`` template over the task's arguments, as
  ``resource=`` is (``"account-{account_id}"``), or a callable taking them.

In either form the gate may also be a callable taking no arguments that returns the gate
(``lambda: gate``), called at each claim: the task then follows whatever that name holds at
the time, such as a gate a test swapped in (``monkeypatch.setattr(proj, "gate", ...)``).

Entries and templates are checked where the task is defined. At claim time a gate that refuses
the fence as stale means the lease is stale already (a newer fence was admitted there): the task
gives the lease back and runs again later, as after a lost lease; unless the gate's fence is
higher than any the lease store ever granted for the resource: the gate then outlived its store
(the store was reset or moved), no later claim would pass it, and the task fails at once with a
LeaseConfigError saying so. A gate that fails in any other
way (it cannot be reached) fails the claim's attempt the way a lease store outage does: the
lease is given back and the task waits on ``lease_store_down_max_wait``.

What remains is the time between the claim and each gate's admit: an older owner whose lease ran
out, frozen past its self-fence deadline, can still land one write at a gate before the new
fence reaches it.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from . import _clock
from . import _events as events
from . import _outage as outage
from ._errors import LeaseConfigError, LeaseError, LeaseStoreError, StaleFenceError
from ._eventlog import lease_log
from ._lease import Lease
from ._names import RESOURCE_PATTERN, RESOURCE_RULE, show_value, without_queries
from ._template import NameTemplate
from .fencing import FenceGate

__all__ = ["Gate", "Gates", "GatesSpec", "Refusal", "check_gates"]

#: The fix every refusal of a ``gates=`` entry ends with.
_FORMS = (
    "each entry is a gate (an object with an admit(key, fence) method, e.g. "
    "FenceGate('postgresql+psycopg://...')), whose key is the resource, or a (gate, key) "
    "pair whose key is a template over the task's arguments like resource= "
    "(gates=[(gate, 'account-{account_id}')]) or a callable taking them; the gate may also be "
    "a callable taking no arguments that returns it (gates=[(lambda: gate, ...)])"
)


class Gate(Protocol):
    """What ``gates=`` takes: anything that admits a fence for a key or raises."""

    def admit(self, key: str, fence: int) -> Any:
        """Admit ``fence`` for ``key``, or raise StaleFenceError when a newer one was admitted."""
        ...


#: What ``gates=`` / ``lease_gates`` takes.
GatesSpec = Sequence[
    Gate | Callable[[], Gate] | tuple[Gate | Callable[[], Gate], str | Callable[..., str]]
]


def _is_gate(value: object) -> bool:
    # (a class has its admit as a plain function: FenceGate itself is not a gate, an instance is)
    return not isinstance(value, (type, str, bytes)) and callable(getattr(value, "admit", None))


def _is_gate_factory(value: object) -> bool:
    """A callable taking no arguments (a lambda, a function) that is no gate and no class: it
    returns the gate at each claim."""
    if isinstance(value, (type, str, bytes)) or _is_gate(value) or not callable(value):
        return False
    try:
        inspect.signature(value).bind()
    except TypeError:  # it needs arguments
        return False
    except ValueError:  # (no signature to read: a builtin) let the call tell
        return True
    return True


def gate_label(gate: object) -> str:
    """How messages, log lines and the outage report name a gate: its class, and its URL
    (password masked, query string left out: a gateway's API key may ride there under any
    name) when it has one. Never its repr, which a client of the user's may fill with a
    token."""
    url = getattr(gate, "url", None)
    name = type(gate).__qualname__
    return f"{name}({without_queries(url)})" if isinstance(url, str) else name


def _factory_label(factory: object) -> str:
    """How a message names a gate factory that returned no gate: its qualified name."""
    return f"{getattr(factory, '__qualname__', type(factory).__qualname__)}()"


def _entries(spec: object, task: str) -> list[tuple[Any, str | Callable[..., Any] | None]]:
    """The (gate, key spec or None) of each entry of ``spec``, or LeaseConfigError."""
    if spec is None:
        return []
    if not isinstance(spec, (list, tuple)):
        hint = f"gates=[{show_value(spec)}]" if _is_gate(spec) else "gates=[gate, ...]"
        raise LeaseConfigError(
            f"task {task!r}: gates= must be a list, got {show_value(spec)}; write {hint} ({_FORMS})"
        )
    entries: list[tuple[Any, str | Callable[..., Any] | None]] = []
    for index, entry in enumerate(spec):
        where = f"task {task!r}: gates[{index}]"
        if _is_gate(entry) or _is_gate_factory(entry):
            entries.append((entry, None))
            continue
        if isinstance(entry, (tuple, list)) and len(entry) == 2:
            gate, key = entry
            if not (_is_gate(gate) or _is_gate_factory(gate)):
                instance = "; list an instance of it" if isinstance(gate, type) else ""
                raise LeaseConfigError(
                    f"{where} pairs {show_value(gate)} with a key, but it is no gate (it has no "
                    f"admit(key, fence) method{instance}); {_FORMS}"
                )
            if not (isinstance(key, str) or callable(key)):
                raise LeaseConfigError(
                    f"{where}: the key of a (gate, key) pair must be a template string or a "
                    f"callable, got {show_value(key)}; {_FORMS}"
                )
            entries.append((gate, key))
            continue
        if isinstance(entry, str):
            why = "a string is not a gate: make one, FenceGate(url), and list it"
        elif isinstance(entry, type):
            why = "a class is not a gate: list an instance of it"
        elif isinstance(entry, (tuple, list)):
            why = f"a pair has two items, this one has {len(entry)}"
        else:
            why = "it has no admit(key, fence) method"
        raise LeaseConfigError(f"{where} is {show_value(entry)}: {why}; {_FORMS}")
    return entries


def check_gates(spec: object, signature: inspect.Signature | None, task: str) -> None:
    """Check a task's ``gates=`` where the task is defined (its key templates too, against
    ``signature``, when there is one), so a mistake fails at import, not at the first run.

    Raises:
        LeaseConfigError: an entry that is no gate or pair, a key that is neither a template
            nor a callable, or a template naming a parameter the task does not have.
    """
    for _, key in _entries(spec, task):
        if isinstance(key, str) and signature is not None:
            NameTemplate(key, signature, "gate key", task)


@dataclass(frozen=True)
class _Entry:
    gate: Any  # the gate, or (factory) the callable that returns it at each claim
    key: NameTemplate | None  # None: the resource
    label: str
    strict: bool  # a FenceGate: its keys follow the resource-name rule
    factory: bool = False

    def resolved(self, task: str) -> _Entry:
        """This entry with its gate: a factory's is asked for now (LeaseConfigError when what
        it returns is no gate)."""
        if not self.factory:
            return self
        gate = self.gate()
        if not _is_gate(gate):
            raise LeaseConfigError(
                f"task {task!r}: the gates= entry {self.label} returned {show_value(gate)}, "
                f"which is no gate (it has no admit(key, fence) method); {_FORMS}"
            )
        return _Entry(gate, self.key, gate_label(gate), isinstance(gate, FenceGate))


@dataclass(frozen=True)
class Refusal:
    """Why a claim's fence was not admitted at one of its gates: ``error`` is the gate's
    StaleFenceError (the lease is stale), a LeaseConfigError (a key the gate refuses) or a
    LeaseStoreError naming the gate (it failed or could not be reached)."""

    gate: str
    key: str
    error: LeaseError


class Gates:
    """The gates of one task, compiled once per process: keys rendered per call, fences
    admitted after each claim.

    Args:
        spec: the task's ``gates=`` / ``lease_gates``.
        signature: the signature of the task's ``run``.
        task: the task name, for messages.
    """

    __slots__ = ("entries", "task")

    def __init__(self, spec: object, signature: inspect.Signature, task: str) -> None:
        self.task = task
        self.entries = tuple(
            _Entry(
                gate,
                None if key is None else NameTemplate(key, signature, "gate key", task),
                gate_label(gate) if _is_gate(gate) else _factory_label(gate),
                isinstance(gate, FenceGate),
                not _is_gate(gate),
            )
            for gate, key in _entries(spec, task)
        )

    def keys(
        self, resource: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> list[tuple[_Entry, str]]:
        """Each gate with its key for one call (before the claim: a bad call claims nothing).

        Raises:
            LeaseConfigError: an argument a key template needs is missing or None, or a
                FenceGate's key is not a valid name.
        """
        keyed = []
        for compiled in self.entries:
            entry = compiled.resolved(self.task)  # (a factory's gate, asked for at each claim)
            if entry.key is None:
                keyed.append((entry, resource))
                continue
            key = entry.key.render(args, kwargs)
            if entry.strict and not RESOURCE_PATTERN.fullmatch(key):
                raise LeaseConfigError(
                    f"task {self.task!r}: gate key {show_value(entry.key.spec)} gave "
                    f"{show_value(key)}, which {entry.label} cannot take: a key is "
                    f"{RESOURCE_RULE}"
                )
            keyed.append((entry, key))
        return keyed

    def admit(
        self, keyed: Sequence[tuple[_Entry, str]], lease: Lease, task_id: str | None
    ) -> Refusal | None:
        """Admit the lease's fence at each gate in turn; the first refusal or failure ends it.

        Returns:
            None when every gate admitted the fence in time, else the :class:`Refusal`. Admits
            that ended past the lease's self-fence deadline count as a failure of the slowest
            gate: the lease is about to be lost, and a gate that slow wants a timeout.
        """
        slowest, took = None, -1.0
        error: LeaseError
        for entry, key in keyed:
            started = _clock.monotonic()
            try:
                entry.gate.admit(key, lease.fence)
            except StaleFenceError as exc:
                return self._refused(entry, key, lease, task_id, exc, "stale")
            except LeaseConfigError as exc:
                error = LeaseConfigError(
                    f"task {self.task!r}: fence gate {entry.label} refused key {key!r} or fence "
                    f"{lease.fence} as invalid ({without_queries(exc)}); give the gate a key it "
                    "takes "
                    "(gates=[(gate, 'a-key-template-{argument}')])"
                )
                return self._refused(entry, key, lease, task_id, error, "config")
            except Exception as exc:  # noqa: BLE001 - any failure of the user's gate: not admitted
                error = LeaseStoreError(
                    f"fence gate {entry.label} did not admit fence {lease.fence} for key "
                    f"{key!r} of {lease.resource!r} ({type(exc).__name__}: "
                    f"{without_queries(exc)}); the lease "
                    "was given back and the claim is tried again as on a lease store outage",
                    isinstance(exc, LeaseStoreError) and exc.refused,
                )
                return self._refused(entry, key, lease, task_id, error, "unreachable")
            if outage.down:  # (one dict test while all is well)
                outage.claim_succeeded(entry.label)
            if _clock.monotonic() - started > took:
                slowest, took = (entry, key), _clock.monotonic() - started
        if slowest is not None and lease.remaining() <= 0:
            entry, key = slowest
            error = LeaseStoreError(
                f"admitting fence {lease.fence} of {lease.resource!r} at its gates took past the "
                f"lease's self-fence deadline ({entry.label} took {took:.1f}s for key {key!r}); "
                "give the gate's client a timeout well below the lease ttl"
            )
            return self._refused(entry, key, lease, task_id, error, "slow")
        return None

    def _refused(
        self,
        entry: _Entry,
        key: str,
        lease: Lease,
        task_id: str | None,
        error: LeaseError,
        reason: str,
    ) -> Refusal:
        events.count("celery_lease_gate_admit_failures_total", reason=reason)
        lease_log(
            "gate_refused",
            # a stale fence at claim or a key the gate refuses: rare and telling; an outage
            # is reported once a minute per gate by _outage, its attempts at INFO
            logging.INFO if reason in ("unreachable", "slow") else logging.WARNING,
            resource=lease.resource,
            fence=lease.fence,
            holder=lease.owner.label,
            task_id=task_id,
            task=self.task,
            gate=entry.label,
            key=key,
            reason=reason,
            newer_fence=error.highest if isinstance(error, StaleFenceError) else None,
            error=str(error) if reason != "stale" else None,
        )
        return Refusal(entry.label, key, error)
