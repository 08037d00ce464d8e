"""Asynchronous training: the staleness rule, interruptible generation, and
the async driver end to end."""

import json
import random
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import Qwen2Config, Qwen2ForCausalLM

from hybridrl.config import Config, RolloutConfig, load_config
from hybridrl.driver.loop import train
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.buffer import TrajectoryBuffer
from hybridrl.tasks.reverse import ReverseTask

torch.set_num_threads(1)


def group(index, version, stamps=(), n=1) -> list[Sample]:
    """Prompt ``index``'s ``n`` scored samples, admitted at ``version`` (a
    group, as a rollout puts it)."""
    meta = {"index": index, "admitted": version}
    return [
        Sample(
            [1],
            [3] * len(stamps),
            [0.0] * len(stamps),
            list(stamps),
            status="finished",
            uid=f"p{index}",
            reward=0.0,
            metadata=dict(meta),
        )
        for _ in range(n)
    ]


def indices(samples: list[Sample]) -> list[int]:
    """The prompt index of each sample of a batch (the buffer hands out a
    flat list, group by group)."""
    return [s.metadata["index"] for s in samples]


# --- the buffer's staleness rule, without a model -------------------------------------------------
def test_admission_capacity_follows_the_areal_rule():
    buf = TrajectoryBuffer(batch_groups=2, max_staleness=1)
    assert buf.admit(10, version=0) == [0, 1, 2, 3]  # (1 + 0 + 1) * 2 - 0
    assert buf.admit(10, version=0) == []
    for i in (0, 1):
        buf.put(group(i, 0, n=2))
    assert buf.admit(10, version=0) == []  # accepted groups count until trained
    assert indices(buf.get_batch(0, timeout=1)) == [0, 0, 1, 1]  # both groups, each whole
    assert buf.admit(10, version=0) == []  # weights 1 not yet at the rollout
    assert buf.admit(10, version=1) == [4, 5]
    with pytest.raises(KeyError):
        buf.put(group(0, 0))  # never admitted again


def test_learner_waits_for_groups_that_would_become_too_stale():
    buf = TrajectoryBuffer(batch_groups=2, max_staleness=1)
    buf.admit(4, version=0)
    for i in (0, 1):
        buf.put(group(i, 0))
    buf.get_batch(0, timeout=1)
    buf.admit(2, version=1)  # prompts 4, 5 at version 1
    for i in (3, 4, 5):
        buf.put(group(i, 0 if i == 3 else 1))
    # prompt 2 (admitted at version 0) is still generating: training version 1 must include it
    with pytest.raises(TimeoutError, match="no training batch for version 1"):
        buf.get_batch(1, timeout=0.05)
    threading.Timer(0.05, lambda: buf.put(group(2, 0))).start()
    assert sorted(indices(buf.get_batch(1, timeout=5))) == [2, 3]


def test_resumed_buffer_hands_out_untrained_prompts_first():
    buf = TrajectoryBuffer(batch_groups=2, max_staleness=1)
    buf.admit(4, version=0)
    buf.put(group(1, 0))
    buf.put(group(3, 0))
    state = buf.state()
    assert state == {"prompt_cursor": 4, "pending_prompts": [0, 1, 2, 3], "trained_groups": 0}
    again = TrajectoryBuffer(2, 1, cursor=state["prompt_cursor"], pending=state["pending_prompts"])
    assert again.admit(6, version=0) == [0, 1, 2, 3]  # capacity 4 at version 0
    assert again.admit(6, version=1) == [4, 5]


