"""Exact resume (local backend, deterministic on CPU): 2k steps in one run == k steps, stop, resume
for k more, for GRPO and for PPO with a critic; a critic (the learner's ``Critic``) rebuilt from its
checkpoint equals the saved one bit for bit in both checkpoint layouts (``train_state.pt`` in one
process, ``dcp/`` for a sharded model).

The sharded layout runs in a subprocess (``python tests/test_resume.py critic-dcp WORKDIR PORT``):
FSDP2 on a 1-rank gloo group, which must not outlive its process (see the exit there)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hybridrl.config import Config, load_config
from hybridrl.controller import WorkerContext
from hybridrl.driver.loop import train
from hybridrl.parallel.distributed import DistEnv, init_distributed
from hybridrl.protocol import Batch

ROOT = Path(__file__).resolve().parents[1]
K = 2
TINY = [
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=8",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4",
    "trainer.eval_every=1",
    "trainer.save_every=0",
    "rollout.max_new_tokens=8",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
    # exercise every piece of resumable state: adaptive KL coefficient (reward penalty),
    # dynamic sampling (prompt cursor)
    "algorithm.kl_reward_coef=0.05",
    "algorithm.kl_ctrl=adaptive",
    "algorithm.filter_groups=true",
    "algorithm.max_sampling_rounds=2",
    f"task.reward_fn={__name__}:digit_credit",
]
# PPO: examples/arith_ppo.yaml (gae, so a critic), two critic optimizer steps per RL
# step (its shuffle RNG matters)
PPO = ["critic.ppo_minibatch_size=4"]
TIMING = (
    "timing/",
    "engine/",
    "perf/",
)  # wall times, and engine statistics (a resumed engine starts with a cold prefix cache)


def digit_credit(prompt, response: str, **_) -> float:
    """Partial credit (the answer's digits in place): a policy warm-started for 3 steps never
    gets an exact answer, and with all-zero rewards the critic never trains and dynamic sampling
    never keeps a group."""
    return sum(a == b for a, b in zip(response, prompt.answer)) / len(prompt.answer)


def trained_every_step(rows: dict[int, dict], role: str) -> bool:
    return all(rows[s][f"{role}/grad_norm"] > 0 for s in rows if s > 0)


def cfg(tmp_path, name, steps, *extra, base=None) -> Config:
    return load_config(
        Config,
        base,
        [
            *TINY,
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            f"trainer.name={name}",
            f"trainer.total_steps={steps}",
            *extra,
        ],
    )


def metrics(tmp_path, name) -> dict[int, dict]:
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
    ]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def weights(tmp_path, name, step, role="model"):
    return load_file(
        tmp_path / "runs" / name / "checkpoints" / f"step_{step:06d}" / role / "model.safetensors"
    )


def assert_same_runs(tmp_path, a_name, b_name, steps, roles=("model",)) -> dict[int, dict]:
    """Equal metrics at every step (bit for bit, timings aside) and equal
    final weights of ``roles``."""
    a, b = metrics(tmp_path, a_name), metrics(tmp_path, b_name)
    assert sorted(a) == sorted(b) == list(range(steps + 1))
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for key in a[step]:
            assert a[step][key] == pytest.approx(b[step][key], rel=0, abs=0), (step, key)
    for role in roles:
        wa, wb = weights(tmp_path, a_name, steps, role), weights(tmp_path, b_name, steps, role)
        assert wa.keys() == wb.keys() and all((wa[n] == wb[n]).all() for n in wa), role
    return a


def test_resume_is_exact_and_continues_after_the_end(tmp_path):
    train(cfg(tmp_path, "straight", 2 * K))
    train(cfg(tmp_path, "split", K))
    resumed = train(cfg(tmp_path, "split", 2 * K), resume=True)
    assert resumed["resumed_from_step"] == K
    rows = assert_same_runs(tmp_path, "straight", "split", 2 * K)
    assert trained_every_step(rows, "actor") and any(
        rows[s]["rollout/informative_frac"] > 0 for s in rows if s > 0
    )
    # resuming a finished run with a larger total_steps trains the remaining steps, not zero
    more = train(cfg(tmp_path, "split", 2 * K + 1), resume=True)
    assert more["resumed_from_step"] == 2 * K and max(metrics(tmp_path, "split")) == 2 * K + 1
    assert (tmp_path / "runs" / "split" / "checkpoints" / f"step_{2 * K + 1:06d}").is_dir()


def test_ppo_resume_is_exact(tmp_path):
    """The critic's head, optimizer and shuffle RNG survive the restart: values, advantages and
    every later metric are those of the run that never stopped."""
    ppo = dict(base=ROOT / "examples" / "arith_ppo.yaml")
    train(cfg(tmp_path, "straight", 2 * K, *PPO, **ppo))
    train(cfg(tmp_path, "split", K, *PPO, **ppo))
    critic_at_k = weights(tmp_path, "split", K, "critic")
    assert train(cfg(tmp_path, "split", 2 * K, *PPO, **ppo), resume=True)["resumed_from_step"] == K
    rows = assert_same_runs(tmp_path, "straight", "split", 2 * K, roles=("model", "critic"))
    assert trained_every_step(rows, "critic") and trained_every_step(rows, "actor")
    assert all(rows[s]["critic/updates"] == 2 for s in rows if s > 0)
    assert critic_at_k["score.weight"].abs().sum() > 0  # a head to lose, had the resume reset it


# --- the critic, rebuilt from its checkpoint ------------------------------------------------------
def critic_cfg() -> Config:
    return load_config(
        Config, ROOT / "examples" / "arith_ppo.yaml", PPO + ["controller.num_threads=1"]
    )


def critic_batch(critic, n: int = 8, prompt_len: int = 5, resp_len: int = 6) -> Batch:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, critic.model.config.vocab_size, (n, prompt_len + resp_len), generator=g)
    rmask = (torch.arange(resp_len) < torch.randint(1, resp_len + 1, (n, 1), generator=g)).float()
    batch = Batch(
        {
            "input_ids": ids,
            "prompts": ids[:, :prompt_len],
            "responses": ids[:, prompt_len:],
            "attention_mask": torch.ones_like(ids),
            "response_mask": rmask,
        }
    )
    return batch | Batch(
        {
            "values": critic.values(batch)["values"],
            "returns": torch.randn(n, resp_len, generator=g) * rmask,
        }
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if hasattr(t, "to_local") else t).detach().clone()


def snapshot(critic) -> dict:
    """Every parameter, the optimizer state per parameter and its hyper-parameters, the shuffle RNG
    (a rank's shards when sharded: with one rank, the whole tensors)."""
    params = list(critic.model.parameters())
    return {
        "params": {n: _local(p) for n, p in critic.model.named_parameters()},
        "optim": [{k: _local(v) for k, v in critic.optimizer.state[p].items()} for p in params],
        "groups": [
            {k: v for k, v in g.items() if k != "params"} for g in critic.optimizer.param_groups
        ],
        "rng": critic.shuffle.get_state(),
    }


def critic_round_trip(dist: DistEnv, path: Path) -> dict:
    """Train a critic 3 updates, save, rebuild from the checkpoint as a resumed run
    does, then train both once more."""
    from hybridrl.learner.critic import Critic
    from hybridrl.parallel.fsdp import is_sharded

    trained = Critic(critic_cfg(), None, dist)
    batch = critic_batch(trained)
    for _ in range(3):
        trained.update(batch)
    trained.save(str(path))
    # as open_session does: the learner's critic built from the checkpoint, then loaded
    resumed = Critic(critic_cfg(), str(path), dist)
    resumed.load(str(path))
    fresh = Critic(critic_cfg(), None, dist)  # load alone restores everything, however it was built
    fresh.load(str(path))
    out = {
        "saved": snapshot(trained),
        "resumed": snapshot(resumed),
        "loaded": snapshot(fresh),
        "sharded": is_sharded(fresh.model),
    }
    trained.update(batch)
    resumed.update(batch)
    return out | {"saved_next": snapshot(trained), "resumed_next": snapshot(resumed)}


def assert_bitwise_equal(a: dict, b: dict) -> None:
    assert a["params"].keys() == b["params"].keys()
    for n in a["params"]:
        assert torch.equal(a["params"][n], b["params"][n]), n
    assert len(a["optim"]) == len(b["optim"]) == len(a["params"])
    for i, (sa, sb) in enumerate(zip(a["optim"], b["optim"])):
        assert sa.keys() == sb.keys() == {"step", "exp_avg", "exp_avg_sq"}, i
        assert all(torch.equal(sa[k], sb[k]) for k in sa), i
    assert a["groups"] == b["groups"] and torch.equal(a["rng"], b["rng"])


def check_round_trip(out: dict) -> None:
    saved = out["saved"]
    assert (
        saved["params"]["score.weight"].abs().sum() > 0
    )  # the head trained away from its zero start
    assert all(s["step"].item() == 6 for s in saved["optim"])  # 3 updates x 2 mini-batches
    assert_bitwise_equal(saved, out["resumed"])
    assert_bitwise_equal(saved, out["loaded"])
    # and they go on alike: same moments, same step count, same mini-batch order
    assert_bitwise_equal(out["saved_next"], out["resumed_next"])
    assert not torch.equal(
        saved["params"]["score.weight"], out["saved_next"]["params"]["score.weight"]
    )


def test_value_model_keeps_a_saved_head_and_starts_a_missing_one_at_zero(tmp_path):
    from hybridrl.learner.critic import build_value_model
    from hybridrl.models.loading import load_model

    policy, _ = load_model(critic_cfg(), None)
    policy.save_pretrained(tmp_path / "policy")
    critic = build_value_model(
        critic_cfg(), str(tmp_path / "policy")
    )  # a policy checkpoint: no head in it
    assert not critic.score.weight.any() and not critic.score.bias.any()
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    with torch.no_grad():
        critic.score.weight.normal_()
        critic.score.bias.fill_(-0.5)
    critic.save_pretrained(tmp_path / "critic")
    again = build_value_model(
        critic_cfg(), str(tmp_path / "critic")
    )  # a critic checkpoint: its head
    a, b = critic.state_dict(), again.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_critic_rebuilt_from_a_single_process_checkpoint_is_the_saved_one(tmp_path):
    ctx = WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=1)
    out = critic_round_trip(init_distributed(ctx), tmp_path / "critic")
    assert not out["sharded"]
    check_round_trip(out)
    assert (tmp_path / "critic" / "train_state.pt").is_file() and not (
        tmp_path / "critic" / "dcp"
    ).exists()


def critic_dcp_main(workdir: str, port: int) -> None:
    """A critic sharded by FSDP2 on a 1-rank gloo group (what world size > 1
    does), so it saves ``dcp/``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = DistEnv(0, 1, torch.device("cpu"), "gloo")
    torch.save(critic_round_trip(group, Path(workdir) / "critic"), Path(workdir) / "out.pt")


def test_critic_rebuilt_from_a_sharded_checkpoint_is_the_saved_one(tmp_path):
    from hybridrl.controller.worker import find_free_port
    from hybridrl.parallel.sharded_checkpoint import is_complete

    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "critic-dcp", str(tmp_path), str(find_free_port("127.0.0.1"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["sharded"]
    check_round_trip(out)
    assert (
        is_complete(tmp_path / "critic" / "dcp")
        and not (tmp_path / "critic" / "train_state.pt").exists()
    )


if __name__ == "__main__":
    if sys.argv[1] == "critic-dcp":
        critic_dcp_main(sys.argv[2], int(sys.argv[3]))
        # FSDP2's hooks keep the gloo group alive past destroy_process_group(), and its threads can
        # abort the interpreter's exit; the results are written by now
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)


def cli_args(tmp_path, name, steps, *extra) -> list[str]:
    return [
        "train",
        *TINY,
        f"sft.checkpoint={tmp_path / 'ws'}",
        f"trainer.runs_dir={tmp_path / 'runs'}",
        f"trainer.name={name}",
        f"trainer.total_steps={steps}",
        *extra,
    ]


def metric_rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def test_resume_from_a_chosen_checkpoint_continues_exactly_from_it(tmp_path, capsys):
    """--resume-from an earlier checkpoint: the steps after it are the first run's again, bit for
    bit; the run goes on in the checkpoint's run directory (another trainer.name in the config)."""
    from hybridrl.cli import main

    keep = ("trainer.save_every=1", "trainer.keep_checkpoints=3")
    assert main(cli_args(tmp_path, "a", 4, *keep)) == 0
    first = metric_rows(tmp_path / "runs/a")
    ckpt = tmp_path / "runs/a/checkpoints/step_000002"
    capsys.readouterr()
    assert main([*cli_args(tmp_path, "other", 4, *keep), "--resume-from", str(ckpt)]) == 0
    summary = json.loads(capsys.readouterr().out.split("\nreport:")[0])
    assert summary["resumed_from_step"] == 2 and summary["run_dir"].endswith("runs/a")
    assert not (tmp_path / "runs/other").exists()
    again = metric_rows(tmp_path / "runs/a")
    assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]


