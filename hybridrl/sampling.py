"""Sampling: what a request asks for (:class:`SamplingParams`) and the batched token sampling with
per-sequence reproducible randomness. Below both the rollout, which samples, and the learner, which
recomputes the log-probs of the same distribution (:func:`filtered_log_softmax`): the one place
their sampling math lives.

The sampling distribution of a row is the softmax of its logits divided by the
temperature, restricted by top-k, top-p (nucleus) and min-p; the log-prob
returned for a token is taken under exactly that distribution (the behaviour
policy the trainer needs), and optionally under the raw, untempered softmax.
Greedy rows (temperature 0) take the argmax and report the raw log-prob.

The trainer recomputes log-probs under the same distribution with
:func:`filtered_log_softmax`, which runs the very same filter code
(:func:`processed_logprobs`): the behaviour log-probs the engine reports and the
ones the trainer computes agree at equal weights, whatever the filters.

Randomness: a row's uniform number is a hash of (sequence seed, position,
stream), computed with integer tensor ops on the logits' device. A sequence's
tokens thus depend only on its own seed, not on which other sequences share
the step, on preemption, or on the device's RNG state. A token is drawn by
inverting the row's CDF with that one uniform, which is exact for any
distribution.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 16
    n: int = 1
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    # stop strings: the response ends with the token that completes one (rollout/stop.py)
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    return_raw_log_probs: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def of(cls, cfg, **overrides) -> SamplingParams:
        """The sampling a run's rollout is configured for (``rollout.temperature``, ``top_p``,
        ``top_k``, ``max_new_tokens``), with ``overrides`` (``n``, ``seed`` ...). ``cfg``: the run's
        Config, whose ``data.stop`` strings end responses too, or its RolloutConfig alone. (Every
        eos id of the tokenizer and the model's generation_config ends a response in the
        backends.)"""
        r = getattr(cfg, "rollout", cfg)
        data = getattr(cfg, "data", None)
        fields = dict(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)
        fields |= dict(stop=tuple(data.stop) if data else ())
        if r.max_new_tokens is not None:  # a RolloutConfig alone leaves it to the model's default
            fields["max_new_tokens"] = r.max_new_tokens
        return cls(**(fields | overrides))


_M32 = 0xFFFFFFFF
STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT = 0, 1, 2


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def uniform(seeds: torch.Tensor, counters: torch.Tensor, stream: int) -> torch.Tensor:
    """Uniform numbers in (0, 1), float64, one per (seed, counter) pair, for the given stream."""
    h = _mix32(seeds ^ (stream * 0x9E3779B9))
    h = _mix32(h ^ (seeds >> 32))
    h = _mix32(h ^ counters)
    h2 = _mix32(h ^ 0x5BD1E995)
    # 53 bits
    return ((h >> 5).double() * 67108864.0 + (h2 >> 6).double() + 0.5) / 9007199254740992.0


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors (``None``: the filter is off for every row)."""

    temperature: torch.Tensor  # (R, 1) float32; greedy rows hold 1.0
    greedy: torch.Tensor | None  # (R,) bool, or None when no row is greedy
    all_greedy: bool
    top_k: torch.Tensor | None  # (R,) long, 0 = off
    top_p: torch.Tensor | None  # (R, 1) float32
    min_p: torch.Tensor | None  # (R, 1) float32
    seeds: torch.Tensor  # (R,) int64
    counters: torch.Tensor  # (R,) int64: position of the token being drawn
    want_raw: bool = False

    @staticmethod
    def for_params(params: Any, rows: int, device: torch.device) -> SamplingTensors:
        """``rows`` rows all using ``params``, for filtering only (seeds and counters are zero)."""
        zeros = torch.zeros(rows, dtype=torch.long, device=device)
        return SamplingTensors.build([params] * rows, zeros, zeros, device)

    @staticmethod
    def build(
        params: Seq[Any], seeds: Seq[int], counters: Seq[int], device: torch.device
    ) -> SamplingTensors:
        """``params[i]`` is row i's SamplingParams (the same object repeated is the fast path)."""
        rows = len(params)
        p0 = params[0]
        uniform_params = all(p is p0 for p in params)
        plist = [p0] if uniform_params else list(params)

        def col(get, dtype):
            vals = [get(p) for p in plist]
            t = torch.tensor(vals, dtype=dtype, device=device)
            return t.expand(rows) if uniform_params else t

        temps = [float(p.temperature) for p in plist]
        greedy_vals = [t == 0 for t in temps]
        all_greedy = all(greedy_vals)
        greedy = None if not any(greedy_vals) else col(lambda p: p.temperature == 0, torch.bool)
        temperature = col(
            lambda p: p.temperature if p.temperature > 0 else 1.0, torch.float32
        ).unsqueeze(1)
        top_k = (
            col(lambda p: int(p.top_k or 0), torch.long)
            if any(int(p.top_k or 0) > 0 for p in plist)
            else None
        )
        top_p = (
            col(lambda p: float(p.top_p), torch.float32).unsqueeze(1)
            if any(p.top_p < 1.0 for p in plist)
            else None
        )
        min_ps = [float(p.min_p) for p in plist]
        min_p = (
            col(lambda p: float(p.min_p), torch.float32).unsqueeze(1)
            if any(m > 0 for m in min_ps)
            else None
        )
        want_raw = any(p.return_raw_log_probs for p in plist)
        return SamplingTensors(
            temperature=temperature,
            greedy=greedy,
            all_greedy=all_greedy,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=torch.as_tensor(seeds, dtype=torch.long, device=device),
            counters=torch.as_tensor(counters, dtype=torch.long, device=device),
            want_raw=want_raw,
        )

    def repeat_rows(self, counts: torch.Tensor) -> SamplingTensors:
        """Rows repeated ``counts[i]`` times (speculative decoding: k+1 positions per sequence)."""

        def rep(t):
            return None if t is None else t.repeat_interleave(counts, 0)

        return SamplingTensors(
            rep(self.temperature),
            rep(self.greedy),
            self.all_greedy,
            rep(self.top_k),
            rep(self.top_p),
            rep(self.min_p),
            rep(self.seeds),
            rep(self.counters),
            self.want_raw,
        )

    def slice_rows(self, start: int, end: int) -> SamplingTensors:
        """Rows ``start:end``."""

        def sl(t):
            return None if t is None else t[start:end]

        return SamplingTensors(
            sl(self.temperature),
            sl(self.greedy),
            self.all_greedy,
            sl(self.top_k),
            sl(self.top_p),
            sl(self.min_p),
            sl(self.seeds),
            sl(self.counters),
            self.want_raw,
        )