@settings(max_examples=40, deadline=None)
@given(
    k=st.integers(0, 4),
    B=st.integers(1, 4),
    seed=st.integers(0, 10**6),
    slow=st.sampled_from(["rollout", "trainer"]),
)
def test_simulated_runs_never_train_a_sample_older_than_k(k, B, seed, slow):
    """A simulated rollout (groups of random lengths, a weight version that lags the trainer's) and
    a trainer, one slow and one fast: every trained group's oldest token is at most k versions old,
    and training goes on (a buffer that never hands out a batch breaks no staleness bound)."""
    rng = random.Random(seed)
    buf = TrajectoryBuffer(batch_groups=B, max_staleness=k)
    running = {}  # index -> [first token version or None, tokens left]
    trained, version = [], {"rollout": 0, "trainer": 0}

    def rollout_tick():
        for i in buf.admit(rng.randint(1, 3), version["rollout"]):
            running[i] = [None, rng.choice([1, 1, 2, 8])]
        for i, r in list(running.items()):
            r[0] = version["rollout"] if r[0] is None else r[0]
            r[1] -= 1
            if r[1] == 0:
                del running[i]
                buf.put(group(i, buf.running[i], stamps=[r[0]]))

    def train_step():
        v = version["trainer"]
        batch = buf.get_batch(v, timeout=0)
        assert len(batch) == B
        assert all(v - s.versions[0] <= k for s in batch)
        if k == 0:
            assert all(s.versions[0] == v for s in batch)
        trained.extend(indices(batch))
        version["trainer"] = v + 1

    for _ in range(400):
        if rng.random() < (0.8 if slow == "trainer" else 0.2):  # one rollout tick
            rollout_tick()
        elif buf._pick(version["trainer"]) is not None:
            train_step()
        if rng.random() < 0.5:
            version["rollout"] = version["trainer"]  # the weight sync lands (sometimes late)
    assert version["trainer"] >= 3  # 400 ticks hold dozens of batches in every setting
    # then the weight sync lands at once: the learner is never stuck,
    # whatever state the random phase left
    goal = version["trainer"] + 3
    for _ in range(200):
        version["rollout"] = version["trainer"]
        if version["trainer"] == goal:
            break
        train_step() if buf._pick(version["trainer"]) is not None else rollout_tick()
    assert version["trainer"] == goal
    # each trained group is a distinct prompt, B per version, and the buffer counts them all
    assert len(trained) == len(set(trained)) == goal * B == buf.state()["trained_groups"]


# --- interruptible generation ---------------------------------------------------------------------
def tiny_model(seed):
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=32,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            max_position_embeddings=128,
        )
    ).eval()


class Tok:
    eos_token_id, pad_token_id = 2, 0


def test_interrupted_sequence_continues_from_its_tokens_under_the_new_weights():
    old, new = tiny_model(0), tiny_model(1)
    cfg = RolloutConfig(
        backend="native", backend_options={"kv_cache_bytes": 1 << 20, "block_size": 4}
    )
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    eng = NativeRollout(old, Tok(), cfg)
    req = Sample(prompt_ids=[1, 5, 7, 9, 11], uid="r")
    eng.add([req], params)
    while eng.engine.stats_acc["tokens"] < 10:
        eng.step()
    eng.update_weights(
        new.state_dict().items(), version=1
    )  # between two steps, as the async driver does
    while not eng.done(req, 1):
        eng.step()
    out = eng.take(req, 1)[0]
    cut = out.versions.index(1)
    assert out.versions == [0] * cut + [1] * (24 - cut) and cut == 10
    assert eng.stats()["engine/interrupted"] == 1
    # the tokens after the update are what the new weights generate from the
    # prompt plus the tokens so far
    fresh = NativeRollout(new, Tok(), cfg).generate(
        [Sample(prompt_ids=req.prompt_ids + out.response_ids[:cut], uid="f")],
        SamplingParams(temperature=0, max_new_tokens=24 - cut, ignore_eos=True),
    )
    assert fresh[0].response_ids == out.response_ids[cut:]


# --- the async driver end to end (tiny model, W3) -------------------------------------------------
RUN = [
    "sft.steps=3",
    "sft.batch_size=16",
    "task.name=reverse",
    "task.eval_size=8",
    "rollout.max_new_tokens=100",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4",
    "trainer.eval_every=0",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
    "trainer.mode=async",
]


def make_cfg(tmp_path, *extra) -> Config:
    return load_config(
        Config,
        None,
        [
            *RUN,
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            *extra,
        ],
    )


