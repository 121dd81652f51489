"""oncedb: embedded deduplication windows and idempotency records.

An in-process ``SET NX EX`` over a time window, and idempotency records scoped by
tenant and operation, bound to a request hash, with a processing / completed / failed
lifecycle, replayed responses, in-flight detection and fencing. Durable stores survive
``kill -9`` and (in ``"sync"`` mode) power loss without losing an acknowledged write.

Keys are ``bytes`` or ``str`` (``str`` is encoded as UTF-8, so ``"k"`` and ``b"k"`` are
the same key). Requests, responses and notes are ``bytes``.

Several worker processes share a :class:`PostgresStore` or a :class:`RedisStore`
(both :class:`SharedStore`): the same reservation API on a server, each call awaited
without a thread (``areserve``, ``await_finished``, ``lease.acomplete``, ...) or made
blocking with the GIL released. A ``Db`` belongs to the process that opened it.

Every call that may wait on an fsync releases the GIL: other threads run during a
commit, and a ``Db`` can be shared across threads. From asyncio, offload calls to a
thread so the event loop never waits on an fsync::

    admitted = await asyncio.to_thread(db.insert_if_absent, key)

(:func:`run` does exactly that.)
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, TypeVar

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
    PostgresStore,
    RedisStore,
    Reservation,
    SharedStore,
    StoreIoError,
    TimedOut,
    Unavailable,
    __version__,
)
from .once import Expired, Failed, InFlight, Mismatch, idempotent

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
    "PostgresStore",
    "RedisStore",
    "Reservation",
    "SharedStore",
    "StoreIoError",
    "TimedOut",
    "Unavailable",
    "Mismatch",
    "InFlight",
    "Failed",
    "Expired",
    "idempotent",
    "run",
    "__version__",
]

T = TypeVar("T")


async def run(call: Callable[..., T], *args: Any) -> T:
    """Runs a blocking oncedb call (``db.reserve``, ``lease.complete``, ...) on a worker
    thread, so that the event loop keeps running while it waits on an fsync."""
    return await asyncio.to_thread(call, *args)
