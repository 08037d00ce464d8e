"""Checkpoint integrity (driver/checkpoint.py): a save refuses non-finite weights and keeps the last
good checkpoint; every checkpoint carries a manifest (size and sha256 of each file) and ``--resume``
falls back past a damaged one with one log line; a checkpoint without a manifest is checked for
damage it can show (truncation, a zip CRC) and otherwise stops ``--resume`` with one line until it
is sealed or deleted; a save that runs out of space, meets an immutable directory or a symbolic link
loop raises one clear error (or replaces the link), leaves no temporary directory and keeps the
older checkpoints whole; every file of a checkpoint is readable by others (0644 under umask 022).

The faults are real where the machine allows: a small tmpfs for a full disk and ``chattr +i`` for an
immutable directory (both need root; the tests skip without it)."""

import errno
import json
import logging
import os
import shutil
import subprocess
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
from hybridrl.driver.loop import train
from hybridrl.driver.placement import build_roles

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


def flip_byte(path: Path, at: float = 0.5) -> None:
    data = bytearray(path.read_bytes())
    data[int(len(data) * at)] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path, by: int = 100) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - by)


def test_checkpoint_without_manifest_stops_resume_in_one_line(run_copy, caplog):
    """No manifest and a flipped bit in the weights: nothing can show the damage, so the checkpoint
    is neither loaded nor dropped for an older one (the next save would delete it): ``--resume``
    stops, naming it and the two ways on, and nothing is deleted."""
    ckpt = step_dir(run_copy, 2)
    (ckpt / MANIFEST).unlink()
    flip_byte(ckpt / "model" / "model.safetensors")
    with pytest.raises(CheckpointError) as err:
        latest_checkpoint(run_copy)
    message = str(err.value)
    assert "\n" not in message and str(ckpt) in message and "no manifest.json" in message
    assert "cannot be verified" in message
    assert f"python -m hybridrl.driver.checkpoint seal {ckpt}" in message and "delete" in message
    assert list_checkpoints(run_copy) == [step_dir(run_copy, 1), ckpt]


@pytest.mark.parametrize(
    "damage, expected",
    [
        ("truncate_weights", "model/model.safetensors is truncated"),
        ("truncate_train_state", "model/train_state.pt is not a whole zip archive"),
        ("flip_train_state", "model/train_state.pt fails its CRC check"),
    ],
)
def test_damage_a_checkpoint_without_manifest_shows_is_skipped(run_copy, caplog, damage, expected):
    """Without a manifest the files are still checked for what they show by themselves: a
    safetensors file's length against its header, a torch zip archive's CRCs."""
    ckpt = step_dir(run_copy, 2)
    (ckpt / MANIFEST).unlink()
    if damage == "truncate_weights":
        truncate(ckpt / "model" / "model.safetensors")
    elif damage == "truncate_train_state":
        truncate(ckpt / "model" / "train_state.pt", 1000)
    else:
        flip_byte(ckpt / "model" / "train_state.pt")
    found, warnings = resume_point(run_copy, caplog)
    assert found == step_dir(run_copy, 1)
    assert len(warnings) == 1 and str(ckpt) in warnings[0] and expected in warnings[0], warnings


def test_a_sealed_checkpoint_resumes(run_copy, capsys):
    ckpt = step_dir(run_copy, 2)
    (ckpt / MANIFEST).unlink()
    assert checkpoint.main(["seal", str(ckpt)]) == 0
    assert capsys.readouterr().out == f"sealed {ckpt}\n"
    assert verify_checkpoint(ckpt) == (None, json.loads((ckpt / "trainer.json").read_text()), True)
    assert latest_checkpoint(run_copy)[0] == ckpt
    assert checkpoint.main(["seal", str(ckpt)]) == 0  # sealing twice changes nothing
    assert capsys.readouterr().out == f"already sealed {ckpt}\n"


