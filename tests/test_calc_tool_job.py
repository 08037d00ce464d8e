"""W4's promise, end to end (`make test-all`; about 15 minutes per case on 2 cores): the calculator
example's warm start reaches its held-out target measured on whole episodes with the tool, and RL
then gains at least 10 points of sampled held-out accuracy, with 1 and 2 torch threads and two
seeds.

The warm start stops on that target, not after a fixed step count: where a step count lands on the
steep part of the SFT loss curve depends on the CPU's matmul kernels (800 fixed steps gave about
50 % on one machine and 7 % on another, a model that cannot use the tool). The tool answers at once
here, as in ``bench/agentic.py``'s gain run: its latency plays no part in what is learned.
"""

import json
from pathlib import Path

import pytest

from hybridrl.config import Config, load_config
from hybridrl.driver.loop import train


@pytest.mark.slow
@pytest.mark.timeout(2400)
@pytest.mark.parametrize("threads,seed", [(2, 0), (1, 0), (2, 1), (1, 1)])
def test_calc_tool_job_learns(tmp_path, torch_threads, threads, seed):
    torch_threads(threads)
    cfg = load_config(
        Config,
        "examples/calc_tool_grpo.yaml",
        [
            f"trainer.runs_dir={tmp_path}",
            "trainer.progress=false",
            "trainer.eval_every=0",
            "trainer.save_every=0",
            "env.kwargs={latency_s: 0.0}",
            f"sft.checkpoint={tmp_path / 'warmstart'}",
            f"controller.num_threads={threads}",
            f"trainer.seed={seed}",
        ],
    )
    summary = train(cfg)
    sft = json.loads((Path(tmp_path) / "warmstart" / "sft.json").read_text())
    assert sft["target_met"], sft
    assert summary["accuracy_before"] >= 0.3, summary  # the model uses the tool before RL
    assert summary["accuracy_after"] - summary["accuracy_before"] >= 0.10, summary
