"""`oncedb.asgi.IdempotencyMiddleware` under a real uvicorn, driven by httpx: the
answers of docs/http.md, 16 concurrent duplicates running the handler once, and a replay
after the server is killed with SIGKILL and started again."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

KEY = "key-0123456789abcdef"
HERE = Path(__file__).parent


class Server:
    """uvicorn serving `server_app:app` on a socket bound here, to a free loopback port."""

    def __init__(self, db_path, app="server_app:app", cwd=HERE, env=None):
        self.db_path = db_path
        self.app, self.cwd, self.env = app, cwd, env or {}
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.process = None

    def start(self):
        env = dict(os.environ, ONCEDB_TEST_DB=str(self.db_path), **self.env)
        fd = self.sock.fileno()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--fd", str(fd), "--log-level", "info"],
            cwd=self.cwd,
            env=env,
            pass_fds=[fd],
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in self.process.stderr:
            if "Application startup complete" in line:
                # Keep reading its log, so that a full pipe never stalls the server.
                threading.Thread(target=self.process.stderr.read, daemon=True).start()
                return
        raise RuntimeError("uvicorn exited before serving")

    def kill(self):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()


@pytest.fixture
def server(tmp_path):
    server = Server(tmp_path / "db")
    server.start()
    yield server
    server.kill()
    server.sock.close()


def post(client, key=KEY, body=b'{"b":2,"a":1}', mode="", tenant="tenant_a", headers=None):
    sent = {"content-type": "application/json", "x-mode": mode}
    if key is not None:
        sent["idempotency-key"] = key
    if tenant is not None:
        sent["authorization"] = f"Bearer {tenant}"
    sent.update(headers or {})
    return client.post("/things", content=body, headers=sent)


def calls(client):
    return int(client.get("/calls").text)


def problem(response):
    assert response.headers["content-type"] == "application/problem+json"
    return response.json()["type"].removeprefix("urn:oncedb:problem:")


def test_the_documented_answers(server):
    with httpx.Client(base_url=server.url) as client:
        assert problem(post(client, key=None)) == "idempotency_key_required"
        assert post(client, key=None).status_code == 400
        assert problem(post(client, key="short")) == "invalid_idempotency_key"
        response = post(client, tenant=None)
        assert (response.status_code, problem(response)) == (401, "unauthorized")
        assert response.headers["www-authenticate"] == "Bearer"
        assert post(client, body=b"x" * 2000).status_code == 413
        assert calls(client) == 0, "refused before the handler"
        first = post(client)
        assert first.status_code == 201
        # Reordered members and another spacing are the same request.
        again = post(client, body=b'{ "a": 1, "b": 2 }')
        assert (again.status_code, again.content) == (201, first.content)
        assert again.headers["idempotent-replayed"] == "true"
        assert again.headers["location"] == "/things/1"
        assert "x-not-replayed" not in again.headers
        other = post(client, body=b'{"a":1,"b":3}')
        assert (other.status_code, problem(other)) == (422, "idempotency_key_reused")
        # Another tenant has keys of its own.
        assert post(client, tenant="tenant_b").json()["call"] == 2
        # A 4xx is stored; a 429 releases the key.
        declined = post(client, key="declined-0123456789", mode="declined")
        assert post(client, key="declined-0123456789", mode="declined").content == declined.content
        assert post(client, key="limited-0123456789a", mode="rate_limited").status_code == 429
        assert post(client, key="limited-0123456789a").status_code == 201
        assert calls(client) == 5


def test_the_outcome_policy(server):
    with httpx.Client(base_url=server.url) as client:
        # A 5xx is stored and replayed by default.
        failed = post(client, key="server-error-0123456", mode="server_error")
        assert failed.status_code == 500
        assert post(client, key="server-error-0123456").content == failed.content
        # An answer marked "unknown" keeps the record in flight, noted.
        assert post(client, key="unknown-0123456789ab", mode="unknown").status_code == 502
        retry = post(client, key="unknown-0123456789ab")
        assert (retry.status_code, problem(retry)) == (409, "request_outcome_unknown")
        # An answer marked "not_performed" lets a retry run.
        assert post(client, key="nothing-0123456789ab", mode="nothing_happened").status_code == 503
        assert post(client, key="nothing-0123456789ab").status_code == 201
        assert calls(client) == 4


def test_sixteen_concurrent_duplicates_run_the_handler_once(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            tasks = [asyncio.ensure_future(post(client, mode="wait")) for _ in range(16)]
            await client.get("/started")
            pending = set(tasks)
            while len(pending) > 1:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            answers = [task.result() for task in tasks if task.done()]
            assert all(a.status_code == 409 and a.headers["retry-after"] for a in answers)
            assert {problem(a) for a in answers} == {"request_in_progress"}
            await client.get("/open-gate")
            [first] = pending
            first = await first
            assert first.status_code == 201
            replay = await post(client)
            assert replay.content == first.content
            assert int((await client.get("/calls")).text) == 1

    asyncio.run(main())


def test_a_replay_survives_sigkill_and_a_restart(server):
    with httpx.Client(base_url=server.url) as client:
        first = post(client)
        assert first.status_code == 201
    server.kill()
    server.start()
    with httpx.Client(base_url=server.url) as client:
        replay = post(client, body=b'{"a":1,"b":2}')
        assert (replay.status_code, replay.content) == (201, first.content)
        assert replay.headers["idempotent-replayed"] == "true"
        assert calls(client) == 0, "the restarted server did not run the handler"


def test_a_client_that_gives_up_does_not_stop_the_handler(server):
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as control:
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
                first = asyncio.ensure_future(post(client, mode="wait"))
                await control.get("/started")
                first.cancel()
            # The client is gone; the handler is still waiting at the gate.
            await control.get("/open-gate")
            # Its answer was stored: the retry replays it, whenever it arrives.
            while True:
                retry = await post(control)
                if retry.status_code != 409:
                    break
            assert retry.status_code == 201
            assert retry.headers["idempotent-replayed"] == "true"
            assert int((await control.get("/calls")).text) == 1

    asyncio.run(main())
