"""Where each role runs and in which precision, decided on this CPU-only machine: CUDA is faked
(``torch.cuda`` queries monkeypatched) and engines are built on the ``meta`` device where a real GPU
would be needed, so the decisions a GPU run takes are checked here; ``tests/test_cuda.py`` runs the
same paths on a real GPU. Also: a CPU run still places everything on the CPU, a missing vllm /
sglang package is a one-line config error, and the extras are declared in pyproject.toml."""

import logging
import os
import sys
import types
from pathlib import Path

import pytest
import tomllib
import torch
from test_rollout_engine import Tok, model, rcfg

from hybridrl.cli import main
from hybridrl.config import Config, FSDPConfig, RolloutConfig, load_config
from hybridrl.controller import WorkerContext
from hybridrl.parallel import distributed, fsdp
from hybridrl.parallel import precision as prec
from hybridrl.parallel.distributed import DistEnv
from hybridrl.rollout.backends import make_backend, missing_requirement
from hybridrl.rollout.backends.hf import HFRollout
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.engine_dtype import engine_precision

ROOT = Path(__file__).resolve().parents[1]


def fake_gpu(monkeypatch, capability=(9, 0), name="NVIDIA H200", count=1):
    """torch.cuda as on a machine with ``count`` GPUs of ``capability``; ``auto`` not fixed by the
    suite's HYBRIDRL_AUTO_PRECISION. Returns the list the devices set with set_device go to."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.delenv(prec.ENV_OVERRIDE, raising=False)
    return chosen


# --- the device ----------------------------------------------------------------------------------
def test_the_worker_device_is_the_gpu_it_was_given(monkeypatch):
    chosen = fake_gpu(monkeypatch, count=2)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert distributed.compute_device() == torch.device("cuda", 0)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a launcher's second rank on the node
    assert distributed.compute_device() == torch.device("cuda", 1) and chosen == [0, 1]


def fake_ray(monkeypatch, actor_id, gpu_ids):
    """``ray`` as seen from a process it runs: an actor (``actor_id``) or the driver (None)."""
    ctx = types.SimpleNamespace(get_actor_id=lambda: actor_id)
    ray = types.SimpleNamespace(
        is_initialized=lambda: True, get_runtime_context=lambda: ctx, get_gpu_ids=lambda: gpu_ids
    )
    monkeypatch.setitem(sys.modules, "ray", ray)


def test_a_ray_actor_that_reserved_no_gpu_runs_on_the_cpu_on_a_gpu_node(monkeypatch):
    """Ray leaves CUDA_VISIBLE_DEVICES alone for an actor with num_gpus=0, so it sees every GPU of
    the node; a pool with gpus_per_worker: 0 must still run on the CPU."""
    fake_gpu(monkeypatch, count=8)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    fake_ray(monkeypatch, "actor-1", [])
    assert distributed.compute_device() == torch.device("cpu")
    fake_ray(monkeypatch, "actor-1", [3])  # reserved one: Ray made it the only visible GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert distributed.compute_device() == torch.device("cuda", 0)
    fake_ray(monkeypatch, None, [])  # the driver (local controller): the machine's GPU 0
    assert distributed.compute_device() == torch.device("cuda", 0)


class _Probe:
    def check(self) -> bool:
        return distributed._ray_actor_without_gpu()


@pytest.mark.slow  # starts Ray (~10 s); the rule itself is tested with a fake above
def test_the_ray_actor_check_against_ray_itself():
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("another test's Ray instance is running")
    path = os.pathsep.join([str(ROOT / "tests"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    ray.init(
        num_cpus=1,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path}},  # the actor imports this module
    )
    try:
        actor = ray.remote(num_cpus=0.1)(_Probe).remote()  # no GPU reserved
        assert ray.get(actor.check.remote()) is True
        assert distributed._ray_actor_without_gpu() is False  # the driver
    finally:
        ray.shutdown()


def test_without_a_gpu_the_worker_device_is_the_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.compute_device() == torch.device("cpu")


def small_cfg(*extra) -> Config:
    return load_config(
        Config, None, ["controller.num_threads=1", "rollout.max_new_tokens=4", *extra]
    )


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_the_rollout_worker_builds_its_engine_on_its_device(monkeypatch, backend):
    """The worker asks compute_device() (the learner's rule) and the engine's weights, KV cache
    and sampling live there, not on the CPU where the model was loaded (``meta`` stands in for a
    GPU)."""
    from hybridrl.rollout import worker

    monkeypatch.setattr(worker, "compute_device", lambda: torch.device("meta"))
    w = worker.RolloutWorker(
        WorkerContext(role="rollout", rank=0, world_size=1, pool="p"),
        small_cfg(
            f"rollout.backend={backend}",
            *(["rollout.backend_options.kv_cache_bytes=1048576"] if backend == "native" else []),
        ),
        None,
    )
    if backend == "native":
        eng = w.backend.engine
        assert eng.device.type == "meta"  # sampling tensors are built on engine.device
        assert {eng.runner.k_cache.device.type, eng.runner.embed.device.type} == {"meta"}
        assert all(t.device.type == "meta" for t in eng.runner.named_weights().values())
    else:
        assert {p.device.type for p in w.backend.model.parameters()} == {"meta"}


def test_a_cpu_rollout_worker_stays_on_the_cpu_in_fp32():
    from hybridrl.rollout.worker import RolloutWorker

    w = RolloutWorker(
        WorkerContext(role="rollout", rank=0, world_size=1, pool="p"),
        small_cfg("rollout.backend_options.kv_cache_bytes=1048576"),
        None,
    )
    eng = w.backend.engine
    assert eng.device.type == "cpu" and eng.runner.k_cache.device.type == "cpu"
    assert eng.dtype == torch.float32  # the suite fixes auto to fp32 (conftest)


class Plugin:
    """A user's backend written before devices existed: built as ``cls(model, tokenizer, cfg)``."""

    def __init__(self, model, tokenizer, cfg):
        self.args = (model, tokenizer, cfg)


def test_make_backend_passes_the_device_only_to_backends_that_take_one():
    cfg = RolloutConfig(backend=f"{__name__}:Plugin")
    assert make_backend(cfg, "m", "t", torch.device("cuda", 0)).args == ("m", "t", cfg)
    eng = make_backend(rcfg(), model(), Tok(), torch.device("meta"))
    assert isinstance(eng, NativeRollout) and eng.engine.device.type == "meta"


def test_a_native_engine_without_a_device_follows_the_model():
    eng = NativeRollout(model(), Tok(), rcfg())
    assert eng.engine.device.type == "cpu"


# --- the rollout's precision ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "capability,setting,want",
    [
        ((9, 0), "auto", torch.bfloat16),  # H100 / H200
        ((8, 0), "auto", torch.bfloat16),  # A100
        ((7, 0), "auto", torch.float32),  # V100: bf16 is emulated
        ((7, 0), "bf16", torch.bfloat16),  # forced
        ((9, 0), "fp32", torch.float32),
    ],
)
def test_rollout_dtype_on_a_gpu(monkeypatch, capability, setting, want):
    fake_gpu(monkeypatch, capability)
    got = engine_precision(setting, model(), torch.device("cuda", 0))
    assert got.dtype == want
    assert "cuda" in got.reason


