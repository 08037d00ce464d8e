"""A reward function for examples/chat_math_grpo.yaml in TRL's batched form: it receives every
sample's completion and, by name, the dataset's columns (here ``unit``, the thing counted)."""


def number_only(completions, unit, **kwargs):
    """1 for a completion that is a bare number, as the prompt asks; -1 for one that names the
    unit ("7 apples"); 0 otherwise. Conversational prompts give completions as chat messages."""
    scores = []
    for completion, thing in zip(completions, unit):
        text = (completion[0]["content"] if isinstance(completion, list) else completion).strip()
        scores.append(1.0 if text.isdigit() else -1.0 if thing in text else 0.0)
    return scores
