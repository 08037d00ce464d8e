"""Several tasks in one run (task.mix): the prompt stream, held-out set, default reward, per-task
metrics and task-level advantage normalisation, and a short run end to end."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from hybridrl.config import Config, load_config
from hybridrl.learner.metrics import mean_over_ranks, task_metrics
from hybridrl.protocol import Batch
from hybridrl.tasks import REWARDS, TASKS
from hybridrl.tasks.base import Task
from hybridrl.tasks.mix import MixedTask


def test_the_stream_follows_the_weights_and_is_a_function_of_the_index():
    task = MixedTask({"arith": 3.0, "reverse": 1.0}, seed=5, heldout_size=40)
    prompts = [task.prompt(i) for i in range(800)]
    counts = Counter(p.task_id for p in prompts)
    assert set(counts) == {"arith", "reverse"}
    assert 0.68 < counts["arith"] / 800 < 0.82  # weight 3/4
    again = MixedTask({"arith": 3.0, "reverse": 1.0}, seed=5, heldout_size=40)
    assert [again.prompt(i) for i in (799, 3, 400)] == [prompts[799], prompts[3], prompts[400]]
    assert len({p.uid for p in prompts}) == 800
    other_seed = MixedTask({"arith": 3.0, "reverse": 1.0}, seed=6, heldout_size=40)
    assert [other_seed.prompt(i) for i in range(50)] != prompts[:50]
    held = task.heldout()
    assert Counter(p.task_id for p in held) == {"arith": 30, "reverse": 10}
    assert {TASKS.get(t).name for t in ("arith", "reverse")} == {p.task_id for p in held}
    # the character tokenizers of arith and reverse merge: every prompt encodes
    tok = task.tokenizer()
    for p in held:
        assert tok.decode(tok(p.text)["input_ids"], skip_special_tokens=True) == p.text


def test_the_default_reward_is_each_prompts_own_task():
    task = MixedTask({"arith": 1.0, "reverse": 1.0}, heldout_size=8)
    fn = REWARDS.get("task_default")
    for p in task.heldout():
        assert fn(p, p.answer)["score"] == 1.0
        assert fn(p, p.answer + "9")["score"] == 0.0


def test_bad_mixes_are_clear_errors():
    with pytest.raises(ValueError, match="at least two tasks"):
        MixedTask({"arith": 1.0})
    with pytest.raises(ValueError, match="weights must be > 0"):
        MixedTask({"arith": 1.0, "reverse": 0.0})

    @TASKS.register("_other_tokenizer")
    class Other(Task):
        def __init__(self, seed=0, heldout_size=1):
            pass

        def tokenizer(self):
            tok = TASKS.get("arith")().tokenizer()
            other = type(tok)(tokenizer_object=tok.backend_tokenizer)
            other.add_tokens(["<extra>"])  # not a single character: cannot be merged
            return other

        prompt = heldout = sft_example = None

    with pytest.raises(ValueError, match="use different tokenizers"):
        MixedTask({"arith": 1.0, "_other_tokenizer": 1.0})


def test_per_task_metrics_and_the_mean_over_ranks_of_a_key_some_ranks_lack():
    batch = Batch({"rewards": torch.tensor([1.0, 0.0, 0.5, 1.0])}, {"task_id": list("aabb")})
    assert task_metrics(batch) == {"reward/task/a": 0.5, "reward/task/b": 0.75}
    assert task_metrics(Batch({"rewards": torch.ones(2)}, {"task_id": ["a", "a"]})) == {}
    merged = mean_over_ranks([{"x": 1.0, "reward/task/a": 0.2}, {"x": 3.0}])
    assert merged == {"x": 2.0, "reward/task/a": 0.2}


@pytest.mark.parametrize("mode", ["sync"])
def test_a_mixed_run_logs_per_task_rewards(tmp_path, mode):
    from hybridrl.driver.loop import train

    cfg = load_config(
        Config,
        None,
        [
            "task.mix={arith: 1, reverse: 1}",
            "algorithm.task_norm=true",
            "sft.steps=2",
            "sft.batch_size=8",
            "task.heldout_size=8",
            "trainer.prompts_per_step=8",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=16",
            "trainer.total_steps=1",
            "trainer.eval_every=1",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "controller.num_threads=1",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
        ],
    )
    assert train(cfg)["steps"] == 1
    (run,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r.get("step") == 1 and "reward/mean" in r)
    assert {"reward/task/arith", "reward/task/reverse"} <= set(step)
