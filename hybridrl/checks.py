"""Checks of a whole config that need more than its schema, run before any work starts by the
command line and the Python API alike: plug-ins resolve, reward functions have a signature we can
call, optional packages (wandb, vllm, sglang, math-verify) are installed, a step's samples fit in
the machine's memory, and a dataset's files hold the columns the config names. Each raises
:class:`~hybridrl.config.ConfigError` with one line."""

from __future__ import annotations

from hybridrl.config import Config, ConfigError


def check_config(cfg: Config) -> None:
    """Every check below, in order; the first problem raises."""
    check_plugins(cfg)
    check_rollout_backend(cfg)
    check_moe(cfg)
    check_loggers(cfg)
    check_run_dir(cfg)
    check_step_memory(cfg)
    check_kv_pool(cfg)
    check_dataset(cfg)
    check_reward_columns(cfg)


def check_dataset(cfg: Config) -> None:
    """``data.train_files``' first rows (``data/check.py``: ``check_data``), and with an
    environment each first row's first turn (:func:`check_first_turn`)."""
    if cfg.data.train_files is None:
        return
    from hybridrl.data import check_data

    first_rows = check_data(cfg)
    if cfg.env.name is not None and first_rows:
        from hybridrl.models.loading import load_tokenizer

        tokenizer = load_tokenizer(cfg, cfg.model.path)
        for where, prompt in first_rows:
            check_first_turn(cfg, tokenizer, prompt, where)


def check_first_turn(cfg: Config, tokenizer, prompt, where: str) -> None:
    """A multi-turn prompt (``env.name`` set) whose first turn cannot fit the model's positions:
    the prompt, the environment's reset observation (e.g. the tool schemas of ``describe_tools``)
    and ``rollout.max_new_tokens`` for the model's first turn. Such a run would end every
    trajectory at once, empty and truncated."""
    positions = cfg.model.max_positions()
    if positions is None:
        return
    from hybridrl.data import DataError
    from hybridrl.rollout.multiturn import first_turn_context

    ids = list(prompt.token_ids)
    try:
        context = first_turn_context(cfg, tokenizer, prompt, ids)
    except Exception as e:
        message = " ".join(str(e).split()) or type(e).__name__
        raise DataError(f"{where}: the environment's reset failed on this prompt: {message}") from e
    need = len(context) + cfg.rollout.max_new_tokens
    if need > positions:
        raise DataError(
            f"{where}: the first turn needs {need} positions, above the model's {positions}: "
            f"the prompt ({len(ids)} tokens), the environment's reset observation "
            f"({len(context) - len(ids)} tokens) and rollout.max_new_tokens="
            f"{cfg.rollout.max_new_tokens}; shorten the prompts or the observation (env.kwargs, "
            "e.g. describe_tools), or lower rollout.max_new_tokens"
        )


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
    check_episode(cfg)


def check_episode(cfg: Config) -> None:
    """``rollout.episode`` loads and is an ``async def`` of (gen, prompt, params), or, with
    ``env.name`` set, a subclass of the environment's episode."""
    import inspect

    from hybridrl.registry import load_dotted
    from hybridrl.rollout.multiturn import EnvEpisode

    if cfg.rollout.episode is None:
        return
    try:
        fn = load_dotted(cfg.rollout.episode)
    except KeyError as e:
        raise ConfigError(f"config key 'rollout.episode': {e.args[0]}") from None
    if cfg.env.name is not None:
        if not (inspect.isclass(fn) and issubclass(fn, EnvEpisode)):
            raise ConfigError(
                "config key 'rollout.episode': with env.name set it names the environment's loop, "
                "a subclass of hybridrl.rollout.multiturn.EnvEpisode; "
                f"{cfg.rollout.episode!r} is not one (an async def episode drives its own "
                "environment: unset env.name)"
            )
        return
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(
            f"config key 'rollout.episode': {cfg.rollout.episode!r} is not an async def; an "
            "episode is `async def fn(gen, prompt, params)` returning the samples to train on "
            "(with env.name set: a subclass of hybridrl.rollout.multiturn.EnvEpisode)"
        )
    try:
        inspect.signature(fn).bind(None, None, None)
    except TypeError:
        raise ConfigError(
            f"config key 'rollout.episode': {cfg.rollout.episode}{inspect.signature(fn)} cannot be "
            "called as fn(gen, prompt, params)"
        ) from None


