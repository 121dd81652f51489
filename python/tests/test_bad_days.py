"""The middleware on bad days, in process (httpx's ASGI transport, or the ASGI calls by
hand): a cancelled request keeps its outcome, a disconnect mid-upload makes no record, a
failure to store never replaces the answer, streams pass through and release the key,
background tasks run after the answer, app exceptions follow `server_errors` with a
note, any body fingerprints, input errors are 400, credentials are never replayed, the
stored layout is the Rust layer's, and the options for keys, fingerprints and waiting."""

import asyncio
import json
import threading

import httpx
import pytest
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

import oncedb
from oncedb.asgi import IdempotencyMiddleware, decode_response, encode_response, fingerprint

KEY = "key-0123456789abcdef"
TENANT = "t"


def make(handler, db=None, **options):
    app = Starlette(routes=[Route("/things", handler, methods=["POST"])])
    db = db or oncedb.Db(window=3600, bucket=60)
    return IdempotencyMiddleware(app, db=db, tenant=lambda scope: TENANT, **options), db


def client(app):
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://test")


def test_a_cancelled_request_keeps_its_outcome():
    entered, gate, calls = asyncio.Event(), asyncio.Event(), []

    async def slow(request):
        calls.append(1)
        entered.set()
        await gate.wait()
        return PlainTextResponse("created", status_code=201)

    app, db = make(slow)

    async def main():
        async with client(app) as http:
            first = asyncio.ensure_future(http.post("/things", headers={"idempotency-key": KEY}))
            await entered.wait()
            first.cancel()  # a timeout middleware, a shutdown
            with pytest.raises(asyncio.CancelledError):
                await first
            gate.set()
            done = await oncedb.run(db.wait_finished, TENANT, "POST /things", KEY, 10)
            assert done is not None and done.status == "completed"
            retry = await http.post("/things", headers={"idempotency-key": KEY})
            return retry

    retry = asyncio.run(main())
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.text == "created" and len(calls) == 1


def test_a_disconnect_mid_upload_makes_no_record():
    calls = []

    async def handler(request):
        calls.append(await request.body())
        return PlainTextResponse("created", status_code=201)

    app, db = make(handler)
    messages = [
        {"type": "http.request", "body": b'{"amount":', "more_body": True},
        {"type": "http.disconnect"},
    ]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/things",
        "query_string": b"",
        "headers": [(b"idempotency-key", KEY.encode())],
    }
    asyncio.run(app(scope, receive, send))
    assert calls == [] and sent == []
    assert db.in_flight(0) == []
    assert db.reserve(TENANT, "POST /things", KEY, b"anything").status == "acquired"


def test_a_response_over_the_limit_is_answered_whole_and_replayed_without_its_body():
    big = b"x" * (2 << 20)

    async def handler(request):
        return Response(big, status_code=201, media_type="application/octet-stream")

    app, _ = make(handler)

    async def main():
        async with client(app) as http:
            first = await http.post("/things", headers={"idempotency-key": KEY})
            retry = await http.post("/things", headers={"idempotency-key": KEY})
            return first, retry

    first, retry = asyncio.run(main())
    assert first.status_code == 201 and first.content == big
    assert retry.status_code == 201 and retry.content == b""
    assert retry.headers["idempotent-body-omitted"] == "true"


def test_a_fenced_lease_never_replaces_the_answer_sent():
    async def handler(request):
        # A reconciler takes the record over while the handler runs.
        assert db.take_over(TENANT, "POST /things", KEY) is not None
        return PlainTextResponse("created", status_code=201)

    app, db = make(handler)

    async def main():
        async with client(app) as http:
            return await http.post("/things", headers={"idempotency-key": KEY})

    answer = asyncio.run(main())
    assert (answer.status_code, answer.text) == (201, "created")


