"""Stop strings against a real multi-character tokenizer: inside a token, across tokens,
at a token's end, after short and long responses, in the native engine, the hf backend and
the shared check."""

import pytest
import torch
from chain_models import chain_model as chain_model_of
from chain_models import word_tokenizer

from hybridrl.config import RolloutConfig
from hybridrl.protocol import Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.stop import stop_hit

NATIVE = {"kv_cache_bytes": 4 << 20, "block_size": 4}  # the native engine: a small KV pool

torch.set_num_threads(1)
STOP = "</ans>"
FILLERS = {
    family: [f"{family}{i}" for i in range(13)] for family in "abc"
}  # a0 a1 ... a12: one chain per case
ENDS = {
    "a": ["x</ans>y"],
    "b": ["</", "ans>"],
    "c": ["z</ans>"],
}  # inside a token, across two, at a token's end
WORDS = (
    ["<pad>", "<bos>", "<eos>", "<unk>", "w"]
    + [t for e in ENDS.values() for t in e]
    + [t for f in FILLERS.values() for t in f]
)


def tokenizer():
    return word_tokenizer(WORDS)  # tokens concatenate: "a11" "x</ans>y" -> "a11x</ans>y"


def chain_model():
    """Greedy decoding walks a fixed chain: a0 -> a1 -> ... -> a12 -> the case's end tokens -> w
    -> w ..."""
    nxt = {"w": "w"}
    for family, fillers in FILLERS.items():
        path = fillers + ENDS[family] + ["w"]
        nxt.update({a: b for a, b in zip(path, path[1:])})
    return chain_model_of(WORDS, nxt), {t: i for i, t in enumerate(WORDS)}


CASES = [
    (family, start) for family in "abc" for start in (10, 0)
]  # 2 or 12 filler tokens before the stop


@pytest.mark.parametrize("backend", ["native", "hf"])
@pytest.mark.parametrize(
    "family,start", CASES, ids=[f"{f}-{'short' if s else 'long'}" for f, s in CASES]
)
def test_a_stop_string_ends_the_response_at_the_token_that_completes_it(backend, family, start):
    tok = tokenizer()
    m, ids = chain_model()
    eng = ROLLOUT_BACKENDS.get(backend)(
        m,
        tok,
        RolloutConfig(backend=backend, backend_options=NATIVE if backend == "native" else {}),
    )
    params = SamplingParams(temperature=0, max_new_tokens=24, stop=(STOP,))
    prompt = [ids["<bos>"], ids[FILLERS[family][start]]]
    s = eng.generate([Sample(prompt_ids=prompt, uid="u")], params)[0]
    want = (
        FILLERS[family][start + 1 :] + ENDS[family]
    )  # the completing token is kept, nothing after it
    assert [WORDS[t] for t in s.response_ids] == want
    assert s.status == "finished" and len(s.log_probs) == len(s.versions) == len(want)
    text = tok.decode(s.response_ids)
    assert STOP in text and STOP not in tok.decode(s.response_ids[:-1])


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_without_a_stop_string_the_chain_runs_to_max_tokens(backend):
    tok = tokenizer()
    m, ids = chain_model()
    eng = ROLLOUT_BACKENDS.get(backend)(
        m,
        tok,
        RolloutConfig(backend=backend, backend_options=NATIVE if backend == "native" else {}),
    )
    s = eng.generate(
        [Sample(prompt_ids=[ids["<bos>"], ids["a0"]], uid="r")],
        SamplingParams(temperature=0, max_new_tokens=20, stop=("</nope>",)),
    )[0]
    assert (
        s.status == "truncated"
        and len(s.response_ids) == 20
        and WORDS[s.response_ids[12]] == "x</ans>y"
    )


def test_the_check_looks_at_the_response_only_and_finds_each_occurrence_at_its_last_token():
    tok = tokenizer()
    ids = {t: i for i, t in enumerate(WORDS)}
    bos = ids["<bos>"]
    assert stop_hit(tok, [bos, ids["</"], ids["ans>"]], 1, [STOP])  # across two tokens
    assert not stop_hit(tok, [bos, ids["</"]], 1, [STOP])
    assert not stop_hit(tok, [ids["x</ans>y"], ids["w"]], 1, [STOP])  # in the prompt only
    long = [ids[f"a{i}"] for i in range(12)] + [ids["x</ans>y"]]
    assert stop_hit(tok, long, 0, [STOP, "zzz"]) and not stop_hit(tok, long, 0, ["zzz"])
