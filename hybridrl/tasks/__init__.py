"""Tasks (prompt streams, held-out sets, warm-start examples) and reward functions."""

# register "arith", "reverse", "exact_match", "math_verify", "task_default",
# "calc", "calc_answer" and the environment "calc_tool"
from hybridrl.tasks import arithmetic, calc, mathverify, mix, reverse  # noqa: F401
from hybridrl.tasks.base import REWARDS, TASKS, Prompt, Task, compute_reward
from hybridrl.tasks.tokenizer import build_char_tokenizer, encode_text

__all__ = [
    "Prompt",
    "Task",
    "TASKS",
    "REWARDS",
    "compute_reward",
    "build_char_tokenizer",
    "encode_text",
]
