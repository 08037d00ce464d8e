"""Chaos: W1 runs whose workers are SIGKILLed at random times, against the same runs unkilled.

    python bench/chaos.py [--steps 30] [--save-every 5] [--kills 3] [--seed 0] [--out-dir DIR]
                          [--modes sync,async]

W1 (``examples/arith_grpo.yaml``: GRPO, tiny model, 32 prompts x 8 samples per step, the native
engine) under the ``ray`` backend, learner and rollout on pools of their own (one process each,
one torch thread), shortened to ``--steps`` steps with a checkpoint every ``--save-every``, from
the cached W1 warm start (``--warm-start``; trained on first use). For each mode (synchronous, and
asynchronous with ``asynchronous.max_staleness`` 1) it runs the job once unkilled and once with
``--kills`` kills drawn from ``--seed``: kill i SIGKILLs rank 0 of the learner or of the rollout
(both roles among the first two kills) a random 0-2 s after the run has logged step s_i (steps
at least 3 apart), by pid, from a thread of this process; the killed run restarts by itself
(``trainer.max_restarts``). Per mode it reports

* ``completed``: the killed run reached its last step; ``restarts``, ``lost_steps`` (steps done
  again), the ``kills`` (step, role, pid, seconds after the step);
* ``trained_twice``: prompts trained more than once in the final lineage (``trajectories.jsonl``:
  the trained prompts' uids per step, steps after a restored checkpoint dropped on restart): must
  be 0;
* ``accuracy_after`` / ``accuracy_after_unkilled`` (held-out, sampled, 1,024 prompts) and, in
  synchronous mode, ``weights_equal``: the final weights equal the unkilled run's bit for bit;
* ``wall_s`` / ``wall_s_unkilled``.

Prints one JSON object (Ray's own reports of the killed workers may come before it on stdout) and
writes it to ``<out-dir>/chaos.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
EXAMPLE = ROOT / "examples" / "arith_grpo.yaml"
TWO_POOLS = [
    "controller.pools={train: {cpus_per_worker: 1}, gen: {cpus_per_worker: 1}}",
    "controller.placement={learner: train, rollout: gen}",
]
MODES = {"sync": [], "async": ["trainer.mode=async", "asynchronous.max_staleness=1"]}


def schedule(seed: int, kills: int, steps: int) -> list[dict]:
    """``kills`` kills: steps at least 3 apart in 3..steps-2, roles (learner and rollout both among
    the first two), delays of 0-2 s after the step is logged."""
    rng = random.Random(seed)
    for _ in range(1000):
        at = sorted(rng.sample(range(3, steps - 1), kills))
        if all(b - a >= 3 for a, b in zip(at, at[1:])):
            break
    roles = rng.sample(["learner", "rollout"], 2) + [
        rng.choice(["learner", "rollout"]) for _ in range(kills - 2)
    ]
    return [
        {"step": s, "role": r, "delay_s": round(rng.uniform(0.0, 2.0), 2)}
        for s, r in zip(at, roles[:kills])
    ]


def logged_step(run_dir: Path) -> int:
    try:
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    except FileNotFoundError:
        return -1
    return max((json.loads(x)["step"] for x in lines if x.strip()), default=-1)


class Killer:
    """Kills per ``plan`` from a thread; finds each live run's groups by wrapping the session's
    ``build_roles`` (a restart builds new ones; kill i waits until no process of the live run is
    one killed before)."""

    def __init__(self, run_dir: Path, plan: list[dict]):
        from hybridrl.driver import session

        self.run_dir, self.plan, self.done = run_dir, plan, []
        self.built: list = []
        self._session, self._original = session, session.build_roles
        session.build_roles = self._build
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _build(self, *args, **kwargs):
        self.built.append(self._original(*args, **kwargs))
        return self.built[-1]

    def _recovered(self, killed: set[int]) -> bool:
        """Whether the live run has come back from the kills so far: its roles' processes (a
        restart builds new ones; an asynchronous run replaces a dead rollout in place) are none of
        the killed ones."""
        if not self.built:
            return False
        try:
            pids = {p["pid"] for r in ("learner", "rollout")
                    for p in getattr(self.built[-1], r).processes()}  # fmt: skip
        except Exception:  # a group being torn down or rebuilt
            return False
        return not pids & killed

    def _run(self) -> None:
        killed: set[int] = set()
        for kill in self.plan:
            while not self._stop.is_set():
                if self._recovered(killed) and logged_step(self.run_dir) >= kill["step"]:
                    break
                time.sleep(0.05)
            if self._stop.wait(kill["delay_s"]):
                return
            group = getattr(self.built[-1], kill["role"])
            pid = group.processes()[0]["pid"]
            killed.add(pid)
            with contextlib.suppress(ProcessLookupError):  # already gone: counted as a kill
                os.kill(pid, signal.SIGKILL)
            self.done.append(kill | {"pid": pid, "logged_step": logged_step(self.run_dir)})
            print(f"chaos: killed {kill['role']} pid {pid} at step {kill['step']}", file=sys.stderr)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._session.build_roles = self._original


def job(args, name: str, mode: str):
    from hybridrl.config import Config, load_config

    return load_config(
        Config,
        str(EXAMPLE),
        [
            "controller.backend=ray",
            "controller.num_threads=1",
            *TWO_POOLS,
            *MODES[mode],
            f"sft.checkpoint={args.warm_start}",
            f"trainer.total_steps={args.steps}",
            "trainer.eval_every=0",
            f"trainer.save_every={args.save_every}",
            f"trainer.keep_checkpoints={args.steps}",
            f"trainer.max_restarts={args.kills + 2}",
            f"trainer.seed={args.seed}",
            f"trainer.runs_dir={args.out_dir / 'runs'}",
            f"trainer.name={name}",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "trainer.log_samples_every=0",
        ],
    )


def lineage(run_dir: Path) -> list[str]:
    rows = [json.loads(x) for x in (run_dir / "trajectories.jsonl").read_text().splitlines()]
    return [u for r in rows for u in r["uids"]]


def final_weights(run_dir: Path):
    from safetensors.torch import load_file

    last = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    return load_file(last / "model" / "model.safetensors")


def one_mode(args, mode: str) -> dict:
    from hybridrl.api import run

    t0 = time.perf_counter()
    straight = run(job(args, f"chaos_{mode}_unkilled", mode))
    wall_straight = time.perf_counter() - t0
    plan = schedule(args.seed, args.kills, args.steps)
    name = f"chaos_{mode}_killed"
    killer = Killer(args.out_dir / "runs" / name, plan)
    t0, error = time.perf_counter(), None
    try:
        summary = run(job(args, name, mode))
    except Exception as exc:  # noqa: BLE001 - reported as not completed
        summary, error = None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    finally:
        killer.close()
    wall = time.perf_counter() - t0
    out = {"completed": summary is not None, "kills": killer.done, "error": error}
    if summary is None:
        return out
    run_dir, base = Path(summary["run_dir"]), Path(straight["run_dir"])
    uids = lineage(run_dir)
    out |= {
        "restarts": summary["restarts"],
        "lost_steps": summary["lost_steps"],
        "trained_twice": len(uids) - len(set(uids)),
        "same_prompts_as_unkilled": uids == lineage(base),
        "accuracy_after": summary["accuracy_after"],
        "accuracy_after_unkilled": straight["accuracy_after"],
        "accuracy_before": summary["accuracy_before"],
        "wall_s": round(wall, 1),
        "wall_s_unkilled": round(wall_straight, 1),
    }
    if mode == "sync":
        a, b = final_weights(run_dir), final_weights(base)
        out["weights_equal"] = a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--kills", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--modes", default="sync,async")
    p.add_argument("--out-dir", type=Path, default=ROOT / "runs" / "chaos")
    p.add_argument(
        "--warm-start",
        type=Path,
        default=None,
        help="the W1 warm start (default: its cache under checkpoints/warmstart/)",
    )
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if args.warm_start is None:
        from hybridrl.config import Config, load_config
        from hybridrl.driver.sft import warm_start_path

        args.warm_start = warm_start_path(load_config(Config, str(EXAMPLE), []))
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    import ray

    from hybridrl.controller import init_ray

    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    init_ray()
    try:
        results = {mode: one_mode(args, mode) for mode in args.modes.split(",")}
    finally:
        ray.shutdown()
    text = json.dumps(
        {
            "date": datetime.date.today().isoformat(),
            "commit": commit,  # when the bench started
            "steps": args.steps,
            "save_every": args.save_every,
            "seed": args.seed,
            "schedule": schedule(args.seed, args.kills, args.steps),
            "warm_start": str(args.warm_start),
            **results,
        },
        indent=1,
    )
    (args.out_dir / "chaos.json").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
