"""On-policy steps take the old log-probs from the update's own forward
(``actor.reuse_old_log_probs``).

The separate pass runs on the micro-batches of the update's first epoch
(``learner/update.py:first_epoch_map``), so it is an exact reference: a step that skips it equals,
bit for bit, one that runs it. Checked on the learner's policy update (weights, metrics and the
log-probs, with a small token budget so that a whole-batch grouping would differ) and on whole runs
of the driver; plus when the pass must run (a reader before the update) and the decision."""

from __future__ import annotations

import json
import os

os.environ["HF_HUB_OFFLINE"] = "1"

import pytest
import torch
from batches import prompt_response_batch
from rank_processes import launch_ranks, wait_ranks
from safetensors.torch import load_file

from hybridrl.config import Config, load_config
from hybridrl.controller import WorkerContext
from hybridrl.driver.loop import train
from hybridrl.learner import Learner
from hybridrl.learner.logprob import batch_log_probs
from hybridrl.learner.passes import reuses_old_log_probs
from hybridrl.protocol import Batch

INDICATOR = "actor/old_log_prob_reused"
ROWS = 32


# --- the decision ---------------------------------------------------------------------------------
def config(*overrides: str) -> Config:
    return load_config(
        Config,
        None,
        [
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=8",
            *overrides,
        ],
    )


@pytest.mark.parametrize(
    "overrides,reuse",
    [
        ([], True),
        (
            ["algorithm.policy_loss=decoupled_ppo"],
            True,
        ),  # pi_prox is the weights before the update: that forward's
        (["algorithm.advantage=gae"], True),  # the critic and GAE never read the old log-probs
        (["actor.reuse_old_log_probs=never"], False),
        (["actor.ppo_epochs=2"], False),
        (["actor.ppo_minibatch_size=4"], False),
        (
            ["algorithm.kl_reward_coef=0.01"],
            False,
        ),  # read before the update: the KL penalty in the reward
        (["algorithm.rollout_is=token"], False),  # read before the update: the correction's weights
        (
            ["algorithm.rollout_bypass=true"],
            False,
        ),  # no pass to skip: the rollout's log-probs are the old ones
    ],
)
def test_reuse_decision(overrides, reuse):
    assert reuses_old_log_probs(config(*overrides), 8) is reuse


def test_the_decision_counts_the_global_batch():
    cfg = config()
    assert reuses_old_log_probs(cfg, 8) and not reuses_old_log_probs(cfg, 16)


# --- the learner's policy update ------------------------------------------------------------------
def actor_cfg(*overrides: str) -> Config:
    # 32 rows of ragged length in micro-batches of at most 100 padded tokens: several micro-batches
    # whose grouping depends on the shuffle (on the machine this was written on, grouping the same
    # rows over the unshuffled batch changes the low bits of about 20 log-probs)
    return load_config(
        Config,
        None,
        [
            f"trainer.prompts_per_step={ROWS // 2}",
            "trainer.samples_per_prompt=2",
            f"actor.ppo_minibatch_size={ROWS}",
            "actor.micro_batch_tokens=100",
            "controller.num_threads=1",
            *overrides,
        ],
    )


def make_learner(cfg: Config) -> Learner:
    torch.set_num_threads(1)
    return Learner(
        WorkerContext(rank=0, world_size=1, role="learner", pool="p", num_threads=1), cfg, None
    )


def ragged_batch(
    vocab: int, n: int = ROWS, prompt_len: int = 8, resp_len: int = 12, seed: int = 0
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    batch = prompt_response_batch(g, vocab, n, prompt_len, resp_len)
    rmask = batch["response_mask"]
    adv = torch.randn(n, 1, generator=g).expand(n, resp_len) * rmask
    behaviour = -torch.rand(n, resp_len, generator=g) * rmask
    return batch | Batch(
        {
            "advantages": adv.contiguous(),
            "ref_log_probs": behaviour - 0.1 * rmask,
            "rollout_log_probs": behaviour,
        }
    )


def state(learner: Learner) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k], k


