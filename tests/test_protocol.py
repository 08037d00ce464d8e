"""hybridrl/protocol.py: Sample copies, Batch operations, pad_2d and the samples -> training-layout
collation."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.protocol import Batch, Sample, pad_2d, samples_to_batch


def make(n: int, width: int = 3) -> Batch:
    """Rows are identifiable: row i of ``x`` is [i*10, i*10+1, ...], ``name`` is 'r<i>'."""
    x = torch.arange(n).unsqueeze(1) * 10 + torch.arange(width)
    return Batch(
        {"x": x, "y": torch.arange(n, dtype=torch.float32)}, {"name": [f"r{i}" for i in range(n)]}
    )


def rows(b: Batch) -> list[str]:
    return list(b["name"])


def assert_batch_equal(a: Batch, b: Batch) -> None:
    assert set(a.tensors) == set(b.tensors) and set(a.meta) == set(b.meta)
    for k in a.tensors:
        assert a[k].shape == b[k].shape and torch.equal(a[k], b[k]), k
    for k in a.meta:
        assert a[k] == b[k], k


# --- Sample ---------------------------------------------------------------------------------------
def test_with_response_is_a_copy_that_keeps_the_prompts_metadata():
    prompt = Sample([1, 5], uid="u", task_id="t", metadata={"prompt": "P", "index": 3})
    response, log_probs, versions = [7, 2], [-0.5, -0.25], [4, 4]
    s = prompt.with_response(response, log_probs, versions, "finished", engine_steps=2)
    assert (s.prompt_ids, s.response_ids, s.log_probs, s.versions) == (
        [1, 5],
        [7, 2],
        [-0.5, -0.25],
        [4, 4],
    )
    assert (s.status, s.uid, s.task_id, s.reward) == ("finished", "u", "t", None)
    assert s.metadata == {"prompt": "P", "index": 3, "engine_steps": 2}
    # the prompt is untouched, and nothing the caller or the sample changes reaches the other
    assert prompt.status == "pending" and prompt.response_ids == [] and prompt.log_probs == []
    assert prompt.metadata == {"prompt": "P", "index": 3}
    response.append(9), log_probs.append(0.0), versions.append(5)
    assert (s.response_ids, s.log_probs, s.versions) == ([7, 2], [-0.5, -0.25], [4, 4])
    s.prompt_ids.append(8)
    s.metadata["seen"] = True
    assert prompt.prompt_ids == [1, 5] and "seen" not in prompt.metadata


def test_samples_of_one_prompt_share_no_mutable_field():
    """Each sample is scored on its own (``reward``, ``reward_extras`` set in place): scoring one
    must not change its siblings nor the prompt, whatever the prompt already carries."""
    prompt = Sample([1, 5], uid="u", reward_extras={"baseline_rewards": 0.5}, metadata={"k": 1})
    a = prompt.with_response([7], [-0.1], [0], "finished")
    b = prompt.with_response([8], [-0.2], [0], "truncated")
    c = prompt.aborted()
    assert a.reward_extras == b.reward_extras == c.reward_extras == {"baseline_rewards": 0.5}
    a.reward, a.reward_extras["reward_errors"] = 1.0, 0.0
    b.reward_extras["baseline_rewards"] = 2.0
    assert b.reward is None and "reward_errors" not in b.reward_extras
    assert c.reward_extras == prompt.reward_extras == {"baseline_rewards": 0.5}
    assert a.reward_extras == {"baseline_rewards": 0.5, "reward_errors": 0.0}
    for x, y in [(a, b), (a, c), (b, c), (a, prompt), (b, prompt), (c, prompt)]:
        for name in (
            "prompt_ids",
            "response_ids",
            "log_probs",
            "versions",
            "reward_extras",
            "metadata",
        ):
            assert getattr(x, name) is not getattr(y, name), name
    assert (c.status, c.response_ids, c.log_probs, c.versions) == ("aborted", [], [], [])
    assert c.metadata == {"k": 1} and c.uid == "u"


# --- construction and access ---------------------------------------------------
def test_construction_rejects_size_mismatch():
    with pytest.raises(ValueError, match="batch size"):
        Batch({"a": torch.zeros(3), "b": torch.zeros(4)})
    with pytest.raises(ValueError, match="batch size"):
        Batch({"a": torch.zeros(3)}, {"m": [1, 2]})


def test_len_contains_getitem_setitem():
    b = make(4)
    assert len(b) == 4 and "x" in b and "name" in b and "nope" not in b
    assert len(Batch()) == 0
    assert len(Batch(meta={"m": [1, 2]})) == 2
    b["z"] = torch.ones(4)
    b["tags"] = ("a", "b", "c", "d")
    assert b.meta["tags"] == ["a", "b", "c", "d"] and "z" in b.tensors
    assert set(b.keys()) == {"x", "y", "z", "name", "tags"}


def test_x_rows_are_distinct():
    b = make(3)
    assert b["x"][1].tolist() == [10, 11, 12] and b["x"][2].tolist() == [20, 21, 22]


# --- index ---------------------------------------------------------------------------
def test_index_slice():
    b = make(5)[1:4]
    assert rows(b) == ["r1", "r2", "r3"] and b["y"].tolist() == [1, 2, 3]
    assert rows(make(5)[::2]) == ["r0", "r2", "r4"]


def test_index_list_reorders_and_repeats():
    b = make(4)[[3, 0, 3]]
    assert rows(b) == ["r3", "r0", "r3"]
    assert b["x"][:, 0].tolist() == [30, 0, 30]


def test_index_bool_and_long_tensor():
    b = make(4)
    sel = b[torch.tensor([True, False, True, False])]
    assert rows(sel) == ["r0", "r2"] and sel["y"].tolist() == [0, 2]
    sel = b[torch.tensor([2, 1])]
    assert rows(sel) == ["r2", "r1"]
    empty = b[torch.zeros(4, dtype=torch.bool)]
    assert len(empty) == 0 and empty["x"].shape == (0, 3)


def test_index_does_not_alias_source():
    b = make(3)
    sub = b[0:2]
    sub["x"][0, 0] = 999
    sub["name"][0] = "changed"
    assert b["x"][0, 0] == 0 and b["name"][0] == "r0"


# --- select / union ---------------------------------------------------------------------
def test_select():
    b = make(3).select("x", "name")
    assert set(b.keys()) == {"x", "name"}
    with pytest.raises(KeyError, match="nope"):
        make(3).select("x", "nope")


def test_union_adds_columns_and_accepts_equal_columns():
    a = make(3)
    extra = Batch(
        {"x": a["x"].clone(), "z": torch.ones(3)}, {"name": list(a["name"]), "tag": [1, 2, 3]}
    )
    u = a.union(extra)
    assert set(u.keys()) == {"x", "y", "z", "name", "tag"}
    assert torch.equal(u["x"], a["x"])
    assert (a | extra).keys() == u.keys()


def test_union_rejects_conflicting_columns():
    a = make(3)
    other_x = a["x"].clone()
    other_x[1, 1] += 1
    with pytest.raises(ValueError, match="'x'"):
        a.union(Batch({"x": other_x}))
    with pytest.raises(ValueError, match="'x'"):  # same values, different shape
        a.union(Batch({"x": a["x"][:, :2].clone()}))
    with pytest.raises(ValueError, match="'name'"):
        a.union(Batch(meta={"name": ["r0", "r1", "other"]}))
    with pytest.raises(ValueError, match="sizes"):
        a.union(Batch({"z": torch.zeros(4)}))


def test_union_with_empty_batch():
    a = make(3)
    assert_batch_equal(a.union(Batch()), a)
    assert_batch_equal(Batch().union(a), a)


# --- chunk / split ---------------------------------------------------------------------------
@pytest.mark.parametrize("n_rows,n", [(10, 3), (7, 7), (3, 5), (8, 4), (0, 2), (1, 1)])
def test_chunk_sizes_and_order(n_rows, n):
    b = make(n_rows)
    parts = b.chunk(n)
    assert len(parts) == n
    sizes = [len(p) for p in parts]
    assert sum(sizes) == n_rows and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # the bigger parts come first
    assert [r for p in parts for r in rows(p)] == rows(b)  # contiguous, order preserved


def test_chunk_rejects_n_below_one():
    with pytest.raises(ValueError):
        make(3).chunk(0)
    with pytest.raises(ValueError):
        make(3).chunk(-1)


def test_split():
    parts = make(7).split(3)
    assert [rows(p) for p in parts] == [["r0", "r1", "r2"], ["r3", "r4", "r5"], ["r6"]]
    assert [len(p) for p in make(6).split(2)] == [2, 2, 2]
    assert make(0).split(4) == []


# --- concat --------------------------------------------------------------------------------------
def test_concat_roundtrip_and_errors():
    b = make(5)
    assert_batch_equal(Batch.concat([b[0:2], b[2:5]]), b)
    assert len(Batch.concat([])) == 0
    with pytest.raises(ValueError, match="different columns"):
        Batch.concat([b[0:2], b[2:5].select("x", "y")])
    wide = Batch(
        {"x": torch.zeros(2, 5, dtype=torch.long), "y": torch.zeros(2)}, {"name": ["a", "b"]}
    )
    with pytest.raises(ValueError, match="widths"):
        Batch.concat([b[0:2], wide])


def test_concat_skips_empty_keyless_batches():
    b = make(3)
    assert_batch_equal(Batch.concat([Batch(), b, Batch()]), b)


# --- repeat / shuffle ----------------------------------------------------------------------------
def test_repeat_interleave_and_tile():
    b = make(2)
    assert rows(b.repeat(3)) == ["r0", "r0", "r0", "r1", "r1", "r1"]
    assert rows(b.repeat(2, interleave=False)) == ["r0", "r1", "r0", "r1"]
    r = b.repeat(2)
    assert torch.equal(r["x"], b["x"].repeat_interleave(2, 0))
    assert len(b.repeat(0)) == 0


def test_shuffle_is_a_seeded_permutation():
    b = make(20)
    s1 = b.shuffle(torch.Generator().manual_seed(7))
    s2 = b.shuffle(torch.Generator().manual_seed(7))
    s3 = b.shuffle(torch.Generator().manual_seed(8))
    assert rows(s1) == rows(s2)
    assert rows(s1) != rows(s3)
    assert sorted(rows(s1)) == sorted(rows(b)) and rows(s1) != rows(b)
    # rows stay aligned across columns
    for i, name in enumerate(s1["name"]):
        k = int(name[1:])
        assert s1["y"][i].item() == k and torch.equal(s1["x"][i], b["x"][k])


def test_to_keeps_everything():
    b = make(3).to("cpu")
    assert_batch_equal(b, make(3))


# --- pad_2d ---------------------------------------------------------------------------------------
def test_pad_2d_right_and_left():
    right = pad_2d([[1, 2, 3], [4], []], 0, torch.long)
    assert right.tolist() == [[1, 2, 3], [4, 0, 0], [0, 0, 0]]
    left = pad_2d([[1, 2, 3], [4], []], -1, torch.long, left=True)
    assert left.tolist() == [[1, 2, 3], [-1, -1, 4], [-1, -1, -1]]
    wide = pad_2d([[1.5], [2.5, 3.5]], 0.0, torch.float32, width=4)
    assert wide.dtype == torch.float32 and wide.tolist() == [[1.5, 0, 0, 0], [2.5, 3.5, 0, 0]]
    assert pad_2d([], 0, torch.long).shape == (0, 0)


# --- samples_to_batch -----------------------------------------------------------------------------
def test_samples_to_batch_layout():
    PAD = 0
    samples = [
        Sample(
            [1, 5, 6],
            [7, 8, 2],
            [-0.1, -0.2, -0.3],
            [3, 3, 4],
            status="finished",
            uid="u0",
            task_id="t",
            metadata={"answer": "42"},
        ),
        Sample(
            [1, 9],
            [10],
            [-0.5],
            [4],
            status="truncated",
            uid="u1",
            task_id="t",
            metadata={"note": "x"},
        ),
    ]
    b = samples_to_batch(samples, PAD)
    assert len(b) == 2
    # prompts left-padded to width 3, responses right-padded to width 3
    assert b["prompts"].tolist() == [[1, 5, 6], [PAD, 1, 9]]
    assert b["responses"].tolist() == [[7, 8, 2], [10, PAD, PAD]]
    assert b["input_ids"].tolist() == [[1, 5, 6, 7, 8, 2], [PAD, 1, 9, 10, PAD, PAD]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 0, 0]]
    assert b["response_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b["input_ids"].dtype == torch.long and b["rollout_log_probs"].dtype == torch.float32
    assert torch.allclose(
        b["rollout_log_probs"], torch.tensor([[-0.1, -0.2, -0.3], [-0.5, 0.0, 0.0]])
    )
    assert b["versions"].tolist() == [[3, 3, 4], [4, -1, -1]]
    assert (
        b["uid"] == ["u0", "u1"]
        and b["task_id"] == ["t", "t"]
        and b["status"] == ["finished", "truncated"]
    )
    # meta keys are the union of every sample's metadata, None where a sample lacks one
    assert b["answer"] == ["42", None] and b["note"] == [None, "x"]


def test_samples_to_batch_all_empty_responses_keeps_width_one():
    b = samples_to_batch([Sample([1, 2], [], [], [], status="aborted", uid="a")], pad_id=0)
    assert b["responses"].shape == (1, 1) and b["response_mask"].tolist() == [[0]]
    assert b["input_ids"].tolist() == [[1, 2, 0]] and b["versions"].tolist() == [[-1]]


def test_samples_to_batch_trains_on_the_loss_mask_and_attends_to_every_response_token():
    """A tool's output in a response is attended (the model reads it) but not trained on."""
    samples = [
        Sample([1, 5], [7, 8, 9, 2], [-0.1] * 4, [0] * 4, loss_mask=[1, 0, 0, 1]),
        Sample([1], [10, 11], [-0.2] * 2, [0] * 2),  # None: every token trained on
        Sample([1, 5, 6], [12], [-0.3], [0], loss_mask=[0]),
    ]
    b = samples_to_batch(samples, pad_id=0)
    assert b["response_mask"].tolist() == [[1, 0, 0, 1], [1, 1, 0, 0], [0, 0, 0, 0]]
    assert b["attention_mask"].tolist() == [
        [0, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 0, 0],
        [1, 1, 1, 1, 0, 0, 0],
    ]
    assert b["response_mask"].dtype == torch.long


