"""A small chat model made locally in seconds: a byte-level BPE tokenizer trained with
``tokenizers`` on the user's text, a ChatML chat template, and a randomly initialised Qwen2 of a
built-in size. It stands in for a downloaded chat checkpoint in the examples and tests (nothing
comes from a model hub), and it is saved as an ordinary transformers directory, so everything that
loads it (``model.path``, ``AutoModelForCausalLM``, ``apply_chat_template``) is the real path.

Special tokens: ``<|endoftext|>`` (padding, end of text), ``<|im_start|>`` and ``<|im_end|>`` (the
end of every chat turn). ``generation_config.eos_token_id`` lists both ``<|im_end|>`` and
``<|endoftext|>``, as chat checkpoints do, so generation stops on either.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from hybridrl.models.factory import SIZES

END_OF_TEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
# ChatML: each message is "<|im_start|>{role}\n{content}<|im_end|>\n"; with add_generation_prompt
# the prompt ends with "<|im_start|>assistant\n", where the model's answer begins
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build_chat_tokenizer(texts: Iterable[str], vocab_size: int = 1024) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer trained on ``texts`` (any character can be encoded: unseen ones
    fall back to bytes), with the ChatML template and special tokens."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=END_OF_TEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHATML_TEMPLATE,
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def build_chat_model(
    out_dir: str | Path,
    texts: Iterable[str],
    size: str = "tiny",
    seed: int = 0,
    vocab_size: int = 1024,
) -> Path:
    """Train the tokenizer on ``texts``, initialise a Qwen2 of built-in ``size`` from ``seed`` and
    save both (safetensors) with a generation config to ``out_dir``; returns its path."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r} (built-in: {', '.join(SIZES)})")
    tokenizer = build_chat_tokenizer(texts, vocab_size)
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (IM_END, END_OF_TEXT)]
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        rope_theta=1e4,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        eos_token_id=eos_ids,
        **SIZES[size],
    )
    rng = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    torch.random.set_rng_state(rng)  # the caller's RNG stream is not disturbed
    model.generation_config = GenerationConfig(
        eos_token_id=eos_ids, pad_token_id=tokenizer.pad_token_id
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
