"""An ``Idempotency-Key`` middleware for ASGI apps (Starlette, FastAPI) over an oncedb ``Db`` or a shared store (PostgreSQL, Redis).

    app.add_middleware(IdempotencyMiddleware, db=db, tenant=lambda scope: tenant_of(scope))

It follows the rules of the Rust layer (``docs/http.md``), answering with RFC 9457 problem
details (``application/problem+json``, ``type`` ``urn:oncedb:problem:<code>``):

- a guarded method (POST, PATCH) without a key: 400 ``idempotency_key_required`` (with
  ``required=False`` the request passes unguarded); two key header lines: 400
  ``duplicate_idempotency_key``; a key outside 16..=255 visible ASCII characters (a quoted
  structured-field string is unquoted first): 400 ``invalid_idempotency_key``. The key
  comes from the ``Idempotency-Key`` header, another header (``key_header="webhook-id"``)
  or a JSON Pointer into the body (``key_pointer="/id"``);
- no tenant (``tenant(scope)`` returns ``None``): 401 ``unauthorized`` with
  ``WWW-Authenticate: Bearer``; a tenant or path too long to scope a record: 400
  ``invalid_tenant`` or ``invalid_path``;
- a body over ``max_body_bytes``: 413 ``request_body_too_large``, from ``Content-Length``
  before anything is read, or once the stream passes the limit; a client that disconnects
  before its whole body arrived gets no record (nothing is reserved or run);
- the key with another fingerprint: 422 ``idempotency_key_reused``. The fingerprint is the
  method, path and query, and the body (a JSON body in a canonical form: members sorted at
  every depth, numbers kept as their source text, no insignificant whitespace; any other
  body, or one too deep to read, as its bytes), or only the body fields that
  ``fingerprint_pointers`` name;
- a retry while the first attempt runs: with ``wait=<seconds>``, the first attempt's
  answer as soon as it ends; after the wait, or without one, 409 ``request_in_progress``
  with ``Retry-After``; after an attempt whose outcome is unknown (a noted record): 409
  ``request_outcome_unknown``; after the response aged out: 410
  ``idempotency_response_expired``;
- a retry after a finished attempt: the stored status, allow-listed headers and body byte
  for byte, plus ``Idempotent-Replayed: true``. The stored layout is the Rust layer's
  (``StoredResponse``), so either side replays the other's records.

What the handler's answer does to the record: ``2xx`` and ``3xx`` complete it; ``401``,
``403``, ``408`` and ``429`` release it (a retry runs again); any other ``4xx`` fails it
(replayed); a ``5xx`` fails it too with ``server_errors="store"`` (the default), releases
it with ``"release"``, or leaves it in flight, noted ``HTTP <status>: outcome unknown``,
with ``"keep_in_flight"``. A handler that knows better marks its answer with
:func:`mark_side_effect`. An exception in the app is noted (``service error: ...``) and
follows ``server_errors`` too: stored as a ``500`` (and answered so), released, or kept in
flight; in each case the exception then goes on to the server (with ``"store"``, after
the stored ``500`` is sent), so that the server's error handling and error reporters
see it. An app that ended with a ``CancelledError`` is answered and logged instead. An answer with a ``Content-Length`` within ``max_response_bytes`` is
collected whole however many messages carry it (a ``BaseHTTPMiddleware`` inside this one
re-sends every answer in chunks). A streaming answer (no ``Content-Length``, or over the
limit) is passed through as it comes and releases the key, so buffering is bounded by
``max_response_bytes``; the request ends when the stream does, and a client that went
away makes the app's next send fail, so an endless stream stops. An answer over the
limit is sent whole and stored without its body (``Idempotent-Body-Omitted: true`` on
replays). An app that ends with a ``BaseException`` (a ``CancelledError`` from a task it
awaited) is treated as a raised exception: the request still gets an answer.

The first attempt runs on a task of its own: a cancelled request (a timeout middleware, a
server shutting down, a client going away) never cancels the handler or the storing of its
answer, so a retry finds the outcome. The answer is sent once the handler sent its last
body message; background tasks then run without holding the client, and an exception they
raise no longer changes a stored answer. A failure to store the answer (a lease fenced or
lost, a poisoned store) is logged and never replaces the answer sent. The handler reads
the tenant, key and operation id with :func:`idempotency_context`. Every store call is an
awaitable that holds no thread (``areserve``, ``acomplete``, ``await_finished``, ...), so
the event loop never waits on an fsync.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import struct
from typing import Any, Awaitable, Callable, Iterable, Optional, Union

from . import Db, Error, Full, InvalidInput, SharedStore, TimedOut, Unavailable

Scope = dict
Message = dict
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

log = logging.getLogger("oncedb.asgi")

RELEASE_STATUSES = frozenset({401, 403, 408, 429})
SIDE_EFFECT = "oncedb.side_effect"
CONTEXT = "oncedb.idempotency"
#: The longest tenant and operation a record's scope takes (bytes), as in Rust.
MAX_SCOPE_PART_BYTES = 1024
#: Response headers never stored or replayed: credentials (a replay would hand one user's
#: session to another user of the tenant) and hop-by-hop headers. The Rust layer's list.
REFUSED_HEADERS = frozenset(
    {
        "set-cookie",
        "cookie",
        "authorization",
        "proxy-authorization",
        "www-authenticate",
        "proxy-authenticate",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
    }
)
#: The layout of a stored answer: the Rust layer's ``StoredResponse`` version 2.
STORED_LAYOUT_VERSION = 2
MAX_STORED_HEADERS = 32
MAX_HEADER_VALUE_BYTES = 8192


def mark_side_effect(scope: Scope, side_effect: str) -> None:
    """Marks the answer of the request of ``scope`` (``request.scope`` in Starlette and
    FastAPI): ``"unknown"`` (the side effect may or may not have happened: keep the
    record in flight for reconciliation) or ``"not_performed"`` (nothing happened: let a
    retry run)."""
    if side_effect not in ("unknown", "not_performed"):
        raise ValueError(f"side effect {side_effect!r}: 'unknown' or 'not_performed'")
    scope.setdefault("extensions", {})[SIDE_EFFECT] = side_effect


def idempotency_context(scope: Scope) -> Optional[dict]:
    """The guarded request's ``{"tenant", "operation", "key", "operation_id"}`` (the
    operation id is stable across retries of one key: send it downstream), or ``None`` for
    a request the middleware did not guard."""
    return scope.get("extensions", {}).get(CONTEXT)


TITLES = {
    "idempotency_key_required": "An idempotency key is required",
    "duplicate_idempotency_key": "Only one Idempotency-Key header is allowed",
    "invalid_idempotency_key": "The Idempotency-Key is not a valid key",
    "unauthorized": "Authentication is required",
    "invalid_tenant": "The tenant cannot scope an idempotency record",
    "invalid_path": "The path is too long to scope an idempotency record",
    "request_body_too_large": "The request body is too large",
    "idempotency_key_reused": "The key was used with a different request",
    "request_in_progress": "A request with this key is still being processed",
    "request_outcome_unknown": "The first request with this key has an unknown outcome, awaiting reconciliation",
    "idempotency_response_expired": "The request with this key was processed; its response is no longer stored",
    "idempotency_store_full": "The idempotency store is full",
    "idempotency_store_unavailable": "The idempotency store cannot be reached",
    "idempotency_store_busy": "The idempotency store is busy with this key",
    "idempotency_store_error": "The idempotency store failed",
    "internal_server_error": "The request failed",
}


class _Number(str):
    """A JSON number, kept as its source text."""


#: A string's JSON text as ``json.dumps(value, ensure_ascii=False)`` writes it, without
#: building an encoder per call.
_string_text: Callable[[str], str] = json.encoder.encode_basestring  # type: ignore[attr-defined]


def _canonical(value: Any) -> str:
    if isinstance(value, _Number):
        return str(value)
    if isinstance(value, str):
        return _string_text(value)
    if isinstance(value, dict):
        members = sorted(value.items())
        return "{" + ",".join(f"{_string_text(k)}:{_canonical(v)}" for k, v in members) + "}"
    if isinstance(value, list):
        return "[" + ",".join(_canonical(v) for v in value) + "]"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if value is None:
        return "null"
    return json.dumps(value)


def _read(body: bytes) -> Optional[tuple[Any, bytes]]:
    """The JSON value of ``body`` and its canonical form, read once; ``None`` if it is
    not one JSON value or cannot be read (too deep, a lone surrogate)."""
    try:
        value = json.loads(body, parse_float=_Number, parse_int=_Number)
        return value, _canonical(value).encode()
    except (ValueError, RecursionError, UnicodeError):
        return None


def canonical_json(body: bytes) -> Optional[bytes]:
    """The canonical form of a JSON body, or ``None`` if it is not one JSON value (or is
    too deep, or holds a lone surrogate)."""
    read = _read(body)
    return None if read is None else read[1]


_MISSING = object()


def json_pointer(value: Any, pointer: str) -> Any:
    """The value a JSON Pointer (RFC 6901) names in ``value``, or a private marker when it
    names none. ``ValueError`` for a string that is not a pointer."""
    if pointer == "":
        return value
    if not pointer.startswith("/") or any(
        not after.startswith(("0", "1")) for after in pointer.split("~")[1:]
    ):
        raise ValueError(f"{pointer!r} is not a JSON Pointer (RFC 6901)")
    for token in pointer.split("/")[1:]:
        token = token.replace("~1", "/").replace("~0", "~")
        if isinstance(value, dict) and token in value:
            value = value[token]
        elif (
            isinstance(value, list)
            and token.isdigit()
            and (token == "0" or not token.startswith("0"))
            and int(token) < len(value)
        ):
            value = value[int(token)]
        else:
            return _MISSING
    return value


RAW_BODY = b"\x00"
"""The byte before a body compared by its bytes (the Rust layer's ``RAW_BODY``): no
canonical JSON text and no ``pointer=value`` line starts with it, so a body not read as
JSON never has the fingerprint of one that is."""


def fingerprint(
    method: str,
    path: str,
    query: bytes,
    content_type: str,
    body: bytes,
    pointers: Optional[Iterable[str]] = None,
) -> bytes:
    """What a retry must repeat: method, path and query, and the (canonical JSON) body, or
    with ``pointers`` only the body fields they name (each ``pointer=value`` or
    ``pointer=-`` on a line), as the Rust layer's ``fields_request``. Never raises: a body
    that cannot be read as JSON counts by its bytes (after ``RAW_BODY``)."""
    read = _read(body) if media_is_json(content_type) or pointers is not None else None
    return _fingerprint(method, path, query, body, pointers, read)


def media_is_json(content_type: str) -> bool:
    """Whether a content type is JSON (``application/json`` or ``*+json``)."""
    media = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


def _fingerprint(
    method: str,
    path: str,
    query: bytes,
    body: bytes,
    pointers: Optional[Iterable[str]],
    read: Optional[tuple[Any, bytes]],
) -> bytes:
    """:func:`fingerprint` with the body already read (``read``: its JSON value and
    canonical form, or ``None`` for a body compared by its bytes)."""
    target = path + ("?" + query.decode("latin-1") if query else "")
    head = f"{method} {target}\n".encode()
    if read is None:
        return head + RAW_BODY + body
    value, canonical = read
    if pointers is None:
        return head + canonical
    lines = []
    for pointer in pointers:
        found = json_pointer(value, pointer)
        text = "-" if found is _MISSING else _canonical(found)
        lines.append(f"{pointer}={text}\n".encode())
    return head + b"".join(lines)


def encode_response(status: int, headers: Iterable[tuple[bytes, bytes]], body: bytes) -> bytes:
    """The stored answer, in the Rust layer's layout (``src/http/stored.rs``): version u8
    (2), status u16, header count u8, per header its name (u8 length, lowercase) and value
    (u16 length), then the body (u32 length), little-endian. Headers with a name over 255
    bytes or a value over 8 KiB are left out, and at most 32 are kept."""
    kept = [
        (name.lower(), value)
        for name, value in headers
        if len(name) <= 255 and len(value) <= MAX_HEADER_VALUE_BYTES
    ][:MAX_STORED_HEADERS]
    out = [struct.pack("<BHB", STORED_LAYOUT_VERSION, status, len(kept))]
    for name, value in kept:
        out.append(struct.pack("<B", len(name)) + name + struct.pack("<H", len(value)) + value)
    out.append(struct.pack("<I", len(body)) + body)
    return b"".join(out)


def decode_response(stored: bytes) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    """The answer ``encode_response`` (or the Rust layer) stored; ``ValueError`` if it is
    not one whole: a cut anywhere or bytes past the body are refused."""
    try:
        version, status, count = struct.unpack_from("<BHB", stored, 0)
        if version != STORED_LAYOUT_VERSION or count > MAX_STORED_HEADERS:
            raise ValueError("not a stored response of layout 2")
        at, headers = 4, []
        for _ in range(count):
            (name_len,) = struct.unpack_from("<B", stored, at)
            name = stored[at + 1 : at + 1 + name_len]
            at += 1 + name_len
            (value_len,) = struct.unpack_from("<H", stored, at)
            value = stored[at + 2 : at + 2 + value_len]
            if len(name) != name_len or len(value) != value_len:
                raise ValueError("a stored response is cut short")
            at += 2 + value_len
            headers.append((name, value))
        (body_len,) = struct.unpack_from("<I", stored, at)
        body = stored[at + 4 :]
        if len(body) != body_len:
            raise ValueError("a stored response's body is cut short or followed by bytes")
        return status, headers, body
    except struct.error as err:
        raise ValueError(f"a stored response is cut short: {err}") from err


#: A key: 16 to 255 visible ASCII characters but ``"`` and ``\\``.
_KEY = re.compile(rb"[\x21\x23-\x5b\x5d-\x7e]{16,255}")


def _valid_key(raw: bytes) -> Optional[bytes]:
    key = raw.strip()
    if len(key) >= 2 and key[:1] == b'"' and key[-1:] == b'"':
        key = key[1:-1]
    return key if _KEY.fullmatch(key) else None


class _Refused(Exception):
    """A request answered by the middleware itself (a problem), before any record."""

    def __init__(self, status: int, code: str, extra: Optional[list] = None) -> None:
        super().__init__(code)
        self.status, self.code, self.extra = status, code, extra or []


class _AppEnded(RuntimeError):
    """The app ended with a ``BaseException`` that is not an ``Exception`` (a
    ``CancelledError`` it awaited): answered as a failure, never raised on."""


class _Disconnected(Exception):
    """The client went away before its whole body arrived: nothing to answer."""


class IdempotencyMiddleware:
    """The ``Idempotency-Key`` rules of ``docs/http.md`` around an ASGI app."""

    def __init__(
        self,
        app: Callable[[Scope, Receive, Send], Awaitable[None]],
        db: Union[Db, SharedStore],
        tenant: Callable[[Scope], Optional[str]],
        methods: Iterable[str] = ("POST", "PATCH"),
        max_body_bytes: int = 1 << 20,
        retry_after_seconds: int = 1,
        replayed_headers: Iterable[str] = ("content-type", "location"),
        server_errors: str = "store",
        *,
        wait: float = 0.0,
        key_header: str = "idempotency-key",
        key_pointer: Optional[str] = None,
        fingerprint_pointers: Optional[Iterable[str]] = None,
        required: bool = True,
        exclude_paths: Iterable[str] = (),
        max_response_bytes: int = 1 << 20,
    ) -> None:
        if server_errors not in ("store", "release", "keep_in_flight"):
            raise ValueError(f"server_errors {server_errors!r}: 'store', 'release' or 'keep_in_flight'")
        replayed = [h.lower() for h in replayed_headers]
        refused = [h for h in replayed if h in REFUSED_HEADERS]
        if refused:
            raise ValueError(f"the header {refused[0]} must not be replayed")
        for pointer in [key_pointer or "/"] + list(fingerprint_pointers or []):
            json_pointer({}, pointer)
        if key_pointer == "":
            raise ValueError("key_pointer names a field of the body, such as '/id'")
        self.server_errors = server_errors
        self.app = app
        self.db = db
        self.tenant = tenant
        self.methods = frozenset(m.upper() for m in methods)
        self.max_body_bytes = max_body_bytes
        self.max_response_bytes = max_response_bytes
        self.retry_after = str(retry_after_seconds).encode()
        self.replayed = frozenset(h.encode() for h in replayed)
        self.wait = float(wait)
        self.key_header = key_header.lower().encode()
        self.key_pointer = key_pointer
        self.pointers = list(fingerprint_pointers) if fingerprint_pointers is not None else None
        self.required = required
        self.exclude_paths = frozenset(exclude_paths)
        # Tasks that outlive the request that started them (first attempts, orphaned
        # reservations): held here so that they are never collected while running.
        self._tasks: set[asyncio.Future] = set()

    def _keep(self, task: asyncio.Future) -> asyncio.Future:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or scope["method"] not in self.methods
            or scope["path"] in self.exclude_paths
        ):
            await self.app(scope, receive, send)
            return
        try:
            guarded = await self._admit(scope, receive)
        except _Refused as refused:
            return await self._problem(send, refused.status, refused.code, refused.extra)
        except _Disconnected:
            return
        if guarded is None:
            return await self.app(scope, receive, send)
        if isinstance(guarded, bytes):
            return await self.app(scope, _replaying(guarded), send)
        tenant, operation, key, body, print_ = guarded
        try:
            answer = await self._reserve(tenant, operation, key, print_)
        except _Refused as refused:
            return await self._problem(send, refused.status, refused.code, refused.extra)
        status = answer.status
        if status == "acquired":
            parts = (tenant, operation, key.decode())
            scope.setdefault("extensions", {})[CONTEXT] = {
                "tenant": tenant,
                "operation": operation,
                "key": key.decode(),
                # As the Rust layer's `IdempotencyContext::operation_id`: each part
                # prefixed with its length in bytes.
                "operation_id": "".join(f"{len(p.encode())}:{p}" for p in parts),
            }
            return await self._first_attempt(scope, body, answer.lease, send)
        if status in ("completed", "failed"):
            return await self._replay(send, answer.response or b"")
        if status == "in_flight":
            code = "request_outcome_unknown" if answer.note else "request_in_progress"
            return await self._problem(send, 409, code, self._retry())
        if status == "expired":
            return await self._problem(send, 410, "idempotency_response_expired")
        return await self._problem(send, 422, "idempotency_key_reused")

    async def _admit(self, scope: Scope, receive: Receive) -> Any:
        """The request's tenant, operation, key, body and fingerprint; ``None`` for a
        request without a key that passes unguarded (its body not read), or the body read
        for one passing unguarded after it; ``_Refused`` or ``_Disconnected`` else."""
        header_key = None
        if self.key_pointer is None:
            keys = [v for k, v in scope["headers"] if k.lower() == self.key_header]
            if not keys:
                if self.required:
                    raise _Refused(400, "idempotency_key_required")
                return None
            if len(keys) > 1:
                raise _Refused(400, "duplicate_idempotency_key")
            header_key = _valid_key(keys[0])
            if header_key is None:
                raise _Refused(400, "invalid_idempotency_key")
        tenant = self.tenant(scope)
        if not tenant:
            raise _Refused(401, "unauthorized", [(b"www-authenticate", b"Bearer")])
        if len(tenant.encode()) > MAX_SCOPE_PART_BYTES:
            raise _Refused(400, "invalid_tenant")
        operation = f"{scope['method']} {scope['path']}"
        if len(operation.encode()) > MAX_SCOPE_PART_BYTES:
            raise _Refused(400, "invalid_path")
        headers = {k.lower(): v for k, v in scope["headers"]}
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise _Refused(413, "request_body_too_large")
        body = await self._read_body(receive)
        # The body is read as JSON once, for the key and the fingerprint both.
        json_body = media_is_json(headers.get(b"content-type", b"").decode("latin-1"))
        fields = self.pointers is not None
        read = _read(body) if json_body or fields or self.key_pointer is not None else None
        key = header_key if header_key is not None else self._body_key(read)
        if key is None:
            if self.required:
                raise _Refused(400, "idempotency_key_required")
            return body
        print_ = _fingerprint(
            scope["method"],
            scope["path"],
            scope.get("query_string", b""),
            body,
            self.pointers,
            read if json_body or fields else None,
        )
        return tenant, operation, key, body, print_

    def _body_key(self, read: Optional[tuple[Any, bytes]]) -> Optional[bytes]:
        """The key ``key_pointer`` names in the body read as JSON; ``None`` if the body is
        not JSON or the pointer names no string or number; ``_Refused`` for one that is
        not a valid key."""
        if read is None:
            return None
        found = json_pointer(read[0], self.key_pointer or "")
        if found is _MISSING or isinstance(found, (dict, list, bool)) or found is None:
            return None
        key = _valid_key(str(found).encode("utf-8", "replace"))
        if key is None:
            raise _Refused(400, "invalid_idempotency_key")
        return key

    async def _reserve(self, tenant: str, operation: str, key: bytes, print_: bytes) -> Any:
        """Reserves the key, waiting up to ``wait`` for an attempt in flight to end. The
        reservation runs on a task of its own: a request cancelled meanwhile releases the
        key it acquired, so no key is left held by a handler that never ran."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        while True:
            reserving = self._keep(
                asyncio.ensure_future(self.db.areserve(tenant, operation, key, print_))
            )
            try:
                answer = await asyncio.shield(reserving)
            except asyncio.CancelledError:
                reserving.add_done_callback(self._release_orphan)
                raise
            except Error as err:
                raise self._store_error(err)
            left = deadline - loop.time()
            if answer.status != "in_flight" or answer.note or left <= 0:
                return answer
            try:
                await self.db.await_finished(tenant, operation, key, left)
            except Error as err:
                raise self._store_error(err)

    def _store_error(self, err: Error) -> _Refused:
        """The answer to a store's refusal, as the Rust layer gives it."""
        if isinstance(err, Full):
            return _Refused(503, "idempotency_store_full", self._retry())
        if isinstance(err, Unavailable):
            return _Refused(503, "idempotency_store_unavailable", self._retry())
        if isinstance(err, TimedOut):
            return _Refused(503, "idempotency_store_busy", self._retry())
        if isinstance(err, InvalidInput):
            return _Refused(400, "invalid_idempotency_key")
        return _Refused(500, "idempotency_store_error")

    def _release_orphan(self, reserving: asyncio.Future) -> None:
        if reserving.cancelled() or reserving.exception() is not None:
            return
        answer = reserving.result()
        if answer.status == "acquired":
            self._keep(asyncio.ensure_future(answer.lease.arelease()))

    def _retry(self) -> list[tuple[bytes, bytes]]:
        return [(b"retry-after", self.retry_after)]

    async def _read_body(self, receive: Receive) -> bytes:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _Refused(413, "request_body_too_large")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def _first_attempt(self, scope: Scope, body: bytes, lease: Any, send: Send) -> None:
        """Runs the app and finishes the lease on a task of its own (a cancel of this
        request reaches neither), then sends the answer, unless the app streamed it."""
        attempt = self._keep(asyncio.ensure_future(self._attempt(scope, body, lease, send)))
        answer = await asyncio.shield(attempt)
        if answer is None:
            return
        status, headers, content, raised = answer
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": content})
        if raised is not None:
            # The stored 500 is sent; the server and the error reporters around this
            # middleware (Starlette's `ServerErrorMiddleware`, Sentry) see the exception.
            raise raised

    async def _attempt(self, scope: Scope, body: bytes, lease: Any, send: Send) -> Any:
        call = _AppCall(self.app, scope, body, send, self.max_response_bytes)
        try:
            answer = await call.answered()
        except Exception as err:  # noqa: BLE001 - any app failure follows the policy
            return await self._failed(lease, err)
        if answer is None:
            # Streamed to the client as it came: nothing whole to store. The request
            # ends when the stream does (a server closes a connection whose app returned
            # mid-answer).
            await self._safely(lease.arelease)
            await call.finished()
            return None
        status, headers, content = answer
        marked = scope.get("extensions", {}).get(SIDE_EFFECT)
        await self._finish(lease, status, headers, content, marked)
        return status, headers, content, None

    async def _failed(self, lease: Any, err: Exception) -> Any:
        """An app that raised before answering: noted, then per ``server_errors``; the
        exception goes on to the server (after the stored ``500`` is sent, with
        ``"store"``), so that its error handling sees it. An app that ended with a
        ``CancelledError`` or another ``BaseException`` is logged instead: the server
        would take that for its own request being cancelled."""
        note = f"service error: {err!r}".encode("utf-8", "replace")[:1024]
        await self._safely(lease.anote, note)
        raised: Optional[Exception] = err
        if isinstance(err, _AppEnded):
            log.error("oncedb: the app ended before answering: %s", err)
            raised = None
        if self.server_errors == "store":
            status, headers, content = _problem_parts(500, "internal_server_error", [])
            await self._safely(lease.afail, encode_response(status, headers, content))
            return status, headers, content, raised
        if self.server_errors == "release":
            await self._safely(lease.arelease)
        raise err

    async def _safely(self, call: Callable[..., Awaitable[Any]], *args: Any) -> bool:
        """Awaits a lease call; a failure is logged, never raised (an answer is on its way)."""
        try:
            await call(*args)
            return True
        except Error as err:
            log.warning("oncedb: %s failed: %s", getattr(call, "__name__", "a lease call"), err)
            return False

    async def _finish(
        self, lease: Any, status: int, headers: list, content: bytes, marked: Optional[str]
    ) -> None:
        server_error = status >= 500
        if marked == "unknown" or (server_error and self.server_errors == "keep_in_flight"):
            # Left in flight with a note: the lease is dropped unfinished.
            await self._safely(lease.anote, f"HTTP {status}: outcome unknown".encode())
            return
        released = status in RELEASE_STATUSES or marked == "not_performed"
        if released or (server_error and self.server_errors == "release"):
            await self._safely(lease.arelease)
            return
        kept = [(k.lower(), v) for k, v in headers if k.lower() in self.replayed]
        omitted = kept + [(b"idempotent-body-omitted", b"true")]
        end = lease.acomplete if status < 400 else lease.afail
        if len(content) > self.max_response_bytes:
            await self._safely(end, encode_response(status, omitted, b""))
            return
        try:
            await end(encode_response(status, kept, content))
        except InvalidInput:
            # Over the store's own limit once encoded (status, headers, body): the
            # refused end kept the lease, so the answer is stored without its body, and
            # a retry learns the outcome instead of a 409 for the whole window.
            await self._safely(end, encode_response(status, omitted, b""))
        except Error as err:
            log.warning("oncedb: storing the answer failed: %s", err)

    async def _replay(self, send: Send, stored: bytes) -> None:
        try:
            status, headers, body = decode_response(stored)
        except ValueError:
            return await self._problem(send, 500, "idempotency_store_error")
        # The length is the replayed body's: a stored one may be the omitted body's.
        headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
        headers += [
            (b"content-length", str(len(body)).encode()),
            (b"idempotent-replayed", b"true"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def _problem(
        self, send: Send, status: int, code: str, extra: Optional[list] = None
    ) -> None:
        status, headers, body = _problem_parts(status, code, extra or [])
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _problem_parts(status: int, code: str, extra: list) -> tuple[int, list, bytes]:
    body = json.dumps(
        {"type": f"urn:oncedb:problem:{code}", "title": TITLES[code], "status": status}
    ).encode()
    return status, [(b"content-type", b"application/problem+json")] + extra, body


def _replaying(body: bytes) -> Receive:
    """A ``receive`` that hands the app the body already read, then waits."""
    sent = False

    async def receive() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()
        return {"type": "http.disconnect"}

    return receive


class _AppCall:
    """One run of the app on a task of its own, its answer collected: whole, when its
    last body message came (the app may run on, with background tasks, whose failures
    are logged), or streamed straight to the client when the app sends its body in
    several messages or more than ``limit`` bytes of it."""

    def __init__(self, app: Any, scope: Scope, body: bytes, send: Send, limit: int) -> None:
        self.body, self.client, self.limit = body, send, limit
        self.status, self.headers, self.chunks, self.size = 500, [], [], 0
        self.streaming = False
        #: The app's ``http.response.start``, forwarded as sent (its ``trailers`` flag too).
        self.start: Message = {}
        #: The answer's ``content-length``: a body of known length within the limit is
        #: collected whole across any number of messages (a ``BaseHTTPMiddleware`` re-sends
        #: every answer in chunks, then an empty last one).
        self.length: Optional[int] = None
        self.done = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.answer: asyncio.Future = loop.create_future()
        self.task = asyncio.ensure_future(self._run(app, scope))

    async def answered(self) -> Any:
        """``(status, headers, body)`` once the app answered whole; ``None`` once it
        streamed its answer; the app's exception if it raised before answering."""
        return await self.answer

    async def finished(self) -> None:
        """Waits until the app's run ended (a streamed answer was sent whole)."""
        await asyncio.wait([self.task])

    async def _run(self, app: Any, scope: Scope) -> None:
        try:
            await app(scope, _replaying(self.body), self._send)
            if not self.answer.done():
                self.answer.set_result((self.status, self.headers, b"".join(self.chunks)))
        except BaseException as err:  # noqa: BLE001 - a cancelled await in the app too
            failure = err
            if not isinstance(err, Exception):
                # A `CancelledError` (the app awaited a task something else cancelled) or
                # another `BaseException`: the request still gets an answer.
                failure = _AppEnded(f"the app ended with {err!r}")
            if not self.answer.done():
                self.answer.set_exception(failure)
            else:
                log.warning("oncedb: the app raised after it answered: %r", err)
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise

    async def _send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.start = message
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
            for name, value in self.headers:
                if name.lower() == b"content-length" and value.strip().isdigit():
                    self.length = int(value)
            return
        if self.streaming:
            await self._forward(message)
            return
        if kind == "http.response.pathsend":
            # A file the server sends itself (the `http.response.pathsend` extension):
            # nothing whole to store, so it passes through and the key is released.
            await self._stream_from(message)
            return
        if kind != "http.response.body":
            return
        chunk, more = message.get("body", b""), message.get("more_body", False)
        self.size += len(chunk)
        trailers = bool(self.start.get("trailers", False))
        if more and not trailers and self.length is not None and self.size <= min(self.length, self.limit):
            # A body of known length sent in several messages: collected whole.
            self.chunks.append(chunk)
            return
        if more or trailers:
            # A stream, or an answer with trailers (which are not stored): what came so
            # far goes out, then the rest as it comes.
            await self._stream_from({"type": "http.response.body", "body": b"".join(self.chunks) + chunk, "more_body": more})
            return
        self.chunks.append(chunk)
        if not self.answer.done():
            self.answer.set_result((self.status, self.headers, b"".join(self.chunks)))

    async def _stream_from(self, message: Message) -> None:
        """Turns the answer into a stream: the start as the app sent it, then `message`,
        then every message after as it comes."""
        self.streaming = True
        if not self.answer.done():
            self.answer.set_result(None)
        start = self.start or {"type": "http.response.start", "status": self.status, "headers": self.headers}
        await self._forward(start)
        await self._forward(message)

    async def _forward(self, message: Message) -> None:
        try:
            await self.client(message)
        except Exception as err:
            # The client went away: the app's send fails, as the server's would, so an
            # endless stream (server-sent events) stops.
            log.debug("oncedb: the client went away mid-stream: %r", err)
            raise
