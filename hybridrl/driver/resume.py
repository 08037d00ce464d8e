"""A resume: which checkpoint a run goes on from, and what may differ since it was saved.

``hybridrl train --resume`` goes on from the run's latest checkpoint, ``--resume-from PATH`` from a
chosen one (a checkpoint directory, or a run directory for its latest); the run goes on in that
checkpoint's run directory, and the checkpoints of later steps are replaced as the run saves again.
A resume is refused, in one line, when the data files' bytes changed since the checkpoint was saved
(``data/fingerprint.py``; ``--resume-changed-data`` goes on) and when the config differs from the
checkpoint's ``config.yaml`` in a key that changes what is trained (``--resume-changed-config`` goes
on): every key but those of :data:`RESUMABLE_CHANGES`, which say how long to train, how often to
save, evaluate and log, where metrics go, timeouts, threads and engine memory.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path

import yaml

from hybridrl.config import Config, ConfigError, dump_yaml

log = logging.getLogger(__name__)

# the config keys a resume may change without changing what is trained: how long, how often to
# save, evaluate and log, where metrics go, timeouts and threads (prefixes end with a dot)
RESUMABLE_CHANGES = (
    "trainer.total_steps",
    "trainer.save_every",
    "trainer.keep_checkpoints",
    "trainer.async_save",
    "trainer.eval_every",
    "trainer.log_every",
    "trainer.log_samples",
    "trainer.log_samples_every",
    "trainer.loggers",
    "trainer.wandb_project",
    "trainer.progress",
    "trainer.profile_steps",
    "trainer.profile_record_shapes",
    "trainer.prefetch_steps",
    "trainer.step_timeout_s",
    "trainer.max_restarts",
    "trainer.name",
    "trainer.runs_dir",
    "controller.num_threads",
    "controller.pg_timeout_s",
    "rollout.timeout_s",
    # the engine's memory and batching: the same samples' distribution
    "rollout.backend_options.max_batch_size",
    "rollout.backend_options.kv_cache_bytes",
    "rollout.backend_options.block_size",
    "rollout.backend_options.max_num_batched_tokens",
    "rollout.backend_options.enable_prefix_caching",
    "rollout.backend_options.kv_cache_memory_fraction",
    "rollout.backend_options.gpu_memory_utilization",
    "controller.ray_address",
    "env.step_timeout_s",
    "env.max_concurrent_steps",
    "task.reward_timeout_s",
    "task.eval_size",
    "data.train_files",  # moved files are the same data: their bytes are compared instead
    "data.val_files",
    "model.path",  # the weights come from the checkpoint
    "sft.",
    "eval.",
    "alerts.",
)


@dataclass(frozen=True)
class Resume:
    """How a run resumes (``hybridrl train --resume``, ``--resume-from PATH``; the Python API's
    ``resume=Resume(...)``, where ``True`` is ``Resume()``): from ``checkpoint`` (a checkpoint
    directory, or a run directory for its latest checkpoint; None: the run's own latest), refused
    when the data files changed since it was saved unless ``changed_data``, and when keys that
    change training differ from its config unless ``changed_config``."""

    checkpoint: str | None = None
    changed_data: bool = False
    changed_config: bool = False


def changed_training_keys(saved: dict, cfg: Config) -> list[str]:
    """``"key: old -> new"`` for each key outside :data:`RESUMABLE_CHANGES` whose value in ``cfg``
    differs from ``saved`` (a checkpoint's config.yaml, read)."""
    old, new = flat(with_backend_options(saved)), flat(with_backend_options(dump_yaml(cfg)))
    return [
        f"{name}: {old.get(name)!r} -> {new.get(name)!r}"
        for name in sorted(old.keys() | new.keys())
        if old.get(name) != new.get(name)
        and not any(
            name == k or (k.endswith(".") and name.startswith(k)) for k in RESUMABLE_CHANGES
        )
    ]


def with_backend_options(config: dict | str) -> dict:
    """A config (a dict read from config.yaml, or its text) with ``rollout.backend_options`` as the
    backend reads them, every option at its value or default, so that a default left out and the
    same value written compare equal. A checkpoint saved before the backends owned their options
    has them as ``rollout.<key>``: they are read from there (the backend's own only)."""
    from dataclasses import asdict

    from hybridrl.config import RolloutConfig
    from hybridrl.config.aliases import MOVED
    from hybridrl.rollout import ROLLOUT_BACKENDS

    tree = yaml.safe_load(config) if isinstance(config, str) else dict(config)
    rollout = dict(tree.get("rollout") or {})
    backend = ROLLOUT_BACKENDS.get(rollout.get("backend", "native"))
    given = dict(rollout.get("backend_options") or {})
    declared = {f.name for f in fields(backend.options)} if backend.options else set()
    for key in [k for k in list(rollout) if f"rollout.{k}" in MOVED]:  # the former layout
        value = rollout.pop(key)
        if key in declared:
            given.setdefault(key, value)
    try:
        options = backend.read_options(RolloutConfig(backend_options=given))
    except ConfigError:  # options this code does not read: compared as they were written
        options = None
    rollout["backend_options"] = given if options is None else asdict(options)
    return tree | {"rollout": rollout}


def flat(tree: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; a mapping inside a key (a plug-in's options, an
    environment's arguments) is walked too, so each of its entries is a key of its own."""
    out = {}
    for key, value in (tree or {}).items():
        if isinstance(value, dict):  # an empty one adds no key: {} and its defaults are alike
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def chosen_checkpoint(path: Path) -> tuple[Path, dict]:
    """``--resume-from PATH``: the checkpoint at ``path``, or a run directory's latest, with its
    ``trainer.json``; a :class:`ConfigError` (one line) when it is neither or does not verify."""
    from hybridrl.driver.checkpoint import CheckpointError, latest_checkpoint, verify_checkpoint

    if (path / "checkpoints").is_dir():
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(
                f"--resume-from {str(path)!r}: the run holds no checkpoint that verifies"
            )
        return found
    if not (path / "trainer.json").is_file():
        raise ConfigError(
            f"--resume-from {str(path)!r} is not a checkpoint (runs/<name>/checkpoints/step_N) "
            "or a run directory (runs/<name>)"
        )
    problem, state, has_manifest = verify_checkpoint(path)
    if problem or not has_manifest:
        raise CheckpointError(f"--resume-from {str(path)!r}: {problem or 'it has no manifest'}")
    return path, state


def check_config_unchanged(ckpt: Path, cfg: Config, force: bool) -> None:
    """Refuse (:class:`ConfigError`, one line listing them) a resume under keys that change
    training; with ``force``, log them and go on."""
    if not (ckpt / "config.yaml").is_file():
        return
    changes = changed_training_keys(yaml.safe_load((ckpt / "config.yaml").read_text()), cfg)
    if not changes:
        return
    what = f"the config differs from the checkpoint {str(ckpt)!r}'s in keys that change training: "
    what += "; ".join(changes)
    if force:
        log.warning("--resume-changed-config: %s; the run goes on with the new values", what)
        return
    raise ConfigError(
        f"{what}. Resume under the checkpoint's config.yaml, start a new run (another "
        "trainer.name), or go on with the new values: --resume-changed-config"
    )