def test_samples_to_batch_refuses_a_loss_mask_of_another_length():
    bad = Sample([1], [7, 8, 9], [-0.1] * 3, [0] * 3, uid="u7", loss_mask=[1, 0])
    with pytest.raises(
        ValueError, match=r"sample 'u7': loss_mask has 2 entries for 3 response tokens"
    ):
        samples_to_batch([bad], pad_id=0)


def test_response_lengths_count_tokens_that_are_not_trained_on():
    """batch_metrics' response lengths are the responses' own, not the loss mask's sums."""
    from hybridrl.learner.metrics import batch_metrics

    samples = [
        Sample([1], [7, 8, 9, 2], [-0.1] * 4, [0] * 4, loss_mask=[1, 0, 0, 1], reward=1.0),
        Sample([1, 5], [10, 11], [-0.2] * 2, [0] * 2, loss_mask=[0, 0], reward=0.0),
    ]
    b = samples_to_batch(samples, pad_id=0)
    b["advantages"] = torch.zeros(2, 4)
    b["reward_errors"] = torch.zeros(2)
    m = batch_metrics(b)
    assert m["response/length_mean"] == 3.0 and m["response/length_max"] == 4.0


def scored(reward, **extras) -> Sample:
    return Sample([1], [3], [-1.0], [0], reward=reward, reward_extras=extras)


