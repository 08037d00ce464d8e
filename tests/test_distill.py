"""Draft distillation: the agreement formula, and a distilled draft is
accepted more often by the engine."""

import copy
import random

import pytest
import torch
from test_rollout_spec import Tok, qwen, rcfg

from hybridrl.cli import main
from hybridrl.driver.distill import agreement, distill_draft
from hybridrl.protocol import Sample
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.native import NativeRollout


def test_agreement_is_the_acceptance_probability_of_rejection_sampling():
    g = torch.Generator().manual_seed(0)
    logits_p, logits_q = (
        torch.randn(5, 7, 30, generator=g) * 3,
        torch.randn(5, 7, 30, generator=g) * 3,
    )
    lp, lq = logits_p.log_softmax(-1), logits_q.log_softmax(-1)
    p, q = lp.double().exp(), lq.double().exp()
    accept = (q * torch.clamp(p / q, max=1.0)).sum(-1)  # E_{x~q}[min(1, p(x)/q(x))]
    assert torch.allclose(agreement(lp, lq).double(), accept, atol=1e-6)
    assert torch.allclose(agreement(lp, lq).double(), 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(agreement(lp, lp), torch.ones(5, 7))


def spec_acceptance(target, draft, prompts) -> float:
    eng = NativeRollout(target, Tok(), rcfg(), draft_model=draft)
    spec = eng.engine.speculative
    spec.choose_k = lambda batch_size: spec.max_k  # speculate on every eligible step
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5, ignore_eos=True)
    eng.generate([Sample(prompt_ids=p, uid=f"r{i}") for i, p in enumerate(prompts)], params)
    stats = eng.stats()
    assert stats["engine/spec_steps"] > 0  # the acceptance below was measured
    return stats["engine/spec_acceptance"]


def test_distilled_draft_is_accepted_more_often_by_the_engine():
    target, draft = qwen(40, 64, 2, 0, 8.0), qwen(40, 32, 1, 1, 8.0)
    rng = random.Random(0)
    prompts = [[rng.randint(3, 39) for _ in range(rng.randint(2, 6))] for _ in range(40 * 16 + 24)]
    before = copy.deepcopy(draft)
    res = distill_draft(
        target, draft, Tok(), prompts[:640], steps=40, batch_size=16, lr=3e-3, max_new_tokens=12
    )
    assert res["kl_last"] < 0.5 * res["kl_first"]
    assert 1 - res["agreement_last"] < 0.5 * (
        1 - res["agreement_first"]
    )  # rejections per token halved at least
    held_out = prompts[640:]
    a0, a1 = spec_acceptance(target, before, held_out), spec_acceptance(target, draft, held_out)
    assert 1 - a1 < 0.6 * (1 - a0), (a0, a1)


def test_distill_draft_rejects_bad_input():
    target, draft = qwen(40, 64, 2, 0), qwen(41, 32, 1, 1)
    with pytest.raises(ValueError, match="vocabulary"):
        distill_draft(target, draft, Tok(), [[3, 4]] * 4, steps=2, batch_size=2, lr=1e-3)
    with pytest.raises(ValueError, match="need 4 prompts"):
        distill_draft(target, qwen(40, 32, 1, 1), Tok(), [[3, 4]], steps=2, batch_size=2, lr=1e-3)
    with pytest.raises(ValueError, match="steps and batch_size"):
        distill_draft(
            target, qwen(40, 32, 1, 1), Tok(), [[3, 4]] * 4, steps=0, batch_size=2, lr=1e-3
        )
    with pytest.raises(ValueError, match="temperature"):
        distill_draft(
            target,
            qwen(40, 32, 1, 1),
            Tok(),
            [[3, 4]] * 4,
            steps=2,
            batch_size=2,
            lr=1e-3,
            temperature=0,
        )


def test_cli_distills_a_draft_into_a_checkpoint(tmp_path, capsys):
    from hybridrl.models.factory import build_model
    from hybridrl.tasks import TASKS

    tok = TASKS.get("arith")(seed=0).tokenizer()
    build_model("tiny", tok, 3).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    out = tmp_path / "draft"
    assert (
        main(
            [
                "distill-draft",
                str(tmp_path / "target"),
                "tiny",
                str(out),
                "--steps",
                "2",
                "--batch-size",
                "4",
            ]
        )
        == 0
    )
    assert (out / "config.json").is_file() and '"agreement_last"' in capsys.readouterr().out
    assert (
        main(["distill-draft", str(tmp_path / "target"), "tiny", str(out)]) == 2
    )  # never overwrites
    assert "not empty" in capsys.readouterr().err
    assert main(["distill-draft", str(tmp_path / "nowhere"), "tiny", str(tmp_path / "d2")]) == 2
    assert "config.json missing" in capsys.readouterr().err
    assert main(["distill-draft", str(tmp_path / "target"), "huge", str(tmp_path / "d3")]) == 2
    assert (
        "neither a checkpoint directory nor a built-in size (tiny, small)"
        in capsys.readouterr().err
    )
