"""Expert routing of transformers mixture-of-experts models: find the routers, record the experts
they choose, and force given choices (routing replay).

Every supported MoE block calls its router (``mlp.gate``) on the flattened tokens of the forward,
``(N, hidden)``, and the router returns ``(router_logits, top_k_weights, top_k_ids)``; the block
then dispatches each token to its ``top_k_ids`` with ``top_k_weights``. A forward hook on the router
sees those three tensors, so routing is read and replaced there without touching the model's code:

* :func:`record` collects each forward's ``top_k_ids`` per layer (:class:`RoutingRecorder`);
* :func:`replay` returns, for given ids, ``(logits, weights, ids)`` where the weights come from the
  *current* router logits at the forced ids (normalised as the family does). The output then
  depends on the router's weights as it would with those ids chosen freshly, so the router keeps
  its gradient; only the discrete choice is fixed.

Families differ in how the top-k weights are normalised (the router of each entry of the model
spec's family table, ``models/spec.py``: ``MOE_FAMILIES``): Qwen2-MoE and
Qwen3-MoE divide by their sum only when ``norm_topk_prob`` is set (Qwen2-MoE's default is off),
Mixtral always does. Ids are stored as int16, with :data:`NOT_ROUTED` (-1) for a token that has no
recorded routing (padding, a response's last token): replay leaves those tokens to the router.

Layers: routing data is indexed by MoE layer, the routers in the whole model's order. A module that
holds only some of them (a pipeline stage) knows each one's place from :func:`number_gates`, run on
the whole model before it is cut: :func:`gate_layers` and :func:`routing_shape` read it, so hooks,
recordings and counts use the whole model's layer numbers on every stage.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

# a token without recorded routing (padding; the last response token, never fed to the model)
NOT_ROUTED = -1
ROUTING_DTYPE = torch.int16


def moe_gates(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (one per MoE layer; dense layers have none): modules of
    a router class of the model spec's family table."""
    from hybridrl.models.spec import ROUTER_FAMILIES  # here: the models package loads transformers

    return [m for m in model.modules() if type(m).__name__ in ROUTER_FAMILIES]


def is_moe(model: nn.Module) -> bool:
    return bool(moe_gates(model))


# on a router: (its MoE layer, the MoE layers of its whole model), set by number_gates
LAYER_ATTR = "hybridrl_moe_layer"


def number_gates(model: nn.Module) -> None:
    """Mark each router of the whole ``model`` with its layer and the layer count, so that a part
    of the model (a pipeline stage) keeps the whole model's numbering; idempotent."""
    gates = moe_gates(model)
    for i, gate in enumerate(gates):
        setattr(gate, LAYER_ATTR, (i, len(gates)))


def gate_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer, router)`` of every router ``model`` holds, in layer order: the numbers of
    :func:`number_gates` when set, else the routers' order in ``model``."""
    gates = moe_gates(model)
    return [(getattr(g, LAYER_ATTR, (i, len(gates)))[0], g) for i, g in enumerate(gates)]


def routing_shape(model: nn.Module) -> tuple[int, int, int]:
    """(MoE layers of the whole model, experts, top-k) of an MoE model or a part of one."""
    gates = moe_gates(model)
    if not gates:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router")
    n_layers = getattr(gates[0], LAYER_ATTR, (0, len(gates)))[1]
    return n_layers, int(gates[0].weight.shape[0]), int(gates[0].top_k)


