"""ReMax plumbing in trainers/collect.py: an estimator with ``needs_greedy_baseline`` gets one greedy response per
prompt, scored by the reward role, as a per-row ``baseline_rewards`` column; the greedy responses are not trained on.
Fake rollout and reward roles, so the rows and rewards are known by hand."""

from __future__ import annotations

import contextlib
import types

import torch

from hybridrl.config import Config, load_config
from hybridrl.protocol import Batch, Sample
from hybridrl.rollout import SamplingParams
from hybridrl.tasks import Prompt
from hybridrl.trainers.collect import collect


class FakeRollout:
    """Sampled responses: token 5 (reward 1) for even sample indices, token 6 (reward 0) otherwise; greedy: the
    prompt's greedy reward is encoded as its response length (1 token -> 0.0, 2 tokens -> 1.0, ...)."""

    def __init__(self, greedy_len: dict, flat: tuple = ()):
        self.greedy_len, self.flat, self.calls = (
            greedy_len,
            flat,
            [],
        )  # prompts in ``flat``: every sample scores 0

    def generate(self, prompts: Batch, params: SamplingParams):
        self.calls.append(params)
        out = []
        for p, ids in zip(prompts["prompt"], prompts["prompt_ids"]):
            if params.greedy:
                out.append(
                    Sample(
                        list(ids),
                        [7] * self.greedy_len[p.uid],
                        [0.0] * self.greedy_len[p.uid],
                        [0] * self.greedy_len[p.uid],
                        uid=p.uid,
                        extra={"prompt": p},
                    )
                )
            else:
                out += [
                    Sample(
                        list(ids),
                        [5 if k % 2 == 0 and p.uid not in self.flat else 6],
                        [0.0],
                        [0],
                        uid=p.uid,
                        extra={"prompt": p},
                    )
                    for k in range(params.n)
                ]
        return [out[: len(out) // 2], out[len(out) // 2 :]]  # two "ranks"


class FakeReward:
    def score(self, batch: Batch) -> Batch:
        rows = batch["responses"] * batch["response_mask"]
        greedy = (rows == 7).sum(-1).float() - 1  # greedy: length - 1
        sampled = (rows[:, 0] == 5).float()
        return Batch(
            {
                "rewards": torch.where(rows[:, 0] == 7, greedy, sampled),
                "reward_errors": torch.zeros(len(batch)),
            }
        )


class FakeTask:
    def prompt(self, i: int) -> Prompt:
        return Prompt(uid=f"p{i}", text=f"{i}+0=", answer=str(i), task_id="arith")


class FakeTokenizer:
    pad_token_id = 0

    def __call__(self, text):
        return {"input_ids": [1, 2]}


class Timer:
    @contextlib.contextmanager
    def phase(self, name):
        yield


def run(cfg: Config, greedy_len: dict, flat: tuple = ()):
    roles = types.SimpleNamespace(rollout=FakeRollout(greedy_len, flat), reward=FakeReward())
    params = SamplingParams(temperature=1.0, max_new_tokens=4, n=cfg.trainer.samples_per_prompt)
    batch, cursor, metrics = collect(
        roles, FakeTask(), FakeTokenizer(), cfg, params, 0, seed=0, timer=Timer()
    )
    return roles, batch, cursor, metrics


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
    roles, batch, cursor, metrics = run(cfg, {"p0": 3, "p1": 1})
    assert batch["uid"] == ["p0", "p0", "p1", "p1"] and cursor == 2
    assert batch["baseline_rewards"].tolist() == [2.0, 2.0, 0.0, 0.0]
    assert batch["rewards"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert (batch["responses"] != 7).all()  # the greedy responses are not in the training batch
    assert metrics["reward/greedy_baseline_mean"] == 1.0
    sampled, greedy = roles.rollout.calls
    assert not sampled.greedy and sampled.n == 2 and greedy.temperature == 0.0 and greedy.n == 1


def test_greedy_baseline_gets_the_overlong_penalty_the_samples_get():
    # max_new_tokens 4, buffer 2: 3 tokens -> -(3 - 2)/2 = -.5, so p0's baseline is 2 - .5 = 1.5; 1 token: no penalty
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
    _, batch, _, _ = run(cfg, {"p0": 3, "p1": 1})
    assert batch["baseline_rewards"].tolist() == [1.5, 1.5, 0.0, 0.0]


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
    roles, batch, _, metrics = run(cfg, {"p0": 3, "p1": 1})
    assert len(roles.rollout.calls) == 1 and "baseline_rewards" not in batch
    assert "reward/greedy_baseline_mean" not in metrics


def test_remax_with_dynamic_sampling_keeps_each_rows_baseline():
    # filter_groups keeps rows one by one and concatenates them: the column must follow its rows
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
    # p0's samples all score 0: its group is dropped, and the second round's p2 takes its place
    _, batch, cursor, metrics = run(cfg, {"p0": 2, "p1": 4, "p2": 3, "p3": 1}, flat=("p0",))
    assert batch["uid"] == ["p1", "p1", "p2", "p2"] and cursor == 4
    assert batch["baseline_rewards"].tolist() == [3.0, 3.0, 2.0, 2.0]
    assert metrics["rollout/sampling_rounds"] == 2 and metrics["rollout/informative_frac"] == 1.0
