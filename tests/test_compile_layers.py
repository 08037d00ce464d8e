"""actor.compile (learner/compile.py): which models get compiled decoder layers, and that the
compiled layers give eager's log-probs and gradients on packed shared-prompt micro-batches without
recompiling for micro-batches of other widths and row counts."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.learner.compile import compile_layers, decide, decoder_layers
from hybridrl.learner.logprob import PACK_RESP, micro_batches, response_log_probs
from hybridrl.models.factory import build_model
from hybridrl.parallel.precision import set_autocast
from hybridrl.protocol import Sample, samples_to_batch
from hybridrl.tasks.tokenizer import build_char_tokenizer

torch.set_num_threads(1)
CPU = torch.device("cpu")
TOL = 1e-5


def qwen2(hidden: int, layers: int = 1) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=17,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config)


def test_auto_compiles_a_mid_size_fp32_cpu_model_only():
    assert decide("auto", qwen2(512), CPU).on
    assert not decide("auto", qwen2(128), CPU).on  # tiny: the compile does not pay
    assert decide(True, qwen2(128), CPU).on
    assert not decide(False, qwen2(512), CPU).on
    bf16 = set_autocast(qwen2(512), torch.bfloat16, "cpu")
    assert decide("auto", bf16, CPU).on  # bf16 autocast on a CPU pays too
    assert "bf16 autocast" in decide("auto", bf16, CPU).reason
    assert not decide("auto", qwen2(512), torch.device("cuda")).on


def test_untested_families_are_never_compiled():
    moe = build_model("tiny_moe", build_char_tokenizer(), 0)
    choice = decide(True, moe, CPU)
    assert not choice.on and "tested family" in choice.reason
    assert not decide(True, torch.nn.Linear(2, 2), CPU).on  # no decoder layers


def group_batch(seed: int, groups: int, longest: int):
    """Groups of 4 samples sharing a prompt (3-7 tokens), responses of 1..``longest`` tokens,
    shuffled."""
    rng = random.Random(seed)
    samples = []
    for g in range(groups):
        prompt = [1] + [rng.randrange(3, 15) for _ in range(rng.randrange(2, 7))]
        for _ in range(4):
            response = [rng.randrange(3, 15) for _ in range(rng.randrange(1, longest))]
            samples.append(Sample(prompt_ids=prompt, response_ids=response, uid=f"g{g}"))
    rng.shuffle(samples)
    return samples_to_batch(samples, pad_id=0)


def passes(model, mbs):
    """Per micro-batch: (log-probs of the training forward, no-grad log-probs), and the summed
    gradients by name."""
    model.zero_grad(set_to_none=True)
    out = []
    for mb in mbs:
        model.train()
        lp, ent = response_log_probs(model, mb, 1.0, with_entropy=True)
        (lp.sum() + 0.1 * ent.sum()).backward()
        model.eval()
        with torch.no_grad():
            out.append((lp.detach(), response_log_probs(model, mb, 1.0)[0]))
    return out, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow  # inductor compiles a train and a no-grad graph: about a minute on 2 cores
def test_compiled_layers_match_eager_and_do_not_recompile():
    from torch._dynamo.utils import counters

    eager = build_model("tiny", build_char_tokenizer(), 0)
    compiled = compile_layers(copy.deepcopy(eager))
    assert all(hasattr(layer, "_compiled_call_impl") for layer in decoder_layers(compiled))
    # micro-batches of different widths and row counts (at least 2: a size-1 dimension is
    # specialised and compiles once more)
    mbs = []
    for seed, groups, longest, budget in ((0, 6, 30, 256), (1, 3, 60, 2048), (2, 4, 20, 512)):
        mbs += micro_batches(group_batch(seed, groups, longest), budget, True, 1 / 768, True)[0]
    assert all(PACK_RESP in mb for mb in mbs)
    widths = {int(mb["pack_resp"].max()) for mb in mbs}
    rows = {int(mb["pack_row"].max()) + 1 for mb in mbs}
    assert len(widths) > 2 and len(rows) > 1 and min(rows) >= 2
    counters.clear()
    got, got_grads = passes(compiled, mbs[:1])
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2  # the train and the no-grad graphs were compiled
    more, more_grads = passes(compiled, mbs[1:])
    assert counters["stats"]["unique_graphs"] == graphs  # no recompile for other shapes
    want, want_grads = passes(eager, mbs[:1])
    want_more, want_more_grads = passes(eager, mbs[1:])
    for (a, b), (c, d) in zip(got + more, want + want_more):
        torch.testing.assert_close(a, c, rtol=0, atol=TOL)
        torch.testing.assert_close(b, d, rtol=0, atol=TOL)
    for mine, ref in ((got_grads, want_grads), (more_grads, want_more_grads)):
        scale = max(g.abs().max().item() for g in ref.values())
        assert scale > 1e-2
        assert max((mine[k] - ref[k]).abs().max().item() for k in ref) <= TOL * scale


@pytest.mark.slow  # inductor compiles a train and a no-grad graph under autocast: about a minute
def test_compiled_layers_under_bf16_autocast_are_as_close_to_fp32_as_eager():
    """Under bf16 autocast neither the eager nor the compiled layers equal fp32; the compiled ones
    round in another order, and must stay as close to the fp32 log-probs and gradients as eager
    bf16 is (within 1.5x of its error)."""
    fp32 = build_model("tiny", build_char_tokenizer(), 0)
    eager = set_autocast(copy.deepcopy(fp32), torch.bfloat16, "cpu")
    compiled = set_autocast(compile_layers(copy.deepcopy(fp32)), torch.bfloat16, "cpu")
    mbs = micro_batches(group_batch(0, 6, 30), 256, True, 1 / 768, True)[0]
    (ref, ref_grads), got, want = passes(fp32, mbs), passes(compiled, mbs), passes(eager, mbs)

    def err(run) -> tuple[float, float]:
        out, grads = run
        lp = max((a - r).abs().max().item() for (a, _), (r, _) in zip(out, ref))
        g = max((grads[k] - ref_grads[k]).abs().max().item() for k in ref_grads)
        return lp, g

    (lp_c, g_c), (lp_e, g_e) = err(got), err(want)
    assert lp_e > 0 and g_e > 0  # bf16 really ran
    assert lp_c <= 1.5 * lp_e and g_c <= 1.5 * g_e
