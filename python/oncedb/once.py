"""``oncedb.idempotent``: any function made once-only (see :func:`idempotent`)."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import decimal
import functools
import inspect
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar, Union

from ._oncedb import Db, Error, Fenced, Lease, LeaseLost, Reservation, SharedStore


if TYPE_CHECKING:
    # For type checkers only (Python 3.9 has no `typing.ParamSpec` at run time): the
    # decorated function keeps its signature.
    from typing_extensions import ParamSpec

    _P = ParamSpec("_P")
_R = TypeVar("_R")


class Mismatch(Error):
    """The key was used before with another payload: the function did not run."""


class InFlight(Error):
    """Another call of the key was still running when the wait for its outcome ended."""


class Failed(Error):
    """An earlier call of the key failed and its failure was stored
    (``on_error="fail"``): the function did not run again. ``args[0]`` is the stored
    failure's text."""


class Expired(Error):
    """An earlier call of the key succeeded, and its stored value aged out (the store
    keeps responses for less than its window): the function did not run again, and the
    value cannot be returned."""


#: The key of a tagged value in a stored result: ``{"$oncedb": TAG, "v": FORM}``.
_TAG = "$oncedb"


def _tagged(value: Any) -> Any:
    """``value`` as plain JSON, with every value JSON cannot carry as itself tagged, so
    that :func:`_json_decode` gives back an equal value of the same type: tuples, sets,
    bytes, dates and times, ``Decimal``, ``UUID``, and dicts whose keys are not all
    strings (or that hold the tag's own key). Any other type raises ``TypeError``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tagged(item) for item in value]
    if isinstance(value, dict):
        if all(isinstance(key, str) for key in value) and _TAG not in value:
            return {key: _tagged(item) for key, item in value.items()}
        return {_TAG: "dict", "v": [[_tagged(key), _tagged(item)] for key, item in value.items()]}
    if isinstance(value, tuple):
        return {_TAG: "tuple", "v": [_tagged(item) for item in value]}
    if isinstance(value, (set, frozenset)):
        items = sorted((_tagged(item) for item in value), key=lambda item: json.dumps(item, sort_keys=True))
        return {_TAG: type(value).__name__, "v": items}
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: type(value).__name__, "v": bytes(value).hex()}
    for kind in (datetime.datetime, datetime.date, datetime.time):
        if isinstance(value, kind):
            return {_TAG: kind.__name__, "v": value.isoformat()}
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return {_TAG: type(value).__name__, "v": str(value)}
    raise TypeError(
        f"a {type(value).__qualname__} result has no stored form that gives it back: "
        "return plain data, or give `encode=` and `decode=`"
    )


#: How each tag's form is read back.
_UNTAG: dict[str, Callable[[Any], Any]] = {
    "dict": lambda pairs: {_hashable(key): item for key, item in pairs},
    "tuple": tuple,
    "set": lambda items: {_hashable(item) for item in items},
    "frozenset": lambda items: frozenset(_hashable(item) for item in items),
    "bytes": bytes.fromhex,
    "bytearray": lambda text: bytearray.fromhex(text),
    "datetime": datetime.datetime.fromisoformat,
    "date": datetime.date.fromisoformat,
    "time": datetime.time.fromisoformat,
    "Decimal": decimal.Decimal,
    "UUID": uuid.UUID,
}


def _hashable(value: Any) -> Any:
    """A decoded key or set member: a list (from a form that was a list) cannot be one."""
    return tuple(value) if isinstance(value, list) else value


def _untagged(form: dict) -> Any:
    if len(form) == 2 and form.get(_TAG) in _UNTAG and "v" in form:
        return _UNTAG[form[_TAG]](form["v"])
    return form


def _json_encode(value: Any) -> bytes:
    """The default ``encode``: JSON, with the types :func:`_tagged` names tagged."""
    return json.dumps(_tagged(value), separators=(",", ":"), sort_keys=True).encode()


def _json_decode(stored: bytes) -> Any:
    """The default ``decode``: plain JSON (a record stored before tags decodes as it
    did), tagged values given back as their types."""
    return json.loads(stored, object_hook=_untagged)


def _canonical(value: Any) -> Any:
    """The JSON form of a payload value the default fingerprint takes (the ``default``
    of ``json.dumps``): one form per value whatever the process (no hash order, no
    address), or a ``TypeError`` that asks for ``payload=``."""
    if isinstance(value, (set, frozenset)):
        items = [json.dumps(item, sort_keys=True, default=_canonical) for item in value]
        return {"set": sorted(items)}
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, (datetime.datetime, datetime.date, datetime.time)):
        return {type(value).__name__: value.isoformat()}
    if isinstance(value, (decimal.Decimal, uuid.UUID)):
        return {type(value).__name__: str(value)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {type(value).__qualname__: dataclasses.asdict(value)}
    raise TypeError(
        f"the default fingerprint cannot take a {type(value).__qualname__} (its repr may hold "
        "an address or a summary): give `payload=` a function of the arguments"
    )


def _payload_of(function: Callable[..., Any]) -> Callable[..., Any]:
    """The default payload: the arguments bound to the function's parameters (so that
    ``f("o", 5)`` and ``f("o", amount=5)`` are one payload), defaults applied."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        signature = None

    def payload(*args: Any, **kwargs: Any) -> Any:
        if signature is None:
            return {"args": list(args), "kwargs": kwargs}
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return dict(bound.arguments)

    return payload