def test_samples_to_batch_has_rewards_only_when_every_sample_is_scored():
    b = samples_to_batch([scored(1.0, reward_errors=0.0), scored(0.0, reward_errors=1.0)], 0)
    assert b["rewards"].dtype == torch.float32 and b["rewards"].tolist() == [1.0, 0.0]
    assert b["reward_errors"].tolist() == [0.0, 1.0]
    assert samples_to_batch([scored(1), scored(0)], 0)["rewards"].dtype == torch.float32
    partly = samples_to_batch([scored(1.0, reward_errors=0.0), scored(None, reward_errors=0.0)], 0)
    assert "rewards" not in partly and "reward_errors" not in partly
    assert "rewards" not in samples_to_batch([scored(None)], 0)
    assert "rewards" not in samples_to_batch([], 0)


def test_samples_to_batch_reward_extras_every_sample_has_become_columns():
    b = samples_to_batch(
        [
            scored(1.0, reward_errors=0.0, baseline_rewards=0.5, **{"reward/format": 1}),
            scored(0.0, reward_errors=1.0, baseline_rewards=2.0),
        ],
        0,
    )
    assert b["reward_errors"].tolist() == [0.0, 1.0]
    assert b["baseline_rewards"].tolist() == [0.5, 2.0]
    assert b["baseline_rewards"].dtype == torch.float32
    assert "reward/format" not in b  # one sample lacks it: no column (and no made-up value)
    assert set(b.tensors) >= {"rewards", "reward_errors", "baseline_rewards"}


