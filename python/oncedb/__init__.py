"""oncedb: embedded deduplication windows and idempotency records.

An in-process ``SET NX EX`` over a time window, and idempotency records scoped by
tenant and operation, bound to a request hash, with a processing / completed / failed
lifecycle, replayed responses, in-flight detection and fencing. Durable stores survive
``kill -9`` and (in ``"sync"`` mode) power loss without losing an acknowledged write.

Keys are ``bytes`` or ``str`` (``str`` is encoded as UTF-8, so ``"k"`` and ``b"k"`` are
the same key). Requests, responses and notes are ``bytes``.

Every call that may wait on an fsync releases the GIL: other threads run during a
commit, and a ``Db`` can be shared across threads. From asyncio, offload calls to a
thread so the event loop never waits on an fsync::

    admitted = await asyncio.to_thread(db.insert_if_absent, key)

(:func:`run` does exactly that.)
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
from typing import Any, Callable, Optional, TypeVar, Union

from ._oncedb import (
    Closed,
    Corrupted,
    Db,
    Error,
    Fenced,
    Full,
    InvalidInput,
    Lease,
    LeaseLost,
    Locked,
    Poisoned,
    Reservation,
    StoreIoError,
    __version__,
)

__all__ = [
    "Closed",
    "Corrupted",
    "Db",
    "Error",
    "Fenced",
    "Full",
    "InvalidInput",
    "Lease",
    "LeaseLost",
    "Locked",
    "Poisoned",
    "Reservation",
    "StoreIoError",
    "Mismatch",
    "InFlight",
    "Failed",
    "idempotent",
    "run",
    "__version__",
]

T = TypeVar("T")


async def run(call: Callable[..., T], *args: Any) -> T:
    """Runs a blocking oncedb call (``db.reserve``, ``lease.complete``, ...) on a worker
    thread, so that the event loop keeps running while it waits on an fsync."""
    return await asyncio.to_thread(call, *args)


class Mismatch(Error):
    """The key was used before with another payload: the function did not run."""


class InFlight(Error):
    """Another call of the key was still running when the wait for its outcome ended."""


class Failed(Error):
    """An earlier call of the key failed and its failure was stored
    (``on_error="fail"``): the function did not run again. ``args[0]`` is the stored
    failure's text."""


def _json_encode(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), sort_keys=True).encode()


def _json_decode(stored: bytes) -> Any:
    return json.loads(stored)


def _default_payload(*args: Any, **kwargs: Any) -> Any:
    return {"args": list(args), "kwargs": kwargs}


def _part(value: Union[str, Callable[..., str]], args: tuple, kwargs: dict) -> str:
    return value(*args, **kwargs) if callable(value) else value


class _Renewal:
    """Renews a lease every third of the store's lease timeout on a thread of its own
    (the renewal waits on an fsync with the GIL released), until stopped."""

    def __init__(self, lease: Lease, timeout: Optional[float]) -> None:
        self.stopped = threading.Event()
        self.thread = None
        if timeout:
            every = timeout / 3
            self.thread = threading.Thread(target=self._loop, args=(lease, every), daemon=True)
            self.thread.start()

    def _loop(self, lease: Lease, every: float) -> None:
        # A timed wait is the renewal's period, not a stand-in for an event.
        while not self.stopped.wait(every):
            try:
                lease.keep_alive()
            except Error:
                return

    def stop(self) -> None:
        self.stopped.set()
        if self.thread is not None:
            self.thread.join()


async def _renew(lease: Lease, timeout: Optional[float]) -> None:
    """Renews ``lease`` every third of ``timeout`` until cancelled (or refused)."""
    if not timeout:
        return
    while True:
        await asyncio.sleep(timeout / 3)
        try:
            await lease.akeep_alive()
        except Error:
            return


