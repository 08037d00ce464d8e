"""Reward functions in their three forms (per-sample, TRL-style batched, veRL-style), sync and
async, several weighted functions, batched scorers added from outside, math_verify, and the
config-time errors; scored through the rollout's Scorer with hand-computed results."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import pytest

from hybridrl.checks import check_plugins
from hybridrl.config import Config, ConfigError, load_config
from hybridrl.protocol import Sample
from hybridrl.rollout import scoring
from hybridrl.rollout.scoring import Scorer
from hybridrl.tasks import Prompt
from hybridrl.tasks.base import needs
from hybridrl.tasks.reward_signatures import RewardConfigError, resolve_reward_fns

EOS, IM_END = 1, 2  # a model's generation_config may end a response with either


class CharTokenizer:
    """One id per character (its code point); ids below 32 are special and decode to nothing."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if i >= 32 or not skip_special_tokens)


def ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def prompt(i: int, answer: str = "", raw=None, task_id: str = "arith", columns=None) -> Prompt:
    return Prompt(f"p-{i}", f"question {i}", answer, task_id, raw=raw, columns=columns or {})


def sample(p: Prompt, text: str, end: int | None = EOS) -> Sample:
    """A finished sample ending with ``end`` (None: truncated, no eos)."""
    return Sample(
        prompt_ids=[40],
        response_ids=ids(text) + ([] if end is None else [end]),
        status="finished" if end is not None else "truncated",
        uid=p.uid,
        metadata={"prompt": p},
    )


def scorer(*fns, weights=None, timeout_s: float = 30.0, **kw) -> Scorer:
    cfg = Config()
    cfg.task.reward_fn = list(fns)
    cfg.task.reward_weights = weights
    cfg.task.reward_timeout_s = timeout_s
    return Scorer(cfg, CharTokenizer(), **kw)


def rewards(samples) -> list[float]:
    return [s.reward for s in samples]


def counts(samples, key) -> list[float]:
    return [s.reward_extras[key] for s in samples]


# --- per-sample -----------------------------------------------------------------------------------
def length_and_format(prompt, response, *, finished=True):
    return {"score": len(response) / 10, "format": float(response.isdigit()), "note": "text"}


def test_per_sample_scores_and_extras():
    samples = [sample(prompt(0), "357"), sample(prompt(1), "ab"), sample(prompt(2), "1", None)]
    scorer(length_and_format)(samples)
    assert rewards(samples) == [0.3, 0.2, 0.1]
    assert [s.reward_extras["reward/format"] for s in samples] == [1.0, 0.0, 1.0]
    assert all("reward/note" not in s.reward_extras for s in samples)  # numbers only
    # one function of weight 1: the reward is its score, no column of its own
    assert "reward/length_and_format" not in samples[0].reward_extras
    assert counts(samples, "reward_errors") == [0.0] * 3


def test_trailing_eos_of_any_eos_id_is_stripped():
    seen = []

    def trl(completions, completion_ids):
        seen.append(completion_ids)
        return [float(len(c)) for c in completions]

    samples = [
        sample(prompt(0), "ab", EOS),
        sample(prompt(1), "ab", IM_END),
        sample(prompt(2), "a"),
    ]
    scorer(trl, eos_ids=[EOS, IM_END])(samples)
    assert seen == [[ids("ab"), ids("ab"), ids("a")]]
    assert rewards(samples) == [2.0, 2.0, 1.0]
    # by default only the tokenizer's eos is stripped (IM_END is a special id: not decoded)
    scorer(trl)(samples)
    assert seen[-1] == [ids("ab"), ids("ab") + [IM_END], ids("a")]


# --- TRL-style ------------------------------------------------------------------------------------
def test_trl_columns_by_name_and_filtered():
    calls = {}

    def with_kwargs(prompts, completions, completion_ids, **kwargs):
        calls["kwargs"] = {"prompts": prompts, "completions": completions, **kwargs}
        return [float(c == s) for c, s in zip(completions, kwargs["solution"])]

    def named(completions, unit):  # no **kwargs: only what it names
        calls["named"] = (completions, unit)
        return [len(c) * u for c, u in zip(completions, unit)]

    ps = [
        prompt(0, "7", columns={"solution": "7", "unit": 1.0}),
        prompt(1, "8", columns={"solution": "9", "unit": 0.5}),
    ]
    samples = [sample(ps[0], "7"), sample(ps[1], "88")]
    s = scorer(with_kwargs, named)
    s(samples)
    assert calls["kwargs"] == {
        "prompts": ["question 0", "question 1"],  # raw None: the prompt text
        "completions": ["7", "88"],
        "solution": ["7", "9"],
        "unit": [1.0, 0.5],
    }
    assert calls["named"] == (["7", "88"], [1.0, 0.5])
    # reward = 1*with_kwargs + 1*named; each function's own score logged
    assert rewards(samples) == [1.0 + 1.0, 0.0 + 1.0]
    assert [x.reward_extras["reward/with_kwargs"] for x in samples] == [1.0, 0.0]
    assert [x.reward_extras["reward/named"] for x in samples] == [1.0, 1.0]


