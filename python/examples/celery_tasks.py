"""Celery tasks whose effect happens once, however often the broker delivers them.

Celery with ``acks_late`` acknowledges a task after it ran, so a task whose worker dies
mid-way is delivered again: at once to another pool process when only the pool process
died (``task_reject_on_worker_lost``), or after the broker's visibility timeout when the
whole worker was lost. A producer may also send one task twice. ``oncedb.idempotent``
over a store every worker shares (a :class:`oncedb.RedisStore` here, or a
:class:`oncedb.PostgresStore`) makes the effect run once per order id:

- delivered again after the effect was recorded, the task returns the stored answer;
- delivered again while the dead worker's lease still holds, it waits for the lease to
  lapse (the dead worker no longer renews it), then takes the key over and runs once;
- sent twice, the second delivery waits for the first's answer and returns it.

Run a worker (the broker and the store may be the same Redis)::

    ONCEDB_BROKER=redis://127.0.0.1:6379/0 ONCEDB_STORE=redis://127.0.0.1:6379 \\
        celery -A celery_tasks worker --concurrency 4

and send ``charge.delay("order-1", 1250)``. ``docs/http.md`` ("Task queues") says which
settings matter and what each guarantees.
"""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path
from typing import Any, Callable, Optional

from celery import Celery
from celery.signals import worker_process_init

import oncedb

BROKER = os.environ.get("ONCEDB_BROKER", "redis://127.0.0.1:6379/0")
STORE = os.environ.get("ONCEDB_STORE", "redis://127.0.0.1:6379")
#: Where the effect is written: one line per charge made.
LEDGER = Path(os.environ.get("ONCEDB_LEDGER", "ledger.txt"))
#: A lease lapses this long after its worker stopped renewing it (a dead worker).
LEASE_TIMEOUT_S = float(os.environ.get("ONCEDB_LEASE_TIMEOUT_S", "30"))
#: How long the broker waits for an acknowledgement before it delivers a task again to
#: another worker (a whole worker lost). Longer than the longest task, and than the
#: lease timeout, so that a redelivered task finds the lease lapsed or about to.
VISIBILITY_TIMEOUT_S = float(os.environ.get("ONCEDB_VISIBILITY_TIMEOUT_S", "3600"))
#: How often a worker looks for tasks past their visibility timeout. kombu's defaults
#: look every 100 s (an interval of 10 s, each tenth look scanning).
RESTORE_SWEEP_S = int(os.environ.get("ONCEDB_RESTORE_SWEEP_S", "60"))

app = Celery("celery_tasks", broker=BROKER, backend=BROKER)
app.conf.update(
    # Acknowledge after the task ran: a task whose worker died is delivered again.
    task_acks_late=True,
    # A pool process killed mid-task: the task goes back to the queue at once.
    task_reject_on_worker_lost=True,
    # One task reserved at a time per process, so a lost worker holds back no others.
    worker_prefetch_multiplier=1,
    broker_transport_options={
        "visibility_timeout": VISIBILITY_TIMEOUT_S,
        "unacked_restore_interval": RESTORE_SWEEP_S,
        "unacked_restore_throttle": 1,
    },
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
)

_store: Optional[oncedb.RedisStore] = None
_charge_once: Optional[Callable[[str, int], dict]] = None


@worker_process_init.connect
def _open_store(**_: Any) -> None:
    """Opens the store in each pool process: a store's connections and threads do not
    survive a fork, so the parent's would be refused."""
    global _store, _charge_once
    _store = oncedb.RedisStore(
        STORE, window=7 * 24 * 3600, prefix="celery", lease_timeout=LEASE_TIMEOUT_S
    )
    # A delivery that finds the key in flight waits for its outcome, and for a dead
    # holder's lease to lapse, before it gives up.
    _charge_once = oncedb.idempotent(
        _store,
        tenant="shop",
        operation="charge",
        key=lambda order_id, amount_cents: order_id,
        wait=3 * LEASE_TIMEOUT_S,
    )(_charge)


def _charge(order_id: str, amount_cents: int) -> dict:
    """The effect: one line in the ledger (a payment provider's call in a real app)."""
    _hold("before", order_id)
    charge_id = uuid.uuid4().hex
    with LEDGER.open("a") as ledger:
        ledger.write(f"{order_id} {amount_cents} {charge_id}\n")
    return {"order": order_id, "charge": charge_id}


@app.task(name="charge")
def charge(order_id: str, amount_cents: int) -> dict:
    if _charge_once is None:
        raise RuntimeError("the store opens in worker processes (worker_process_init)")
    answer = _charge_once(order_id, amount_cents)
    # The effect is recorded; Celery has neither stored the answer nor acknowledged.
    _hold("after", order_id)
    return answer


def _hold(where: str, order_id: str) -> None:
    """For the tests' bad days (``ONCEDB_HOLD_DIR``): if the file ``hold-WHERE-ORDER``
    is there, takes it (one process only), says so in ``held-WHERE-ORDER`` with its pid,
    and waits to be killed."""
    folder = os.environ.get("ONCEDB_HOLD_DIR")
    if not folder:
        return
    hold, taking, held = (Path(folder) / f"{state}-{where}-{order_id}" for state in ("hold", "taking", "held"))
    try:
        os.rename(hold, taking)
    except FileNotFoundError:
        return
    taking.write_text(str(os.getpid()))
    os.rename(taking, held)
    threading.Event().wait()
