"""Algorithm registries: advantage estimators, policy losses (``losses.py``, ``losses_more.py``,
``losses_logp.py``), loss aggregation, KL estimators.

Adding an algorithm is a decorated function; the driver never branches on names.
"""

# registers cispo, gmpo, clip_cov, kl_cov, sapo; reinforce, dro, dppo_tv, dppo_kl
from hybridrl.algorithms import losses_logp, losses_more  # noqa: F401
from hybridrl.algorithms.advantages import (
    ADVANTAGES,
    compute_advantages,
    group_normalise,
    group_rows,
    masked_whiten,
    overlong_penalty,
    token_level_scores,
)
from hybridrl.algorithms.aggregation import LOSS_AGG, AggTotals, agg_totals
from hybridrl.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)
from hybridrl.algorithms.losses import POLICY_LOSSES, value_loss
from hybridrl.algorithms.masking import masked_mean

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGG",
    "POLICY_LOSSES",
    "AdaptiveKLController",
    "AggTotals",
    "FixedKLController",
    "agg_totals",
    "apply_kl_penalty",
    "compute_advantages",
    "group_normalise",
    "group_rows",
    "kl_penalty",
    "masked_mean",
    "masked_whiten",
    "overlong_penalty",
    "token_level_scores",
    "value_loss",
]