def test_trl_conversational_prompts_get_message_completions():
    got = {}

    def trl(prompts, completions, **kwargs):
        got["prompts"], got["completions"] = prompts, completions
        return [float(c[0]["content"] == "42") for c in completions]

    chat = [{"role": "user", "content": "6*7?"}]
    samples = [sample(prompt(0, raw=chat), "42"), sample(prompt(1, raw=chat), "41")]
    scorer(trl)(samples)
    assert got["prompts"] == [chat, chat]
    assert got["completions"] == [
        [{"role": "assistant", "content": "42"}],
        [{"role": "assistant", "content": "41"}],
    ]
    assert rewards(samples) == [1.0, 0.0]


def test_trl_none_means_not_scored_and_all_none_is_an_error(caplog):
    def first(completions, **kw):
        return [1.0, None, None]

    def second(completions, **kw):
        return [2.0, 3.0, None]

    samples = [sample(prompt(i), "x") for i in range(3)]
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        scorer(first, second, weights=[1.0, 10.0])(samples)
    assert rewards(samples) == [1.0 + 20.0, 30.0, 0.0]
    assert counts(samples, "reward_errors") == [0.0, 0.0, 1.0]
    assert counts(samples, "reward_nonfinite") == [0.0] * 3
    assert samples[0].reward_extras["reward/first"] == 1.0
    assert "reward/first" not in samples[1].reward_extras  # not scored by it
    assert any(
        "returned None" in r.getMessage() and "p-2" in r.getMessage() for r in caplog.records
    )


def test_trl_bad_results_fail_their_samples():
    def nonfinite_second(completions, **kw):
        return [1.0, math.inf, 0.5]

    samples = [sample(prompt(i), "x") for i in range(3)]
    scorer(nonfinite_second)(samples)
    assert rewards(samples) == [1.0, 0.0, 0.5]
    assert counts(samples, "reward_nonfinite") == [0.0, 1.0, 0.0]

    def short(completions, **kw):
        return [1.0]

    def raises(completions, **kw):
        raise RuntimeError("judge down")

    for fn in (short, raises):
        samples = [sample(prompt(i), "x") for i in range(3)]
        scorer(fn)(samples)
        assert rewards(samples) == [0.0] * 3 and counts(samples, "reward_errors") == [1.0] * 3

    def needs_missing_column(completions, solution):
        return [1.0] * len(completions)

    samples = [sample(prompt(0), "x")]
    scorer(needs_missing_column)(samples)
    assert counts(samples, "reward_errors") == [1.0]


# --- veRL-style -----------------------------------------------------------------------------------
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    hit = solution_str in ground_truth  # ground_truth as the row holds it: here a list
    return {"score": float(hit) + extra_info["bonus"], "acc": float(hit), "pred": solution_str}


def test_verl_style_dict_results_and_raw_ground_truth():
    cfg = Config()
    cfg.task.reward_fn = compute_score
    cfg.data.answer_key = "reward_model.ground_truth"
    rows = [
        {"reward_model": {"ground_truth": ["6", "06"]}, "extra_info": {"bonus": 0.5}},
        {"reward_model": {"ground_truth": ["6"]}, "extra_info": {"bonus": 0.0}},
    ]
    ps = [prompt(i, str(r), task_id="gsm8k", columns=r) for i, r in enumerate(rows)]
    samples = [sample(ps[0], "06"), sample(ps[1], "7")]
    Scorer(cfg, CharTokenizer())(samples)
    assert rewards(samples) == [1.5, 0.0]
    assert [s.reward_extras["reward/acc"] for s in samples] == [1.0, 0.0]
    assert "reward/pred" not in samples[0].reward_extras


