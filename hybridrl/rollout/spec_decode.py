"""Speculative decoding with exact rejection sampling (Leviathan et al.; Chen et al.).

A draft model proposes k tokens x_1..x_k, each sampled from its own sampling
distribution q_i (same temperature / top-k / top-p / min-p as the request); the
target scores all k+1 positions in one forward pass, giving p_1..p_{k+1}.
x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
rejection the token is drawn from norm(max(0, p_i - q_i)) and the rest is
dropped; when all k are accepted a bonus token is drawn from p_{k+1}. Every
emitted token is then distributed exactly as plain sampling from the target,
so its behaviour log-prob is log p_i(token). Only greedy requests (temperature 0)
use exact match against the target's argmax; accepting a sampled draft token
because it equals the target's argmax would change the distribution.

The draft model has its own KV pool with the same block layout and shares the
sequences' block tables; ``Sequence.num_draft_computed`` tracks how far its KV
is valid. A round speculates for the decoding sequences of a step; sequences
admitted in the same step are prefilled in the same draft and target passes.
Speculation runs only while at most ``max_batch`` sequences are running, and
turns itself off where it does not pay: the engine fits the seconds of a
forward over T query tokens as t0 + c T to its plain decode steps and its
verification passes, measures a draft step's seconds and the acceptance rate a,
and speculates with the k (up to ``rollout.backend_options.num_speculative_tokens``) that
maximises B E(k) / (t(B (k + 1)) + k t_draft), E(k) = (1 - a^(k+1)) / (1 - a),
when that beats plain decoding's B / t(B); otherwise it probes one round in 16
to keep the estimates fresh. Where a step is memory-bound (batch 1) c is small
and long proposals pay; where it is compute-bound (larger batches on a CPU),
verifying k + 1 tokens per sequence costs almost k + 1 plain steps, so k shrinks
or speculation stops.
"""

from __future__ import annotations

import time

import torch

from hybridrl.sampling import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    SamplingTensors,
    draw,
    processed_logprobs,
    uniform,
)


class _View:
    """What ModelRunner.prepare reads from a sequence, with the proposals appended."""

    __slots__ = ("token_ids", "num_computed", "block_table", "seq_id")

    def __init__(self, token_ids, num_computed, block_table, seq_id=None):
        self.token_ids, self.num_computed, self.block_table = token_ids, num_computed, block_table
        self.seq_id = seq_id  # lets the draft runner keep its gathered context across draft steps


