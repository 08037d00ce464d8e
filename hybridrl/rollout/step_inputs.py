"""The model runner's step inputs: a flat token batch and what attention needs to find each
token's context in the paged KV pool.

:class:`StepPreparation` is the input half of ``ModelRunner`` (``model_runner.py``), kept apart so
that each file holds one concern: it turns the scheduled sequences and their new-token counts into a
:class:`StepInputs` (token ids, RoPE rows, KV slots, block tables, the causal mask) and, for decode
steps on a CPU, decides whether the context gathered at the previous step can be reused. It relies
on the runner's ``block_size``, ``device``, ``dtype``, ``cos_table`` / ``sin_table``,
``keep_gathered`` and ``_last_batch``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hybridrl.rollout.sequence import Sequence


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    cos: torch.Tensor  # (T, 1, D)
    sin: torch.Tensor
    slots: torch.Tensor  # (T,) cache slot of each new token
    # (B * nb,) block table of each sequence, padded with block 0 (masked); None: reuse
    kv_blocks: torch.Tensor | None
    bias: torch.Tensor  # (B, qmax, kmax) additive attention mask
    batch: int
    qmax: int
    kmax: int
    # (B * qmax,) flat token index per padded query (None: decode only)
    q_pad_index: torch.Tensor | None
    out_index: torch.Tensor | None  # (T,) padded row of each token
    last_index: torch.Tensor  # (B,) flat index of each sequence's last query token
    # decode step over (a subset of) the kept batch: the gathered context is still valid
    reuse: bool = False
    pos: torch.Tensor | None = None  # (B,) position of each new token (decode)
    # (B,) kept-buffer row of each sequence (None: row b is sequence b)
    rows: torch.Tensor | None = None
    # rows of the kept buffers (>= B; the extra rows belong to sequences that left)
    num_rows: int = 0


class StepPreparation:
    """Step inputs from scheduled sequences (mixed into ``ModelRunner``)."""

    def prepare(self, seqs: list[Sequence], num_tokens: list[int]) -> StepInputs:
        """Flat step inputs for ``num_tokens[i]`` new tokens of each sequence, starting at its
        ``num_computed``."""
        B, bs, dev = len(seqs), self.block_size, self.device
        if all(q == 1 for q in num_tokens):
            return self._prepare_decode(seqs)
        starts = [s.num_computed for s in seqs]
        ids = [t for s, st, q in zip(seqs, starts, num_tokens) for t in s.token_ids[st : st + q]]
        qmax = max(num_tokens)
        nb = (max(st + q for st, q in zip(starts, num_tokens)) + bs - 1) // bs
        kmax = nb * bs  # contexts are gathered whole blocks at a time
        bt = self._block_table(seqs, nb)
        starts_t = torch.tensor(starts, dtype=torch.long)
        q_t = torch.tensor(num_tokens, dtype=torch.long)
        T = len(ids)
        seq_idx = torch.repeat_interleave(torch.arange(B), q_t)
        cu = torch.cumsum(q_t, 0) - q_t
        local = torch.arange(T) - cu[seq_idx]
        pos = starts_t[seq_idx] + local
        i = torch.minimum(torch.arange(qmax).unsqueeze(0), (q_t - 1).unsqueeze(1))  # (B, qmax)
        self._last_batch = None  # this step writes the pool without updating the kept context
        to = lambda t: t.to(dev, non_blocking=True)  # noqa: E731
        pos_d = to(pos)
        return StepInputs(
            input_ids=to(torch.tensor(ids, dtype=torch.long)),
            cos=self.cos_table[pos_d].unsqueeze(1),
            sin=self.sin_table[pos_d].unsqueeze(1),
            slots=to(bt[seq_idx, pos // bs] * bs + pos % bs),
            kv_blocks=to(bt.flatten()),
            bias=to(self._causal_bias(starts_t.unsqueeze(1) + i, kmax)),
            batch=B,
            qmax=qmax,
            kmax=kmax,
            q_pad_index=to((cu.unsqueeze(1) + i).flatten()),
            out_index=to(seq_idx * qmax + local),
            last_index=to(cu + q_t - 1),
            num_rows=B,
        )

    def _prepare_decode(self, seqs: list[Sequence]) -> StepInputs:
        """One new token per sequence; per-sequence work: three list comprehensions, one tensor."""
        B, bs, dev = len(seqs), self.block_size, self.device
        pos = [s.num_computed for s in seqs]
        ids = [s.token_ids[p] for s, p in zip(seqs, pos)]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        nb = max(pos) // bs + 1
        ipt = torch.tensor([ids, pos, slots], dtype=torch.long)
        reuse, rows, num_rows = False, None, B
        if self.keep_gathered:
            reuse, rows, num_rows = self._kept_rows(seqs, nb)
        qpos = ipt[1]
        if rows is not None:  # rows of sequences that left keep a harmless mask (key 0 only)
            qpos = torch.zeros(num_rows, dtype=torch.long).index_copy_(0, rows, qpos)
        ipt = ipt.to(dev, non_blocking=True)
        pos_d = ipt[1]
        return StepInputs(
            input_ids=ipt[0],
            cos=self.cos_table[pos_d].unsqueeze(1),
            sin=self.sin_table[pos_d].unsqueeze(1),
            slots=ipt[2],
            kv_blocks=None if reuse else self._block_table(seqs, nb).flatten().to(dev),
            bias=self._causal_bias(qpos.unsqueeze(1), nb * bs).to(dev),
            batch=B,
            qmax=1,
            kmax=nb * bs,
            q_pad_index=None,
            out_index=None,
            last_index=torch.arange(B, device=dev),
            reuse=reuse,
            pos=pos_d,
            rows=None if rows is None else rows.to(dev),
            num_rows=num_rows,
        )

    @staticmethod
    def _block_table(seqs: list[Sequence], nb: int) -> torch.Tensor:
        """(B, nb) block ids, padded with block 0 (its keys are masked)."""
        return torch.tensor([(s.block_table + [0] * nb)[:nb] for s in seqs], dtype=torch.long)

    def _causal_bias(self, qpos: torch.Tensor, kmax: int) -> torch.Tensor:
        """(rows, qmax, kmax) additive mask: 0 where key <= query position, -inf after."""
        future = torch.arange(kmax).view(1, 1, -1) > qpos.unsqueeze(-1)
        return torch.zeros(future.shape, dtype=self.dtype).masked_fill_(future, float("-inf"))

    def _kept_rows(self, seqs, nb: int) -> tuple[bool, torch.Tensor | None, int]:
        """Whether this decode step can reuse the kept context (same block count, every sequence
        already has a row), the row of each sequence (None when row b is sequence b) and the number
        of rows."""
        ids = [getattr(s, "seq_id", None) for s in seqs]
        last = self._last_batch
        if last is not None and last[0] == nb and None not in ids:
            row_of = last[1]
            rows = [row_of.get(i) for i in ids]
            if None not in rows:
                if len(rows) == len(row_of) and rows == list(range(len(rows))):
                    return True, None, len(rows)
                return True, torch.tensor(rows, dtype=torch.long), len(row_of)
        self._last_batch = None if None in ids else (nb, {i: r for r, i in enumerate(ids)})
        return False, None, len(seqs)
