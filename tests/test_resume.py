"""Exact resume (local backend, deterministic on CPU): 2k steps in one run == k steps, stop, resume for k more."""
import json

import pytest
from safetensors.torch import load_file

from hybridrl.config import Config, load_config
from hybridrl.trainers.sync import train

K = 2
TINY = [
    "sft.steps=3", "sft.batch_size=16", "task.eval_size=8", "trainer.prompts_per_step=4", "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4", "trainer.eval_every=1", "trainer.save_every=0", "rollout.max_new_tokens=8",
    "trainer.progress=false", "trainer.tensorboard=false", "controller.num_threads=1",
    # exercise every piece of resumable state: adaptive KL coefficient (reward penalty), dynamic sampling (prompt cursor)
    "algorithm.kl_reward_coef=0.05", "algorithm.kl_ctrl=adaptive", "algorithm.filter_groups=true", "algorithm.max_sampling_rounds=2",
]
TIMING = ("timing/", "engine/", "perf/")  # wall times, and engine statistics (a resumed engine starts with a cold prefix cache)


def cfg(tmp_path, name, steps, *extra) -> Config:
    return load_config(Config, None, [*TINY, f"sft.checkpoint={tmp_path / 'ws'}", f"trainer.runs_dir={tmp_path / 'runs'}",
                                      f"trainer.name={name}", f"trainer.total_steps={steps}", *extra])


def metrics(tmp_path, name) -> dict[int, dict]:
    rows = [json.loads(line) for line in (tmp_path / "runs" / name / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows}


def weights(tmp_path, name, step):
    return load_file(tmp_path / "runs" / name / "checkpoints" / f"step_{step:06d}" / "model" / "model.safetensors")


def test_resume_is_exact_and_continues_after_the_end(tmp_path):
    train(cfg(tmp_path, "straight", 2 * K))
    train(cfg(tmp_path, "split", K))
    resumed = train(cfg(tmp_path, "split", 2 * K), resume=True)
    assert resumed["resumed_from_step"] == K
    a, b = metrics(tmp_path, "straight"), metrics(tmp_path, "split")
    assert sorted(a) == sorted(b) == list(range(2 * K + 1))
    for step in a:
        assert a[step].keys() == b[step].keys(), step
        for key in a[step]:
            assert a[step][key] == pytest.approx(b[step][key], rel=0, abs=0), (step, key)
    wa, wb = weights(tmp_path, "straight", 2 * K), weights(tmp_path, "split", 2 * K)
    assert wa.keys() == wb.keys() and all((wa[n] == wb[n]).all() for n in wa)
    # resuming a finished run with a larger total_steps trains the remaining steps, not zero
    more = train(cfg(tmp_path, "split", 2 * K + 1), resume=True)
    assert more["resumed_from_step"] == 2 * K and max(metrics(tmp_path, "split")) == 2 * K + 1
    assert (tmp_path / "runs" / "split" / "checkpoints" / f"step_{2 * K + 1:06d}").is_dir()
