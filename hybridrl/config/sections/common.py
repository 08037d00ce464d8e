"""What the config sections share: the bounds and names their fields are checked against, ``_f``
(a field with its ``help`` text and checks) and the checks of paths."""

from __future__ import annotations

import json
import os
from pathlib import Path

from hybridrl.registry import option

SEED_MAX = 2**63 - 1  # seeds reach torch.manual_seed and torch.Generator (64-bit)
# a step's prompts, samples and their tokens are held in host memory at once: a bound far above
# any real batch, so that a typo (prompts_per_step=100000000) fails before memory fills up
MAX_SAMPLES_PER_STEP = 2**20
# torch threads of one process: far above any machine's cores (more threads than cores only slow a
# process down), far below what the OpenMP runtime fails to create (100,000 crashed a run)
MAX_THREADS = 1024
# the Linear modules of the decoder layers of the built-in (Qwen2) models and of the Qwen2, Qwen3
# and Llama checkpoints the native rollout serves: the names actor.lora_target_modules may take
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"  # PEFT's name for every Linear module but the output head
LORA_MODEL_TYPES = ("qwen2", "qwen3", "llama")


# the schema's short name for a field with its help text and checks
_f = option


def _check_checkpoint_dir(key: str, path: str) -> None:
    """A ValueError unless ``path`` is a directory holding a transformers ``config.json``."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"{key} {path!r} does not exist or is not a directory")
    if not (p / "config.json").is_file():
        raise ValueError(f"{key} {path!r} holds no config.json (not a transformers checkpoint)")


def _check_writable_dir(key: str, path: str) -> None:
    """A ValueError unless directory ``path`` can be created (or replaced) and written: it is not
    a file, and its nearest existing ancestor is a writable directory."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{key} {path!r} is a file, not a directory")
    # an existing directory is written into or replaced, which its own permissions decide (and an
    # immutable one refuses even root): found now, not when the work to save is done
    if p.is_dir() and not os.access(p, os.W_OK | os.X_OK):
        raise ValueError(
            f"{key} {path!r} cannot be written (no write permission, or immutable: chattr -i)"
        )
    probe = p.parent
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not probe.is_dir():
        raise ValueError(f"{key} {path!r} cannot be created: {str(probe)!r} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ValueError(f"{key} {path!r} cannot be written: no write permission in {str(probe)!r}")


def _check_reward_model(key: str, path: str) -> None:
    """A ValueError unless ``path`` is a checkpoint of a one-label sequence-classification model."""
    _check_checkpoint_dir(key, path)
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{key} {path!r}: its config.json cannot be read ({e})") from None
    archs = (config.get("architectures") if isinstance(config, dict) else None) or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise ValueError(
            f"{key} {path!r} is not a sequence-classification model (architectures: "
            f"{archs or 'none listed'}); a reward model is a *ForSequenceClassification checkpoint"
        )
    labels = len(config["id2label"]) if "id2label" in config else config.get("num_labels", 2)
    if labels != 1:
        raise ValueError(
            f"{key} {path!r} has {labels} labels; a reward model scores with one (num_labels=1)"
        )


def _absolute_file_path(plugin):
    """A plug-in named by file (``rewards.py:fn``) with the file's absolute path; anything else as
    it is."""
    if isinstance(plugin, str) and ".py:" in plugin:
        file, _, attr = plugin.rpartition(":")
        return f"{Path(file).expanduser().resolve()}:{attr}"
    return plugin
