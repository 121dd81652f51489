"""Requests per second of one uvicorn worker serving `bench_app.py`, with and without
the idempotency middleware, each request a new key, 32 in flight (httpx).

    python python/examples/bench_asgi.py [--requests N]
"""

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).parent


def serve(bare: bool, state: str):
    sock = socket.socket()
    # Accepted connections inherit it: no Nagle stall between a response's writes.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind(("127.0.0.1", 0))
    env = dict(os.environ, ONCEDB_DIR=state, ONCEDB_BENCH_BARE="1" if bare else "0")
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "bench_app:app", "--fd", str(sock.fileno()), "--no-access-log"],
        cwd=HERE, env=env, pass_fds=[sock.fileno()], stderr=subprocess.PIPE, text=True,
    )
    for line in process.stderr:
        if "Application startup complete" in line:
            threading.Thread(target=process.stderr.read, daemon=True).start()
            break
    return process, sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


async def load(url: str, requests: int) -> float:
    async with httpx.AsyncClient(base_url=url, limits=httpx.Limits(max_connections=32)) as client:
        queue = iter(range(requests))

        async def worker():
            for n in queue:
                response = await client.post(
                    "/things", content=b'{"n":1}',
                    headers={"idempotency-key": f"bench-key-{n:012d}", "content-type": "application/json"},
                )
                assert response.status_code == 201, response.text

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(32)))
        return requests / (time.perf_counter() - started)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=5000)
    args = parser.parse_args()
    for bare in (True, False):
        with tempfile.TemporaryDirectory() as state:
            process, sock, url = serve(bare, state)
            try:
                rates = [asyncio.run(load(url, args.requests)) for _ in range(3)]
            finally:
                process.kill()
                process.wait()
                sock.close()
        rates.sort()
        print(f"{'bare app' if bare else 'with the middleware':<22} {rates[1]:8.0f} requests/s (median of 3)")


if __name__ == "__main__":
    main()
