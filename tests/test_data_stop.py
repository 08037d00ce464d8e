"""Stopping for chat models: every eos id of the model's generation_config ends a response in the
native engine and the hf backend (a ChatML model ends a turn with <|im_end|>, the tokenizer's eos,
and a text with <|endoftext|>), and data.stop strings reach the sampling parameters."""

from __future__ import annotations

import pytest
import torch
from chain_models import chain_model as chain_model_of
from chain_models import word_tokenizer
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from hybridrl.config import Config, RolloutConfig
from hybridrl.config.schema import DataConfig
from hybridrl.protocol import Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.stop import eos_token_ids

NATIVE = {"kv_cache_bytes": 4 << 20, "block_size": 4}  # the native engine: a small KV pool

torch.set_num_threads(1)
WORDS = ["<pad>", "<bos>", "<|im_end|>", "<|endoftext|>", "<unk>", "a", "b", "c", "w"]
IDS = {t: i for i, t in enumerate(WORDS)}
CHAIN = ["a", "b", "c", "<|endoftext|>", "w"]  # greedy decoding walks it, then w -> w forever


def tokenizer() -> PreTrainedTokenizerFast:
    return word_tokenizer(WORDS, eos="<|im_end|>")


def chain_model(eos) -> Qwen2ForCausalLM:
    """Greedy decoding walks CHAIN; ``eos``: its generation_config's eos_token_id."""
    m = chain_model_of(WORDS, dict(zip(CHAIN, CHAIN[1:] + ["w"])), hidden=32)
    m.generation_config.eos_token_id = eos
    return m


def generate(backend: str, eos, params: SamplingParams) -> Sample:
    tok = tokenizer()
    engine = ROLLOUT_BACKENDS.get(backend)(
        chain_model(eos),
        tok,
        RolloutConfig(backend=backend, backend_options=NATIVE if backend == "native" else {}),
    )
    return engine.generate([Sample(prompt_ids=[IDS["<bos>"], IDS["a"]], uid="u")], params)[0]


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_every_eos_id_of_the_generation_config_ends_a_response(backend):
    greedy = SamplingParams(temperature=0, max_new_tokens=8)
    both = generate(backend, [IDS["<|im_end|>"], IDS["<|endoftext|>"]], greedy)
    assert [WORDS[t] for t in both.response_ids] == ["b", "c", "<|endoftext|>"]
    assert both.status == "finished" and len(both.log_probs) == 3
    only = generate(backend, IDS["<|im_end|>"], greedy)  # the tokenizer's eos alone: runs on
    assert only.status == "truncated" and len(only.response_ids) == 8


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_data_stop_strings_reach_the_sampling_and_end_a_response(backend):
    cfg = Config(data=DataConfig(stop=["c"]))
    params = SamplingParams.of(cfg, temperature=0.0)
    assert params.stop == ("c",) and params.max_new_tokens == cfg.rollout.max_new_tokens
    s = generate(backend, IDS["<|im_end|>"], params)
    assert [WORDS[t] for t in s.response_ids] == ["b", "c"] and s.status == "finished"
    assert SamplingParams.of(cfg.rollout).stop == ()  # a RolloutConfig alone: no data.stop


def test_eos_ids_are_the_tokenizers_then_the_models_once_each():
    tok = tokenizer()
    im_end, text_end = IDS["<|im_end|>"], IDS["<|endoftext|>"]
    assert eos_token_ids(chain_model([text_end, im_end]), tok) == (im_end, text_end)
    assert eos_token_ids(chain_model(text_end), tok) == (im_end, text_end)
    assert eos_token_ids(chain_model(None), tok) == (im_end,)
