"""bench/pipeline.py: its JSON (simulated figures next to Table 2, the real run's fields null with a
reason when the measuring module is missing or fails) and its timeline PNG."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "bench" / "pipeline.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


BENCH = load_bench()


def test_json_and_png(tmp_path, capsys):
    out = BENCH.main(
        ["--no-measure", "--pp", "2,4", "--schedules", "1f1b,zbv,dualpipev"]
        + ["--png-dir", str(tmp_path), "--png-pp", "2"]
    )
    assert capsys.readouterr().out.strip().startswith("{")
    one, dv = out["schedules"]["1f1b"]["pp4"], out["schedules"]["dualpipev"]["pp4"]
    assert one["bubble_sim"] == one["bubble_formula"] == 9.0  # (4 - 1)(1 + 2)
    assert dv["bubble_sim"] == dv["bubble_formula"] == 3.0  # (8/2 - 1)(1.5 + 1 - 1.5), half stages
    assert dv["stages"] == 8 and dv["param_copies"] == 2 and dv["peak_activations"] == 9
    assert out["schedules"]["zbv"]["pp4"]["bubble_formula"] is None
    assert dv["bubble_measured"] is None and dv["measure_error"] == "--no-measure"
    assert out["dualpipev_below_1f1b"] == {
        "pp": 4,
        "n_microbatches": 8,
        "simulated": True,
        "measured": None,
    }
    png = Path(out["schedules"]["dualpipev"]["pp2"]["png"])
    assert png == tmp_path / "pipeline_dualpipev.png" and png.stat().st_size > 1000
    assert "png" not in dv


def test_a_failing_real_run_is_recorded_not_raised():
    def broken(schedule, pp, n_microbatches):
        raise RuntimeError("rank 0 log\n...\nValueError: no process group\n")

    row = BENCH.measured(broken, None, "1f1b", 2, 8)
    assert row == {
        "bubble_measured": None,
        "stage_idle_measured": None,
        "measure_error": "RuntimeError: ValueError: no process group",
    }

    def fine(schedule, pp, n_microbatches):
        return {"bubble_measured": 0.25, "stage_idle": [0.2, 0.3]}

    row = BENCH.measured(fine, None, "1f1b", 2, 8)
    assert row["bubble_measured"] == 0.25 and row["stage_idle_measured"] == [0.2, 0.3]


def test_unknown_schedule_rejected():
    with pytest.raises(SystemExit):
        BENCH.main(["--no-measure", "--schedules", "nope"])
