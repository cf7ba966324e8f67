"""Fault injection for the OSS test double: errors, delays, dropped connections, outages.

``FaultInjection`` is the part of the double that tests drive to make requests fail
(``fail_next``), answer late (``delay_next``), lose their connection (``drop_next``) or meet
an outage (``set_down``); each ``FaultRule`` is limited by HTTP methods, OSS operations, an
object key prefix and a number of matching requests to let through first. The request handler
takes the rules that apply to each request (``_take_faults``) and carries them out;
``faults_injected`` counts them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Optional


@dataclass
class FaultRule:
    """One fault rule: what to do to how many requests, and to which."""

    kind: str  # "fail" | "delay" | "drop"
    remaining: int
    methods: Optional[frozenset[str]]
    operations: Optional[frozenset[str]]
    key_prefix: Optional[str]
    skip: int = 0
    status: int = 503
    code: str = "ServiceUnavailable"
    seconds: float = 0.0
    read_bytes: Optional[int] = None
    applied: bool = False
    message: str = "The service is unavailable."

    def matches(self, method: str, operation: str, key: str) -> bool:
        """Whether a request with this method, OSS operation and key is one the rule targets."""
        return ((self.methods is None or method in self.methods)
                and (self.operations is None or operation in self.operations)
                and (self.key_prefix is None or key.startswith(self.key_prefix)))


def _frozen(items: Optional[Iterable[str]], upper: bool = False) -> Optional[frozenset[str]]:
    if items is None:
        return None
    if isinstance(items, str):
        items = (items,)
    return frozenset(i.upper() if upper else i for i in items)


class FaultInjection:
    """The fault rules and the outage switch of the OSS test double (thread-safe).

    Args:
        lock: the double's one lock (it also guards the buckets and counters).
    """

    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        self._rules: list[FaultRule] = []
        self._down = False
        self.faults_injected = 0

    def _add_rule(self, rule: FaultRule) -> None:
        with self._lock:
            if rule.remaining <= 0:  # n=0 clears every rule of that kind
                self._rules = [r for r in self._rules if r.kind != rule.kind]
            else:
                self._rules.append(rule)

    def fail_next(self, n: int, status: int = 503, code: str = "ServiceUnavailable",
                  methods: Optional[Iterable[str]] = None, key_prefix: Optional[str] = None,
                  *, operations: Optional[Iterable[str]] = None, skip: int = 0,
                  message: str = "injected by the OSS test double") -> None:
        """The next ``n`` matching requests get this OSS error (``n=0`` clears every fail rule).

        Args:
            n: how many requests.
            status: HTTP status (503, 500, 429, 403 ...).
            code: OSS error code (``ServiceUnavailable``, ``SlowDown``, ``InternalError``,
                ``AccessDenied`` ...).
            methods: only these HTTP methods (``("PUT",)``).
            key_prefix: only object requests whose key starts with this.
            operations: only these OSS operations (``("UploadPart",)``; see
                ``operation_counts`` for the names).
            skip: let this many matching requests through first.
            message: the error document's ``Message``.
        """
        self._add_rule(FaultRule("fail", n, _frozen(methods, True), _frozen(operations),
                                 key_prefix, skip, status=status, code=code, message=message))

    def delay_next(self, n: int, seconds: float, methods: Optional[Iterable[str]] = None,
                   key_prefix: Optional[str] = None, *,
                   operations: Optional[Iterable[str]] = None, skip: int = 0) -> None:
        """The next ``n`` matching requests are answered ``seconds`` late (``n=0`` clears).

        The request is read first, then the answer waits: past the client's timeout ``oss2``
        raises ``RequestError`` (the operation is still carried out, as on a slow OSS).
        """
        self._add_rule(FaultRule("delay", n, _frozen(methods, True), _frozen(operations),
                                 key_prefix, skip, seconds=seconds))

    def drop_next(self, n: int, methods: Optional[Iterable[str]] = None,
                  key_prefix: Optional[str] = None, *,
                  operations: Optional[Iterable[str]] = None, skip: int = 0,
                  read_bytes: Optional[int] = None, applied: bool = False) -> None:
        """The next ``n`` matching requests lose their connection, with no answer (``n=0`` clears).

        Args:
            n: how many requests.
            methods: only these HTTP methods.
            key_prefix: only object requests whose key starts with this.
            operations: only these OSS operations.
            skip: let this many matching requests through first.
            read_bytes: read at most this many bytes of the body, then close (a connection
                lost mid-upload); None reads the whole request first. Nothing is stored.
            applied: carry the request out, then close without answering (a lost
                acknowledgement: the object exists, the client saw an error).
        """
        self._add_rule(FaultRule("drop", n, _frozen(methods, True), _frozen(operations),
                                 key_prefix, skip, read_bytes=read_bytes, applied=applied))

    def clear_faults(self) -> None:
        """Removes every fault rule and ends an outage."""
        with self._lock:
            self._rules = []
            self._down = False

    def set_down(self, down: bool) -> None:
        """While down, every request gets 503 ``ServiceUnavailable``."""
        with self._lock:
            self._down = down

    def _take_faults(self, method: str, operation: str, key: str) -> list[FaultRule]:
        """The rules (at most one of each kind) that apply to this request; counts them."""
        hit: list[FaultRule] = []
        with self._lock:
            if self._down:
                self.faults_injected += 1
                return [FaultRule("fail", 1, None, None, None, code="ServiceUnavailable")]
            kinds: set[str] = set()
            for rule in list(self._rules):
                if rule.kind in kinds or not rule.matches(method, operation, key):
                    continue
                if rule.skip > 0:
                    rule.skip -= 1
                    continue
                rule.remaining -= 1
                if rule.remaining <= 0:
                    self._rules.remove(rule)
                kinds.add(rule.kind)
                hit.append(rule)
            self.faults_injected += len(hit)
        return hit
