"""bench/agentic.py: the tool latency distribution it reports is calc_tool's own seeded draws."""

import importlib.util
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[1] / "bench" / "agentic.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_agentic", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_latency_distribution_is_lognormal_around_the_median():
    d = _bench().latency_distribution(sigma=1.0, draws=4000)
    assert d["p50_s"] == pytest.approx(0.2, rel=0.1)
    # a long tail: mean above the median (exp(sigma^2 / 2) = 1.65x), p99 about 10x the median
    assert d["mean_s"] == pytest.approx(0.2 * 1.65, rel=0.1)
    assert d["p50_s"] < d["p90_s"] < d["p99_s"] <= d["max_s"]
    assert d["p99_s"] == pytest.approx(0.2 * 10.2, rel=0.2)


def test_sigma_zero_is_a_fixed_latency():
    d = _bench().latency_distribution(sigma=0.0, draws=100)
    assert d["p50_s"] == d["max_s"] == pytest.approx(0.2)


def test_share_past_the_deadline_matches_the_lognormal_tail():
    # P(latency > 5 s) = P(z > ln(25) / 1.5) = 1.6 % at median 0.2 s, shape 1.5
    d = _bench().latency_distribution(sigma=1.5, draws=4000, deadline_s=5.0)
    assert d["past_deadline_frac"] == pytest.approx(0.016, abs=0.006)
    assert _bench().latency_distribution(sigma=1.5, draws=100)["past_deadline_frac"] is None