def test_streams_pass_through_and_release_the_key():
    calls = []

    async def stream(request):
        calls.append(1)

        async def chunks():
            for n in range(3):
                yield f"chunk {n}\n"

        return StreamingResponse(chunks(), status_code=200)

    app, _ = make(stream)

    async def main():
        async with client(app) as http:
            first = await http.post("/things", headers={"idempotency-key": KEY})
            second = await http.post("/things", headers={"idempotency-key": KEY})
            return first, second

    first, second = asyncio.run(main())
    assert first.text == "chunk 0\nchunk 1\nchunk 2\n" == second.text
    assert "idempotent-replayed" not in second.headers
    assert len(calls) == 2


def test_background_tasks_run_after_the_answer_and_their_failure_keeps_it():
    gate = threading.Event()

    async def later():
        # Runs after the answer: the client already has it when the gate opens.
        await asyncio.get_running_loop().run_in_executor(None, gate.wait, 10)
        raise RuntimeError("the background task failed")

    entered = asyncio.Event()

    async def handler(request):
        entered.set()
        return PlainTextResponse("created", status_code=201, background=BackgroundTask(later))

    app, db = make(handler)

    async def main():
        async with client(app) as http:
            first = asyncio.ensure_future(http.post("/things", headers={"idempotency-key": KEY}))
            await entered.wait()
            # The record completes (and the answer goes out) before the background task.
            done = await oncedb.run(db.wait_finished, TENANT, "POST /things", KEY, 10)
            assert done is not None and done.status == "completed"
            gate.set()
            try:
                await first
            except RuntimeError:
                pass  # the transport re-raises the app's late exception
            return await http.post("/things", headers={"idempotency-key": KEY})

    retry = asyncio.run(main())
    assert (retry.status_code, retry.text) == (201, "created")
    assert retry.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize(
    "policy, retried",
    [("store", 500), ("release", 500), ("keep_in_flight", 409)],
)
def test_app_exceptions_follow_server_errors_with_a_note(policy, retried):
    calls = []

    async def broken(scope, receive, send):
        # A bare ASGI app: the exception reaches the middleware unanswered (a Starlette
        # app answers 500 first, which the middleware takes as the answer).
        calls.append(1)
        raise RuntimeError("database down")

    db = oncedb.Db(window=3600, bucket=60)
    app = IdempotencyMiddleware(broken, db=db, tenant=lambda scope: TENANT, server_errors=policy)

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = await http.post("/things", headers={"idempotency-key": KEY})
            notes = [r["note"] for r in db.in_flight(0)]
            second = await http.post("/things", headers={"idempotency-key": KEY})
            return first, notes, second

    first, notes, second = asyncio.run(main())
    assert first.status_code == 500
    assert second.status_code == retried
    if policy == "store":
        assert second.headers["idempotent-replayed"] == "true"
        assert len(calls) == 1
    if policy == "release":
        assert len(calls) == 2
    if policy == "keep_in_flight":
        assert notes and notes[0].startswith(b"service error: RuntimeError")
        assert second.json()["type"] == "urn:oncedb:problem:request_outcome_unknown"


def test_no_lock_is_held_across_a_gil_release(tmp_path):
    db = oncedb.Db(tmp_path / "db", durability="sync")
    lease = db.reserve(TENANT, "op", KEY, b"r").lease
    stop = threading.Event()

    def noting():
        while not stop.is_set():
            try:
                lease.note(b"still working")
            except oncedb.LeaseLost:
                return

    def ending():
        for _ in range(200):
            try:
                lease.complete(b"done")
            except (oncedb.LeaseLost, oncedb.Fenced):
                pass

    threads = [threading.Thread(target=noting), threading.Thread(target=ending)]
    for thread in threads:
        thread.start()
    threads[1].join(30)
    stop.set()
    threads[0].join(30)
    assert not any(thread.is_alive() for thread in threads), "a lease call hung"


def test_a_body_read_by_its_bytes_never_matches_a_json_request():
    # A text body whose bytes are a JSON request's fields form, or its canonical form, is
    # another request (422 on reuse), as in the Rust layer (RAW_BODY).
    json_print = fingerprint("POST", "/hooks", b"", "application/json", b'{"amount":5}', ["/amount"])
    text_print = fingerprint("POST", "/hooks", b"", "text/plain", b"/amount=5\n", ["/amount"])
    assert json_print != text_print
    assert fingerprint("POST", "/u", b"", "application/json", b'{"a":1}') != fingerprint(
        "POST", "/u", b"", "text/plain", b'{"a":1}'
    )
    assert fingerprint("POST", "/u", b"", "text/plain", b"a b") == b"POST /u\n\x00a b"