@torch.no_grad()
def filter_mask(scaled: torch.Tensor, st: SamplingTensors) -> torch.Tensor | None:
    """(R, V) bool, the tokens that top-k, then top-p, then min-p remove from the rows of ``scaled``
    (the logits divided by the temperature); None when no filter is on. No autograd: the support is
    a step function of the logits, and the sort / cumsum buffers are freed at once."""
    if st.top_k is None and st.top_p is None and st.min_p is None:
        return None
    x = scaled
    neg_inf = torch.tensor(float("-inf"), device=x.device)
    if st.top_k is not None:
        kmax = int(st.top_k.max())
        vals = torch.topk(x, min(kmax, x.shape[-1]), dim=-1).values
        k = st.top_k.clamp(1, vals.shape[-1])
        thresh = vals.gather(1, (k - 1).unsqueeze(1))
        thresh = torch.where(st.top_k.unsqueeze(1) > 0, thresh, neg_inf)
        x = torch.where(x < thresh, neg_inf, x)
    if st.top_p is not None:
        probs = torch.softmax(x, -1)
        sorted_p, order = probs.sort(-1, descending=True)
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly higher-ranked tokens
        # rows with top_p >= 1 keep everything: their float32 cumsum can reach 1.0 before the tail
        # and would drop tokens only because a neighbouring row asked for top-p
        drop_sorted = (mass_before >= st.top_p) & (st.top_p < 1.0)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    if st.min_p is not None:
        probs = torch.softmax(x, -1)
        x = torch.where(probs < st.min_p * probs.max(-1, keepdim=True).values, neg_inf, x)
    return torch.isneginf(x)