def test_a_resume_under_keys_that_change_training_is_refused_naming_them(tmp_path, capsys):
    from hybridrl.cli import main

    assert main(cli_args(tmp_path, "a", 1, "trainer.save_every=1")) == 0
    capsys.readouterr()
    assert (
        main([*cli_args(tmp_path, "a", 2, "actor.lr=2e-4", "rollout.top_p=0.9"), "--resume"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "actor.lr: 0.0001 -> 0.0002" in err, err
    assert "rollout.top_p: 1.0 -> 0.9" in err and "--resume-changed-config" in err, err
    assert not (tmp_path / "runs/a/checkpoints/step_000002").exists()
    # how long, how often and where to log may change; the rest with --resume-changed-config
    assert main([*cli_args(tmp_path, "a", 2, "trainer.eval_every=2"), "--resume"]) == 0
    assert main([*cli_args(tmp_path, "a", 3, "actor.lr=2e-4"), "--resume-changed-config"]) == 0
    assert main([*cli_args(tmp_path, "a", 3), "--resume-from", str(tmp_path)]) == 2
    assert "is not a checkpoint" in capsys.readouterr().err


# ~9 s each: SIGTERM (what schedulers send) runs by default, SIGINT with the slow tests
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)]
)
def test_a_signal_finishes_the_step_saves_and_says_how_to_resume(tmp_path, signum):
    args = cli_args(tmp_path, "a", 500, "trainer.save_every=0")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT / "tests")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hybridrl.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # SIGINT as a terminal's Ctrl-C sends it (a background child would inherit it ignored)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.default_int_handler),
    )
    metrics = tmp_path / "runs/a/metrics.jsonl"
    for _ in range(600):
        if proc.poll() is not None or (
            metrics.exists() and len(metrics.read_text().splitlines()) >= 3
        ):
            break
        time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    summary = json.loads(out.split("\nreport:")[0])
    step = summary["steps"]
    assert summary["stopped_by"] == signal.Signals(signum).name and 2 <= step < 500
    assert summary["final_checkpoint"].endswith(f"step_{step:06d}")
    line = err.strip().splitlines()[-1]
    assert f"stopped by {signal.Signals(signum).name} after step {step}" in line, err[-2000:]
    assert line.endswith(f"--resume-from {tmp_path / 'runs/a'}"), line
    from hybridrl.cli import main

    resumed = [
        *args[:-2],
        f"trainer.total_steps={step + 1}",
        "--resume-from",
        str(tmp_path / "runs/a"),
    ]
    assert main(resumed) == 0
    assert json.loads((tmp_path / "runs/a/summary.json").read_text())["resumed_from_step"] == step


def test_a_checkpoint_of_the_former_rollout_layout_compares_by_the_options_it_means():
    import yaml

    from hybridrl.config import Config, dump_yaml, load_config
    from hybridrl.driver.resume import changed_training_keys

    cfg = load_config(Config, None, [])
    saved = yaml.safe_load(dump_yaml(cfg))
    del saved["rollout"]["backend_options"]  # saved before the backends owned their options
    saved["rollout"] |= {"block_size": 16, "dtype": "auto", "gpu_memory_utilization": 0.5}
    assert changed_training_keys(saved, cfg) == []
    saved["rollout"]["dtype"] = "fp32"
    assert changed_training_keys(saved, cfg) == ["rollout.backend_options.dtype: 'fp32' -> 'auto'"]
    # an option written at its default and one left out are the same options
    written = load_config(Config, None, ["rollout.backend_options.dtype=auto"])
    assert changed_training_keys(yaml.safe_load(dump_yaml(written)), cfg) == []
