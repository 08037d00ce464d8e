"""The default job's promise (issue 2), end to end: `make test-all` runs it (about 4 minutes on 2 cores)."""
import pytest

from hybridrl.config import Config, load_config
from hybridrl.trainers.sync import train


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_default_job_learns(tmp_path):
    cfg = load_config(Config, "examples/arith_grpo.yaml", [f"trainer.runs_dir={tmp_path}", "trainer.progress=false",
                                                          f"sft.checkpoint={tmp_path / 'warmstart'}"])
    summary = train(cfg)
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.10, summary
    assert summary["greedy_accuracy_after"] >= summary["greedy_accuracy_before"], summary
    assert summary["wall_seconds"] < 15 * 60, summary