def data_columns(cfg: Config) -> list[str]:
    """The columns a prompt carries to reward functions: a dataset's columns other than the
    prompt's (read from each training file's first row), else those of the task's first held-out
    prompt (none for the built-in tasks; a plug-in task's prompts may carry some)."""
    if cfg.data.train_files is None:
        from hybridrl.models.loading import make_task

        first = make_task(cfg).heldout()[:1]
        return list(first[0].columns) if first else []
    from hybridrl.data.files import as_paths, first_row

    columns: dict[str, None] = {}
    for path in as_paths(cfg.data.train_files, "data.train_files"):
        names = first_row(path, "data.train_files", "train")[0]
        columns |= dict.fromkeys(c for c in names if c != cfg.data.prompt_key)
    return list(columns)


def check_reward_columns(cfg: Config) -> None:
    """A TRL-style reward function whose required arguments name columns the data lacks would fail
    on every sample: it is refused now."""
    from hybridrl.tasks.reward_signatures import (
        RewardConfigError,
        TrlStyle,
        resolve_reward_fns,
        reward_function,
    )

    # task.reward_fn in its order, and an environment's own (the tools environment's reward_fn)
    fns = {f"task.reward_fn[{i}]": f for i, f in enumerate(resolve_reward_fns(cfg))}
    spec = cfg.env.kwargs.get("reward_fn") if cfg.env.name is not None else None
    if spec is not None:
        try:
            fns["env.kwargs.reward_fn"] = reward_function(spec, "env.kwargs.reward_fn")
        except RewardConfigError as e:
            raise ConfigError(f"config key {e.key!r}: {e.message}") from None
    columns = data_columns(cfg) if any(isinstance(f, TrlStyle) for f in fns.values()) else []
    for key, f in fns.items():
        problem = f.missing_columns(columns) if isinstance(f, TrlStyle) else None
        if problem:
            raise ConfigError(f"config key {key!r}: {problem}")


def check_loggers(cfg: Config) -> None:
    """A logger in ``trainer.loggers`` whose package is missing fails now, before any work."""
    if "wandb" in cfg.trainer.loggers:
        from hybridrl.telemetry.tracking import import_wandb

        try:
            import_wandb()
        except ImportError as e:
            raise ConfigError(f"config key 'trainer.loggers': {e}") from None


def check_run_dir(cfg: Config) -> None:
    """``trainer.runs_dir`` and the run's directory in it can be created and written (not a file,
    under a writable directory): checked now, not when the warm start is done."""
    from hybridrl.config.sections.common import _check_writable_dir
    from hybridrl.driver.checkpoint import writable_problem
    from hybridrl.driver.run_dir import run_path

    for key, path in (("trainer.runs_dir", cfg.trainer.runs_dir), ("trainer.name", run_path(cfg))):
        try:
            _check_writable_dir(key, str(path))
        except ValueError as e:
            raise ConfigError(f"config key {key!r}: {e}") from None
    # an existing run directory is written (--resume) or moved aside (a fresh run, which an
    # immutable directory refuses too): refused now rather than with a traceback later
    if run_path(cfg).is_dir() and (problem := writable_problem(run_path(cfg))):
        raise ConfigError(f"config key 'trainer.name': the run directory {problem}")


