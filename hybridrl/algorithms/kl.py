"""KL estimators between the policy and the reference, per token (Schulman, "Approximating KL divergence").

With ``log_ratio = logp - ref_logp`` (samples drawn from the policy):
k1 = log_ratio, k2 = log_ratio^2 / 2, k3 = exp(-log_ratio) - 1 + log_ratio (>= 0, low variance).
"""
from __future__ import annotations

import torch

from hybridrl.registry import Registry

KL_ESTIMATORS = Registry("KL estimator")
_CLAMP = 20.0  # keep exp() finite for far-off samples


@KL_ESTIMATORS.register("k1")
def k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


@KL_ESTIMATORS.register("k2")
def k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


@KL_ESTIMATORS.register("k3")
def k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    neg = (ref_logp - logp).clamp(-_CLAMP, _CLAMP)
    return (neg.exp() - 1 - neg).clamp(max=10.0)


def kl_penalty(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return KL_ESTIMATORS.get(name)(logp, ref_logp)
