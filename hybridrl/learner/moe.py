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
finds it there, notes the router logits for the balancing losses, counts expert loads and compares
fresh routing with the recorded one. The reference carries none: it only replays
(:func:`replays_routing`); a critic neither replays nor observes.
"""

from __future__ import annotations

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


class _Forward:
    """The hook of one forward: replays ``forced`` (n, layers, k) when given and reports each
    router call to the runtime."""

    def __init__(self, runtime, forced, recorded, real_flat, capture):
        self.runtime, self.forced, self.recorded = runtime, forced, recorded
        self.real_flat, self.capture = real_flat, capture

    def __call__(self, layer: int, gate: nn.Module, out: tuple):
        logits, _, fresh = out
        ids = fresh
        if self.forced is not None:
            if self.forced.shape[0] != logits.shape[0]:
                raise ValueError(
                    f"routing replay: {self.forced.shape[0]} tokens of routing for a forward of "
                    f"{logits.shape[0]} tokens"
                )
            forced = self.forced[:, layer].to(fresh.device, torch.long)
            ids = torch.where((forced >= 0).all(-1, keepdim=True), forced, fresh)
            out = (logits, gate_weights(gate, logits, ids), ids)
        if self.runtime is not None:
            rec = None if self.recorded is None else self.recorded[:, layer]
            self.runtime.observe(layer, logits, fresh, ids, self.real_flat, rec, self.capture)
        return out if self.forced is not None else None


@contextmanager
def moe_forward(model: nn.Module, mb) -> Iterator[None]:
    """Around one forward of micro-batch ``mb``: replay its ``routing`` where ``routing_replay``
    asks (a model marked by :func:`replays_routing`), and let the model's :class:`MoETraining`
    (when attached) observe the routing. A no-op for a dense model and for an unmarked one (a
    critic)."""
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
    real_flat = torch.zeros(n, dtype=torch.bool, device=places.device)
    real_flat[places] = True
    capture = None
    if runtime is not None and runtime.store is not None and ROW in mb:
        capture = (mb[ROW], mb["prompts"].shape[1], places, real)
    hook = _Forward(runtime, recorded if replaying else None, recorded, real_flat, capture)
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
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # (logits, ids) per layer
        self.losses_on = cfg.aux_loss_coef > 0 or cfg.z_loss_coef > 0
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
    def observe(self, layer, logits, fresh, ids, real_flat, recorded, capture) -> None:
        real = real_flat.to(ids.device)
        if capture is not None and not torch.is_grad_enabled():
            self._capture(layer, fresh, capture)
        if not torch.is_grad_enabled():  # passes without gradient: only R2's capture
            return
        used = ids[real]
        count = torch.bincount(used.reshape(-1), minlength=self.n_experts).double().cpu()
        self.counts[layer] += count
        self.bias_loads[layer] += count
        if recorded is not None:
            rec = recorded.to(ids.device)[real].long()
            valid = (rec >= 0).all(-1)
            diff = ~same_sets(fresh[real][valid], rec[valid])
            self.changed += int(diff.sum())
            self.compared += int(valid.sum())
        if self.losses_on:
            self.pending.append((logits[real], used))

    def _capture(self, layer, fresh, capture) -> None:
        rows, p, places, real = capture
        width = real.shape[1]
        out = torch.full((*real.shape, self.top_k), NOT_ROUTED, dtype=ROUTING_DTYPE)
        out[real.cpu()] = fresh[places.to(fresh.device)].to("cpu", ROUTING_DTYPE)
        start = self.prompt_width - p
        self.store[rows.cpu(), start : start + width, layer] = out

    # --- the loss -------------------------------------------------------------------------------
    def add_losses(self, loss, metrics: dict, mb, totals):
        """``loss`` plus this micro-batch's balancing losses (noted by its forward), weighted by
        its share of the mini-batch's response tokens; their values in ``metrics``."""
        pending, self.pending = self.pending, []
        if not pending:
            return loss, metrics
        aux = torch.stack([switch_aux_loss(lg, ids) for lg, ids in pending]).mean()
        z = torch.stack([router_z_loss(lg) for lg, _ in pending]).mean()
        share = float(mb["response_mask"].sum()) / max(float(totals.n_tokens), 1.0)
        extra = self.cfg.aux_loss_coef * aux + self.cfg.z_loss_coef * z
        metrics = metrics | {"moe/aux_loss": aux.item(), "moe/z_loss": z.item()}
        return loss + share * extra.to(loss.dtype), metrics

    def update_bias(self) -> None:
        """After an optimizer step: the bias update from the loads since the previous one."""
        loads = self.bias_loads
        if distributed.world_size() > 1:
            loads = distributed.all_reduce(loads.flatten()).view(loads.shape)
        self.bias.update(loads)
        self.bias_loads.zero_()

    # --- metrics --------------------------------------------------------------------------------
    def step_metrics(self, batch) -> dict[str, float]:
        """The step's ``moe/`` metrics (a collective when the world size is > 1)."""
        counts, changed, compared = self.counts, self.changed, self.compared
        if distributed.world_size() > 1:
            counts = distributed.all_reduce(counts.flatten()).view(counts.shape)
            changed, compared = distributed.all_reduce([changed, compared]).tolist()
        self.counts = torch.zeros_like(self.counts)
        self.changed, self.compared = 0, 0
        metrics = self.health.step(counts)
        against = "old_pass" if self.cfg.routing_replay == "r2" else "rollout"
        if compared:
            metrics[f"moe/routing_changed_vs_{against}"] = changed / compared
        metrics["moe/routing_changed_vs_previous_version"] = self._probe_drift(batch)
        if self.bias is not None:
            metrics["moe/bias_abs_max"] = float(self.bias.values().abs().max())
        return metrics

    @torch.no_grad()
    def _probe_drift(self, batch) -> float:
        """The fraction of the probe's real tokens whose top-k set differs from the last step's
        (the probe: the first rows of the first batch, fixed for the run); NaN the first time."""
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
        now = rec.forwards()[0][attn.reshape(-1).bool().cpu()]
        before, self.probe_ids = self.probe_ids, now
        if before is None:
            return float("nan")
        return float((~same_sets(now.long(), before.long())).float().mean())
