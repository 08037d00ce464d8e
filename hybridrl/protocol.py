"""The data that flows between roles: :class:`Sample` (one trajectory, from prompt to learner) and
:class:`Batch` (named tensors with a shared leading batch dimension, plus per-sample metadata
lists), which the learner builds once from its samples (:func:`samples_to_batch`) and extends with
columns (``old_log_probs``, ``ref_log_probs``, ``advantages`` ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

# the adapter entries of a LoRA weight sync: <module>.lora_A / .lora_B / .lora_scaling
LORA_A, LORA_B, LORA_SCALING = (".lora_A", ".lora_B", ".lora_scaling")
# the asynchronous buffer's error while a dead rollout is replaced (the learner's step and the
# driver retry on it)
REPLACING = "the rollout is being replaced"


@dataclass
class Sample:
    """One trajectory from prompt to learner (the one type a trajectory has).

    A rollout backend receives prompt samples (``response_ids`` empty, ``status`` ``pending``) and
    returns ``n`` copies of each with the response filled in; the rollout rank that generated them
    scores them (``reward``, ``reward_extras``); the learner collates them into a :class:`Batch`.
    """

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    # behaviour log-prob of each response token
    log_probs: list[float] = field(default_factory=list)
    # weight version that produced each response token
    versions: list[int] = field(default_factory=list)
    # per response token: 1 trained on, 0 not (a tool's output); None: all
    loss_mask: list[int] | None = None
    status: str = "pending"  # pending (a prompt) | finished | truncated | aborted
    uid: str = ""  # group id: all samples of one prompt share it (and it names the request)
    task_id: str = ""
    reward: float | None = None  # None until scored
    # e.g. error (1: the reward function raised)
    reward_extras: dict[str, float] = field(default_factory=dict)
    # per-token routing data of a mixture-of-experts model (routing replay); None: none
    routing: Any = None
    # the task's Prompt, stream index, engine stats ...
    metadata: dict[str, Any] = field(default_factory=dict)

    def with_response(self, response_ids, log_probs, versions, status: str, **metadata) -> Sample:
        """A copy of this prompt sample with a generated response (the prompt's metadata kept)."""
        return replace(
            self,
            prompt_ids=list(self.prompt_ids),
            response_ids=list(response_ids),
            log_probs=list(log_probs),
            versions=list(versions),
            status=status,
            reward_extras=dict(self.reward_extras),  # each sample is scored on its own
            metadata=self.metadata | metadata,
        )

    def aborted(self) -> Sample:
        return self.with_response([], [], [], "aborted")


def prompt_sample(prompt, tokenizer) -> Sample:
    """The prompt sample of a task's :class:`~hybridrl.tasks.Prompt`: its ``token_ids`` when the
    source tokenized it, else its text encoded (the tokenizer adds ``<bos>`` where it has one)."""
    ids = prompt.token_ids
    return Sample(
        prompt_ids=list(ids) if ids is not None else tokenizer(prompt.text)["input_ids"],
        uid=prompt.uid,
        task_id=prompt.task_id,
        metadata={"prompt": prompt},
    )


class Batch:
    """Named tensors (first dim = batch) and per-sample metadata lists."""

    def __init__(
        self, tensors: dict[str, torch.Tensor] | None = None, meta: dict[str, list] | None = None
    ):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: dict[str, list] = {k: list(v) for k, v in (meta or {}).items()}
        sizes = {k: t.shape[0] for k, t in self.tensors.items()} | {
            k: len(v) for k, v in self.meta.items()
        }
        if len(set(sizes.values())) > 1:
            raise ValueError(f"Batch columns disagree on batch size: {sizes}")

    # --- access -------------------------------------------------------------
    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key):
        if isinstance(key, str):
            return self.tensors[key] if key in self.tensors else self.meta[key]
        return self.index(key)

    def __setitem__(self, key: str, value) -> None:
        if isinstance(value, torch.Tensor):
            self.tensors[key] = value
        else:
            self.meta[key] = list(value)

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.meta)

    def __repr__(self) -> str:
        cols = [f"{k}{tuple(t.shape)}" for k, t in self.tensors.items()] + list(self.meta)
        return f"Batch(len={len(self)}, {', '.join(cols)})"

    # --- operations ---------------------------------------------------------
    def index(self, idx) -> Batch:
        """Rows by slice, list of ints or bool/long tensor."""
        if isinstance(idx, slice):
            rows = list(range(len(self)))[idx]
        elif isinstance(idx, torch.Tensor):
            rows = (idx.nonzero().flatten() if idx.dtype == torch.bool else idx).tolist()
        else:
            rows = list(idx)
        ridx = torch.tensor(rows, dtype=torch.long)
        return Batch(
            {k: t.index_select(0, ridx) for k, t in self.tensors.items()},
            {k: [v[i] for i in rows] for k, v in self.meta.items()},
        )

    def select(self, *keys: str) -> Batch:
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"Batch has no column(s) {missing}; it has {self.keys()}")
        return Batch(
            {k: t for k, t in self.tensors.items() if k in keys},
            {k: v for k, v in self.meta.items() if k in keys},
        )

    def union(self, other: Batch) -> Batch:
        """Columns of both; a column present in both must hold equal values."""
        if len(self) and len(other) and len(self) != len(other):
            raise ValueError(f"cannot union batches of sizes {len(self)} and {len(other)}")
        tensors, meta = dict(self.tensors), dict(self.meta)
        for k, t in other.tensors.items():
            if k in tensors and not (tensors[k].shape == t.shape and torch.equal(tensors[k], t)):
                raise ValueError(f"union: column {k!r} differs between the batches")
            tensors[k] = t
        for k, v in other.meta.items():
            if k in meta and meta[k] != v:
                raise ValueError(f"union: metadata {k!r} differs between the batches")
            meta[k] = v
        return Batch(tensors, meta)

    def __or__(self, other: Batch) -> Batch:
        return self.union(other)

    def chunk(self, n: int) -> list[Batch]:
        """Split into ``n`` contiguous parts whose sizes differ by at most one."""
        if n < 1:
            raise ValueError(f"chunk: n must be >= 1, got {n}")
        size, rem = divmod(len(self), n)
        out, start = [], 0
        for i in range(n):
            end = start + size + (1 if i < rem else 0)
            out.append(self.index(slice(start, end)))
            start = end
        return out

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of ``size`` rows (the last may be shorter)."""
        return [self.index(slice(i, i + size)) for i in range(0, len(self), size)]

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        batches = [b for b in batches if len(b) or b.keys()]
        if not batches:
            return Batch()
        keys = set(batches[0].keys())
        for b in batches[1:]:
            if set(b.keys()) != keys:
                raise ValueError(
                    f"concat: batches have different columns: {sorted(keys)} vs {sorted(b.keys())}"
                )
        tensors = {}
        for k in batches[0].tensors:
            parts = [b.tensors[k] for b in batches]
            width = max(p.shape[1] for p in parts) if parts[0].dim() > 1 else None
            if width is not None and any(p.shape[1] != width for p in parts):
                raise ValueError(
                    f"concat: column {k!r} has different widths {[p.shape[1] for p in parts]}"
                )
            tensors[k] = torch.cat(parts, 0)
        meta = {k: [x for b in batches for x in b.meta[k]] for k in batches[0].meta}
        return Batch(tensors, meta)

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Each row ``n`` times: ``aabb`` when interleaved, else ``abab``."""
        rows = (
            [i for i in range(len(self)) for _ in range(n)]
            if interleave
            else list(range(len(self))) * n
        )
        return self.index(rows)

    def to(self, device: torch.device | str) -> Batch:
        return Batch({k: t.to(device) for k, t in self.tensors.items()}, self.meta)

    def shuffle(self, generator: torch.Generator) -> Batch:
        return self.index(torch.randperm(len(self), generator=generator))