def test_rollout_auto_on_a_gpu_follows_the_env_override(monkeypatch):
    fake_gpu(monkeypatch)
    monkeypatch.setenv(prec.ENV_OVERRIDE, "fp32")
    got = engine_precision("auto", model(), "cuda")
    assert got.dtype == torch.float32 and prec.ENV_OVERRIDE in got.reason


def test_rollout_auto_on_the_cpu_is_unchanged(monkeypatch):
    """A CPU engine still decides as before: the env override (the suite's fp32), else the CPU's
    flags and a measurement; never the GPU rule."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", pytest.fail)
    assert engine_precision("auto", model(), "cpu").dtype == torch.float32
    monkeypatch.setenv(prec.ENV_OVERRIDE, "bf16")
    assert engine_precision("auto", model(), None).dtype == torch.bfloat16
    monkeypatch.delenv(prec.ENV_OVERRIDE)
    monkeypatch.setattr(prec, "cpu_bf16_support", lambda: None)
    got = engine_precision("auto", model(), "cpu")
    assert got.dtype == torch.float32 and "no native bf16 matmul" in got.reason


class Recorder(torch.nn.Module):
    """A model whose ``to`` only records where it was sent (no CUDA here)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(2))
        self.sent = None

    def to(self, *args, **kwargs):
        self.sent = args
        return self


@pytest.mark.parametrize("setting,want", [("auto", torch.bfloat16), ("fp32", torch.float32)])
def test_the_hf_backend_on_a_gpu_moves_and_casts_its_model(monkeypatch, setting, want):
    fake_gpu(monkeypatch)
    m = Recorder()
    HFRollout(
        m, Tok(), RolloutConfig(backend="hf", backend_options={"dtype": setting}), device="cuda:0"
    )
    assert m.sent == ("cuda:0", want)


def test_the_hf_backend_on_the_cpu_keeps_the_models_dtype():
    m = model()
    eng = HFRollout(
        m, Tok(), RolloutConfig(backend="hf", backend_options={"dtype": "bf16"}), device="cpu"
    )
    assert {p.dtype for p in eng.model.parameters()} == {torch.float32}


# --- training precision --------------------------------------------------------------------------
def prepared(monkeypatch, device: str, caplog, **fsdp_kw):
    """``prepare_model`` of a tiny model for a rank on ``device``, world size 1 (the placement
    itself, ``model.to``, is skipped: there is no GPU here)."""
    monkeypatch.setattr(fsdp, "_prepare", lambda m, *a: m)
    with caplog.at_level(logging.INFO, logger="hybridrl.parallel.fsdp"):
        m = fsdp.prepare_model(
            model(), FSDPConfig(strategy="none", **fsdp_kw), DistEnv(device=torch.device(device))
        )
    lines = [r.getMessage() for r in caplog.records if "precision" in r.getMessage()]
    assert len(lines) == 1  # one line says which precision runs
    return m, lines[0]