def test_any_body_fingerprints_without_raising():
    deep = b"[" * 100_000 + b"]" * 100_000
    surrogate = b'{"a":"\\ud800"}'
    for body in (deep, surrogate, b"\xff\xfe not utf-8"):
        print_ = fingerprint("POST", "/things", b"", "application/json", body)
        assert print_.endswith(body)
        assert fingerprint("POST", "/t", b"", "application/json", body, ["/a"]).endswith(body)

    async def handler(request):
        return PlainTextResponse("created", status_code=201)

    app, _ = make(handler)

    async def main():
        async with client(app) as http:
            return await http.post(
                "/things",
                content=deep,
                headers={"idempotency-key": KEY, "content-type": "application/json"},
            )

    assert asyncio.run(main()).status_code == 201


def test_input_errors_answer_400():
    async def handler(request):
        return PlainTextResponse("created", status_code=201)

    app = Starlette(routes=[Route("/{rest:path}", handler, methods=["POST"])])
    long_tenant = IdempotencyMiddleware(app, db=oncedb.Db(), tenant=lambda scope: "t" * 2000)
    plain = IdempotencyMiddleware(app, db=oncedb.Db(), tenant=lambda scope: TENANT)

    async def main():
        async with client(long_tenant) as http:
            tenant = await http.post("/things", headers={"idempotency-key": KEY})
        async with client(plain) as http:
            path = await http.post("/" + "p" * 2000, headers={"idempotency-key": KEY})
        return tenant, path

    tenant, path = asyncio.run(main())
    assert (tenant.status_code, tenant.json()["type"]) == (400, "urn:oncedb:problem:invalid_tenant")
    assert (path.status_code, path.json()["type"]) == (400, "urn:oncedb:problem:invalid_path")


def test_credentials_are_never_replayed():
    for header in ("set-cookie", "Authorization", "connection"):
        with pytest.raises(ValueError):
            make(lambda request: None, replayed_headers=("content-type", header))


def test_the_stored_layout_is_the_rust_layers():
    # The same bytes `src/http/stored.rs` asserts (`SHARED_WITH_PYTHON`).
    shared = bytes.fromhex(
        "02c900010c636f6e74656e742d7479706510006170706c69636174696f6e2f6a736f6e020000007b7d"
    )
    assert encode_response(201, [(b"content-type", b"application/json")], b"{}") == shared
    assert decode_response(shared) == (201, [(b"content-type", b"application/json")], b"{}")
    for damaged in (shared[:-1], shared + b"x", shared[:10]):
        with pytest.raises(ValueError):
            decode_response(damaged)


def test_keys_from_a_header_or_a_body_pointer_and_fields_fingerprints():
    calls = []

    async def hook(request):
        calls.append(1)
        return JSONResponse({"n": len(calls)}, status_code=200)

    by_header, _ = make(hook, key_header="webhook-id", fingerprint_pointers=["/amount"])
    by_body, _ = make(hook, key_pointer="/id", fingerprint_pointers=["/amount"])

    async def main():
        async with client(by_header) as http:
            h = {"webhook-id": "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W"}
            first = await http.post("/things", json={"amount": 5, "sent_at": 1}, headers=h)
            again = await http.post("/things", json={"amount": 5, "sent_at": 2}, headers=h)
            changed = await http.post("/things", json={"amount": 6}, headers=h)
        async with client(by_body) as http:
            event = {"id": "evt_1NG8Du2eZvKYlo2C", "amount": 5, "created": 1}
            b_first = await http.post("/things", json=event)
            b_again = await http.post("/things", json=dict(event, created=2))
            missing = await http.post("/things", json={"amount": 5})
        return first, again, changed, b_first, b_again, missing

    first, again, changed, b_first, b_again, missing = asyncio.run(main())
    assert again.headers["idempotent-replayed"] == "true" and again.json() == first.json()
    assert changed.status_code == 422
    assert b_again.headers["idempotent-replayed"] == "true" and b_again.json() == b_first.json()
    assert missing.status_code == 400
    assert len(calls) == 2
    with pytest.raises(ValueError):
        make(hook, key_pointer="id")


