"""bench/e2e.py and bench/e2e_sides.py: their pure helpers (always), and one step per side against
TRL (only where TRL is installed: it is the optional ``bench`` extra, which CI does not install)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


E2E, SIDES = load_bench("e2e"), load_bench("e2e_sides")


def test_prompts_are_the_trainers_stream():
    from hybridrl.config import Config
    from hybridrl.models.loading import make_task

    task = make_task(Config())  # what the sync trainer draws from (trainer.seed 0)
    pairs = SIDES.w1_prompts(40)
    assert pairs == [(task.prompt(i).text, task.prompt(i).answer) for i in range(40)]
    assert all(eval(text[:-1]) == int(answer) for text, answer in pairs)  # "a+b=" -> str(a + b)
    from hybridrl.protocol import prompt_sample
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()  # <bos> and one token per character
    widths = {len(prompt_sample(task.prompt(i), tok).prompt_ids) for i in range(2000)}
    assert max(widths) == SIDES.PROMPT_LEN


def test_trl_micro_batch_fits_the_token_budget():
    assert SIDES.trl_micro_batch(16) == 256  # (9 + 16) * 256 = 6400 <= 8192
    assert SIDES.trl_micro_batch(128) == 32  # (9 + 128) * 32 = 4384; 64 would be 8768
    assert SIDES.trl_micro_batch(10_000) == 1
    for n in (16, 64, 128, 512):
        m = SIDES.trl_micro_batch(n)
        assert 256 % m == 0 and (m == 1 or m * (SIDES.PROMPT_LEN + n) <= SIDES.MICRO_TOKENS)


def test_both_configs_describe_the_same_step(tmp_path):
    from hybridrl.config import Config, load_config

    overrides, dropped = SIDES.known_overrides(
        SIDES.hybridrl_overrides(str(tmp_path), 128, 4, 2, "fp32", str(tmp_path), "x")
    )
    assert set(dropped) <= {
        "rollout.backend_options.dtype=fp32"
    }  # the only key an older checkout may lack
    assert SIDES.known_overrides(["actor.lr=1", "actor.no_such_key=1", "nosection.x=1"]) == (
        ["actor.lr=1"],
        ["actor.no_such_key=1", "nosection.x=1"],
    )
    (tmp_path / "config.json").write_text("{}")  # model.path must hold a checkpoint
    cfg = load_config(Config, str(ROOT / "examples" / "arith_grpo.yaml"), overrides)
    trl = SIDES.trl_config_kwargs(128, 4, "fp32", str(tmp_path))
    t, a, alg, r = cfg.trainer, cfg.actor, cfg.algorithm, cfg.rollout
    assert (
        t.prompts_per_step * t.samples_per_prompt
        == a.ppo_minibatch_size
        == trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"]
        == 256
    )
    assert (
        trl["num_generations"] == t.samples_per_prompt == 8
        and a.ppo_epochs == trl["num_iterations"] == 1
    )
    assert r.max_new_tokens == trl["max_completion_length"] == 128
    assert (
        (r.temperature, r.top_p, r.top_k)
        == (trl["temperature"], trl["top_p"], trl["top_k"])
        == (1.0, 1.0, 0)
    )
    assert alg.kl_coef == trl["beta"] == 0.04 and alg.kl_estimator == "k3"
    assert alg.clip_ratio_low == alg.clip_ratio_high == trl["epsilon"] == 0.2
    assert (alg.loss_agg, trl["loss_type"]) == (
        "token-mean",
        "dapo",
    )  # both: mean over all tokens of the batch
    assert alg.advantage == "grpo" and alg.norm_adv_by_std and trl["scale_rewards"] == "group"
    assert a.lr == trl["learning_rate"] == 1e-5 and a.weight_decay == trl["weight_decay"] == 0.0
    assert a.grad_clip == trl["max_grad_norm"] == 1.0 and trl["lr_scheduler_type"] == "constant"
    assert trl["optim"] == "adamw_torch" and not trl["gradient_checkpointing"] and not trl["bf16"]
    assert (
        cfg.fsdp.mixed_precision == "fp32"
        and not cfg.sft.enabled
        and t.total_steps == trl["max_steps"] == 4
    )
    assert (
        t.eval_every == 0
        and t.loggers == ["jsonl"]
        and not t.progress
        and trl["report_to"] == "none"
    )
    assert SIDES.trl_config_kwargs(16, 1, "bf16", str(tmp_path))["bf16"]


def test_trl_positions_are_the_padded_batch():
    p = SIDES.trl_positions(256, 8, 128)
    assert p == {f"positions/{k}": 256.0 * 136 for k in ("generation", "reference", "update")}
    assert E2E.step_work(p) == 5 * 256 * 136


def test_summarise_drops_warmup_and_takes_medians():
    rows = [
        {"step": 9.0, "cpu": 8.0, "rollout": 5.0, "response_length": 3.0},
        {"step": 1.0, "cpu": 0.9, "rollout": 0.5, "response_length": 4.0},
        {"step": 3.0, "cpu": 2.5, "rollout": 0.7, "response_length": 6.0},
        {"step": 2.0, "cpu": 1.5, "rollout": 0.6, "response_length": 5.0},
    ]
    for r, n in zip(rows, (9, 1, 3, 2)):
        r |= {"positions/generation": 10.0 * n, "positions/reference": n, "positions/update": n}
    s = E2E.summarise(rows, warmup=1)
    assert s["s_per_step"] == 2.0 and s["cpu_s_per_step"] == 1.5 and s["phases"] == {"rollout": 0.6}
    assert s["positions"] == {"generation": 20.0, "reference": 2.0, "update": 2.0}
    assert s["work"] == 2 * (10 + 1 + 3)  # the median step's: generation + reference + 3 x update
    assert s["response_length"] == 5.0
    assert s["timed_steps"] == 3 and s["step_times"] == [9.0, 1.0, 3.0, 2.0]


@pytest.mark.slow  # ~20 s: both sides train a step in subprocesses; the specs are checked above
@pytest.mark.timeout(600)
def test_one_step_per_side_against_trl(tmp_path):
    pytest.importorskip("trl")
    out = E2E.main(
        [
            "--workloads",
            "w1_tiny",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "e2e.json"),
        ]
    )
    r = out["w1_tiny"]
    assert r["identical_prompt_ids"] and r["prompt_ids_checked"] == 32
    assert r["first_prompt_ids"][0] == 1  # <bos> first on both sides
    assert r["speedup_vs_trl"] == pytest.approx(r["trl_s_per_step"] / r["hybridrl_s_per_step"])
    for side in ("hybridrl", "trl"):
        assert (
            r[side]["timed_steps"] == 1
            and r[side]["s_per_step"] > 0
            and r[side]["phases"]["rollout"] > 0
        )
        assert r[side]["cpu_s_per_step"] > 0 and r[side]["response_length"] > 0
    assert r["speedup_vs_trl_cpu_time"] == pytest.approx(
        r["trl"]["cpu_s_per_step"] / r["hybridrl"]["cpu_s_per_step"]
    )
    lengths = r["trl"]["response_length"] / r["hybridrl"]["response_length"]
    assert r["speedup_vs_trl_per_token"] == pytest.approx(r["speedup_vs_trl"] / lengths)
    # TRL pads every row to the longest prompt and completion: never less work than hybridrl's
    assert r["work_ratio"] >= 1.0
    assert r["speedup_per_work"] == pytest.approx(r["speedup_vs_trl"] / r["work_ratio"])
    assert r["trl"]["positions"]["update"] % 256 == 0  # 256 rows of one padded width
    assert {"precision", "threads", "commit", "machine", "trl"} <= set(out) and out[
        "trl"
    ] == sys.modules["trl"].__version__