def test_verl_style_arguments():
    seen = []

    def old_style(data_source, solution_str, ground_truth):  # before extra_info existed
        seen.append((data_source, solution_str, ground_truth))
        return 1.0

    def new_style(data_source, solution_str, ground_truth, extra_info=None):
        seen.append(extra_info)
        return 0.25

    # data.answer_key is "answer": its raw value (an int here); no extra_info column: all columns
    p = prompt(0, "357", task_id="mydata", columns={"answer": 357, "level": 3})
    scorer(old_style, new_style, weights=[1.0, 2.0])([sample(p, "357")])
    assert seen == [("mydata", "357", 357), {"answer": 357, "level": 3}]
    no_columns = sample(prompt(1, "5"), "5")  # a built-in task: the answer text
    scorer(old_style)([no_columns])
    assert seen[-1] == ("arith", "5", "5") and no_columns.reward == 1.0


# --- async ----------------------------------------------------------------------------------------
async def slow_per_sample(prompt, response):
    await asyncio.sleep(0.2)
    return float(response == prompt.answer)


async def slow_verl(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(0.2)
    return {"score": 0.5, "slept": 0.2}


async def slow_trl(prompts, completions, **kwargs):
    await asyncio.sleep(0.2)
    return [1.0] * len(completions)


@pytest.mark.parametrize("fn", [slow_per_sample, slow_verl, slow_trl])
def test_async_functions_run_concurrently(fn):
    samples = [sample(prompt(i, "3" if i % 2 else "4"), "3") for i in range(8)]
    start = time.monotonic()
    scorer(fn)(samples)
    elapsed = time.monotonic() - start
    assert elapsed < 0.8, elapsed  # 8 calls of 0.2 s one after another would take 1.6 s
    expected = {slow_per_sample: [0.0, 1.0] * 4, slow_verl: [0.5] * 8, slow_trl: [1.0] * 8}[fn]
    assert rewards(samples) == expected
    assert counts(samples, "reward_errors") == [0.0] * 8


async def hangs_on_hang(prompt, response):
    await asyncio.sleep(30 if prompt.answer == "hang" else 0.05)
    return 1.0


def test_async_call_times_out_alone(caplog):
    samples = [sample(prompt(i, "hang" if i == 2 else "x"), "x") for i in range(5)]
    start = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=scoring.__name__):
        s = scorer(hangs_on_hang, timeout_s=0.3)
        s(samples)
    assert time.monotonic() - start < 3
    assert rewards(samples) == [1.0, 1.0, 0.0, 1.0, 1.0]
    assert counts(samples, "reward_timeouts") == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert counts(samples, "reward_errors") == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert any("0.3 s" in r.getMessage() and "p-2" in r.getMessage() for r in caplog.records)
    assert s.pools["hangs_on_hang"].hung == 0  # cancelled: no thread left behind


async def slow_batch(completions, **kwargs):
    await asyncio.sleep(30)


def test_async_batched_timeout_fails_the_batch():
    samples = [sample(prompt(i), "x") for i in range(3)]
    scorer(slow_batch, timeout_s=0.2)(samples)
    assert counts(samples, "reward_timeouts") == [1.0] * 3 and rewards(samples) == [0.0] * 3


# --- several functions, weights, names ------------------------------------------------------------
def one(prompt, response):
    return 1.0


def test_weights_per_function_scores_and_unique_names():
    samples = [sample(prompt(0), "abc")]
    s = scorer(one, length_and_format, one, weights=[2.0, 10.0, -0.5])
    assert [f.name for f in s.functions] == ["one", "length_and_format", "one_2"]
    s(samples)
    assert samples[0].reward == pytest.approx(2.0 + 10 * 0.3 - 0.5)
    extras = samples[0].reward_extras
    assert extras["reward/one"] == 1.0 and extras["reward/one_2"] == 1.0
    assert extras["reward/length_and_format"] == pytest.approx(0.3)  # unweighted
    assert extras["reward/format"] == 0.0  # its extras, as with one function


def test_a_failing_function_scores_the_sample_zero():
    def boom(prompt, response):
        raise ValueError("no")

    samples = [sample(prompt(0), "abc")]
    scorer(one, boom)(samples)
    assert samples[0].reward == 0.0 and samples[0].reward_extras["reward_errors"] == 1.0
    assert samples[0].reward_extras["reward/boom"] == 0.0
    assert samples[0].reward_extras["reward/one"] == 1.0


