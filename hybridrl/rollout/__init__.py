"""Rollout: one interface (``base.RolloutEngine``), several backends chosen by
``rollout.backend``."""

# importing a backend module registers it; the vllm / sglang adapters import only hybridrl code here
# (their package is imported when one is built)
from hybridrl.rollout.backends import hf as _hf  # noqa: F401
from hybridrl.rollout.backends import native as _native  # noqa: F401
from hybridrl.rollout.backends import sglang as _sglang  # noqa: F401
from hybridrl.rollout.backends import vllm as _vllm  # noqa: F401
from hybridrl.rollout.base import ROLLOUT_BACKENDS, RolloutEngine, SamplingParams

__all__ = ["ROLLOUT_BACKENDS", "RolloutEngine", "SamplingParams"]