class SpecDecoder:
    def __init__(self, engine, draft_runner, k: int, max_batch: int):
        if draft_runner.spec.vocab_size != engine.runner.spec.vocab_size:
            raise ValueError("the draft model must share the target's vocabulary")
        self.engine = engine
        self.draft = draft_runner
        self.max_k = k  # rollout.backend_options.num_speculative_tokens: the longest proposal
        self.k = k  # this round's proposal length (the cost model's choice)
        self.max_batch = max_batch
        # cost model: a forward over T query tokens takes about t0 + c * T seconds, fitted to two
        # running averages of (tokens, seconds): decode-only plain steps and verification passes (a
        # round minus its drafting); a draft step takes t_draft; alpha is the acceptance rate
        self.alpha, self.plain, self.verify, self.t_draft = 0.8, None, None, None
        self.skipped, self.probe_every = 0, 16
        # last verdict of the cost model; while False the draft does not follow plain steps
        self.paying = True

    def expected_tokens(self, k: int) -> float:
        """Tokens a round of k proposals emits per sequence at acceptance rate alpha:
        (1 - a^(k+1)) / (1 - a)."""
        a = min(self.alpha, 0.999)
        return (1 - a ** (k + 1)) / (1 - a)

    def step_seconds(self, tokens: float) -> float:
        (tp, sp), (tv, sv) = self.plain, self.verify
        c = max(0.0, (sv - sp) / (tv - tp)) if tv > tp else 0.0
        return max(0.0, sp - c * tp) + c * tokens

    def wants_step(self, scheduler) -> bool:
        """Whether the next step speculates (at most ``max_batch`` sequences running, some decoding,
        and the cost model's :meth:`choose_k` says so); sets ``k``."""
        run = scheduler.running
        B = sum(1 for s in run if len(s) - s.num_computed == 1)
        if not B or len(run) > self.max_batch:
            return False
        k = self.choose_k(B)
        if k is None:
            return False
        self.k = k
        return True

    def choose_k(self, B: int) -> int | None:
        """The cost model's proposal length for a round over ``B`` decoding sequences, None for a
        plain step: the k that maximises tokens per second, B * E(k) / (t(B (k + 1)) + k t_draft),
        if that beats plain decoding's B / t(B); otherwise None, except for a probe one time in
        ``probe_every``."""
        if self.plain is None or self.verify is None:
            # measure a plain step first, then a round
            return self.max_k if self.plain is not None else None
        rate, k = max(
            (B * self.expected_tokens(k) / (self.step_seconds(B * (k + 1)) + k * self.t_draft), k)
            for k in range(1, self.max_k + 1)
        )
        self.paying = rate >= B / max(self.step_seconds(B), 1e-9)
        if self.paying:
            return k
        # speculation does not pay here (low acceptance or compute-bound): probe now and then
        self.skipped += 1
        return k if self.skipped % self.probe_every == 0 else None

    @staticmethod
    def _average(old, new):
        """Running average (weight 0.3 on the new value) of a number or a tuple of numbers."""
        if old is None:
            return new
        return (
            tuple(0.7 * o + 0.3 * n for o, n in zip(old, new))
            if isinstance(new, tuple)
            else 0.7 * old + 0.3 * new
        )

    def note_plain(self, tokens: int, seconds: float) -> None:
        self.plain = self._average(self.plain, (tokens, seconds))

    def follow(self, seqs, num_tokens) -> None:
        """After a plain target step, bring the draft's KV up to the same tokens. Skipped while
        speculation is off (large batch, or not paying): the first draft forward of the next round
        catches up instead."""
        if len(seqs) > self.max_batch or not self.paying:
            return
        views, qs = [], []
        for s, q in zip(seqs, num_tokens):
            end = s.num_computed + q
            if s.num_draft_computed < end:
                views.append(_View(s.token_ids, s.num_draft_computed, s.block_table, s.seq_id))
                qs.append(end - s.num_draft_computed)
                s.num_draft_computed = end
        if views:
            self.draft.forward(self.draft.prepare(views, qs), None)

    @torch.inference_mode()
    def step(self, batch) -> int | None:
        """One round for the decoding sequences of ``batch``; its prefilling sequences (admitted in
        the same step) share the draft's first forward and the target's verification forward.
        Returns the number of tokens generated, or None (nothing done) when no sequence of the batch
        decodes: the engine steps plainly."""
        t0 = time.perf_counter()
        eng, k, dev = self.engine, self.k, self.engine.device
        seqs, rest, rest_q = [], [], []
        for s, q in zip(batch.seqs, batch.num_tokens):
            if q == 1 and not s.num_forks:
                seqs.append(s)
            else:
                rest.append(s)
                rest_q.append(q)
        if not seqs:
            return None
        eng.count_prompt_tokens(rest, rest_q)
        B = len(seqs)
        st = SamplingTensors.build(
            [s.params for s in seqs], [s.seed for s in seqs], [len(s) for s in seqs], dev
        )
        base = torch.tensor([len(s) for s in seqs], device=dev)  # position of x_1
        # 1. draft proposes k tokens (the first forward also catches up on tokens it has not seen,
        # and prefills `rest`)
        views = [
            _View(list(s.token_ids), s.num_draft_computed, s.block_table, s.seq_id) for s in seqs
        ]
        qs = [len(s) - s.num_draft_computed for s in seqs]
        catch_up = [
            (
                _View(s.token_ids, s.num_draft_computed, s.block_table),
                s.num_computed + q - s.num_draft_computed,
            )
            for s, q in zip(rest, rest_q)
        ]
        for s, q in zip(rest, rest_q):
            s.num_draft_computed = s.num_computed + q
        proposals, q_logps = [], []
        t_draft = time.perf_counter()
        for i in range(k):
            extra = catch_up if i == 0 else []
            inp = self.draft.prepare(views + [v for v, _ in extra], qs + [q for _, q in extra])
            logits = self.draft.forward(inp, inp.last_index[:B])
            st.counters = base + i
            if st.all_greedy:
                lq = torch.log_softmax(logits, -1)
                x = logits.argmax(-1)
            else:
                lq = processed_logprobs(logits, st)
                x = draw(lq.exp(), uniform(st.seeds, st.counters, STREAM_DRAFT))
                if st.greedy is not None:
                    x = torch.where(st.greedy, logits.argmax(-1), x)
            proposals.append(x)
            q_logps.append(lq)
            if i + 1 < k:
                for v, t, q in zip(views, x.tolist(), qs):
                    v.num_computed += q
                    v.token_ids.append(t)
                qs = [1] * B
        t_draft = time.perf_counter() - t_draft
        X = torch.stack(proposals, 1)  # (B, k)
        LQ = torch.stack(q_logps, 1)  # (B, k, V)
        # 2. target scores the last token and the k proposals in one pass (with the prefill chunks
        # of `rest`)
        xs = X.tolist()
        tviews = [
            _View(s.token_ids + xs[b], s.num_computed, s.block_table) for b, s in enumerate(seqs)
        ]
        T = B * (k + 1)
        inp = eng.runner.prepare(
            tviews + [_View(s.token_ids, s.num_computed, s.block_table) for s in rest],
            [k + 1] * B + rest_q,
        )
        all_logits = eng.runner.forward(
            inp, torch.cat([torch.arange(T, device=dev), inp.last_index[B:]])
        )
        logits = all_logits[:T].view(B, k + 1, -1)
        # 3. accept / reject
        rep = torch.full((B,), k + 1, device=dev)
        stp = st.repeat_rows(rep)
        stp.counters = (base.unsqueeze(1) + torch.arange(k + 1, device=dev)).flatten()
        flat = logits.view(T, -1)
        if st.all_greedy:
            LP = torch.log_softmax(flat, -1).view(B, k + 1, -1)
        else:
            LP = processed_logprobs(flat, stp).view(B, k + 1, -1)
        tokens, n_acc = accept_tokens(X, LP, LQ, logits, st, base)
        # 4. emit tokens, update KV bookkeeping
        lp_all = LP.gather(2, tokens.unsqueeze(2)).squeeze(2)  # (B, k+1) log p of emitted tokens
        greedy_rows = st.greedy if st.greedy is not None else None
        if greedy_rows is not None or st.want_raw:
            raw = torch.log_softmax(logits.float(), -1).gather(2, tokens.unsqueeze(2)).squeeze(2)
            if greedy_rows is not None and not st.all_greedy:
                lp_all = torch.where(greedy_rows.unsqueeze(1), raw, lp_all)
        n_list, tok_list, lp_list = n_acc.tolist(), tokens.tolist(), lp_all.tolist()
        raw_list = raw.tolist() if st.want_raw else None
        out_t, out_lp, out_raw = [], [], [] if st.want_raw else None
        for b, s in enumerate(seqs):
            a = n_list[b]
            out_t.append(tok_list[b][: a + 1])
            out_lp.append(lp_list[b][: a + 1])
            if out_raw is not None:
                out_raw.append(raw_list[b][: a + 1])
            s.num_computed += a + 1  # the pending token and the accepted proposals now have KV
            s.num_draft_computed = min(views[b].num_computed + qs[b], s.num_computed)
        eng.append_tokens(seqs, out_t, out_lp, out_raw)
        for s in seqs:
            if s.block_table:
                eng.bm.register_computed(s)
        n_rest = eng.complete(rest, rest_q, all_logits[T:]) if rest else 0
        acc = eng.stats_acc
        acc["spec_steps"] += 1
        acc["spec_proposed"] += B * k
        acc["spec_accepted"] += sum(n_list)
        self.alpha = self._average(self.alpha, sum(n_list) / (B * k))
        self.t_draft = self._average(self.t_draft, t_draft / k)
        self.verify = self._average(
            self.verify, (T + sum(rest_q), time.perf_counter() - t0 - t_draft)
        )
        return sum(len(t) for t in out_t) + n_rest


