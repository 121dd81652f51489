"""An ``Idempotency-Key`` middleware for ASGI apps (Starlette, FastAPI) over an oncedb ``Db``.

    app.add_middleware(IdempotencyMiddleware, db=db, tenant=lambda scope: tenant_of(scope))

It follows the rules of the Rust layer (``docs/http.md``), answering with RFC 9457 problem
details (``application/problem+json``, ``type`` ``urn:oncedb:problem:<code>``):

- a guarded method (POST, PATCH) without a key: 400 ``idempotency_key_required``; two key
  header lines: 400 ``duplicate_idempotency_key``; a key outside 16..=255 visible ASCII
  characters (a quoted structured-field string is unquoted first): 400
  ``invalid_idempotency_key``;
- no tenant (``tenant(scope)`` returns ``None``): 401 ``unauthorized`` with
  ``WWW-Authenticate: Bearer``;
- a body over ``max_body_bytes``: 413 ``request_body_too_large``, from ``Content-Length``
  before anything is read, or once the stream passes the limit;
- the key with another fingerprint: 422 ``idempotency_key_reused``. The fingerprint is the
  method, path and query, and the body; a JSON body in a canonical form (members sorted at
  every depth, numbers kept as their source text, no insignificant whitespace), so a retry
  with reordered members matches;
- a retry while the first attempt runs: 409 ``request_in_progress`` with ``Retry-After``;
  after an attempt whose outcome is unknown (a noted record): 409
  ``request_outcome_unknown``; after the response aged out: 410
  ``idempotency_response_expired``;
- a retry after a finished attempt: the stored status, allow-listed headers and body byte
  for byte, plus ``Idempotent-Replayed: true``.

What the handler's answer does to the record: ``2xx`` and ``3xx`` complete it; ``401``,
``403``, ``408`` and ``429`` release it (a retry runs again); any other ``4xx`` fails it
(replayed); a ``5xx`` fails it too with ``server_errors="store"`` (the default), releases
it with ``"release"``, or leaves it in flight, noted ``HTTP <status>: outcome unknown``,
with ``"keep_in_flight"``. A handler that knows better marks its answer with
:func:`mark_side_effect`: ``"unknown"`` leaves the record in flight with that note (retries
get 409 ``request_outcome_unknown`` until a reconciler settles it), ``"not_performed"``
releases it. An exception leaves it in flight without a note. The
handler runs to the end even if the client goes away: its answer is buffered, stored,
then sent. The scope of a record is the tenant, and the method with the request path.
Every store call runs on a worker thread (``oncedb.run``), so the event loop never waits
on an fsync.
"""

from __future__ import annotations

import asyncio
import json
import struct
from typing import Any, Awaitable, Callable, Iterable, Optional

from . import Db, Error, Full, run

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

RELEASE_STATUSES = frozenset({401, 403, 408, 429})
SIDE_EFFECT = "oncedb.side_effect"


def mark_side_effect(scope: Scope, side_effect: str) -> None:
    """Marks the answer of the request of ``scope`` (``request.scope`` in Starlette and
    FastAPI): ``"unknown"`` (the side effect may or may not have happened: keep the
    record in flight for reconciliation) or ``"not_performed"`` (nothing happened: let a
    retry run)."""
    if side_effect not in ("unknown", "not_performed"):
        raise ValueError(f"side effect {side_effect!r}: 'unknown' or 'not_performed'")
    scope.setdefault("extensions", {})[SIDE_EFFECT] = side_effect
STORED_LAYOUT_VERSION = 1

TITLES = {
    "idempotency_key_required": "An Idempotency-Key header is required",
    "duplicate_idempotency_key": "Only one Idempotency-Key header is allowed",
    "invalid_idempotency_key": "The Idempotency-Key is not a valid key",
    "unauthorized": "Authentication is required",
    "request_body_too_large": "The request body is too large",
    "idempotency_key_reused": "The key was used with a different request",
    "request_in_progress": "A request with this key is still being processed",
    "request_outcome_unknown": "The first request with this key has an unknown outcome, awaiting reconciliation",
    "idempotency_response_expired": "The request with this key was processed; its response is no longer stored",
    "idempotency_store_full": "The idempotency store is full",
    "idempotency_store_error": "The idempotency store failed",
}


