"""The trajectory buffer of asynchronous training, with AReaL's staleness control at admission.

Rollout ranks ask it for prompts (:meth:`TrajectoryBuffer.admit`) and put finished, scored groups
into it (:meth:`put`); the learner takes training batches from it (:meth:`get_batch`). Under the
``ray`` backend it is a threaded Ray actor, so trajectories go rollout -> buffer -> learner and
never through the driver; under ``local`` it is a plain object shared by threads.

Units: one *group* = the ``G`` samples of one prompt; a step trains ``B`` groups. With ``v`` the
rollout's weight version and ``k`` = ``max_staleness``, a new prompt is admitted only while

    (k + v + 1) * B - (accepted + running) > 0

(accepted: groups finished since the run began, trained or waiting; running: groups generating),
so at most ``(k + v + 1) * B`` groups were ever started by the time version ``v`` exists. A group
admitted at version ``a`` must then be trained by version ``a + k`` (its deadline; its oldest token
is at least ``a``). The admission rule alone does not ensure that: when the learner fills a batch
with younger groups while older ones are still generating, too many old ones can fall due at once.
So the learner training version ``s`` takes the ``B`` ready groups with the earliest deadlines (in
prompt order among equal ones), but
only if every group left (ready or generating) can still be trained by its deadline in the steps
after ``s`` (for every ``t``: groups due by ``t`` <= ``(t - s) * B``); otherwise it waits for more
to finish. With both rules no sample is trained more than ``k`` versions after its first token and
none is thrown away for being stale; ``k = 0`` gives on-policy batches.

Resume: :meth:`state` holds the prompt cursor and the prompts admitted but not yet trained
(generating or waiting); a resumed buffer hands those out again first, so no prompt is skipped
and no trajectory is trained twice.
"""

from __future__ import annotations

import threading
from collections import deque

from hybridrl.protocol import REPLACING, Sample
from hybridrl.rollout.group_hooks import DynamicSampling

# the scored samples of one prompt; metadata: "index" (stream position), "admitted"
Group = list[Sample]


def _index(group: Group) -> int:
    return group[0].metadata["index"]


def _admitted(group: Group) -> int:
    return group[0].metadata["admitted"]