def accept_tokens(X, LP, LQ, logits, st: SamplingTensors, base):
    """The rejection step. X (B, k) proposals drawn from exp(LQ) (B, k, V); LP (B, k+1, V) target
    log-probs; logits (B, k+1, V) raw target logits (greedy rows); ``base`` (B,) position of x_1
    (random counters). Returns tokens (B, k+1), of which row b emits its first n_acc[b] + 1, and
    n_acc (B,)."""
    B, k = X.shape
    dev = X.device
    if st.all_greedy:
        target_best = logits.argmax(-1)  # (B, k+1)
        ok = target_best[:, :k] == X
        n_acc = ok.int().cumprod(1).sum(1)
        return target_best, n_acc  # the argmax is the proposal where accepted, the correction after
    lp_x = LP[:, :k].gather(2, X.unsqueeze(2)).squeeze(2)
    lq_x = LQ.gather(2, X.unsqueeze(2)).squeeze(2)
    counters = base.unsqueeze(1) + torch.arange(k, device=dev)
    u = uniform(st.seeds.unsqueeze(1).expand(B, k), counters, STREAM_ACCEPT)
    ok = torch.log(u) < (lp_x - lq_x).double()  # u < p/q  <=>  accept with prob min(1, p/q)
    if st.greedy is not None:
        ok = torch.where(st.greedy.unsqueeze(1), logits[:, :k].argmax(-1) == X, ok)
    n_acc = ok.int().cumprod(1).sum(1)  # (B,) accepted prefix length
    # token after the accepted prefix: residual max(0, p - q) on rejection, p itself after k accepts
    idx = n_acc.clamp(max=k)
    p_next = LP.gather(1, idx.view(B, 1, 1).expand(B, 1, LP.shape[-1])).squeeze(1).exp()
    q_next = (
        LQ.gather(1, idx.clamp(max=k - 1).view(B, 1, 1).expand(B, 1, LQ.shape[-1])).squeeze(1).exp()
    )
    resid = (p_next - q_next).clamp_(min=0)
    use_resid = (n_acc < k).unsqueeze(1) & (resid.sum(-1, keepdim=True) > 0)
    dist = torch.where(use_resid, resid, p_next)
    y = draw(dist, uniform(st.seeds, base + idx, STREAM_SAMPLE))
    if st.greedy is not None:
        y = torch.where(
            st.greedy,
            logits.gather(1, idx.view(B, 1, 1).expand(B, 1, logits.shape[-1]))
            .squeeze(1)
            .argmax(-1),
            y,
        )
    tokens = torch.cat([X, X[:, :1]], 1)
    tokens.scatter_(1, idx.unsqueeze(1), y.unsqueeze(1))
    return tokens, n_acc
