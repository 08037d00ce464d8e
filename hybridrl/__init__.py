"""hybridrl: reinforcement-learning post-training of LLMs with a single controller.

``hybridrl.train(config, reward_funcs=..., train_dataset=...)`` is the Python entry point
(:mod:`hybridrl.api`); ``hybridrl train CONFIG`` the command line (:mod:`hybridrl.cli`).
"""

from hybridrl.api import make_config, train

__all__ = ["make_config", "train"]
