"""What the synchronous and the asynchronous drivers share: start a run (warm start, resume or
restart, roles, evaluator, logger, the held-out evaluation before training) and end it (summary and
report)."""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from hybridrl.config import Config, to_dict
from hybridrl.controller.health import DeathWatch
from hybridrl.data import DatasetTask
from hybridrl.data.fingerprint import STATE_KEY, check_unchanged, data_fingerprint
from hybridrl.driver.checkpoint import latest_checkpoint, list_checkpoints
from hybridrl.driver.evaluate import Evaluator
from hybridrl.driver.placement import Roles, build_roles
from hybridrl.driver.restarts import Faults
from hybridrl.driver.resume import Resume, check_config_unchanged, chosen_checkpoint
from hybridrl.driver.run_dir import open_run_dir, run_path, write_summary
from hybridrl.driver.sft import ensure_warm_start
from hybridrl.models.loading import load_tokenizer, make_task
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.scoring import RewardsFailedError
from hybridrl.telemetry import MetricsLogger, PhaseTimer, write_report
from hybridrl.telemetry.samples import sample_rows
from hybridrl.telemetry.sinks import read_metrics
from hybridrl.telemetry.watchdog import Watchdog

log = logging.getLogger(__name__)

TRACE_FILE = "trajectories.jsonl"  # per step the trained prompts' uids (async: their staleness)


class FaultLogger:
    """The run's :class:`MetricsLogger` with the ``fault/*`` counters added to every step's line
    once the run has restarted; remembers the last step logged (the steps a restart loses)."""

    def __init__(self, logger: MetricsLogger, faults: Faults):
        self.logger, self.faults = logger, faults

    def log(self, step: int, metrics) -> None:
        if step > 0:
            metrics = {**metrics, **self.faults.metrics()}
        self.logger.log(step, metrics)
        self.faults.reached = max(self.faults.reached, step)

    def __getattr__(self, name: str):
        return getattr(self.logger, name)


@dataclass
class Session:
    cfg: Config
    roles: Roles
    task: object
    tokenizer: object
    params: SamplingParams  # the rollout's sampling (n = G)
    evaluate: Evaluator
    logger: MetricsLogger
    timer: PhaseTimer
    run_dir: Path
    state: dict  # trainer.json of the checkpoint resumed from, or a fresh one
    resumed: bool
    warm: str | None
    t_start: float  # perf_counter() when the run began (before the warm start)
    # stops a step past trainer.step_timeout_s (stacks to <run>/hang/); the drivers arm it per step
    watchdog: Watchdog | None = None
    # restarts and lost steps (driver/restarts.py)
    faults: Faults = field(default_factory=lambda: Faults(0))
    # steps in a row whose every reward failed (task.max_failed_reward_steps stops the run)
    failed_reward_steps: int = 0

    def due(self, every: int, done: int) -> bool:
        return bool(every and done % every == 0) or done == self.cfg.trainer.total_steps

    def check_rewards(self, done: int, out: dict) -> None:
        """After step ``done`` is logged: raise :class:`RewardsFailedError` once every sample's
        reward failed (raised, timed out, not finite, scored by no function; or its environment
        failed) in ``task.max_failed_reward_steps`` steps in a row. A run whose reward cannot
        score anything trains on zeros: it stops, naming the function and its first error."""
        failed, scored, first = out["reward_failures"]
        self.failed_reward_steps = self.failed_reward_steps + 1 if failed == scored > 0 else 0
        limit = self.cfg.task.max_failed_reward_steps
        if limit and self.failed_reward_steps >= limit:
            raise RewardsFailedError(
                f"every reward failed in {limit} steps in a row (steps {done - limit + 1}-{done}); "
                f"the first error: {first}; fix the reward function (task.reward_fn), or raise "
                "task.max_failed_reward_steps (0: never stop)"
            )

    def log_samples(self, done: int, samples) -> None:
        """A table of sample completions when one is due (every ``trainer.log_samples_every`` steps
        and at the last step; never when it is 0): of ``samples``, a list or a function that
        returns one (called only then)."""
        t = self.cfg.trainer
        if t.log_samples_every and self.due(t.log_samples_every, done):
            samples = samples() if callable(samples) else samples
            self.logger.log_samples(done, sample_rows(samples, self.tokenizer, done, t.log_samples))

    def trace(self, done: int, out: dict) -> None:
        """Append step ``done``'s trained prompt uids and each sample's staleness (versions behind)
        from the learner's ``train_step`` result to ``trajectories.jsonl``."""
        line = {"step": done, "uids": out["uids"], "staleness": out["staleness"]}
        with open(self.run_dir / TRACE_FILE, "a") as f:
            f.write(json.dumps(line) + "\n")

    def watch_rollout(self, on_death):
        """Asynchronous training under ``ray``: ``on_death(message)`` once a rollout rank is found
        dead (a :class:`DeathWatch`; ``stop()`` ends it), else a watch that does nothing."""
        group = getattr(self.roles.rollout, "group", self.roles.rollout)  # a RoleView's group
        if group.backend_name != "ray":
            return _NoWatch()
        return DeathWatch(group, on_death)

    def close(self, last: dict) -> dict:
        """Write ``summary.json`` and ``report.png``; returns the summary."""
        t, before = self.cfg.trainer, self.state["before"]
        checkpoints = list_checkpoints(self.run_dir)
        binary = last.get("eval/reward_binary", before.get("eval/reward_binary", 1.0))
        summary = {
            # the held-out mean reward: an accuracy where every reward was 0 or 1
            "eval_metric": "accuracy" if binary else "mean reward",
            "accuracy_before": before["eval/accuracy"],
            "accuracy_after": last["eval/accuracy"],
            "greedy_accuracy_before": before["eval/greedy_accuracy"],
            "greedy_accuracy_after": last["eval/greedy_accuracy"],
            "steps": self.faults.reached if self.watchdog.stop_requested else t.total_steps,
            # the signal that stopped the run early (it saved a checkpoint first), or null
            "stopped_by": self.watchdog.stop_requested,
            "wall_seconds": time.perf_counter() - self.t_start,
            "run_dir": str(self.run_dir),
            "warm_start": self.warm,
            "resumed_from_step": self.state["step"] if self.resumed else None,
            "mode": t.mode,
            "restarts": self.faults.restarts,
            "lost_steps": self.faults.lost_steps,
            **reward_failure_totals(self.run_dir),
            "final_checkpoint": str(checkpoints[-1]) if checkpoints else None,
        }
        write_summary(self.run_dir, summary)
        a, files = self.cfg.algorithm, self.cfg.data.train_files
        data = Path(files[0] if isinstance(files, list) else files).name if files else None
        data = data or self.cfg.task.name
        write_report(
            self.run_dir, title=f"{t.name}: {a.advantage} / {a.policy_loss} on {data} ({t.mode})"
        )
        return summary


