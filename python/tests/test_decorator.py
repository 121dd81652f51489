"""`oncedb.idempotent` on `def` and `async def`, and a `Db` used after a fork."""

import asyncio
import os
import threading
import time

import pytest

import oncedb


def counting(db, **options):
    calls = []

    @oncedb.idempotent(
        db,
        tenant="t",
        operation=lambda order, amount: f"charge:{order}",
        key=lambda order, amount: order,
        payload=lambda order, amount: {"amount": amount},
        **options,
    )
    def charge(order, amount):
        calls.append((order, amount))
        if amount < 0:
            raise ValueError("a negative amount")
        return {"charged": amount, "call": len(calls)}

    return charge, calls


def test_a_function_runs_once_per_key_and_retries_get_its_value():
    db = oncedb.Db()
    charge, calls = counting(db)
    assert charge("o-1", 5) == {"charged": 5, "call": 1}
    assert charge("o-1", 5) == {"charged": 5, "call": 1}
    assert len(calls) == 1
    with pytest.raises(oncedb.Mismatch):
        charge("o-1", 6)
    assert charge("o-2", 5) == {"charged": 5, "call": 2}


def test_an_exception_releases_the_key_or_is_stored():
    db = oncedb.Db()
    charge, calls = counting(db)
    for _ in range(2):
        with pytest.raises(ValueError):
            charge("o-3", -1)
    assert len(calls) == 2, "a released key runs again"
    failing, failed_calls = counting(db, on_error="fail")
    with pytest.raises(ValueError):
        failing("o-4", -1)
    with pytest.raises(oncedb.Failed, match="a negative amount"):
        failing("o-4", -1)
    assert len(failed_calls) == 1
    with pytest.raises(ValueError):
        counting(db, on_error="sometimes")


def test_a_call_in_flight_waits_for_the_outcome_or_raises_in_flight():
    db = oncedb.Db()
    entered, gate = threading.Event(), threading.Event()

    @oncedb.idempotent(db, tenant="t", operation="slow", key=lambda n: n, wait=30)
    def slow(n):
        entered.set()
        gate.wait(30)
        return n * 2

    first = threading.Thread(target=slow, args=("k",))
    first.start()
    entered.wait(30)
    answers = []
    waiter = threading.Thread(target=lambda: answers.append(slow("k")))
    waiter.start()
    while db.stats()["outcome_waiters"] == 0:
        threading.Event().wait(0.001)
    gate.set()
    first.join(30)
    waiter.join(30)
    assert answers == ["kk"]

    @oncedb.idempotent(db, tenant="t", operation="busy", key=lambda n: n, wait=0.2)
    def busy(n):
        return n

    lease = db.reserve("t", "busy", "b", b'{"n":"b"}').lease
    with pytest.raises(oncedb.InFlight):
        busy("b")
    lease.release()
    assert busy("b") == "b"


def test_async_functions_run_once_and_renew_their_lease():
    db = oncedb.Db(lease_timeout=0.3)
    calls = []

    @oncedb.idempotent(db, tenant="t", operation="async", key=lambda n: n, wait=0.2)
    async def work(n):
        calls.append(n)
        # Longer than the lease timeout: renewed meanwhile, so never taken over.
        await asyncio.sleep(1.0)
        return n

    async def main():
        first = asyncio.ensure_future(work("a"))
        await asyncio.sleep(0.7)
        with pytest.raises(oncedb.InFlight):
            await work("a")
        return await first, await work("a")

    assert asyncio.run(main()) == ("a", "a")
    assert calls == ["a"]


def test_a_db_used_after_a_fork_refuses_at_once(tmp_path):
    db = oncedb.Db(tmp_path / "db")
    lease = db.reserve("t", "op", "k", b"r").lease
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            db.insert_if_absent(b"x")
        except oncedb.Error as err:
            code = 0 if "forked" in str(err) else 2
        try:
            lease.complete(b"done")
            code = 3
        except oncedb.Error:
            pass
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert db.insert_if_absent(b"x")
    lease.complete(b"done")


def test_the_version_is_the_packages():
    assert oncedb.__version__ == "0.1.0"


