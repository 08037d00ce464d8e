"""The learner: the trained models of a run (policy, reference, critic) and the learning step,
with what it is built from (log-probs, the update loop, reward shaping, metrics, role
checkpoints, LoRA)."""

from hybridrl.learner.learner import Learner

__all__ = ["Learner"]
