"""Celery workers on bad days, with ``examples/celery_tasks.py``: real ``celery worker``
processes (the prefork pool) on a real Redis broker, the tasks' keys in a
:class:`oncedb.RedisStore` on the same server. A worker process is SIGKILLed after the
effect (the task redelivered replays the stored answer), or before it with its lease
held (the redelivery waits for the lease to lapse, then runs the effect once); a whole
worker is lost (the broker's visibility timeout redelivers to another); and one task is
sent twice. The ledger the effect writes says how often it ran."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
from celery import Celery

import servers

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
LEASE_TIMEOUT_S = 2.0
VISIBILITY_TIMEOUT_S = 3.0
#: How long a task may take to be answered, redeliveries and lease lapses included.
ANSWER_S = 60.0


class Queue:
    """A Redis server for one test (broker, results and store), the workers started on
    it (each killed with its pool when the test ends), and the ledger of effects."""

    def __init__(self, redis_url: str, folder: Path) -> None:
        self.url = redis_url
        self.folder = folder
        self.ledger = folder / "ledger.txt"
        self.workers: list[subprocess.Popen] = []
        self.client = Celery("client", broker=f"{redis_url}/0", backend=f"{redis_url}/0")
        self.client.conf.update(
            broker_transport_options={"visibility_timeout": VISIBILITY_TIMEOUT_S},
            task_serializer="json",
            result_serializer="json",
            accept_content=["json"],
        )

    def start_worker(self, name: str, concurrency: int = 1) -> subprocess.Popen:
        env = dict(
            os.environ,
            ONCEDB_BROKER=f"{self.url}/0",
            ONCEDB_STORE=self.url,
            ONCEDB_LEDGER=str(self.ledger),
            ONCEDB_LEASE_TIMEOUT_S=str(LEASE_TIMEOUT_S),
            ONCEDB_VISIBILITY_TIMEOUT_S=str(VISIBILITY_TIMEOUT_S),
            ONCEDB_RESTORE_SWEEP_S="1",
            ONCEDB_HOLD_DIR=str(self.folder),
        )
        log = (self.folder / f"{name}.log").open("w")
        worker = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "celery_tasks", "worker",
             "--pool", "prefork", "--concurrency", str(concurrency), "--loglevel", "INFO",
             "--hostname", f"{name}@oncedb", "--without-gossip", "--without-mingle",
             "--without-heartbeat"],
            cwd=EXAMPLES,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.workers.append(worker)
        return worker

    def charge(self, order: str, amount_cents: int = 1250):
        return self.client.send_task("charge", args=[order, amount_cents])

    def hold(self, where: str, order: str) -> None:
        """The next process that reaches ``where`` for ``order`` waits there to be killed."""
        (self.folder / f"hold-{where}-{order}").touch()

    def held(self, where: str, order: str) -> int:
        """The pid of the process held at ``where`` for ``order``, once it is there."""
        held = self.folder / f"held-{where}-{order}"
        deadline = time.monotonic() + ANSWER_S
        while not held.exists():
            assert time.monotonic() < deadline, f"no process held {where} {order}: {self.logs()}"
            time.sleep(0.02)
        return int(held.read_text())

    def answer(self, result) -> dict:
        """The task's answer once a worker process logged that it succeeded (a run killed
        before that is delivered again), so that the ledger is read after every run of
        the task ended."""
        done = f"Task charge[{result.id}] succeeded"
        deadline = time.monotonic() + ANSWER_S
        while done not in self.logs():
            assert time.monotonic() < deadline, f"task {result.id} never succeeded: {self.logs()}"
            time.sleep(0.02)
        return result.get(timeout=ANSWER_S)

    def effects(self, order: str) -> list[str]:
        """The charge ids the ledger holds for ``order``."""
        if not self.ledger.exists():
            return []
        lines = self.ledger.read_text().splitlines()
        return [line.split()[2] for line in lines if line.split()[0] == order]

    def logs(self) -> str:
        return "\n".join(path.read_text() for path in sorted(self.folder.glob("*.log")))

    def close(self) -> None:
        for worker in self.workers:
            try:
                os.killpg(worker.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            worker.wait()
        self.client.close()


@pytest.fixture
def queue() -> Iterator[Queue]:
    with tempfile.TemporaryDirectory(prefix="oncedb-celery-") as tmp:
        folder = Path(tmp)
        redis = servers.redis(folder)
        queue = Queue(next(redis), folder)
        try:
            yield queue
        finally:
            queue.close()
            redis.close()


def test_a_task_redelivered_after_its_effect_replays_the_stored_answer(queue: Queue) -> None:
    queue.start_worker("w1")
    queue.hold("after", "order-a")
    result = queue.charge("order-a")
    # The effect is recorded, and the process dies before Celery stores the answer or
    # acknowledges the task: it is delivered again, and replays the recorded answer.
    os.kill(queue.held("after", "order-a"), signal.SIGKILL)
    answer = queue.answer(result)
    assert queue.effects("order-a") == [answer["charge"]], queue.logs()


def test_a_task_redelivered_before_its_effect_runs_it_once(queue: Queue) -> None:
    queue.start_worker("w1")
    queue.hold("before", "order-b")
    result = queue.charge("order-b")
    # The process holds the key's lease and dies before the effect: the redelivery
    # finds the key in flight, waits for the lease to lapse, takes it over and runs.
    os.kill(queue.held("before", "order-b"), signal.SIGKILL)
    answer = queue.answer(result)
    assert queue.effects("order-b") == [answer["charge"]], queue.logs()


def test_a_task_of_a_lost_worker_runs_once_on_another(queue: Queue) -> None:
    first = queue.start_worker("w1")
    queue.hold("before", "order-d")
    result = queue.charge("order-d")
    queue.held("before", "order-d")
    # The whole worker is lost: nothing requeues the task, the broker redelivers it after
    # its visibility timeout to the other worker, by then past the lease timeout.
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    queue.start_worker("w2")
    answer = queue.answer(result)
    assert queue.effects("order-d") == [answer["charge"]], queue.logs()


def test_a_task_sent_twice_runs_once(queue: Queue) -> None:
    queue.start_worker("w1", concurrency=2)
    results = [queue.charge("order-c"), queue.charge("order-c")]
    answers = [queue.answer(result) for result in results]
    assert answers[0] == answers[1]
    assert queue.effects("order-c") == [answers[0]["charge"]], queue.logs()