def test_awaitables_complete_from_the_commit_without_threads(tmp_path):
    db = oncedb.Db(tmp_path / "db", durability="sync")

    async def main():
        threads_before = threading.active_count()
        answers = await asyncio.gather(*(db.areserve("t", "op", f"k{n}", b"r") for n in range(200)))
        assert all(a.status == "acquired" for a in answers)
        threads_during = threading.active_count()
        await asyncio.gather(*(a.lease.acomplete(b"done") for a in answers))
        again = await db.areserve("t", "op", "k7", b"r")
        assert (again.status, again.response) == ("completed", b"done")
        assert await db.ainsert_if_absent(b"x") and not await db.ainsert_if_absent(b"x")
        # Woken by the ending; a missing record answers at once.
        held = (await db.areserve("t", "op", "held", b"r")).lease
        waiting = asyncio.ensure_future(db.await_finished("t", "op", "held", 30))
        while db.stats()["outcome_waiters"] == 0:
            await asyncio.sleep(0)
        await held.acomplete(b"late")
        assert (await waiting).response == b"late"
        assert await db.await_finished("t", "op", "none", 30) is None
        # A refused end changes nothing: the lease is kept.
        big = (await db.areserve("t", "op", "big", b"r")).lease
        with pytest.raises(oncedb.InvalidInput):
            await big.acomplete(b"x" * (2 << 20))
        await big.arelease()
        with pytest.raises(oncedb.LeaseLost):
            await big.arelease()
        return threads_before, threads_during

    before, during = asyncio.run(main())
    # One runtime thread at most, however many calls wait.
    assert during <= before + 1


def test_a_result_that_cannot_be_encoded_fails_the_key_and_does_not_run_again():
    class Opaque:
        pass

    db = oncedb.Db()
    calls = []

    @oncedb.idempotent(db, tenant="t", operation="stamp", key=lambda order: order)
    def stamp(order):
        calls.append(order)
        return {"at": Opaque()}

    with pytest.raises(TypeError, match="could not be encoded.*no stored form"):
        stamp("o-1")
    # The side effect happened: a retry is told so, and does not run the function.
    with pytest.raises(oncedb.Failed, match="could not be encoded"):
        stamp("o-1")
    assert calls == ["o-1"]