#: A renewal refused for a reason that may pass is sent again after this long at first,
#: doubling up to a third of the lease timeout, while the lease still holds (as in Rust).
FIRST_RETRY = 0.01

#: The note a record is left with when its call was cancelled or interrupted after the
#: function started: its side effect may have happened, so no store takes it over
#: automatically; a reconciler settles it (``in_flight``, then ``take_over``).
UNFINISHED_NOTE = b"idempotent: the call was cancelled: outcome unknown"


class _Renewals:
    """When the next renewal goes out: every third of the timeout; after a refusal that
    may pass, again with a growing back-off while the lease holds; never after
    ``Fenced`` or ``LeaseLost``, or once a timeout passed since the last renewal taken."""

    def __init__(self, timeout: float, asked: float) -> None:
        self.timeout = timeout
        self.held_until = asked + timeout
        self.retry = FIRST_RETRY

    def first(self) -> float:
        return self.timeout / 3

    def after(self, sent: float, err: Optional[BaseException]) -> Optional[float]:
        if err is None:
            self.held_until = sent + self.timeout
            self.retry = FIRST_RETRY
            return self.timeout / 3
        if isinstance(err, (Fenced, LeaseLost)):
            return None
        left = self.held_until - time.monotonic()
        if left <= 0:
            return None
        wait = min(self.retry, left)
        self.retry = min(self.retry * 2, self.timeout / 3)
        return wait


class _Renewal:
    """Renews a lease on a thread of its own (the renewal waits on an fsync with the GIL
    released), retrying a refusal that may pass while the lease holds, until stopped."""

    def __init__(self, lease: Lease, timeout: Optional[float], asked: float) -> None:
        self.stopped = threading.Event()
        self.thread = None
        if timeout:
            renewals = _Renewals(timeout, asked)
            self.thread = threading.Thread(target=self._loop, args=(lease, renewals), daemon=True)
            self.thread.start()

    def _loop(self, lease: Lease, renewals: _Renewals) -> None:
        wait: Optional[float] = renewals.first()
        # A timed wait is the renewal's period, not a stand-in for an event.
        while wait is not None and not self.stopped.wait(wait):
            sent = time.monotonic()
            try:
                lease.keep_alive()
                wait = renewals.after(sent, None)
            except Error as err:
                wait = renewals.after(sent, err)

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()


async def _renew(lease: Lease, timeout: Optional[float], asked: float) -> None:
    """Renews ``lease`` as :class:`_Renewals` says, until cancelled or lost."""
    if not timeout:
        return
    renewals = _Renewals(timeout, asked)
    wait: Optional[float] = renewals.first()
    while wait is not None:
        await asyncio.sleep(wait)
        sent = time.monotonic()
        try:
            await lease.akeep_alive()
            wait = renewals.after(sent, None)
        except Error as err:
            wait = renewals.after(sent, err)


