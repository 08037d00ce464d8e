"""ReMax plumbing in the rollout stream (``rollout/group_hooks.py``), as a synchronous step fills
the trajectory buffer: an estimator with ``needs_greedy_baseline`` gets one greedy response per
prompt, scored on the rollout like the samples, as each sample's
``reward_extras["baseline_rewards"]`` (a per-row ``baseline_rewards`` column of the learner's
batch); the greedy responses are not trained on. A fake backend (through the default streaming
interface) and a fake reward, so the samples and rewards are known by hand."""

from __future__ import annotations

import torch

from hybridrl.config import Config, load_config
from hybridrl.learner.metrics import batch_metrics
from hybridrl.protocol import Batch, Sample, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.base import RolloutEngine
from hybridrl.rollout.buffer import BufferHandle, TrajectoryBuffer
from hybridrl.rollout.group_hooks import DynamicSampling
from hybridrl.rollout.stream import RolloutStream
from hybridrl.tasks import Prompt


def score(samples: list[Sample]) -> list[Sample]:
    """The fake reward: a sampled response scores 1 for token 5, else 0; a greedy one (token 7) its
    length - 1. Set in place, as the rollout's scorer does."""
    for s in samples:
        greedy = s.response_ids[0] == 7
        s.reward = float(len(s.response_ids) - 1) if greedy else float(s.response_ids[0] == 5)
        s.reward_extras["reward_errors"] = 0.0
    return samples


class FakeRollout(RolloutEngine):
    """Sampled responses: token 5 (reward 1) for even sample indices, token 6 (reward 0) otherwise;
    greedy: the prompt's greedy reward is encoded as its response length (1 token -> 0.0, 2 tokens
    -> 1.0, ...)."""

    def __init__(self, greedy_len: dict, flat: tuple = ()):
        super().__init__()
        self.greedy_len, self.flat = greedy_len, flat  # prompts in ``flat``: every sample scores 0
        self.calls: list[tuple[SamplingParams, list[str]]] = []

    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        self.calls.append((params, [p.uid for p in prompts]))
        out = []
        for p in prompts:
            uid = p.metadata["prompt"].uid
            assert p.status == "pending" and not p.response_ids
            if params.greedy:
                n = self.greedy_len[uid]
                out.append(p.with_response([7] * n, [0.0] * n, [0] * n, "finished"))
            else:
                out += [
                    p.with_response(
                        [5 if k % 2 == 0 and uid not in self.flat else 6], [0.0], [0], "finished"
                    )
                    for k in range(params.n)
                ]
        return out

    def _load_weights(self, named_tensors, version: int) -> int:
        return 0


class FakeTask:
    def prompt(self, i: int) -> Prompt:
        return Prompt(uid=f"p{i}", text=f"{i}+0=", answer=str(i), task_id="arith")


class FakeTokenizer:
    pad_token_id = 0

    def __call__(self, text):
        return {"input_ids": [1, 2]}


def run(cfg: Config, greedy_len: dict, flat: tuple = ()):
    """One synchronous step's batch: the stream fills the buffer (staleness 0), the learner's
    side takes it."""
    rollout = FakeRollout(greedy_len, flat)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=cfg.trainer.samples_per_prompt)
    t = cfg.trainer
    buffer = BufferHandle(
        TrajectoryBuffer(t.prompts_per_step, max_staleness=0, sampling=DynamicSampling.of(cfg))
    )
    stream = RolloutStream(
        rollout, buffer, FakeTask(), FakeTokenizer(), score, params, 0, t.prompts_per_step,
        prefetch=0, cfg=cfg,
    )  # fmt: skip
    stream.fill()
    samples = buffer.get_batch(0, timeout=1)
    stats = buffer.stats()
    stream.stop()
    return rollout, samples, buffer.state()["prompt_cursor"], stats


def logged(batch) -> dict:
    """The step's batch metrics (``learner/metrics.py``), advantages as yet zero."""
    batch |= Batch({"advantages": torch.zeros(batch["responses"].shape)})
    return batch_metrics(batch)