def trace(tmp_path, advantage: str = "grpo") -> list[dict]:
    path = tmp_path / "runs" / f"reverse_{advantage}" / "trajectories.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize(
    "k,slow",
    [(1, "trainer"), (1, "rollout"), pytest.param(2, "rollout", marks=pytest.mark.slow)],
)
def test_staleness_bound_holds_on_the_stamps(tmp_path, k, slow):
    tilt = (
        ["actor.ppo_epochs=6", "asynchronous.max_concurrent_prompts=16"]
        if slow == "trainer"
        else ["asynchronous.max_concurrent_prompts=1"]
    )  # one prompt at a time: generation is the bottleneck
    train(make_cfg(tmp_path, f"asynchronous.max_staleness={k}", "trainer.total_steps=5", *tilt))
    rows = trace(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    lags = [x for r in rows for x in r["staleness"]]
    assert len(lags) == 5 * 8 and max(lags) <= k
    if slow == "trainer":
        assert max(lags) == k  # a fast rollout runs ahead as far as it may


def test_max_staleness_zero_is_on_policy(tmp_path):
    train(make_cfg(tmp_path, "asynchronous.max_staleness=0", "trainer.total_steps=3"))
    metrics = [
        json.loads(line)
        for line in (tmp_path / "runs" / "reverse_grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    rows = trace(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and [m["step"] for m in metrics] == [0, 1, 2, 3]
    lags = [x for r in rows for x in r["staleness"]]
    assert len(lags) == 3 * 8 and set(lags) == {0}
    assert all(
        m["async/staleness_0"] == 1.0 and m["async/partial_frac"] == 0.0 for m in metrics[1:]
    )


def test_resume_trains_no_trajectory_twice_and_continues_the_stream(tmp_path):
    train(make_cfg(tmp_path, "trainer.total_steps=2", "trainer.save_every=2"))
    summary = train(
        make_cfg(tmp_path, "trainer.total_steps=4", "trainer.save_every=2"), resume=True
    )
    assert summary["resumed_from_step"] == 2
    rows = trace(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    trained = [int(u.split("-")[1]) for r in rows for u in r["uids"]]
    assert len(trained) == len(set(trained)) == 16
    final = json.loads(
        (
            tmp_path / "runs" / "reverse_grpo" / "checkpoints" / "step_000004" / "trainer.json"
        ).read_text()
    )
    # every prompt of the stream up to the cursor was trained exactly once or
    # is still pending: none skipped
    assert sorted(trained + final["pending_prompts"]) == list(range(final["prompt_cursor"]))


@pytest.mark.slow  # ~30 s of Ray start-up; two FSDP ranks are covered fast in test_fsdp.py
def test_two_learner_ranks_on_ray(tmp_path):
    """Rollout and learner on their own pools, the buffer a Ray actor (the data path
    never touches the driver), and the learner as 2 FSDP2 ranks: rank 0 fetches each
    batch, the ranks split the work."""
    import ray

    pools = [
        "controller.backend=ray",
        "controller.pools={train: {workers_per_node: 2, cpus_per_worker: 0.5}, "
        "gen: {cpus_per_worker: 0.5}}",
        "controller.placement={learner: train, rollout: gen}",
    ]
    try:
        summary = train(
            make_cfg(tmp_path, "trainer.total_steps=3", "asynchronous.max_staleness=1", *pools)
        )
    finally:
        ray.shutdown()
    assert summary["mode"] == "async"
    rows = trace(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and max(
        x for r in rows for x in r["staleness"]
    ) <= 1


def test_async_config_errors():
    with pytest.raises(Exception, match="rollout needs its own pool"):
        load_config(Config, None, ["trainer.mode=async", "controller.backend=ray"])


def test_async_training_runs_with_the_hf_backend(tmp_path):
    """Every backend streams (the engine's default add/step/done/take runs one generate
    per step), so asynchronous training takes a backend other than native: hf trains
    within the staleness bound."""
    cfg = make_cfg(
        tmp_path, "rollout.backend=hf", "trainer.total_steps=2", "asynchronous.max_staleness=1"
    )
    assert cfg.rollout.backend == "hf"
    summary = train(cfg)
    assert summary["mode"] == "async" and summary["steps"] == 2
    rows = trace(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    lags = [x for r in rows for x in r["staleness"]]
    assert len(lags) == 2 * 8 and max(lags) <= 1
    metrics = [
        json.loads(line)
        for line in (tmp_path / "runs" / "reverse_grpo" / "metrics.jsonl").read_text().splitlines()
    ]
    assert all("reward/mean" in m and "actor/pg_loss" in m for m in metrics[1:])
    assert all(m["actor/lr"] == cfg.actor.lr for m in metrics[1:])  # the schedule's rate, logged


class FailingTask(ReverseTask):
    """W3 whose prompt stream breaks at prompt 6 (a bug in a user's task)."""

    def prompt(self, index):
        if index >= 6:
            raise ValueError("prompt source went away")
        return super().prompt(index)


def test_a_failing_rollout_stops_the_run_with_its_error(tmp_path):
    with pytest.raises(Exception, match="prompt source went away"):
        train(make_cfg(tmp_path, f"task.name={__name__}:FailingTask", "trainer.total_steps=5"))
    metrics = (tmp_path / "runs" / "failingtask_grpo" / "metrics.jsonl").read_text().splitlines()
    assert json.loads(metrics[0])["step"] == 0  # what was written before is kept


def test_cli_runs_the_async_trainer(tmp_path, capsys):
    from hybridrl.cli import main

    args = [
        *RUN,
        f"sft.checkpoint={tmp_path / 'ws'}",
        f"trainer.runs_dir={tmp_path / 'runs'}",
        "trainer.total_steps=1",
    ]
    example = str(Path(__file__).parents[1] / "examples" / "reverse_async.yaml")
    assert main(["train", example, *args, "controller.backend=local"]) == 0
    assert json.loads(capsys.readouterr().out.split("\nreport:")[0])["mode"] == "async"


# --- group hooks in the asynchronous stream: DAPO's dynamic sampling, ReMax's greedy baseline ----
def test_dynamic_sampling_drops_uniform_groups_while_credit_lasts():
    from hybridrl.rollout.group_hooks import DynamicSampling

    cfg = load_config(
        Config,
        None,
        ["algorithm.filter_groups=true", "algorithm.max_sampling_rounds=3",
         "trainer.prompts_per_step=2", "trainer.samples_per_prompt=2",
         "actor.ppo_minibatch_size=4"],
    )  # fmt: skip

    def group(*rewards):
        return [Sample(prompt_ids=[1], uid="u", reward=r) for r in rewards]

    rule = DynamicSampling.of(cfg)  # credit (3 - 1) x 2 = 4
    assert [rule.keep(group(0, 0)) for _ in range(5)] == [False] * 4 + [True]
    assert rule.keep(group(0, 1))  # an informative group earns 2 drops
    assert [rule.keep(group(1, 1)) for _ in range(3)] == [False, False, True]
    assert rule.stats() == {"rollout/dropped_groups": 6}
    assert rule.stats() == {"rollout/dropped_groups": 0}  # counted since the last call


def group_rewards(prompt, response: str, **_) -> float:
    """Partial credit (digits in place): some groups differ, some do not."""
    return sum(a == b for a, b in zip(response, prompt.answer)) / max(len(prompt.answer), 1)


@pytest.mark.parametrize("advantage", ["grpo", "remax"])
def test_dapo_trains_in_async_mode_and_never_trains_a_dropped_prompt(tmp_path, advantage):
    cfg = make_cfg(
        tmp_path,
        f"algorithm.advantage={advantage}",
        "algorithm.filter_groups=true",
        "algorithm.max_sampling_rounds=3",
        f"task.reward_fn={__name__}:group_rewards",
        "trainer.total_steps=4",
    )
    train(cfg)
    rows = [json.loads(x) for x in (tmp_path / f"runs/reverse_{advantage}/metrics.jsonl").open()]
    dropped = sum(r.get("rollout/dropped_groups", 0) for r in rows)
    assert dropped > 0, rows
    trained = [uid for r in trace(tmp_path, advantage) for uid in r["uids"]]
    assert len(set(trained)) == 4 * 4  # every step full: 4 groups
    state = json.loads(
        sorted((tmp_path / f"runs/reverse_{advantage}/checkpoints").glob("step_*"))[-1]
        .joinpath("trainer.json")
        .read_text()
    )
    # more prompts were admitted than trained or pending: the dropped ones, never handed out again
    assert state["prompt_cursor"] >= 16 + len(state["pending_prompts"]) + dropped


def test_remax_gets_each_prompts_greedy_baseline_in_the_stream():
    from hybridrl.rollout.buffer import BufferHandle
    from hybridrl.rollout.stream import RolloutStream

    cfg = load_config(
        Config,
        None,
        ["algorithm.advantage=remax", "trainer.mode=async", "trainer.prompts_per_step=2",
         "trainer.samples_per_prompt=2", "actor.ppo_minibatch_size=4",
         "rollout.max_new_tokens=6"],
    )  # fmt: skip
    model = tiny_model(0)
    eng = NativeRollout(
        model, Tok(), RolloutConfig(backend="native", backend_options={"kv_cache_bytes": 1 << 20})
    )

    class Task:  # prompts of the tiny vocabulary
        def prompt(self, i):
            from hybridrl.tasks import Prompt

            return Prompt(uid=f"p{i}", text="", answer="", task_id="t", token_ids=[1, 5 + i, 9])

    def score(samples):  # the reward: the response's first token
        for s in samples:
            s.reward = float(s.response_ids[0])
        return samples

    buffer = BufferHandle(TrajectoryBuffer(batch_groups=2, max_staleness=0))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, ignore_eos=True)
    stream = RolloutStream(eng, buffer, Task(), None, score, params, 0, 2, prefetch=0, cfg=cfg)
    stream.start()
    samples = buffer.get_batch(0, 60)
    stream.stop()
    groups = {}
    for s in samples:
        groups.setdefault(s.uid, []).append(s)
    assert len(groups) == 2 and all(len(g) == 2 for g in groups.values())
    for group in groups.values():
        prompt = Sample(prompt_ids=group[0].prompt_ids, uid="x")
        greedy = eng.generate(
            [prompt], SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
        )
        assert {s.reward_extras["baseline_rewards"] for s in group} == {
            float(greedy[0].response_ids[0])
        }
