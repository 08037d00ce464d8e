"""Make the assets of the chat-math tutorial (README, "Your model, your data"): jsonl files of
chat-format arithmetic word problems, RL prompts and supervised conversations, and a small chat
model (BPE tokenizer, ChatML template, tiny Qwen2, random weights) that stands in for a downloaded
one. Nothing is downloaded; it takes a few seconds.

    .venv/bin/python examples/make_chat_math.py            # -> examples/chat_math/
    .venv/bin/hybridrl sft examples/chat_math_sft.yaml     # warm up on sft.jsonl
    .venv/bin/hybridrl train examples/chat_math_grpo.yaml  # GRPO from the SFT model
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from hybridrl.models.chat_model import build_chat_model
from hybridrl.tasks.word_problems import word_problem, write_word_problems


def conversation(row: dict) -> list[dict]:
    return row["prompt"] + [{"role": "assistant", "content": row["answer"]}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="examples/chat_math", help="output directory")
    p.add_argument("--train-rows", type=int, default=4000)
    p.add_argument("--val-rows", type=int, default=256)
    p.add_argument("--sft-rows", type=int, default=2000)
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
    # supervised conversations from other streams than the RL prompts: the answer as the
    # assistant's turn
    sft = {}
    for name, n, seed in (("sft", args.sft_rows, 2), ("sft_val", 128, 3)):
        sft[name] = out / f"{name}.jsonl"
        sft[name].write_text(
            "".join(
                json.dumps({"messages": conversation(word_problem(seed, i))}) + "\n"
                for i in range(n)
            )
        )
    print(
        json.dumps(
            {
                "train": str(train),
                "val": str(val),
                "model": str(model_dir),
                **{name: str(path) for name, path in sft.items()},
                "seconds": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
