"""Tasks, the W1 character tokenizer and reward functions."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from hybridrl.tasks import (
    REWARDS,
    TASKS,
    Prompt,
    Task,
    build_char_tokenizer,
    compute_reward,
    encode_text,
)
from hybridrl.tasks.arithmetic import ArithmeticTask, exact_match
from hybridrl.tasks.tokenizer import W1_CHARS, W1_VOCAB_SIZE

TOK = build_char_tokenizer()
W1_IDS = {
    "<pad>": 0,
    "<bos>": 1,
    "<eos>": 2,
    **{str(d): 3 + d for d in range(10)},
    "+": 13,
    "-": 14,
    "=": 15,
    " ": 16,
}


# --- tokenizer ----------------------------------------------------------------
def test_w1_vocabulary_exact():
    assert TOK.get_vocab() == W1_IDS
    assert len(TOK) == W1_VOCAB_SIZE == 17
    assert (TOK.pad_token_id, TOK.bos_token_id, TOK.eos_token_id) == (0, 1, 2)
    assert (TOK.pad_token, TOK.bos_token, TOK.eos_token) == ("<pad>", "<bos>", "<eos>")


def test_encode_one_id_per_char_and_bos():
    assert TOK("12+345=", add_special_tokens=False)["input_ids"] == [4, 5, 13, 6, 7, 8, 15]
    assert TOK("1 -0", add_special_tokens=False)["input_ids"] == [4, 16, 14, 3]
    assert TOK("12+345=")["input_ids"] == [
        1,
        4,
        5,
        13,
        6,
        7,
        8,
        15,
    ]  # special tokens on: <bos> prepended
    assert TOK("", add_special_tokens=False)["input_ids"] == []


def test_decode_exact_and_skip_special():
    ids = [1, 4, 16, 16, 5, 13, 2, 0, 0]
    assert TOK.decode(ids, skip_special_tokens=True) == "1  2+"
    assert TOK.decode(ids) == "<bos>1  2+<eos><pad><pad>"
    assert TOK.batch_decode([[3, 16, 3], [16]], skip_special_tokens=True) == ["0 0", " "]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=W1_CHARS, max_size=40))
def test_roundtrip_random_strings(text):
    ids = TOK(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert ids == encode_text(TOK, text)
    assert TOK.decode(ids, skip_special_tokens=True) == text
    assert (
        TOK.decode(encode_text(TOK, text, add_bos=True, add_eos=True), skip_special_tokens=True)
        == text
    )


def test_encode_text_helper_and_unknown_chars():
    assert encode_text(TOK, "1+2=", add_bos=True, add_eos=True) == [1, 4, 13, 5, 15, 2]
    with pytest.raises(ValueError, match=r"\['a', 'x'\]"):
        encode_text(TOK, "1a+x")
    with pytest.raises(ValueError):
        encode_text(TOK, "<eos>")  # special tokens are not plain text
    # the raw tokenizer has no unk token either (the tokenizers library raises a bare Exception)
    with pytest.raises(Exception, match=r"Missing \[UNK\] token"):
        TOK("1a", add_special_tokens=False)


def test_padding_uses_pad_id():
    out = TOK(["1", "123"], add_special_tokens=False, padding=True)
    assert out["input_ids"] == [[4, 0, 0], [4, 5, 6]]
    assert out["attention_mask"] == [[1, 0, 0], [1, 1, 1]]


def test_save_and_autotokenizer_roundtrip(tmp_path):
    tok = build_char_tokenizer(extra_chars="r:")
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    text = "r: 12 + 3=15"
    ids = loaded(text)["input_ids"]
    assert ids == tok(text)["input_ids"] and ids[0] == 1 and len(ids) == len(text) + 1
    assert loaded.decode(ids + [2], skip_special_tokens=True) == text


def test_tokenizer_saved_next_to_a_model_reloads_with_the_same_vocabulary(tmp_path):
    from hybridrl.models.factory import build_model, load_model_and_tokenizer

    tok = build_char_tokenizer()
    build_model("tiny", tok, 0).save_pretrained(
        tmp_path
    )  # config.json of a Qwen2 model beside the tokenizer
    tok.save_pretrained(tmp_path)
    model, loaded = load_model_and_tokenizer(str(tmp_path), "tiny", 0, None)
    assert len(loaded) == len(tok) == model.config.vocab_size and loaded.unk_token is None
    assert loaded("12+3=")["input_ids"] == tok("12+3=")["input_ids"]


def test_extra_chars():
    tok = build_char_tokenizer(extra_chars="r:")
    assert len(tok) == 19
    assert tok.get_vocab() == {**W1_IDS, "r": 17, ":": 18}
    assert tok("r:9", add_special_tokens=False)["input_ids"] == [17, 18, 12]
    assert tok.decode([17, 18, 2], skip_special_tokens=True) == "r:"
    nl = build_char_tokenizer(extra_chars="\n")
    assert nl("1\n2", add_special_tokens=False)["input_ids"] == [4, 17, 5]
    with pytest.raises(ValueError, match="repeats"):
        build_char_tokenizer(extra_chars="1")
    with pytest.raises(ValueError, match="repeats"):
        build_char_tokenizer(extra_chars="rr")


# --- arithmetic task -------------------------------------------------------------
def test_prompt_stream_deterministic_and_seed_dependent():
    t0, t0b, t1 = ArithmeticTask(seed=0), ArithmeticTask(seed=0), ArithmeticTask(seed=1)
    s0 = [t0.prompt(i) for i in range(200)]
    assert s0 == [t0b.prompt(i) for i in range(200)]
    assert [t0.prompt(i) for i in reversed(range(200))] == s0[
        ::-1
    ]  # random access: resume mid-stream
    assert [p.text for p in s0] != [t1.prompt(i).text for i in range(200)]
    assert len({p.uid for p in s0}) == 200
    assert s0[123].uid == "arith-000123"
    assert len({p.text for p in s0}) > 190  # not a constant stream


def test_prompt_format_and_range():
    task = ArithmeticTask(seed=3)
    seen = set()
    for i in range(2000):
        p = task.prompt(i)
        assert p.task_id == "arith"
        lhs, rhs = p.text.split("+")
        assert rhs.endswith("=")
        a, b = int(lhs), int(rhs[:-1])
        assert 0 <= a <= 999 and 0 <= b <= 999
        assert p.text == f"{a}+{b}=" and p.answer == str(a + b)
        encode_text(task.tokenizer(), p.text + p.answer)
        seen.update((a, b))
    assert min(seen) < 20 and max(seen) > 980  # covers the range
    small = ArithmeticTask(seed=0, max_operand=3)
    ops = {int(x) for i in range(300) for x in small.prompt(i).text[:-1].split("+")}
    assert ops == {0, 1, 2, 3}


def test_heldout_fixed():
    h = ArithmeticTask(seed=0).heldout()
    assert len(h) == 1024
    assert h == ArithmeticTask(seed=7).heldout()  # independent of the training seed
    assert len({p.uid for p in h}) == 1024
    assert all(p.answer == str(sum(int(x) for x in p.text[:-1].split("+"))) for p in h)
    assert h != ArithmeticTask(heldout_seed=1).heldout()
    assert len(ArithmeticTask(heldout_size=10).heldout()) == 10
    assert ArithmeticTask(heldout_size=10).heldout() == h[:10]
    # the returned list is a copy: mutating it does not change the task's set
    task = ArithmeticTask()
    task.heldout().clear()
    assert len(task.heldout()) == 1024


def test_sft_examples():
    task = ArithmeticTask(seed=0)
    ex = [task.sft_example(i) for i in range(100)]
    assert ex == [ArithmeticTask(seed=0).sft_example(i) for i in range(100)]
    for text, completion in ex:
        a, b = (int(x) for x in text[:-1].split("+"))
        assert text.endswith("=") and completion == str(a + b)
    assert len(set(ex)) > 90


def test_invalid_arguments():
    with pytest.raises(ValueError):
        ArithmeticTask(max_operand=-1)
    with pytest.raises(IndexError):
        ArithmeticTask().prompt(-1)


def test_task_is_abstract():
    with pytest.raises(TypeError):
        Task()
    assert isinstance(ArithmeticTask(), Task)


# --- rewards -----------------------------------------------------------------------
P = Prompt(uid="arith-000000", text="12+345=", answer="357", task_id="arith")


@pytest.mark.parametrize(
    "response,expected",
    [
        ("357", 1.0),
        ("358", 0.0),
        ("", 0.0),
        ("0357", 0.0),
        ("357+1", 0.0),
        ("3570", 0.0),
        ("35", 0.0),
        (" 357", 0.0),
        ("357 ", 0.0),
        ("-357", 0.0),
        ("+-=", 0.0),
        ("3 5 7", 0.0),
    ],
)
def test_exact_match_cases(response, expected):
    assert exact_match(P, response) == expected


def test_exact_match_unfinished_and_zero():
    assert exact_match(P, "357", finished=False) == 0.0
    zero = Prompt(uid="z", text="0+0=", answer="0", task_id="arith")
    assert (
        exact_match(zero, "0") == 1.0
        and exact_match(zero, "00") == 0.0
        and exact_match(zero, "") == 0.0
    )


def test_registry_lookup():
    assert TASKS.get("arith") is ArithmeticTask
    assert REWARDS.get("exact_match") is exact_match
    assert REWARDS.get("hybridrl.tasks.arithmetic:exact_match") is exact_match
    assert TASKS.get("hybridrl.tasks.arithmetic:ArithmeticTask") is ArithmeticTask
    assert "arith" in TASKS.names() and "exact_match" in REWARDS.names()
    task = TASKS.get("arith")(seed=5, max_operand=9)
    assert task.prompt(0) == ArithmeticTask(seed=5, max_operand=9).prompt(0)
    assert REWARDS.get(task.default_reward) is exact_match
    with pytest.raises(KeyError, match="exact_match"):
        REWARDS.get("exact_mach")


def test_compute_reward_float_and_dict():
    assert compute_reward(exact_match, P, "357") == (1.0, {})
    assert compute_reward(exact_match, P, "357", finished=False) == (0.0, {})

    def two_args(prompt, response):  # no `finished`: called without it
        return 1

    assert compute_reward(two_args, P, "x", finished=False) == (1.0, {})

    def with_kwargs(prompt, response, **kw):
        return {"score": 0.5, "finished": kw["finished"], "length": len(response)}

    score, extras = compute_reward(with_kwargs, P, "abcd", finished=False)
    assert score == 0.5 and isinstance(score, float) and extras == {"finished": False, "length": 4}

    assert compute_reward(lambda p, r: np.float32(0.25), P, "")[0] == 0.25
    assert compute_reward(lambda p, r: torch.tensor(2.0), P, "")[0] == 2.0
    assert compute_reward(lambda p, r: {"score": True}, P, "") == (1.0, {})


def test_compute_reward_errors():
    with pytest.raises(ValueError, match="score"):
        compute_reward(lambda p, r: {"acc": 1.0}, P, "")
    with pytest.raises(TypeError):
        compute_reward(lambda p, r: "1.0", P, "")
    with pytest.raises(TypeError):
        compute_reward(lambda p, r: None, P, "")
    with pytest.raises(ValueError, match="NaN"):
        compute_reward(lambda p, r: float("nan"), P, "")

    def boom(p, r):
        raise RuntimeError("reward crashed")

    with pytest.raises(RuntimeError, match="reward crashed"):  # not swallowed
        compute_reward(boom, P, "")
