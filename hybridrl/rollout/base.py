"""The rollout interface every backend implements.

Prompts go in as prompt :class:`~hybridrl.protocol.Sample` s (``response_ids`` empty, status
``pending``); a prompt's ``uid`` is its request id (seeds, ``abort``).
``generate(prompts, params) -> list[Sample]`` returns ``params.n`` samples per prompt, in prompt
order, each ``prompt.with_response(...)`` (the prompt's metadata kept) with the behaviour log-prob
of every token and the weight version that produced it; a prompt aborted before it ran comes back as
``n`` ``prompt.aborted()`` samples.

Streaming (asynchronous training): ``add(prompts, params)`` queues prompts, ``step()`` advances
generation by one step, ``done(prompt, n)`` says whether all ``n`` samples of a prompt are ready and
``take(prompt, n)`` returns them. Every backend streams: the default implementation runs one
``generate`` per ``step`` over the prompts queued since the last one; the native backend steps its
continuous batch instead, so prompts finish and new ones enter between steps.

``update_weights`` takes an iterator of
``(name, tensor)`` pairs (streamed in buckets by the caller) and a version;
``pause``/``resume``/``abort`` and ``release_memory``/``wake_up`` serve
asynchronous training and colocation.

LoRA: ``update_weights`` recognises adapter entries, ``<module>.lora_A`` (r x in),
``<module>.lora_B`` (out x r) and ``<module>.lora_scaling`` (0-d), and merges
them into the live weight ``<module>.weight`` as ``W_base + scale * B @ A``
(:meth:`RolloutEngine.merge_adapters`). The engine keeps its own copy of the
base weight of every adapted module, so repeated syncs never accumulate; a
full weight for such a module received in a sync becomes its new base (the
actor's first sync sends the base weights, then adapters only). Backends that
override ``update_weights`` pass their stream through ``merge_adapters`` and,
when they have no ``self.model``, implement ``_weight_tensors``. A backend loads
the (checked, merged) stream in ``_load_weights(named_tensors, version)``.

Every ``update_weights`` call is one complete sync of a version (its buckets
arrive as one stream). It is checked when the stream ends: it must carry every
weight of the model by its transformers name (tied aliases count once), or
LoRA adapter entries only; an unknown name or a missing weight raises
:class:`WeightSyncError` naming a few of them. Tensors loaded before the error
stay loaded, so the engine then refuses to generate until a sync succeeds
instead of serving a half-updated model.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from hybridrl.config.convert import ConfigError, from_dict
from hybridrl.protocol import LORA_A, LORA_B, LORA_SCALING, Sample
from hybridrl.registry import Registry
from hybridrl.sampling import SamplingParams

ROLLOUT_BACKENDS = Registry("rollout backend")  # name -> cls(model, tokenizer, cfg: RolloutConfig)

_LORA_SUFFIXES = (LORA_A, LORA_B, LORA_SCALING)
# buffers some checkpoints carry; computed from the config, never synced
_IGNORED = ("rotary_emb.inv_freq",)
_SHOWN = 5  # names quoted in a sync error


class WeightSyncError(ValueError):
    """A weight sync that does not match the rollout model (unknown names, missing weights)."""


class SyncCheck:
    """Follows one sync's stream: drops (and records) unknown names, and when the stream ends raises
    :class:`WeightSyncError` unless it carried every weight (or adapters only).
    ``live`` (name -> tensor) is None when the backend cannot name its weights; names that share
    storage (a tied head) count once."""

    def __init__(self, live: dict[str, torch.Tensor] | None, aliases: Iterable[str] = ()):
        self.known = None if live is None else set(live) | set(aliases)
        groups: dict[tuple, list[str]] = defaultdict(list)
        for name, t in (live or {}).items():
            groups[(t.data_ptr(), tuple(t.shape), t.stride())].append(name)
        self.groups = [sorted(g) for g in groups.values()]

    def stream(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        full: set[str] = set()
        unknown: list[str] = []
        adapters = False
        for name, tensor in named_tensors:
            if name.endswith(_LORA_SUFFIXES):
                adapters = True
            elif name.endswith(_IGNORED):
                continue
            elif self.known is not None and name not in self.known:
                unknown.append(name)
                continue
            else:
                full.add(name)
            yield name, tensor
        self._verify(full, unknown, adapters)

    def _verify(self, full: set[str], unknown: list[str], adapters: bool) -> None:
        problems = []
        if unknown:
            problems.append(
                f"{len(unknown)} name(s) the rollout model does not have: {unknown[:_SHOWN]}"
            )
        if not full and not adapters:
            problems.append("no tensors at all")
        elif full and self.groups:
            missing = sorted(g[0] for g in self.groups if full.isdisjoint(g))
            if missing:
                problems.append(
                    f"{len(missing)} of its {len(self.groups)} weights missing: {missing[:_SHOWN]}"
                )
        if problems:
            example = sorted(self.known)[:3] if self.known else []
            raise WeightSyncError(
                "update_weights: "
                + "; ".join(problems)
                + ". A sync must carry every weight of the "
                f"model by its transformers name (e.g. {example}), or LoRA adapter entries "
                f"(<module>{LORA_A}, {LORA_B}, {LORA_SCALING}) only"
            )


def _by_params(
    queued: list[tuple[Sample, SamplingParams]],
) -> list[tuple[SamplingParams, list[Sample]]]:
    """Queued prompts grouped by equal sampling parameters, in queue order."""
    groups: list[tuple[SamplingParams, list[Sample]]] = []
    for prompt, params in queued:
        for p, prompts in groups:
            if p == params:
                prompts.append(prompt)
                break
        else:
            groups.append((params, [prompt]))
    return groups


class RolloutEngine(ABC):
    """Base of all rollout backends; holds the weight version, pause/abort state and the default
    streaming queue (``add`` / ``step`` / ``done`` / ``take`` over ``generate``)."""

    # the backend's own options (``rollout.backend_options``): a dataclass whose fields are
    # ``hybridrl.registry.option(default, help, ...)``; None: the backend takes none
    options: type | None = None

    @classmethod
    def read_options(cls, cfg) -> Any:
        """``cfg.backend_options`` (a ``RolloutConfig``'s) read into this backend's ``options``
        dataclass: every key checked (unknown keys, types, bounds), the others at their defaults;
        None for a backend that declares no options, which then takes none. The same call checks
        a config before any work (``hybridrl.checks``) and builds the backend's options."""
        given = cfg.backend_options
        if cls.options is None:
            if given:
                raise ConfigError(
                    f"config key 'rollout.backend_options': backend {cls.__name__} declares no "
                    f"options, got {', '.join(map(str, given))}"
                )
            return None
        try:
            return from_dict(cls.options, given, "rollout.backend_options")
        except ConfigError as e:  # which backend's options these are
            raise ConfigError(f"rollout.backend={cfg.backend}: {e}") from None

    def __init__(self) -> None:
        self.version = 0
        self.paused = False
        self._unpaused = threading.Event()  # cleared while paused: step() waits on it
        self._unpaused.set()
        self._stepping = threading.Lock()  # held by a default step() while it generates
        self._aborted: set[str] = set()
        # "<module>.weight" -> its base value (adapted modules)
        self._lora_base: dict[str, torch.Tensor] = {}
        # why the last weight sync failed (the weights may be half-updated)
        self._sync_failure: str | None = None
        self._queue_lock = threading.Lock()
        self._queue: list[tuple[Sample, SamplingParams]] = []  # added, not yet stepped
        self._results: dict[str, list[Sample]] = defaultdict(list)  # uid -> samples ready

    @abstractmethod
    def generate(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """``params.n`` samples per prompt, in prompt order (see the module docstring)."""

    @abstractmethod
    def _load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """Copy tensors into the live weights in place (sync of ``version``); the number loaded."""

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> int:
        # the default streaming step generates under this lock: a sync waits for the call in
        # flight, so every token of one call comes from one version (native syncs under its own)
        with self._stepping:
            count = self.checked_sync(
                named_tensors, lambda stream: self._load_weights(stream, version)
            )
            self.version = version
        return count

    def generate_streamed(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """``generate`` through the streaming interface (:class:`InFlight`): for backends whose
        ``step`` is their own (continuous batching), so that one path serves both modes."""
        flight, out = InFlight(self), {}
        flight.add(prompts, params)
        while flight:
            out |= {id(p): samples for p, samples in flight.step()}
        return [s for p in prompts for s in out[id(p)]]

    # --- streaming --------------------------------------------------------------------------------
    def add(self, prompts: list[Sample], params: SamplingParams) -> list[Sample]:
        """Queue prompts for generation with ``params`` (their seeds come from ``params.seed`` and
        each prompt's uid, as in ``generate``); returns the prompts queued (an aborted one is
        not)."""
        self.check_servable()
        added = [p for p in prompts if p.uid not in self._aborted]
        with self._queue_lock:
            self._queue.extend((p, params) for p in added)
        return added

    def step(self) -> int:
        """Advance generation by one step (waits while paused); returns the number of tokens
        generated. Default: one ``generate`` over the prompts queued so far (one per distinct
        ``params``)."""
        while True:
            self._unpaused.wait()
            with self._stepping:
                if not self._unpaused.is_set():  # paused since: wait again
                    continue
                with self._queue_lock:
                    queued, self._queue = self._queue, []
                tokens = 0
                for params, prompts in _by_params(queued):
                    out, n = self.generate(prompts, params), max(1, params.n)
                    with self._queue_lock:
                        for i, p in enumerate(prompts):
                            self._results[p.uid].extend(out[i * n : (i + 1) * n])
                    tokens += sum(len(s.response_ids) for s in out)
                return tokens

    def done(self, prompt: Sample, n: int) -> bool:
        """Whether the ``n`` samples of an added prompt are ready to :meth:`take` (an aborted prompt
        is done once it has left the engine)."""
        uid = prompt.uid
        with self._queue_lock:
            if len(self._results.get(uid, ())) >= n:
                return True
            return uid in self._aborted and not any(p.uid == uid for p, _ in self._queue)

    def take(self, prompt: Sample, n: int) -> list[Sample]:
        """The ``n`` samples of a prompt that is :meth:`done` (those aborted as
        ``prompt.aborted()``)."""
        with self._queue_lock:
            ready = self._results.pop(prompt.uid, [])
        return ready + [prompt.aborted() for _ in range(n - len(ready))]

    # --- sync checks ------------------------------------------------------------------------------
    def _sync_aliases(self) -> set[str]:
        """Sync names that are not live weights of their own: a head tied to the embedding."""
        config = getattr(getattr(self, "model", None), "config", None)
        return {"lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()

    def checked_sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        load: Callable[[Iterator[tuple[str, torch.Tensor]]], int],
    ) -> int:
        """``load`` the sync's stream (LoRA merged) after :class:`SyncCheck`; a failure is
        remembered, so :meth:`check_servable` refuses generation until a later sync succeeds."""
        try:
            live = self._weight_tensors()
        # the backend cannot name its weights: unknown and missing names go unchecked
        except NotImplementedError:
            live = None
        check = SyncCheck(live, self._sync_aliases())
        try:
            count = load(self.merge_adapters(check.stream(named_tensors)))
        except BaseException as e:
            self._sync_failure = f"{type(e).__name__}: {e}"
            raise
        self._sync_failure = None
        return count

    def check_servable(self) -> None:
        if self._sync_failure is not None:
            raise RuntimeError(
                f"{type(self).__name__}: the last weight sync failed, so the model may be "
                f"half-updated; complete a sync before generating ({self._sync_failure})"
            )

    # --- LoRA -------------------------------------------------------------------------------------
    def _weight_tensors(self) -> dict[str, torch.Tensor]:
        """The live weights by transformers name (read for the base copies of adapted modules)."""
        model = getattr(self, "model", None)
        if model is None:
            raise NotImplementedError(
                f"{type(self).__name__}: LoRA sync needs _weight_tensors() (live weights by name)"
            )
        return dict(model.named_parameters())

    @torch.no_grad()
    def merge_adapters(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The sync stream with adapter entries replaced by merged weights: full weights pass
        through as they come (the consumer loads each before asking for the next); the adapters are
        gathered and, once the stream is exhausted, every adapted module yields
        ``W = W_base + scale * B @ A`` (float32 math, cast to the live dtype). A module's base copy
        is taken from the live weight the first time it is adapted, and again whenever the same sync
        also carried its full weight."""
        adapters: dict[str, dict[str, torch.Tensor]] = defaultdict(dict)
        full: set[str] = set()
        for name, tensor in named_tensors:
            suffix = next((s for s in _LORA_SUFFIXES if name.endswith(s)), None)
            if suffix is None:
                full.add(name)
                yield name, tensor
            else:
                adapters[name[: -len(suffix)]][suffix] = tensor
        stale = full & self._lora_base.keys()
        if not adapters and not stale:
            return
        live = self._weight_tensors()
        for wname in stale:  # a new base (adapters for it, if any, are merged below)
            self._lora_base[wname] = live[wname].detach().clone()
        for module, parts in adapters.items():
            missing = [s for s in _LORA_SUFFIXES if s not in parts]
            if missing:
                raise ValueError(f"LoRA sync: {module!r} lacks {missing}")
            wname = module + ".weight"
            if wname not in live:
                raise KeyError(f"LoRA sync: the rollout model has no weight {wname!r}")
            w = live[wname]
            if wname not in self._lora_base:
                self._lora_base[wname] = w.detach().clone()
            base = self._lora_base[wname]
            a, b = (
                parts[LORA_A].to(w.device, torch.float32),
                parts[LORA_B].to(w.device, torch.float32),
            )
            if (b.shape[0], a.shape[1]) != tuple(w.shape) or b.shape[1] != a.shape[0]:
                raise ValueError(
                    f"LoRA sync: {module}: B {tuple(b.shape)} @ A {tuple(a.shape)} "
                    f"does not fit {tuple(w.shape)}"
                )
            yield wname, (base.float() + float(parts[LORA_SCALING]) * (b @ a)).to(w.dtype)

    def pause(self) -> None:
        """Stop generating between steps; returns once the step in flight (if any) has finished."""
        self._unpaused.clear()
        with self._stepping:
            self.paused = True

    def resume(self) -> None:
        self.paused = False
        self._unpaused.set()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort the prompts with these uids: not started, they are skipped; running, they stop
        (where the backend can stop them) and come back as ``aborted`` samples."""
        self._aborted.update(request_ids)

    def release_memory(self) -> None:  # noqa: B027 (optional: nothing to free without a KV pool)
        """Free the generation memory (KV cache) while the trainer runs (colocation)."""

    def wake_up(self) -> None:  # noqa: B027 (optional, as release_memory)
        """Take back what :meth:`release_memory` freed."""

    def stats(self) -> dict[str, float]:
        return {}

    def close(self) -> None:  # noqa: B027 (optional: an engine in this process needs nothing)
        """Shut the engine down at the end of a run: the processes and files it started."""


class InFlight:
    """The one loop that drives a backend's streaming interface to finished groups: prompts are
    added (``add``), the engine is stepped (``step``), and each prompt's group is taken as soon as
    it is ``done``. The synchronous call (:meth:`RolloutEngine.generate_streamed`), the rollout
    worker's scoring that overlaps generation (``worker_scoring.generate_scored``) and the
    asynchronous stream (``rollout/stream.py``) all drive a backend through it; they differ only in
    what they add when and what they do with each finished group. (An episode,
    ``rollout/episode.py``, is a backend itself: it queues each completion its episodes ask for on
    its inner engine and hands it back when it is done.)"""

    def __init__(self, backend):
        self.backend = backend
        self.pending: list[tuple[Sample, int]] = []  # (prompt, samples it waits for), added order

    def add(self, prompts: list[Sample], params: SamplingParams) -> None:
        """Queue ``prompts``. Each is pending until its group is taken; one aborted already is not
        queued, is done at once and comes back as its aborted samples."""
        self.backend.add(prompts, params)
        self.pending += [(p, max(1, params.n)) for p in prompts]

    def step(self) -> list[tuple[Sample, list[Sample]]]:
        """The groups that are done, taken, in the order their prompts were added; when none is,
        one engine step first."""
        finished = self._take_done()
        if not finished:
            self.backend.step()
            finished = self._take_done()
        return finished

    def _take_done(self) -> list[tuple[Sample, list[Sample]]]:
        finished, keep = [], []
        for p, n in self.pending:
            (finished if self.backend.done(p, n) else keep).append((p, n))
        self.pending = keep
        return [(p, self.backend.take(p, n)) for p, n in finished]

    def __len__(self) -> int:
        return len(self.pending)
