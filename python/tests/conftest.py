"""Fixtures shared by the test modules: one PostgreSQL and one Redis server for the
session (started on first use), the shared stores on them, and mypy on a snippet."""

import subprocess
import sys
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


@pytest.fixture
def mypy(tmp_path):
    """Runs mypy on a source text: what it prints."""

    def check(source: str) -> str:
        checked = tmp_path / "typed.py"
        checked.write_text(source)
        found = subprocess.run(
            [sys.executable, "-m", "mypy", "--no-incremental", str(checked)],
            capture_output=True,
            text=True,
        )
        return found.stdout

    return check
