"""update_weights checks what a sync delivered: every weight (or LoRA adapters only), no unknown
names; after a failed sync the engine refuses to generate until a complete one arrives."""

import pytest
import torch
from test_rollout_engine import Tok, greedy, hf_greedy, model, prompts, rcfg, reqs

from hybridrl.rollout import ROLLOUT_BACKENDS
from hybridrl.rollout.base import WeightSyncError

torch.set_num_threads(1)
BACKENDS = ["native", "hf"]


def engine(backend, m):
    return ROLLOUT_BACKENDS.get(backend)(m, Tok(), rcfg(backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_sync_missing_weights_is_refused_until_a_complete_one_arrives(backend):
    new = model(seed=1)
    eng = engine(backend, model(seed=0))
    state = list(new.state_dict().items())
    dropped = sorted(n for n, _ in state if n.startswith("model.layers.1."))
    with pytest.raises(
        WeightSyncError, match=rf"{len(dropped)} of its \d+ weights missing: \['{dropped[0]}'"
    ):
        eng.update_weights(iter([(n, t) for n, t in state if n not in dropped]), version=1)
    assert eng.version == 0
    with pytest.raises(
        RuntimeError, match="last weight sync failed"
    ):  # layer 0 is new, layer 1 old: not served
        eng.generate(reqs(prompts([5])), greedy(4))
    buckets = [
        state[i : i + 5] for i in range(0, len(state), 5)
    ]  # as the rollout worker receives a version
    assert eng.update_weights((item for bucket in buckets for item in bucket), version=2) == len(
        state
    )
    ps = prompts([5, 8])
    out = eng.generate(reqs(ps), greedy(6))
    assert [s.response_ids for s in out] == [hf_greedy(new, p, 6) for p in ps] and out[
        0
    ].versions == [2] * 6


@pytest.mark.parametrize("backend", BACKENDS)
def test_unknown_names_and_empty_syncs_are_refused_with_the_names(backend):
    eng = engine(backend, model())
    state = list(model(seed=1).state_dict().items())
    extra = [(f"model.layers.{i}.mlp.extra_proj.weight", torch.zeros(3)) for i in range(7)]
    with pytest.raises(
        WeightSyncError,
        match=r"7 name\(s\) the rollout model does not have: \['model.layers.0.mlp.extra_proj",
    ):
        eng.update_weights(iter(state[:4] + extra + state[4:]), version=1)
    with pytest.raises(WeightSyncError, match="no tensors at all"):
        eng.update_weights(iter([]), version=1)
    # a partial set of full weights next to adapters is neither a full sync nor an adapter-only one
    mod = "model.layers.0.self_attn.k_proj"
    w = dict(state)[mod + ".weight"]
    adapter = [
        (mod + ".lora_A", torch.zeros(2, w.shape[1])),
        (mod + ".lora_B", torch.zeros(w.shape[0], 2)),
        (mod + ".lora_scaling", torch.tensor(1.0)),
    ]
    with pytest.raises(WeightSyncError, match="weights missing"):
        eng.update_weights(iter([(mod + ".weight", w)] + adapter), version=1)
    assert eng.update_weights(iter(state + adapter), version=3) > 0  # base weights, then adapters
    assert eng.update_weights(iter(adapter), version=4) > 0  # adapters only
    assert eng.generate(reqs(prompts([4])), greedy(3))[0].versions == [4] * 3
