"""Make the assets of ``examples/chat_math_grpo.yaml``: a jsonl of chat-format arithmetic word
problems and a small chat model (BPE tokenizer, ChatML template, tiny Qwen2), trained briefly on
correct answers so that it starts RL from a non-zero accuracy, like a real pretrained model would.
Nothing is downloaded; it takes about a minute on a laptop CPU.

    .venv/bin/python examples/make_chat_math.py            # -> examples/chat_math/
    .venv/bin/hybridrl train examples/chat_math_grpo.yaml
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hybridrl.models.chat_model import build_chat_model
from hybridrl.tasks.word_problems import word_problem, write_word_problems


def conversation(row: dict) -> list[dict]:
    return row["prompt"] + [{"role": "assistant", "content": row["answer"]}]


def ids_of(tokenizer, messages: list[dict], generation_prompt: bool) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, add_generation_prompt=generation_prompt, tokenize=True, return_dict=True
    )
    return list(out["input_ids"])


def warm_up(model_dir: Path, rows: list[dict], steps: int, batch: int, lr: float) -> float:
    """A short supervised pass on the rows' correct answers (loss on the answer and its
    ``<|im_end|>`` only); saves the model in place; returns the last loss."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    examples = []
    for row in rows:
        prompt = ids_of(tok, row["prompt"], True)
        full = prompt + tok(row["answer"])["input_ids"] + [tok.eos_token_id]
        examples.append((full, len(prompt)))
    g = torch.Generator().manual_seed(0)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        pick = torch.randint(len(examples), (batch,), generator=g).tolist()
        width = max(len(examples[i][0]) for i in pick)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        mask = torch.zeros(batch, width, dtype=torch.long)
        for r, i in enumerate(pick):
            full, start = examples[i]
            ids[r, : len(full)] = torch.tensor(full)
            labels[r, start : len(full)] = torch.tensor(full[start:])
            mask[r, : len(full)] = 1
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(model_dir)
    return loss.item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="examples/chat_math", help="output directory")
    p.add_argument("--train-rows", type=int, default=4000)
    p.add_argument("--val-rows", type=int, default=256)
    p.add_argument("--warm-steps", type=int, default=150, help="supervised steps (0: none)")
    args = p.parse_args()
    t0, out = time.perf_counter(), Path(args.out)
    train = write_word_problems(out / "train.jsonl", args.train_rows, seed=0)
    val = write_word_problems(out / "val.jsonl", args.val_rows, seed=1)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    # the tokenizer learns the chat markup too ("user", "assistant"), as a chat model's would
    texts = ["".join(f"{m['role']}\n{m['content']}\n" for m in conversation(r)) for r in rows] + [
        word_problem(2, i)["prompt"][0]["content"] for i in range(500)
    ]
    model_dir = build_chat_model(out / "model", texts, size="tiny", seed=0)
    loss = warm_up(model_dir, rows, args.warm_steps, 64, 3e-3) if args.warm_steps else None
    print(
        json.dumps(
            {
                "train": str(train),
                "val": str(val),
                "model": str(model_dir),
                "warm_up_loss": loss,
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
