"""``oncedb.idempotent``: any function made once-only (see :func:`idempotent`)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
import threading
import time
from typing import Any, Callable, Optional, Union

from ._oncedb import Db, Error, Lease, Reservation, SharedStore


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


class _Renewal:
    """Renews a lease every third of the store's lease timeout on a thread of its own
    (the renewal waits on an fsync with the GIL released), until stopped."""

    def __init__(self, lease: Lease, timeout: Optional[float]) -> None:
        self.stopped = threading.Event()
        self.thread = None
        if timeout:
            self.thread = threading.Thread(target=self._loop, args=(lease, timeout / 3), daemon=True)
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


class _Once:
    """What :func:`idempotent` was given, and the calls of the functions it wraps."""

    def __init__(self, db: Union[Db, SharedStore], **given: Any) -> None:
        if given["on_error"] not in ("release", "fail"):
            raise ValueError(f"on_error {given['on_error']!r}: 'release' or 'fail'")
        self.db = db
        self.given = given

    def scope(self, args: tuple, kwargs: dict) -> tuple[str, str, Any, bytes]:
        """Tenant, operation, key and the fingerprinted payload of one call."""
        part = lambda value: value(*args, **kwargs) if callable(value) else value  # noqa: E731
        payload = (self.given["payload"] or _default_payload)(*args, **kwargs)
        request = json.dumps(payload, separators=(",", ":"), sort_keys=True, default=repr)
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
            raise Failed("the key's outcome is no longer stored")
        raise Mismatch("the key was used before with another payload")

    def failure(self, err: BaseException) -> Optional[bytes]:
        """What to store for an exception (``on_error="fail"``), or ``None`` to release."""
        if self.given["on_error"] == "fail" and isinstance(err, Exception):
            return repr(err).encode("utf-8", "replace")
        return None

    def call(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        scope = self.scope(args, kwargs)
        deadline = time.monotonic() + self.given["wait"]
        while True:
            answer = self.db.reserve(*scope)
            if answer.status == "acquired":
                return self.run(answer.lease, function, args, kwargs)
            if answer.status != "in_flight":
                return self.settled(answer)
            left = deadline - time.monotonic()
            if left <= 0:
                raise InFlight("another call of the key is still running")
            self.db.wait_finished(scope[0], scope[1], scope[2], left)

    def run(self, lease: Lease, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        renewal = _Renewal(lease, self.db.lease_timeout)
        try:
            value = function(*args, **kwargs)
        except BaseException as err:
            renewal.stop()
            stored = self.failure(err)
            lease.release() if stored is None else lease.fail(stored)
            raise
        renewal.stop()
        lease.complete(self.given["encode"](value))
        return value

    async def acall(self, function: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        # The awaitables: no thread is held while a call waits on a commit or an outcome.
        scope = self.scope(args, kwargs)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.given["wait"]
        while True:
            answer = await self.db.areserve(*scope)
            if answer.status == "acquired":
                return await self.arun(answer.lease, function, args, kwargs)
            if answer.status != "in_flight":
                return self.settled(answer)
            left = deadline - loop.time()
            if left <= 0:
                raise InFlight("another call of the key is still running")
            await self.db.await_finished(scope[0], scope[1], scope[2], left)

    async def arun(
        self, lease: Lease, function: Callable[..., Any], args: tuple, kwargs: dict
    ) -> Any:
        renewal = asyncio.ensure_future(_renew(lease, self.db.lease_timeout))
        try:
            value = await function(*args, **kwargs)
        except BaseException as err:
            renewal.cancel()
            stored = self.failure(err)
            await (lease.arelease() if stored is None else lease.afail(stored))
            raise
        renewal.cancel()
        await lease.acomplete(self.given["encode"](value))
        return value


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
      ``lease_timeout``, if it has one. An ``async def`` awaits the store without holding
      a thread.
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

    def decorate(function: Callable[..., Any]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                return await once.acall(function, args, kwargs)

            return run_async

        @functools.wraps(function)
        def run_sync(*args: Any, **kwargs: Any) -> Any:
            return once.call(function, args, kwargs)

        return run_sync

    return decorate
