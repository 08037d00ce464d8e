"""Tiny models whose greedy decoding walks a fixed chain of words, and their word-level tokenizers:
deterministic engines' inputs for stopping tests (stop strings, eos ids)."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM


def word_tokenizer(words: list[str], eos: str = "<eos>") -> PreTrainedTokenizerFast:
    """One token per word of ``words`` (ids in order), split on whitespace; decoding concatenates
    the tokens with nothing between them."""
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, eos_token=eos, pad_token="<pad>", bos_token="<bos>", unk_token="<unk>"
    )


def chain_model(words: list[str], nxt: dict[str, str], hidden: int = 64) -> Qwen2ForCausalLM:
    """A one-layer Qwen2 whose attention and MLP outputs are zero, so its logits depend on the
    current token only: greedy decoding goes from word ``a`` to ``nxt[a]``."""
    ids = {t: i for i, t in enumerate(words)}
    cfg = Qwen2Config(
        vocab_size=len(words),
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=32,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    m = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
        m.model.embed_tokens.weight.copy_(torch.eye(len(words), hidden))
        m.lm_head.weight.zero_()
        for a, b in nxt.items():
            m.lm_head.weight[ids[b], ids[a]] = 10.0
    return m
