"""The package layout: no import cycle between hybridrl's top-level packages (a lazy import inside a
function counts too: it is a dependency all the same)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import hybridrl

ROOT = Path(hybridrl.__file__).parent


def top_level(module: str) -> str | None:
    """``hybridrl.rollout.engine`` -> ``rollout``; None outside hybridrl
    (or the root package itself)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "hybridrl" and len(parts) > 1 else None


def package_imports(root: Path) -> dict[str, dict[str, list[str]]]:
    """{package: {imported package: ["file:line", ...]}} over every module under ``root``."""
    edges: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent)
        source = top_level(".".join(rel.with_suffix("").parts))
        if source is None:
            continue
        package = ".".join(rel.parent.parts)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: resolve against this file's package
                    base = ".".join(
                        package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                    )
                names = (
                    [base] + [f"{base}.{a.name}" for a in node.names]
                    if base == "hybridrl"
                    else [base]
                )
            else:
                continue
            for name in names:
                target = top_level(name)
                if target is not None and target != source:
                    edges[source][target].append(f"{rel}:{node.lineno}")
    return edges


def find_cycle(edges: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle as a list of packages (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, {})):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(edges):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_no_import_cycle_between_top_level_packages():
    edges = package_imports(ROOT)
    assert edges, "no imports found: the scan is broken"
    cycle = find_cycle(edges)
    if cycle:
        sites = [f"{a} -> {b}: {', '.join(edges[a][b][:3])}" for a, b in zip(cycle, cycle[1:])]
        raise AssertionError("import cycle between top-level packages:\n  " + "\n  ".join(sites))


def test_the_cycle_finder_finds_a_planted_cycle(tmp_path):
    """The check above can fail: two packages that import each other are
    reported, with the import sites."""
    pkg = tmp_path / "hybridrl"
    for name, imports in {
        "alpha": "from hybridrl.beta import x",
        "beta": "import hybridrl.gamma.y",
        "gamma": "from hybridrl.alpha import z",
        "delta": "from hybridrl import alpha",
    }.items():
        (pkg / name).mkdir(parents=True)
        (pkg / name / "__init__.py").write_text(f"{imports}\n")
    edges = package_imports(pkg)
    assert edges["delta"]["alpha"] == ["hybridrl/delta/__init__.py:1"]
    cycle = find_cycle(edges)
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"alpha", "beta", "gamma"}
    (pkg / "gamma" / "__init__.py").write_text("import os\n")
    assert find_cycle(package_imports(pkg)) is None


def test_the_learner_and_the_rollout_never_import_each_other():
    """They meet through ``protocol.py`` (Sample, the LoRA entry names, the buffer's message) and
    ``sampling.py`` (SamplingParams and the one filter both sample and recompute log-probs with),
    never directly, in either direction (the rollout's own imports of learner code would tie the
    engine to the trainer's internals)."""
    edges = package_imports(ROOT)
    assert edges["learner"], "no imports found: the scan is broken"
    assert "rollout" not in edges["learner"], edges["learner"]["rollout"]
    assert "learner" not in edges["rollout"], edges["rollout"]["learner"]
    # the scan sees such an import where one exists: the driver imports both
    assert {"rollout", "learner"} <= edges["driver"].keys()


def test_the_transformers_floor_is_the_version_ci_tests():
    """pyproject.toml's lowest transformers is the one ``make test-floor`` installs and tests."""
    import re

    root = ROOT.parent
    floor = re.search(r'"transformers>=([\d.]+)', (root / "pyproject.toml").read_text())
    tested = re.search(r"^TRANSFORMERS_FLOOR := ([\d.]+)$", (root / "Makefile").read_text(), re.M)
    assert floor and tested, "pyproject.toml or the Makefile lost the floor"
    assert tested.group(1).removesuffix(".0") == floor.group(1).removesuffix(".0")


# the config fields only a decoder's shape has; the model spec reads them for everyone
SHAPE_FIELDS = ("num_key_value_heads", "num_experts_per_tok", "moe_intermediate_size", "head_dim")
# the built-in sizes set them, the precision cache keys on the model's shape
SHAPE_WRITERS = {"models/spec.py", "models/factory.py", "parallel/precision.py"}


def test_one_module_reads_a_decoders_shape_from_its_config():
    """Every part that needs a decoder's shape (the engine, the memory estimator, FLOP accounting,
    the expert-parallel check) gets it from ``models/spec.py``: none reads the fields itself."""
    readers = set()
    for path in ROOT.rglob("*.py"):
        text = path.read_text()
        if any(f'"{field}"' in text for field in SHAPE_FIELDS):
            readers.add(path.relative_to(ROOT).as_posix())
    assert readers <= SHAPE_WRITERS, sorted(readers - SHAPE_WRITERS)


def test_the_spec_estimates_any_decoder_and_the_engine_runs_the_listed_families():
    from transformers import MistralConfig, Qwen3MoeConfig

    from hybridrl.models.spec import ModelSpec

    mistral = ModelSpec.from_config(MistralConfig(num_hidden_layers=2))
    assert (mistral.family, mistral.num_kv_heads, mistral.head_dim, mistral.moe) == (
        None,
        8,
        128,
        None,
    )
    with pytest.raises(ValueError, match="native rollout supports .*qwen3_moe.* not 'mistral'"):
        mistral.require_family("native rollout")
    moe = ModelSpec.from_config(Qwen3MoeConfig(num_hidden_layers=4, mlp_only_layers=[1]))
    assert moe.require_family("native rollout").family == "qwen3_moe"
    assert moe.moe.sparse_layers == (True, False, True, True) and moe.num_moe_layers == 3
