"""Token log-probs of responses under a causal LM, in micro-batches under a token budget.

Layout (veRL-style): ``input_ids = prompts (left-padded) ++ responses
(right-padded)``, ``attention_mask`` marks real tokens, ``response_mask``
marks real response tokens. Log-prob of response token t comes from the
logits at position P + t - 1.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridrl.protocol import Batch


def micro_batches(batch: Batch, token_budget: int) -> list[Batch]:
    """Consecutive slices whose padded size (rows x width) stays within ``token_budget`` (at least one row)."""
    width = batch["input_ids"].shape[1]
    rows = max(1, token_budget // max(width, 1))
    return batch.split(rows)


def response_log_probs(model, mb: Batch, temperature: float = 1.0, with_entropy: bool = False):
    """(log_probs, entropy or None), each (B, R), zero where ``response_mask`` is 0."""
    input_ids, attn = mb["input_ids"], mb["attention_mask"]
    resp_len = mb["responses"].shape[1]
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=False).logits
    logits = logits[:, -resp_len - 1 : -1].float()
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    logp_all = F.log_softmax(logits, dim=-1)
    mask = mb["response_mask"].to(logp_all.dtype)
    logp = logp_all.gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1) * mask
    entropy = None
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    return logp, entropy


@torch.no_grad()
def batch_log_probs(model, batch: Batch, token_budget: int, temperature: float = 1.0) -> torch.Tensor:
    model.eval()
    parts = [response_log_probs(model, mb, temperature)[0] for mb in micro_batches(batch, token_budget)]
    return torch.cat(parts, 0)
