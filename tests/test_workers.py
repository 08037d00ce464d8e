"""The real worker classes (rollout, reward, reference, actor) in the local backend with the real tiny
model: log-prob alignment between rollout and training layout, weight sync, reward errors,
policy updates and exact gradient accumulation over micro-batches."""

from __future__ import annotations

import os
from dataclasses import replace

os.environ["HF_HUB_OFFLINE"] = "1"

import math

import pytest
import torch

from hybridrl.algorithms import compute_advantages
from hybridrl.config import Config
from hybridrl.controller import ResourcePool, WorkerGroup
from hybridrl.protocol import Sample, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.tasks import Prompt
from hybridrl.trainers.evaluate import collate, prompt_batch
from hybridrl.training.logprob import micro_batches
from hybridrl.workers import ActorWorker, ReferenceWorker, RewardWorker, RolloutWorker
from hybridrl.workers.common import make_task

ATOL_LOGP = 1e-4


def exploding_reward(prompt, response, *, finished=True):
    raise RuntimeError("boom")


def make_cfg(**actor) -> Config:
    cfg = Config()
    cfg.trainer.prompts_per_step = 4
    cfg.trainer.samples_per_prompt = 2
    cfg.actor.ppo_minibatch_size = 4
    cfg.rollout.max_new_tokens = 8  # keep generation cheap on the shared 2-core machine
    for k, v in actor.items():
        setattr(cfg.actor, k, v)
    cfg.validate()
    return cfg


def group(cls, cfg, role):
    return WorkerGroup(
        cls, ResourcePool(), role=role, backend="local", args=(cfg, None), num_threads=1
    )


@pytest.fixture(scope="module")
def cfg():
    return make_cfg()


@pytest.fixture(scope="module")
def tokenizer(cfg):
    return make_task(cfg).tokenizer()


@pytest.fixture(scope="module")
def prompts(cfg, tokenizer):
    task = make_task(cfg)
    return prompt_batch([task.prompt(i) for i in range(cfg.trainer.prompts_per_step)], tokenizer)


@pytest.fixture(scope="module")
def rollout(cfg):
    return group(RolloutWorker, cfg, "rollout")


@pytest.fixture(scope="module")
def actor(cfg):
    return group(ActorWorker, cfg, "actor")


def sampled(cfg, seed=0):
    return SamplingParams(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_new_tokens=cfg.rollout.max_new_tokens,
        n=cfg.trainer.samples_per_prompt,
        seed=seed,
    )


def greedy(cfg):
    return SamplingParams(temperature=0.0, max_new_tokens=cfg.rollout.max_new_tokens, n=1)


def assert_logp_match(batch, logp):
    mask = batch["response_mask"].bool()
    diff = (batch["rollout_log_probs"] - logp).abs()[mask]
    assert diff.max().item() <= ATOL_LOGP, (
        f"max |rollout - actor| log-prob = {diff.max().item():.3g}"
    )
    assert (logp[~mask] == 0).all()


# --- rollout ------------------------------------------------------------------------------------
def test_rollout_samples_and_logprob_alignment(cfg, tokenizer, prompts, rollout, actor):
    samples = rollout.generate(prompts, sampled(cfg))
    flat = [s for part in samples for s in part]
    n, G = cfg.trainer.prompts_per_step, cfg.trainer.samples_per_prompt
    assert len(flat) == n * G
    uids = [p.uid for p in prompts["prompt"]]
    assert sorted(s.uid for s in flat) == sorted(uids * G)
    for s in flat:
        i = uids.index(s.uid)
        assert (
            s.prompt_ids == prompts["prompt_ids"][i] and s.prompt_ids[0] == tokenizer.bos_token_id
        )
        assert len(s.response_ids) == len(s.log_probs) == len(s.versions) >= 1
        assert s.versions == [0] * len(s.response_ids)
        assert all(lp <= 0 and math.isfinite(lp) for lp in s.log_probs)
        assert s.status in ("finished", "truncated")
        assert (s.status == "finished") == (s.response_ids[-1] == tokenizer.eos_token_id)
        assert s.extra["prompt"].uid == s.uid
    batch = collate(samples, tokenizer.pad_token_id)
    # prompts have different lengths, so the layout really is left-padded
    assert batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(1).unique().numel() > 1
    logp = actor.compute_log_prob(batch)["old_log_probs"]
    assert logp.shape == batch["responses"].shape
    assert_logp_match(batch, logp)


