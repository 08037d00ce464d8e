"""What the synchronous and the asynchronous drivers share: start a run (warm start, resume, roles,
evaluator, logger, the held-out evaluation before training) and end it (summary and report)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from hybridrl.config import Config, to_dict
from hybridrl.driver.checkpoint import latest_checkpoint
from hybridrl.driver.evaluate import Evaluator
from hybridrl.driver.placement import Roles, build_roles
from hybridrl.driver.run_dir import open_run_dir, run_path, write_summary
from hybridrl.driver.sft import ensure_warm_start
from hybridrl.models.loading import load_tokenizer, make_task
from hybridrl.rollout import SamplingParams
from hybridrl.telemetry import MetricsLogger, PhaseTimer, write_report
from hybridrl.telemetry.samples import sample_rows
from hybridrl.telemetry.watchdog import Watchdog

log = logging.getLogger(__name__)


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

    def due(self, every: int, done: int) -> bool:
        return bool(every and done % every == 0) or done == self.cfg.trainer.total_steps

    def log_samples(self, done: int, samples) -> None:
        """A table of sample completions when one is due (every ``trainer.log_samples_every`` steps
        and at the last step; never when it is 0): of ``samples``, a list or a function that
        returns one (called only then)."""
        t = self.cfg.trainer
        if t.log_samples_every and self.due(t.log_samples_every, done):
            samples = samples() if callable(samples) else samples
            self.logger.log_samples(done, sample_rows(samples, self.tokenizer, done, t.log_samples))

    def close(self, last: dict) -> dict:
        """Write ``summary.json`` and ``report.png``; returns the summary."""
        t, before = self.cfg.trainer, self.state["before"]
        summary = {
            "accuracy_before": before["eval/accuracy"],
            "accuracy_after": last["eval/accuracy"],
            "greedy_accuracy_before": before["eval/greedy_accuracy"],
            "greedy_accuracy_after": last["eval/greedy_accuracy"],
            "steps": t.total_steps,
            "wall_seconds": time.perf_counter() - self.t_start,
            "run_dir": str(self.run_dir),
            "warm_start": self.warm,
            "resumed_from_step": self.state["step"] if self.resumed else None,
            "mode": t.mode,
        }
        write_summary(self.run_dir, summary)
        a = self.cfg.algorithm
        write_report(
            self.run_dir,
            title=f"{t.name}: {a.advantage} / {a.policy_loss} on {self.cfg.task.name} ({t.mode})",
        )
        return summary


def open_session(cfg: Config, resume: bool) -> Session:
    """Warm start, latest checkpoint (``resume``), roles with the checkpoint's weights synced to the
    rollout, and the held-out evaluation before training (once per run)."""
    t_start, t = time.perf_counter(), cfg.trainer
    warm = ensure_warm_start(cfg, t.progress)
    found = latest_checkpoint(run_path(cfg)) if resume else None
    if resume and not found:
        log.warning(
            "--resume: no complete checkpoint that verifies under %s, starting a fresh run",
            run_path(cfg),
        )
    elif found:
        log.info("--resume: from %s", found[0])
    run_dir = open_run_dir(cfg, resume=found is not None)
    state = found[1] if found else {"step": 0, "prompt_cursor": 0, "reference_path": warm}
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
        task, tokenizer = make_task(cfg), load_tokenizer(cfg, warm)
        params = SamplingParams.of(cfg, n=t.samples_per_prompt)  # data.stop too
        evaluate = Evaluator(
            roles.rollout,
            task.heldout()[: cfg.task.eval_size],
            tokenizer,
            params,
            seed=t.seed + 10_000,
        )
        logger = MetricsLogger(
            run_dir,
            "tensorboard" in t.loggers,
            resume_step=state["step"] if found else None,
            alerts=cfg.alerts,
            max_staleness=cfg.asynchronous.max_staleness,
            wandb=(
                {"project": t.wandb_project, "name": t.name, "config": to_dict(cfg)}
                if "wandb" in t.loggers
                else None
            ),
        )
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
        )
        s.watchdog = Watchdog(t.step_timeout_s, run_dir / "hang", roles.groups)
        if "before" not in state:
            with s.timer.phase("eval"):
                state["before"] = evaluate()
            logger.log(0, state["before"])
        s.timer.pop()
    except BaseException:
        roles.shutdown()
        raise
    return s
