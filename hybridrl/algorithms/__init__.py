"""Algorithm registries: advantage estimators, policy losses, KL estimators.

Adding an algorithm is a decorated function; the driver never branches on names.
"""
from hybridrl.algorithms.advantages import ADVANTAGES, compute_advantages
from hybridrl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from hybridrl.algorithms.losses import POLICY_LOSSES, masked_mean

__all__ = ["ADVANTAGES", "KL_ESTIMATORS", "POLICY_LOSSES", "compute_advantages", "kl_penalty", "masked_mean"]