# --- properties -----------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(n_rows=st.integers(0, 40), n=st.integers(1, 12))
def test_prop_concat_of_chunk_is_identity(n_rows, n):
    b = make(n_rows)
    parts = b.chunk(n)
    sizes = [len(p) for p in parts]
    assert len(parts) == n and max(sizes) - min(sizes) <= 1
    assert_batch_equal(Batch.concat(parts), b)


@settings(max_examples=40, deadline=None)
@given(n_rows=st.integers(0, 40), size=st.integers(1, 12))
def test_prop_concat_of_split_is_identity(n_rows, size):
    b = make(n_rows)
    parts = b.split(size)
    assert all(len(p) == size for p in parts[:-1]) and all(1 <= len(p) <= size for p in parts)
    if n_rows:  # concat of no parts is the empty Batch()
        assert_batch_equal(Batch.concat(parts), b)


@settings(max_examples=30, deadline=None)
@given(n_rows=st.integers(1, 20), n=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_prop_repeat_and_shuffle_preserve_rows(n_rows, n, seed):
    b = make(n_rows)
    rep = b.repeat(n)
    assert len(rep) == n_rows * n
    assert sorted(rows(rep)) == sorted(rows(b) * n)
    assert rows(b.repeat(n, interleave=False)) == rows(b) * n
    sh = b.shuffle(torch.Generator().manual_seed(seed))
    assert sorted(rows(sh)) == sorted(rows(b))


@settings(max_examples=30, deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 6), st.integers(0, 6)), min_size=1, max_size=8))
def test_prop_samples_to_batch_masks_match_lengths(lengths):
    samples = [
        Sample(list(range(1, p + 1)), list(range(3, 3 + r)), [-1.0] * r, [0] * r, uid=str(i))
        for i, (p, r) in enumerate(lengths)
    ]
    b = samples_to_batch(samples, pad_id=0)
    P = max(p for p, _ in lengths)
    assert b["prompts"].shape[1] == P
    assert b["response_mask"].sum(1).tolist() == [r for _, r in lengths]
    assert b["attention_mask"].sum(1).tolist() == [p + r for p, r in lengths]
    # the real prompt tokens end exactly at column P (left padding), responses start there
    assert b["attention_mask"][:, P - 1].tolist() == [1] * len(lengths)
    assert torch.equal(b["input_ids"][:, P:], b["responses"])
    assert (b["rollout_log_probs"] * (1 - b["response_mask"])).abs().sum() == 0
    assert ((b["versions"] == -1) == (b["response_mask"] == 0)).all()
