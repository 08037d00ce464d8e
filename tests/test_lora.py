"""LoRA on the actor (``learner/lora.py``): only the adapters train, the adapter-only weight sync
merges into the rollout's base weights without accumulating, its bytes are a small fraction of a
full sync, checkpoints resume and export, FSDP2 on 2 gloo ranks equals one process, and
``train()`` runs."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

import pytest
import torch
from batches import prompt_response_batch
from rank_processes import launch_ranks, wait_ranks
from test_train_e2e import TINY_RUN

from hybridrl.config import Config, load_config
from hybridrl.controller import WorkerContext
from hybridrl.learner import Learner
from hybridrl.learner import lora as lora_lib
from hybridrl.models.loading import load_model
from hybridrl.parallel.fsdp import iter_weight_buckets
from hybridrl.parallel.sharded_checkpoint import export_hf
from hybridrl.protocol import Batch
from hybridrl.rollout import ROLLOUT_BACKENDS

TOL = 1e-5
CTX1 = WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=1)


def make_cfg(rank: int = 8, lr: float = 1e-2) -> Config:
    cfg = Config()
    cfg.actor.ppo_minibatch_size = 4
    cfg.actor.lr = lr  # default: big steps, the adapters move far from zero
    cfg.actor.lora_rank = rank  # the schema fields may not exist yet: plain attributes work too
    cfg.actor.lora_alpha = 16.0
    return cfg


def make_batch(
    vocab: int, n: int = 8, prompt_len: int = 5, resp_len: int = 6, seed: int = 0
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return prompt_response_batch(g, vocab, n, prompt_len, resp_len)


def rl_batch(actor: Learner, seed: int = 0) -> Batch:
    batch = make_batch(actor.tokenizer.vocab_size if actor.tokenizer else 64, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    old = actor.compute_log_prob(batch)["old_log_probs"]
    rmask = batch["response_mask"]
    adv = torch.randn(len(batch), 1, generator=g).expand_as(old) * rmask
    return batch | Batch(
        {
            "old_log_probs": old,
            "ref_log_probs": old.clone(),
            "advantages": adv.contiguous(),
            "rollout_log_probs": old,
        }
    )


def logits(model, batch: Batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits


def merged_model(actor: Learner):
    plain, _ = load_model(actor.cfg, None)
    plain.load_state_dict(lora_lib.merged_weights(actor.model), strict=False)
    return plain


def hf_rollout(cfg: Config, model=None):
    if model is None:
        model, _ = load_model(cfg, None)
    return ROLLOUT_BACKENDS.get("hf")(model, None, cfg.rollout)


@pytest.fixture(scope="module")
def trained():
    """A LoRA actor after two updates, with its batch."""
    actor = Learner(CTX1, make_cfg(), None)
    batch = rl_batch(actor)
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    actor.update_actor(batch)
    after1 = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    grads = {n for n, p in actor.model.named_parameters() if p.grad is not None}
    actor.update_actor(batch)
    return {"actor": actor, "batch": batch, "before": before, "after1": after1, "grads": grads}


def test_only_adapters_train(trained):
    actor = trained["actor"]
    names = {n for n, _ in actor.model.named_parameters()}
    adapters = {n for n in names if ".lora_A." in n or ".lora_B." in n}
    assert adapters and len(adapters) == 2 * 7 * actor.model.config.num_hidden_layers
    assert {n for n, p in actor.model.named_parameters() if p.requires_grad} == adapters
    opt_params = {id(p) for group in actor.optimizer.param_groups for p in group["params"]}
    assert opt_params == {id(p) for n, p in actor.model.named_parameters() if n in adapters}
    assert trained["grads"] and trained["grads"] <= adapters
    now = {n: p.detach() for n, p in actor.model.named_parameters()}
    changed = {n for n in names if not torch.equal(trained["before"][n], now[n])}
    assert changed == adapters  # step 1 moves B (A's gradient is 0 while B = 0), step 2 moves A too
    assert {
        n for n in names if not torch.equal(trained["before"][n], trained["after1"][n])
    } <= adapters


def test_sync_matches_merged_model_and_does_not_accumulate(trained):
    actor, batch = trained["actor"], trained["batch"]
    want = logits(merged_model(actor), batch)
    # the actor's own (unmerged) forward agrees with the merged weights
    assert (logits(actor.model, batch) - want).abs().max().item() <= TOL
    fresh = Learner(CTX1, make_cfg(), None)  # a new actor's first sync sends the base too
    rollout = hf_rollout(actor.cfg)
    first = actor.weight_buckets(mode="base")
    assert (
        rollout.update_weights((item for b in first for item in b), 1) > 0 and rollout.version == 1
    )
    assert (logits(rollout.model, batch) - want).abs().max().item() <= TOL
    w1 = {n: p.detach().clone() for n, p in rollout.model.named_parameters()}
    base, _ = load_model(actor.cfg, None)
    base = dict(base.named_parameters())
    assert any(
        not torch.equal(base[n], w) for n, w in w1.items()
    )  # the trained adapters moved the merged weights
    for version in (2, 3):  # adapters only, twice: the same weights, no accumulation
        buckets = actor.weight_buckets(mode="adapter")
        names = [n for b in buckets for n, _ in b]
        assert names and all(n.endswith((".lora_A", ".lora_B", ".lora_scaling")) for n in names)
        assert (
            rollout.update_weights((item for b in buckets for item in b), version) > 0
        )  # a sync that merged something
        assert all(torch.equal(w1[n], p) for n, p in rollout.model.named_parameters())
    # the fresh actor (B = 0): merging its adapters restores the base exactly
    rollout.update_weights((item for b in fresh.weight_buckets(mode="adapter") for item in b), 4)
    assert all(torch.equal(base[n], p) for n, p in rollout.model.named_parameters())


def test_first_sync_resets_a_rollout_built_from_merged_weights(trained):
    """After a resume the rollout is built from the merged checkpoint: the actor's first (auto) sync
    sends the base, so the adapters are not added twice."""
    actor, batch = trained["actor"], trained["batch"]
    merged = merged_model(actor)
    want = logits(merged, batch)
    rollout = hf_rollout(actor.cfg, merged_model(actor))
    actor.actor.base_synced = False
    auto = actor.weight_buckets()
    assert (
        any(n == "model.embed_tokens.weight" for b in auto for n, _ in b)
        and actor.actor.base_synced
    )
    rollout.update_weights((item for b in auto for item in b), 1)
    assert (logits(rollout.model, batch) - want).abs().max().item() <= TOL
    rollout.update_weights(
        (item for b in actor.weight_buckets() for item in b), 2
    )  # auto: adapters only now
    assert (logits(rollout.model, batch) - want).abs().max().item() <= TOL


def test_shm_sync_of_a_lora_learner_goes_through_its_buckets():
    """The shm transport moves a single-rank learner's parameters into its staging file when they
    are its weights; a LoRA learner's are not (PEFT names, the base sent once, then adapters), so
    it publishes its buckets, and the rollout loads them."""
    from hybridrl.parallel.weight_sync import SHM_DIR, ShmTransport

    if SHM_DIR is None:
        pytest.skip("no shared-memory directory")
    assert Learner(CTX1, Config(), None).weights_are_parameters  # a plain one's are
    actor = Learner(CTX1, make_cfg(), None)
    assert not actor.weights_are_parameters
    rollout = hf_rollout(actor.cfg, merged_model(actor))
    with ShmTransport() as writer, ShmTransport() as reader:
        handle = writer.publish(actor, 1)
        assert not writer.rehomed
        assert reader.load(rollout, handle, 1) > 0  # the rollout's sync check accepts the names
    assert actor.actor.base_synced


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_every_backend_merges_lora_syncs(trained, backend):
    """The merge lives in ``RolloutEngine``: each backend's live weights equal the merged
    weights after repeated syncs."""
    actor = trained["actor"]
    model, tok = load_model(actor.cfg, None)
    rollout = ROLLOUT_BACKENDS.get(backend)(
        model,
        tok,
        dataclasses.replace(
            actor.cfg.rollout,
            backend=backend,
            backend_options={"kv_cache_bytes": 4 << 20} if backend == "native" else {},
        ),
    )
    want = lora_lib.merged_weights(actor.model)
    for version, mode in enumerate(["base", "adapter", "adapter"], 1):
        rollout.update_weights(
            (item for b in actor.weight_buckets(mode=mode) for item in b), version
        )
        live = rollout._weight_tensors()
        assert max((live[k] - want[k]).abs().max().item() for k in want) <= 1e-6


def test_lora_sync_bytes_are_a_small_fraction(trained):
    actor = trained["actor"]
    adapter = lora_lib.sync_bytes(actor.weight_buckets(mode="adapter"))
    full = lora_lib.sync_bytes(iter_weight_buckets(load_model(actor.cfg, None)[0]))
    assert lora_lib.sync_bytes(actor.weight_buckets(mode="merged")) == full
    c, r = actor.model.config, 8
    hd = c.hidden_size // c.num_attention_heads
    dims = [
        (c.hidden_size, c.hidden_size),
        (c.hidden_size, hd * c.num_key_value_heads),
        (c.hidden_size, hd * c.num_key_value_heads),
        (c.hidden_size, c.hidden_size),
        (c.hidden_size, c.intermediate_size),
        (c.hidden_size, c.intermediate_size),
        (c.intermediate_size, c.hidden_size),
    ]
    expected = c.num_hidden_layers * (
        sum(4 * r * (i + o) for i, o in dims) + 4 * len(dims)
    )  # fp32 A, B + scaling
    assert adapter == expected
    assert adapter / full < 0.1, (adapter, full)


@pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing.*:FutureWarning"
)  # inside PeftModel.from_pretrained
def test_checkpoint_resume_and_export(trained, tmp_path):
    actor, batch = trained["actor"], trained["batch"]
    path = tmp_path / "model"
    actor.save_checkpoint(str(path))
    assert (path / "model.safetensors").is_file() and (
        path / "adapter" / "adapter_config.json"
    ).is_file()
    assert (
        path / "adapter" / "adapter_model.safetensors"
    ).is_file() and lora_lib.is_lora_checkpoint(path)
    # resume as the trainer does: built from the checkpoint (the merged weights), then load_state
    resumed = Learner(CTX1, make_cfg(), str(path))
    resumed.load_state(str(path))
    a = {n: p.detach() for n, p in actor.model.named_parameters()}
    assert all(torch.equal(a[n], p) for n, p in resumed.model.named_parameters())
    for p1, p2 in zip(
        actor.optimizer.param_groups[0]["params"], resumed.optimizer.param_groups[0]["params"]
    ):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(actor.optimizer.state[p1][k], resumed.optimizer.state[p2][k])
    assert torch.equal(actor.actor.shuffle.get_state(), resumed.actor.shuffle.get_state())
    # export: a transformers directory with the merged model's logits
    import transformers

    out = export_hf(path, tmp_path / "exported")
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        out, local_files_only=True, dtype=torch.float32
    )
    assert (logits(exported, batch) - logits(actor.model, batch)).abs().max().item() <= TOL
    from peft import PeftModel

    base, _ = load_model(actor.cfg, None)
    peft_loaded = PeftModel.from_pretrained(base, str(path / "adapter"))
    assert (logits(peft_loaded, batch) - logits(actor.model, batch)).abs().max().item() <= TOL


# --- FSDP2 on 2 gloo ranks ------------------------------------------------------------------------
WORLD = 2
# Adam turns rounding-level gradient differences into steps of up to lr: keep lr small here
FSDP_LR = 1e-4


def rank_main(rank: int, port: int, workdir: str) -> None:
    from hybridrl.parallel.distributed import teardown_distributed

    torch.set_num_threads(1)
    work = Path(workdir)
    batch = Batch(torch.load(work / "batch.pt", weights_only=True))
    ctx = WorkerContext(
        rank=rank, world_size=WORLD, role="learner", pool="p", master_port=port, num_threads=1
    )
    actor = Learner(ctx, make_cfg(lr=FSDP_LR), None)
    from torch.distributed.tensor import DTensor

    params = dict(actor.model.named_parameters())
    layout = {
        "sharded": all(isinstance(p, DTensor) for p in params.values()),
        "trainable": sorted(n for n, p in params.items() if p.requires_grad),
        "optimized": len(actor.optimizer.param_groups[0]["params"]),
    }
    actor.update_actor(batch.chunk(WORLD)[rank])
    buckets = actor.weight_buckets(mode="base")
    merged = lora_lib.merged_weights(actor.model)
    actor.save_checkpoint(str(work / "ckpt"))
    fresh = Learner(ctx, make_cfg(lr=FSDP_LR), str(work / "ckpt"))
    fresh.load_state(str(work / "ckpt"))
    reloaded = lora_lib.merged_weights(fresh.model)
    actor.close()
    fresh.close()
    teardown_distributed()
    if rank == 0:
        torch.save(
            {"buckets": buckets, "merged": merged, "reloaded": reloaded, "layout": layout},
            work / "ranks.pt",
        )


@pytest.mark.distributed
def test_two_fsdp_ranks_equal_one_process(tmp_path):

    single = Learner(CTX1, make_cfg(lr=FSDP_LR), None)
    batch = rl_batch(single)
    torch.save(batch.tensors, tmp_path / "batch.pt")
    procs = launch_ranks(__file__, WORLD, tmp_path)
    single.update_actor(batch)
    want = lora_lib.merged_weights(single.model)
    want_buckets = dict(item for b in single.weight_buckets(mode="base") for item in b)
    wait_ranks(procs, timeout=240)
    got = torch.load(tmp_path / "ranks.pt", weights_only=False)
    lay, adapters = (
        got["layout"],
        sorted(n for n, p in single.model.named_parameters() if p.requires_grad),
    )
    assert lay["sharded"] and lay["trainable"] == adapters and lay["optimized"] == len(adapters), (
        lay
    )
    assert (
        max(t.abs().max().item() for k, t in want_buckets.items() if k.endswith(".lora_B"))
        > 10 * TOL
    )  # it trained
    names = dict(item for b in got["buckets"] for item in b)
    assert names.keys() == want_buckets.keys()
    assert max((names[k] - want_buckets[k]).abs().max().item() for k in names) <= TOL
    assert got["merged"].keys() == want.keys()
    assert max((got["merged"][k] - want[k]).abs().max().item() for k in want) <= TOL
    assert all(torch.equal(got["merged"][k], got["reloaded"][k]) for k in want)
    # the sharded checkpoint's merged model loads in one process
    import transformers

    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", local_files_only=True, dtype=torch.float32
    )
    assert max((p - want[n]).abs().max().item() for n, p in exported.named_parameters()) <= TOL


# --- the trainer ----------------------------------------------------------------------------------
def test_train_two_steps_with_lora_then_resume(tmp_path):
    from hybridrl.driver.loop import train

    tiny = [
        *TINY_RUN,
        f"sft.checkpoint={tmp_path / 'ws'}",
        f"trainer.runs_dir={tmp_path / 'runs'}",
        "trainer.name=lora",
    ]
    cfg = load_config(Config, None, tiny)
    cfg.actor.lora_rank = 8
    summary = train(cfg)
    assert summary["steps"] == 2
    ckpt = tmp_path / "runs" / "lora" / "checkpoints" / "step_000002" / "model"
    assert (ckpt / "model.safetensors").is_file() and lora_lib.is_lora_checkpoint(ckpt)
    assert lora_lib.base_source_of(ckpt) == str(tmp_path / "ws")
    cfg = load_config(Config, None, [*tiny, "trainer.total_steps=3"])
    cfg.actor.lora_rank = 8
    resumed = train(cfg, resume=True)
    assert resumed["resumed_from_step"] == 2 and resumed["steps"] == 3


if __name__ == "__main__" and sys.argv[1] == "rank":
    rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    # FSDP2's hooks leave Python/C++ reference cycles that gc cannot break, so the gloo group
    # outlives destroy_process_group() and its threads can abort the interpreter's exit ("terminate
    # called without an active exception", about 1 run in 7 here). The results are written by now:
    # leave without that exit.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def test_targets_are_spelled_out_as_linear_modules_and_a_miss_is_named():
    """PEFT gets the Linear modules the targets name (a name or a dotted suffix of one), never a
    fused 3-D expert tensor; targets that name no Linear module fail naming what the model has."""
    from hybridrl.models.factory import build_model
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    moe = build_model("tiny_moe", tok, 0)
    names = lora_lib.linear_targets(moe, ("self_attn.q_proj", "up_proj"))
    assert names == [f"model.layers.{i}.self_attn.q_proj" for i in range(4)]  # no expert tensor
    with pytest.raises(ValueError, match=r"\['qkv'\] names no Linear module.*: down_proj, "):
        lora_lib.linear_targets(build_model("tiny", tok, 0), ("qkv",))


def test_all_linear_is_every_linear_module_but_the_head():
    """PEFT's all-linear, spelled out: the seven projections of every layer, not lm_head (tied or
    not); a config takes it as one string."""
    from hybridrl.config import Config, load_config
    from hybridrl.models.factory import build_model
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    model = build_model("tiny", build_char_tokenizer(), 0)
    names = lora_lib.linear_targets(model, ("all-linear",))
    assert len(names) == 4 * 7 and not any("lm_head" in n for n in names)
    cfg = load_config(Config, None, ["actor.lora_rank=4", "actor.lora_target_modules=all-linear"])
    peft_model = lora_lib.apply_lora(model, lora_lib.lora_settings(cfg))
    adapted = {
        n.rsplit(".lora_A", 1)[0] for n, _ in peft_model.named_parameters() if ".lora_A" in n
    }
    assert len(adapted) == 4 * 7


def test_mlp_targets_that_peft_maps_onto_the_experts_are_refused():
    """A Qwen3-MoE with a dense first layer: PEFT maps the MLP names onto the routed experts'
    fused tensors, so those targets are refused with the names to leave out; attention works."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hybridrl.models.factory import MOE_SIZES

    config = Qwen3MoeConfig(vocab_size=64, **(MOE_SIZES["tiny_moe"] | {"mlp_only_layers": [0]}))
    with pytest.raises(ValueError, match=r"MLP names \['down_proj', 'gate_proj', 'up_proj'\]"):
        lora_lib.apply_lora(Qwen3MoeForCausalLM(config), lora_lib.LoraSettings(rank=4))
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    model = lora_lib.apply_lora(
        Qwen3MoeForCausalLM(config), lora_lib.LoraSettings(4, targets=attention)
    )
    adapted = {n for n, p in model.named_parameters() if p.requires_grad}
    assert adapted and all(".self_attn." in n for n in adapted)
