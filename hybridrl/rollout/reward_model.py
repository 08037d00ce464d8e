"""The reward-model role: a sequence-classification checkpoint (``task.reward_model_path``, one
label) that scores ``(prompt text, completion text)`` pairs, data-parallel over its ranks.

A pair is scored as the model's scalar logit at the last token of ``prompt text + completion text``
(the two strings concatenated, then tokenized by the checkpoint's own tokenizer with its special
tokens): what the checkpoint's ``*ForSequenceClassification`` forward pools. The prompt text is the
rendered prompt the policy saw (``Prompt.text``: a chat prompt already rendered by its chat
template), so a reward model trained on the same template sees its own format. Pairs go through the
model in micro-batches of ``task.reward_model_batch_size``, sorted by length and padded on the
right; transformers pools the rightmost token that is not the pad token, so padding does not change
a score. A checkpoint whose config names no pad token is scored one pair at a time (transformers
then pools the last token, and cannot batch).

The rollout ranks call it through :class:`RewardModelClient` (``driver/placement.py`` wires one to
each rollout rank's :class:`~hybridrl.rollout.scoring.Scorer`): the worker object itself when both
live in one process (the ``local`` backend, or one colocated Ray process), a Ray actor otherwise.
Weights: fp32 on the CPU, bf16 on the process's GPU when it has one. Colocated with other roles on
a GPU, :meth:`RewardModelWorker.sleep` moves the weights to host memory and the next call moves
them back.
"""

from __future__ import annotations

import torch

from hybridrl.config import Config
from hybridrl.controller import Dispatch, Worker, WorkerContext, register
from hybridrl.parallel.distributed import compute_device

# the name of the reward model's score among the Scorer's terms: logged as reward/reward_model
SCORE_NAME = "reward_model"


def load_reward_model(path: str, device: torch.device):
    """``(model, tokenizer)`` of the checkpoint at ``path``, in eval mode on ``device`` (bf16 on a
    GPU, fp32 otherwise)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype)
    if model.config.num_labels != 1:
        raise ValueError(
            f"reward model {path!r} has {model.config.num_labels} labels; it needs num_labels=1"
        )
    return model.to(device).eval(), AutoTokenizer.from_pretrained(path)


class RewardModelWorker(Worker):
    def __init__(self, ctx: WorkerContext, cfg: Config):
        super().__init__(ctx)
        self.device = compute_device()
        self.model, self.tokenizer = load_reward_model(cfg.task.reward_model_path, self.device)
        self.pad_id = self.model.config.pad_token_id
        # without a pad token in the model's config transformers pools the last token of an
        # unpadded sequence only: one pair per forward pass
        self.batch_size = cfg.task.reward_model_batch_size if self.pad_id is not None else 1
        self.asleep = False

    @register(Dispatch.DP_COMPUTE)
    def score(self, pairs: list[tuple[str, str]]) -> list[float]:
        """The score of each ``(prompt text, completion text)`` pair, in order."""
        if self.asleep:
            self.wake()
        ids = [self.tokenizer(p + c)["input_ids"] for p, c in pairs]
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        scores = [0.0] * len(ids)
        with torch.no_grad():
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                for i, value in zip(chunk, self._forward([ids[i] for i in chunk])):
                    scores[i] = value
        return scores

    def _forward(self, batch: list[list[int]]) -> list[float]:
        width = max(len(x) for x in batch)
        pad = self.pad_id if self.pad_id is not None else 0
        input_ids = torch.tensor([x + [pad] * (width - len(x)) for x in batch])
        mask = torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in batch])
        logits = self.model(
            input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device)
        ).logits
        return logits[:, 0].float().tolist()

    def sleep(self) -> None:
        """Colocation on a GPU: the weights to host memory while another role has the device."""
        if self.device.type == "cuda" and not self.asleep:
            self.model.to("cpu")
            self.asleep = True

    def wake(self) -> None:
        if self.asleep:
            self.model.to(self.device)
            self.asleep = False


class RewardModelClient:
    """What a rollout rank calls: ``fn(prompts, completions) -> scores`` (the Scorer's batched
    form) on one reward-model rank.

    ``target`` is the :class:`RewardModelWorker` itself (same process) or a Ray actor handle of the
    rank's host; ``route`` is the method path on that host: ``("score",)`` for a group of its own,
    ``("call_role", "reward_model", "score")`` for a rank of a colocated group."""

    def __init__(self, target, route: tuple[str, ...] = ()):
        self.target, self.route = target, route

    def __call__(self, prompts: list, completions: list[str]) -> list[float]:
        pairs = [(p.text, c) for p, c in zip(prompts, completions)]
        if not self.route:
            return self.target.score(pairs)
        import ray

        return ray.get(self.target.call.remote(*self.route, pairs))

    def __repr__(self) -> str:
        where = "in-process" if not self.route else "Ray actor " + ".".join(self.route)
        return f"RewardModelClient({where})"


def attach_reward_model(rollout, clients: list[RewardModelClient], weight: float) -> str:
    """On a rollout rank (``WorkerGroup.apply_all``): add reward-model rank ``rank % len(clients)``
    to the rank's Scorer, which scores the sync batches and the async stream alike. The scorer's
    name for it."""
    client = clients[rollout.rank % len(clients)]
    return rollout.scorer.add_scorer(SCORE_NAME, client, weight)


def attach_colocated(worker, weight: float) -> str:
    """On a rank of a colocated group holding both roles: the rollout part calls the reward-model
    part beside it, in memory."""
    client = RewardModelClient(worker.parts["reward_model"])
    return worker.parts["rollout"].scorer.add_scorer(SCORE_NAME, client, weight)
