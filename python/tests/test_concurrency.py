"""The GIL and the event loop: a call waiting on an fsync lets other Python code run.

The GIL test sets the interpreter's switch interval to an hour, so that a thread gives up
the GIL only when it blocks: if oncedb held the GIL across its fsyncs, the other thread
could not run at all while the commits happen. (From asyncio, `oncedb.run` offloads a
call to a worker thread; the event loop then runs for the same reason.)"""

import asyncio
import sys
import threading
import time

import pytest

import oncedb


@pytest.fixture
def no_preemption():
    before = sys.getswitchinterval()
    sys.setswitchinterval(3600)
    yield
    sys.setswitchinterval(before)


def test_other_threads_run_during_sync_commits(tmp_path, no_preemption):
    db = oncedb.Db(tmp_path, durability="sync")
    counter = {"n": 0, "done": False}

    def count():
        while not counter["done"]:
            counter["n"] += 1
            # A blocking call: hands the GIL back to the committing thread.
            time.sleep(0)

    other = threading.Thread(target=count)
    other.start()
    before = counter["n"]
    for n in range(20):
        db.insert_if_absent(f"key-{n}")
    during = counter["n"] - before
    counter["done"] = True
    other.join()
    assert during > 0, "the counting thread never ran while 20 fsyncs happened"


def test_run_offloads_a_call_and_passes_its_answer_and_errors(tmp_path):
    db = oncedb.Db(tmp_path, durability="sync")
    loop_thread = threading.get_ident()
    ran_on = []

    def insert(key):
        ran_on.append(threading.get_ident())
        return db.insert_if_absent(key)

    async def main():
        assert await oncedb.run(insert, "k") is True
        assert await oncedb.run(db.insert_if_absent, "k") is False
        with pytest.raises(oncedb.InvalidInput):
            await oncedb.run(db.insert_if_absent, b"")

    asyncio.run(main())
    assert ran_on and ran_on[0] != loop_thread, "the call ran off the event loop's thread"


def test_one_db_shared_by_threads_admits_each_key_once(tmp_path):
    db = oncedb.Db(tmp_path, durability="buffered")
    admitted = []
    lock = threading.Lock()

    def worker():
        mine = [key for key in range(2_000) if db.insert_if_absent(f"key-{key}")]
        with lock:
            admitted.extend(mine)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(admitted) == list(range(2_000))