def test_overflowing_weighted_sum_is_nonfinite():
    samples = [sample(prompt(0), "abc")]
    scorer(one, weights=[1e300])(samples)
    assert samples[0].reward == 0.0 and samples[0].reward_extras["reward_nonfinite"] == 1.0


def test_default_reward_of_a_dataset_is_exact_match():
    cfg = Config()
    assert [f.name for f in resolve_reward_fns(cfg)] == ["exact_match"]
    cfg.data.train_files = "rows.jsonl"
    cfg.task.name = "no-such-task"  # ignored with a dataset
    assert [f.name for f in resolve_reward_fns(cfg)] == ["exact_match"]


# --- batched scorers from outside -----------------------------------------------------------------
def test_external_batched_scorer():
    got = []

    def judge(prompts, completions):
        got.append((prompts, completions))
        return [0.5 * len(c) for c in completions]

    ps = [prompt(0, "ab"), prompt(1, "ab")]
    s = scorer("exact_match", extra_scorers=[("judge", judge, 2.0)])
    assert s.add_scorer("judge", judge, 0.5) == "judge_2"
    samples = [sample(ps[0], "ab"), sample(ps[1], "abcd")]
    s(samples)
    assert got[0] == (ps, ["ab", "abcd"]) and len(got) == 2  # one call per scorer call
    assert rewards(samples) == [1.0 + 2 * 1.0 + 0.5 * 1.0, 0.0 + 2 * 2.0 + 0.5 * 2.0]
    assert samples[1].reward_extras["reward/judge"] == 2.0
    assert samples[1].reward_extras["reward/exact_match"] == 0.0

    def down(prompts, completions):
        raise ConnectionError("reward model unreachable")

    s.add_scorer("rm", down)
    s(samples)
    assert rewards(samples) == [0.0, 0.0] and counts(samples, "reward_errors") == [1.0, 1.0]


# --- math_verify ----------------------------------------------------------------------------------
def test_math_verify():
    pytest.importorskip("math_verify")
    from hybridrl.tasks.mathverify import math_verify

    assert math_verify(prompt(0, "\\frac{1}{2}"), "0.5") == 1.0
    assert math_verify(prompt(0, "0.5"), "so the answer is $\\frac{1}{2}$") == 1.0
    assert math_verify(prompt(0, "357"), "12+345 gives \\boxed{357}") == 1.0
    assert math_verify(prompt(0, "357"), "\\boxed{358}") == 0.0
    assert math_verify(prompt(0, "x+1"), "$1+x$") == 1.0  # a bare reference is read as $...$
    assert math_verify(prompt(0, ""), "1") == 0.0
    # on the scorer's helper threads (math-verify's signal timeouts are off)
    samples = [sample(prompt(0, "\\frac{1}{2}"), "0.5"), sample(prompt(1, "2"), "\\boxed{3}")]
    scorer("math_verify")(samples)
    assert rewards(samples) == [1.0, 0.0] and counts(samples, "reward_errors") == [0.0, 0.0]


# --- config-time errors ---------------------------------------------------------------------------
def bad_signature(x):
    return 1.0


@needs("no_such_package_hybridrl_test", extra="extra-name")
def needs_missing_package(prompt, response):
    return 1.0


def test_unrecognised_signature_is_a_config_error():
    cfg = load_config(Config, None, [f"task.reward_fn=[exact_match, {__name__}:bad_signature]"])
    with pytest.raises(ConfigError) as info:
        check_plugins(cfg)
    message = str(info.value)
    assert "\n" not in message and message.startswith("config key 'task.reward_fn[1]'")
    assert "bad_signature(x)" in message
    for form in ("per-sample fn(prompt, response", "fn(prompts, completions", "solution_str"):
        assert form in message
    cfg.task.reward_fn = [lambda: 1.0]
    with pytest.raises(RewardConfigError, match=r"task.reward_fn\[0\].*unrecognised"):
        Scorer(cfg, CharTokenizer())


def test_missing_package_and_unknown_name_are_config_errors():
    cfg = load_config(Config, None, [f"task.reward_fn={__name__}:needs_missing_package"])
    with pytest.raises(ConfigError, match=r"pip install 'hybridrl\[extra-name\]'"):
        check_plugins(cfg)
    cfg = load_config(Config, None, ["task.reward_fn=exact_matc"])
    with pytest.raises(ConfigError, match="did you mean 'exact_match'"):
        check_plugins(cfg)
    from hybridrl.tasks.mathverify import math_verify

    assert math_verify.requires_module == ("math_verify", "math")
