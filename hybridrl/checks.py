"""Checks of a whole config that need more than its schema, run before any work starts by the
command line and the Python API alike: plug-ins resolve, reward functions have a signature we can
call, optional packages (wandb, vllm, sglang, math-verify) are installed, and a dataset's files
hold the columns the config names. Each raises :class:`~hybridrl.config.ConfigError` with one
line."""

from __future__ import annotations

from hybridrl.config import Config, ConfigError


def check_config(cfg: Config) -> None:
    """Every check below, in order; the first problem raises."""
    check_plugins(cfg)
    check_rollout_backend(cfg)
    check_loggers(cfg)
    if cfg.data.train_files is not None:
        from hybridrl.data import check_data

        check_data(cfg)


def check_plugins(cfg: Config) -> None:
    """Resolve every registry name now, so a typo fails before any work; load every reward
    function (name, dotted path or callable) and check its signature and optional package."""
    from hybridrl.algorithms import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES
    from hybridrl.rollout import ROLLOUT_BACKENDS
    from hybridrl.tasks import TASKS
    from hybridrl.tasks.reward_signatures import RewardConfigError, resolve_reward_fns

    for key, registry, name in [
        ("task.name", TASKS, cfg.task.name),
        ("rollout.backend", ROLLOUT_BACKENDS, cfg.rollout.backend),
        ("algorithm.advantage", ADVANTAGES, cfg.algorithm.advantage),
        ("algorithm.policy_loss", POLICY_LOSSES, cfg.algorithm.policy_loss),
        ("algorithm.kl_estimator", KL_ESTIMATORS, cfg.algorithm.kl_estimator),
    ]:
        try:
            registry.get(name)
        except KeyError as e:
            raise ConfigError(f"config key {key!r}: {e.args[0]}") from None
    try:
        resolve_reward_fns(cfg)
    except RewardConfigError as e:
        raise ConfigError(f"config key {e.key!r}: {e.message}") from None


def check_loggers(cfg: Config) -> None:
    """A logger in ``trainer.loggers`` whose package is missing fails now, before any work."""
    if "wandb" in cfg.trainer.loggers:
        from hybridrl.telemetry.tracking import import_wandb

        try:
            import_wandb()
        except ImportError as e:
            raise ConfigError(f"config key 'trainer.loggers': {e}") from None


def check_rollout_backend(cfg: Config) -> None:
    """A rollout backend whose package is missing (vllm, sglang) fails now, before any worker
    starts, naming the extra that installs it."""
    from hybridrl.rollout.backends import missing_requirement

    problem = missing_requirement(cfg.rollout.backend)
    if problem:
        raise ConfigError(f"config key 'rollout.backend': {problem}")
