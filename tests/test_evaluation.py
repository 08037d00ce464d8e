"""The held-out evaluation (eval section): n samples per prompt, mean@n, pass@k by the unbiased
estimator, a breakdown per data source, the evaluation's own sampling settings, the generations
written to a jsonl, the evaluation before training switchable; the same metrics in
`hybridrl eval`."""

import itertools
import json
import math
from types import SimpleNamespace

import pytest

from hybridrl.config import Config, load_config
from hybridrl.driver.evaluate import eval_metrics, final_answer, pass_at_k
from hybridrl.tasks import Prompt


@pytest.mark.parametrize("n, c", [(4, 0), (4, 1), (4, 3), (8, 2), (5, 5)])
def test_pass_at_k_is_the_exact_chance_over_the_draws(n, c):
    """1 - C(n-c, k) / C(n, k) equals the share of k-subsets of the n draws with a right one."""
    draws = [1] * c + [0] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(draws, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))


def sample(reward):
    return SimpleNamespace(reward=reward)


def prompt(i, source):
    return Prompt(uid=f"p{i}", text="q", answer="a", task_id=source)


def test_metrics_of_an_evaluation():
    prompts = [prompt(0, "gsm8k"), prompt(1, "gsm8k"), prompt(2, "math")]
    sampled = [sample(r) for r in (1, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0)]  # n = 4: 1, 4, 0 right
    greedy = [sample(r) for r in (1, 1, 0)]
    out = eval_metrics(prompts, sampled, greedy, 4)
    assert out["eval/accuracy"] == pytest.approx(5 / 12)  # mean@4
    assert out["eval/greedy_accuracy"] == pytest.approx(2 / 3)
    assert out["eval/pass@1"] == pytest.approx(5 / 12)  # pass@1 is mean@n
    assert out["eval/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/pass@2"] == pytest.approx((pass_at_k(4, 1, 2) + 1 + 0) / 3)
    assert out["eval/source/gsm8k/accuracy"] == pytest.approx(5 / 8)
    assert out["eval/source/math/accuracy"] == 0.0
    assert out["eval/reward_binary"] == 1.0
    # a reward that is not 0 or 1: a mean reward, no pass@k
    partial = eval_metrics(prompts[:1], [sample(0.5), sample(1)], [sample(1)], 2)
    assert partial["eval/reward_binary"] == 0.0 and not any("pass@" in k for k in partial)
    one_source = eval_metrics(prompts[:2], sampled[:8], greedy[:2], 4)
    assert not any(k.startswith("eval/source/") for k in one_source)


@pytest.mark.parametrize(
    "response, answer",
    [
        ("so the answer is \\boxed{\\frac{1}{2}} or 7", "\\frac{1}{2}"),  # the last box, nested
        ("3 apples and 4 pears: 1,234.5 in all", "1234.5"),  # the last number
        ("  blue \n", "blue"),
    ],
)
def test_final_answer(response, answer):
    assert final_answer(response) == answer


def test_maj_at_k_votes_on_final_answers():
    prompts = [prompt(0, "a"), prompt(1, "a")]
    # prompt 0: answers 7, 5, 5, 5 (5 right): the majority of all four is right, and of the runs
    # of two: [7, 5] ties (7 first: wrong), [5, 5] right; prompt 1: 3 right once, 8 twice
    rewards = (0, 1, 1, 1, 1, 0, 0, 0)
    answers = ["7", "5", "5", "5", "3", "8", "8", "9"]
    out = eval_metrics(prompts, [sample(r) for r in rewards], [sample(0)] * 2, 4, answers)
    assert out["eval/maj@4"] == pytest.approx((1 + 0) / 2)
    assert out["eval/maj@2"] == pytest.approx((1 / 2 + 1 / 2) / 2)  # [3, 8] tie: 3, right
    assert out["eval/pass@4"] == 1.0  # pass@k counts any right sample, maj@k the vote
    assert "eval/maj@1" not in out and "eval/maj@2" not in eval_metrics(
        prompts, [sample(r) for r in rewards], [sample(0)] * 2, 4
    )


def test_a_run_evaluates_with_its_own_settings_and_writes_the_generations(tmp_path):
    from hybridrl.driver.loop import train

    cfg = load_config(
        Config,
        None,
        [
            "sft.steps=3",
            "sft.batch_size=16",
            "task.eval_size=8",
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=4",
            "trainer.total_steps=1",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "controller.num_threads=1",
            "eval.n=4",
            "eval.temperature=0.7",
            "eval.max_new_tokens=5",
            "eval.before=false",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
        ],
    )
    summary = train(cfg)
    run = tmp_path / "runs" / cfg.trainer.name
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 0 and rows[0]["eval/accuracy"] is None  # eval.before off
    written = json.loads((run / "summary.json").read_text())
    assert (
        written["accuracy_before"] is None
        and written["accuracy_after"] == summary["accuracy_after"]
    )
    last = rows[-1]
    assert {"eval/pass@1", "eval/pass@2", "eval/pass@4"} <= set(last)
    assert last["eval/pass@1"] == pytest.approx(last["eval/accuracy"])
    assert last["eval/pass@1"] <= last["eval/pass@2"] <= last["eval/pass@4"]
    lines = [json.loads(x) for x in (run / "eval" / "step_000001.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and all(len(x["responses"]) == len(x["rewards"]) == 4 for x in lines)
    assert all(isinstance(x["responses"][0], str) for x in lines)
    assert not (run / "eval" / "step_000000.jsonl").exists()
    mean = sum(r for x in lines for r in x["rewards"]) / 32
    assert math.isclose(mean, last["eval/accuracy"])


def test_hybridrl_eval_prints_the_same_metrics(tmp_path, capsys):
    from hybridrl.cli import main

    args = ["eval", "sft.steps=3", "sft.batch_size=16", "task.eval_size=8", "eval.n=2"]
    args += [f"sft.checkpoint={tmp_path / 'ws'}", "trainer.progress=false"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"eval/accuracy", "eval/greedy_accuracy", "eval/pass@1", "eval/pass@2"} <= set(out)


def test_hybridrl_generate_writes_one_line_per_prompt(tmp_path, capsys):
    from hybridrl.cli import main

    out = tmp_path / "gen" / "out.jsonl"
    args = ["generate", "sft.steps=3", "sft.batch_size=16", "eval.n=3", "rollout.backend=hf"]
    args += [f"sft.checkpoint={tmp_path / 'ws'}", "trainer.progress=false"]
    assert main([*args, "--output", str(out), "--train", "5"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) == 5 and all(len(x["responses"]) == 3 for x in lines)
    assert len({x["uid"] for x in lines}) == 5  # the first five training prompts
    assert metrics["eval/accuracy"] == pytest.approx(sum(sum(x["rewards"]) for x in lines) / 15)
    with pytest.raises(SystemExit):
        main(["generate", "sft.steps=3"])  # --output is required
