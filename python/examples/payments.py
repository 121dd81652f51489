"""The seed's idempotent payments API on FastAPI, with oncedb's middleware doing the
idempotency: reserve before the side effect, store the answer after it, replay retries.

    ONCEDB_DIR=/tmp/payments uvicorn payments:app --app-dir python/examples

The "provider" is a ledger file of charges (one line each, fsynced), standing in for the
card processor; it receives the stable operation id, as a real provider would."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from uuid import uuid4

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

import oncedb
from oncedb.asgi import IdempotencyMiddleware

STATE = Path(os.environ.get("ONCEDB_DIR", "/tmp/oncedb-payments"))
STATE.mkdir(parents=True, exist_ok=True)
LEDGER = STATE / "charges.log"


class PaymentRequest(BaseModel):
    amount_cents: int = Field(gt=0)
    currency: str = Field(min_length=3, max_length=3)
    payment_method_id: str


@dataclass(frozen=True)
class Identity:
    tenant_id: str


def tenant(scope) -> str | None:
    # The tenant comes from validated authentication, never from the body.
    for name, value in scope["headers"]:
        if name == b"authorization" and value.startswith(b"Bearer "):
            return value[len(b"Bearer ") :].decode()
    return None


def charge(operation_id: str, request: PaymentRequest) -> str:
    """The side effect: one durable ledger line per charge."""
    payment_id = f"pay_{uuid4().hex[:12]}"
    with LEDGER.open("a") as ledger:
        ledger.write(f"{operation_id} {payment_id} {request.amount_cents} {request.currency}\n")
        ledger.flush()
        os.fsync(ledger.fileno())
    return payment_id


db = oncedb.Db(STATE / "idempotency", window=86400, bucket=900, durability="sync")
app = FastAPI(title="Idempotent Payments API")
app.add_middleware(IdempotencyMiddleware, db=db, tenant=tenant, methods=("POST",))


@app.post("/v1/payments", status_code=201)
async def create_payment(
    payment: PaymentRequest,
    request: Request,
    idempotency_key: str = Header(alias="Idempotency-Key", min_length=16, max_length=200),
) -> JSONResponse:
    operation_id = f"{tenant(request.scope)}:create_payment:{idempotency_key}"
    payment_id = charge(operation_id, payment)
    return JSONResponse(
        {"id": payment_id, "status": "authorized", "amount_cents": payment.amount_cents},
        status_code=201,
        headers={"location": f"/v1/payments/{payment_id}"},
    )
