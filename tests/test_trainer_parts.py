"""Driver and learner pieces: dynamic sampling, reward shaping, the learner's critic."""

import torch

from hybridrl.config import Config, load_config
from hybridrl.controller import ResourcePool, WorkerGroup
from hybridrl.learner import Learner
from hybridrl.learner.metrics import batch_metrics
from hybridrl.learner.passes import needs_critic
from hybridrl.learner.shaping import RewardShaper, overlong_penalty
from hybridrl.models.loading import make_task
from hybridrl.protocol import Batch, Sample, prompt_sample, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.group_hooks import differs
from hybridrl.rollout.worker import RolloutWorker


def test_a_group_differs_only_where_its_rewards_are_not_all_equal():
    def group(*rewards):
        return [Sample([1], [2], uid="a", reward=r) for r in rewards]

    assert differs(group(1.0, 0.0)) and differs(group(0.5, 0.5, 0.25))
    # all equal, or a group of one: zero advantage, dropped by dynamic sampling
    assert not differs(group(1.0, 1.0)) and not differs(group(0.0, 0.0, 0.0))
    assert not differs(group(1.0))


def test_the_informative_share_counts_groups_whose_rewards_differ():
    uids, rewards = ["a", "b", "a", "b", "c", "c", "c"], [1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.25]
    samples = [
        Sample([1], [2], [0.0], [0], uid=u, reward=r, reward_extras={"reward_errors": 0.0})
        for u, r in zip(uids, rewards)
    ]
    batch = samples_to_batch(samples, pad_id=0)
    batch |= Batch({"advantages": torch.zeros(len(batch), 1)})
    assert batch_metrics(batch)["rollout/informative_frac"] == 2 / 3  # a and c, not b


def test_overlong_penalty_by_hand():
    # max 16, buffer 4: lengths <= 12 free; 14 -> -(14-12)/4 = -0.5; 16 -> -1
    got = overlong_penalty(torch.tensor([5, 12, 14, 16]), max_len=16, buffer=4, factor=1.0)
    assert torch.allclose(got, torch.tensor([0.0, 0.0, -0.5, -1.0]))
    assert torch.equal(overlong_penalty(torch.tensor([16]), 16, 0, 1.0), torch.zeros(1))


def test_shaper_puts_score_on_last_token_and_penalises_kl():
    cfg = load_config(Config, None, ["algorithm.kl_reward_coef=0.5", "algorithm.kl_estimator=k1"])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    batch = Batch(
        {
            "rewards": torch.tensor([1.0, 0.0]),
            "response_mask": mask,
            "old_log_probs": torch.tensor([[-1.0, -1.0, 0.0], [-1.0, -2.0, -1.0]]),
            "ref_log_probs": torch.tensor([[-1.5, -1.0, 0.0], [-1.0, -1.0, -1.0]]),
        }
    )
    out, metrics = RewardShaper(cfg.algorithm, max_new_tokens=16)(batch)
    assert torch.allclose(
        out["token_level_scores"], torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    )
    # k1 = old - ref: row0 [0.5, 0, -] ; row1 [0, -1, 0]; reward -= 0.5 * k1
    expect = torch.tensor([[-0.25, 1.0, 0.0], [0.0, 0.5, 0.0]])
    assert torch.allclose(out["token_level_rewards"], expect), out["token_level_rewards"]
    assert metrics["kl/coef"] == 0.5


def test_gae_gives_the_learner_a_critic_that_learns(tmp_path):
    cfg = load_config(
        Config,
        None,
        [
            "algorithm.advantage=gae",
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=8",
            "critic.ppo_minibatch_size=8",
            "critic.ppo_epochs=4",
            "rollout.max_new_tokens=6",
            "critic.lr=1e-2",
        ],
    )
    assert needs_critic(cfg) and not needs_critic(Config())
    pool = ResourcePool()
    rollout = WorkerGroup(RolloutWorker, pool, role="rollout", args=(cfg, None), num_threads=1)
    learner = WorkerGroup(Learner, pool, role="learner", args=(cfg, None), num_threads=1)
    critic = learner.workers[0].critic
    assert critic is not None and critic.model is not learner.workers[0].model
    task = make_task(cfg)
    tok = task.tokenizer()
    prompts = [prompt_sample(task.prompt(i), tok) for i in range(4)]
    batch = samples_to_batch(
        rollout.generate(prompts, SamplingParams(max_new_tokens=6, n=2, seed=0)), tok.pad_token_id
    )
    assert len(batch) == 8
    values = critic.values(batch)["values"]
    assert torch.equal(values, torch.zeros_like(values))  # zero-initialised head
    returns = torch.ones_like(values) * batch["response_mask"]
    train = batch | Batch({"values": values, "returns": returns})
    first = critic.update(train)["critic/vf_loss"]
    for _ in range(3):
        last = critic.update(train)["critic/vf_loss"]
    assert last < first
    new_values = critic.values(batch)["values"]
    assert (new_values * batch["response_mask"]).sum() > 0 and torch.all(
        new_values[batch["response_mask"] == 0] == 0
    )
    without = WorkerGroup(Learner, pool, role="learner", args=(Config(), None), num_threads=1)
    assert without.workers[0].critic is None  # GRPO needs no values: no critic is built
