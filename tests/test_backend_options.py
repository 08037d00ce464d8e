"""A rollout backend owns its options (``rollout.backend_options``): each backend reads them into
the dataclass it declares, every key is checked before any work starts (unknown keys, types,
bounds), a backend given by dotted path declares its own the same way, and the keys these options
replaced are refused in one line naming the new key."""

import textwrap

import pytest

from hybridrl.checks import check_config
from hybridrl.config import Config, ConfigError, RolloutConfig, load_config
from hybridrl.config.aliases import MOVED
from hybridrl.rollout import ROLLOUT_BACKENDS
from hybridrl.rollout.engine import NativeOptions

ROLLOUT_MOVED = sorted(k for k in MOVED if k.startswith("rollout."))


def checked(*overrides: str) -> Config:
    cfg = load_config(Config, None, list(overrides))
    check_config(cfg)
    return cfg


@pytest.mark.parametrize("old", ROLLOUT_MOVED)
def test_a_former_rollout_key_is_refused_naming_its_new_key(old):
    assert len(ROLLOUT_MOVED) == 14  # every key a backend took over
    new = f"rollout.backend_options.{old.removeprefix('rollout.')}"
    with pytest.raises(ConfigError, match=rf"'{old}' moved to the backend .* options: use '{new}'"):
        load_config(Config, None, [f"{old}=1"])


def test_each_backend_checks_its_own_options_before_any_work():
    native = checked("rollout.backend_options.block_size=8", "rollout.backend_options.dtype=fp32")
    options = ROLLOUT_BACKENDS.get("native").read_options(native.rollout)
    assert options == NativeOptions(block_size=8, dtype="fp32")  # the others at their defaults
    with pytest.raises(ConfigError, match="did you mean 'rollout.backend_options.block_size'"):
        checked("rollout.backend_options.blok_size=8")
    with pytest.raises(ConfigError, match="'rollout.backend_options.block_size' must be >= 1"):
        checked("rollout.backend_options.block_size=0")
    with pytest.raises(ConfigError, match="'rollout.backend_options.kv_cache_bytes'"):
        checked("rollout.backend_options.kv_cache_bytes=lots")
    with pytest.raises(
        ConfigError, match="'rollout.backend_options.dtype'.*'auto', 'fp32', 'bf16'"
    ):
        checked("rollout.backend_options.dtype=fp16")
    # an option of another backend is refused, naming the backend and the options it has
    with pytest.raises(
        ConfigError,
        match=r"^rollout.backend=native: unknown config key "
        r"'rollout.backend_options.gpu_memory_utilization' \(keys of "
        r"rollout.backend_options: max_batch_size, kv_cache_bytes, block_size",
    ):
        checked("rollout.backend_options.gpu_memory_utilization=0.8")
    with pytest.raises(
        ConfigError,
        match=r"^rollout.backend=hf: .*block_size' \(keys of rollout.backend_options: max_b",
    ):
        checked("rollout.backend=hf", "rollout.backend_options.block_size=8")


def test_the_options_reach_the_engine():
    from test_rollout_engine import Tok, model

    cfg = RolloutConfig(backend_options={"block_size": 8, "max_batch_size": 3, "dtype": "fp32"})
    engine = ROLLOUT_BACKENDS.get("native")(model(), Tok(), cfg).engine
    assert (engine.bm.block_size, engine.scheduler.max_num_seqs) == (8, 3)
    hf = RolloutConfig(backend="hf", backend_options={"max_batch_size": 5})
    assert ROLLOUT_BACKENDS.get("hf")(model(), Tok(), hf).max_batch_size == 5
    with pytest.raises(ConfigError, match="rollout.backend_options.kv_cache_bytes"):
        ROLLOUT_BACKENDS.get("hf")(
            None, Tok(), RolloutConfig(backend_options={"kv_cache_bytes": 1})
        )


def test_a_dotted_path_backend_declares_its_own_options(tmp_path):
    path = tmp_path / "my_backend.py"
    path.write_text(
        textwrap.dedent(
            """
            from dataclasses import dataclass

            from hybridrl.registry import option
            from hybridrl.rollout.backends.hf import HFRollout


            @dataclass
            class Options:
                beams: int = option(1, "beams per prompt", ge=1)


            class Mine(HFRollout):
                options = Options

                def __init__(self, model, tokenizer, cfg=None, **kw):
                    self.mine = self.read_options(cfg)
                    super().__init__(model, tokenizer, None, **kw)


            class Plain(HFRollout):
                options = None
            """
        )
    )
    mine, plain = f"rollout.backend={path}:Mine", f"rollout.backend={path}:Plain"
    cfg = checked(mine, "rollout.backend_options.beams=3")
    assert ROLLOUT_BACKENDS.get(cfg.rollout.backend).read_options(cfg.rollout).beams == 3
    with pytest.raises(ConfigError, match="'rollout.backend_options.beams' must be >= 1"):
        checked(mine, "rollout.backend_options.beams=0")
    with pytest.raises(ConfigError, match=r"did you mean 'rollout.backend_options.beams'"):
        checked(mine, "rollout.backend_options.beam=2")
    checked(plain)
    with pytest.raises(ConfigError, match="backend Plain declares no options, got beams"):
        checked(plain, "rollout.backend_options.beams=2")


def test_the_reference_lists_every_backends_options():
    from hybridrl.config_reference import describe

    text = describe("rollout.backend_options")
    for backend, option in [
        ("native", "kv_cache_bytes"),
        ("hf", "max_batch_size"),
        ("vllm", "gpu_memory_utilization"),
        ("sglang", "engine_kwargs"),
    ]:
        line = next(x for x in text.splitlines() if x.startswith(f"  with backend {backend}:"))
        assert option in line, line
