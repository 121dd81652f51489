"""Several workers: `uvicorn --workers 2` over a shared store (a real PostgreSQL, a real
Redis), 16 concurrent duplicates of a request spread over both workers run the handler
once, and every duplicate gets its answer."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest

HERE = Path(__file__).parent


class Workers:
    """uvicorn with two worker processes on a socket bound here."""

    def __init__(self, env):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        fd = self.sock.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "workers_app:app", "--fd", str(fd),
             "--workers", "2", "--log-level", "info"],
            cwd=HERE,
            env=dict(os.environ, **env),
            pass_fds=[fd],
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        started = 0
        for line in self.process.stderr:
            started += "Application startup complete" in line
            if started == 2:
                threading.Thread(target=self.process.stderr.read, daemon=True).start()
                return
        raise RuntimeError("uvicorn's workers exited before serving")

    def stop(self):
        # The whole session: the supervisor and its workers.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self.sock.close()


@pytest.fixture(params=["postgres", "redis"])
def workers(request, tmp_path):
    url = request.getfixturevalue(f"{request.param}_url")
    files = {"effects": tmp_path / "effects", "seen": tmp_path / "seen"}
    for path in files.values():
        path.touch()
    server = Workers({
        "ONCEDB_TEST_STORE": f"{request.param}:{url}",
        "ONCEDB_TEST_PREFIX": f"w{uuid.uuid4().hex[:12]}",
        "ONCEDB_TEST_EFFECTS": str(files["effects"]),
        "ONCEDB_TEST_SEEN": str(files["seen"]),
    })
    yield server, files
    server.stop()


async def sixteen_duplicates(url, order):
    # A connection per request, so that the kernel hands them to either worker.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as http:
        key = f"order-{order}-{uuid.uuid4().hex}"
        return await asyncio.gather(*(
            http.post("/charges", json={"order": order}, headers={"idempotency-key": key})
            for _ in range(16)
        ))


def test_sixteen_duplicates_over_two_workers_run_the_handler_once(workers):
    server, files = workers
    # Rounds until both workers served duplicates of one round (the kernel spreads the
    # connections; nothing here forces it).
    for order in range(20):
        before = files["seen"].read_text().split()
        answers = asyncio.run(sixteen_duplicates(server.url, order))
        served = Counter(files["seen"].read_text().split()[len(before):])
        bodies = {answer.text for answer in answers}
        assert [a.status_code for a in answers] == [201] * 16
        assert len(bodies) == 1, bodies
        effects = [line for line in files["effects"].read_text().splitlines()
                   if line.split()[0] == str(order)]
        assert len(effects) == 1, effects
        if len(served) == 2:
            return
    pytest.fail("the duplicates of every round went to one worker")
