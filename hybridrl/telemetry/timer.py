"""Wall-clock timing of the phases of a training step.

Usage::

    timer = PhaseTimer()
    for step in ...:
        with timer.phase("rollout"):
            ...
        with timer.phase("update"):
            with timer.phase("forward"):   # nesting of different names is fine
                ...
        metrics.update(timer.pop())        # {"timing/rollout": s, ..., "timing/step": s}

With ``spans`` (a :class:`~hybridrl.telemetry.timeline.SpanLog`) every phase is also recorded as a
span ``<prefix><name>`` of the run's timeline (wall-clock start and end).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext


class PhaseTimer:
    """Accumulates wall seconds per named phase between two :meth:`pop` calls.

    * A phase entered several times before the next ``pop`` adds up.
    * Phases with *different* names may nest; each one measures its own wall
      time (so nested phases overlap and their sum can exceed the step time).
    * Re-entering a phase that is already open raises ``RuntimeError`` (it
      would count the same seconds twice).
    * A phase still open when ``pop`` is called contributes the time elapsed
      so far; the rest is attributed to the next step.

    ``clock`` is injectable for tests; it defaults to :func:`time.perf_counter`. ``spans``: where
    each phase also goes as a timeline span named ``prefix + name``.
    """

    PREFIX = "timing/"

    def __init__(
        self, clock: Callable[[], float] = time.perf_counter, spans=None, prefix: str = ""
    ):
        self._clock = clock
        self._spans, self._span_prefix = spans, prefix
        self._totals: dict[str, float] = defaultdict(float)
        self._open: dict[str, float] = {}  # phase name -> start time
        self._step_start = clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Context manager timing one occurrence of phase ``name``."""
        if name == "step":
            raise ValueError("'step' is reserved for the whole-step time")
        if name in self._open:
            raise RuntimeError(f"phase {name!r} is already running")
        self._open[name] = self._clock()
        span = (
            self._spans.span(self._span_prefix + name) if self._spans is not None else nullcontext()
        )
        try:
            with span:
                yield
        finally:
            start = self._open.pop(name)
            self._totals[name] += self._clock() - start

    def pop(self) -> dict[str, float]:
        """Return ``{"timing/<phase>": seconds, ..., "timing/step": seconds}``
        for everything since the previous ``pop`` (or construction), and reset."""
        now = self._clock()
        for name, start in self._open.items():  # split open phases at `now`
            self._totals[name] += now - start
            self._open[name] = now
        out = {self.PREFIX + name: secs for name, secs in self._totals.items()}
        out[self.PREFIX + "step"] = now - self._step_start
        self._totals = defaultdict(float)
        self._step_start = now
        return out
