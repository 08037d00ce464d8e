"""Users' datasets as the prompt source (hybridrl/data): the file formats, chat-template rendering
with a local ChatML tokenizer, the epoch order and exact resume, the held-out set, the prompt
length limit, dotted answer keys, the one-line errors and steps_for_epochs."""

from __future__ import annotations

import json
import logging
import math
from collections import Counter
from pathlib import Path

import datasets
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from hybridrl.config import Config
from hybridrl.config.schema import DataConfig, ModelConfig, TaskConfig, TrainerConfig
from hybridrl.data import DataError, DatasetTask, steps_for_epochs
from hybridrl.models.loading import make_task
from hybridrl.protocol import prompt_sample
from hybridrl.tasks.arithmetic import ArithmeticTask

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def chatml_tokenizer(template: str | None = CHATML) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on a few sentences, with a ChatML template and eos <|im_end|>."""
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator(
        ["what is two plus three", "you are a helpful assistant", "system user assistant"] * 3,
        trainer,
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        chat_template=template,
    )


def model_dir(tmp_path: Path, tok) -> str:
    """A directory holding the tokenizer, as model.path would."""
    path = tmp_path / "model"
    tok.save_pretrained(path)
    return str(path)


def config(train, *, model_path=None, seed=0, heldout_size=1024, pps=4, **data) -> Config:
    return Config(
        model=ModelConfig(path=model_path),
        task=TaskConfig(heldout_size=heldout_size),
        data=DataConfig(train_files=train, **data),
        trainer=TrainerConfig(seed=seed, prompts_per_step=pps),
    )


def rows(n: int) -> list[dict]:
    """Arithmetic prompts the built-in character tokenizer can encode."""
    return [{"prompt": f"{i}+1=", "answer": i + 1, "level": i % 3} for i in range(n)]


def write(path: Path, records: list[dict]) -> str:
    """``records`` in the format ``path``'s suffix names (no suffix: a save_to_disk directory)."""
    table = datasets.Dataset.from_list(records)
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    elif path.suffix == ".parquet":
        table.to_parquet(str(path))
    elif path.suffix == ".csv":
        table.to_csv(str(path), index=False)
    else:
        table.save_to_disk(str(path))
    return str(path)


# --- formats ------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["d.jsonl", "d.json", "d.parquet", "d.csv", "saved"])
def test_every_format_gives_the_same_rows(tmp_path, name):
    task = DatasetTask(config(write(tmp_path / name, rows(20)), val_files=None, shuffle=False))
    assert task.num_rows == 18  # 2 of 20 held out (a tenth)
    held = {p.text for p in task.heldout()}
    trained = [task.prompt(i) for i in range(task.num_rows)]
    assert len(held) == 2 and held.isdisjoint(p.text for p in trained)
    assert sorted([p.text for p in trained] + list(held)) == sorted(r["prompt"] for r in rows(20))
    first = trained[0]
    i = int(first.text.split("+")[0])
    assert first.answer == str(i + 1) and first.columns == {"answer": i + 1, "level": i % 3}
    assert first.task_id == task.name == Path(name).stem and first.raw == first.text
    assert list(first.token_ids) == task.tokenizer()(first.text)["input_ids"]


def test_a_list_of_files_is_read_in_order(tmp_path):
    a = write(tmp_path / "a.jsonl", rows(3))
    b = write(tmp_path / "b.parquet", rows(6)[3:])
    val = write(tmp_path / "v.jsonl", rows(2))
    task = DatasetTask(config([a, b], val_files=val, shuffle=False))
    assert [task.prompt(i).text for i in range(6)] == [r["prompt"] for r in rows(6)]
    assert [p.uid for p in task.heldout()] == ["a-val-r0", "a-val-r1"]


# --- errors -------------------------------------------------------------------------------------
def one_line_error(make, *words):
    with pytest.raises(DataError) as e:
        make()
    msg = str(e.value)
    assert "\n" not in msg and all(w in msg for w in words), msg


