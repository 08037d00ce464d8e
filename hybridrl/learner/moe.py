"""MoE training on the learner's batches: routing replay, balancing losses, the expert bias and the
health metrics, wired through one context around each model forward (:func:`moe_forward`).

Batch columns:

* ``routing`` (B, P + R, layers, k), int16: expert ids aligned with ``input_ids`` (left-padded
  prompt ++ right-padded response), :data:`~hybridrl.moe.routing.NOT_ROUTED` where nothing was
  recorded. It comes from the rollout (``samples_to_batch``), and follows the rows, trimming and
  packing of ``input_ids`` into every micro-batch.
* ``routing_replay`` (B,): 1 where a forward must dispatch each token to ``routing``'s experts.
* ``moe_row`` (B,): each row's index, for R2's capture of the old-policy pass's routing.

Modes (``moe.routing_replay``): ``r3`` marks every row for replay of the rollout's routing, in every
training forward (the reference's, the old log-probs', the update's); ``r2`` records the routing of
the learner's old-policy pass (``compute_log_prob``) and replays it in the update (on-policy with
the old log-probs taken from the update's own first forward, that forward *is* the old policy and
R2 equals no replay); ``none`` routes afresh everywhere.

The policy model carries a :class:`MoETraining` (attribute ``hybridrl_moe``): the forward context
finds it there, counts expert loads, compares fresh routing with the recorded one and adds the
balancing losses. The reference carries none: it only replays (:func:`replays_routing`); a critic
neither replays nor observes. A pipelined policy (``actor.pp_size`` > 1) is the module of a rank's
stages: the pipeline runs the same context around each micro-batch's forward of a stage
(``parallel/pipeline.py``), and the routers keep the whole model's layer numbers
(``moe/routing.py``), so each rank replays, observes and captures the layers it holds and the step's
sums are taken over every rank.

Observed tokens: the real tokens (attention mask) of the rows that train, those with a response
token in the loss. The fillers that keep ranks in step (data parallelism's dummy micro-batches, a
pipeline round's padding rows) have none: they are replayed like any row, but they are no expert's
load and no part of the balancing losses, of R2's capture or of the routing comparisons.

Balancing losses: each router call of a training forward computes its layer's terms on the observed
tokens and joins them to the gradient right there (:class:`_Balanced`, on the dispatch weights), so
a pipeline stage's layers reach the gradient in that stage's backward. A micro-batch's terms weigh
its share of the mini-batch's response tokens, like the policy loss; the backward reads the
mini-batch's totals, which the update notes before the backward (:func:`note_minibatch`: the
learner's loss, and on every pipeline rank the pipelined update).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hybridrl.moe.balance import ExpertBias, attach_biases, router_z_loss, switch_aux_loss
from hybridrl.moe.health import RoutingHealth
from hybridrl.moe.routing import (
    NOT_ROUTED,
    ROUTING_DTYPE,
    gate_hooks,
    gate_weights,
    is_moe,
    record,
    routing_shape,
    same_sets,
)
from hybridrl.parallel import distributed

ROUTING, REPLAY, ROW = "routing", "routing_replay", "moe_row"
RUNTIME_ATTR = "hybridrl_moe"
# set on the models whose forwards replay a batch's routing: the policy and its reference, not a
# critic (its routers are its own, trained apart from the policy's)
REPLAYS_ATTR = "hybridrl_moe_replays"
PROBE_ROWS = 8  # rows of the fixed probe batch whose routing is compared between versions


def prepare(model: nn.Module, cfg) -> nn.Module:
    """Before sharding: an MoE model gets its expert biases when ``moe.bias_update_rate`` > 0."""
    if cfg.bias_update_rate > 0 and is_moe(model):
        attach_biases(model)
    return model


def note_minibatch(model: nn.Module, totals) -> None:
    """The global ``totals`` of the mini-batch whose micro-batches ``model``'s next training
    forwards run: the backward weighs each micro-batch's balancing losses by them. The pipelined
    update notes them on every rank (only the ranks holding the last stage compute a loss); a
    no-op for a model without MoE runtime."""
    runtime = getattr(model, RUNTIME_ATTR, None)
    if runtime is not None:
        runtime.totals = totals


def replays_routing(model: nn.Module) -> nn.Module:
    """Mark ``model`` (the policy, the reference) as one whose forwards replay recorded routing."""
    setattr(model, REPLAYS_ATTR, True)
    return model


def start(model: nn.Module, optimizer, cfg) -> MoETraining | None:
    """The policy's MoE runtime (None for a dense model), attached to ``model``; the expert bias
    moves after each of ``optimizer``'s steps."""
    if not is_moe(model):
        return None
    runtime = MoETraining(model, cfg)
    setattr(model, RUNTIME_ATTR, runtime)
    replays_routing(model)
    if runtime.bias is not None:
        optimizer.register_step_post_hook(lambda opt, args, kwargs: runtime.update_bias())
    return runtime


