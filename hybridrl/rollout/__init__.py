"""Rollout: one interface (``base.RolloutEngine``), several backends chosen by ``rollout.backend``."""
from hybridrl.rollout.base import ROLLOUT_BACKENDS, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.rollout.backends import hf as _hf  # noqa: F401  (registers "hf")

__all__ = ["ROLLOUT_BACKENDS", "GenerationRequest", "RolloutEngine", "SamplingParams"]
from hybridrl.rollout.backends import native as _native  # noqa: F401,E402  (registers "native")
