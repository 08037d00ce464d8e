"""Scoring overlapped with generation (``rollout/worker_scoring.py``): on the native engine's
continuous batch each group is scored once done while the others generate, and the result is the
plain path's (generate, then score the batch): the same samples in the same order, the same rewards;
async reward functions stay concurrent."""

import asyncio
import threading
import time

import pytest
import torch

from hybridrl.config import Config
from hybridrl.models.factory import build_model
from hybridrl.protocol import prompt_sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends import make_backend
from hybridrl.rollout.scoring import Scorer
from hybridrl.rollout.worker_scoring import generate_scored, steps_itself
from hybridrl.tasks.arithmetic import ArithmeticTask
from hybridrl.tasks.tokenizer import build_char_tokenizer

torch.set_num_threads(1)
PROMPTS, N = 6, 4


def length_score(prompt, response, *, finished=True):
    """Differs between samples (a random-init model rarely answers right), so that a mixed-up
    order or a missed group shows."""
    return len(response) / 10 + (0.5 if finished else 0.0)


def digits_batched(prompts, completions, **_):
    """TRL-style batched: one call for every sample it is given."""
    return [float(sum(c.isdigit() for c in text)) for text in completions]


def setup(backend="native", reward_fns=(length_score,), max_new=24):
    cfg = Config()
    cfg.rollout.backend = backend
    cfg.task.reward_fn = list(reward_fns)
    tok = build_char_tokenizer()
    engine = make_backend(cfg.rollout, build_model("tiny", tok, 0).eval(), tok)
    task = ArithmeticTask(seed=0)
    prompts = [prompt_sample(task.prompt(i), tok) for i in range(PROMPTS)]
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new, n=N, seed=7)
    return cfg, tok, engine, prompts, params


def summary(samples):
    return [
        (s.uid, s.status, s.prompt_ids, s.response_ids, s.reward, dict(s.reward_extras))
        for s in samples
    ]


def test_overlapped_scoring_equals_scoring_after_generation():
    cfg, tok, engine, prompts, params = setup(reward_fns=(length_score, digits_batched))
    want = Scorer(cfg, tok)(engine.generate(prompts, params))

    cfg, tok, engine, prompts, params = setup(reward_fns=(length_score, digits_batched))
    assert steps_itself(engine)
    steps, scored_at = [0], []
    step = engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    scorer = Scorer(cfg, tok)

    def score(groups):
        scored_at.append((steps[0], len(groups)))
        return scorer(groups)

    got = generate_scored(engine, score, prompts, params)
    assert summary(got) == summary(want)
    assert [s.uid for s in got] == [p.uid for p in prompts for _ in range(N)]
    # whole groups, each scored once, the first call before generation ended
    assert sum(size for _, size in scored_at) == PROMPTS * N
    assert all(size % N == 0 for _, size in scored_at)
    assert len(scored_at) >= 2 and scored_at[0][0] < steps[0]
    assert len({s.reward for s in got}) > 3  # the rewards tell the samples apart


def test_default_step_backend_keeps_the_plain_path():
    """hf's ``step`` is the base class's one-generate default: every group finishes at once."""
    *_, engine, _, _ = setup(backend="hf")
    assert not steps_itself(engine)


def test_async_reward_calls_stay_concurrent():
    delay, live, most = 0.3, [0], [0]
    lock = threading.Lock()

    async def slow_length(prompt, response, *, finished=True):
        with lock:
            live[0] += 1
            most[0] = max(most[0], live[0])
        await asyncio.sleep(delay)
        with lock:
            live[0] -= 1
        return float(len(response))

    cfg, tok, engine, prompts, params = setup(reward_fns=(slow_length,), max_new=4)
    scorer = Scorer(cfg, tok)
    t0 = time.perf_counter()
    got = generate_scored(engine, scorer, prompts, params)
    elapsed = time.perf_counter() - t0
    calls = PROMPTS * N
    assert len(got) == calls and all(s.reward_extras["reward_errors"] == 0 for s in got)
    assert most[0] > N  # calls of different groups were in flight together
    assert elapsed < calls * delay / 4  # sequential calls would take calls x delay


def test_a_scoring_error_is_raised():
    cfg, tok, engine, prompts, params = setup(max_new=24)

    def score(group):
        raise RuntimeError("scorer down")

    with pytest.raises(RuntimeError, match="scorer down"):
        generate_scored(engine, score, prompts, params)