def check_kv_pool(cfg: Config) -> None:
    """The native engine's KV pool (its ``kv_cache_bytes`` option in blocks of ``block_size``
    tokens) holds one sequence of one prompt token and ``rollout.max_new_tokens`` new ones in the
    model (and its draft): a smaller pool can serve no request, and would fail at the first
    generation. Counted at bf16, the smallest dtype ``dtype=auto`` may pick, unless fp32 is set;
    skipped for other backends, with ``kv_cache_memory_fraction``, and where the model's config
    cannot be read here (the engine checks each request as it arrives)."""
    import torch

    from hybridrl.models.spec import ModelSpec
    from hybridrl.rollout import ROLLOUT_BACKENDS
    from hybridrl.rollout.kv_capacity import bytes_per_block, pool_blocks

    r = cfg.rollout
    if r.backend != "native":
        return
    o = ROLLOUT_BACKENDS.get("native").read_options(r)
    if o.kv_cache_memory_fraction:
        return
    dtype = torch.float32 if o.dtype == "fp32" else torch.bfloat16
    try:
        per_block = sum(
            bytes_per_block(ModelSpec.from_config(config), o.block_size, dtype)
            for config in _rollout_model_configs(cfg, o.draft_model_path)
        )
    except (OSError, ValueError, KeyError):  # no readable config: the engine checks at start
        return
    blocks = pool_blocks(o, torch.device("cpu"), per_block, None)
    need = -(-r.max_new_tokens // o.block_size)  # the last token is sampled, never stored
    if blocks < need:
        raise ConfigError(
            f"config key 'rollout.backend_options.kv_cache_bytes': {o.kv_cache_bytes} bytes hold "
            f"{blocks} blocks of {o.block_size} tokens ({per_block} bytes each in this model), "
            f"fewer than the {need} blocks one sequence of "
            f"rollout.max_new_tokens={r.max_new_tokens} needs; give at least {need * per_block} "
            "bytes"
        )


def _rollout_model_configs(cfg: Config, draft_path: str | None) -> list:
    """The transformers configs of the model the rollout serves and of its draft model at
    ``draft_path`` (if any), read from disk or built for a built-in name, no weights loaded."""
    from transformers import AutoConfig

    from hybridrl.models.factory import model_size_config
    from hybridrl.models.loading import load_tokenizer

    if cfg.model.path is not None:
        configs = [AutoConfig.from_pretrained(cfg.model.path, local_files_only=True)]
    else:
        configs = [model_size_config(cfg.model.name, load_tokenizer(cfg, None))]
    if draft_path:
        configs.append(AutoConfig.from_pretrained(draft_path, local_files_only=True))
    return configs


def check_rollout_backend(cfg: Config) -> None:
    """The backend's options (``rollout.backend_options``) are the ones it declares, of their
    types and in their bounds; a backend whose package is missing (vllm, sglang) fails now,
    before any worker starts, naming the extra that installs it."""
    from hybridrl.rollout import ROLLOUT_BACKENDS
    from hybridrl.rollout.backends import missing_requirement

    ROLLOUT_BACKENDS.get(cfg.rollout.backend).read_options(cfg.rollout)
    problem = missing_requirement(cfg.rollout.backend)
    if problem:
        raise ConfigError(f"config key 'rollout.backend': {problem}")


# config.json keys whose positive value makes a checkpoint a mixture of experts
MOE_CONFIG_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _checkpoint_config(cfg: Config) -> dict | None:
    """The config.json of ``model.path``; None for a built-in model or one that cannot be read."""
    import json
    from pathlib import Path

    if cfg.model.path is None:
        return None
    try:
        return json.loads((Path(cfg.model.path).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None


def model_is_moe(cfg: Config) -> bool | None:
    """Whether the configured model is a mixture of experts: a built-in MoE name, or a checkpoint
    whose config.json counts experts; None when its config.json cannot be read."""
    from hybridrl.models.factory import MOE_SIZES

    if cfg.model.path is None:
        return cfg.model.name in MOE_SIZES
    config = _checkpoint_config(cfg)
    if config is None:
        return None
    return any(int(config.get(k) or 0) > 0 for k in MOE_CONFIG_KEYS)


def check_moe(cfg: Config) -> None:
    """Routing replay, balancing and expert parallelism need an MoE model of a family whose routers
    and experts hybridrl knows, r3 a rollout backend that records routing (native and hf do; vllm,
    sglang and external engines do not)."""
    moe = model_is_moe(cfg)
    if moe is False and cfg.moe.active:
        raise ConfigError(
            "config section 'moe': routing replay and expert balancing (moe.routing_replay, "
            "moe.aux_loss_coef, moe.z_loss_coef, moe.bias_update_rate) need a mixture-of-experts "
            "model, and the configured model is dense; use model.name=tiny_moe or an MoE "
            "checkpoint, or leave the moe section at its defaults"
        )
    model_type = (_checkpoint_config(cfg) or {}).get("model_type")
    if moe and (cfg.moe.active or cfg.moe.ep_size > 1) and model_type is not None:
        from hybridrl.models.spec import MOE_FAMILIES

        if model_type not in MOE_FAMILIES:
            raise ConfigError(
                "config section 'moe': routing replay, the balancing losses, the expert bias and "
                "expert parallelism work through the routers and experts of the families "
                f"{', '.join(sorted(MOE_FAMILIES))}; model.path is a {model_type!r} model, whose "
                "routers they would not find. Leave the moe section at its defaults to train it "
                "as any model"
            )
    if cfg.moe.routing_replay == "r3":
        from hybridrl.rollout.base import ROLLOUT_BACKENDS

        if not getattr(ROLLOUT_BACKENDS.get(cfg.rollout.backend), "records_routing", False):
            raise ConfigError(
                f"config key 'moe.routing_replay': r3 replays the routing the rollout recorded, "
                f"and rollout.backend={cfg.rollout.backend!r} records none; use "
                "rollout.backend=native or hf, or moe.routing_replay=r2 (the trainer's own "
                "old-policy routing)"
            )
    if moe is False and cfg.moe.ep_size > 1:
        raise ConfigError(
            f"config key 'moe.ep_size': {cfg.moe.ep_size} needs a mixture-of-experts model, and "
            "the configured model is dense; leave it at 1"
        )
    try:  # expert parallelism: world size, experts, other layouts (hybridrl/moe/ep.py)
        from hybridrl.moe.ep import check_config as check_ep

        check_ep(cfg)
    except ValueError as e:
        raise ConfigError(f"config key 'moe.ep_size': {e}") from None


# host bytes per token of a step's samples: ~100 B of Python lists in a Sample (token ids,
# log-probs), ~60 B of batch tensors in the learner (ids, masks, positions, log-probs, advantages,
# values), doubled for the copies made on the way (pickling, gathering, batching)
STEP_BYTES_PER_TOKEN = 256
# prompt length assumed when data.max_prompt_length does not bound it
PROMPT_TOKENS_GUESS = 256


def available_memory() -> int | None:
    """Bytes of memory available to new work on this machine: psutil's figure, else
    ``MemAvailable`` of /proc/meminfo; None where neither is known."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def step_memory(cfg: Config) -> int:
    """Host bytes a step's samples and batch tensors need: prompts_per_step x samples_per_prompt
    x (prompt + max_new_tokens) tokens x :data:`STEP_BYTES_PER_TOKEN`. The learner's activations
    are not counted: ``actor.micro_batch_tokens`` bounds them, whatever the step's size."""
    t = cfg.trainer
    prompt = cfg.data.max_prompt_length or PROMPT_TOKENS_GUESS
    tokens = t.prompts_per_step * t.samples_per_prompt * (prompt + cfg.rollout.max_new_tokens)
    return tokens * STEP_BYTES_PER_TOKEN


def check_step_memory(cfg: Config) -> None:
    """A step whose samples cannot fit in the machine's available memory fails now, naming the
    keys to lower; skipped where the available memory is unknown."""
    available = available_memory()
    need = step_memory(cfg)
    if available is None or need <= available:
        return
    t, gib, bound = cfg.trainer, 2**30, cfg.data.max_prompt_length
    keys = "'trainer.prompts_per_step', 'trainer.samples_per_prompt', 'rollout.max_new_tokens'"
    keys += ", 'data.max_prompt_length'" if bound else ""
    prompt = f"{bound} prompt" if bound else f"{PROMPT_TOKENS_GUESS} prompt (assumed)"
    raise ConfigError(
        f"config keys {keys}: a step's samples need about {need / gib:.1f} GiB of host memory "
        f"({t.prompts_per_step} x {t.samples_per_prompt} samples x ({prompt} + "
        f"{cfg.rollout.max_new_tokens} new) tokens x {STEP_BYTES_PER_TOKEN} B), above the "
        f"{available / gib:.1f} GiB available; lower them"
    )
