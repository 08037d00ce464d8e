"""Rollout: one interface (``base.RolloutEngine``), several backends chosen by ``rollout.backend``."""
from hybridrl.rollout.base import ROLLOUT_BACKENDS, GenerationRequest, RolloutEngine, SamplingParams
from hybridrl.rollout.backends import hf as _hf  # noqa: F401  (registers "hf")

__all__ = ["ROLLOUT_BACKENDS", "GenerationRequest", "RolloutEngine", "SamplingParams"]
from hybridrl.rollout.backends import native as _native  # noqa: F401,E402  (registers "native")
# vllm / sglang adapters: registering them imports only hybridrl code; the package itself is imported when one is built
from hybridrl.rollout.backends import sglang as _sglang, vllm as _vllm  # noqa: F401,E402