def test_a_call_cancelled_after_its_side_effect_is_not_run_again():
    db = oncedb.Db()
    calls = []
    started = None

    @oncedb.idempotent(db, tenant="t", operation="slow", key=lambda order: order)
    async def slow(order):
        calls.append(order)
        started.set()
        await asyncio.Event().wait()  # the provider never answers
        return "done"

    async def scenario():
        nonlocal started
        started = asyncio.Event()
        task = asyncio.ensure_future(slow("o-1"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The note is written by a task of its own: let it run, then retry.
        for _ in range(100):
            answer = await db.areserve("t", "slow", "o-1", b'{"order":"o-1"}')
            if answer.status == "in_flight" and answer.note:
                break
            await asyncio.sleep(0.01)
        assert answer.status == "in_flight" and answer.note.endswith(b"outcome unknown")
        with pytest.raises(oncedb.InFlight):
            await slow("o-1")

    asyncio.run(scenario())
    assert calls == ["o-1"], "the retry ran the cancelled call's side effect again"


def test_the_default_fingerprint_is_one_form_in_every_process():
    import subprocess
    import sys

    db = oncedb.Db()
    calls = []

    @oncedb.idempotent(db, tenant="t", operation="charge", key=lambda order, amount=0: order)
    def charge(order, amount=0):
        calls.append(order)
        return amount

    # Positional or keyword, one payload.
    assert charge("o-1", 5) == 5
    assert charge("o-1", amount=5) == 5
    assert calls == ["o-1"]

    # A set fingerprints alike whatever the hash seed of the process.
    program = (
        "import json, oncedb.once as o\n"
        "print(json.dumps({'s': {'b', 'a', 'c', 'd', 'e'}}, sort_keys=True, default=o._canonical))"
    )
    printed = {
        subprocess.run(
            [sys.executable, "-c", program],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in range(1, 6)
    }
    assert len(printed) == 1, printed

    # An object whose repr may hold its address is refused before the function runs.
    class Row:
        pass

    @oncedb.idempotent(db, tenant="t", operation="row", key=lambda row: "r")
    def save(row):
        calls.append("row")

    with pytest.raises(TypeError, match="payload="):
        save(Row())
    assert "row" not in calls


def test_a_forked_child_that_drops_the_db_leaves_the_parents_files_alone(tmp_path):
    import gc
    import time as clock

    db = oncedb.Db(tmp_path / "db", durability="sync")
    db.insert_if_absent(b"before the fork")

    def files():
        return sorted((p.name, p.stat().st_size) for p in (tmp_path / "db").iterdir())

    # The parent's own background work (the next segment prepared) done first, so that
    # any change to the files is the child's.
    db.flush()
    before = files()
    pid = os.fork()
    if pid == 0:
        # A worker that exits normally drops what it inherited (as `sys.exit` would).
        code = 1
        try:
            del db
            gc.collect()
            code = 0
        finally:
            os._exit(code)
    deadline = clock.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if clock.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the child hung dropping the parent's store")
        clock.sleep(0.01)
    assert os.WEXITSTATUS(status) == 0
    assert files() == before, "the child changed the parent's files"
    assert db.insert_if_absent(b"after the fork")


def test_the_decorated_function_keeps_its_signature_for_type_checkers(mypy):
    found = mypy(
        "import oncedb\n"
        "db = oncedb.Db()\n"
        "@oncedb.idempotent(db, tenant='t', operation='o', key=lambda order, amount: order)\n"
        "def charge(order: str, amount: int) -> int:\n"
        "    return amount\n"
        "total: int = charge('o', 5)\n"
        "charge('o', 'five')\n"
    )
    assert 'Argument 2 to "charge" has incompatible type "str"' in found, found
    assert found.count("error:") == 1, found


def test_a_value_that_aged_out_raises_expired_not_failed():
    # Responses kept for one second of a minute's window: the record stays, its value
    # goes once its bucket passes the retention (the clock is the real one).
    db = oncedb.Db(window=60, bucket=1, response_retention=1)
    charge, calls = counting(db)
    assert charge("o-9", 5) == {"charged": 5, "call": 1}
    deadline = time.monotonic() + 30
    while db.reserve("t", "charge:o-9", "o-9", b'{"amount":5}').status != "expired":
        assert time.monotonic() < deadline, "the stored value never aged out"
        time.sleep(0.05)
    with pytest.raises(oncedb.Expired, match="no longer stored"):
        charge("o-9", 5)
    assert len(calls) == 1


def test_a_replay_gives_back_the_results_types():
    import datetime
    import decimal
    import uuid

    result = {
        "when": datetime.datetime(2026, 12, 7, 14, 30, tzinfo=datetime.timezone.utc),
        "day": datetime.date(2026, 12, 7),
        "at": datetime.time(9, 15, 30),
        "amount": decimal.Decimal("12.50"),
        "id": uuid.UUID("12345678-1234-5678-1234-567812345678"),
        "raw": b"\x00\xff",
        "pair": (1, ("nested", 2)),
        "by_number": {1: "one", (2, 3): "pair"},
        "tags": {"a", "b"},
        "frozen": frozenset({1, 2}),
        "$oncedb": "a key that looks like the tag",
        "plain": [1, 2.5, None, True, "text"],
    }
    db = oncedb.Db()
    calls = []

    @oncedb.idempotent(db, tenant="t", operation="types", key=lambda order: order)
    def run(order):
        calls.append(order)
        return result

    first = run("o-types")
    again = run("o-types")
    assert len(calls) == 1
    assert first == result
    assert again == result, "the replay differs from the first answer"
    assert {key: type(value) for key, value in again.items()} == {
        key: type(value) for key, value in result.items()
    }
    assert type(again["pair"][1]) is tuple


def test_a_result_stored_as_plain_json_decodes_as_before():
    from oncedb.once import _json_decode

    assert _json_decode(b'{"a":[1,2],"b":{"c":"d"}}') == {"a": [1, 2], "b": {"c": "d"}}