class _NoWatch:
    def stop(self) -> None:
        pass


def reward_failure_totals(run_dir: Path) -> dict[str, int]:
    """``reward_errors``, ``reward_timeouts`` and ``reward_nonfinite``: the failed reward calls of
    the trained samples over the whole run, summed from ``metrics.jsonl`` (so a resumed run counts
    the steps before the resume too)."""
    totals = dict.fromkeys(("reward_errors", "reward_timeouts", "reward_nonfinite"), 0.0)
    for row in read_metrics(run_dir):
        if row.get("step", 0) > 0:
            for key in totals:
                totals[key] += row.get(key.replace("_", "/", 1), 0.0)
    return {k: int(v) for k, v in totals.items()}


def _truncate_trace(run_dir: Path, step: int) -> None:
    """Drop the ``trajectories.jsonl`` lines of steps after ``step`` (they are done again)."""
    path = run_dir / TRACE_FILE
    if path.exists():
        lines = path.read_text().splitlines(keepends=True)
        path.write_text("".join(x for x in lines if x.strip() and json.loads(x)["step"] <= step))


def open_session(cfg: Config, resume: bool | Resume, faults: Faults | None = None) -> Session:
    """Warm start, the checkpoint to resume from (``resume``, :class:`Resume`), roles with the
    checkpoint's weights synced to the rollout, and the held-out evaluation before training (once
    per run). ``faults``: the run's restart counters (``driver/restarts.py``); when it says a
    restart is under way, the newest checkpoint is restored like ``resume``, and without one the run
    starts again from step 0 in its own directory. The data files' hashes go into the trainer state;
    a resume refuses files that differ from the checkpoint's, and keys that change training."""
    t_start, t = time.perf_counter(), cfg.trainer
    faults = faults or Faults(t.max_restarts)
    restart = faults.restarting is not None
    resume = Resume() if resume is True else resume or None
    warm = ensure_warm_start(cfg, t.progress)
    if resume and resume.checkpoint and not restart:
        found = chosen_checkpoint(Path(resume.checkpoint))
    else:
        found = latest_checkpoint(run_path(cfg)) if resume or restart else None
    if resume and not found and not restart:
        log.warning(
            "--resume: no complete checkpoint that verifies under %s, starting a fresh run",
            run_path(cfg),
        )
    elif found:
        log.info("%s: from %s", "restart" if restart else "--resume", found[0])
    # a restart goes on with the state it left; a fresh run records the data, --resume compares
    prints = data_fingerprint(cfg) if not (restart and found) else None
    if found and not restart:
        check_unchanged(found[1].get(STATE_KEY), prints, cfg, found[0], resume.changed_data)
        check_config_unchanged(found[0], cfg, resume.changed_config)
    task = make_task(cfg)
    if isinstance(task, DatasetTask):  # every row read and checked before any model is built
        task.rows()
    run_dir = open_run_dir(cfg, resume=found is not None or restart)
    state = found[1] if found else {"step": 0, "prompt_cursor": 0, "reference_path": warm}
    if prints is not None:
        state[STATE_KEY] = prints  # saved in every checkpoint's trainer.json
    if restart and not found and faults.before is not None:
        state["before"] = faults.before  # a restart before the first checkpoint keeps it
    if not restart:
        faults.load(state.get("fault"))
    # lines after the restored step are done again: dropped (all but step 0's "before" when
    # restarting without a checkpoint, everything when that is not known either)
    resume_step = state["step"] if found else (None if not restart else 0 if "before" in state
                                               else -1)  # fmt: skip
    if resume_step is not None:
        _truncate_trace(run_dir, resume_step)
    ckpt = found[0] if found else None
    roles = build_roles(
        cfg,
        str(ckpt / "model") if ckpt else warm,
        state["reference_path"],
        str(ckpt / "critic") if ckpt and (ckpt / "critic").is_dir() else None,
    )
    try:
        if ckpt:
            critic = ckpt / "critic"
            roles.learner.load_state(str(ckpt / "model"), str(critic) if critic.is_dir() else None)
            roles.sync_weights(state["step"])
        roles.learner.set_kl_reward_coef(state.get("kl_reward_coef"))
        tokenizer = load_tokenizer(cfg, warm)
        params = SamplingParams.of(cfg, n=t.samples_per_prompt)  # data.stop too
        heldout = task.heldout()[: cfg.task.eval_size]
        evaluate = Evaluator.of(cfg, roles.rollout, heldout, tokenizer, run_dir / "eval")
        for group in roles.groups:  # the rollout's generate calls (ray only: controller/health.py)
            for call in ("rollout.generate", "rollout.fill_stream"):
                group.set_call_timeout(call, cfg.rollout.timeout_s, "rollout.timeout_s")
        if cfg.controller.backend == "ray" and (cfg.rollout.timeout_s or 0) >= t.step_timeout_s:
            log.warning(
                "rollout.timeout_s=%g is not below trainer.step_timeout_s=%g: a generate call that "
                "hangs stops the run (step watchdog) before it could restart it",
                cfg.rollout.timeout_s,
                t.step_timeout_s,
            )
        logger = MetricsLogger(
            run_dir,
            "tensorboard" in t.loggers,
            resume_step=resume_step,
            alerts=cfg.alerts,
            max_staleness=cfg.max_staleness,
            wandb=(
                {"project": t.wandb_project, "name": t.name, "config": to_dict(cfg)}
                if "wandb" in t.loggers
                else None
            ),
            # a log file, not a terminal with a progress bar: a metrics line now and then
            console_every=0 if t.progress and sys.stderr.isatty() else t.log_every,
            total_steps=t.total_steps,
        )
        if restart:
            faults.restarted(run_dir, state["step"])
        faults.reached = state["step"]
        state["fault"] = faults.state()  # saved in every checkpoint's trainer.json
        s = Session(
            cfg,
            roles,
            task,
            tokenizer,
            params,
            evaluate,
            logger,
            PhaseTimer(),
            run_dir,
            state,
            found is not None,
            warm,
            t_start,
            faults=faults,
        )
        s.logger = FaultLogger(logger, faults)
        s.watchdog = Watchdog(t.step_timeout_s, run_dir / "hang", roles.groups)
        if "before" not in state:
            with s.timer.phase("eval"):
                # eval.before off: null figures (NaN is logged as null)
                skipped = dict.fromkeys(("eval/accuracy", "eval/greedy_accuracy"), math.nan)
                state["before"] = evaluate(0) if cfg.eval.before else skipped
            data = task.data_metrics() if isinstance(task, DatasetTask) else {}
            logger.log(0, {**state["before"], **data})
        faults.before = state["before"]
        s.timer.pop()
    except BaseException:
        roles.shutdown()
        raise
    return s