def _masked_log_softmax(
    scaled: torch.Tensor, drop: torch.Tensor | None, keep: torch.Tensor | None
) -> torch.Tensor:
    if drop is None:
        return torch.log_softmax(scaled, -1)
    if keep is not None:
        drop = drop.scatter(1, keep.unsqueeze(1), False)
    return torch.log_softmax(scaled.masked_fill(drop, float("-inf")), -1)


def processed_logprobs(
    logits: torch.Tensor, st: SamplingTensors, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """(R, V) float32 log-probs of the sampling distribution (filtered tokens hold -inf).

    ``keep`` (R,) token ids, optional: each row's token stays in the support even if a filter drops
    it. The trainer passes the sampled tokens: its logits differ from the engine's by rounding,
    which can move a token that sat on a filter's edge (a top-k tie, the top-p or min-p boundary)
    just outside, and its log-prob would be -inf. Only such near-ties are affected.
    """
    scaled = logits.float() / st.temperature
    return _masked_log_softmax(scaled, filter_mask(scaled, st), keep)


# the trainer filters this many logits at a time (bounds the sort's buffers)
FILTER_CHUNK_ELEMENTS = 1 << 26


def filtered_log_softmax(
    logits: torch.Tensor, params: Any, tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """(..., V) log-probs of the distribution a request with SamplingParams-like ``params`` samples
    from: what :func:`sample` reports as the behaviour log-prob. Greedy (temperature 0): the raw
    log-softmax. ``tokens`` (...) optional: kept in the support (see :func:`processed_logprobs`).
    Differentiable; the filter masks are computed in chunks of rows, so a long micro-batch's sort
    never holds all its logits."""
    if params.temperature == 0:
        return torch.log_softmax(logits.float(), -1)
    shape = logits.shape
    flat = logits.reshape(-1, shape[-1])
    rows = flat.shape[0]
    st = SamplingTensors.for_params(params, rows, flat.device)
    scaled = flat.float() / st.temperature
    chunk = max(1, FILTER_CHUNK_ELEMENTS // shape[-1])
    masks = [
        filter_mask(scaled[i : i + chunk], st.slice_rows(i, i + chunk))
        for i in range(0, rows, chunk)
    ]
    drop = None if not masks or masks[0] is None else torch.cat(masks)
    keep = None if tokens is None else tokens.reshape(-1)
    return _masked_log_softmax(scaled, drop, keep).view(shape)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: one token per row of (unnormalised, non-negative) ``probs`` given uniforms
    ``u``."""
    cdf = probs.double().cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)


def sample(
    logits: torch.Tensor, st: SamplingTensors
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Tokens (R,), their log-probs under the sampling distribution (R,), and raw log-probs (R,) or
    None."""
    raw = torch.log_softmax(logits.float(), -1) if (st.want_raw or st.greedy is not None) else None
    if st.all_greedy:
        tokens = logits.argmax(-1)
        lp = raw.gather(1, tokens.unsqueeze(1)).squeeze(1)
        return tokens, lp, (lp if st.want_raw else None)
    logp = processed_logprobs(logits, st)
    tokens = draw(logp.exp(), uniform(st.seeds, st.counters, STREAM_SAMPLE))
    lp = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
    if st.greedy is not None:
        g_tokens = logits.argmax(-1)
        tokens = torch.where(st.greedy, g_tokens, tokens)
        lp = torch.where(st.greedy, raw.gather(1, g_tokens.unsqueeze(1)).squeeze(1), lp)
    raw_lp = raw.gather(1, tokens.unsqueeze(1)).squeeze(1) if st.want_raw else None
    return tokens, lp, raw_lp
