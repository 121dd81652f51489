"""The app `test_workers.py` runs under `uvicorn --workers 2`: each worker process opens
its own shared store (`$ONCEDB_TEST_STORE`, `postgres:<url>` or `redis:<url>`) after it
started, as a deployment does. The handler's side effect is a line in
`$ONCEDB_TEST_EFFECTS`; every request a worker serves is a line in `$ONCEDB_TEST_SEEN`,
so the test sees which workers took part."""

import asyncio
import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

import oncedb
from oncedb.asgi import IdempotencyMiddleware

kind, url = os.environ["ONCEDB_TEST_STORE"].split(":", 1)
if kind == "postgres":
    store = oncedb.PostgresStore(url, window=3600)
else:
    store = oncedb.RedisStore(url, window=3600, prefix=os.environ["ONCEDB_TEST_PREFIX"])


def line(path: str, text: str) -> None:
    with open(path, "a") as out:
        out.write(text + "\n")


async def charge(request):
    body = await request.json()
    line(os.environ["ONCEDB_TEST_EFFECTS"], f"{body['order']} {os.getpid()}")
    # The charge takes a while, so that duplicates arrive while it is in flight.
    await asyncio.sleep(0.2)
    return JSONResponse({"order": body["order"], "charged_by": os.getpid()}, status_code=201)


class Seen:
    """Notes the worker that serves each request, before the middleware answers it."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            line(os.environ["ONCEDB_TEST_SEEN"], str(os.getpid()))
        await self.app(scope, receive, send)


app = Starlette(
    routes=[Route("/charges", charge, methods=["POST"])],
    middleware=[
        Middleware(Seen),
        Middleware(IdempotencyMiddleware, db=store, tenant=lambda scope: "shop", wait=30),
    ],
)