def test_logprob_alignment_at_temperature_below_one(tokenizer, prompts):
    # both sides divide the logits by the rollout temperature
    cfg = make_cfg()
    cfg.rollout.temperature = 0.7
    rollout, actor = group(RolloutWorker, cfg, "rollout"), group(ActorWorker, cfg, "actor")
    params = replace(sampled(cfg, seed=4), temperature=0.7)
    batch = collate(rollout.generate(prompts, params), tokenizer.pad_token_id)
    assert_logp_match(batch, actor.compute_log_prob(batch)["old_log_probs"])


def test_rollout_same_seed_same_samples(cfg, prompts, rollout):
    a = [s for part in rollout.generate(prompts, sampled(cfg, seed=3)) for s in part]
    b = [s for part in rollout.generate(prompts, sampled(cfg, seed=3)) for s in part]
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_greedy_is_deterministic_and_aligned(cfg, tokenizer, prompts, rollout, actor):
    a = [s for part in rollout.generate(prompts, greedy(cfg)) for s in part]
    torch.manual_seed(1234)  # greedy must not depend on the global RNG
    b = [s for part in rollout.generate(prompts, greedy(cfg)) for s in part]
    assert len(a) == cfg.trainer.prompts_per_step
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert [s.log_probs for s in a] == [s.log_probs for s in b]
    batch = samples_to_batch(a, tokenizer.pad_token_id)
    assert_logp_match(batch, actor.compute_log_prob(batch)["old_log_probs"])


def test_update_weights_syncs_rollout_to_actor(cfg, tokenizer, prompts):
    rollout, actor = group(RolloutWorker, cfg, "rollout"), group(ActorWorker, cfg, "actor")
    before = [s for part in rollout.generate(prompts, greedy(cfg)) for s in part]
    b_before = samples_to_batch(before, tokenizer.pad_token_id)
    model = actor.workers[0].model
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    # the actor changed, the rollout not yet: its behaviour log-probs no longer match
    stale = actor.compute_log_prob(b_before)["old_log_probs"]
    mask = b_before["response_mask"].bool()
    assert (stale - b_before["rollout_log_probs"]).abs()[mask].max() > 1e-2
    # small buckets: several of them, every tensor exactly once
    buckets = actor.weight_buckets(bucket_bytes=64 << 10)[0]
    assert len(buckets) > 1
    names = [name for bucket in buckets for name, _ in bucket]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    loaded = rollout.update_weights(buckets, 7)
    assert loaded == [len(names)]
    live = rollout.workers[0].engine._weight_tensors()  # the engine's weights by transformers name
    assert (
        len(set(live) & {n for n, _ in model.named_parameters()}) >= len(names) - 1
    )  # all but a tied lm_head
    for name, p in model.named_parameters():
        if name in live:
            assert torch.equal(live[name].reshape(p.shape), p), name
    after = [s for part in rollout.generate(prompts, greedy(cfg)) for s in part]
    assert all(s.versions == [7] * len(s.response_ids) for s in after)
    b_after = samples_to_batch(after, tokenizer.pad_token_id)
    assert_logp_match(b_after, actor.compute_log_prob(b_after)["old_log_probs"])
    # sampled rollouts match the new actor too
    b_sampled = collate(rollout.generate(prompts, sampled(cfg, seed=11)), tokenizer.pad_token_id)
    assert_logp_match(b_sampled, actor.compute_log_prob(b_sampled)["old_log_probs"])