def gate_weights(gate: nn.Module, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The dispatch weights of experts ``ids`` (N, k) under ``logits`` (N, E), as the router's
    family computes them for its own choice: softmax probabilities at the ids, renormalised when the
    family does. Differentiable in ``logits``."""
    from hybridrl.models.spec import ROUTER_FAMILIES

    family = ROUTER_FAMILIES[type(gate).__name__]
    weights = torch.softmax(logits.float(), dim=-1).gather(-1, ids)
    if family.normalises(gate):
        weights = weights / weights.sum(-1, keepdim=True)
    return weights.to(logits.dtype) if family.cast_weights else weights


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per token (rows of (N, k)): whether ``a`` and ``b`` choose the same set of experts."""
    return (a.sort(-1).values == b.sort(-1).values).all(-1)


GateHook = Callable[[int, nn.Module, tuple], tuple | None]
# on a router while gate_hooks runs: (its layer, the hook), for activation checkpointing to find
HOOK_ATTR = "hybridrl_gate_hook"


@contextmanager
def _hooked(hooks: list[tuple[int, nn.Module, GateHook]]) -> Iterator[None]:
    """Each ``(layer, gate, fn)``: ``fn(layer, gate, out)`` as a forward hook on ``gate``."""
    handles = [
        gate.register_forward_hook(lambda mod, args, out, layer=layer, fn=fn: fn(layer, mod, out))
        for layer, gate, fn in hooks
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def gate_hooks(model: nn.Module, fn: GateHook) -> Iterator[list[nn.Module]]:
    """``fn(layer, gate, (logits, weights, ids))`` as a forward hook on every router while the
    block runs (``layer``: :func:`gate_layers`); a tuple it returns replaces the router's output
    (what the MoE block dispatches). A layer that activation checkpointing recomputes in the
    backward, after the block, gets the hook again (:func:`checkpoint_context`)."""
    layers = gate_layers(model)
    before = [getattr(gate, HOOK_ATTR, None) for _, gate in layers]
    for layer, gate in layers:
        setattr(gate, HOOK_ATTR, (layer, fn))
    try:
        with _hooked([(layer, gate, fn) for layer, gate in layers]):
            yield [gate for _, gate in layers]
    finally:
        for (_, gate), hook in zip(layers, before):
            setattr(gate, HOOK_ATTR, hook)


def checkpoint_context(model: nn.Module) -> Callable[[], tuple]:
    """The ``context_fn`` of torch's (non-reentrant) activation checkpointing for ``model``'s
    layers: a layer the backward runs again routes as its forward did. Torch calls it as each
    checkpointed layer's forward begins; it notes the hooks on the routers then (:func:`gate_hooks`:
    a replay's forced experts, the training runtime's observer) and returns the contexts of that
    forward (nothing) and of its recomputation, which puts the same hooks back while the layer runs
    again, each as its ``recompute`` where it has one (what happens once per forward, counting
    loads or recording, happens in the forward only). Without it the recomputed router would choose
    afresh: other experts than the forward's, under replay or a moved selection."""
    gates = moe_gates(model)

    def context() -> tuple:
        hooks = [getattr(gate, HOOK_ATTR, None) for gate in gates]
        again = [
            (hook[0], gate, getattr(hook[1], "recompute", hook[1]))
            for gate, hook in zip(gates, hooks)
            if hook is not None
        ]
        return nullcontext(), _hooked(again)

    return context


class RoutingRecorder:
    """Each router call's ``top_k_ids`` (on the CPU, int16), per layer, in call order."""

    def __init__(self, layers: list[int]):
        self.calls: dict[int, list[torch.Tensor]] = {layer: [] for layer in sorted(layers)}

    def __call__(self, layer: int, gate: nn.Module, out: tuple) -> None:
        self.calls[layer].append(out[2].detach().to("cpu", ROUTING_DTYPE))

    def recompute(self, layer: int, gate: nn.Module, out: tuple) -> None:
        """A layer recomputed in the backward: its forward's call was recorded already."""

    def forwards(self) -> list[torch.Tensor]:
        """One (N, layers, k) tensor per recorded forward of the model (the layers it holds, in
        order)."""
        calls = list(self.calls.values())
        n = len(calls[0]) if calls else 0
        if any(len(c) != n for c in calls):
            raise RuntimeError("routing recorder: the layers recorded different numbers of calls")
        return [torch.stack([c[i] for c in calls], 1) for i in range(n)]


@contextmanager
def record(model: nn.Module) -> Iterator[RoutingRecorder]:
    """Record the experts every forward inside the block chooses (``.forwards()`` afterwards)."""
    recorder = RoutingRecorder([layer for layer, _ in gate_layers(model)])
    with gate_hooks(model, recorder):
        yield recorder


class Replayer:
    """Forces ``expert_ids`` (N, layers, k) on the next forwards; tokens whose ids hold
    :data:`NOT_ROUTED` keep the router's own choice."""

    def __init__(self, expert_ids: torch.Tensor):
        self.expert_ids = expert_ids

    def __call__(self, layer: int, gate: nn.Module, out: tuple) -> tuple:
        logits, _, fresh = out
        if self.expert_ids.shape[0] != logits.shape[0]:
            raise ValueError(
                f"routing replay: {self.expert_ids.shape[0]} tokens of routing for a forward of "
                f"{logits.shape[0]} tokens"
            )
        forced = self.expert_ids[:, layer].to(fresh.device, torch.long)
        routed = (forced >= 0).all(-1, keepdim=True)
        ids = torch.where(routed, forced, fresh)
        return logits, gate_weights(gate, logits, ids), ids


@contextmanager
def replay(model: nn.Module, expert_ids: torch.Tensor) -> Iterator[Replayer]:
    """Every forward inside the block dispatches each token to ``expert_ids`` (N, layers, k), with
    weights from the current router logits (the router still gets gradients)."""
    replayer = Replayer(expert_ids)
    with gate_hooks(model, replayer):
        yield replayer
