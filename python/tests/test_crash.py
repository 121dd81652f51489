"""Across processes: a writer killed with SIGKILL loses nothing it acknowledged."""

import os
import signal
import subprocess
import sys
import textwrap

import oncedb

WRITER = textwrap.dedent(
    """
    import sys
    import oncedb

    db = oncedb.Db(sys.argv[1], durability=sys.argv[2])
    for n in range(1_000_000):
        if db.insert_if_absent(f"key-{n}"):
            lease = db.reserve("t", "op", f"record-{n}", b"req").lease
            lease.complete(f"response-{n}".encode())
            print(n, flush=True)
    """
)


def run_and_kill(path, durability, acknowledged):
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), durability],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        acked = [int(child.stdout.readline()) for _ in range(acknowledged)]
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        child.stdout.close()
    assert child.returncode == -signal.SIGKILL
    return acked


def test_sigkill_loses_no_acknowledged_key_or_record(tmp_path):
    for durability in ("sync", "buffered"):
        path = tmp_path / durability
        acked = run_and_kill(path, durability, 300)
        db = oncedb.Db(path)
        for n in acked:
            assert db.contains(f"key-{n}"), n
            replay = db.reserve("t", "op", f"record-{n}", b"req")
            assert (replay.status, replay.response) == ("completed", f"response-{n}".encode())
        # The store takes writes after the crash.
        assert db.insert_if_absent("after the crash")
