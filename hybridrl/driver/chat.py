"""``hybridrl chat MODEL_DIR``: talk to a model with its own chat template, one user message per
line of standard input, so it can be typed at or scripted (``printf 'hi\\nmore\\n' | hybridrl chat
DIR``).

Each line is the next user message; the reply (the model's tokens up to an end-of-turn token of its
generation config, or ``--max-new-tokens``) is printed, then the conversation goes on with it.
``/reset`` starts a new conversation; end of input ends the chat. Sampling: ``--temperature``
(0: greedy), ``--top-p``, ``--seed`` (one seed per reply, from the seed and the turn, so a script
gets the same replies every time). Generation is transformers' ``generate`` on the CPU or the GPU
torch sees first: the same model classes a run trains.
"""

from __future__ import annotations

import argparse
import sys
from typing import TextIO

import torch


def chat(
    model_dir: str,
    lines: TextIO,
    out: TextIO,
    temperature: float = 0.7,
    top_p: float = 1.0,
    max_new_tokens: int = 256,
    system: str | None = None,
    seed: int = 0,
) -> int:
    """The loop of the module docstring; returns the number of replies."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # standard error stays for errors
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{model_dir}: the tokenizer has no chat template")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True).to(device)
    model.eval()
    start = [{"role": "system", "content": system}] if system else []
    messages, replies = list(start), 0
    for line in lines:
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() == "/reset":
            messages = list(start)
            continue
        messages.append({"role": "user", "content": text})
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"].to(device)
        torch.manual_seed(seed + replies)
        with torch.no_grad():
            output = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=temperature > 0,
                temperature=temperature if temperature > 0 else None,
                top_p=top_p if temperature > 0 else None,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
            )
        reply = tokenizer.decode(output[0, ids.shape[1] :], skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": reply})
        print(reply, file=out, flush=True)
        replies += 1
    return replies


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="hybridrl chat", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "model_dir",
        help="a model directory with a chat template, a run checkpoint or a run directory (its "
        "newest checkpoint): the forms model.path takes",
    )
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy (default 0.7)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--system", default=None, help="a system message that starts every chat")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from hybridrl.config.sections.model import model_dir

    try:
        chat(
            str(model_dir(args.model_dir, "MODEL_DIR")),
            sys.stdin,
            sys.stdout,
            args.temperature,
            args.top_p,
            args.max_new_tokens,
            args.system,
            args.seed,
        )
    except (OSError, ValueError) as e:
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return 2
    return 0