@pytest.mark.parametrize(
    "loss,precision",
    [("ppo_clip", "fp32"), ("decoupled_ppo", "fp32"), ("clip_cov", "fp32"), ("ppo_clip", "bf16")],
)
def test_update_without_old_log_probs_equals_the_update_after_the_pass(loss, precision):
    """Two identical learners, one step each on the same batch: one runs the pass, the other is
    given no old log-probs. Weights after the step, metrics (the indicator aside) and the old
    log-probs are the same bits (also in CPU bf16 autocast)."""
    cfg = actor_cfg(f"algorithm.policy_loss={loss}", f"fsdp.mixed_precision={precision}")
    passed, reused = make_learner(cfg), make_learner(cfg)
    batch = ragged_batch(passed.model.config.vocab_size)
    old = passed.compute_log_prob(batch)["old_log_probs"]
    m_pass = passed.update_actor(batch | Batch({"old_log_probs": old}))
    m_reuse = reused.update_actor(batch)
    assert (m_pass.pop(INDICATOR), m_reuse.pop(INDICATOR)) == (0.0, 1.0)
    assert_same(m_pass, m_reuse)
    assert_same(state(passed), state(reused))
    assert torch.equal(reused.old_log_probs_of_last_update(batch)["old_log_probs"], old)
    if loss != "clip_cov":  # on-policy the ratio is 1 exactly, so nothing is clipped
        assert (
            m_reuse["actor/ratio_max"] == m_reuse["actor/ratio_min"] == 1.0
            and m_reuse["actor/clip_frac"] == 0.0
        )
    with pytest.raises(RuntimeError, match="not given a batch without"):
        reused.old_log_probs_of_last_update(batch)  # handed back once


def test_the_pass_is_the_update_forward_bit_for_bit():
    """What makes the comparison above exact: the pass groups rows as the update's shuffled first
    epoch does. Grouped over the whole batch instead (``batch_log_probs``), some rows get other low
    bits."""
    learner = make_learner(actor_cfg())
    batch = ragged_batch(learner.model.config.vocab_size, n=ROWS)
    seen = torch.zeros(tuple(batch["responses"].shape))
    batch = batch | Batch({"row": torch.arange(ROWS)})
    old = learner.compute_log_prob(batch)["old_log_probs"]
    regrouped = batch_log_probs(
        learner.model, batch, learner.cfg.actor.micro_batch_tokens, learner.actor.sampling
    )
    objective = learner.objective

    def record(logp, entropy, mb, totals):  # the log-probs of the update's own forward
        seen[mb["row"], : logp.shape[1]] = logp.detach()
        return objective(logp, entropy, mb, totals)

    learner.objective = record
    learner.update_actor(batch | Batch({"old_log_probs": old}))
    assert torch.equal(seen, old)
    assert torch.allclose(regrouped, old, atol=1e-5)  # the same numbers up to rounding


def test_reuse_needs_a_single_pass():
    learner = make_learner(actor_cfg(f"actor.ppo_minibatch_size={ROWS // 2}"))
    with pytest.raises(ValueError, match="one epoch over one mini-batch"):
        learner.update_actor(ragged_batch(learner.model.config.vocab_size))


def test_dropout_in_training_mode_falls_back_to_the_pass():
    """A training forward with dropout is not the old policy's: the learner runs the pass itself."""
    cfg = actor_cfg()
    passed, fallback = make_learner(cfg), make_learner(cfg)
    passed.model.config.attention_dropout = fallback.model.config.attention_dropout = (
        0.1  # read by the check only
    )
    batch = ragged_batch(passed.model.config.vocab_size)
    old = passed.compute_log_prob(batch)["old_log_probs"]
    metrics = fallback.update_actor(batch)
    assert metrics[INDICATOR] == 0.0
    assert torch.equal(fallback.old_log_probs_of_last_update(batch)["old_log_probs"], old)


# --- whole runs of the driver ---------------------------------------------------------------------
TINY = [
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=8",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=8",
    "actor.micro_batch_tokens=64",
    "trainer.eval_every=0",
    "trainer.save_every=0",
    "rollout.max_new_tokens=8",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
    "trainer.total_steps=2",
    f"task.reward_fn={__name__}:digit_credit",
]


