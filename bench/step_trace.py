"""Which of hybridrl's modules and functions one training step runs through (a measure of how much
code a newcomer follows to read a step, not of speed).

    python bench/step_trace.py [--config examples/arith_grpo.yaml] [--out FILE] [key=value ...]

One session of the config (the default job: W1, GRPO, synchronous, the local backend), its feed
started, one step untraced, then the second step traced: the learner's step, the weight sync and the
feed's statistics, on every thread of the process (the rollout's scoring thread and prompt
prefetcher included; under the local backend every role lives in it). A function counts once, by
its module and qualified name. Extra ``key=value`` arguments override the config (e.g.
``sft.checkpoint=DIR`` to reuse a warm start, ``trainer.mode=async``).

Prints one JSON object: the counts, and the modules with how many of their functions ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import hybridrl  # noqa: E402
from hybridrl.config import Config, load_config  # noqa: E402
from hybridrl.driver.loop import Feed  # noqa: E402
from hybridrl.driver.session import open_session  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--config", default=str(ROOT / "examples" / "arith_grpo.yaml"))
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("overrides", nargs="*", help="config key=value")
    args = ap.parse_args()
    package = str(Path(hybridrl.__file__).parent)
    runs = tempfile.mkdtemp(prefix="bench_step_trace_")
    cfg = load_config(
        Config,
        args.config,
        ["trainer.progress=false", "trainer.loggers=[jsonl]", "task.eval_size=8",
         f"trainer.runs_dir={runs}", *args.overrides],
    )  # fmt: skip
    seen: set[tuple[str, str]] = set()
    counting = threading.Event()

    def note(frame, event, arg):
        code = frame.f_code
        if event == "call" and counting.is_set() and code.co_filename.startswith(package):
            seen.add((os.path.relpath(code.co_filename, package), code.co_qualname))

    session = open_session(cfg, resume=False)
    feed = Feed(session)
    threading.setprofile(note)  # every thread started from here on (the feed's among them)
    sys.setprofile(note)
    try:
        feed.start()
        feed.train_step(0)  # first-call work (compilation, caches) stays out of the count
        feed.sync_weights(1)
        counting.set()
        out = feed.train_step(1)
        feed.sync_weights(2)
        feed.stats(out, 1.0)
        counting.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        feed.close()
        session.logger.close()
        session.roles.shutdown()
    modules = Counter(module for module, _ in seen)
    result = {
        "config": [args.config, *args.overrides],
        "modules": len(modules),
        "functions": len(seen),
        "functions_per_module": dict(sorted(modules.items())),
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
    }
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