class _Number(str):
    """A JSON number, kept as its source text."""


def _canonical(value: Any) -> str:
    if isinstance(value, dict):
        members = sorted(value.items())
        return "{" + ",".join(f"{_canonical(k)}:{_canonical(v)}" for k, v in members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if isinstance(value, _Number):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return json.dumps(value)


def canonical_json(body: bytes) -> Optional[bytes]:
    """The canonical form of a JSON body, or ``None`` if it is not one JSON value."""
    try:
        value = json.loads(body, parse_float=_Number, parse_int=_Number)
    except ValueError:
        return None
    return _canonical(value).encode()


def fingerprint(method: str, path: str, query: bytes, content_type: str, body: bytes) -> bytes:
    """What a retry must repeat: method, path and query, and the (canonical JSON) body."""
    target = path + ("?" + query.decode("latin-1") if query else "")
    media = content_type.split(";")[0].strip().lower()
    if media == "application/json" or media.endswith("+json"):
        body = canonical_json(body) or body
    return f"{method} {target}\n".encode() + body


def encode_response(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The stored answer: version u8, status u16, header count u16, then per header its
    name and value each as u16 length + bytes, then the body (little-endian)."""
    headers = list(headers)
    out = [struct.pack("<BHH", STORED_LAYOUT_VERSION, status, len(headers))]
    for name, value in headers:
        out.append(struct.pack("<H", len(name)) + name + struct.pack("<H", len(value)) + value)
    out.append(body)
    return b"".join(out)


def decode_response(stored: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer ``encode_response`` stored; ``ValueError`` if it is not one."""
    try:
        version, status, count = struct.unpack_from("<BHH", stored, 0)
        if version != STORED_LAYOUT_VERSION:
            raise ValueError("unknown stored response version")
        at, headers = 5, []
        for _ in range(count):
            (name_len,) = struct.unpack_from("<H", stored, at)
            name = stored[at + 2 : at + 2 + name_len]
            at += 2 + name_len
            (value_len,) = struct.unpack_from("<H", stored, at)
            value = stored[at + 2 : at + 2 + value_len]
            at += 2 + value_len
            headers.append((name, value))
        return status, headers, stored[at:]
    except struct.error as err:
        raise ValueError(f"a stored response is cut short: {err}") from err


def _valid_key(raw: bytes) -> Optional[bytes]:
    key = raw.strip()
    if len(key) >= 2 and key[:1] == b'"' and key[-1:] == b'"':
        key = key[1:-1]
    if not 16 <= len(key) <= 255:
        return None
    if any(c < 0x21 or c > 0x7E or c in (0x22, 0x5C) for c in key):
        return None
    return key


class IdempotencyMiddleware:
    """The ``Idempotency-Key`` rules of ``docs/http.md`` around an ASGI app."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        db: Db,
        tenant: Callable[[Scope], Optional[str]],
        methods: Iterable[str] = ("POST", "PATCH"),
        max_body_bytes: int = 1 << 20,
        retry_after_seconds: int = 1,
        replayed_headers: Iterable[str] = ("content-type", "location"),
        server_errors: str = "store",
    ) -> None:
        if server_errors not in ("store", "release", "keep_in_flight"):
            raise ValueError(f"server_errors {server_errors!r}: 'store', 'release' or 'keep_in_flight'")
        self.server_errors = server_errors
        self.app = app
        self.db = db
        self.tenant = tenant
        self.methods = frozenset(m.upper() for m in methods)
        self.max_body_bytes = max_body_bytes
        self.retry_after = str(retry_after_seconds).encode()
        self.replayed = frozenset(h.lower().encode() for h in replayed_headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self.methods:
            await self.app(scope, receive, send)
            return
        keys = [v for k, v in scope["headers"] if k.lower() == b"idempotency-key"]
        if not keys:
            return await self._problem(send, 400, "idempotency_key_required")
        if len(keys) > 1:
            return await self._problem(send, 400, "duplicate_idempotency_key")
        key = _valid_key(keys[0])
        if key is None:
            return await self._problem(send, 400, "invalid_idempotency_key")
        tenant = self.tenant(scope)
        if not tenant:
            return await self._problem(send, 401, "unauthorized", [(b"www-authenticate", b"Bearer")])
        headers = {k.lower(): v for k, v in scope["headers"]}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return await self._problem(send, 413, "request_body_too_large")
        body = await self._read_body(receive)
        if body is None:
            return await self._problem(send, 413, "request_body_too_large")
        print_ = fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            headers.get(b"content-type", b"").decode("latin-1"),
            body,
        )
        operation = f"{scope['method']} {scope['path']}"
        try:
            answer = await run(self.db.reserve, tenant, operation, key, print_)
        except Full:
            return await self._problem(send, 503, "idempotency_store_full", self._retry())
        except Error:
            return await self._problem(send, 500, "idempotency_store_error")
        status = answer.status
        if status == "acquired":
            return await self._first_attempt(scope, body, answer.lease, send)
        if status in ("completed", "failed"):
            return await self._replay(send, answer.response or b"")
        if status == "in_flight":
            code = "request_outcome_unknown" if answer.note else "request_in_progress"
            return await self._problem(send, 409, code, self._retry())
        if status == "expired":
            return await self._problem(send, 410, "idempotency_response_expired")
        return await self._problem(send, 422, "idempotency_key_reused")

    def _retry(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", self.retry_after)]

    async def _read_body(self, receive: Receive) -> Optional[bytes]:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _first_attempt(self, scope: Scope, body: bytes, lease: Any, send: Send) -> None:
        """Runs the app detached from the client, stores its answer, then sends it."""
        outcome = asyncio.ensure_future(self._run_app(scope, body))
        # The client going away cancels this task, not the handler's.
        status, headers, content = await asyncio.shield(outcome)
        marked = scope.get("extensions", {}).get(SIDE_EFFECT)
        await self._finish(lease, status, headers, content, marked)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    async def _run_app(self, scope: Scope, body: bytes) -> tuple[int, list, bytes]:
        sent = {"body": False}
        finished = asyncio.Event()
        answer: dict[str, Any] = {"status": 500, "headers": [], "body": []}

        async def receive() -> Message:
            if not sent["body"]:
                sent["body"] = True
                return {"type": "http.request", "body": body, "more_body": False}
            await finished.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            if message["type"] == "http.response.start":
                answer["status"] = message["status"]
                answer["headers"] = list(message.get("headers", []))
            elif message["type"] == "http.response.body":
                answer["body"].append(message.get("body", b""))

        try:
            await self.app(scope, receive, send)
        finally:
            finished.set()
        return answer["status"], answer["headers"], b"".join(answer["body"])

    async def _finish(
        self, lease: Any, status: int, headers: list, content: bytes, marked: Optional[str]
    ) -> None:
        server_error = status >= 500
        if marked == "unknown" or (server_error and self.server_errors == "keep_in_flight"):
            # Left in flight with a note: the lease is dropped unfinished.
            await run(lease.note, f"HTTP {status}: outcome unknown".encode())
            return
        released = status in RELEASE_STATUSES or marked == "not_performed"
        if released or (server_error and self.server_errors == "release"):
            await run(lease.release)
            return
        kept = [(k.lower(), v) for k, v in headers if k.lower() in self.replayed]
        stored = encode_response(status, kept, content)
        if status < 400:
            await run(lease.complete, stored)
        else:
            await run(lease.fail, stored)

    async def _replay(self, send: Send, stored: bytes) -> None:
        status, headers, body = decode_response(stored)
        headers = headers + [(b"idempotent-replayed", b"true")]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _problem(
        self, send: Send, status: int, code: str, extra: Optional[list] = None
    ) -> None:
        body = json.dumps(
            {"type": f"urn:oncedb:problem:{code}", "title": TITLES[code], "status": status}
        ).encode()
        headers = [(b"content-type", b"application/problem+json")] + (extra or [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
