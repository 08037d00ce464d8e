"""Checkpoint integrity (driver/checkpoint.py): a save refuses non-finite weights and keeps the last
good checkpoint; every checkpoint carries a manifest (size and sha256 of each file) and ``--resume``
falls back past a damaged one with one log line; a checkpoint without a manifest is accepted with a
warning; a save that runs out of space raises one clear error and leaves no temporary directory."""

import errno
import json
import logging
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from hybridrl.config import Config, load_config
from hybridrl.driver import checkpoint
from hybridrl.driver.checkpoint import (
    MANIFEST,
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from hybridrl.driver.placement import build_roles
from hybridrl.driver.sync import train

TINY_RUN = [
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=8",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4",
    "trainer.total_steps=2",
    "trainer.eval_every=0",
    "trainer.save_every=1",
    "trainer.keep_checkpoints=2",
    "rollout.max_new_tokens=8",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
]
STATE = {"prompt_cursor": 0, "reference_path": None, "before": {"eval/accuracy": 0.0}}


def make_cfg(work: Path, *extra) -> Config:
    return load_config(
        Config,
        None,
        [
            *TINY_RUN,
            f"sft.checkpoint={work / 'ws'}",
            f"trainer.runs_dir={work / 'runs'}",
            "trainer.name=run",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-step run that saved step_000001 and step_000002; tests damage copies of it."""
    work = tmp_path_factory.mktemp("trained")
    train(make_cfg(work))
    return work


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    shutil.copytree(trained / "runs", tmp_path / "runs")
    return tmp_path / "runs" / "run"


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def damage_warnings(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == checkpoint.__name__ and r.levelno >= logging.WARNING
    ]


def resume_point(run_dir: Path, caplog) -> tuple[Path, list[str]]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        found = latest_checkpoint(run_dir)
    assert found is not None
    return found[0], damage_warnings(caplog)


def test_manifest_lists_every_file_with_size_and_sha256(run_copy):
    ckpt = step_dir(run_copy, 2)
    manifest = json.loads((ckpt / MANIFEST).read_text())
    assert manifest["format"] == 1 and manifest["step"] == 2
    on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {MANIFEST}
    assert set(manifest["files"]) == on_disk
    assert {"trainer.json", "config.yaml", "model/model.safetensors"} <= on_disk
    for rel, entry in manifest["files"].items():
        assert entry["size"] == (ckpt / rel).stat().st_size
        assert checkpoint._hash_file(ckpt / rel) == (entry["size"], entry["sha256"])
    assert verify_checkpoint(ckpt)[0] is None
    assert not list((run_copy / "checkpoints").glob(".tmp-*"))


def test_flipped_byte_falls_back_to_the_previous_checkpoint(run_copy, caplog):
    weights = step_dir(run_copy, 2) / "model" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    found, warnings = resume_point(run_copy, caplog)
    assert found == step_dir(run_copy, 1)
    assert len(warnings) == 1
    assert "step_000002" in warnings[0] and "model/model.safetensors" in warnings[0]
    assert "sha256" in warnings[0] and "\n" not in warnings[0]


def test_resume_trains_on_from_the_checkpoint_that_verifies(trained, run_copy, caplog):
    """End to end: ``--resume`` with the newest checkpoint damaged resumes from the one before."""
    (step_dir(run_copy, 2) / "model" / "train_state.pt").write_bytes(b"")
    cfg = make_cfg(run_copy.parent.parent, f"sft.checkpoint={trained / 'ws'}")
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        summary = train(cfg, resume=True)
    assert summary["resumed_from_step"] == 1
    warnings = damage_warnings(caplog)
    assert len(warnings) == 1 and "train_state.pt is empty" in warnings[0]
    assert verify_checkpoint(step_dir(run_copy, 2))[0] is None  # written again, whole


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("truncate_trainer_json", "trainer.json is truncated"),
        ("truncate_trainer_json_no_manifest", "trainer.json is unreadable"),
        ("missing_key", "trainer.json lacks reference_path"),
        ("missing_file", "model/config.json is missing"),
        ("malformed_manifest", "manifest.json is unreadable"),
    ],
)
def test_damaged_checkpoint_is_reported_once_and_skipped(run_copy, caplog, damage, expected):
    ckpt = step_dir(run_copy, 2)
    trainer_json = ckpt / "trainer.json"
    if damage.startswith("truncate_trainer_json"):
        if damage.endswith("no_manifest"):  # no hash to catch it: the parse does
            (ckpt / MANIFEST).unlink()
        text = trainer_json.read_text()
        trainer_json.write_text(text[: len(text) // 2])
    elif damage == "missing_key":
        # written without reference_path, its manifest consistent with that: the keys are checked
        state = json.loads(trainer_json.read_text())
        del state["reference_path"]
        trainer_json.write_text(json.dumps(state))
        checkpoint.write_manifest(ckpt, 2)
    elif damage == "missing_file":
        (ckpt / "model" / "config.json").unlink()
    elif damage == "malformed_manifest":
        (ckpt / MANIFEST).write_text('{"format": 1, "files": ')
    found, warnings = resume_point(run_copy, caplog)
    assert found == step_dir(run_copy, 1)
    assert len(warnings) == 1, warnings
    assert str(ckpt) in warnings[0] and expected in warnings[0]


def test_checkpoint_without_manifest_is_accepted_with_a_warning(run_copy, caplog):
    (step_dir(run_copy, 2) / MANIFEST).unlink()  # as an older version wrote it
    found, warnings = resume_point(run_copy, caplog)
    assert found == step_dir(run_copy, 2)
    assert len(warnings) == 1 and "no manifest.json" in warnings[0]


def test_every_checkpoint_damaged_gives_no_resume_point(run_copy, caplog):
    for step in (1, 2):
        (step_dir(run_copy, step) / "trainer.json").write_text("")
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        assert latest_checkpoint(run_copy) is None
    assert len(damage_warnings(caplog)) == 2


# --- saving ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    """The built-in tiny policy in a local learner (no warm start), keeping one checkpoint."""
    work = tmp_path_factory.mktemp("roles")
    cfg = make_cfg(work, "trainer.keep_checkpoints=1")
    roles = build_roles(cfg, None, None)
    yield cfg, roles
    roles.shutdown()


def save(cfg, roles, run_dir: Path, step: int) -> Path:
    return save_checkpoint(run_dir, step, roles, STATE | {"step": step}, cfg)


def test_nan_weights_are_refused_and_the_last_good_checkpoint_is_kept(roles, tmp_path):
    cfg, roles = roles
    run_dir = tmp_path / "run"
    good = save(cfg, roles, run_dir, 1)

    def poison(learner, value):
        with torch.no_grad():
            p = next(learner.model.parameters())
            saved = p.detach().clone()
            p.view(-1)[0] = value
        return saved

    saved = roles.learner.apply_all(poison, float("nan"))[0]
    try:
        with pytest.raises(CheckpointError) as err:
            save(cfg, roles, run_dir, 2)
    finally:
        roles.learner.apply_all(lambda w: next(w.model.parameters()).data.copy_(saved))
    message = str(err.value)
    assert "\n" not in message and "step 2" in message and "non-finite" in message
    assert f"the last good checkpoint {good} is kept" in message
    # nothing written, nothing rotated out (keep_checkpoints=1 would have dropped step 1)
    assert list_checkpoints(run_dir) == [good] and verify_checkpoint(good)[0] is None
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert save(cfg, roles, run_dir, 2) == step_dir(run_dir, 2)  # finite again: saved
    assert list_checkpoints(run_dir) == [step_dir(run_dir, 2)]


def half_written_then(exc_of):
    """A ``torch.save`` that writes part of the file, then raises ``exc_of(path)``."""

    def fake_save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"\0" * 1000)
        raise exc_of(str(f))

    return fake_save


def test_disk_full_raises_one_clear_error_and_removes_the_partial_save(
    roles, tmp_path, monkeypatch
):
    cfg, roles = roles
    run_dir = tmp_path / "run"
    good = save(cfg, roles, run_dir, 1)
    enospc = half_written_then(lambda path: OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path))
    monkeypatch.setattr(torch, "save", enospc)
    with pytest.raises(CheckpointError) as err:
        save(cfg, roles, run_dir, 2)
    message = str(err.value)
    assert "\n" not in message and message.startswith("step 2: ")
    assert "no space left on device while writing" in message
    assert "train_state.pt" in message and str(good) in message
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    assert list_checkpoints(run_dir) == [good]
    assert latest_checkpoint(run_dir)[0] == good


def test_torch_write_failure_on_a_full_disk_is_named(roles, tmp_path, monkeypatch):
    """torch's own error when the disk fills inside ``torch.save`` says nothing about space: the
    free space of the checkpoint's filesystem does."""
    cfg, roles = roles
    run_dir = tmp_path / "run"
    save(cfg, roles, run_dir, 1)
    torch_error = half_written_then(
        lambda path: RuntimeError(
            "[enforce fail at inline_container.cc:603] . unexpected pos 4160 vs 4052"
        )
    )
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(torch, "save", torch_error)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 0))
    with pytest.raises(CheckpointError, match="no space left on device while writing"):
        save(cfg, roles, run_dir, 2)
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_driver_side_write_error_names_the_file(roles, tmp_path, monkeypatch):
    cfg, roles = roles
    run_dir = tmp_path / "run"
    real = checkpoint._write_synced

    def failing(path, text):
        if path.name == "config.yaml":
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        real(path, text)

    monkeypatch.setattr(checkpoint, "_write_synced", failing)
    with pytest.raises(CheckpointError) as err:
        save(cfg, roles, run_dir, 1)
    message = str(err.value)
    assert os.strerror(errno.EIO) in message and "config.yaml" in message
    assert "no earlier checkpoint exists" in message
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_rotation_after_a_resume_past_damaged_checkpoints_keeps_the_good_ones(tmp_path):
    """Resumed from step 100 past damaged 190 and 200: saving 110 removes that discarded future
    instead of rotating 100 and 110 out (which would leave only damaged checkpoints)."""
    from hybridrl.driver.checkpoint import list_checkpoints, rotate, step_of

    for step in (100, 190, 200, 110):
        (tmp_path / "checkpoints" / f"step_{step:06d}").mkdir(parents=True)
    rotate(tmp_path, 110, keep=2)
    assert [step_of(c) for c in list_checkpoints(tmp_path)] == [100, 110]
    (tmp_path / "checkpoints" / "step_000120").mkdir()
    rotate(tmp_path, 120, keep=2)
    assert [step_of(c) for c in list_checkpoints(tmp_path)] == [110, 120]