def _token_places(model, mb) -> tuple[torch.Tensor, int, torch.Tensor]:
    """``(places, n, real)``: where each real token of ``mb`` (``real``: its attention mask, (B, T)
    bool) sits in the forward's flattened (n,) token order, unpacked or packed."""
    from hybridrl.learner.logprob import PACK_OFFSET, PACK_ROW
    from hybridrl.parallel.packing import is_varlen, packed_layout

    attn = mb["attention_mask"]
    real = attn.bool()
    if PACK_ROW in mb:
        layout = packed_layout(attn, mb[PACK_ROW], mb[PACK_OFFSET], one_row=is_varlen(model))
        return layout.flat[real], layout.n_rows * layout.width, real
    n = attn.numel()
    return torch.arange(n, device=attn.device).view(attn.shape)[real], n, real


def _training_rows(mb) -> torch.Tensor:
    """(B,) bool: the rows of ``mb`` that train, those with a response token in the loss (every
    row of a micro-batch without a loss mask, such as the drift probe)."""
    if "response_mask" in mb:
        return mb["response_mask"].bool().any(-1)
    return torch.ones(mb["attention_mask"].shape[0], dtype=torch.bool)


class _Share:
    """A micro-batch's weight in its mini-batch's loss, read by the backward: its response tokens
    over the mini-batch's (the totals its runtime noted before the backward)."""

    def __init__(self, runtime: MoETraining, tokens: float):
        self.runtime, self.tokens = runtime, tokens

    def value(self) -> float:
        totals = self.runtime.totals
        if totals is None:
            raise RuntimeError(
                "MoE balancing losses: a backward before the mini-batch's totals were noted "
                "(note_minibatch)"
            )
        return self.tokens / max(float(totals.n_tokens), 1.0)


class _Balanced(torch.autograd.Function):
    """The router's dispatch weights, unchanged; in the backward the layer's balancing ``term`` gets
    the gradient ``share.value()``, as if ``share * term`` were added to the loss. The term joins
    the gradient on the rank that runs the router, whichever pipeline stage that is."""

    @staticmethod
    def forward(ctx, weights, term, share):
        ctx.share = share
        ctx.save_for_backward(term)
        return weights.clone()

    @staticmethod
    def backward(ctx, grad):
        (term,) = ctx.saved_tensors
        return grad, torch.full_like(term, ctx.share.value()), None


class _Forward:
    """The hook of one forward of micro-batch ``mb`` (``places``, ``n``, ``real``: its tokens, as
    :func:`_token_places`): replays ``forced`` (n, layers, k) when given and reports each router
    call to the runtime."""

    def __init__(self, runtime, forced, recorded, mb, places, n, real):
        self.runtime, self.forced, self.recorded = runtime, forced, recorded
        seen = real & _training_rows(mb).to(real.device)[:, None]
        keep = seen[real]  # per real token, in the order of places
        self.seen = torch.zeros(n, dtype=torch.bool, device=places.device)
        self.seen[places[keep]] = True
        self.capture = None
        if runtime is not None and runtime.store is not None and ROW in mb:
            self.capture = (mb[ROW], mb["prompts"].shape[1], places[keep], seen)
        tokens = float(mb["response_mask"].sum()) if "response_mask" in mb else 0.0
        self.share = _Share(runtime, tokens) if runtime is not None else None

    def __call__(self, layer: int, gate: nn.Module, out: tuple, recomputing: bool = False):
        logits, weights, fresh = out
        ids = fresh
        if self.forced is not None:
            if self.forced.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"routing replay: {self.forced.shape[0]} tokens of routing for a forward of "
                    f"{logits.shape[0]} tokens"
                )
            forced = self.forced[:, layer].to(fresh.device, torch.long)
            ids = torch.where((forced >= 0).all(-1, keepdim=True), forced, fresh)
            weights = gate_weights(gate, logits, ids)
        if self.runtime is not None:
            weights = self.runtime.observe(layer, logits, fresh, ids, weights, self, recomputing)
        return logits, weights, ids

    def recompute(self, layer: int, gate: nn.Module, out: tuple):
        """A layer activation checkpointing runs again in the backward: the same experts and the
        same operations (torch checks that the recomputed tensors are the forward's), nothing
        counted twice."""
        return self(layer, gate, out, recomputing=True)


