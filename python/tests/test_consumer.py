"""The consumer example killed with SIGKILL at every step of every message, then run
again: each message's effect is applied exactly once and every message is acked."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

CONSUMER = Path(__file__).parent.parent / "examples" / "consumer.py"
MESSAGES = 6


def run(messages, state, crash_at=None):
    env = dict(os.environ)
    env.pop("ONCEDB_CRASH_AT", None)
    if crash_at:
        env["ONCEDB_CRASH_AT"] = crash_at
    return subprocess.run(
        [sys.executable, str(CONSUMER), str(messages), str(state)], env=env, capture_output=True
    )


def test_a_kill_at_any_step_applies_each_effect_once(tmp_path):
    messages = tmp_path / "messages.jsonl"
    lines = [json.dumps({"id": f"order-{n}", "total": n * 100}) for n in range(MESSAGES)]
    # A redelivered message in the stream, as a broker would send it.
    lines.insert(3, lines[1])
    messages.write_text("\n".join(lines) + "\n")
    for step in ("reserved", "applied", "completed", "acked"):
        for n in range(len(lines)):
            state = tmp_path / f"{step}-{n}"
            crashed = run(messages, state, f"{step}:{n}")
            if crashed.returncode != -signal.SIGKILL:
                # The redelivered copy never reaches the crash point: it is only acked.
                assert crashed.returncode == 0 and n == 3, (step, n, crashed.stderr)
            finished = run(messages, state)
            assert finished.returncode == 0, finished.stderr
            effects = (state / "effects.log").read_text().split()
            assert sorted(effects) == sorted(f"order-{i}" for i in range(MESSAGES)), (step, n)
            assert (state / "offset").read_text() == str(len(lines))
