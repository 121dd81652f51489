"""The seed's message consumer on oncedb: reserve -> side effect -> complete -> ack.

    python python/examples/consumer.py MESSAGES.jsonl STATE_DIR

Reads messages (one JSON object per line, with an "id") from the offset last acked,
and applies each one's effect once: a redelivery after a crash finds the record
completed and is only acked again. An attempt that crashed between its effect and its
completion leaves the record in flight; the restarted consumer takes it over and
reconciles through the effect store, which is keyed by message id (the business effect
is idempotent, as the seed requires), before completing it.

`ONCEDB_CRASH_AT=<step>:<n>` kills the process with SIGKILL at step `reserved`,
`applied`, `completed` or `acked` of the n-th message, for the crash tests."""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import oncedb

TENANT, OPERATION = "shop", "handle_order_event"


def crash_point(step: str, n: int) -> None:
    if os.environ.get("ONCEDB_CRASH_AT") == f"{step}:{n}":
        os.kill(os.getpid(), signal.SIGKILL)


def durable_write(path: Path, text: str) -> None:
    with path.open("a") as file:
        file.write(text)
        file.flush()
        os.fsync(file.fileno())


class Effects:
    """The business effect: one ledger line per message id, applied at most once."""

    def __init__(self, path: Path):
        self.path = path
        self.done = set(path.read_text().split()) if path.exists() else set()

    def apply(self, message_id: str) -> None:
        if message_id not in self.done:
            durable_write(self.path, message_id + "\n")
            self.done.add(message_id)


def consume(messages: Path, state: Path) -> int:
    state.mkdir(parents=True, exist_ok=True)
    offset_file = state / "offset"
    offset = int(offset_file.read_text()) if offset_file.exists() else 0
    effects = Effects(state / "effects.log")
    handled = 0
    with oncedb.Db(state / "dedup", window=7 * 86400, bucket=3600) as db:
        lines = messages.read_text().splitlines()
        for n, line in enumerate(lines[offset:], start=offset):
            message = json.loads(line)
            answer = db.reserve(TENANT, OPERATION, message["id"], line.encode())
            lease = answer.lease
            if answer.status == "in_flight":
                # A crashed attempt: take it over, reconcile through the effect store.
                lease = db.take_over(TENANT, OPERATION, message["id"])
            if lease is not None:
                crash_point("reserved", n)
                effects.apply(message["id"])
                crash_point("applied", n)
                lease.complete(b"applied")
                crash_point("completed", n)
                handled += 1
            offset_file.write_text(str(n + 1))  # the ack
            crash_point("acked", n)
    return handled


if __name__ == "__main__":
    print(consume(Path(sys.argv[1]), Path(sys.argv[2])))
