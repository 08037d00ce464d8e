"""Random RL batches for the tests that compare ranks, layouts or passes against one process."""

from __future__ import annotations

import torch

from hybridrl.protocol import Batch


def prompt_response_batch(
    g: torch.Generator, vocab: int, n: int, prompt_len: int, resp_len: int
) -> Batch:
    """``n`` rows of a left-padded prompt (2..prompt_len tokens) ++ a right-padded response
    (1..resp_len tokens), token ids in [3, vocab), drawn from ``g`` (callers keep drawing from it
    for their other columns): prompts, responses, input_ids, attention_mask, response_mask."""
    p_len = torch.randint(2, prompt_len + 1, (n,), generator=g)
    r_len = torch.randint(1, resp_len + 1, (n,), generator=g)
    pmask = (torch.arange(prompt_len) >= prompt_len - p_len[:, None]).long()
    rmask = (torch.arange(resp_len) < r_len[:, None]).long()
    prompts = torch.randint(3, vocab, (n, prompt_len), generator=g) * pmask
    responses = torch.randint(3, vocab, (n, resp_len), generator=g) * rmask
    return Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": torch.cat([pmask, rmask], 1),
            "response_mask": rmask.float(),
        }
    )
