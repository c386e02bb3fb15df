"""How late a sleeping process wakes while a CPU vLLM engine generates, with the engine free to
run anywhere and confined to `proxy.tools.engine.engine_cores()`: the reason for that placement.

vLLM's engine-core process busy-waits (sched_yield) for its worker's output. On a small VM we
saw that spinner delay the timers of other processes on its core by seconds, which is what the
proxy's queue and execution timeouts and health probes are. For each placement this starts one
engine, asks it for one long generation, and meanwhile runs a probe process pinned to each
core that wakes on a fixed 0.5 s schedule; prints each probe's worst lateness and the engine's
speed.

    .venv/bin/python benchmarks/timer_starvation.py --seconds 8
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from proxy.tools.engine import (
    EngineProcess,
    engine_cores,
    local_engine,
)

# Runs in its own process, started at sys.argv[1] (CLOCK_MONOTONIC is shared by processes):
# wakes every `nap` seconds on a fixed schedule and prints how late its worst wake-up was
# (its own start included).
PROBE = """
import sys, time
launched, seconds, nap = (float(a) for a in sys.argv[1:4])
due, worst = launched + nap, 0.0
while due < launched + seconds:
    time.sleep(max(0.0, due - time.monotonic()))
    worst = max(worst, time.monotonic() - due)
    due += nap
print(worst)
"""


def generate(url: str, tokens: int, out: dict[str, float]) -> None:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": tokens, "ignore_eos": True}
    req = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    start = time.monotonic()
    with urllib.request.urlopen(req, timeout=600) as resp:
        usage = json.load(resp)["usage"]
    out["tokens_per_s"] = usage["completion_tokens"] / (time.monotonic() - start)


def start_probe(core: int, seconds: float, nap: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [
            "taskset",
            "-c",
            str(core),
            sys.executable,
            "-c",
            PROBE,
            str(time.monotonic()),
            str(seconds),
            str(nap),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def measure(confined: bool, seconds: float, nap: float, log_dir: Path) -> tuple[list[float], float]:
    spec = local_engine(
        max_num_seqs=4,
        plugin=False,
        extra_args=("--max-model-len", "16384"),
        cpus=engine_cores() if confined else None,
    )
    name = "confined" if confined else "free"
    engine = EngineProcess(spec, log_dir / f"timer-starvation-{name}.log")
    try:
        engine.start().wait_ready()
        all_cores = sorted(os.sched_getaffinity(0))
        speed: dict[str, float] = {}
        # Long enough to outlast every probe; the engine generates ~600-900 tokens/s here.
        gen = threading.Thread(target=generate, args=(spec.url, 16000, speed))
        gen.start()
        time.sleep(1.0)  # generating by now
        # All at once, so that each runs while the engine generates, whatever stalls this one.
        probes = [start_probe(core, seconds, nap) for core in all_cores]
        lateness = [float(p.communicate(timeout=600)[0]) for p in probes]
        gen.join()
        return lateness, speed.get("tokens_per_s", 0.0)
    finally:
        engine.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="probe time per core")
    parser.add_argument("--nap", type=float, default=0.5, help="the probe's sleep, seconds")
    args = parser.parse_args()
    log_dir = Path(".tierproxy/logs")
    cores = sorted(os.sched_getaffinity(0))
    print(f"engine cores when confined: {sorted(engine_cores() or [])} of {cores}")
    print(
        f"{'engine placement':<22}"
        + "".join(f"{'core ' + str(c):>12}" for c in cores)
        + f"{'tokens/s':>12}"
    )
    for confined in (False, True):
        lateness, speed = measure(confined, args.seconds, args.nap, log_dir)
        label = "confined" if confined else "anywhere (vLLM auto)"
        print(f"{label:<22}" + "".join(f"{late:>11.2f}s" for late in lateness) + f"{speed:>12.0f}")
    print(
        f"(worst lateness of a {args.nap:g} s sleep, in a probe pinned to each core, while the "
        "engine generates)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