def test_seal_refuses_a_damaged_checkpoint(run_copy, capsys):
    ckpt = step_dir(run_copy, 2)
    (ckpt / MANIFEST).unlink()
    truncate(ckpt / "model" / "model.safetensors")
    assert checkpoint.main(["seal", str(ckpt)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "model/model.safetensors is truncated" in err
    assert not (ckpt / MANIFEST).exists()


def run_cli(capsys, work: Path, runs_dir: Path, *args: str) -> tuple[int, list[str]]:
    """``hybridrl train`` in this process: its exit code and its stderr lines."""
    from hybridrl import cli

    capsys.readouterr()
    rc = cli.main(
        [
            "train",
            *TINY_RUN,
            f"sft.checkpoint={work / 'ws'}",
            f"trainer.runs_dir={runs_dir}",
            "trainer.name=run",
            *args,
        ]
    )
    return rc, capsys.readouterr().err.splitlines()


def error_line(lines: list[str]) -> str:
    """The one ``hybridrl: error:`` line, and no traceback."""
    errors = [x for x in lines if x.startswith("hybridrl: error: ")]
    assert len(errors) == 1 and not any("Traceback" in x for x in lines), lines
    return errors[0]


def test_resume_from_an_unverifiable_checkpoint_is_one_line_and_exit_1(trained, run_copy, capsys):
    (step_dir(run_copy, 2) / MANIFEST).unlink()
    flip_byte(step_dir(run_copy, 2) / "model" / "model.safetensors")
    rc, lines = run_cli(capsys, trained, run_copy.parent, "--resume")
    assert rc == 1 and "no manifest.json" in error_line(lines)
    assert len(list_checkpoints(run_copy)) == 2 and not list(run_copy.parent.glob("run.*"))


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


# --- real faults: a full disk, immutable directories, symbolic link loops ------------------------
@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(bytes)``: a fresh directory on a tmpfs of that size, unmounted afterwards."""
    mounted = []

    def mount(size: int) -> Path:
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            pytest.skip(
                f"no small tmpfs for a full disk (mounting needs root): {out.stderr.strip()}"
            )
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


@pytest.fixture
def immutable():
    """``immutable(path)``: ``chattr +i`` (root bypasses permissions, not this); undone after."""
    made = []

    def make(path: Path) -> None:
        out = subprocess.run(["chattr", "+i", str(path)], capture_output=True, text=True)
        if out.returncode:
            pytest.skip(f"chattr +i failed (needs root and ext4/xfs/tmpfs): {out.stderr.strip()}")
        made.append(path)

    yield make
    for path in reversed(made):
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_a_full_disk_while_writing_the_weights_is_one_line(roles, tmp_path, small_disk):
    """A real ENOSPC in the middle of ``model.safetensors`` (safetensors reports it as an error of
    its own, with the errno only in its text)."""
    cfg, roles = roles
    measured = save(cfg, roles, tmp_path / "measure", 1)
    weights = (measured / "model" / "model.safetensors").stat().st_size
    run_dir = small_disk(tree_bytes(measured) + weights // 2) / "run"
    good = save(cfg, roles, run_dir, 1)
    with pytest.raises(CheckpointError) as err:
        save(cfg, roles, run_dir, 2)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("step 2: checkpoint not saved, no space left on device while writing")
    assert f"the last good checkpoint {good} is kept" in message
    assert list_checkpoints(run_dir) == [good] and verify_checkpoint(good)[0] is None
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))


def test_a_run_that_fills_the_disk_ends_in_one_line_with_exit_1(
    trained, tmp_path, small_disk, capsys
):
    first = step_dir(trained / "runs" / "run", 1)
    weights = (first / "model" / "model.safetensors").stat().st_size
    disk = small_disk(tree_bytes(first) + weights // 2 + (512 << 10))
    rc, lines = run_cli(capsys, trained, disk)
    line = error_line(lines)
    assert rc == 1 and "step 2: checkpoint not saved, no space left on device" in line
    assert [c.name for c in list_checkpoints(disk / "run")] == ["step_000001"]
    assert verify_checkpoint(step_dir(disk / "run", 1))[0] is None
    assert not list((disk / "run" / "checkpoints").glob(".tmp-*"))


def test_an_immutable_checkpoints_directory_is_one_line(roles, tmp_path, immutable):
    from hybridrl.driver.checkpointer import Checkpointer

    cfg, roles = roles
    run_dir = tmp_path / "run"
    good = save(cfg, roles, run_dir, 1)
    immutable(run_dir / "checkpoints")
    with pytest.raises(CheckpointError) as err:
        Checkpointer(run_dir, roles, cfg).check()  # at the first step, before any training
    assert "\n" not in str(err.value) and "cannot be written" in str(err.value)
    assert str(run_dir / "checkpoints") in str(err.value)
    with pytest.raises(CheckpointError) as err:  # made immutable during the run
        save(cfg, roles, run_dir, 2)
    message = str(err.value)
    assert "\n" not in message and message.startswith("step 2: checkpoint not saved, ")
    assert "Operation not permitted" in message and "make it writable" in message
    assert f"the last good checkpoint {good} is kept" in message
    assert list_checkpoints(run_dir) == [good] and verify_checkpoint(good)[0] is None


def test_an_old_checkpoint_that_cannot_be_removed_stays_whole(roles, tmp_path, immutable, caplog):
    """Rotation (``keep_checkpoints=1``) meets an immutable old checkpoint: the new one is saved,
    the old one stays as it was (never half deleted), one warning says so."""
    cfg, roles = roles
    run_dir = tmp_path / "run"
    old = save(cfg, roles, run_dir, 1)
    immutable(old)
    with caplog.at_level(logging.WARNING, logger=checkpoint.__name__):
        new = save(cfg, roles, run_dir, 2)
    assert verify_checkpoint(new)[0] is None and verify_checkpoint(old)[0] is None
    warnings = damage_warnings(caplog)
    assert (
        len(warnings) == 1 and str(old) in warnings[0] and "Operation not permitted" in warnings[0]
    )


def test_an_immutable_run_directory_is_refused_before_any_work(
    trained, run_copy, immutable, capsys
):
    immutable(run_copy)
    for resume in ([], ["--resume"]):
        rc, lines = run_cli(capsys, trained, run_copy.parent, "--print-config", *resume)
        line = error_line(lines)
        assert rc == 2 and str(run_copy) in line and "cannot be written" in line, line


def test_a_checkpoint_that_is_a_symbolic_link_loop_is_reported_and_replaced(
    roles, tmp_path, caplog
):
    cfg, roles = roles
    run_dir = tmp_path / "run"
    good = save(cfg, roles, run_dir, 1)
    for step in (2, 9):  # the next save's name, and a later step's
        step_dir(run_dir, step).symlink_to(step_dir(run_dir, step).name)
    found, warnings = resume_point(run_dir, caplog)
    assert found == good and len(warnings) == 2
    assert all("symbolic link loop" in w for w in warnings)
    assert save(cfg, roles, run_dir, 2) == step_dir(run_dir, 2)
    assert list_checkpoints(run_dir) == [step_dir(run_dir, 2)]  # the later loop is gone too
    assert verify_checkpoint(step_dir(run_dir, 2))[0] is None


def test_a_checkpoints_directory_that_is_a_symbolic_link_loop_is_one_line(roles, tmp_path):
    from hybridrl.driver.checkpointer import Checkpointer

    cfg, roles = roles
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").symlink_to("checkpoints")
    with pytest.raises(CheckpointError, match="checkpoints is a symbolic link loop"):
        Checkpointer(run_dir, roles, cfg).check()
    with pytest.raises(CheckpointError) as err:
        save(cfg, roles, run_dir, 1)
    assert "\n" not in str(err.value) and "symbolic link loop" in str(err.value)


def test_every_file_of_a_checkpoint_is_readable_by_others(roles, tmp_path):
    """safetensors writes 0600 (through a temporary file): the save gives every file the mode the
    umask gives any other file."""
    cfg, roles = roles
    umask = os.umask(0o022)
    try:
        ckpt = save(cfg, roles, tmp_path / "run", 1)
    finally:
        os.umask(umask)
    modes = {p.relative_to(ckpt).as_posix(): p.stat().st_mode & 0o777 for p in ckpt.rglob("*")}
    assert modes["model/model.safetensors"] == 0o644
    assert {m for p, m in modes.items() if (ckpt / p).is_file()} == {0o644}


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o027, 0o640)])
def test_a_saved_model_directory_takes_the_umask_mode(tmp_path, umask, mode):
    """What a warm start, ``hybridrl export`` and a distilled draft write: transformers alone leaves
    model.safetensors 0600."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hybridrl.models import save_model_dir

    tiny = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=16,
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=8,
        )
    )
    old = os.umask(umask)
    try:
        out = save_model_dir(tmp_path / "m", tiny)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {mode}
