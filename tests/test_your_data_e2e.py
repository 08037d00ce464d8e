"""A user's model and data end to end: a locally built chat model (BPE tokenizer, ChatML template),
a jsonl of chat-format prompts with an extra column, a TRL-style batched reward function given by
file path that reads that column, a run that crosses an epoch boundary and is resumed there
exactly, sample tables, and an export that transformers loads back with its chat template. The
same job through the command line and through the Python API."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import hybridrl
from hybridrl.cli import main as cli_main
from hybridrl.models.chat_model import build_chat_model
from hybridrl.tasks.word_problems import word_problem

ROWS = 24  # 3 steps of 8 prompts per epoch (4 rows are held out: val_files is not given)
REWARD = '''
import json, os

def unit_bonus(prompts, completions, completion_ids, unit, **kwargs):
    """Reads the dataset's extra column: 1 for a completion that names no unit, and records what it
    was given."""
    with open(os.environ["UNIT_LOG"], "a") as f:
        for p, c, ids, u in zip(prompts, completions, completion_ids, unit):
            f.write(json.dumps({"prompt": p, "completion": c, "ids": ids, "unit": u}) + "\\n")
    return [0.0 if u in c[0]["content"] else 1.0 for c, u in zip(completions, unit)]
'''


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("your_data")
    rows = [word_problem(7, i) for i in range(ROWS)]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    texts = [r["prompt"][0]["content"] + " " + r["answer"] for r in rows] + ["user assistant"]
    build_chat_model(root / "model", texts, size="tiny", seed=0, vocab_size=300)
    (root / "rewards.py").write_text(REWARD)
    return root


def overrides(root, runs, steps: int) -> list[str]:
    return [
        f"model.path={root / 'model'}",
        f"data.train_files={root / 'train.jsonl'}",
        f"task.reward_fn={root / 'rewards.py'}:unit_bonus",
        f"trainer.runs_dir={runs}",
        f"trainer.total_steps={steps}",
        "trainer.prompts_per_step=4",
        "trainer.samples_per_prompt=2",
        "actor.ppo_minibatch_size=8",
        "rollout.max_new_tokens=6",
        "trainer.eval_every=0",
        "trainer.save_every=3",
        "trainer.log_samples_every=1",
        "trainer.log_samples=8",
        "trainer.loggers=[jsonl]",
        "trainer.progress=false",
        "controller.num_threads=1",
    ]


def weights(run_dir, step: int) -> dict[str, torch.Tensor]:
    model = run_dir / "checkpoints" / f"step_{step:06d}" / "model"
    return load_file(str(next(model.glob("*.safetensors"))))


def test_chat_data_trl_reward_epoch_resume_samples_and_export(assets, tmp_path, monkeypatch):
    monkeypatch.setenv("UNIT_LOG", str(tmp_path / "units.jsonl"))
    # 20 training rows (4 held out), 4 prompts per step: epoch 0 is steps 1-5, step 6 starts epoch 1
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert cli_main(["train", *overrides(assets, straight, 6)]) == 0
    assert cli_main(["train", *overrides(assets, resumed, 3)]) == 0
    assert cli_main(["train", *overrides(assets, resumed, 6), "--resume"]) == 0

    name = "train_grpo"  # from the data file's name, not W1's
    a, b = straight / name, resumed / name
    wa, wb = weights(a, 6), weights(b, 6)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    rows_a = [json.loads(x) for x in (a / "samples.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (b / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["uid"]) for r in rows_a] == [(r["step"], r["uid"]) for r in rows_b]
    assert {r["step"] for r in rows_a} == set(range(1, 7))
    epochs = {r["step"]: r["uid"].split("-e")[1][0] for r in rows_a}
    assert epochs[5] == "0" and epochs[6] == "1"  # the resumed run crossed the boundary too
    first = rows_a[0]
    assert first["prompt"].startswith("<|im_start|>user\n") and "assistant" in first["prompt"]
    assert {"completion", "reward", "status", "turns"} <= first.keys()

    # the reward function got the extra column, the chat prompts and chat-message completions
    rows = {json.dumps(word_problem(7, i)["prompt"]): word_problem(7, i) for i in range(ROWS)}
    calls = [json.loads(x) for x in (tmp_path / "units.jsonl").read_text().splitlines()]
    assert len(calls) >= 12 * 8  # 6 steps straight, 3 + 3 resumed, 8 samples each (+ evals)
    for call in calls:
        assert call["unit"] == rows[json.dumps(call["prompt"])]["unit"]
        assert call["completion"][0]["role"] == "assistant"
        assert all(isinstance(i, int) for i in call["ids"])

    out = tmp_path / "exported"
    assert cli_main(["export", str(a / "checkpoints" / "step_000006"), str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "Mia has 2 apples."}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    assert tok.decode(ids["input_ids"][0]).endswith("<|im_start|>assistant\n")
    for k, v in model.state_dict().items():
        if k in wa:
            assert torch.equal(v, wa[k]), k


def test_the_same_job_through_the_python_api(assets, tmp_path, monkeypatch):
    from datasets import Dataset

    monkeypatch.setenv("UNIT_LOG", str(tmp_path / "units.jsonl"))
    seen = []

    def short_answer(completions, completion_ids, **kwargs):  # a notebook-style callable
        seen.extend(len(i) for i in completion_ids)
        return [1.0 if len(i) <= 3 else 0.0 for i in completion_ids]

    data = Dataset.from_json(str(assets / "train.jsonl"))
    summary = hybridrl.train(
        overrides=[*overrides(assets, tmp_path / "runs", 2), "trainer.name=api_run"],
        reward_funcs=[f"{assets / 'rewards.py'}:unit_bonus", short_answer],
        reward_weights=[1.0, 0.5],
        train_dataset=data,
    )
    assert summary["steps"] == 2 and len(seen) >= 2 * 4 * 2
    metrics = [
        json.loads(x) for x in (tmp_path / "runs/api_run/metrics.jsonl").read_text().splitlines()
    ]
    step = next(m for m in metrics if m["step"] == 2)
    assert {"reward/unit_bonus", "reward/short_answer"} <= step.keys()
    expected = step["reward/unit_bonus"] + 0.5 * step["reward/short_answer"]
    assert step["reward/mean"] == pytest.approx(expected, abs=1e-6)
    saved = (tmp_path / "runs/api_run/config.yaml").read_text()
    assert "short_answer" in saved and "datasets/" in saved


def test_bad_rows_are_dropped_and_a_changed_file_is_refused_on_resume(
    assets, tmp_path, capsys, monkeypatch
):
    """Rows that crashed the step drawing them (a null prompt, a number, an empty string for a
    tokenizer without <bos>, a prompt longer than the model's positions) are dropped and counted
    in step 0's metrics; a data file that is not UTF-8 is refused in one line; a data file changed
    before --resume is refused in one line unless --resume-changed-data."""
    monkeypatch.setenv("UNIT_LOG", str(tmp_path / "units.jsonl"))
    good = [json.loads(x) for x in (assets / "train.jsonl").read_text().splitlines()]
    bad = [None, 5, "", "x " * 50_000]  # rows 1-4: the first step draws them
    records = good[:1] + [{**good[i], "prompt": p} for i, p in enumerate(bad)] + good[1:]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    runs = tmp_path / "runs"

    def args(steps: int, path=data) -> list[str]:
        return [
            *overrides(assets, runs, steps),
            f"data.train_files={path}",
            "data.shuffle=false",
            "trainer.save_every=1",
            "trainer.log_samples_every=0",
        ]

    assert cli_main(["train", *args(1)]) == 0
    run = runs / "data_grpo"
    step0 = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert step0["step"] == 0 and step0["data/dropped_not_a_prompt"] == 2
    assert step0["data/dropped_empty"] == 1 and step0["data/dropped_long"] == 1
    state = json.loads((run / "checkpoints/step_000001/trainer.json").read_text())
    assert state["data_sha256"]["data.train_files"][0]

    records[0], records[-1] = records[-1], records[0]  # the same rows in another order
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    capsys.readouterr()
    assert cli_main(["train", *args(2), "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"'{data}'" in err and "changed" in err, err
    assert "--resume-changed-data" in err and "step_000001" in err, err
    assert not (run / "checkpoints/step_000002").exists()
    assert cli_main(["train", *args(2), "--resume-changed-data"]) == 0
    assert (run / "checkpoints/step_000002").is_dir()

    latin1 = tmp_path / "latin1.jsonl"
    lines = data.read_bytes().splitlines(keepends=True)
    lines[12] = lines[12].replace(b"?", b"\xbf?")  # Latin-1, not UTF-8
    latin1.write_bytes(b"".join(lines))
    capsys.readouterr()
    assert cli_main(["train", *args(1, latin1), "trainer.name=latin1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "line 13 is not valid UTF-8" in err, err