class TrajectoryBuffer:
    def __init__(
        self,
        batch_groups: int,
        max_staleness: int,
        cursor: int = 0,
        pending: list[int] | tuple = (),
        trained_groups: int = 0,
        sampling: DynamicSampling | None = None,
    ):
        self.B, self.k = batch_groups, max_staleness
        self.sampling = sampling  # dynamic sampling (DAPO): drops uniform groups as they are put
        self.cursor = cursor  # next fresh prompt index
        self.retry = deque(pending)  # prompts admitted before a restart but never trained
        self.consumed = trained_groups
        self.running: dict[int, int] = {}  # prompt index -> admission version
        self.ready: list[Group] = []
        self.cond = threading.Condition()
        self.closed = ""  # why, once closed
        self.paused = ""  # why, while a dead rollout is replaced (driver/replace.py)

    # --- rollout side ---------------------------------------------------------------------------
    def capacity(self, version: int) -> int:
        return (self.k + version + 1) * self.B - (
            self.consumed + len(self.ready) + len(self.running)
        )

    def admit(self, want: int, version: int) -> list[int]:
        """Up to ``want`` prompt indices the caller may start generating with weights
        ``version``."""
        with self.cond:
            n = max(0, min(want, self.capacity(version))) if not (self.closed or self.paused) else 0
            out = [self.retry.popleft() for _ in range(min(n, len(self.retry)))]
            fresh = n - len(out)
            out += range(self.cursor, self.cursor + fresh)
            self.cursor += fresh
            self.running.update((i, version) for i in out)
            return out

    def put(self, group: Group) -> None:
        with self.cond:
            if self.running.pop(_index(group), None) is None:
                if _index(group) in self.retry:  # handed out again: a replaced rollout's late group
                    return
                raise KeyError(
                    f"group for prompt {_index(group)} was never admitted (or was put twice)"
                )
            # a group dropped by dynamic sampling is not trained and not handed out again: its
            # place goes to another prompt
            if self.sampling is None or self.sampling.keep(group):
                self.ready.append(group)
            self.cond.notify_all()

    # --- learner side ---------------------------------------------------------------------------
    def _pick(self, version: int) -> list[Group] | None:
        """The batch for ``version``, or None while training now could force a later sample past its
        deadline."""
        if len(self.ready) < self.B:
            return None
        # earliest deadline (admitted + k) first, then in prompt order (not the order the groups
        # finished in: a batch's order does not depend on the engine's timing)
        self.ready.sort(key=lambda g: (_admitted(g), _index(g)))
        left = sorted([_admitted(g) for g in self.ready[self.B :]] + list(self.running.values()))
        # after this step, steps version+1 .. t take (t - version) * B groups: enough for those due
        # by t?
        if any(i + 1 > (adm + self.k - version) * self.B for i, adm in enumerate(left)):
            return None
        return self.ready[: self.B]

    def get_batch(self, version: int, timeout: float) -> list[Sample]:
        """The samples of the ``B`` groups to train weights ``version`` on, group by group (blocks
        until they are ready)."""
        with self.cond:
            if not self.cond.wait_for(
                lambda: self.closed or self.paused or self._pick(version) is not None, timeout
            ):
                raise TimeoutError(
                    f"no training batch for version {version} within {timeout:.0f} s "
                    f"({len(self.ready)} groups ready, {len(self.running)} generating, "
                    f"B = {self.B}): "
                    "is the rollout alive? (asynchronous.batch_timeout_s)"
                )
            if self.closed:
                raise RuntimeError(f"the trajectory buffer was closed: {self.closed}")
            if self._pick(version) is None:
                raise RuntimeError(f"{REPLACING}: {self.paused}")
            batch, self.ready = self.ready[: self.B], self.ready[self.B :]
            self.consumed += self.B
            return [sample for group in batch for sample in group]

    # --- control ----------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        with self.cond:
            out = {
                "buffer/ready_groups": float(len(self.ready)),
                "buffer/generating_groups": float(len(self.running)),
                "buffer/trained_groups": float(self.consumed),
            }
            return out | (self.sampling.stats() if self.sampling is not None else {})

    def state(self) -> dict:
        """What a checkpoint needs: the cursor, the admitted, untrained prompts, oldest first, and
        dynamic sampling's credit."""
        with self.cond:
            pending = sorted(set(self.retry) | set(self.running) | {_index(g) for g in self.ready})
            out = {
                "prompt_cursor": self.cursor,
                "pending_prompts": pending,
                "trained_groups": self.consumed,
            }
            if self.sampling is not None:
                out["sampling_credit"] = self.sampling.credit
            return out

    def interrupt(self, reason: str) -> None:
        """A rollout rank died: admit nothing, hand every generating prompt out again (first, oldest
        first; the partial samples are never put), and stop a waiting learner with ``REPLACING``
        unless a batch is ready, until :meth:`unpause`."""
        with self.cond:
            self.paused = reason
            self.retry = deque(sorted(set(self.retry) | set(self.running)))
            self.running.clear()
            self.cond.notify_all()

    def interrupted(self) -> str:
        """Why the buffer is paused ("" when it is not)."""
        return self.paused

    def unpause(self) -> None:
        with self.cond:
            self.paused = ""

    def close(self, reason: str = "the run ended") -> None:
        """Wake a waiting learner with an error, and admit nothing more."""
        with self.cond:
            self.closed = reason
            self.cond.notify_all()


class BufferHandle:
    """Calls a :class:`TrajectoryBuffer` the same way whether it is a local object or a Ray actor
    (blocking calls); picklable when it wraps an actor, so workers can be handed one."""

    def __init__(self, target):
        self.target = target

    def __getattr__(self, name: str):
        if name == "target":  # not set yet (unpickling)
            raise AttributeError(name)
        method = getattr(self.target, name)
        if not hasattr(method, "remote"):
            return method
        import ray

        return lambda *args, **kwargs: ray.get(method.remote(*args, **kwargs))

    def kill(self) -> None:
        if hasattr(getattr(self.target, "close", None), "remote"):
            import ray

            ray.kill(self.target, no_restart=True)


def make_buffer(backend: str, **kwargs) -> BufferHandle:
    """A trajectory buffer in-process (``local``) or a threaded Ray actor with no CPU (``ray``)."""
    if backend != "ray":
        return BufferHandle(TrajectoryBuffer(**kwargs))
    import ray

    return BufferHandle(
        ray.remote(TrajectoryBuffer).options(max_concurrency=16, num_cpus=0).remote(**kwargs)
    )