def pad_2d(
    rows: Iterable[Sequence],
    pad: float,
    dtype: torch.dtype,
    left: bool = False,
    width: int | None = None,
) -> torch.Tensor:
    """Stack ragged rows into a (B, width) tensor padded on the right (or left)."""
    rows = [list(r) for r in rows]
    width = max([len(r) for r in rows] + [0]) if width is None else width
    out = torch.full((len(rows), width), pad, dtype=dtype)
    for i, r in enumerate(rows):
        if r:
            vals = torch.tensor(r, dtype=dtype)
            if left:
                out[i, width - len(r) :] = vals
            else:
                out[i, : len(r)] = vals
    return out


def samples_to_batch(samples: Sequence[Sample], pad_id: int) -> Batch:
    """Collate samples into the training layout: ``input_ids = prompts ++ responses``.

    Prompts are left-padded, responses right-padded. ``response_mask`` is each sample's
    ``loss_mask`` (all ones when None); ``routing`` (a mixture-of-experts rollout's expert ids,
    :func:`routing_column`) when any sample has them; ``rewards`` comes when every sample is
    scored, and each ``reward_extras`` key every sample has becomes a column of its own
    (``reward_errors``, ``baseline_rewards`` ...); ``metadata`` keys become metadata lists.
    """
    prompts = pad_2d([s.prompt_ids for s in samples], pad_id, torch.long, left=True)
    prompt_mask = pad_2d([[1] * len(s.prompt_ids) for s in samples], 0, torch.long, left=True)
    width = max([len(s.response_ids) for s in samples] + [1])
    responses = pad_2d([s.response_ids for s in samples], pad_id, torch.long, width=width)
    attended = pad_2d([[1] * len(s.response_ids) for s in samples], 0, torch.long, width=width)
    masks = [[1] * len(s.response_ids) if s.loss_mask is None else s.loss_mask for s in samples]
    for s, mask in zip(samples, masks):
        if len(mask) != len(s.response_ids):
            raise ValueError(
                f"sample {s.uid!r}: loss_mask has {len(mask)} entries for "
                f"{len(s.response_ids)} response tokens "
                "(one 0/1 per response token, or None for all ones)"
            )
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, attended], 1),
        "response_mask": pad_2d(masks, 0, torch.long, width=width),
        "rollout_log_probs": pad_2d(
            [s.log_probs for s in samples], 0.0, torch.float32, width=width
        ),
        "versions": pad_2d([s.versions for s in samples], -1, torch.long, width=width),
    }
    if any(s.routing is not None for s in samples):
        tensors["routing"] = routing_column(samples, prompts.shape[1], width)
    if samples and all(s.reward is not None for s in samples):
        tensors["rewards"] = torch.tensor([float(s.reward) for s in samples])
        for key in set.intersection(*(set(s.reward_extras) for s in samples)):
            tensors[key] = torch.tensor([float(s.reward_extras[key]) for s in samples])
    meta: dict[str, list] = {
        "uid": [s.uid for s in samples],
        "task_id": [s.task_id for s in samples],
        "status": [s.status for s in samples],
    }
    for key in sorted({k for s in samples for k in s.metadata}):
        meta[key] = [s.metadata.get(key) for s in samples]
    return Batch(tensors, meta)


