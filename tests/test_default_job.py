"""The default job's promise, end to end: `make test-all` runs it
(a few minutes per case on 2 cores).

The warm start stops on a held-out accuracy target, so RL's room to gain does not depend on where a
fixed step count lands on the steep part of the SFT loss curve (which the CPU's matmul kernels
decide). Each case trains its own warm start, with 1 and 2 torch threads and two seeds.
"""

import json
from pathlib import Path

import pytest

from hybridrl.config import Config, load_config
from hybridrl.driver.loop import train


@pytest.mark.slow
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("threads,seed", [(2, 0), (1, 0), (2, 1), (1, 1)])
def test_default_job_learns(tmp_path, torch_threads, threads, seed):
    torch_threads(threads)
    cfg = load_config(
        Config,
        "examples/arith_grpo.yaml",
        [
            f"trainer.runs_dir={tmp_path}",
            "trainer.progress=false",
            f"sft.checkpoint={tmp_path / 'warmstart'}",
            f"controller.num_threads={threads}",
            f"trainer.seed={seed}",
        ],
    )
    summary = train(cfg)
    sft = json.loads((Path(tmp_path) / "warmstart" / "sft.json").read_text())
    assert sft["target_met"], sft
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.10, summary
    assert summary["greedy_accuracy_after"] >= summary["greedy_accuracy_before"], summary
    assert summary["wall_seconds"] < 15 * 60, summary
