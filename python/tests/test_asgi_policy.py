"""The middleware's `server_errors` choices, in process (httpx's ASGI transport)."""

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import oncedb
from oncedb.asgi import IdempotencyMiddleware

KEY = "key-0123456789abcdef"


def app_with(server_errors):
    calls = []

    async def failing(request):
        calls.append(1)
        return PlainTextResponse("database down", status_code=500)

    app = Starlette(routes=[Route("/things", failing, methods=["POST"])])
    db = oncedb.Db(window=3600, bucket=60)
    wrapped = IdempotencyMiddleware(app, db=db, tenant=lambda scope: "t", server_errors=server_errors)
    return wrapped, calls


def twice(app):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            first = await client.post("/things", headers={"idempotency-key": KEY})
            second = await client.post("/things", headers={"idempotency-key": KEY})
            return first, second

    return asyncio.run(main())


def test_server_errors_store_release_or_keep_in_flight():
    app, calls = app_with("store")
    first, second = twice(app)
    assert (first.status_code, second.status_code, len(calls)) == (500, 500, 1)
    assert second.headers["idempotent-replayed"] == "true"
    app, calls = app_with("release")
    first, second = twice(app)
    assert (second.status_code, len(calls)) == (500, 2)
    app, calls = app_with("keep_in_flight")
    first, second = twice(app)
    assert (second.status_code, len(calls)) == (409, 1)
    assert second.json()["type"] == "urn:oncedb:problem:request_outcome_unknown"
    with pytest.raises(ValueError):
        app_with("sometimes")
