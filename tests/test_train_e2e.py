"""End-to-end: the real driver, workers and tiny model, on both backends."""

import json

import pytest
import ray

from hybridrl.config import Config, load_config
from hybridrl.driver.loop import train

TINY_RUN = [
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=16",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4",
    "trainer.total_steps=2",
    "trainer.eval_every=1",
    "trainer.save_every=1",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
]


def make_cfg(tmp_path, *extra) -> Config:
    return load_config(
        Config,
        None,
        [
            *TINY_RUN,
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def ray_cluster():
    yield
    if ray.is_initialized():
        ray.shutdown()


def first_step(run_dir) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step1 = next(r for r in rows if r["step"] == 1)
    return {k: v for k, v in step1.items() if not k.startswith(("timing/", "engine/", "perf/"))}


def test_two_steps_local_then_resume(tmp_path):
    summary = train(make_cfg(tmp_path))
    run_dir = tmp_path / "runs" / "arith_grpo"
    assert summary["steps"] == 2 and (run_dir / "report.png").stat().st_size > 0
    assert {
        "accuracy_before",
        "accuracy_after",
        "greedy_accuracy_before",
        "greedy_accuracy_after",
        "wall_seconds",
        "final_checkpoint",
    } <= set(summary)
    assert summary["eval_metric"] == "accuracy"  # exact match: every reward 0 or 1
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for key in [
        "reward/mean",
        "actor/kl_ref",
        "actor/clip_frac",
        "actor/entropy",
        "actor/grad_norm",
        "response/length_mean",
        "timing/rollout",  # generation and scoring, both on the rollout ranks
        "timing/reference",
        "timing/advantage",
        "timing/old_log_prob",
        "timing/update",
        "timing/weight_sync",
    ]:
        assert key in rows[1], key
    ckpts = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert ckpts == ["step_000001", "step_000002"]
    assert (run_dir / "checkpoints" / "step_000002" / "model" / "model.safetensors").is_file()
    # resume for two more steps: starts at step 2, keeps the earlier metrics
    resumed = train(make_cfg(tmp_path, "trainer.total_steps=4"), resume=True)
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 4
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert resumed["accuracy_before"] == summary["accuracy_before"]


@pytest.mark.distributed
def test_ray_first_step_matches_local(tmp_path, ray_cluster):
    local = train(make_cfg(tmp_path, "trainer.total_steps=1", "trainer.name=local"))
    remote = train(
        make_cfg(tmp_path, "trainer.total_steps=2", "trainer.name=ray", "controller.backend=ray")
    )
    assert remote["steps"] == 2
    a, b = first_step(tmp_path / "runs" / "local"), first_step(tmp_path / "runs" / "ray")
    assert a.keys() == b.keys()
    for k in a:
        assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), k
    assert local["accuracy_before"] == remote["accuracy_before"]


def test_ppo_with_critic_runs_and_resumes(tmp_path):
    """gae makes the learner build a critic from the warm start; its state
    is checkpointed and resumed."""
    summary = train(
        make_cfg(
            tmp_path, "algorithm.advantage=gae", "trainer.name=ppo", "algorithm.kl_reward_coef=0.01"
        )
    )
    ckpt = tmp_path / "runs" / "ppo" / "checkpoints" / "step_000002"
    assert (ckpt / "critic" / "train_state.pt").is_file() and (
        ckpt / "model" / "train_state.pt"
    ).is_file()
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "ppo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert (
        "critic/vf_loss" in rows[1] and "kl/coef" in rows[1] and "timing/critic_update" in rows[1]
    )
    resumed = train(
        make_cfg(
            tmp_path,
            "algorithm.advantage=gae",
            "trainer.name=ppo",
            "algorithm.kl_reward_coef=0.01",
            "trainer.total_steps=3",
        ),
        resume=True,
    )
    assert resumed["resumed_from_step"] == 2 and summary["steps"] == 2


def test_dynamic_sampling_and_gspo_run(tmp_path):
    train(
        make_cfg(
            tmp_path,
            "algorithm.filter_groups=true",
            "algorithm.policy_loss=gspo",
            "algorithm.loss_agg=seq-mean-token-mean",
            "algorithm.overlong_buffer=4",
            "trainer.name=dapo",
            "trainer.total_steps=1",
        )
    )
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "dapo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert "rollout/dropped_groups" in rows[1] and "actor/seq_ratio_mean" in rows[1]


def test_export_cli_writes_a_loadable_model(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from hybridrl.cli import main

    train(make_cfg(tmp_path, "trainer.total_steps=1", "trainer.name=exp"))
    ckpt = tmp_path / "runs" / "exp" / "checkpoints" / "step_000001"
    assert main(["export", str(ckpt), str(tmp_path / "out")]) == 0
    a = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    b = AutoModelForCausalLM.from_pretrained(ckpt / "model")
    ids = torch.tensor([[1, 4, 5, 13, 6, 15]])
    assert torch.equal(a(ids).logits, b(ids).logits)


def flaky_reward(prompt, response):
    if prompt.text.startswith(("1", "3", "5", "7", "9")):
        raise RuntimeError("reward backend unavailable")
    return float(response == prompt.answer)


def test_reward_function_that_raises_does_not_stop_the_run(tmp_path):
    summary = train(
        make_cfg(
            tmp_path,
            f"task.reward_fn={__name__}:flaky_reward",
            "trainer.name=flaky",
            "trainer.total_steps=1",
        )
    )
    rows = [
        json.loads(line)
        for line in (tmp_path / "runs" / "flaky" / "metrics.jsonl").read_text().splitlines()
    ]
    assert summary["steps"] == 1 and rows[1]["reward/errors"] > 0
