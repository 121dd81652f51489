"""Real servers for the shared-store tests, each on a free loopback port in a temp dir,
stopped when its fixture ends (a failed test too): PostgreSQL (``initdb`` + ``pg_ctl``;
run as root, the server runs as the ``postgres`` user) and Redis (``redis-server``).
``.ci/run`` installs both from Debian's packages."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator, Optional


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_answers(port: int, what: str, limit_s: float = 30.0) -> None:
    """Returns once the port accepts a connection; the server is polled, since nothing
    else tells when it listens."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not start listening on port {port}")


def _pg_bin() -> Path:
    if os.environ.get("PG_BIN"):
        return Path(os.environ["PG_BIN"])
    found = shutil.which("initdb")
    if found:
        return Path(found).parent
    versions = sorted(
        (int(p.name), p / "bin") for p in Path("/usr/lib/postgresql").glob("*") if p.name.isdigit()
    )
    if not versions:
        raise RuntimeError("PostgreSQL must be installed (.ci/run installs it)")
    return versions[-1][1]


def postgres(tmp: Path) -> Iterator[str]:
    """A PostgreSQL cluster in ``tmp``: yields its URL, stops it afterwards."""
    as_user: Optional[str] = "postgres" if os.geteuid() == 0 else None
    if as_user:
        shutil.chown(tmp, user=as_user, group=as_user)
    bin_dir, data, port = _pg_bin(), tmp / "data", free_port()
    run = dict(user=as_user, check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        [str(bin_dir / "initdb"), "-D", str(data), "-U", "oncedb", "--auth=trust", "-E", "UTF8",
         "--locale=C", "--no-sync"],
        **run,
    )
    options = (
        f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={tmp} "
        "-c max_connections=200 -c fsync=off"
    )
    subprocess.run(
        [str(bin_dir / "pg_ctl"), "-D", str(data), "-w", "-l", str(tmp / "log"), "-o", options, "start"],
        **run,
    )
    try:
        yield f"postgres://oncedb@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            [str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"],
            user=as_user,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )


def redis(tmp: Path) -> Iterator[str]:
    """A Redis server in ``tmp`` with no persistence: yields its URL, kills it afterwards."""
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(tmp)],
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_until_answers(port, "redis-server")
        yield f"redis://127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()
