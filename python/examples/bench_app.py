"""The app `bench_asgi.py` serves: one POST route, with the middleware unless
`ONCEDB_BENCH_BARE=1`, over a store in `$ONCEDB_DIR` (`interval:10ms`)."""

import os

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse
from starlette.routing import Route

import oncedb
from oncedb.asgi import IdempotencyMiddleware


async def create(request):
    return JSONResponse({"ok": True, "body": (await request.body()).decode()}, status_code=201)


middleware = []
if os.environ.get("ONCEDB_BENCH_BARE") != "1":
    db = oncedb.Db(os.environ["ONCEDB_DIR"], durability="interval:10ms")
    middleware = [Middleware(IdempotencyMiddleware, db=db, tenant=lambda scope: "bench")]
app = Starlette(routes=[Route("/things", create, methods=["POST"])], middleware=middleware)
