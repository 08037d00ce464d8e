"""Build or load the policy model and its tokenizer.

Built-in sizes are W1's Qwen2 configs (docs/workloads.md), randomly initialised
from a seed (no download); ``model.path`` loads any local transformers
causal-LM checkpoint together with its tokenizer.

``tiny_moe`` is a mixture-of-experts sibling of ``tiny`` (Qwen3-MoE: 8 experts, top-2, every
layer sparse) whose *active* parameters per token match ``tiny``'s: two experts of width 256 hold
as many MLP weights as tiny's one MLP of width 512. It exists so that MoE training (routing replay,
balancing, ``docs/moe.md``) runs on a laptop CPU like the dense default.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.utils import logging as hf_logging

from hybridrl.config.sections.model import BUILTIN_MAX_POSITIONS

log = logging.getLogger(__name__)

SIZES = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
    "small": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=1408,
    ),
}

# mixture-of-experts built-ins: (transformers config class, model class, shape)
MOE_SIZES = {
    "tiny_moe": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        # tiny's dense width, used by no layer (every layer is sparse) but kept for tools that
        # read it
        intermediate_size=512,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        # the balancing losses are ours (hybridrl/moe/balance.py), computed on the routing that
        # was dispatched; transformers' own would recompute a fresh top-k
        output_router_logits=False,
        router_aux_loss_coef=0.0,
    ),
}
BUILDERS = {name: (Qwen2Config, Qwen2ForCausalLM) for name in SIZES} | {
    name: (Qwen3MoeConfig, Qwen3MoeForCausalLM) for name in MOE_SIZES
}


def builtin_names() -> list[str]:
    """Every built-in model name (dense and mixture-of-experts)."""
    return list(BUILDERS)


def model_size_config(name: str, tokenizer):
    """The transformers config of built-in ``name`` for ``tokenizer``'s vocabulary."""
    if name not in BUILDERS:
        raise ValueError(f"unknown model size {name!r} (built-in: {', '.join(BUILDERS)})")
    config_cls, _ = BUILDERS[name]
    return config_cls(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        rope_theta=1e4,
        max_position_embeddings=BUILTIN_MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        torch_dtype="float32",
        **(SIZES | MOE_SIZES)[name],
    )


def build_model(name: str, tokenizer, seed: int) -> PreTrainedModel:
    """A randomly initialised built-in model; the same seed gives the same weights in any
    process."""
    config = model_size_config(name, tokenizer)  # an unknown name raises here
    devnull_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = BUILDERS[name][1](config)
    torch.random.set_rng_state(devnull_state)  # do not disturb the caller's RNG stream
    return model


def load_model_and_tokenizer(path: str | None, size: str, seed: int, task_tokenizer=None):
    """(model, tokenizer): from a local checkpoint directory, or a built-in size with the task's
    tokenizer."""
    # per-load progress bars drown the training bar (also inside Ray workers)
    hf_logging.disable_progress_bar()
    if path is None:
        if task_tokenizer is None:
            raise ValueError("a built-in model size needs the task's tokenizer")
        return build_model(size, task_tokenizer, seed), task_tokenizer
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model path {str(p)!r} holds no transformers checkpoint (config.json missing)"
        )
    tokenizer = (
        AutoTokenizer.from_pretrained(p, local_files_only=True)
        if (p / "tokenizer_config.json").exists()
        else task_tokenizer
    )
    if tokenizer is None:
        raise FileNotFoundError(
            f"model path {str(p)!r} has no tokenizer and the task provides none"
        )
    if tokenizer.pad_token_id is None:  # Llama-style tokenizers have none; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(p, local_files_only=True, dtype=torch.float32)
    # e.g. a default unk token added on reload: its id has no embedding
    if len(tokenizer) > model.config.vocab_size:
        log.warning(
            "%s: the tokenizer has %d tokens, the model's vocabulary %d rows; ids from %d on would "
            "fail "
            "(added tokens: %s)",
            p,
            len(tokenizer),
            model.config.vocab_size,
            model.config.vocab_size,
            sorted(t for t, i in tokenizer.get_vocab().items() if i >= model.config.vocab_size),
        )
    return model, tokenizer


def new_file_mode() -> int:
    """The mode a new file gets under this process's umask (0o644 under the usual 022), read without
    setting the umask (``os.umask`` sets it, for every thread)."""
    mask = None
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                mask = int(line.split()[1], 8)
    if mask is None:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def save_model_dir(out, model, tokenizer=None) -> Path:
    """``model`` (and ``tokenizer``) written to the directory ``out`` by ``save_pretrained``, then
    every file given the mode a new file gets (transformers writes ``model.safetensors`` 0600,
    which no one else can read: a shared model directory, a serving engine run as another user)."""
    out = Path(out)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    mode = new_file_mode()
    for path in out.rglob("*"):
        if path.is_file() and path.stat().st_mode & 0o777 != mode:
            path.chmod(mode)
    return out
