"""Concurrent records from one event loop on a `Sync` store: `areserve` + `acomplete`
(awaitables that hold no thread) against `asyncio.to_thread(db.reserve)` +
`asyncio.to_thread(lease.complete)`, with CONCURRENCY calls in flight at once. Prints
records per second (median of five runs) and the most threads alive during a run.

    python python/examples/bench_async.py [--records N] [--concurrency C]
"""

import argparse
import asyncio
import statistics
import tempfile
import threading
import time

import oncedb


async def awaitables(db, keys, concurrency):
    gate = asyncio.Semaphore(concurrency)

    async def one(key):
        async with gate:
            answer = await db.areserve("t", "op", key, b"r")
            await answer.lease.acomplete(b"done")

    await asyncio.gather(*(one(k) for k in keys))


async def threads(db, keys, concurrency):
    gate = asyncio.Semaphore(concurrency)

    async def one(key):
        async with gate:
            answer = await asyncio.to_thread(db.reserve, "t", "op", key, b"r")
            await asyncio.to_thread(answer.lease.complete, b"done")

    await asyncio.gather(*(one(k) for k in keys))


def measure(way, records, concurrency):
    rates, peak = [], 0
    for run in range(5):
        with tempfile.TemporaryDirectory() as dir:
            db = oncedb.Db(dir, durability="sync")
            keys = [f"{way.__name__}-{run}-{n}" for n in range(records)]
            stop = threading.Event()

            def watch():
                nonlocal peak
                while not stop.wait(0.005):
                    peak = max(peak, threading.active_count())

            watcher = threading.Thread(target=watch)
            watcher.start()
            started = time.perf_counter()
            asyncio.run(way(db, keys, concurrency))
            rates.append(records / (time.perf_counter() - started))
            stop.set()
            watcher.join()
            db.close()
    return statistics.median(rates), peak - 1  # the watcher itself


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--records", type=int, default=20_000)
    parser.add_argument("--concurrency", type=int, default=1000)
    args = parser.parse_args()
    for way in (awaitables, threads):
        rate, peak = measure(way, args.records, args.concurrency)
        print(f"{way.__name__:>10}: {rate:10.0f} records/s, at most {peak} threads alive")


if __name__ == "__main__":
    main()
