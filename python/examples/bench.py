"""Python-side throughput: oncedb's insert_many and reserve + complete against a Python
set and dict holding the same keys. Prints medians of five runs.

    python python/examples/bench.py [--keys N] [--dir D]
"""

import argparse
import statistics
import tempfile
import time

import oncedb


def timed(run, repeats=5):
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--redis-port", type=int, default=None, help="a local redis-server for redis-py SET NX")
    args = parser.parse_args()
    keys = [f"msg-{n:012d}".encode() for n in range(args.keys)]
    batches = [keys[i : i + 1024] for i in range(0, len(keys), 1024)]

    def with_set():
        seen = set()
        for batch in batches:
            answers = []
            for key in batch:
                answers.append(key not in seen)
                seen.add(key)

    def with_db(path, durability):
        def run():
            db = oncedb.Db(path() if path else None, durability=durability)
            for batch in batches:
                db.insert_many(batch)
            db.close()

        return run

    records = keys[: args.keys // 10]

    def dict_records():
        store = {}
        for key in records:
            if key not in store:
                store[key] = None
                store[key] = b"response"

    def db_records(path, durability):
        def run():
            db = oncedb.Db(path() if path else None, durability=durability)
            for key in records:
                answer = db.reserve("tenant", "op", key, b"request")
                answer.lease.complete(b"response")
            db.close()

        return run

    fresh = (lambda: tempfile.mkdtemp(dir=args.dir))
    rows = [
        ("set, batches of 1024", len(keys), timed(with_set)),
        ("oncedb in memory, insert_many x1024", len(keys), timed(with_db(None, "sync"))),
        ("oncedb interval:10ms, insert_many x1024", len(keys), timed(with_db(fresh, "interval:10ms"))),
        ("dict, check + store", len(records), timed(dict_records)),
        ("oncedb in memory, reserve + complete", len(records), timed(db_records(None, "sync"))),
        ("oncedb interval:10ms, reserve + complete", len(records), timed(db_records(fresh, "interval:10ms"))),
    ]
    if args.redis_port:
        import redis

        client = redis.Redis(port=args.redis_port)

        def redis_set_nx():
            client.flushall()
            for batch in batches:
                pipe = client.pipeline(transaction=False)
                for key in batch:
                    pipe.set(key, b"1", nx=True, ex=86400)
                pipe.execute()

        rows.append(("redis-py SET NX EX, pipelines of 1024", len(keys), timed(redis_set_nx, 3)))

        def redis_single():
            client.flushall()
            for key in records:
                client.set(key, b"1", nx=True, ex=86400)

        rows.append(("redis-py SET NX EX, one call each", len(records), timed(redis_single, 3)))
    for name, n, seconds in rows:
        print(f"{name:<44} {n / seconds / 1e6:8.3f} M ops/s")


if __name__ == "__main__":
    main()
