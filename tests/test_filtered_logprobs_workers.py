"""The real rollout worker and learner (policy and reference) with filtered sampling (top-k and
top-p from the config): at equal weights the learner's old log-probs equal the engine's behaviour
log-probs (decoupled PPO's weight pi_prox / mu is 1), the reference's equal the policy's (the KL
starts at 0), and the learner's policy loss applies the rollout correction weights."""

from __future__ import annotations

import copy
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch

from hybridrl.algorithms import agg_totals
from hybridrl.algorithms.rollout_correction import WEIGHT_KEY
from hybridrl.config import Config
from hybridrl.controller import ResourcePool, WorkerGroup
from hybridrl.learner import Learner
from hybridrl.models.loading import make_task
from hybridrl.protocol import prompt_sample, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.worker import RolloutWorker


def group(cls, cfg, role):
    return WorkerGroup(
        cls, ResourcePool(), role=role, backend="local", args=(cfg, None), num_threads=1
    )


@pytest.fixture(scope="module")
def setup():
    cfg = Config()
    cfg.trainer.prompts_per_step, cfg.trainer.samples_per_prompt, cfg.actor.ppo_minibatch_size = (
        4,
        4,
        16,
    )
    cfg.rollout.max_new_tokens = 8
    cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p = 0.8, 6, 0.9
    cfg.algorithm.kl_coef, cfg.algorithm.entropy_coef = 0.0, 0.0
    cfg.validate()
    task = make_task(cfg)
    tok = task.tokenizer()
    prompts = [prompt_sample(task.prompt(i), tok) for i in range(cfg.trainer.prompts_per_step)]
    r = cfg.rollout  # the SamplingParams the trainer session builds from the config
    params = SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        n=cfg.trainer.samples_per_prompt,
        seed=3,
    )
    batch = samples_to_batch(
        group(RolloutWorker, cfg, "rollout").generate(prompts, params), tok.pad_token_id
    )
    learner = group(Learner, cfg, "learner")
    assert learner.workers[0].reference is None  # no KL term reads it: the learner builds none
    with_kl = copy.deepcopy(cfg)
    with_kl.algorithm.kl_coef = 0.01
    with_ref = group(Learner, with_kl, "learner").workers[0]  # a KL term reads the reference
    batch = (
        batch
        | learner.compute_log_prob(batch)
        | with_ref.reference.log_probs(batch, with_ref.actor.shuffle)
    )
    return cfg, learner, batch


def test_learner_and_reference_log_probs_equal_the_filtered_behaviour_log_probs(setup):
    _, _, batch = setup
    mask = batch["response_mask"].bool()
    gap = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs()[mask]
    assert gap.max() < 1e-5, gap.max()
    weight = torch.exp(batch["old_log_probs"] - batch["rollout_log_probs"])[
        mask
    ]  # decoupled PPO's pi_prox / mu
    assert (weight - 1).abs().max() < 1e-5
    assert torch.equal(batch["ref_log_probs"], batch["old_log_probs"])


def test_learner_loss_multiplies_the_policy_loss_by_the_rollout_weights(setup):
    _, learner, batch = setup
    worker = learner.workers[0]
    g = torch.Generator().manual_seed(0)
    mb = batch.index(slice(0, 8))
    mb["advantages"] = torch.randn(mb["responses"].shape, generator=g) * mb["response_mask"]
    totals = agg_totals(mb["response_mask"])
    base, m1 = worker.policy_loss(mb, totals)
    mb[WEIGHT_KEY] = torch.full(mb["responses"].shape, 2.0) * mb["response_mask"]
    doubled, m2 = worker.policy_loss(mb, totals)
    assert abs(base.item()) > 1e-4
    assert doubled.item() == pytest.approx(2 * base.item(), rel=1e-5)
    assert m2["actor/pg_loss"] == pytest.approx(2 * m1["actor/pg_loss"], rel=1e-5)
    mb[WEIGHT_KEY] = torch.zeros(mb["responses"].shape)
    assert worker.policy_loss(mb, totals)[0].item() == 0.0
