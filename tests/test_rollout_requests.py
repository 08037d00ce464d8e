"""How requests enter a backend: seeds from each request's identity (not its position in the call),
and groups larger than the engine's seats."""

import pytest
import torch
from test_rollout_engine import Tok, model, prompts, rcfg

from hybridrl.protocol import Batch, Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams

torch.set_num_threads(1)


def as_ranks(requests, world_size):
    """The requests each data-parallel rank receives: contiguous chunks,
    as DP_COMPUTE splits a Batch."""
    batch = Batch(meta={"request": list(requests)})
    return [part["request"] for part in batch.chunk(world_size)]


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_samples_do_not_depend_on_how_the_prompts_are_split_among_ranks(backend):
    m = model()
    ps = prompts([5, 9, 7, 4])
    ps[2] = ps[
        0
    ]  # the same prompt text under another uid: first of rank 1's chunk, as prompt 0 is of rank 0's
    requests = [Sample(prompt_ids=p, uid=f"p{i}") for i, p in enumerate(ps)]
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=3, seed=11)

    def run(world_size):  # one engine per rank, as every rollout rank has its own
        return [
            s
            for part in as_ranks(requests, world_size)
            for s in ROLLOUT_BACKENDS.get(backend)(m, Tok(), rcfg(backend=backend)).generate(
                part, params
            )
        ]

    one, two = run(1), run(2)
    assert [s.uid for s in two] == [s.uid for s in one]
    assert [s.response_ids for s in two] == [s.response_ids for s in one]
    assert [s.response_ids for s in one[:3]] != [
        s.response_ids for s in one[6:9]
    ]  # p0 and p2 draw different numbers


def test_a_group_larger_than_the_seats_enters_in_parts():
    """samples_per_prompt above rollout.backend_options.max_batch_size: the group is admitted in
    parts of at most that many."""
    m = model()
    ps = prompts([9, 6])
    requests = [Sample(prompt_ids=p, uid=f"u{i}") for i, p in enumerate(ps)]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=8, seed=2)
    params.ignore_eos = True
    wide = ROLLOUT_BACKENDS.get("native")(m, Tok(), rcfg(max_batch_size=64)).generate(
        requests, params
    )
    eng = ROLLOUT_BACKENDS.get("native")(m, Tok(), rcfg(max_batch_size=3))
    narrow = eng.generate(requests, params)
    assert [s.uid for s in narrow] == ["u0"] * 8 + ["u1"] * 8
    assert [s.response_ids for s in narrow] == [
        s.response_ids for s in wide
    ]  # sample i keeps its seed
    assert eng.stats()["engine/prompt_tokens_computed"] < 3 * sum(
        map(len, ps)
    )  # later parts reuse the cached prompt