def digit_credit(prompt, response: str, **_) -> float:
    """Partial credit, so that a policy warm-started for 3 steps gets non-zero advantages (and
    gradients)."""
    return sum(a == b for a, b in zip(response, prompt.answer)) / len(prompt.answer)


def run(tmp_path, name: str, *extra: str) -> tuple[dict[int, dict], dict[str, torch.Tensor]]:
    train(
        load_config(
            Config,
            None,
            [
                *TINY,
                f"sft.checkpoint={tmp_path / 'ws'}",
                f"trainer.runs_dir={tmp_path / 'runs'}",
                f"trainer.name={name}",
                *extra,
            ],
        )
    )
    run_dir = tmp_path / "runs" / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows)
    return {r["step"]: r for r in rows}, load_file(
        run_dir / "checkpoints" / f"step_{last:06d}" / "model" / "model.safetensors"
    )


def comparable(row: dict) -> dict:
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("timing/", "engine/", "perf/")) and k != INDICATOR
    }


@pytest.mark.parametrize(
    "extra",
    [
        [],
        ["algorithm.policy_loss=decoupled_ppo"],
        ["algorithm.advantage=gae", "critic.ppo_minibatch_size=4"],
    ],
    ids=["ppo_clip", "decoupled_ppo", "gae"],
)
def test_a_run_that_skips_the_pass_equals_a_run_that_forces_it(tmp_path, extra):
    reused, w_reused = run(tmp_path, "auto", *extra)
    forced, w_forced = run(tmp_path, "never", *extra, "actor.reuse_old_log_probs=never")
    assert sorted(reused) == sorted(forced) == [0, 1, 2]
    for step in (1, 2):
        assert reused[step][INDICATOR] == 1.0 and forced[step][INDICATOR] == 0.0
        assert "timing/old_log_prob" not in reused[step] and forced[step]["timing/old_log_prob"] > 0
        assert reused[step]["actor/grad_norm"] > 0
        assert {"rollout_corr/logp_gap_mean", "rollout_corr/kl_k3"} <= reused[
            step
        ].keys()  # the gap, every step
        a, b = comparable(reused[step]), comparable(forced[step])
        assert a.keys() == b.keys(), step
        for key in a:
            assert a[key] == b[key], (step, key)
    assert w_reused.keys() == w_forced.keys() and all(
        torch.equal(w_reused[n], w_forced[n]) for n in w_reused
    )


@pytest.mark.parametrize(
    "reader,metric",
    [
        ("algorithm.kl_reward_coef=0.01", "kl/penalty_mean"),
        ("algorithm.rollout_is=token", "rollout_corr/is_weight_mean"),
    ],
)
def test_the_pass_runs_when_something_reads_the_old_log_probs_before_the_update(
    tmp_path, reader, metric
):
    rows, _ = run(tmp_path, "reader", reader, "trainer.total_steps=1")
    assert rows[1][INDICATOR] == 0.0 and rows[1]["timing/old_log_prob"] > 0 and metric in rows[1]


