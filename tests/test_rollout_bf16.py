"""The native engine in bf16 (``rollout.backend_options.dtype``) against fp32: logits and log-probs
no further from fp32 than transformers' own bf16 forward (both round weights and activations to 8
significant bits), weights synced from an fp32 actor cast on load, and what ``auto`` picks, logged
with why."""

import logging

import pytest
import torch
from test_rollout_engine import ARCHS, DEVICES, Tok, model, prompts, rcfg, reqs

from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.block_manager import BlockManager
from hybridrl.rollout.model_runner import ModelRunner
from hybridrl.rollout.sequence import Sequence


def fp32_and_bf16_log_probs(m, samples, temperature):
    """Per sample: transformers' log-probs of its tokens at ``temperature``,
    in fp32 and from a bf16 copy."""
    m16 = model().to(m.device, torch.bfloat16)
    m16.load_state_dict(m.state_dict())
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids], device=m.device)
        tok = torch.tensor(s.response_ids, device=m.device)[:, None]
        with torch.no_grad():
            lp = [
                torch.log_softmax(
                    mm(ids).logits[0, len(s.prompt_ids) - 1 : -1].float() / temperature, -1
                )
                .gather(1, tok)
                .squeeze(1)
                .cpu()
                for mm in (m, m16)
            ]
        out.append(lp)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("device", DEVICES)
def test_bf16_engine_logits_are_as_close_to_fp32_as_transformers_bf16(arch, device):
    m = model(arch).to(device)
    m16 = model(arch).to(device, torch.bfloat16)
    runner = ModelRunner(
        m.config, device=device, dtype=torch.bfloat16, block_size=4, hf_model=m
    )  # cast on load
    qkv = runner.model.model.layers[0].self_attn.qkv_proj.weight
    assert runner.embed.dtype == qkv.dtype == torch.bfloat16
    runner.allocate_kv(16)
    assert runner.k_cache.dtype == torch.bfloat16
    bm = BlockManager(16, 4)
    ps = prompts([5, 11])
    seqs = [Sequence(f"s{i}", p, SamplingParams(), 0) for i, p in enumerate(ps)]
    for s in seqs:
        bm.allocate(s)
    with torch.no_grad():
        ours = runner.execute(seqs, [len(p) for p in ps], all_logits=True)
        ref = torch.cat([m(torch.tensor([p], device=device)).logits[0] for p in ps])
        hf16 = torch.cat([m16(torch.tensor([p], device=device)).logits[0].float() for p in ps])
    assert ours.dtype == torch.float32
    err, hf_err = (ours - ref).abs().max().item(), (hf16 - ref).abs().max().item()
    assert 0 < err <= 2 * hf_err + 1e-3, (err, hf_err)


def test_bf16_engine_generates_with_fp32_log_probs_close_to_fp32():
    m = model()
    eng = NativeRollout(m, Tok(), rcfg(dtype="bf16"))
    assert eng.engine.dtype == torch.bfloat16 and eng.engine.runner.k_cache.dtype == torch.bfloat16
    p = SamplingParams(temperature=0.7, max_new_tokens=10, n=3, seed=4)
    p.ignore_eos = True
    samples = eng.generate(reqs(prompts([4, 9, 6])), p)
    assert len(samples) == 9 and all(len(s.response_ids) == 10 for s in samples)
    worst = worst_hf = 0.0
    for s, (lp32, lp16) in zip(samples, fp32_and_bf16_log_probs(m, samples, 0.7)):
        ours = torch.tensor(s.log_probs, dtype=torch.float64)  # python floats of fp32 values
        worst = max(worst, (ours - lp32.double()).abs().max().item())
        worst_hf = max(worst_hf, (lp16 - lp32).abs().max().item())
    # as close to the fp32 log-probs as transformers in bf16 is (both round
    # the weights and activations)
    assert 0 < worst <= 2 * worst_hf + 1e-3, (worst, worst_hf)


def test_rollout_dtype_picks_the_engine_dtype_and_synced_weights_are_cast(monkeypatch, caplog):
    from hybridrl.parallel import precision

    old, new = model(seed=0), model(seed=1)
    assert NativeRollout(old, Tok(), rcfg()).engine.runner.embed.dtype == torch.float32
    eng = NativeRollout(old, Tok(), rcfg(dtype="bf16"))
    eng.update_weights(iter(new.state_dict().items()), version=1)  # an fp32 actor's weights
    want = new.state_dict()["model.layers.1.mlp.down_proj.weight"].to(torch.bfloat16)
    assert torch.equal(eng.engine.runner.model.model.layers[1].mlp.down_proj.weight, want)
    # auto: bf16 when the CPU has it and the measurement says it pays (both
    # injected here), logged with why
    monkeypatch.delenv(precision.ENV_OVERRIDE, raising=False)
    monkeypatch.setattr(precision, "cpu_bf16_support", lambda: "amx_bf16")
    for gain, dtype in ((1.8, torch.bfloat16), (1.0, torch.float32)):
        monkeypatch.setattr(precision.SPEEDUPS, "get", lambda model, train, gain=gain: gain)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hybridrl.rollout.engine_dtype"):
            auto = NativeRollout(old, Tok(), rcfg(dtype="auto"))
        assert auto.engine.dtype == dtype
        assert [
            r.getMessage()
            for r in caplog.records
            if r.getMessage().startswith("rollout precision: ")
        ] == [
            f"rollout precision: {'bf16' if gain > 1.3 else 'fp32'} "
            "(rollout.backend_options.dtype=auto: CPU amx_bf16, "
            + (
                f"bf16 measured {gain:.2f}x"
                if gain > 1.3
                else f"but bf16 measured only {gain:.2f}x"
            )
            + " fp32 on one layer of this model"
            + (")" if gain > 1.3 else " (needs 1.3x))")
        ]
