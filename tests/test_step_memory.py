"""The up-front check of a step's size against the machine's memory (checks.py:
``check_step_memory``): too large a step fails before any work with one line naming the keys to
lower, the estimate and the available bytes; an unknown figure skips the check."""

import pytest

from hybridrl import checks
from hybridrl.config import Config, ConfigError, load_config

BIG = [
    "trainer.prompts_per_step=1024",
    "trainer.samples_per_prompt=16",
    "actor.ppo_minibatch_size=16",
    "rollout.max_new_tokens=4096",
]


def config(*overrides) -> Config:
    return load_config(Config, None, list(overrides))


def test_the_estimate_counts_every_token_of_the_step():
    cfg = config(*BIG, "data.max_prompt_length=1024")
    assert checks.step_memory(cfg) == 1024 * 16 * (1024 + 4096) * checks.STEP_BYTES_PER_TOKEN
    unbounded = config(*BIG)  # no prompt bound: an assumed prompt length
    assert checks.step_memory(unbounded) == 1024 * 16 * (checks.PROMPT_TOKENS_GUESS + 4096) * (
        checks.STEP_BYTES_PER_TOKEN
    )


def test_a_step_larger_than_the_available_memory_fails_before_any_work(monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda: 8 << 30)  # 8 GiB free
    with pytest.raises(ConfigError) as err:
        checks.check_config(config(*BIG))
    message = str(err.value)
    assert "\n" not in message
    for key in ("trainer.prompts_per_step", "trainer.samples_per_prompt", "rollout.max_new_tokens"):
        assert key in message
    assert "about 17.0 GiB" in message and "8.0 GiB available" in message
    assert "(256 prompt (assumed) + 4096 new) tokens x 256 B" in message
    monkeypatch.setattr(checks, "available_memory", lambda: 1 << 30)
    with pytest.raises(ConfigError, match="'data.max_prompt_length': .* 1.0 GiB available"):
        checks.check_config(config(*BIG, "data.max_prompt_length=64"))
    checks.check_config(config())  # the default step fits easily


def test_an_unknown_figure_skips_the_check(monkeypatch):
    monkeypatch.setattr(checks, "available_memory", lambda: None)
    checks.check_config(config(*BIG))


def test_the_available_memory_is_read_from_proc_meminfo_without_psutil(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_psutil(name, *args, **kwargs):
        if name == "psutil":
            raise ImportError("no psutil")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_psutil)
    found = checks.available_memory()
    assert found is None or found > 0
    with open("/proc/meminfo") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    assert found is not None and abs(found - kib * 1024) < 1 << 30
