"""A pipelined actor end to end: ``train`` with the learner on two Ray ranks forming one two-stage
pipeline (``actor.pp_size=2``, 1F1B) runs two synchronous GRPO steps on the tiny model; the update
and the old log-prob pass go through the pipeline (``perf/pipeline_idle_fraction`` is logged),
weight sync hands the rollout every stage's weights by name, the checkpoint is a transformers
directory of the whole model plus each pipeline rank's state, and a resumed run loads it and trains
a third step. Slow: Ray start-up (twice) and two learner processes."""

from __future__ import annotations

import json

import pytest
import torch

from hybridrl.config import Config, load_config
from hybridrl.driver.loop import train

RUN = [
    "sft.steps=2",
    "sft.batch_size=8",
    "task.eval_size=8",
    "rollout.max_new_tokens=6",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "trainer.total_steps=2",
    "trainer.save_every=2",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
    "controller.backend=ray",
    "controller.pools={train: {workers_per_node: 2, cpus_per_worker: 0.5}, "
    "gen: {cpus_per_worker: 0.5}}",
    "controller.placement={learner: train, rollout: gen}",
    "actor.pp_size=2",
    "actor.pp_schedule=1f1b",
    "actor.ppo_minibatch_size=4",
    "actor.reuse_old_log_probs=never",
    "algorithm.kl_coef=0",
    "algorithm.entropy_coef=0.01",  # a gradient even when every reward is equal
]


@pytest.mark.slow
def test_train_with_a_pipelined_actor(tmp_path):
    import ray

    where = [f"sft.checkpoint={tmp_path / 'ws'}", f"trainer.runs_dir={tmp_path / 'runs'}"]
    cfg = load_config(Config, None, [*RUN, *where])
    try:
        summary = train(cfg)
    finally:
        ray.shutdown()
    assert summary["steps"] == 2
    run = tmp_path / "runs" / cfg.trainer.name
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]  # row 0: the evaluation before training
    assert len(steps) == 2
    for row in steps:
        assert 0.0 <= row["perf/pipeline_idle_fraction"] < 1.0
        assert row["actor/updates"] == 2 and row["actor/grad_norm"] > 0
    from transformers import AutoModelForCausalLM

    model_dir = run / "checkpoints" / "step_000002" / "model"
    saved = AutoModelForCausalLM.from_pretrained(model_dir)
    assert all(torch.isfinite(p).all() for p in saved.parameters())
    assert (model_dir / "pipeline" / "stage0").is_dir() and (
        model_dir / "pipeline" / "stage1"
    ).is_dir()