@contextmanager
def moe_forward(model: nn.Module, mb) -> Iterator[None]:
    """Around one forward of micro-batch ``mb``: replay its ``routing`` where ``routing_replay``
    asks (a model marked by :func:`replays_routing`), and let the model's :class:`MoETraining`
    (when attached) observe the routing and add the balancing losses. A no-op for a dense model and
    for an unmarked one (a critic)."""
    runtime = getattr(model, RUNTIME_ATTR, None)
    replays = getattr(model, REPLAYS_ATTR, False)
    if (runtime is None and not replays) or not is_moe(model):
        yield
        return
    places, n, real = _token_places(model, mb)
    recorded = None
    if ROUTING in mb:
        routing = mb[ROUTING]
        recorded = torch.full((n, *routing.shape[2:]), NOT_ROUTED, dtype=routing.dtype)
        recorded = recorded.to(routing.device)
        recorded[places] = routing[real]
    replaying = replays and recorded is not None and REPLAY in mb and bool(mb[REPLAY].any())
    hook = _Forward(runtime, recorded if replaying else None, recorded, mb, places, n, real)
    with gate_hooks(model, hook):
        yield


class MoETraining:
    """The policy's MoE state: loads, balancing losses, the expert bias, R2's capture, health."""

    def __init__(self, model: nn.Module, cfg):
        self.model, self.cfg = model, cfg
        self.n_layers, self.n_experts, self.top_k = routing_shape(model)
        shape = (self.n_layers, self.n_experts)
        self.counts = torch.zeros(shape, dtype=torch.float64)  # this step's update forwards
        self.bias_loads = torch.zeros(shape, dtype=torch.float64)  # since the last optimizer step
        self.changed, self.compared = 0, 0
        # this step's balancing losses: sums over (micro-batch, layer) of tokens x aux, tokens x z,
        # tokens (a micro-batch's response tokens)
        self.balance = torch.zeros(3, dtype=torch.float64)
        self.losses_on = cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0
        self.totals = None  # the running mini-batch's totals (AggTotals), noted before backward
        has_bias = cfg.bias_update_rate > 0
        self.bias = ExpertBias(model, cfg.bias_update_rate) if has_bias else None
        self.health = RoutingHealth(cfg.health_max_mean_threshold, cfg.health_empty_steps)
        self.store: torch.Tensor | None = None  # R2: the old-policy pass's routing
        self.prompt_width = 0
        self.probe: tuple[torch.Tensor, torch.Tensor] | None = None
        self.probe_ids: torch.Tensor | None = None

    # --- batches --------------------------------------------------------------------------------
    def mark(self, batch):
        """The step's batch with its replay marks (``r3``: every row) and, for ``r2``, the row ids
        and an empty store for the old-policy pass to fill."""
        mode, rows = self.cfg.routing_replay, len(batch)
        batch[REPLAY] = torch.full((rows,), int(mode == "r3" and ROUTING in batch))
        if mode == "r2":
            batch[ROW] = torch.arange(rows)
            width = batch["input_ids"].shape[1]
            shape = (rows, width, self.n_layers, self.top_k)
            self.store = torch.full(shape, NOT_ROUTED, dtype=ROUTING_DTYPE)
            self.prompt_width = batch["prompts"].shape[1]
        return batch

    def after_old_pass(self, batch):
        """R2: replay in the update what the old-policy pass routed (when that pass ran)."""
        store, self.store = self.store, None
        if store is not None and bool((store >= 0).any()):
            batch[ROUTING] = store
            batch[REPLAY] = torch.ones(len(batch), dtype=torch.long)
        return batch

    # --- during forwards ------------------------------------------------------------------------
    def observe(
        self, layer, logits, fresh, ids, weights, forward: _Forward, recomputing: bool = False
    ) -> torch.Tensor:
        """One router call of ``forward``: R2's capture in a pass without gradient; in a training
        forward, the loads, the comparison with the recorded routing and the balancing losses (a
        layer ``recomputing`` for activation checkpointing: the losses' operations alone, counted
        by its forward). Returns the dispatch weights (carrying the layer's balancing losses)."""
        if not torch.is_grad_enabled():
            if forward.capture is not None:
                self._capture(layer, fresh, forward.capture)
            return weights
        seen = forward.seen.to(ids.device)
        used = ids[seen]
        if not recomputing:
            count = torch.bincount(used.reshape(-1), minlength=self.n_experts).double().cpu()
            self.counts[layer] += count
            self.bias_loads[layer] += count
        if forward.recorded is not None and not recomputing:
            rec = forward.recorded[:, layer].to(ids.device)[seen].long()
            valid = (rec >= 0).all(-1)
            diff = ~same_sets(fresh[seen][valid], rec[valid])
            self.changed += int(diff.sum())
            self.compared += int(valid.sum())
        if not self.losses_on or not bool(seen.any()):
            return weights
        aux, z = switch_aux_loss(logits[seen], used), router_z_loss(logits[seen])
        tokens = forward.share.tokens
        if not recomputing:
            self.balance += torch.tensor([tokens * aux.item(), tokens * z.item(), tokens])
        # the mean over the whole model's layers, whichever of them this module holds
        term = (self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z) / self.n_layers
        return _Balanced.apply(weights, term, forward.share)

    def _capture(self, layer, fresh, capture) -> None:
        rows, p, places, seen = capture
        width = seen.shape[1]
        out = torch.full((*seen.shape, self.top_k), NOT_ROUTED, dtype=ROUTING_DTYPE)
        seen = seen.cpu()
        out[seen] = fresh[places.to(fresh.device)].to("cpu", ROUTING_DTYPE)
        start = self.prompt_width - p
        trains = seen.any(-1)  # a filler row leaves its source row's capture alone
        self.store[rows.cpu()[trains], start : start + width, layer] = out[trains]

    # --- the loss -------------------------------------------------------------------------------
    def update_bias(self) -> None:
        """After an optimizer step: the bias update from the loads since the previous one."""
        loads = self.bias_loads
        if distributed.world_size() > 1:
            loads = distributed.all_reduce(loads.flatten()).view(loads.shape)
        self.bias.update(loads)
        self.bias_loads.zero_()

    # --- metrics --------------------------------------------------------------------------------
    def step_metrics(self, batch) -> dict[str, float]:
        """The step's ``moe/`` metrics (a collective when the world size is > 1): loads and
        routing comparisons over every rank's training forwards, the balancing losses as their
        token-weighted mean over those forwards and the layers."""
        counts = self.counts
        sums = torch.tensor([self.changed, self.compared, *self.balance.tolist()]).double()
        if distributed.world_size() > 1:
            counts = distributed.all_reduce(counts.flatten()).view(counts.shape)
            sums = distributed.all_reduce(sums)
        changed, compared, aux, z, tokens = sums.tolist()
        self.counts = torch.zeros_like(self.counts)
        self.balance = torch.zeros_like(self.balance)
        self.changed, self.compared = 0, 0
        self.totals = None  # the next step's loss notes its own
        metrics = self.health.step(counts)
        against = "old_pass" if self.cfg.routing_replay == "r2" else "rollout"
        if compared:
            metrics[f"moe/routing_changed_vs_{against}"] = changed / compared
        if self.losses_on:
            metrics["moe/aux_loss"] = aux / tokens if tokens else math.nan
            metrics["moe/z_loss"] = z / tokens if tokens else math.nan
        metrics["moe/routing_changed_vs_previous_version"] = self._probe_drift(batch)
        if self.bias is not None:
            held = float(self.bias.values().abs().max())  # a pipeline rank: its layers' biases
            metrics["moe/bias_abs_max"] = float(distributed.all_reduce([held], op="max")[0])
        return metrics

    @torch.no_grad()
    def _probe_drift(self, batch) -> float:
        """The fraction of the probe's (real token, layer) pairs whose top-k set differs from the
        last step's (the probe: the first rows of the first batch, fixed for the run); NaN the
        first time. A pipelined model's call runs the forward through every rank's stages, each
        rank recording its layers."""
        if self.probe is None:
            rows = slice(0, min(PROBE_ROWS, len(batch)))
            self.probe = (batch["input_ids"][rows].clone(), batch["attention_mask"][rows].clone())
        ids, attn = self.probe
        from hybridrl.learner.logprob import model_device

        device = model_device(self.model)
        ids, attn = ids.to(device), attn.to(device)
        was_training = self.model.training
        self.model.eval()
        with record(self.model) as rec:
            self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                use_cache=False,
            )
        self.model.train(was_training)
        # a pipeline forwards the probe in micro-batches of consecutive rows
        now = torch.cat(rec.forwards())[attn.reshape(-1).bool().cpu()]
        before, self.probe_ids = self.probe_ids, now
        if before is None:
            return float("nan")
        differ = float((~same_sets(now.long(), before.long())).sum())
        differ, pairs = distributed.all_reduce([differ, now.shape[0] * now.shape[1]]).tolist()
        return differ / pairs
