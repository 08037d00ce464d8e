"""Pipeline-parallel actor runtime: the policy update and the log-prob passes through
``torch.distributed.pipelining``.

The actor's ranks form a (dp x pp) mesh: global rank ``d * pp + s`` is pipeline rank s of data
parallel replica d. The ranks of one replica hold the same rows and the stages of one model
(``pipeline_stages.py``); the replicas' stages are sharded with FSDP2 over the dp dimension.

A mini-batch (this replica's rows of the global mini-batch, drawn exactly as ``learner/update.py``
draws them) is trimmed to its longest row, padded with empty rows (``response_mask`` 0) and run as
one or more *rounds*, each one schedule step of ``n_microbatches`` equal micro-batches under the
token budget (replicas run as many rounds as the busiest one, for FSDP2's collectives). The last
stage computes the RL loss of each micro-batch: response log-probs under the rollout's filters from
the logits (``logits_log_probs`` in ``learner/pipeline_update.py``, as ``response_log_probs``),
then the caller's objective with the global mini-batch totals, so the micro-batches' losses sum to
the mini-batch loss; the schedules run with ``scale_grads=False`` (their gradients are the exact
sum, not the mean). The loss function gets the rows of its micro-batch as its target (a tensor of
indices into the round's batch), which holds every per-row column the loss reads.

The log-prob passes run the same stages forward-only (:meth:`Pipeline.forward_round`, a wavefront
of our own: torch's multi-stage schedules run backward actions even in ``eval``) on the rounds the
next update's first epoch would cut, and broadcast the (B, R) log-probs from the last stage to every
rank of the replica.

Around every micro-batch's forward of a stage, in training rounds and forward-only ones alike, the
pipeline enters the caller's context ``around(modules, mb)`` with the rows of that micro-batch (the
learner's MoE hooks: routing replay, loads, balancing losses, ``learner/moe.py``); the forward that
a fresh schedule runs once on the first micro-batch to infer shapes stays outside it.

Idle time: every stage's forward, backward and weight-gradient actions and the loss are timed
(:class:`ComputeClock`); a rank's idle fraction is 1 - compute / wall time of the schedule steps.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import pipelining as pipe

from hybridrl.parallel import distributed
from hybridrl.parallel.pipeline_stages import (
    PLACEMENTS,
    build_stages,
    gather_full_weights,
    is_tied,
    load_full_weights,
)
from hybridrl.protocol import Batch

# schedule name -> (torch schedule class, takes a list of stages)
SCHEDULES = {
    "gpipe": (pipe.ScheduleGPipe, False),
    "1f1b": (pipe.Schedule1F1B, False),
    "interleaved_1f1b": (pipe.ScheduleInterleaved1F1B, True),
    "zbv": (pipe.ScheduleZBVZeroBubble, True),
    "dualpipev": (pipe.ScheduleDualPipeV, True),
}


@dataclass(frozen=True)
class PipeLayout:
    """This rank's place in the (dp x pp) mesh and the schedule's shape."""

    pp: int
    dp: int
    rank: int
    schedule: str = "1f1b"
    microbatches: int = 0  # 0: twice the number of stages

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp

    @property
    def n_stages(self) -> int:
        return self.pp * PLACEMENTS[self.schedule].stages_per_rank

    @property
    def n_microbatches(self) -> int:
        return self.microbatches or 2 * self.n_stages

    def stages_of(self, pp_rank: int) -> list[int]:
        return PLACEMENTS[self.schedule].stages_of(pp_rank, self.pp)

    def holder(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        return next(r for r in range(self.pp) if stage in self.stages_of(r))


def check_layout(world: int, pp: int, schedule: str, microbatches: int, n_layers: int) -> None:
    """A clear error for a pipeline that cannot run."""
    if schedule not in SCHEDULES:
        raise ValueError(f"actor.pp_schedule: unknown {schedule!r} (known: {', '.join(SCHEDULES)})")
    if world % pp:
        raise ValueError(
            f"actor.pp_size={pp} does not divide the actor's world size {world} "
            "(the ranks form a data-parallel x pp_size mesh)"
        )
    layout = PipeLayout(pp, world // pp, 0, schedule, microbatches)
    n = layout.n_stages
    if n_layers < n:
        raise ValueError(
            f"the model has {n_layers} decoder layers, fewer than the {n} pipeline stages of "
            f"actor.pp_size={pp} with {schedule} (every stage needs a layer)"
        )
    if PLACEMENTS[schedule].shape == "v" and world > pp:
        raise ValueError(
            f"actor.pp_schedule={schedule} with data parallelism (world size {world}, "
            f"pp_size {pp}): its split backward (input gradients first, weight gradients later) "
            "does not compose with FSDP2's gradient reduction here; use 1f1b, gpipe or "
            "interleaved_1f1b, or pp_size equal to the world size"
        )
    if PLACEMENTS[schedule].shape == "v" and layout.n_microbatches < n:
        raise ValueError(
            f"actor.pp_schedule={schedule} needs at least as many micro-batches as stages "
            f"({n}), got actor.pp_microbatches={layout.n_microbatches}"
        )


class ComputeClock:
    """Seconds this rank spent in stage compute (forward, backward, weight gradients, loss) and in
    schedule steps (wall). Wraps the stages' compute methods, so waiting for a peer is not
    counted."""

    METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")

    def __init__(self):
        self.busy, self.wall = 0.0, 0.0

    def wrap(self, stage) -> None:
        for name in self.METHODS:
            setattr(stage, name, self.timed(getattr(stage, name)))

    def timed(self, fn):
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.busy += time.perf_counter() - t0

        return run

    def pop(self) -> tuple[float, float]:
        out, (self.busy, self.wall) = (self.busy, self.wall), (0.0, 0.0)
        return out


def _no_context(modules, mb):
    return contextlib.nullcontext()


class StageModules(nn.ModuleList):
    """A rank's stages as one module: their parameters (the optimizer's, checks, moves), the full
    model's ``config`` (FLOPs accounting reads the model's shape), and a call like the model's, a
    forward-only pass through the whole pipeline (a collective: every rank of the replica calls,
    each running its stages) whose logits come back on the rank holding the last stage (None on
    the others); positions come from the attention mask, as every stage rebuilds them."""

    def __init__(self, pipeline: Pipeline):
        super().__init__(pipeline.stages)
        self.config = pipeline.config
        self.pipeline = pipeline

    def forward(self, input_ids, attention_mask, position_ids=None, use_cache=False):
        return self.pipeline.forward_logits(input_ids, attention_mask)


class Pipeline:
    """This rank's stages of ``model`` and the machinery to run them (see the module docstring).
    ``mesh``: the pipelined :class:`~hybridrl.parallel.mesh.ModelMesh` of the learner's
    ``ParallelDims`` (None: built here for ``layout``, without expert parallelism); FSDP2 shards
    the stages over its ``dp`` dimension when dp > 1, with ``fsdp_cfg``, and splits their experts
    over its ``ep`` dimension when it has one (``parallel/ep_fsdp.py``). ``around(modules, mb)``:
    the context around each micro-batch's forward of a stage (``modules``: this rank's
    :class:`StageModules`, ``mb``: the micro-batch's rows of the round batch); none by default."""

    def __init__(
        self, model, layout: PipeLayout, device=None, mesh=None, fsdp_cfg=None, around=None
    ):
        check_layout(
            layout.pp * layout.dp,
            layout.pp,
            layout.schedule,
            layout.microbatches,
            len(model.model.layers),
        )
        self.layout, self.device = layout, device or torch.device("cpu")
        if mesh is None:
            from hybridrl.parallel.mesh import ParallelDims

            mesh = ParallelDims(layout.pp * layout.dp, layout.pp, 1, self.device.type).pipelined
        self.mesh, self.pp_group = mesh, mesh.pp.get_group()
        self.config, self.tied = model.config, is_tied(model)
        self.stages = build_stages(model, layout.stages_of(layout.pp_rank), layout.n_stages)
        for stage in self.stages:
            stage.to(self.device)
        for stage in self.stages:
            if mesh.ep is not None:  # moe.ep_size: experts split over the replicas' ranks
                from hybridrl.config import FSDPConfig
                from hybridrl.parallel.ep_fsdp import shard_with_experts

                layers = stage.decoder_layers()
                shard_with_experts(stage, layers, mesh, fsdp_cfg or FSDPConfig(), self.device)
            elif layout.dp > 1:
                from hybridrl.parallel.fsdp import shard_modules

                shard_modules(stage, stage.decoder_layers(), mesh.dp, fsdp_cfg, self.device)
        self.tie_group = self._tie_group()
        self.clock = ComputeClock()
        self.modules = StageModules(self)
        self.around = around or _no_context

    # --- parameters ---------------------------------------------------------------------------
    def parameters(self):
        """The stages' parameters as the optimizer holds them: sharded, with their gradients
        (:meth:`reshard` first)."""
        self.reshard()
        return [p for s in self.stages for p in s.parameters()]

    def reshard(self) -> None:
        """Put every FSDP2 unit of the stages back in its sharded state. A stage's root unit
        stays gathered after a forward, and while it is, the module holds its unsharded
        parameters, which carry no gradient."""
        from torch.distributed.fsdp import FSDPModule

        for stage in self.stages:
            for module in stage.modules():
                if isinstance(module, FSDPModule):
                    module.reshard()

    def train(self, mode: bool = True):
        for s in self.stages:
            s.train(mode)

    def _tie_group(self):
        """The two ranks of each replica holding a tied weight's copies (the first and the last
        stage) when they differ; every rank takes part in making every replica's group."""
        lay = self.layout
        first, last = lay.holder(0), lay.holder(lay.n_stages - 1)
        if first == last or not self.tied:
            return None
        mine = None
        for d in range(lay.dp):
            group = dist.new_group([d * lay.pp + first, d * lay.pp + last])
            mine = group if d == lay.dp_rank else mine
        return mine

    def _tied_pair(self):
        first = next((s for s in self.stages if s.is_first), None)
        last = next((s for s in self.stages if s.is_last and s.head_is_copy), None)
        return (
            first.embed_tokens.weight if first is not None else None,
            last.head.weight if last is not None else None,
        )

    @torch.no_grad()
    def sync_tied_grads(self) -> None:
        """Both copies of a tied weight get the sum of their gradients (see pipeline_stages.py)."""
        embed, head = self._tied_pair()
        if embed is not None and head is not None:  # both on this rank (V-shaped schedules)
            total = _local(embed.grad) + _local(head.grad)
            _local(embed.grad).copy_(total)
            _local(head.grad).copy_(total)
        elif self.tie_group is not None and (embed is not None or head is not None):
            dist.all_reduce(
                _local((embed if embed is not None else head).grad), group=self.tie_group
            )

    def clip_grad_norm(self, max_norm: float) -> float:
        """The global gradient norm (over every stage and replica; a tied weight once), then
        every gradient scaled so it is at most ``max_norm`` (0: measure only)."""
        _, head = self._tied_pair()
        from hybridrl.parallel.fsdp import grad_norm

        counted = [p.grad for p in self.parameters() if p.grad is not None and p is not head]
        sq = grad_norm(counted).detach().double().cpu() ** 2
        sq = sq.to(distributed._device_of_group())
        dist.all_reduce(sq, group=self.pp_group)
        total = float(sq.sqrt().item())
        if max_norm and math.isfinite(total) and total > max_norm:
            coef = max_norm / (total + 1e-6)
            for p in self.parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        return total

    # --- running the schedule -----------------------------------------------------------------
    def _schedule(self, loss_fn, rb: Batch):
        """A schedule over fresh stage wrappers for round batch ``rb`` (their activation shapes
        are inferred from the first micro-batch, so every round may have its own width)."""
        cls, multi = SCHEDULES[self.layout.schedule]
        stages = []
        for stage in self.stages:
            ps = pipe.PipelineStage(
                stage, stage.index, self.layout.n_stages, self.device, group=self.pp_group
            )
            self._enter_around(ps, rb)
            self.clock.wrap(ps)
            stages.append(ps)
        n = self.layout.n_microbatches
        return cls(stages if multi else stages[0], n, loss_fn=loss_fn, scale_grads=False)

    def _microbatch_rows(self, n_rows: int) -> list[torch.Tensor]:
        """The rows of each micro-batch of a round of ``n_rows`` (as the schedules split it)."""
        return list(torch.arange(n_rows).tensor_split(self.layout.n_microbatches))

    def _enter_around(self, ps, rb: Batch) -> None:
        """Run ``ps``'s micro-batch forwards inside ``around`` (its shape inference stays out)."""
        run, rows = ps.forward_one_chunk, self._microbatch_rows(len(rb))

        def forward_one_chunk(chunk, *args, **kwargs):
            with self.around(self.modules, rb.index(rows[chunk])):
                return run(chunk, *args, **kwargs)

        ps.forward_one_chunk = forward_one_chunk

    def run_round(self, rb: Batch, loss_fn) -> None:
        """One training schedule step over the round batch ``rb`` (rows a multiple of
        n_microbatches); ``loss_fn(output, rows)`` on the last stage, rows indexing ``rb``.

        A fresh schedule infers the shapes of the backward by calling the loss once, before the
        micro-batches, on placeholder activations: that call is answered with a zero loss of the
        output (no metrics, no finiteness check); the count is checked afterwards.

        Gradients add up over the rounds of a mini-batch. The shape inference of a sharded stage
        runs a real forward and backward and then drops every gradient of the stage (torch 2.13:
        ``_post_metadata_inference_cleanup``), the earlier rounds' too; so they are set aside
        during the step and added back after it."""
        kept = [(p, p.grad) for p in self.parameters() if p.grad is not None]
        for p, _ in kept:
            p.grad = None
        calls = [0]

        def guarded(output, rows):
            calls[0] += 1
            if calls[0] == 1:
                return output.float().sum() * 0.0
            return loss_fn(output, rows)

        schedule = self._schedule(self.clock.timed(guarded), rb)
        args, kwargs = self._inputs(rb)
        t0 = time.perf_counter()
        schedule.step(*args, target=torch.arange(len(rb)), return_outputs=False, **kwargs)
        self.clock.wall += time.perf_counter() - t0
        for p, grad in kept:
            p.grad = grad if p.grad is None else grad.add_(p.grad)
        if self.holds_last() and calls[0] != self.layout.n_microbatches + 1:
            raise RuntimeError(
                f"pipeline: the schedule called the loss {calls[0]} times for "
                f"{self.layout.n_microbatches} micro-batches (expected one shape-inference call "
                "first): this torch version runs the schedules differently"
            )

    def _inputs(self, rb: Batch):
        attn = rb["attention_mask"]
        kwargs = dict(attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0))
        kwargs = {k: v.to(self.device) for k, v in kwargs.items()}
        args = (rb["input_ids"].to(self.device),) if self.layout.pp_rank == 0 else ()
        return args, kwargs

    @torch.no_grad()
    def forward_round(self, rb: Batch, consume) -> None:
        """Forward only over ``rb`` in n_microbatches micro-batches, stage by stage, each
        micro-batch's activations sent on as soon as they are computed (the torch schedules all
        run backward actions, even in ``eval``, on multi-stage ranks): ``consume(logits, rows)`` on
        the rank holding the last stage."""
        lay, args, kwargs = self.layout, *self._inputs(rb)
        rows = [r for r in self._microbatch_rows(len(rb)) if len(r)]
        kw = [{k: v[r.to(v.device)] for k, v in kwargs.items()} for r in rows]
        mine = {s.index: s for s in self.stages}
        base = lay.dp_rank * lay.pp
        held: dict[int, torch.Tensor] = {}  # micro-batch -> activations handed to the next stage
        sends = []
        for s in range(lay.n_stages):
            if s not in mine:
                continue
            prev = lay.holder(s - 1) if s else lay.pp_rank
            for m, r in enumerate(rows):
                if s == 0:
                    x = args[0][r.to(args[0].device)]
                elif prev == lay.pp_rank:
                    x = held.pop(m)
                else:
                    shape = (len(r), rb["input_ids"].shape[1], self.config.hidden_size)
                    x = torch.empty(shape, device=distributed._device_of_group())
                    dist.recv(x, src=base + prev, group=self.pp_group)
                    x = x.to(self.device)
                with self.around(self.modules, rb.index(r)):
                    y = mine[s](x, **kw[m])
                if s == lay.n_stages - 1:
                    consume(y, r)
                elif lay.holder(s + 1) == lay.pp_rank:
                    held[m] = y
                else:
                    out = y.float().to(distributed._device_of_group()).contiguous()
                    sends.append(dist.isend(out, dst=base + lay.holder(s + 1), group=self.pp_group))
        for work in sends:
            work.wait()

    @torch.no_grad()
    def forward_logits(self, input_ids, attention_mask) -> torch.Tensor | None:
        """Forward only over the rows of ``input_ids``: their logits (B, T, V) on the rank holding
        the last stage, None on the others (every rank of the replica calls)."""
        parts = []
        rb = Batch({"input_ids": input_ids, "attention_mask": attention_mask})
        self.forward_round(rb, lambda logits, rows: parts.append(logits))
        return torch.cat(parts) if parts else None

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` as the rank holding the last stage has it, on every rank of the replica."""
        src = self.layout.dp_rank * self.layout.pp + self.layout.holder(self.layout.n_stages - 1)
        t = t.to(distributed._device_of_group())
        dist.broadcast(t, src=src, group=self.pp_group)
        return t.cpu()

    def holds_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    def full_weights(self) -> dict[str, torch.Tensor]:
        """The full model's weights by transformers name on global rank 0 (``{}`` elsewhere);
        every rank calls."""
        return gather_full_weights(self.stages, list(range(self.layout.pp)))

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        load_full_weights(self.stages, weights)

    def idle_fraction(self) -> float:
        """1 - compute / wall time of the schedule steps since the last call, mean over ranks (a
        collective)."""
        busy, wall = self.clock.pop()
        mine = 1.0 - busy / wall if wall > 0 else 0.0
        return float(distributed.all_reduce([mine])[0].item()) / distributed.world_size()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t