def test_bad_paths_are_one_line_errors_naming_the_path_and_what_is_allowed(tmp_path):
    (tmp_path / "p.txt").write_text("x")
    (tmp_path / "plain").mkdir()
    one_line_error(lambda: DatasetTask(config(str(tmp_path / "no.jsonl"))), "no.jsonl", "exist")
    one_line_error(lambda: DatasetTask(config(str(tmp_path / "p.txt"))), "p.txt", ".parquet")
    one_line_error(lambda: DatasetTask(config(str(tmp_path / "plain"))), "plain", "save_to_disk")
    one_line_error(lambda: DatasetTask(config([])), "data.train_files", ".jsonl")
    good = write(tmp_path / "d.jsonl", rows(5))
    one_line_error(
        lambda: DatasetTask(config(good, val_files=str(tmp_path / "v.csv"))),
        "data.val_files",
        "v.csv",
    )


def test_unreadable_or_mismatched_files_are_one_line_errors(tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "answer": 2}\n{"prompt": \n')
    one_line_error(lambda: DatasetTask(config(str(broken))).prompt(0), "cannot read", "broken")
    a = write(tmp_path / "a.jsonl", rows(3))
    b = write(tmp_path / "b.jsonl", [{"prompt": "1+1=", "other": 1}])
    one_line_error(lambda: DatasetTask(config([a, b])).prompt(0), "b.jsonl", "no column 'answer'")
    c = write(tmp_path / "c.jsonl", [{"prompt": "2+2=", "answer": 4, "extra": "x"}])
    task = DatasetTask(config([a, c], shuffle=False))  # an extra column: null in the other file
    assert task.prompt(0).columns["extra"] is None and task.prompt(3).columns["extra"] == "x"


def test_missing_columns_are_one_line_errors_naming_the_columns(tmp_path):
    path = write(tmp_path / "d.jsonl", [{"question": "1+1=", "rm": {"gt": "2"}}] * 4)
    one_line_error(
        lambda: DatasetTask(config(path)).prompt(0), "'prompt'", "data.prompt_key", "question"
    )
    one_line_error(
        lambda: DatasetTask(config(path, prompt_key="question")).prompt(0),
        "'answer'",
        "data.answer_key",
        "['question', 'rm']",
    )
    one_line_error(
        lambda: DatasetTask(config(path, prompt_key="question", answer_key="rm.truth")).prompt(0),
        "'truth'",
        "'rm'",
        "gt",
    )
    bad = write(tmp_path / "n.jsonl", [{"prompt": 5, "answer": 1}] * 3)
    one_line_error(lambda: DatasetTask(config(bad)).prompt(0), "row 0", "string or a list")


def test_a_dotted_answer_key_reaches_into_a_dict_column(tmp_path):
    records = [
        {"q": f"{i}+2=", "reward_model": {"ground_truth": i + 2}, "data_source": "src"}
        for i in range(4)
    ]
    task = DatasetTask(
        config(
            write(tmp_path / "d.jsonl", records),
            val_files=write(tmp_path / "v.jsonl", records[:1]),
            prompt_key="q",
            answer_key="reward_model.ground_truth",
            shuffle=False,
        )
    )
    p = task.prompt(3)
    assert p.answer == "5" and p.task_id == "src"
    assert p.columns == {"reward_model": {"ground_truth": 5}, "data_source": "src"}
    none = DatasetTask(config(write(tmp_path / "e.jsonl", rows(3)), answer_key=None))
    assert none.prompt(0).answer == ""


def test_sft_example_is_an_error(tmp_path):
    task = DatasetTask(config(write(tmp_path / "d.jsonl", rows(3))))
    one_line_error(lambda: task.sft_example(0), "sft.enabled=false")


# --- chat templates -----------------------------------------------------------------------------
CHAT = [{"role": "user", "content": "what is two plus three"}]


def chat_task(tmp_path, records, tok=None, **data) -> DatasetTask:
    tmp_path.mkdir(exist_ok=True)
    path = write(tmp_path / "c.jsonl", records)
    return DatasetTask(
        config(path, model_path=model_dir(tmp_path, tok or chatml_tokenizer()), **data)
    )


def test_chat_messages_are_rendered_with_the_templates_own_token_ids(tmp_path):
    tok = chatml_tokenizer()
    task = chat_task(tmp_path, [{"prompt": CHAT, "answer": "5"}] * 3, tok, shuffle=False)
    p = task.prompt(0)
    want = tok.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(p.token_ids) == want
    assert p.text == tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert p.text.endswith("<|im_start|>assistant\n") and p.raw == CHAT
    assert prompt_sample(p, tok).prompt_ids == want  # not re-encoded


def test_the_system_prompt_goes_first_unless_the_messages_have_one(tmp_path):
    tok = chatml_tokenizer()
    own = [{"role": "system", "content": "own"}, *CHAT]
    task = chat_task(
        tmp_path,
        [{"prompt": CHAT, "answer": ""}, {"prompt": own, "answer": ""}],
        tok,
        system_prompt="you are a helpful assistant",
        shuffle=False,
    )
    first, second = task.prompt(0), task.prompt(1)
    assert first.text.startswith("<|im_start|>system\nyou are a helpful assistant<|im_end|>\n")
    assert first.text.count("system") == 1
    assert (
        second.text.startswith("<|im_start|>system\nown<|im_end|>") and "helpful" not in second.text
    )


@pytest.mark.parametrize("mode", [None, True, False])
def test_plain_strings_follow_apply_chat_template(tmp_path, mode):
    tok = chatml_tokenizer()
    task = chat_task(
        tmp_path,
        [{"prompt": "what is two plus three", "answer": "5"}] * 2,
        tok,
        apply_chat_template=mode,
        system_prompt="you are a helpful assistant",
    )
    p = task.prompt(0)
    if mode is True:
        msgs = [{"role": "system", "content": "you are a helpful assistant"}, *CHAT]
        assert p.text == tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert list(p.token_ids) == tok.apply_chat_template(
            msgs, add_generation_prompt=True, return_dict=False
        )
    else:
        assert p.text == "what is two plus three"
        assert list(p.token_ids) == tok(p.text)["input_ids"]


def test_chat_messages_without_a_template_are_an_error_naming_the_fix(tmp_path):
    records = [{"prompt": CHAT, "answer": ""}] * 2
    one_line_error(
        lambda: chat_task(tmp_path, records, chatml_tokenizer(template=None)).prompt(0),
        "no chat template",
        "data.apply_chat_template=false",
    )
    plain = chat_task(
        tmp_path / "f", records, chatml_tokenizer(template=None), apply_chat_template=False
    )
    assert plain.prompt(0).text == "what is two plus three"


def test_the_length_limit_counts_the_rendered_templates_tokens(tmp_path):
    tok = chatml_tokenizer()
    short, long = CHAT, [{"role": "user", "content": "you are a helpful assistant " * 4}]
    limit = len(tok.apply_chat_template(short, add_generation_prompt=True, return_dict=False))
    records = [{"prompt": long if i % 4 == 0 else short, "answer": ""} for i in range(12)]
    task = chat_task(tmp_path, records, tok, max_prompt_length=limit, val_files=None)
    assert task.dropped_long == 3 and task.num_rows + len(task.heldout()) == 9
    assert all(len(task.prompt(i).token_ids) == limit for i in range(task.num_rows))


# --- the order of the stream --------------------------------------------------------------------
def epoch_rows(task: DatasetTask, epoch: int) -> list[int]:
    n = task.num_rows
    return [int(task.prompt(epoch * n + i).uid.rsplit("-r", 1)[1]) for i in range(n)]


def test_each_epoch_is_its_own_seeded_permutation(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(40))
    task = DatasetTask(config(path, seed=7))
    e0, e1 = epoch_rows(task, 0), epoch_rows(task, 1)
    assert sorted(e0) == sorted(e1) == sorted(set(e0)) and len(e0) == task.num_rows == 36
    assert e0 != e1 and e0 != sorted(e0)
    again = DatasetTask(config(path, seed=7))
    assert epoch_rows(again, 1) == e1  # same seed, same order
    assert epoch_rows(DatasetTask(config(path, seed=8)), 0) != e0
    assert epoch_rows(DatasetTask(config(path, shuffle=False)), 3) == sorted(e0)
    uids = [task.prompt(i).uid for i in range(3 * task.num_rows)]
    assert len(set(uids)) == len(uids)


def test_a_prompt_is_a_pure_function_of_seed_and_index_across_epochs(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(25))
    run = DatasetTask(config(path, seed=3))
    n = run.num_rows
    stream = [run.prompt(i) for i in range(3 * n)]
    resumed = DatasetTask(config(path, seed=3))  # a new process resuming mid-epoch
    for i in [n + 5, n - 1, n, 2 * n + 1, 0]:
        assert resumed.prompt(i) == stream[i]


# --- the held-out set and the length limit ------------------------------------------------------
def test_the_heldout_split_is_fixed_small_and_never_trained_on(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(100))
    task = DatasetTask(config(path, seed=1, heldout_size=4))
    held = task.heldout()
    assert len(held) == 4 and all(p.uid.startswith("d-heldout-r") for p in held)
    assert DatasetTask(config(path, seed=9, heldout_size=4)).heldout() == held
    trained = {task.prompt(i).text for i in range(2 * task.num_rows)}
    assert task.num_rows == 96 and trained.isdisjoint(p.text for p in held)
    assert len(DatasetTask(config(path, heldout_size=50)).heldout()) == 10  # a tenth at most
    every = DatasetTask(config(path, heldout_size=4, holdout=False))  # switched off
    assert every.num_rows == 100 and every.heldout() == []


def test_no_heldout_prompts_give_null_figures_not_zero():
    from hybridrl.driver.evaluate import Evaluator
    from hybridrl.rollout import SamplingParams

    metrics, sampled, _ = Evaluator(None, [], None, SamplingParams(), seed=0).run()
    assert math.isnan(metrics["eval/accuracy"]) and sampled == []


def test_long_prompts_are_dropped_and_counted_or_an_error(tmp_path):
    records = [{"prompt": "1+1=" if i % 3 else "123456+1=", "answer": 2} for i in range(30)]
    path = write(tmp_path / "d.jsonl", records)
    task = DatasetTask(config(path, max_prompt_length=5))  # <bos> + 4 characters
    assert task.dropped_long == 10 and task.num_rows == 18
    assert all(len(task.prompt(i).token_ids) <= 5 for i in range(task.num_rows))
    one_line_error(
        lambda: DatasetTask(config(path, max_prompt_length=5, drop_long_prompts=False)).prompt(0),
        "row 0",
        "10 tokens",
        "data.max_prompt_length=5",
    )
    one_line_error(
        lambda: DatasetTask(config(path, max_prompt_length=2)).prompt(0), "no training rows left"
    )


# --- make_task and epochs -----------------------------------------------------------------------
def test_make_task_builds_a_dataset_task_only_for_data_files(tmp_path):
    path = write(tmp_path / "d.jsonl", rows(30))
    task = make_task(config(path))
    assert isinstance(task, DatasetTask) and task.tokenizer()("1+1=")["input_ids"][0] == 1
    assert isinstance(make_task(Config()), ArithmeticTask)


def test_steps_for_epochs_covers_the_passes(tmp_path):
    task = DatasetTask(config(write(tmp_path / "d.jsonl", rows(50)), val_files=None))
    assert task.num_rows == 45
    assert steps_for_epochs(config("x.jsonl", pps=4), task) is None
    assert steps_for_epochs(config("x.jsonl", pps=4, epochs=1), task) == 12  # ceil(45 / 4)
    assert steps_for_epochs(config("x.jsonl", pps=5, epochs=3), task) == 27
    cfg = config("x.jsonl", pps=4, epochs=2)
    steps = steps_for_epochs(cfg, task)
    seen = Counter(task.prompt(i).uid.split("-r")[1] for i in range(steps * 4))
    assert len(seen) == 45 and min(seen.values()) >= 2


# --- every row checked when the data is read ----------------------------------------------------
def write_lines(path: Path, records: list) -> str:
    """``records`` as JSON lines, as they are (a column may mix types, which datasets reads)."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_rows_that_are_not_prompts_are_dropped_counted_and_named(tmp_path, caplog):
    records = rows(80)
    records[50]["prompt"], records[60]["prompt"] = None, 5
    records[70]["prompt"] = {"text": "1+1="}
    path = write_lines(tmp_path / "d.jsonl", records)
    with caplog.at_level(logging.INFO, logger="hybridrl.data"):
        task = DatasetTask(config(path, shuffle=False))
        assert task.dropped == {"not_a_prompt": 3} and task.num_rows + len(task.heldout()) == 77
    for i in range(2 * task.num_rows):  # no draw meets a bad row
        assert task.prompt(i).text.endswith("+1=")
    said = warnings_of(caplog)
    for row, what in [(50, "None"), (60, "int"), (70, "dict")]:
        assert any(f"'{path}' row {row}" in m and what in m for m in said), said
    assert any("3 of 80 rows dropped" in m and "3 not a prompt" in m for m in said), said
    assert task.data_metrics()["data/dropped_not_a_prompt"] == 3
    assert task.data_metrics()["data/train_rows"] == task.num_rows


def test_dropped_rows_are_named_by_their_file_and_the_warning_is_bounded(tmp_path, caplog):
    a = write_lines(tmp_path / "a.jsonl", rows(5))
    bad = [{"prompt": None, "answer": 1, "level": 0}] * 40 + rows(10)
    b = write_lines(tmp_path / "b.jsonl", bad)
    val = write_lines(tmp_path / "v.jsonl", [*rows(3), {"prompt": 7, "answer": 1, "level": 0}])
    with caplog.at_level(logging.INFO, logger="hybridrl.data"):
        task = DatasetTask(config([a, b], val_files=val))
        assert task.num_rows == 15 and len(task.heldout()) == 3
    said = warnings_of(caplog)
    assert len(said) <= 12, said  # a few rows named per key, then one count per key
    assert any(f"data.train_files '{b}' row 0:" in m for m in said), said
    assert any(f"data.val_files '{val}' row 3:" in m for m in said), said
    assert any("40 of 55 rows dropped" in m for m in said), said
    assert task.dropped == {"not_a_prompt": 41}


def test_a_missing_answer_in_a_row_drops_that_row(tmp_path):
    records = [{"q": f"{i}+2=", "rm": {"gt": i + 2}} for i in range(12)]
    records[5]["rm"] = None
    task = DatasetTask(
        config(write_lines(tmp_path / "d.jsonl", records), prompt_key="q", answer_key="rm.gt")
    )
    assert task.dropped == {"no_answer": 1}
    assert all(task.prompt(i).answer for i in range(2 * task.num_rows))


def test_a_file_that_is_not_utf8_is_refused_naming_its_line(tmp_path):
    lines = [json.dumps(r).encode() for r in rows(40)]
    lines[30] = b'{"prompt": "1+1=", "answer": "caf\xe9", "level": 0}'  # Latin-1
    for name, text in [
        ("d.jsonl", b"\n".join(lines) + b"\n"),
        ("d.csv", b"prompt,answer\n" + b"1+1=,2\n" * 29 + b"1+1=,caf\xe9\n" + b"1+1=,2\n" * 5),
    ]:
        (tmp_path / name).write_bytes(text)
        one_line_error(
            lambda name=name: DatasetTask(config(str(tmp_path / name))).num_rows,
            f"'{tmp_path / name}' line 31",
            "not valid UTF-8",
            "0xe9",
        )


def test_a_table_holding_text_that_is_not_utf8_is_refused_naming_its_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"{i}+1=".encode() for i in range(20)]
    texts[7] = b"7+\xe9="
    prompts = pa.array(texts, pa.binary()).view(pa.string())  # unchecked bytes, as some writers do
    pq.write_table(pa.table({"prompt": prompts, "answer": list(range(20))}), tmp_path / "d.parquet")
    one_line_error(
        lambda: DatasetTask(config(str(tmp_path / "d.parquet"))).num_rows,
        f"'{tmp_path / 'd.parquet'}' row 7",
        "not valid UTF-8",
        "'prompt'",
    )


def test_a_prompt_too_long_for_the_model_is_dropped_without_max_prompt_length(tmp_path, caplog):
    records = rows(30)
    records[7]["prompt"] = "1" * 100_000
    path = write_lines(tmp_path / "d.jsonl", records)
    with caplog.at_level(logging.INFO, logger="hybridrl.data"):
        task = DatasetTask(config(path))
        assert task.dropped == {"long": 1} and task.num_rows + len(task.heldout()) == 29
    said = warnings_of(caplog)
    assert any("row 7" in m and "100001 tokens" in m for m in said), said
    assert any("512 positions" in m and "rollout.max_new_tokens" in m for m in said), said
    one_line_error(
        lambda: DatasetTask(config(path, drop_long_prompts=False)).num_rows,
        "row 7",
        "100001 tokens",
        "512 positions",
    )


def test_a_prompt_of_no_tokens_is_dropped(tmp_path, caplog):
    records = [{"prompt": "what is two plus three", "answer": "5"} for _ in range(12)]
    records[4]["prompt"] = ""
    with caplog.at_level(logging.INFO, logger="hybridrl.data"):
        task = chat_task(tmp_path, records, chatml_tokenizer(), shuffle=False)  # no <bos>
        assert task.dropped == {"empty": 1}
    assert all(task.prompt(i).token_ids for i in range(2 * task.num_rows))
    assert any("row 4" in m and "no tokens" in m for m in warnings_of(caplog))


def saved_char_tokenizer(tmp_path: Path) -> str:
    """The built-in character tokenizer saved next to a Qwen2 config, as a checkpoint holds it:
    reloaded it is Qwen2's tokenizer class, which drops the characters it lacks."""
    from hybridrl.tasks.tokenizer import build_char_tokenizer

    path = tmp_path / "model"
    build_char_tokenizer().save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return str(path)


def test_characters_the_tokenizer_cannot_encode_are_refused(tmp_path):
    from transformers import AutoTokenizer

    model = saved_char_tokenizer(tmp_path)
    dropped = AutoTokenizer.from_pretrained(model)("sum 12+34=")["input_ids"]
    assert dropped == [1, 4, 5, 13, 6, 7, 15]  # <bos>12+34=: the tokenizer loses "sum "
    records = rows(20)
    records[3]["prompt"] = "sum 12+34="
    path = write_lines(tmp_path / "d.jsonl", records)
    for model_path in (model, None):  # saved, and the built-in one in process
        one_line_error(
            lambda model_path=model_path: DatasetTask(config(path, model_path=model_path)).num_rows,
            f"'{path}' row 3",
            "cannot encode",
            "'s'",
            "'u'",
            "'m'",
        )
    ok = DatasetTask(config(write_lines(tmp_path / "ok.jsonl", rows(20)), model_path=model))
    assert ok.num_rows == 18
    invisible = rows(20)
    invisible[2]["prompt"] = "2\u200b+1="  # a zero-width space the tokenizer removes: not lost
    path = write_lines(tmp_path / "zw.jsonl", invisible)
    assert DatasetTask(config(path, model_path=model)).num_rows == 18


# --- the data's fingerprint, compared on resume -------------------------------------------------
def test_the_fingerprint_is_of_the_bytes_and_a_change_is_refused_unless_forced(tmp_path, caplog):
    from hybridrl.data.fingerprint import check_unchanged, data_fingerprint

    a, val = write_lines(tmp_path / "a.jsonl", rows(6)), write_lines(tmp_path / "v.jsonl", rows(2))
    saved_dir = write(tmp_path / "saved", rows(4))
    cfg = config([a, saved_dir], val_files=val)
    before = data_fingerprint(cfg)
    assert len(before["data.train_files"]) == 2 and len(before["data.val_files"]) == 1
    moved = tmp_path / "elsewhere"
    moved.mkdir()
    copy = write_lines(moved / "a.jsonl", rows(6))
    assert data_fingerprint(config([copy, saved_dir], val_files=val)) == before
    check_unchanged(before, before, cfg, Path("ckpt"), force=False)

    write_lines(tmp_path / "a.jsonl", rows(6)[::-1])  # the same rows, another order
    after = data_fingerprint(cfg)
    one_line_error(
        lambda: check_unchanged(before, after, cfg, tmp_path / "step_000004", force=False),
        f"data.train_files '{a}' changed",
        "step_000004",
        "--resume-changed-data",
    )
    with caplog.at_level(logging.WARNING, logger="hybridrl.data"):
        check_unchanged(before, after, cfg, tmp_path / "step_000004", force=True)
    assert any(f"'{a}' changed" in m for m in warnings_of(caplog))
    fewer = data_fingerprint(config([a], val_files=val))
    one_line_error(
        lambda: check_unchanged(before, fewer, cfg, Path("c"), force=False),
        "data.train_files names 1 file(s) where the run read 2",
    )
    check_unchanged(None, after, cfg, Path("c"), force=False)  # a checkpoint that records none
