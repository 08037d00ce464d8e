"""Mixture-of-experts training (``hybridrl/moe/``): the built-in ``tiny_moe`` (active parameters
like ``tiny``'s, exact per-expert checkpoint round trip); recorded routing equals transformers' own
top-k; replaying it reproduces the forward exactly, also when a selection bias makes the fresh
routing differ for most tokens, and the router still gets gradients (Qwen3-MoE, Qwen2-MoE,
Mixtral); the ``hf`` rollout's routing reaches the batch aligned with ``input_ids`` and R3 log-probs
through the learner's micro-batching (length groups and packing) equal the rollout-time ones; R2
captures the old-policy pass; the balancing losses and the bias update against hand-computed
values; activation checkpointing recomputes each layer with its forward's routing and counts
nothing twice; the health monitor flags a collapsed router; the config checks; a 2-step GRPO run
with R3 logs ``moe/`` metrics.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from hybridrl.algorithms import agg_totals
from hybridrl.checks import check_moe
from hybridrl.config import Config, ConfigError, load_config
from hybridrl.learner.logprob import batch_log_probs, micro_batches, response_log_probs
from hybridrl.learner.moe import REPLAY, ROUTING, note_minibatch, replays_routing, start
from hybridrl.models.factory import build_model
from hybridrl.moe.balance import (
    BIAS_NAME,
    ExpertBias,
    attach_biases,
    router_z_loss,
    switch_aux_loss,
)
from hybridrl.moe.health import RoutingHealth, load_stats
from hybridrl.moe.routing import moe_gates, record, replay, same_sets
from hybridrl.protocol import Sample, samples_to_batch
from hybridrl.rollout.backends.hf import HFRollout
from hybridrl.sampling import SamplingParams
from hybridrl.tasks import TASKS

torch.manual_seed(0)


@pytest.fixture(scope="module")
def tok():
    return TASKS.get("arith")(seed=0).tokenizer()


def moe_cfg(**kw):
    base = dict(
        routing_replay="none",
        aux_loss_coef=0.0,
        z_loss_coef=0.0,
        bias_update_rate=0.0,
        health_max_mean_threshold=3.0,
        health_empty_steps=2,
    )
    return SimpleNamespace(**(base | kw))


def skew_selection(model, experts=(0, 1), amount=10.0):
    """A large selection bias on ``experts``: fresh routing picks them for (almost) every token,
    while the dispatch weights (unbiased probabilities) stay what they were."""
    attach_biases(model)
    with torch.no_grad():
        for gate in moe_gates(model):
            getattr(gate, BIAS_NAME)[list(experts)] = amount


def small_family(kind: str, vocab: int):
    """A two-layer Qwen2-MoE (shared expert, norm_topk_prob left at its default, off) or Mixtral
    (router_jitter_noise 0), random from seed 0."""
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=2,
        max_position_embeddings=128,
    )
    if kind == "qwen2_moe":
        return Qwen2MoeForCausalLM(
            Qwen2MoeConfig(
                **common,
                num_experts=6,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=64,
                intermediate_size=128,
            )
        )
    return MixtralForCausalLM(
        MixtralConfig(**common, num_local_experts=6, intermediate_size=32, router_jitter_noise=0.0)
    )


# --- the model ------------------------------------------------------------------------------------
def test_tiny_moe_active_parameters_and_checkpoint_round_trip(tok, tmp_path):
    dense, moe = build_model("tiny", tok, 0), build_model("tiny_moe", tok, 0)
    n_layers, n_experts, k = 4, 8, 2
    assert len(moe_gates(moe)) == n_layers and not moe_gates(dense)
    total = sum(p.numel() for p in moe.parameters())
    experts = sum(p.numel() for n, p in moe.named_parameters() if ".experts." in n)
    active = total - experts + experts * k // n_experts
    dense_total = sum(p.numel() for p in dense.parameters())
    assert abs(active - dense_total) / dense_total < 0.01
    # same seed, same weights; another seed, others
    again = build_model("tiny_moe", tok, 0)
    assert all(torch.equal(a, b) for a, b in zip(moe.parameters(), again.parameters()))
    other = build_model("tiny_moe", tok, 1)
    assert not torch.equal(moe.lm_head.weight, other.lm_head.weight)
    moe.save_pretrained(tmp_path)
    from safetensors import safe_open

    with safe_open(str(next(tmp_path.glob("*.safetensors"))), "pt") as f:
        keys = list(f.keys())
    assert any(".experts.7.down_proj.weight" in key for key in keys)  # per-expert names on disk
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    want, got = moe.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    assert all(torch.equal(want[key], got[key]) for key in want)


# --- recording and replay -------------------------------------------------------------------------
def test_recorded_routing_is_transformers_top_k(tok):
    model = build_model("tiny_moe", tok, 0).eval()
    ids = torch.randint(3, len(tok), (3, 11), generator=torch.Generator().manual_seed(1))
    with record(model) as rec:
        out = model(input_ids=ids, output_router_logits=True)
    recorded = rec.forwards()
    assert len(recorded) == 1 and recorded[0].shape == (33, 4, 2)
    assert recorded[0].dtype == torch.int16
    for layer, logits in enumerate(out.router_logits):
        own = torch.softmax(logits.float(), -1).topk(2, -1).indices
        assert torch.equal(recorded[0][:, layer].long(), own)


@pytest.mark.parametrize("kind", ["tiny_moe", "qwen2_moe", "mixtral"])
def test_replay_reproduces_the_forward_and_trains_the_router(tok, kind):
    model = build_model("tiny_moe", tok, 0) if kind == "tiny_moe" else small_family(kind, len(tok))
    model.eval()
    ids = torch.randint(3, len(tok), (4, 12), generator=torch.Generator().manual_seed(2))
    with record(model) as rec:
        before = model(input_ids=ids).logits
    routing = rec.forwards()[0]
    with replay(model, routing):
        again = model(input_ids=ids).logits
    assert (again - before).abs().max().item() == 0.0
    # a selection bias moves most tokens' fresh routing; replay still gives the recorded forward
    skew_selection(model)
    with record(model) as rec:
        fresh = model(input_ids=ids).logits
    changed = (~same_sets(rec.forwards()[0].long(), routing.long())).float().mean().item()
    assert changed > 0.5
    assert (fresh - before).abs().max().item() > 1e-3
    model.zero_grad()
    with replay(model, routing):
        replayed = model(input_ids=ids).logits
    assert (replayed - before).abs().max().item() <= 1e-6
    replayed.logsumexp(-1).sum().backward()
    assert all(
        g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in moe_gates(model)
    )


# --- the hf rollout's routing through the learner's micro-batches ---------------------------------
@pytest.fixture(scope="module")
def rollout_batch(tok):
    """Samples of tiny_moe from the hf backend (prompts of different lengths, 3 samples each)."""
    model = build_model("tiny_moe", tok, 0)
    engine = HFRollout(model, tok)
    prompts = [
        Sample(prompt_ids=tok(text)["input_ids"], uid=str(i))
        for i, text in enumerate(["1+2=", "123+456=", "99+7="])
    ]
    params = SamplingParams(n=3, max_new_tokens=6, seed=0)
    samples = engine.generate(prompts, params)
    return model, samples, samples_to_batch(samples, tok.pad_token_id)


def test_hf_rollout_routing_lines_up_with_input_ids(rollout_batch):
    model, samples, batch = rollout_batch
    for s in samples:
        assert s.routing.shape == (len(s.prompt_ids) + len(s.response_ids), 4, 2)
        # every token has its routing but the response's last when it was the last generate fed
        # (one that ended early was fed while the other rows went on)
        assert (s.routing[:-1] >= 0).all()
        assert (s.routing[-1] == -1).all() or (s.routing[-1] >= 0).all()
    assert any((s.routing[-1] == -1).all() for s in samples)
    routing, attn = batch[ROUTING], batch["attention_mask"]
    assert routing.shape[:2] == batch["input_ids"].shape
    assert ((routing >= 0).all(-1).all(-1) <= attn.bool()).all()  # routed tokens are real
    # each real token but the response's last carries the routing a full forward of its sequence
    # chooses (the prefill and the cached decode steps route alike, up to float noise at ties)
    for row, s in enumerate(samples):
        seq = torch.tensor([s.prompt_ids + s.response_ids])
        with record(model) as rec, torch.no_grad():
            model(input_ids=seq)
        full = rec.forwards()[0].long()
        got = routing[row][attn[row].bool()].long()
        fed = (got >= 0).all(-1).all(-1)
        same = same_sets(got[fed].flatten(0, 1), full[fed].flatten(0, 1))
        assert same.float().mean() > 0.99


@pytest.mark.parametrize("packing", [False, True])
def test_r3_log_probs_equal_the_rollout_time_ones(rollout_batch, packing):
    _, samples, batch = rollout_batch
    tok_model = replays_routing(build_model("tiny_moe", TASKS.get("arith")(seed=0).tokenizer(), 0))
    before = batch_log_probs(tok_model, batch, 64, packing=packing)
    rollout = batch["rollout_log_probs"]
    mask = batch["response_mask"].bool()
    assert (before - rollout)[mask].abs().max() < 1e-4  # hf generate vs one forward, fp32
    skew_selection(tok_model)  # the router now chooses otherwise for most tokens
    fresh = batch_log_probs(tok_model, batch, 64, packing=packing)
    assert (fresh - before)[mask].abs().max() > 1e-3
    marked = batch | type(batch)({REPLAY: torch.ones(len(batch), dtype=torch.long)})
    replayed = batch_log_probs(tok_model, marked, 64, packing=packing)
    assert (replayed - before)[mask].abs().max() < 1e-5
    # a model not marked to replay (a critic) routes afresh
    delattr(tok_model, "hybridrl_moe_replays")
    assert torch.equal(batch_log_probs(tok_model, marked, 64, packing=packing), fresh)
    # the micro-batches carry the routing trimmed like input_ids
    mbs, _ = micro_batches(marked, 16, packing)
    assert len(mbs) > 1
    assert all(mb[ROUTING].shape[:2] == mb["input_ids"].shape for mb in mbs)


@pytest.mark.parametrize("packing", [False, True])
def test_r2_replays_the_old_policy_pass(rollout_batch, tok, packing):
    _, _, batch = rollout_batch
    model = build_model("tiny_moe", tok, 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    runtime = start(model, optimizer, moe_cfg(routing_replay="r2"))
    batch = runtime.mark(batch.index(list(range(len(batch)))))
    old = batch_log_probs(model, batch, 64, packing=packing)  # the old-policy pass: captured
    batch = runtime.after_old_pass(batch)
    assert batch[REPLAY].all()
    real = batch["attention_mask"].bool()
    assert (batch[ROUTING][real] >= 0).all() and (batch[ROUTING][~real] == -1).all()
    skew_selection(model)
    mb = batch.index(list(range(len(batch))))
    with torch.enable_grad():
        logp, _ = response_log_probs(model.train(), mb)
    mask = batch["response_mask"].bool()
    assert (logp.detach() - old)[mask].abs().max() < 1e-5
    metrics = runtime.step_metrics(batch)
    assert metrics["moe/routing_changed_vs_old_pass"] > 0.5  # fresh (skewed) vs replayed


def test_expert_bias_reaches_the_hf_rollout_by_weight_sync(tok):
    trainer = build_model("tiny_moe", tok, 0)
    attach_biases(trainer)
    with torch.no_grad():
        for i, gate in enumerate(moe_gates(trainer)):
            getattr(gate, BIAS_NAME).copy_(torch.arange(8.0) * (i + 1))
    engine = HFRollout(build_model("tiny_moe", tok, 0), tok)
    engine.update_weights(list(trainer.named_parameters()), version=1)
    for mine, theirs in zip(moe_gates(engine.model), moe_gates(trainer)):
        assert torch.equal(getattr(mine, BIAS_NAME), getattr(theirs, BIAS_NAME))
    ids = torch.randint(3, len(tok), (2, 9), generator=torch.Generator().manual_seed(3))
    with record(engine.model) as a, record(trainer) as b, torch.no_grad():
        engine.model(input_ids=ids)
        trainer(input_ids=ids)
    assert torch.equal(a.forwards()[0], b.forwards()[0])  # the bias steers both alike


# --- balancing ------------------------------------------------------------------------------------
def test_switch_aux_loss_and_z_loss_by_hand():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [2.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    ids = torch.tensor([[0, 1], [0, 2], [1, 0]])
    # f = (3, 2, 1, 0) / 6; P = mean softmax per expert
    p = torch.softmax(logits, -1).mean(0)
    f = torch.tensor([3.0, 2.0, 1.0, 0.0]) / 6
    assert torch.allclose(switch_aux_loss(logits, ids), 4 * (f * p).sum())
    even = torch.zeros(8, 4)
    assert torch.allclose(switch_aux_loss(even, torch.arange(8).view(4, 2) % 4), torch.tensor(1.0))
    z = torch.logsumexp(logits, -1).pow(2).mean()
    assert torch.allclose(router_z_loss(logits), z)
    g = logits.clone().requires_grad_(True)
    switch_aux_loss(g, ids).backward()
    assert g.grad.abs().sum() > 0


def test_expert_bias_update_by_hand(tok):
    loads = torch.tensor([[10.0, 2.0, 4.0, 4.0]])  # mean 5
    assert torch.equal(ExpertBias.delta(loads, 0.1), torch.tensor([[-0.1, 0.1, 0.1, 0.1]]))
    model = build_model("tiny_moe", tok, 0)
    attach_biases(model)
    bias = ExpertBias(model, 0.01)
    counts = torch.zeros(4, 8)
    counts[:, 0] = 8  # every layer: expert 0 takes all the load
    bias.update(counts)
    want = torch.full((8,), 0.01)
    want[0] = -0.01
    assert all(torch.allclose(v, want) for v in bias.values())


def test_losses_and_bias_through_a_training_step(tok, rollout_batch):
    """The balancing losses reach the gradient through the routers, each micro-batch's weighed by
    its share of the mini-batch's response tokens: the gradient of every parameter equals that of
    the losses written out by hand on a copy of the model; their values are step metrics; after
    the optimizer step the bias moves against the loads."""
    import copy

    _, _, batch = rollout_batch
    model = build_model("tiny_moe", tok, 0)
    attach_biases(model)
    hand = copy.deepcopy(model).train()
    cfg = moe_cfg(aux_loss_coef=0.01, z_loss_coef=0.001, bias_update_rate=0.05)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    runtime = start(model, optimizer, cfg)
    batch = runtime.mark(batch.index(list(range(len(batch)))))
    totals = agg_totals(batch["response_mask"], 6)
    halves = [batch.index(list(range(4))), batch.index(list(range(4, len(batch))))]
    model.train()
    for mb in halves:
        logp, _ = response_log_probs(model, mb)
        note_minibatch(model, totals)  # the losses are in the forward's graph, weighed by these
        (logp.sum() * 0.0).backward()
    assert all(g.weight.grad.abs().sum() > 0 for g in moe_gates(model))  # the losses' gradient
    want_aux = want_z = 0.0
    for mb in halves:
        attn = mb["attention_mask"]
        with record(hand) as rec:
            out = hand(
                input_ids=mb["input_ids"],
                attention_mask=attn,
                position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                output_router_logits=True,
            )
        real = attn.reshape(-1).bool()
        ids = rec.forwards()[0].long()[real]
        share = float(mb["response_mask"].sum()) / totals.n_tokens
        logits = [lg[real] for lg in out.router_logits]
        aux = torch.stack([switch_aux_loss(lg, ids[:, i]) for i, lg in enumerate(logits)]).mean()
        z = torch.stack([router_z_loss(lg) for lg in logits]).mean()
        (share * (0.01 * aux + 0.001 * z)).backward()
        want_aux, want_z = want_aux + share * aux.item(), want_z + share * z.item()
    mine = dict(model.named_parameters())
    for name, p in hand.named_parameters():
        if p.grad is not None:
            assert torch.allclose(mine[name].grad, p.grad, rtol=1e-4, atol=1e-9), name
    loads = runtime.bias_loads.clone()
    metrics = runtime.step_metrics(batch)
    assert metrics["moe/aux_loss"] == pytest.approx(want_aux, rel=1e-5) and want_aux > 0.9
    assert metrics["moe/z_loss"] == pytest.approx(want_z, rel=1e-5)
    optimizer.step()  # the post-step hook moves the bias against the loads
    want = ExpertBias.delta(loads, 0.05)
    assert torch.allclose(runtime.bias.values(), want)
    assert runtime.bias_loads.sum() == 0


@pytest.mark.parametrize("packing", [False, True])
def test_activation_checkpointing_recomputes_with_the_forwards_routing(tok, rollout_batch, packing):
    """With activation checkpointing the backward runs each decoder layer again: its router must
    dispatch as the forward did (R3's replayed experts, not a fresh choice, which the selection bias
    makes differ for most tokens) and nothing may count twice. One training step with R3, both
    balancing losses and the expert bias gives the same gradients, expert loads and ``moe/``
    metrics with checkpointing as without."""
    from hybridrl.parallel.fsdp import enable_activation_checkpointing

    _, _, batch = rollout_batch
    cfg = moe_cfg(routing_replay="r3", aux_loss_coef=0.01, z_loss_coef=0.001, bias_update_rate=0.05)
    got = []
    for checkpointing in (False, True):
        model = build_model("tiny_moe", tok, 0)
        skew_selection(model)  # fresh routing now differs from the rollout's for most tokens
        if checkpointing:
            enable_activation_checkpointing(model)
        runtime = start(model, torch.optim.SGD(model.parameters(), lr=0.0), cfg)
        marked = runtime.mark(batch.index(list(range(len(batch)))))
        totals = agg_totals(marked["response_mask"], 6)
        mbs, _ = micro_batches(marked, 48, packing)
        model.train()
        for mb in mbs:
            logp, _ = response_log_probs(model, mb)
            note_minibatch(model, totals)
            logp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        loads = runtime.bias_loads.clone()
        got.append((grads, loads, runtime.step_metrics(marked)))
    (grads, loads, metrics), (ac_grads, ac_loads, ac_metrics) = got
    assert len(mbs) > 1 and metrics["moe/routing_changed_vs_rollout"] > 0.5  # replay mattered
    assert grads.keys() == ac_grads.keys() and len(grads) > 20
    for name, g in grads.items():
        assert torch.allclose(ac_grads[name], g, rtol=1e-5, atol=1e-7), name
    assert torch.equal(ac_loads, loads)  # each token counted once
    for key, value in metrics.items():
        assert ac_metrics[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key


# --- health ---------------------------------------------------------------------------------------
def test_load_stats_by_hand():
    stats = load_stats(torch.tensor([[4.0, 4.0, 0.0, 0.0], [2.0, 2.0, 2.0, 2.0]]))
    assert torch.allclose(stats["max_mean"], torch.tensor([2.0, 1.0], dtype=torch.float64))
    assert torch.allclose(stats["entropy"], torch.log(torch.tensor([2.0, 4.0])).double())
    assert stats["empty"].tolist() == [2, 0]


def test_monitor_flags_a_collapsed_router(tok, rollout_batch, caplog):
    _, _, batch = rollout_batch
    model = build_model("tiny_moe", tok, 0)
    skew_selection(model, experts=(3, 5), amount=100.0)  # every token to experts 3 and 5
    runtime = start(model, torch.optim.SGD(model.parameters(), lr=0.0), moe_cfg())
    with caplog.at_level(logging.WARNING, logger="hybridrl.moe.health"):
        for _ in range(2):  # health_empty_steps=2
            response_log_probs(model.train(), batch)
            metrics = runtime.step_metrics(batch)
    assert metrics["moe/max_mean"] == pytest.approx(4.0)  # 8 experts, all load on 2
    assert metrics["moe/layer0/load/3"] == pytest.approx(0.5)
    assert metrics["moe/empty_experts"] == 4 * 6
    assert metrics["moe/alert_imbalance"] == 1.0 and metrics["moe/alert_dead_expert"] == 1.0
    assert "imbalance" in caplog.text and "dead experts" in caplog.text
    healthy = RoutingHealth(3.0, 2).step(torch.ones(2, 8))
    assert healthy["moe/alert_imbalance"] == 0.0 and healthy["moe/alert_dead_expert"] == 0.0


# --- config checks --------------------------------------------------------------------------------
def test_config_checks():
    native = ["model.name=tiny_moe", "rollout.backend=native", "moe.routing_replay=r3"]
    check_moe(load_config(Config, None, native))  # the native engine serves MoE models too
    with pytest.raises(ConfigError, match="dense"):
        check_moe(load_config(Config, None, ["moe.routing_replay=r3", "rollout.backend=hf"]))
    with pytest.raises(ConfigError, match="dense"):
        check_moe(load_config(Config, None, ["moe.aux_loss_coef=0.01"]))
    ok = ["model.name=tiny_moe", "rollout.backend=hf", "moe.routing_replay=r3"]
    check_moe(load_config(Config, None, ok))
    check_moe(load_config(Config, None, []))  # dense, defaults
    # r3 with a backend that records no routing: refused, r2 (the trainer's own routing) is fine
    for backend in ("vllm", "sglang"):
        r3 = ["model.name=tiny_moe", f"rollout.backend={backend}", "moe.routing_replay=r3"]
        with pytest.raises(ConfigError, match=f"rollout.backend='{backend}' records none"):
            check_moe(load_config(Config, None, r3))
        check_moe(load_config(Config, None, [*r3[:2], "moe.routing_replay=r2"]))


@pytest.mark.parametrize("model_type", ["olmoe", "deepseek_v3"])
def test_moe_training_of_a_family_without_known_routers_is_refused(tmp_path, model_type):
    """The hooks find routers by the family table's classes: another MoE family (its config counts
    experts) would train with none of them applied, silently; refused before any work, while the
    same model trains plainly and a known family passes."""
    experts = "n_routed_experts" if model_type == "deepseek_v3" else "num_experts"
    for name, family in (("other", model_type), ("known", "qwen3_moe")):
        (tmp_path / name).mkdir()
        config = {"model_type": family, experts: 8, "num_experts_per_tok": 2}
        (tmp_path / name / "config.json").write_text(json.dumps(config))
    other = [f"model.path={tmp_path / 'other'}", "rollout.backend=hf"]
    for asked in ("moe.routing_replay=r2", "moe.aux_loss_coef=0.01", "moe.bias_update_rate=0.01"):
        with pytest.raises(ConfigError, match=f"model.path is a '{model_type}' model, whose rou"):
            check_moe(load_config(Config, None, [*other, asked]))
    check_moe(load_config(Config, None, other))  # the moe section at its defaults: plain training
    known = [f"model.path={tmp_path / 'known'}", "rollout.backend=hf", "moe.routing_replay=r2"]
    check_moe(load_config(Config, None, known))


# --- end to end -----------------------------------------------------------------------------------
def test_grpo_with_r3_on_tiny_moe_logs_moe_metrics(tmp_path):
    import hybridrl

    root = Path(__file__).resolve().parents[1]
    summary = hybridrl.train(
        root / "examples" / "arith_grpo_moe.yaml",
        overrides=[
            "rollout.backend=hf",  # the native engine's run: tests/test_rollout_moe.py
            "sft.steps=3",
            "sft.batch_size=16",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=4",
            "actor.ppo_minibatch_size=16",
            "task.eval_size=8",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "controller.num_threads=1",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            "trainer.name=moe",
        ],
    )
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "runs" / "moe" / "metrics.jsonl").open()]
    steps = [m for m in lines if "moe/max_mean" in m]
    assert len(steps) == 2
    # R3 on the weights the rollout used: the training forward routes like the rollout
    assert all(m["moe/routing_changed_vs_rollout"] < 0.05 for m in steps)
    assert all("moe/layer3/load/7" in m for m in steps)


# --- FSDP2, 2 gloo ranks --------------------------------------------------------------------------
WORLD = 2


def moe_learner(world: int = 1, rank: int = 0, port: int | None = None):
    from hybridrl.controller import WorkerContext
    from hybridrl.learner import Learner

    cfg = load_config(
        Config,
        None,
        [
            "model.name=tiny_moe",
            "rollout.backend=hf",
            "moe.routing_replay=r3",
            # (not the balancing losses: they are computed per micro-batch, and a rank's
            # micro-batches are not one process's, so they are not the same loss)
            "moe.bias_update_rate=0.01",
            "actor.ppo_minibatch_size=8",
            "actor.micro_batch_tokens=64",
        ],
    )
    ctx = WorkerContext(
        rank=rank, world_size=world, role="learner", pool="p", master_port=port, num_threads=1
    )
    return Learner(ctx, cfg, None)


def train_part(lrn, part):
    """Old log-probs, then one update (2 optimizer steps) on this rank's rows; the metrics and the
    expert loads counted over every rank (a collective)."""
    from hybridrl.parallel import distributed

    part = part | lrn.compute_log_prob(part)
    metrics = lrn.update_actor(part)
    loads = distributed.all_reduce(lrn.moe.counts.flatten().clone()).view(lrn.moe.counts.shape)
    return metrics | lrn.moe.step_metrics(part), loads


# rows of the 16-row batch each rank trains on: rank 0 runs more micro-batches, rank 1 fillers
RANK_ROWS = [slice(0, 12), slice(12, 16)]


def rank_main(rank: int, port: int, workdir: str) -> None:
    from pathlib import Path as P

    from hybridrl.parallel.distributed import teardown_distributed
    from hybridrl.parallel.fsdp import full_state_dict
    from hybridrl.protocol import Batch

    torch.set_num_threads(1)
    work = P(workdir)
    saved = torch.load(work / "batch.pt", weights_only=True)
    batch = Batch(saved)
    lrn = moe_learner(WORLD, rank, port)
    metrics, loads = train_part(lrn, batch.index(RANK_ROWS[rank]))
    state = {k: v.clone() for k, v in full_state_dict(lrn.model).items()}
    lrn.close()
    teardown_distributed()
    if rank == 0:
        torch.save({"weights": state, "metrics": metrics, "loads": loads}, work / "ranks.pt")


@pytest.mark.distributed
def test_two_rank_fsdp_moe_update_equals_one_process(tmp_path, rollout_batch):
    """R3 replay and the expert bias under FSDP2 at world size 2 train the same weights (the bias
    included), count the same expert loads and log the same ``moe/`` metrics as one process. The
    ranks hold 12 and 4 rows, so rank 1 runs filler micro-batches to keep the collectives in step:
    their tokens are no expert's load."""
    from rank_processes import launch_ranks, wait_ranks

    _, samples, _ = rollout_batch
    single = moe_learner()
    batch = samples_to_batch(samples[:8] + samples[:8], 0)
    batch = single.moe.mark(batch)
    g = torch.Generator().manual_seed(4)
    batch["advantages"] = torch.randn(len(batch), 1, generator=g) * batch["response_mask"]
    tensors = {k: v for k, v in batch.tensors.items()}
    torch.save(tensors, tmp_path / "batch.pt")
    procs = launch_ranks(__file__, WORLD, tmp_path)
    metrics, loads = train_part(single, type(batch)(tensors))
    ref = {k: v.detach().clone() for k, v in single.model.state_dict().items()}
    wait_ranks(procs, timeout=600)
    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    # every real token of the two mini-batches, once per layer and slot
    real = int(batch["attention_mask"].sum())
    assert loads.sum(-1).tolist() == [2.0 * real] * 4
    assert torch.equal(got["loads"], loads), (got["loads"].sum(-1), loads.sum(-1))
    assert any(k.endswith(BIAS_NAME) for k in ref)
    diffs = {k: (ref[k] - got["weights"][k]).abs().max().item() for k in ref}
    assert max(diffs.values()) <= 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert ref[next(k for k in ref if k.endswith(BIAS_NAME))].abs().max() > 0
    moe_keys = [k for k in metrics if k.startswith("moe/") and "previous_version" not in k]
    assert "moe/layer3/load/7" in moe_keys
    for key in ["actor/pg_loss", *moe_keys]:
        assert abs(metrics[key] - got["metrics"][key]) <= 1e-6, (
            key,
            metrics[key],
            got["metrics"][key],
        )


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "rank":
        rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