def routing_column(
    samples: Sequence[Sample], prompt_width: int, response_width: int
) -> torch.Tensor:
    """(B, prompt_width + response_width, layers, k) int16: each sample's ``routing`` (one row per
    prompt and response token, ``hybridrl/moe/``) placed like its tokens in ``input_ids`` (prompt
    left-padded, response right-padded); -1 (no recorded routing: the trainer routes afresh) at
    padding and for samples without routing."""
    first = next(s.routing for s in samples if s.routing is not None)
    out = torch.full(
        (len(samples), prompt_width + response_width, *first.shape[1:]), -1, dtype=torch.int16
    )
    for i, s in enumerate(samples):
        if s.routing is None:
            continue
        n_p, n_r = len(s.prompt_ids), len(s.response_ids)
        if tuple(s.routing.shape) != (n_p + n_r, *first.shape[1:]):
            raise ValueError(
                f"sample {s.uid!r}: routing of shape {tuple(s.routing.shape)} for {n_p} prompt + "
                f"{n_r} response tokens (expected {n_p + n_r} rows of {tuple(first.shape[1:])})"
            )
        out[i, prompt_width - n_p : prompt_width] = s.routing[:n_p]
        out[i, prompt_width : prompt_width + n_r] = s.routing[n_p:]
    return out
