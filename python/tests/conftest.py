"""Fixtures shared by the test modules: one PostgreSQL and one Redis server for the
session (started on first use), and the shared stores on them."""

import tempfile
import uuid
from pathlib import Path

import pytest

import oncedb
import servers


@pytest.fixture(scope="session")
def postgres_url():
    with tempfile.TemporaryDirectory(prefix="oncedb-pg-") as tmp:
        yield from servers.postgres(Path(tmp))


@pytest.fixture(scope="session")
def redis_url():
    with tempfile.TemporaryDirectory(prefix="oncedb-redis-") as tmp:
        yield from servers.redis(Path(tmp))


@pytest.fixture(params=["postgres", "redis"])
def shared(request):
    """A factory of shared stores on either server; each test gets keys of its own (a
    fresh Redis prefix, a fresh tenant via ``shared.tenant``)."""
    kind = request.param
    url = request.getfixturevalue(f"{kind}_url")
    prefix = f"t{uuid.uuid4().hex[:12]}"

    def open_store(**options):
        options.setdefault("window", 3600)
        if kind == "postgres":
            return oncedb.PostgresStore(url, **options)
        return oncedb.RedisStore(url, prefix=prefix, **options)

    open_store.kind = kind
    open_store.url = url
    open_store.tenant = f"tenant-{uuid.uuid4().hex[:12]}"
    return open_store
