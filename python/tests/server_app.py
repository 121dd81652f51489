"""The app the middleware tests run under uvicorn: a Starlette route behind
`IdempotencyMiddleware` over a durable store at `$ONCEDB_TEST_DB`. `x-mode: wait` makes
the handler wait for `GET /open-gate`; `GET /started` answers once a handler is waiting;
`GET /calls` counts the handler's runs in this process."""

import asyncio
import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

import oncedb
from oncedb.asgi import IdempotencyMiddleware, mark_side_effect

calls = 0
gate = asyncio.Event()
started = asyncio.Event()


async def things(request):
    global calls
    calls += 1
    n = calls
    body = await request.body()
    if request.headers.get("x-mode") == "wait":
        started.set()
        await gate.wait()
    status = 422 if request.headers.get("x-mode") == "declined" else 201
    if request.headers.get("x-mode") == "rate_limited":
        status = 429
    if request.headers.get("x-mode") == "unknown":
        status = 502
        mark_side_effect(request.scope, "unknown")
    if request.headers.get("x-mode") == "nothing_happened":
        status = 503
        mark_side_effect(request.scope, "not_performed")
    if request.headers.get("x-mode") == "server_error":
        status = 500
    return JSONResponse(
        {"call": n, "body": body.decode()},
        status_code=status,
        headers={"location": "/things/1", "x-not-replayed": "1"},
    )


async def count(request):
    return PlainTextResponse(str(calls))


async def open_gate(request):
    gate.set()
    return PlainTextResponse("open")


async def wait_started(request):
    await started.wait()
    return PlainTextResponse("started")


def tenant(scope):
    for name, value in scope["headers"]:
        if name == b"authorization" and value.startswith(b"Bearer "):
            return value[len(b"Bearer ") :].decode()
    return None


db = oncedb.Db(os.environ["ONCEDB_TEST_DB"], durability="sync")
app = Starlette(
    routes=[
        Route("/things", things, methods=["POST"]),
        Route("/calls", count),
        Route("/open-gate", open_gate),
        Route("/started", wait_started),
    ],
    middleware=[Middleware(IdempotencyMiddleware, db=db, tenant=tenant, max_body_bytes=1024)],
)