# --- reward -----------------------------------------------------------------------------------------
def hand_batch(tokenizer, responses: list[tuple[str, str, str]]):
    """(prompt text, answer, response text); each response ends with <eos>."""
    samples = []
    for i, (text, answer, resp) in enumerate(responses):
        p = Prompt(uid=f"p{i}", text=text, answer=answer, task_id="arith")
        ids = tokenizer(resp, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        samples.append(
            Sample(
                tokenizer(text)["input_ids"],
                ids,
                [-0.1] * len(ids),
                [0] * len(ids),
                uid=p.uid,
                task_id="arith",
                extra={"prompt": p},
            )
        )
    return samples_to_batch(samples, tokenizer.pad_token_id)


def test_reward_exact_match(cfg, tokenizer):
    reward = group(RewardWorker, cfg, "reward")
    batch = hand_batch(
        tokenizer, [("1+2=", "3", "3"), ("10+5=", "15", "16"), ("400+600=", "1000", "1000")]
    )
    out = reward.score(batch)
    assert out["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert out["reward_errors"].tolist() == [0.0, 0.0, 0.0]
    # a truncated sample (no <eos>) scores 0 even with the right digits
    trunc = batch[[0]]
    trunc["status"] = ["truncated"]
    mask = trunc["response_mask"].clone()
    mask[0, 1] = 0  # drop the <eos>: the response is just "3"
    trunc["response_mask"] = mask
    assert reward.score(trunc)["rewards"].tolist() == [0.0]


def test_reward_function_that_raises_scores_zero(tokenizer):
    cfg = make_cfg()
    cfg.task.reward_fn = f"{__name__}:exploding_reward"
    reward = group(RewardWorker, cfg, "reward")
    batch = hand_batch(tokenizer, [("1+2=", "3", "3"), ("2+2=", "4", "5")])
    out = reward.score(batch)  # no exception
    assert out["rewards"].tolist() == [0.0, 0.0]
    assert out["reward_errors"].tolist() == [1.0, 1.0]


# --- actor update -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def train_batch(cfg, tokenizer, prompts, rollout):
    """A full step's batch (rollout, reward, reference, old log-probs, advantages) with rewards set by hand
    so that the advantages are not all zero (the random model never answers correctly)."""
    batch = collate(rollout.generate(prompts, sampled(cfg, seed=21)), tokenizer.pad_token_id)
    batch = batch | group(RewardWorker, cfg, "reward").score(batch)
    batch["rewards"] = torch.tensor([float(i % 2) for i in range(len(batch))])
    batch = batch | group(ReferenceWorker, cfg, "reference").compute_ref_log_prob(batch)
    batch = batch | group(ActorWorker, cfg, "actor").compute_log_prob(batch)
    batch = compute_advantages(batch, cfg.algorithm)
    assert batch["advantages"].abs().sum() > 0
    return batch


def params_of(wg):
    return {n: p.detach().clone() for n, p in wg.workers[0].model.named_parameters()}


def test_update_policy_metrics_and_weights_change(cfg, train_batch):
    actor = group(ActorWorker, cfg, "actor")
    before = params_of(actor)
    (metrics,) = actor.update_policy(train_batch)
    for key in (
        "actor/pg_loss",
        "actor/kl_ref",
        "actor/entropy",
        "actor/clip_frac",
        "actor/grad_norm",
    ):
        assert key in metrics and math.isfinite(metrics[key]), key
    assert metrics["actor/grad_norm"] > 0
    assert metrics["actor/entropy"] > 0
    # 8 samples / minibatch 4 = 2 optimizer steps per epoch
    assert metrics["actor/updates"] == len(train_batch) // cfg.actor.ppo_minibatch_size
    after = params_of(actor)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    # the policy moved: log-probs of the batch changed
    new = actor.compute_log_prob(train_batch)["old_log_probs"]
    mask = train_batch["response_mask"].bool()
    assert (new - train_batch["old_log_probs"]).abs()[mask].max() > 0


def record_grads(wg) -> list[dict[str, torch.Tensor]]:
    """Wraps the worker's optimizer.step to keep a copy of the gradients it applies (instrumentation only)."""
    worker, seen = wg.workers[0], []
    step = worker.optimizer.step

    def recording_step(*args, **kwargs):
        seen.append({n: p.grad.detach().clone() for n, p in worker.model.named_parameters()})
        return step(*args, **kwargs)

    worker.optimizer.step = recording_step
    return seen


def test_micro_batching_is_exact_gradient_accumulation(train_batch):
    width = train_batch["input_ids"].shape[1]
    one = group(ActorWorker, make_cfg(micro_batch_tokens=1 << 20), "actor")
    many = group(ActorWorker, make_cfg(micro_batch_tokens=1), "actor")  # one row per micro-batch
    assert len(micro_batches(train_batch[:4], 1)[0]) == 4
    assert len(micro_batches(train_batch[:4], 1 << 20)[0]) == 1
    g_one, g_many = record_grads(one), record_grads(many)
    m_one = one.update_policy(train_batch)[0]
    m_many = many.update_policy(train_batch)[0]
    # the gradient of every optimizer step is the same token-mean, up to float32 rounding
    assert len(g_one) == len(g_many) == 2
    for step, (a, b) in enumerate(zip(g_one, g_many)):
        tol = (
            1e-5 if step == 0 else 1e-4
        )  # later steps start from weights that AdamW's rounding moved (see below)
        for n in a:
            scale = a[n].abs().max().item()
            assert (a[n] - b[n]).abs().max().item() <= tol * scale + 1e-12, (step, n)
    # weights: AdamW's update lr * m/(sqrt(v)+eps) normalises each entry, so float32 rounding on entries with
    # |grad| ~ eps (1e-8) shows up as differences of up to ~1% of lr (seen: 1.6e-6 at lr 2e-4) although the
    # gradients agree to ~1e-7 relative (seen: 5.7e-6 at lr 1e-4 once micro-batches are trimmed to their own
    # width, which changes the summation order). Weights are therefore compared at 10% of lr, gradients above.
    p_one, p_many = params_of(one), params_of(many)
    worst = max((p_one[n] - p_many[n]).abs().max().item() for n in p_one)
    assert worst <= 0.1 * one.workers[0].cfg.actor.lr, f"max weight difference {worst:.3g}"
    for k in (
        "actor/pg_loss",
        "actor/kl_ref",
        "actor/entropy",
        "actor/grad_norm",
        "actor/clip_frac",
    ):
        assert m_one[k] == pytest.approx(m_many[k], rel=1e-4, abs=1e-6), k


def test_length_buckets_and_trimming_leave_log_probs_unchanged(cfg):
    """Long-tailed rows are grouped by length and their common padding is cut (W3's 1..96-token answers):
    the log-probs, in the batch's row order, equal one untrimmed forward over the whole batch."""
    from hybridrl.models import load_model_and_tokenizer
    from hybridrl.training.logprob import batch_log_probs, response_log_probs

    model, _ = load_model_and_tokenizer(None, "tiny", 0, make_task(cfg).tokenizer())
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            [1] + torch.randint(3, 17, (p,), generator=g).tolist(),
            torch.randint(3, 17, (r,), generator=g).tolist(),
            [0.0] * r,
            [0] * r,
        )
        for p, r in [(3, 40), (9, 2), (5, 1), (2, 17), (7, 3), (4, 40)]
    ]
    batch = samples_to_batch(samples, pad_id=0)
    with torch.no_grad():
        whole = response_log_probs(model.eval(), batch)[0]
    for budget in (1, 60, 1 << 20):
        assert torch.allclose(batch_log_probs(model, batch, budget), whole, atol=1e-5), budget
    mbs, order = micro_batches(batch, 60)
    assert (
        sorted(order.tolist()) == list(range(6))
        and len(mbs) == 4
        and mbs[0]["input_ids"].shape[1] < 20
    )  # 3 short rows
