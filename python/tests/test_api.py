"""The library API: keys, batches, the record lifecycle, fencing, notes, the ordering
guard, errors and closing."""

import asyncio
from datetime import timedelta

import pytest

import oncedb


def memory_db(**options):
    return oncedb.Db(window=timedelta(hours=1), bucket=60, **options)


def test_str_keys_are_their_utf8_bytes():
    db = memory_db()
    assert db.insert_if_absent("ключ") is True
    assert db.insert_if_absent("ключ".encode()) is False
    assert db.contains(b"\xd0\xba\xd0\xbb\xd1\x8e\xd1\x87")
    assert not db.contains("other")


def test_insert_many_answers_each_key_in_order():
    db = memory_db()
    assert db.insert_many([b"a", "b", b"a"]) == [True, True, False]
    assert db.insert_many(["b", "c"]) == [False, True]
    assert db.stats()["live_keys"] == 3


def test_a_record_goes_from_acquired_to_replayed():
    db = memory_db()
    first = db.reserve("tenant", "pay", "key-1", b"request")
    assert first.status == "acquired" and first.response is None
    lease = first.lease
    assert lease.epoch > 0
    again = db.reserve("tenant", "pay", "key-1", b"request")
    assert again.status == "in_flight" and again.since > 0 and again.lease is None
    lease.complete(b"paid")
    replay = db.reserve("tenant", "pay", "key-1", b"request")
    assert (replay.status, replay.response) == ("completed", b"paid")
    assert db.reserve("tenant", "pay", "key-1", b"another request").status == "mismatch"
    # Scopes are independent.
    assert db.reserve("tenant-b", "pay", "key-1", b"request").status == "acquired"
    with pytest.raises(oncedb.LeaseLost):
        lease.complete(b"twice")


def test_failures_replay_and_releases_let_a_retry_run():
    db = memory_db()
    db.reserve("t", "op", "declined", b"r").lease.fail(b"card declined")
    failed = db.reserve("t", "op", "declined", b"r")
    assert (failed.status, failed.response) == ("failed", b"card declined")
    db.reserve("t", "op", "retry", b"r").lease.release()
    assert db.reserve("t", "op", "retry", b"r").status == "acquired"


def test_a_take_over_fences_the_old_lease_and_notes_are_seen():
    db = memory_db()
    old = db.reserve("t", "op", "k", b"r").lease
    old.note(b"charging")
    seen = db.reserve("t", "op", "k", b"r")
    assert seen.note == b"charging"
    [record] = db.in_flight(0)
    assert (record["tenant"], record["key"], record["note"]) == (b"t", b"k", b"charging")
    new = db.take_over("t", "op", "k")
    assert new is not None and new.epoch > old.epoch
    with pytest.raises(oncedb.Fenced):
        old.complete(b"late")
    new.complete(b"done")
    assert db.take_over("t", "op", "k") is None


def test_the_ordering_guard():
    db = memory_db()
    assert db.advance("t", "orders", "order-1", 1) == ("applied", None)
    assert db.advance("t", "orders", "order-1", 1) == ("duplicate", None)
    assert db.advance("t", "orders", "order-1", 3) == ("gap", 2)
    assert db.advance("t", "orders", "order-1", 2) == ("applied", None)
    assert db.advance("t", "orders", "order-1", 1) == ("stale", 2)


def test_bad_input_raises_and_changes_nothing():
    db = memory_db(max_keys=2, shards=1)
    with pytest.raises(oncedb.InvalidInput):
        db.insert_if_absent(b"")
    with pytest.raises(oncedb.InvalidInput):
        db.insert_many([b"ok", b""])
    assert not db.contains(b"ok"), "a rejected batch admits nothing"
    with pytest.raises(TypeError):
        db.insert_if_absent(42)
    with pytest.raises(oncedb.InvalidInput):
        oncedb.Db(window=60, bucket=120)
    with pytest.raises(oncedb.InvalidInput):
        oncedb.Db("/tmp/x", durability="sometimes")
    db.insert_many([b"a", b"b"])
    with pytest.raises(oncedb.Full):
        db.insert_if_absent(b"c")
    assert issubclass(oncedb.Full, oncedb.Error)


def test_a_durable_store_is_locked_closed_and_reopened(tmp_path):
    with oncedb.Db(tmp_path, durability="buffered") as db:
        assert db.durable
        db.insert_if_absent("kept")
        db.reserve("t", "op", "k", b"r").lease.complete(b"response")
        with pytest.raises(oncedb.Locked):
            oncedb.Db(tmp_path)
    with pytest.raises(oncedb.Closed):
        db.insert_if_absent("after close")
    db.close()
    reopened = oncedb.Db(tmp_path)
    assert reopened.contains("kept")
    assert reopened.reserve("t", "op", "k", b"r").response == b"response"
    assert reopened.stats()["fsyncs"] >= 0


def test_an_embedded_awaitable_that_waits_for_nothing_is_answered_at_once(tmp_path):
    # Under `interval` nothing waits for an fsync: the call is made on the caller's
    # thread and its future is done before it is awaited (no crossing to oncedb's
    # runtime thread and back). Under `sync` it waits for its group commit there.
    async def main():
        # Day-wide buckets: no new bucket (and roll-over) comes between the calls.
        quick = oncedb.Db(
            str(tmp_path / "interval"),
            durability="interval:10ms",
            window=timedelta(days=7),
            bucket=timedelta(days=1),
        )
        # The first writes create the log's first segment and raise the floor of lease
        # ids (the manifest rewritten): file work, handed to a thread.
        first = await quick.areserve("t", "op", "first", b"req")
        await first.lease.acomplete(b"done")
        reserving = quick.areserve("t", "op", "k", b"req")
        assert reserving.done()
        reservation = await reserving
        assert reservation.status == "acquired"
        completing = reservation.lease.acomplete(b"done")
        assert completing.done()
        await completing
        inserting = quick.ainsert_if_absent("key")
        assert inserting.done() and inserting.result() is True
        replay = await quick.areserve("t", "op", "k", b"req")
        assert (replay.status, replay.response) == ("completed", b"done")
        quick.close()

        durable = oncedb.Db(str(tmp_path / "sync"), durability="sync")
        reserving = durable.areserve("t", "op", "k", b"req")
        reservation = await reserving
        assert reservation.status == "acquired"
        await reservation.lease.acomplete(b"done")
        replay = await durable.areserve("t", "op", "k", b"req")
        assert (replay.status, replay.response) == ("completed", b"done")
        durable.close()

    asyncio.run(main())


def test_a_shared_store_is_made_only_as_one_of_its_kinds(mypy):
    # At runtime `SharedStore()` has no constructor; type checkers refuse it too, while
    # each kind keeps its own.
    with pytest.raises(TypeError):
        oncedb.SharedStore()
    found = mypy(
        "import oncedb\n"
        "store = oncedb.SharedStore()\n"
        "def kinds(url: str) -> list[oncedb.SharedStore]:\n"
        "    return [oncedb.RedisStore(url, window=60), "
        "oncedb.PostgresStore(url, window=60)]\n"
    )
    assert 'Too few arguments for "SharedStore"' in found, found
    assert found.count("error:") == 1, found
