"""The middleware in front of what apps put inside it (in process, httpx's ASGI
transport): a `BaseHTTPMiddleware`, which re-sends every answer in chunks; a streamed
answer; an app that ends with `CancelledError`."""

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

import oncedb
from oncedb.asgi import IdempotencyMiddleware

KEY = "key-0123456789abcdef"


def guarded(app):
    db = oncedb.Db(window=3600, bucket=60)
    return IdempotencyMiddleware(app, db=db, tenant=lambda scope: "t")


def send_all(app, requests):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            answers = []
            for path in requests:
                post = client.post(path, headers={"idempotency-key": KEY}, json={"a": 1})
                answers.append(await asyncio.wait_for(post, 10))
            return answers

    return asyncio.run(main())


def call_directly(app, path, headers, sent):
    """Calls `app` as a server does, with a body of `{}`: every message it sends goes to
    `sent`; returns once the call returns."""

    async def main():
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": b"{}", "more_body": False}
            await asyncio.Event().wait()

        async def send(message):
            sent.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "root_path": "",
            "query_string": b"",
            "headers": headers + [(b"content-length", b"2")],
            "client": ("127.0.0.1", 1),
            "server": ("test", 80),
        }
        await app(scope, receive, send)

    asyncio.run(main())


async def passing(request, call_next):
    return await call_next(request)


def test_a_base_http_middleware_inside_keeps_idempotency():
    calls = []

    async def things(request):
        calls.append(1)
        return JSONResponse({"call": len(calls)}, status_code=201)

    inner = Starlette(
        routes=[Route("/things", things, methods=["POST"])],
        middleware=[Middleware(BaseHTTPMiddleware, dispatch=passing)],
    )
    answers = send_all(guarded(inner), ["/things"] * 3)
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert [a.json() for a in answers] == [{"call": 1}] * 3
    assert [a.headers.get("idempotent-replayed") for a in answers] == [None, "true", "true"]
    assert len(calls) == 1, "the handler ran on a retry"


def test_a_streamed_answer_is_sent_whole_and_releases_the_key():
    async def stream(request):
        async def chunks():
            for n in range(5):
                await asyncio.sleep(0.02)  # a slow producer: the call must wait for it
                yield f"chunk {n}\n".encode()

        return StreamingResponse(chunks(), media_type="text/plain")

    inner = Starlette(routes=[Route("/stream", stream, methods=["POST"])])
    (answer,) = send_all(guarded(inner), ["/stream"])
    assert answer.text == "".join(f"chunk {n}\n" for n in range(5))
    # Called as a server calls it: the call returns only once the answer is complete (a
    # server closes a connection whose app returned mid-answer).
    sent = []
    headers = [(b"idempotency-key", b"key-stream-0123456789"), (b"content-type", b"application/json")]
    call_directly(guarded(inner), "/stream", headers, sent)
    bodies = [m for m in sent if m["type"] == "http.response.body"]
    assert bodies and not bodies[-1].get("more_body", False), "returned mid-answer"
    assert b"".join(m.get("body", b"") for m in bodies).count(b"chunk") == 5


def test_an_app_that_ends_with_cancelled_error_still_answers():
    async def cancelled(request):
        raise asyncio.CancelledError()

    inner = Starlette(routes=[Route("/cancelled", cancelled, methods=["POST"])])
    first, second = send_all(guarded(inner), ["/cancelled"] * 2)
    assert first.status_code == 500
    assert second.status_code == 500
    assert second.headers.get("idempotent-replayed") == "true"


def test_an_answer_over_the_stores_limit_is_stored_without_its_body():
    calls = []

    async def big(request):
        calls.append(1)
        # Under the middleware's 1 MiB, over the store's limit once encoded.
        return JSONResponse({"blob": "x" * ((1 << 20) - 12)}, status_code=201)

    inner = Starlette(routes=[Route("/big", big, methods=["POST"])])
    first, second = send_all(guarded(inner), ["/big"] * 2)
    assert first.status_code == 201 and len(first.content) > 1 << 19
    assert second.status_code == 201, "the retry did not learn the outcome"
    assert second.headers.get("idempotent-body-omitted") == "true"
    assert len(calls) == 1


def test_a_replay_without_its_body_says_its_own_length():
    async def big(request):
        return JSONResponse({"blob": "x" * 4096}, status_code=201)

    inner = Starlette(routes=[Route("/big", big, methods=["POST"])])
    db = oncedb.Db(window=3600, bucket=60)
    app = IdempotencyMiddleware(
        inner,
        db=db,
        tenant=lambda scope: "t",
        max_response_bytes=1024,
        replayed_headers=["content-type", "content-length"],
    )
    sent = []
    for _ in range(2):
        call_directly(app, "/big", [(b"idempotency-key", KEY.encode())], sent)
    starts = [m for m in sent if m["type"] == "http.response.start"]
    replay = dict(starts[-1]["headers"])
    assert replay[b"idempotent-body-omitted"] == b"true"
    assert replay[b"content-length"] == b"0", replay


def test_trailers_and_a_file_the_server_sends_pass_through_and_release_the_key():
    runs = []

    async def with_trailers(scope, receive, send):
        runs.append("trailers")
        await send({"type": "http.response.start", "status": 200, "headers": [], "trailers": True})
        await send({"type": "http.response.body", "body": b"data"})
        await send({"type": "http.response.trailers", "headers": [(b"checksum", b"abc")]})

    async def file_sent_by_the_server(scope, receive, send):
        runs.append("pathsend")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.pathsend", "path": "/srv/report.pdf"})

    headers = [(b"idempotency-key", KEY.encode()), (b"content-type", b"application/json")]
    for app, last in [(with_trailers, "http.response.trailers"), (file_sent_by_the_server, "http.response.pathsend")]:
        guarded_app = guarded(app)
        for _ in range(2):
            sent = []
            call_directly(guarded_app, "/things", headers, sent)
            assert [m["type"] for m in sent][-1] == last, sent
            assert sent[0]["type"] == "http.response.start"
            assert sent[0].get("trailers", False) == (app is with_trailers)
    # Nothing whole was stored: each retry ran the app again.
    assert runs == ["trailers", "trailers", "pathsend", "pathsend"]