def baselines(samples: list[Sample]) -> list[float]:
    return [s.reward_extras["baseline_rewards"] for s in samples]


def test_remax_batch_gets_the_greedy_reward_of_its_prompt():
    cfg = load_config(
        Config,
        None,
        [
            "algorithm.advantage=remax",
            "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=4",
        ],
    )
    # greedy lengths p0: 3 tokens -> reward 2.0, p1: 1 token -> 0.0
    rollout, samples, cursor, metrics = run(cfg, {"p0": 3, "p1": 1})
    assert [s.uid for s in samples] == ["p0", "p0", "p1", "p1"] and cursor == 2
    assert baselines(samples) == [2.0, 2.0, 0.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 0.0, 1.0, 0.0]
    # the greedy responses are not among the samples trained on
    assert all(7 not in s.response_ids for s in samples)
    (sampled, asked), (greedy, asked_greedy) = rollout.calls  # one call each for the step
    assert not sampled.greedy and sampled.n == 2 and greedy.temperature == 0.0 and greedy.n == 1
    # the greedy responses answer the same prompts, under uids of their own
    assert asked == ["p0", "p1"] and asked_greedy == ["p0#greedy", "p1#greedy"]
    # the learner's batch: one baseline per row, beside the rewards, and its mean logged
    batch = samples_to_batch(samples, FakeTokenizer.pad_token_id)
    assert batch["baseline_rewards"].tolist() == [2.0, 2.0, 0.0, 0.0]
    assert batch["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert (batch["responses"] != 7).all()
    assert logged(batch)["reward/greedy_baseline_mean"] == 1.0


def test_greedy_baseline_gets_the_overlong_penalty_the_samples_get():
    # max_new_tokens 4, buffer 2: 3 tokens -> -(3 - 2)/2 = -.5, so p0's baseline is 2 - .5 = 1.5; 1
    # token: no penalty
    cfg = load_config(
        Config,
        None,
        [
            "algorithm.advantage=remax",
            "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=4",
            "rollout.max_new_tokens=4",
            "algorithm.overlong_buffer=2",
        ],
    )
    _, samples, _, _ = run(cfg, {"p0": 3, "p1": 1})
    assert baselines(samples) == [1.5, 1.5, 0.0, 0.0]


def test_other_estimators_generate_no_greedy_response():
    cfg = load_config(
        Config,
        None,
        [
            "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=4",
        ],
    )
    rollout, samples, _, _ = run(cfg, {"p0": 3, "p1": 1})
    assert len(rollout.calls) == 1 and len(samples) == 4
    assert all("baseline_rewards" not in s.reward_extras for s in samples)
    batch = samples_to_batch(samples, FakeTokenizer.pad_token_id)
    assert "baseline_rewards" not in batch
    assert "reward/greedy_baseline_mean" not in logged(batch)


def test_remax_with_dynamic_sampling_keeps_each_rows_baseline():
    # filter_groups keeps samples group by group: each keeps its own prompt's baseline
    cfg = load_config(
        Config,
        None,
        [
            "algorithm.advantage=remax",
            "algorithm.filter_groups=true",
            "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=4",
        ],
    )
    # p0's samples all score 0: its group is dropped, and p2 is admitted in its place
    rollout, samples, cursor, stats = run(cfg, {"p0": 2, "p1": 4, "p2": 3}, flat=("p0",))
    assert [s.uid for s in samples] == ["p1", "p1", "p2", "p2"] and cursor == 3
    assert baselines(samples) == [3.0, 3.0, 2.0, 2.0]
    batch = samples_to_batch(samples, FakeTokenizer.pad_token_id)
    assert batch["baseline_rewards"].tolist() == [3.0, 3.0, 2.0, 2.0]
    assert stats["rollout/dropped_groups"] == 1 and logged(batch)["rollout/informative_frac"] == 1
    # p2's greedy response came with its samples, in the call after p0's and p1's
    assert [uids for _, uids in rollout.calls][2:] == [["p2"], ["p2#greedy"]]