def idempotent(
    db: Db,
    *,
    tenant: Union[str, Callable[..., str]],
    operation: Union[str, Callable[..., str]],
    key: Callable[..., Union[str, bytes]],
    payload: Optional[Callable[..., Any]] = None,
    wait: float = 0.0,
    on_error: str = "release",
    encode: Callable[[Any], bytes] = _json_encode,
    decode: Callable[[bytes], Any] = _json_decode,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Makes a function (``def`` or ``async def``) run once per key:

    - ``tenant`` and ``operation`` scope the key: strings, or callables of the function's
      arguments; ``key(*args, **kwargs)`` gives the key;
    - ``payload(*args, **kwargs)`` gives what the fingerprint covers (default: the
      arguments, as canonical JSON); the key used again with another payload raises
      :class:`Mismatch`;
    - the return value is stored with ``encode`` (JSON by default) and a retry returns it,
      ``decode``d, without calling the function;
    - a call that finds the key in flight waits up to ``wait`` seconds for the outcome
      (woken by it, never polling), then raises :class:`InFlight`;
    - an exception releases the key and propagates (``on_error="release"``), or is stored
      as the key's failure (``on_error="fail"``: retries raise :class:`Failed`);
    - while the function runs, its lease is renewed every third of the store's
      ``lease_timeout``, if it has one.
    """
    if on_error not in ("release", "fail"):
        raise ValueError(f"on_error {on_error!r}: 'release' or 'fail'")
    fingerprint = payload or _default_payload

    def request_of(args: tuple, kwargs: dict) -> tuple[str, str, Any, bytes]:
        request = json.dumps(
            fingerprint(*args, **kwargs), separators=(",", ":"), sort_keys=True, default=repr
        ).encode()
        return (
            _part(tenant, args, kwargs),
            _part(operation, args, kwargs),
            key(*args, **kwargs),
            request,
        )

    def settled(answer: Reservation) -> Any:
        if answer.status == "completed":
            return decode(answer.response or b"null")
        if answer.status == "failed":
            raise Failed((answer.response or b"").decode("utf-8", "replace"))
        if answer.status == "expired":
            raise Failed("the key's outcome is no longer stored")
        raise Mismatch("the key was used before with another payload")

    def ended(lease: Lease, err: BaseException) -> None:
        if on_error == "fail" and isinstance(err, Exception):
            lease.fail(repr(err).encode("utf-8", "replace"))
        else:
            lease.release()

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                # The awaitables: no thread is held while a call waits on a commit or
                # for an outcome.
                scope = request_of(args, kwargs)
                loop = asyncio.get_running_loop()
                deadline = loop.time() + wait
                while True:
                    answer = await db.areserve(*scope)
                    if answer.status == "acquired":
                        lease = answer.lease
                        renewal = asyncio.ensure_future(_renew(lease, db.lease_timeout))
                        try:
                            value = await function(*args, **kwargs)
                        except BaseException as err:
                            renewal.cancel()
                            if on_error == "fail" and isinstance(err, Exception):
                                await lease.afail(repr(err).encode("utf-8", "replace"))
                            else:
                                await lease.arelease()
                            raise
                        renewal.cancel()
                        await lease.acomplete(encode(value))
                        return value
                    if answer.status != "in_flight":
                        return settled(answer)
                    left = deadline - loop.time()
                    if left <= 0:
                        raise InFlight("another call of the key is still running")
                    await db.await_finished(scope[0], scope[1], scope[2], left)

            return run_async

        @functools.wraps(function)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            import time

            scope = request_of(args, kwargs)
            deadline = time.monotonic() + wait
            while True:
                answer = db.reserve(*scope)
                if answer.status == "acquired":
                    lease = answer.lease
                    renewal = _Renewal(lease, db.lease_timeout)
                    try:
                        value = function(*args, **kwargs)
                    except BaseException as err:
                        renewal.stop()
                        ended(lease, err)
                        raise
                    renewal.stop()
                    lease.complete(encode(value))
                    return value
                if answer.status != "in_flight":
                    return settled(answer)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise InFlight("another call of the key is still running")
                db.wait_finished(scope[0], scope[1], scope[2], left)

        return run_sync

    return decorate