def test_the_async_learner_skips_the_pass_alike(tmp_path):
    """The asynchronous learner runs the same step (decoupled PPO: pi_prox from the update's
    forward, mu the engine's); on-policy (max_staleness 0) its learning metrics equal those of a
    learner forced to run the pass."""
    from hybridrl.driver.loop import train as train_async

    rows = {}
    for name, extra in (("auto", []), ("never", ["actor.reuse_old_log_probs=never"])):
        train_async(
            load_config(
                Config,
                None,
                [
                    "sft.steps=3",
                    "sft.batch_size=16",
                    "task.name=reverse",
                    "task.eval_size=8",
                    "rollout.max_new_tokens=16",
                    "trainer.prompts_per_step=4",
                    "trainer.samples_per_prompt=2",
                    "actor.ppo_minibatch_size=8",
                    "trainer.eval_every=0",
                    "trainer.progress=false",
                    "trainer.loggers=[jsonl]",
                    "controller.num_threads=1",
                    "trainer.mode=async",
                    "asynchronous.max_staleness=0",
                    "trainer.total_steps=2",
                    f"sft.checkpoint={tmp_path / 'ws'}",
                    f"trainer.runs_dir={tmp_path / 'runs'}",
                    f"trainer.name={name}",
                    *extra,
                ],
            )
        )
        lines = (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()
        rows[name] = {r["step"]: r for r in map(json.loads, lines)}
    learned = ("actor/", "rollout_corr/", "reward/", "response/", "advantage/")
    for step in (1, 2):
        auto, never = rows["auto"][step], rows["never"][step]
        assert auto[INDICATOR] == 1.0 and never[INDICATOR] == 0.0
        assert "timing/old_log_prob" not in auto and never["timing/old_log_prob"] > 0
        assert "actor/behav_weight_mean" in auto and "rollout_corr/logp_gap_max" in auto
        a = {k: v for k, v in auto.items() if k.startswith(learned) and k != INDICATOR}
        assert a == {k: v for k, v in never.items() if k.startswith(learned) and k != INDICATOR}, (
            step
        )


# --- data parallel: two gloo ranks in subprocesses ---------------------------------------------
# (each runs ``python tests/test_reuse_old_log_probs.py rank ...``)
WORLD = 2


def full_weights(learner) -> dict[str, torch.Tensor]:
    return {n: t.clone() for bucket in learner.weight_buckets(1 << 20) for n, t in bucket}


def dp_rank_main(rank: int, port: int, workdir: str) -> None:
    """Each rank: two FSDP2 learners on its chunk, one after the pass, one without old log-probs.
    One row per micro-batch and 31 rows (chunks of 16 and 15): rank 1 runs a dummy micro-batch,
    which must not overwrite the log-probs of the row it copies."""
    from pathlib import Path

    from hybridrl.parallel.distributed import teardown_distributed

    torch.set_num_threads(1)
    work = Path(workdir)
    part = Batch(torch.load(work / "batch.pt", weights_only=True)).chunk(WORLD)[rank]
    ctx = WorkerContext(
        rank=rank, world_size=WORLD, role="learner", pool="p", master_port=port, num_threads=1
    )
    cfg = actor_cfg("actor.micro_batch_tokens=1")
    passed, reused = Learner(ctx, cfg, None), Learner(ctx, cfg, None)
    old = passed.compute_log_prob(part)["old_log_probs"]
    out = {
        "pass": passed.update_actor(part | Batch({"old_log_probs": old})),
        "reuse": reused.update_actor(part),
        "old": old,
        "taken": reused.old_log_probs_of_last_update(part)["old_log_probs"],
    }
    out |= {"w_pass": full_weights(passed), "w_reuse": full_weights(reused)}
    for learner in (passed, reused):
        learner.close()
    teardown_distributed()
    torch.save(out, work / f"rank{rank}.pt")


@pytest.mark.slow  # two gloo ranks (~15 s); one rank is checked bit for bit by default
def test_two_ranks_without_the_pass_equal_two_ranks_with_it(tmp_path):

    vocab = make_learner(actor_cfg()).model.config.vocab_size
    torch.save(ragged_batch(vocab, n=ROWS - 1).tensors, tmp_path / "batch.pt")
    wait_ranks(launch_ranks(__file__, WORLD, tmp_path), timeout=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for out in ranks:
        assert (out["pass"].pop(INDICATOR), out["reuse"].pop(INDICATOR)) == (0.0, 1.0)
        assert_same(out["pass"], out["reuse"])
        assert torch.equal(out["taken"], out["old"])
    assert_same(ranks[0]["w_pass"], ranks[0]["w_reuse"])
    assert ranks[0]["reuse"]["actor/clip_frac"] == 0.0 and ranks[0]["reuse"]["actor/updates"] == 1


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "rank":
        dp_rank_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
        # as tests/test_fsdp.py: FSDP2's hooks can keep the gloo group alive into the interpreter's
        # exit
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)