class _Once:
    """What :func:`idempotent` was given, and the calls of the functions it wraps."""

    def __init__(self, db: Union[Db, SharedStore], **given: Any) -> None:
        if given["on_error"] not in ("release", "fail"):
            raise ValueError(f"on_error {given['on_error']!r}: 'release' or 'fail'")
        self.db = db
        self.given = given

    def scope(
        self, function: Callable[..., Any], args: tuple, kwargs: dict
    ) -> tuple[str, str, Any, bytes]:
        """Tenant, operation, key and the fingerprinted payload of one call."""
        part = lambda value: value(*args, **kwargs) if callable(value) else value  # noqa: E731
        payload = (self.given["payload"] or _payload_of(function))(*args, **kwargs)
        request = json.dumps(payload, separators=(",", ":"), sort_keys=True, default=_canonical)
        return (
            part(self.given["tenant"]),
            part(self.given["operation"]),
            self.given["key"](*args, **kwargs),
            request.encode(),
        )

    def settled(self, answer: Reservation) -> Any:
        """The stored outcome of a finished call (or the mismatch), as the caller sees it."""
        if answer.status == "completed":
            return self.given["decode"](answer.response or b"null")
        if answer.status == "failed":
            raise Failed((answer.response or b"").decode("utf-8", "replace"))
        if answer.status == "expired":
            raise Expired("the key's call succeeded; its value is no longer stored")
        raise Mismatch("the key was used before with another payload")

    def failure(self, err: BaseException) -> Optional[bytes]:
        """What to store for an exception (``on_error="fail"``), or ``None`` to release."""
        if self.given["on_error"] == "fail" and isinstance(err, Exception):
            return repr(err).encode("utf-8", "replace")
        return None

    def call(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        scope = self.scope(function, args, kwargs)
        deadline = time.monotonic() + self.given["wait"]
        while True:
            asked = time.monotonic()
            answer = self.db.reserve(*scope)
            if answer.status == "acquired":
                return self.run(answer.lease, asked, function, args, kwargs)
            if answer.status != "in_flight":
                return self.settled(answer)
            left = deadline - time.monotonic()
            if left <= 0:
                raise InFlight("another call of the key is still running")
            self.db.wait_finished(scope[0], scope[1], scope[2], left)

    def encoded(self, value: Any) -> tuple[Optional[bytes], Optional[bytes]]:
        """The value as stored, or (when ``encode`` fails after the function ran) the
        failure to store instead: the side effect happened, so a retry must not run the
        function again."""
        try:
            return self.given["encode"](value), None
        except Exception as err:  # noqa: BLE001 - any encoder failure
            why = f"the result could not be encoded: {err!r}"
            return None, why.encode("utf-8", "replace")

    def run(
        self, lease: Lease, asked: float, function: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        renewal = _Renewal(lease, self.db.lease_timeout, asked)
        try:
            value = function(*args, **kwargs)
        except Exception as err:
            renewal.stop()
            stored = self.failure(err)
            lease.release() if stored is None else lease.fail(stored)
            raise
        except BaseException:
            # Interrupted (KeyboardInterrupt, SystemExit): the outcome is unknown.
            renewal.stop()
            lease.note(UNFINISHED_NOTE)
            raise
        renewal.stop()
        stored, failure = self.encoded(value)
        if stored is None:
            lease.fail(failure)
            raise TypeError(failure.decode("utf-8", "replace"))
        lease.complete(stored)
        return value

    async def acall(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # The awaitables: no thread is held while a call waits on a commit or an outcome.
        scope = self.scope(function, args, kwargs)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.given["wait"]
        while True:
            asked = time.monotonic()
            answer = await _reserved(self.db, scope)
            if answer.status == "acquired":
                return await self.arun(answer.lease, asked, function, args, kwargs)
            if answer.status != "in_flight":
                return self.settled(answer)
            left = deadline - loop.time()
            if left <= 0:
                raise InFlight("another call of the key is still running")
            await self.db.await_finished(scope[0], scope[1], scope[2], left)

    async def arun(
        self, lease: Lease, asked: float, function: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        renewal = asyncio.ensure_future(_renew(lease, self.db.lease_timeout, asked))
        try:
            value = await function(*args, **kwargs)
        except Exception as err:
            renewal.cancel()
            stored = self.failure(err)
            await (lease.arelease() if stored is None else lease.afail(stored))
            raise
        except BaseException:
            # Cancelled (a timeout around the call, a task cancelled) or interrupted while
            # the function ran: its side effect may have happened, so the record is noted,
            # not released; a retry is not run again automatically. The note is written
            # whatever happens to this task now.
            renewal.cancel()
            _keep(asyncio.ensure_future(lease.anote(UNFINISHED_NOTE)))
            raise
        renewal.cancel()
        stored, failure = self.encoded(value)
        if stored is None:
            await lease.afail(failure)
            raise TypeError(failure.decode("utf-8", "replace"))
        await lease.acomplete(stored)
        return value


#: Tasks that must finish although nothing awaits them (a note after a cancel).
_KEPT: set = set()


def _keep(task: "asyncio.Future[Any]") -> None:
    _KEPT.add(task)
    task.add_done_callback(_KEPT.discard)


async def _reserved(db: Union[Db, SharedStore], scope: tuple) -> Reservation:
    """``db.areserve(*scope)``; if this call is cancelled while the reservation is on its
    way, a lease it acquired is released when it arrives (the function never ran), so the
    key is not left in flight."""
    reserving = asyncio.ensure_future(db.areserve(*scope))
    try:
        return await asyncio.shield(reserving)
    except asyncio.CancelledError:

        def release(done: "asyncio.Future[Any]") -> None:
            if done.cancelled() or done.exception() is not None:
                return
            answer = done.result()
            if answer.status == "acquired":
                _keep(asyncio.ensure_future(answer.lease.arelease()))

        reserving.add_done_callback(release)
        raise


def idempotent(
    db: Union[Db, SharedStore],
    *,
    tenant: Union[str, Callable[..., str]],
    operation: Union[str, Callable[..., str]],
    key: Callable[..., Union[str, bytes]],
    payload: Optional[Callable[..., Any]] = None,
    wait: float = 0.0,
    on_error: str = "release",
    encode: Callable[[Any], bytes] = _json_encode,
    decode: Callable[[bytes], Any] = _json_decode,
) -> Callable[[Callable[_P, _R]], Callable[_P, _R]]:
    """Makes a function (``def`` or ``async def``) run once per key:

    - ``tenant`` and ``operation`` scope the key: strings, or callables of the function's
      arguments; ``key(*args, **kwargs)`` gives the key;
    - ``payload(*args, **kwargs)`` gives what the fingerprint covers (default: the
      arguments bound to the function's parameters, defaults applied, as canonical JSON:
      ``f("o", 5)`` and ``f("o", amount=5)`` are one payload; sets, bytes, dates, times,
      ``Decimal``, ``UUID`` and dataclasses have one form in every process; any other
      object raises ``TypeError`` before the function runs, asking for ``payload=``);
      the key used again with another payload raises :class:`Mismatch`;
    - the return value is stored with ``encode`` and a retry returns it, ``decode``d,
      without calling the function. The default is JSON in which tuples, sets, bytes,
      dates and times, ``Decimal``, ``UUID`` and dicts with non-string keys are tagged, so
      a retry gets back an equal value of the same type; another type fails the key (see
      below); once the store no longer keeps it
      (``response_retention`` shorter than the window) a retry raises :class:`Expired`;
    - a call that finds the key in flight waits up to ``wait`` seconds for the outcome
      (woken by it, never polling), then raises :class:`InFlight`;
    - an exception releases the key and propagates (``on_error="release"``), or is stored
      as the key's failure (``on_error="fail"``: retries raise :class:`Failed`);
    - a result ``encode`` cannot store (the function ran) fails the key with a text
      saying so and raises ``TypeError``: retries raise :class:`Failed`, the function
      does not run again;
    - a call cancelled (``asyncio.wait_for``, a cancelled task) or interrupted while the
      function runs leaves the key in flight with a note, "outcome unknown": retries
      raise :class:`InFlight`, and no lease timeout takes it over; a reconciler settles
      it (``in_flight``, then ``take_over``). A call cancelled while its reservation is on
      its way releases the lease it gets (the function never ran);
    - while the function runs, its lease is renewed every third of the store's
      ``lease_timeout``, if it has one; a renewal refused for a reason that may pass is
      sent again with a growing back-off while the lease holds. An ``async def`` awaits
      the store without holding a thread.
    """
    once = _Once(
        db,
        tenant=tenant,
        operation=operation,
        key=key,
        payload=payload,
        wait=wait,
        on_error=on_error,
        encode=encode,
        decode=decode,
    )

    def decorate(function: Callable[_P, _R]) -> Callable[_P, _R]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await once.acall(function, args, kwargs)

            return run_async  # type: ignore[return-value]

        @functools.wraps(function)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            return once.call(function, args, kwargs)

        return run_sync  # type: ignore[return-value]

    return decorate
