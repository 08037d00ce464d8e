"""The Python entry point's config building (hybridrl.make_config), callables in a saved config,
and plug-ins named by file path. The end-to-end run through the API is in
tests/test_your_data_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import hybridrl
from hybridrl.config import Config, ConfigError, dump_yaml, load_config
from hybridrl.config.loader import callable_path
from hybridrl.registry import load_dotted

ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i % 3} for i in range(12)]


def short(completions, **kwargs):
    return [1.0 if len(c) < 5 else 0.0 for c in completions]


def test_config_from_a_dict_a_config_and_overrides_in_both_forms(tmp_path):
    runs = str(tmp_path / "runs")
    a = hybridrl.make_config({"trainer": {"runs_dir": runs}}, {"trainer.total_steps": 7})
    b = hybridrl.make_config(None, [f"trainer.runs_dir={runs}", "trainer.total_steps=7"])
    c = hybridrl.make_config(a, {"actor.lr": 0.5})
    assert a.trainer.total_steps == b.trainer.total_steps == c.trainer.total_steps == 7
    assert dump_yaml(a) == dump_yaml(b)
    assert c.actor.lr == 0.5 and a.actor.lr != 0.5  # the given Config is not changed


def test_bad_config_arguments_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="config must be a YAML path, a dict"):
        hybridrl.make_config(42)
    with pytest.raises(ConfigError, match="overrides must be a dict or a list"):
        hybridrl.make_config(None, "trainer.total_steps=3")
    with pytest.raises(ConfigError, match="unknown"):
        hybridrl.make_config(None, {"trainer.totl_steps": 3})
    with pytest.raises(ConfigError, match="a list of rows must hold dicts"):
        hybridrl.make_config(
            None, {"trainer.runs_dir": str(tmp_path)}, train_dataset=[{"prompt": "1"}, 3]
        )
    with pytest.raises(ConfigError, match="reward_weights has 2 weight"):
        hybridrl.make_config(None, reward_funcs=[short], reward_weights=[1.0, 2.0])


def test_a_dataset_object_is_saved_once_by_content_and_named_in_the_config(tmp_path):
    from datasets import Dataset

    runs = tmp_path / "runs"
    a = hybridrl.make_config(None, {"trainer.runs_dir": str(runs)}, train_dataset=ROWS)
    b = hybridrl.make_config(
        None, {"trainer.runs_dir": str(runs)}, train_dataset=Dataset.from_list(ROWS)
    )
    other = hybridrl.make_config(None, {"trainer.runs_dir": str(runs)}, train_dataset=ROWS[:6])
    assert a.data.train_files == b.data.train_files != other.data.train_files
    path = Path(a.data.train_files)
    assert path.is_file() and path.parent.parent == (runs / "datasets").resolve()
    assert Dataset.from_parquet(str(path)).to_list() == ROWS
    assert a.trainer.name == "dataset_grpo"  # derived from the saved file, not W1's name
    assert not a.sft.enabled  # no arithmetic warm start on a user's dataset
    saved = yaml.safe_load(dump_yaml(a))
    assert saved["data"]["train_files"] == a.data.train_files


def test_callables_are_kept_and_the_saved_config_names_them():
    cfg = hybridrl.make_config(
        None, reward_funcs=[short, "exact_match", lambda prompt, response: 0.0]
    )
    assert cfg.task.reward_fn[0] is short
    saved = yaml.safe_load(dump_yaml(cfg))["task"]["reward_fn"]
    assert saved[:2] == [f"{__name__}:short", "exact_match"]
    assert saved[2].startswith("<python: ") and saved[2].endswith("<lambda>>")
    assert callable_path(short) == f"{__name__}:short"


def test_a_reward_function_by_file_path_is_loaded_and_made_absolute(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def r(prompt, response):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(Config, None, ["task.reward_fn=my_rewards.py:r"])
    assert cfg.task.reward_fn == f"{tmp_path / 'my_rewards.py'}:r"
    fn = load_dotted(cfg.task.reward_fn)
    assert fn(None, "x") == 0.5 and load_dotted(cfg.task.reward_fn) is fn  # loaded once
    with pytest.raises(KeyError, match="no such file"):
        load_dotted(str(tmp_path / "missing.py") + ":r")
    with pytest.raises(KeyError, match="has no attribute"):
        load_dotted(cfg.task.reward_fn[:-1] + "nope")


def test_a_config_file_with_a_dataset_path_resolves_name_and_warm_start(tmp_path):
    data = tmp_path / "my_problems.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    cfg = hybridrl.make_config(None, {"data.train_files": str(data)})
    assert cfg.trainer.name == "my_problems_grpo" and cfg.sft.enabled is False
    assert hybridrl.make_config(None, {}).sft.enabled is True  # the built-in job keeps it
    assert hybridrl.make_config(None, {"trainer.name": "mine"}).trainer.name == "mine"
