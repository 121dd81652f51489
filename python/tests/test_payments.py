"""The payments example (FastAPI on the middleware) under uvicorn: concurrent identical
requests and a retry after the server is killed and restarted charge the card once."""

import asyncio
from pathlib import Path

import httpx
import pytest

from test_asgi import Server

EXAMPLES = Path(__file__).parent.parent / "examples"
KEY = "7ccf419e-f129-4ac8-9c1e"
BODY = {"amount_cents": 5000, "currency": "EUR", "payment_method_id": "pm_123"}


@pytest.fixture
def payments(tmp_path):
    server = Server(tmp_path / "db", app="payments:app", cwd=EXAMPLES, env={"ONCEDB_DIR": str(tmp_path)})
    server.start()
    yield server, tmp_path / "charges.log"
    server.kill()
    server.sock.close()


def pay(client, body=BODY):
    headers = {"idempotency-key": KEY, "authorization": "Bearer org_123"}
    return client.post("/v1/payments", json=body, headers=headers)


def test_concurrent_and_post_crash_retries_charge_once(payments):
    server, ledger = payments

    async def concurrent():
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(*(pay(client) for _ in range(16)))

    answers = asyncio.run(concurrent())
    created = [a for a in answers if a.status_code == 201]
    assert created and all(a.status_code in (201, 409) for a in answers)
    assert len({a.content for a in created}) == 1, "every 201 is the same payment"
    assert len(ledger.read_text().splitlines()) == 1
    server.kill()
    server.start()
    with httpx.Client(base_url=server.url) as client:
        replay = pay(client, body=dict(reversed(list(BODY.items()))))
        assert (replay.status_code, replay.content) == (201, created[0].content)
        assert replay.headers["idempotent-replayed"] == "true"
        assert pay(client, body=dict(BODY, amount_cents=1)).status_code == 422
    assert len(ledger.read_text().splitlines()) == 1, "charged once"