def test_a_retry_waits_for_the_first_attempt():
    entered, gate, calls = asyncio.Event(), asyncio.Event(), []

    async def slow(request):
        calls.append(1)
        entered.set()
        await gate.wait()
        return PlainTextResponse("created", status_code=201)

    app, db = make(slow, wait=10)

    async def main():
        async with client(app) as http:
            first = asyncio.ensure_future(http.post("/things", headers={"idempotency-key": KEY}))
            await entered.wait()
            retry = asyncio.ensure_future(http.post("/things", headers={"idempotency-key": KEY}))
            while db.stats()["outcome_waiters"] == 0:
                await asyncio.sleep(0)
            gate.set()
            return await first, await retry

    first, retry = asyncio.run(main())
    assert (first.status_code, retry.status_code) == (201, 201)
    assert retry.headers["idempotent-replayed"] == "true" and len(calls) == 1


def test_a_handler_reads_the_tenant_key_and_operation_id():
    from oncedb.asgi import idempotency_context

    async def handler(request):
        return JSONResponse(idempotency_context(request.scope))

    app, _ = make(handler)

    async def main():
        async with client(app) as http:
            return await http.post("/things", headers={"idempotency-key": KEY})

    context = asyncio.run(main()).json()
    assert context["key"] == KEY and context["tenant"] == TENANT
    assert context["operation_id"] == f"1:t12:POST /things{len(KEY)}:{KEY}"


def test_excluded_paths_and_optional_keys_pass_unguarded():
    calls = []

    async def handler(request):
        calls.append(await request.body())
        return PlainTextResponse("ok", status_code=201)

    app, _ = make(handler, required=False, exclude_paths=["/health"])

    async def main():
        async with client(app) as http:
            return await http.post("/things", content=b"body")

    assert asyncio.run(main()).status_code == 201
    assert calls == [b"body"]


def test_a_runtime_task_that_panics_settles_its_awaitable_with_an_error():
    # Without the settling guard the future stays pending: wait_for's limit would end it.
    async def main():
        with pytest.raises(oncedb.Error, match="panicked"):
            await asyncio.wait_for(oncedb._oncedb._awaitable_that_panics(), 30)

    asyncio.run(main())


def test_an_app_exception_reaches_the_server_after_the_stored_500():
    # Finding 6: with the default `server_errors="store"` the exception was stored as a
    # 500 and went no further, so the server's error handling (ServerErrorMiddleware,
    # Sentry, the server's own traceback) never saw it.
    calls = []

    async def broken(scope, receive, send):
        calls.append(1)
        raise RuntimeError("database down")

    db = oncedb.Db(window=3600, bucket=60)
    app = IdempotencyMiddleware(broken, db=db, tenant=lambda scope: TENANT)

    async def call():
        sent = []
        scope = {
            "type": "http", "method": "POST", "path": "/things", "raw_path": b"/things",
            "query_string": b"", "headers": [(b"idempotency-key", KEY.encode())],
            "scheme": "http", "server": ("test", 80), "client": ("test", 1), "root_path": "",
            "http_version": "1.1", "asgi": {"version": "3.0"},
        }
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)

        try:
            await app(scope, receive, send)
            return sent, None
        except RuntimeError as err:
            return sent, err

    first, raised = asyncio.run(call())
    assert str(raised) == "database down"
    assert first[0]["status"] == 500, "the stored 500 is sent before the exception goes on"
    again, raised_again = asyncio.run(call())
    assert raised_again is None, "a replay raises nothing"
    assert again[0]["status"] == 500
    assert (b"idempotent-replayed", b"true") in again[0]["headers"]
    assert len(calls) == 1
