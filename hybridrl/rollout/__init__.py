"""Rollout: one interface (``base.RolloutEngine``), several backends chosen by ``rollout.backend``."""

from hybridrl.rollout.backends import hf as _hf  # noqa: F401  (registers "hf")
from hybridrl.rollout.base import ROLLOUT_BACKENDS, GenerationRequest, RolloutEngine, SamplingParams

__all__ = ["ROLLOUT_BACKENDS", "GenerationRequest", "RolloutEngine", "SamplingParams"]
from hybridrl.rollout.backends import native as _native  # noqa: F401,E402  (registers "native")

# vllm / sglang adapters: registering them imports only hybridrl code; the package itself is imported when one is built
from hybridrl.rollout.backends import sglang as _sglang  # noqa: F401,E402
from hybridrl.rollout.backends import vllm as _vllm
