"""check_data: a dataset's problems found before a run starts, from each file's first row (every
format), as the same one-line errors the full read gives."""

from __future__ import annotations

import pytest
from test_data import CHAT, chatml_tokenizer, config, model_dir, rows, saved_char_tokenizer, write

from hybridrl.data import DataError, DatasetTask, check_data


@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "d.csv", "saved"])
def test_good_data_passes_in_every_format(tmp_path, name):
    check_data(
        config(write(tmp_path / name, rows(5)), val_files=write(tmp_path / "v.jsonl", rows(2)))
    )


@pytest.mark.parametrize("name", ["d.jsonl", "d.parquet", "saved"])
def test_a_missing_column_is_found_from_the_first_row(tmp_path, name):
    path = write(tmp_path / name, [{"question": "1+1=", "rm": {"gt": "2"}}] * 3)
    with pytest.raises(DataError, match=r"no column 'prompt' \(data.prompt_key\).*question"):
        check_data(config(path))
    with pytest.raises(DataError, match=r"'rm' has no field 'truth'.*\['gt'\]"):
        check_data(config(path, prompt_key="question", answer_key="rm.truth"))
    check_data(config(path, prompt_key="question", answer_key="rm.gt"))


def test_chat_without_a_template_and_bad_paths_fail_before_any_read(tmp_path):
    chat = write(tmp_path / "c.jsonl", [{"prompt": CHAT, "answer": "5"}] * 2)
    no_template = model_dir(tmp_path, chatml_tokenizer(template=None))
    with pytest.raises(DataError, match="data.apply_chat_template=false"):
        check_data(config(chat, model_path=no_template))
    check_data(config(chat, model_path=no_template, apply_chat_template=False))
    with pytest.raises(DataError, match="val.jsonl' does not exist"):
        check_data(config(chat, val_files=str(tmp_path / "val.jsonl")))


def test_a_first_row_that_is_not_a_prompt_is_left_to_the_read_which_drops_it(tmp_path):
    """As any row: dropped and counted when the data is read; a file of nothing else is refused
    then, naming the row."""
    bad = write(tmp_path / "b.jsonl", [{"prompt": ["not", "messages"], "answer": 1}])
    check_data(config(bad))
    with pytest.raises(DataError, match="no training rows left.*b.jsonl' row 0.*string or a list"):
        DatasetTask(config(bad)).rows()
    check_data(config(write(tmp_path / "n.jsonl", [{"prompt": None, "answer": 1}, *rows(3)])))


def test_characters_the_tokenizer_loses_in_the_first_row_are_refused_before_the_run(tmp_path):
    records = [{"prompt": "sum 12+34=", "answer": 46}, *rows(3)]
    path = write(tmp_path / "d.jsonl", records)
    with pytest.raises(DataError, match=r"d.jsonl' row 0: the tokenizer cannot encode .*'s'"):
        check_data(config(path, model_path=saved_char_tokenizer(tmp_path)))


def test_no_data_files_is_nothing_to_check():
    from hybridrl.config import Config

    check_data(Config())


def test_a_multi_turn_prompt_that_cannot_fit_the_context_is_refused(tmp_path):
    """With env.name=tools and describe_tools, the tool schemas join the prompt before the first
    turn: prompt + schemas + rollout.max_new_tokens above the model's 512 positions is refused,
    in one line, before any work (the run would end every trajectory empty)."""
    from hybridrl.config.schema import EnvConfig
    from hybridrl.models.chat_model import build_chat_model

    model = build_chat_model(tmp_path / "model", ["what is two plus three"], vocab_size=300)
    chat = write(tmp_path / "c.jsonl", [{"prompt": CHAT, "answer": "5"}] * 2)

    def with_tools(describe: bool, max_new_tokens: int):
        cfg = config(chat, model_path=str(model))
        cfg.env = EnvConfig(name="tools", kwargs={"describe_tools": describe})
        cfg.rollout.max_new_tokens = max_new_tokens
        return cfg

    from hybridrl.checks import check_dataset

    with pytest.raises(DataError) as e:
        check_dataset(with_tools(True, 64))
    msg = str(e.value)
    assert "\n" not in msg and "above the model's 512" in msg and "describe_tools" in msg, msg
    check_dataset(with_tools(False, 64))  # the prompt alone fits
    with pytest.raises(DataError, match="rollout.max_new_tokens=500"):
        check_dataset(with_tools(False, 500))
