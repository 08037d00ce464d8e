"""Save / load what a trained role needs to resume exactly: weights (transformers format), optimizer, shuffle RNG."""
from __future__ import annotations

from pathlib import Path

import torch


def save_trainable(path: str | Path, model, optimizer, generator: torch.Generator, tokenizer=None) -> None:
    path = Path(path)
    model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    torch.save({"optimizer": optimizer.state_dict(), "shuffle_rng": generator.get_state()}, path / "train_state.pt")


def load_trainable(path: str | Path, optimizer, generator: torch.Generator) -> None:
    """Optimizer and RNG state (the weights were loaded when the model was built from ``path``)."""
    state = torch.load(Path(path) / "train_state.pt", weights_only=True)
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["shuffle_rng"])
