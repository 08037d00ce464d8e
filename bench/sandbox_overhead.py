"""Overhead of one sandboxed call: a trivial program (``pass``) run in the sandbox vs. the same
interpreter started as a plain subprocess (the baseline, measured in the same run).

    python bench/sandbox_overhead.py [--calls N]

For each isolation that works here: median and 90th percentile wall time per call (the private
directory's creation and removal, and the call's cgroup where one is used, included), and the
median overhead over the baseline.
The kinds of call are interleaved, so that each sees the same machine load. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybridrl.envs.sandbox import ISOLATIONS, Sandbox  # noqa: E402


def stats(times: list[float]) -> dict[str, float]:
    times = sorted(times)
    return {
        "median_ms": round(1000 * statistics.median(times), 1),
        "p90_ms": round(1000 * times[int(0.9 * (len(times) - 1))], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    out: dict = {"calls": args.calls, "cpus": os.cpu_count(), "modes": {}}
    boxes = {}
    for mode in ISOLATIONS:
        try:
            boxes[mode] = Sandbox(isolation=mode)
        except RuntimeError as e:
            out["modes"][mode] = {"unavailable": str(e)}
    if not boxes:
        print(json.dumps(out))
        return
    python = next(iter(boxes.values())).python
    runs = {"baseline": lambda: subprocess.run([python, "-I", "-c", "pass"], check=True)}
    runs.update({mode: (lambda b=box: b.run_python("pass")) for mode, box in boxes.items()})
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(args.calls + 1):  # interleaved, so that every kind sees the same load
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            if i:  # the first round warms up
                times[name].append(time.perf_counter() - start)
    out["python"], out["baseline_subprocess"] = python, stats(times.pop("baseline"))
    for mode, ts in times.items():
        out["modes"][mode] = stats(ts)
        out["modes"][mode]["overhead_median_ms"] = round(
            out["modes"][mode]["median_ms"] - out["baseline_subprocess"]["median_ms"], 1
        )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
