"""`oncedb.PostgresStore` and `oncedb.RedisStore` against real servers started by the
tests: the reservation API of `Db`, blocking and awaitable; waiting for an outcome;
fencing; notes and renewals; the decorator and the middleware over them; the fork check;
an unreachable server answered as unavailable."""

import asyncio
import multiprocessing
import threading

import httpx
import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

import oncedb
import servers
from oncedb.asgi import IdempotencyMiddleware

OP = "charge"


def test_the_reservation_api_answers_as_the_embedded_store(shared):
    store, tenant = shared(), shared.tenant
    first = store.reserve(tenant, OP, "k1", b"request")
    assert first.status == "acquired" and first.lease is not None
    again = store.reserve(tenant, OP, "k1", b"request")
    assert again.status == "in_flight" and again.lease is None
    first.lease.complete(b"charged")
    replay = store.reserve(tenant, OP, "k1", b"request")
    assert (replay.status, replay.response) == ("completed", b"charged")
    assert store.reserve(tenant, OP, "k1", b"another request").status == "mismatch"
    with pytest.raises(oncedb.LeaseLost):
        first.lease.complete(b"twice")
    failed = store.reserve(tenant, OP, "k2", b"request").lease
    failed.fail(b"declined")
    answer = store.reserve(tenant, OP, "k2", b"request")
    assert (answer.status, answer.response) == ("failed", b"declined")
    released = store.reserve(tenant, OP, "k3", b"request").lease
    released.release()
    assert store.reserve(tenant, OP, "k3", b"request").status == "acquired"
    key = f"{tenant}-dedup"
    assert store.insert_many([key, key + "-2", key]) == [True, True, False]
    assert store.insert_if_absent(key) is False


def test_awaitables_wait_for_the_outcome(shared):
    store, tenant = shared(), shared.tenant

    async def main():
        first = await store.areserve(tenant, OP, "k", b"request")
        assert first.status == "acquired"
        waiting = asyncio.ensure_future(store.await_finished(tenant, OP, "k", 30))
        await first.lease.anote(b"calling the bank")
        noted = await store.areserve(tenant, OP, "k", b"request")
        assert (noted.status, noted.note) == ("in_flight", b"calling the bank")
        await first.lease.akeep_alive()
        await first.lease.acomplete(b"charged")
        done = await waiting
        assert (done.status, done.response) == ("completed", b"charged")
        assert await store.ainsert_if_absent(f"{tenant}-a") is True
        assert await store.ainsert_if_absent(f"{tenant}-a") is False
        assert await store.await_finished(tenant, OP, "never reserved", 5) is None

    asyncio.run(main())


def test_a_take_over_fences_the_old_lease(shared):
    store, tenant = shared(), shared.tenant
    old = store.reserve(tenant, OP, "k", b"request").lease
    new = store.take_over(tenant, OP, "k")
    assert new is not None and new.epoch > old.epoch
    with pytest.raises(oncedb.Fenced):
        old.complete(b"late")
    new.complete(b"done")
    assert store.take_over(tenant, OP, "k") is None
    assert [r for r in store.in_flight(0) if r["tenant"] == tenant.encode()] == []


def test_a_blocking_renewal_and_an_ending_of_one_lease_do_not_lose_it(shared):
    store, tenant = shared(lease_timeout=60), shared.tenant
    assert store.lease_timeout == 60
    lease = store.reserve(tenant, OP, "k", b"request").lease
    renewed, refused = threading.Event(), []

    def renew():
        while True:
            try:
                lease.keep_alive()
            except oncedb.Error as err:
                return refused.append(err)
            renewed.set()

    renewals = threading.Thread(target=renew)
    renewals.start()
    renewed.wait()
    lease.complete(b"done")  # waits for a renewal in progress, never finds the lease gone
    renewals.join()
    assert [type(err) for err in refused] == [oncedb.LeaseLost]
    assert store.reserve(tenant, OP, "k", b"request").response == b"done"


def test_the_decorator_runs_once_across_threads_and_tasks(shared):
    store, tenant = shared(lease_timeout=30), shared.tenant
    runs = []
    start = threading.Barrier(8)

    @oncedb.idempotent(store, tenant=tenant, operation="sync", key=lambda order: order, wait=30)
    def charge(order):
        runs.append(order)
        return {"order": order, "charged": True}

    def caller(answers):
        start.wait()
        answers.append(charge("o-1"))

    answers = []
    threads = [threading.Thread(target=caller, args=(answers,)) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert runs == ["o-1"] and answers == [{"order": "o-1", "charged": True}] * 8

    @oncedb.idempotent(store, tenant=tenant, operation="async", key=lambda order: order, wait=30)
    async def acharge(order):
        runs.append(order)
        return order.upper()

    async def main():
        return await asyncio.gather(*(acharge("o-2") for _ in range(8)))

    assert asyncio.run(main()) == ["O-2"] * 8 and runs == ["o-1", "o-2"]

    @oncedb.idempotent(store, tenant=tenant, operation="sync", key=lambda order, cents: order)
    def charge_cents(order, cents):
        runs.append(order)

    with pytest.raises(oncedb.Mismatch):
        charge_cents("o-1", 2)
    assert runs == ["o-1", "o-2"]


def _use_in_child(store, answers):
    try:
        store.reserve("t", OP, "k", b"r")
        answers.put("used")
    except oncedb.Error as err:
        answers.put(str(err))


def test_a_store_used_after_a_fork_refuses_at_once(shared):
    store = shared()
    context = multiprocessing.get_context("fork")
    answers = context.Queue()
    child = context.Process(target=_use_in_child, args=(store, answers))
    child.start()
    answer = answers.get(timeout=60)
    child.join()
    assert "forked" in answer


def test_the_middleware_answers_from_a_shared_store(shared):
    store, tenant, calls = shared(), shared.tenant, []

    async def handler(request):
        calls.append(1)
        return PlainTextResponse("created", status_code=201)

    app = Starlette(routes=[Route("/things", handler, methods=["POST"])])
    guarded = IdempotencyMiddleware(app, db=store, tenant=lambda scope: tenant)

    async def main():
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = await http.post("/things", headers={"idempotency-key": "key-0123456789abcdef"})
            retry = await http.post("/things", headers={"idempotency-key": "key-0123456789abcdef"})
            return first, retry

    first, retry = asyncio.run(main())
    assert (first.status_code, retry.status_code) == (201, 201), first.text
    assert retry.headers["idempotent-replayed"] == "true" and calls == [1]


def test_a_server_that_went_away_is_unavailable_and_answers_503(tmp_path):
    gen = servers.redis(tmp_path)
    url = next(gen)
    store = oncedb.RedisStore(url, window=60, response_timeout=1)
    gen.close()  # kills the server
    with pytest.raises(oncedb.Unavailable):
        store.reserve("t", OP, "k", b"r")

    async def handler(request):
        return PlainTextResponse("created", status_code=201)

    app = Starlette(routes=[Route("/things", handler, methods=["POST"])])
    guarded = IdempotencyMiddleware(app, db=store, tenant=lambda scope: "t")

    async def main():
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            return await http.post("/things", headers={"idempotency-key": "key-0123456789abcdef"})

    answer = asyncio.run(main())
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["type"].endswith("idempotency_store_unavailable")
    with pytest.raises(oncedb.Unavailable):
        oncedb.PostgresStore(f"postgres://oncedb@127.0.0.1:{servers.free_port()}/x", window=60)