@pytest.mark.parametrize("setting", ["auto", "bf16"])
def test_one_gpu_trains_in_bf16_autocast_over_fp32_master_weights(monkeypatch, caplog, setting):
    fake_gpu(monkeypatch)
    m, line = prepared(monkeypatch, "cuda", caplog, mixed_precision=setting)
    assert prec.autocast_dtype(m) == torch.bfloat16 and prec.autocast_device(m) == "cuda"
    assert {p.dtype for p in m.parameters()} == {torch.float32}  # master weights, so AdamW's state
    assert line.startswith("training precision: bf16 autocast (fsdp.mixed_precision=")
    assert "on cuda" in line
    # the forward's context (torch.autocast("cuda") cannot be built without CUDA: recorded)
    monkeypatch.setattr(torch, "autocast", lambda device_type, dtype: (device_type, dtype))
    assert prec.autocast(m) == ("cuda", torch.bfloat16)


def test_one_gpu_trains_in_fp32_when_asked(monkeypatch, caplog):
    fake_gpu(monkeypatch)
    m, line = prepared(monkeypatch, "cuda", caplog, mixed_precision="fp32")
    assert prec.autocast_dtype(m) is None and "training precision: fp32" in line


def test_an_old_gpu_trains_in_fp32_at_auto(monkeypatch, caplog):
    fake_gpu(monkeypatch, capability=(7, 0), name="Tesla V100")
    m, line = prepared(monkeypatch, "cuda", caplog, mixed_precision="auto")
    assert prec.autocast_dtype(m) is None and "Tesla V100 has no native bf16" in line


def test_a_cpu_rank_still_decides_as_before(monkeypatch, caplog):
    """CPU: the suite's fp32 at auto, CPU autocast at bf16; the GPU rule is never asked."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", pytest.fail)
    m, line = prepared(monkeypatch, "cpu", caplog, mixed_precision="auto")
    assert prec.autocast_dtype(m) is None and "fp32" in line
    caplog.clear()
    m, line = prepared(monkeypatch, "cpu", caplog, mixed_precision="bf16")
    assert prec.autocast_dtype(m) == torch.bfloat16 and prec.autocast_device(m) == "cpu"
    assert line.startswith("training precision: bf16 autocast (fsdp.mixed_precision=bf16")


def test_fsdp2_on_gpus_keeps_bf16_params_with_fp32_reduce():
    on, off = fsdp.mixed_precision_policy(True), fsdp.mixed_precision_policy(False)
    assert (on.param_dtype, on.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert off.param_dtype is None and off.reduce_dtype is None


def test_precision_settings_are_checked(monkeypatch):
    fake_gpu(monkeypatch)
    with pytest.raises(ValueError, match="must be auto, fp32 or bf16"):
        prec.cuda_precision("fp16", key="fsdp.mixed_precision")
    monkeypatch.setenv(prec.ENV_OVERRIDE, "fp16")
    with pytest.raises(ValueError, match=prec.ENV_OVERRIDE):
        prec.cuda_precision("auto", key="rollout.backend_options.dtype")


# --- vllm / sglang without their package ---------------------------------------------------------
@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_a_missing_engine_package_is_a_one_line_config_error(monkeypatch, capsys, name):
    monkeypatch.setitem(
        sys.modules, name, None
    )  # as if not installed (import fails), even if it is
    problem = missing_requirement(name)
    assert "\n" not in problem
    assert f"needs the {name!r} package" in problem
    assert f"pip install 'hybridrl[{name}]'" in problem and "usable here: hf, native" in problem
    # before any worker starts: the CLI stops at the config check with exit code 2
    assert main(["train", "examples/arith_grpo.yaml", f"rollout.backend={name}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"pip install 'hybridrl[{name}]'" in err
    assert err.startswith("hybridrl: error: config key 'rollout.backend':")


@pytest.mark.parametrize("name", ["vllm", "sglang"])
def test_an_installed_engine_package_passes_the_check(monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert missing_requirement(name) is None


def test_backends_without_a_package_pass_the_check():
    assert missing_requirement("native") is None and missing_requirement("hf") is None


# --- extras -------------------------------------------------------------------------------------
def test_pyproject_declares_the_extras():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for extra, package in [
        ("vllm", "vllm"),
        ("sglang", "sglang"),
        ("wandb", "wandb"),
        ("math", "math-verify"),
    ]:
        assert any(req.startswith(package) for req in extras[extra]), extra
    deps = project["dependencies"]
    assert any(d.startswith("datasets>=") for d in deps)
    assert "torch>=2.6,<=2.14.1" in deps  # the extras resolve with it (docs/gpu.md)
    for cls in (
        "hybridrl.rollout.backends.vllm:VLLMRollout",
        "hybridrl.rollout.backends.sglang:SGLangRollout",
    ):
        from hybridrl.registry import load_dotted

        assert load_dotted(cls).extra in extras  # the error names an extra that exists
