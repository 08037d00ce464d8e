"""Background checkpoint saves (``trainer.async_save``, driver/checkpointer.py): the checkpoint is
the one a synchronous save of the same state writes, file for file; the saving step returns while
the files are still being written and training may change the weights meanwhile (the snapshot is
what is saved); a writer that fails leaves the previous checkpoint the newest complete one and the
failure is raised at the next step (a full disk frees the partial files at once); a run that fails
while a save is in flight, or an earlier process stopped mid-save, leaves no temporary directory; a
run with async saves, stopped and resumed, equals a synchronous run bit for bit. The sharded layout
(FSDP2, DCP) runs in a subprocess (``python tests/test_async_save.py sharded WORKDIR PORT``), as in
tests/test_resume.py."""

import errno
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from test_checkpoint_integrity import (
    STATE,
    TINY_RUN,
    error_line,
    make_cfg,
    run_cli,
    small_disk,  # noqa: F401 -- a fixture
    trained,  # noqa: F401 -- a fixture
    tree_bytes,
)
from test_resume import K, assert_same_runs, cfg, critic_batch, critic_cfg, snapshot

from hybridrl.config import Config, load_config
from hybridrl.driver.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    list_checkpoints,
    save_checkpoint,
    verify_checkpoint,
)
from hybridrl.driver.checkpointer import Checkpointer
from hybridrl.driver.loop import train
from hybridrl.driver.placement import build_roles

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def roles(tmp_path_factory):
    """The built-in tiny policy in a local learner, trained one optimizer step (so the optimizer
    has moments to save); keeps one checkpoint."""
    work = tmp_path_factory.mktemp("roles")
    config = make_cfg(work, "trainer.keep_checkpoints=1")
    roles = build_roles(config, None, None)
    roles.learner.apply_all(optimizer_step)
    yield config, roles
    roles.shutdown()


def optimizer_step(learner, scale: float = 1.0) -> None:
    loss = sum((p.float() ** 2).sum() for p in learner.model.parameters()) * scale
    loss.backward()
    learner.optimizer.step()
    learner.optimizer.zero_grad()


def weights_of(learner) -> dict:
    return {n: p.detach().clone() for n, p in learner.model.named_parameters()}


def restore(learner, saved: dict) -> None:
    with torch.no_grad():
        for n, p in learner.model.named_parameters():
            p.copy_(saved[n])


def background(config, roles, run_dir: Path) -> Checkpointer:
    saver = Checkpointer(run_dir, roles, config)
    saver.background = True  # the same config.yaml as the synchronous save's
    return saver


def files(ckpt: Path) -> dict[str, bytes]:
    return {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def test_async_save_writes_the_files_a_synchronous_save_writes(roles, tmp_path):
    config, roles = roles
    sync = save_checkpoint(tmp_path / "a", 1, roles, STATE | {"step": 1}, config)
    saver = background(config, roles, tmp_path / "b")
    saver.save(1, STATE | {"step": 1})
    saver.close()
    done = step_dir(tmp_path / "b", 1)
    assert files(done) == files(sync)  # every file's bytes, manifest.json included
    assert {"model/train_state.pt", "model/model.safetensors", "manifest.json"} <= set(files(done))
    assert verify_checkpoint(done)[0] is None
    assert not list((tmp_path / "b" / "checkpoints").glob(".*"))  # no markers, no temporary dir


def gated_writes(monkeypatch) -> threading.Event:
    """The learner's writer waits for the returned event before writing anything (a slow disk)."""
    from hybridrl.learner import state

    gate, real = threading.Event(), state._write_single

    def slow(*args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        return real(*args, **kwargs)

    monkeypatch.setattr(state, "_write_single", slow)
    return gate


def test_the_step_returns_before_the_write_and_the_snapshot_is_saved(roles, tmp_path, monkeypatch):
    config, roles = roles
    before = roles.learner.apply_all(weights_of)[0]
    expected = files(save_checkpoint(tmp_path / "a", 1, roles, STATE | {"step": 1}, config))
    gate = gated_writes(monkeypatch)
    saver = background(config, roles, tmp_path / "b")
    t0 = time.perf_counter()
    saver.save(1, STATE | {"step": 1})
    returned = time.perf_counter() - t0
    assert saver.thread.is_alive() and not list_checkpoints(tmp_path / "b")
    try:  # training goes on while the writer waits: the weights change under it
        roles.learner.apply_all(optimizer_step, 100.0)
        assert any(
            not torch.equal(before[n], w) for n, w in roles.learner.apply_all(weights_of)[0].items()
        )
        gate.set()
        roles.learner.apply_all(optimizer_step, 100.0)  # and while the files are written
        saver.close()
        assert files(step_dir(tmp_path / "b", 1)) == expected  # the state of the saving step
    finally:
        gate.set()
        roles.learner.apply_all(restore, before)
    assert returned < 5.0


def test_a_failing_writer_keeps_the_previous_checkpoint_and_is_raised_at_the_next_step(
    roles, tmp_path, monkeypatch
):
    config, roles = roles
    run_dir = tmp_path / "run"
    saver = background(config, roles, run_dir)
    saver.save(1, STATE | {"step": 1})
    saver.wait()
    good = step_dir(run_dir, 1)

    def enospc(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"\0" * 1000)  # half written, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))

    monkeypatch.setattr(torch, "save", enospc)
    saver.save(2, STATE | {"step": 2})  # returns: the failure is the writer's
    saver.thread.join(60)
    with pytest.raises(CheckpointError) as err:
        saver.check()  # what the driver calls at the next step
    message = str(err.value)
    assert "\n" not in message and message.startswith("step 2: checkpoint not saved, ")
    assert "no space left on device while writing" in message and "train_state.pt" in message
    assert f"the last good checkpoint {good} is kept" in message
    assert list_checkpoints(run_dir) == [good]  # nothing rotated out (keep_checkpoints=1)
    assert latest_checkpoint(run_dir)[0] == good
    assert not list((run_dir / "checkpoints").glob(".tmp-*"))
    saver.check()  # raised once

    def boom(*args, **kwargs):
        raise RuntimeError("writer crashed\nmid-write")

    monkeypatch.setattr(torch, "save", boom)
    saver.save(3, STATE | {"step": 3})
    with pytest.raises(CheckpointError) as err:
        saver.close()  # the end of the run raises it too
    assert "background write failed (RuntimeError: writer crashed mid-write)" in str(err.value)
    assert list_checkpoints(run_dir) == [good] and latest_checkpoint(run_dir)[0] == good


def test_a_real_full_disk_is_raised_at_the_next_step_with_the_space_freed(
    roles,
    tmp_path,
    small_disk,  # noqa: F811
):
    """ENOSPC in the middle of ``model.safetensors`` on a background thread: the rank removes its
    partial files at once (the disk is usable again and its marker can be written), so the failure
    reaches the next step without waiting for another save."""
    config, roles = roles
    measured = save_checkpoint(tmp_path / "measure", 1, roles, STATE | {"step": 1}, config)
    weights = (measured / "model" / "model.safetensors").stat().st_size
    disk = small_disk(tree_bytes(measured) + weights // 2)
    run_dir = disk / "run"
    saver = background(config, roles, run_dir)
    saver.save(1, STATE | {"step": 1})
    saver.wait()
    good, free = step_dir(run_dir, 1), shutil.disk_usage(disk).free
    saver.save(2, STATE | {"step": 2})
    deadline, error = time.monotonic() + 30, None
    while error is None and time.monotonic() < deadline:
        try:
            saver.check()  # what each step calls; never waits
            time.sleep(0.05)
        except CheckpointError as exc:
            error = str(exc)
    try:
        assert error is not None, "the failure never reached check()"
        assert "\n" not in error
        assert error.startswith("step 2: checkpoint not saved, no space left on device while")
        assert f"the last good checkpoint {good} is kept" in error
    finally:
        saver.close(abandon=True)
    assert list_checkpoints(run_dir) == [good] and verify_checkpoint(good)[0] is None
    assert not list((run_dir / "checkpoints").glob(".*"))
    assert shutil.disk_usage(disk).free >= free  # all of the partial save's space is back


def test_a_run_with_tensorboard_that_fills_the_disk_ends_in_one_line(
    trained,  # noqa: F811
    small_disk,  # noqa: F811
    capsys,
):
    """End to end, as the command line runs it: background saves and TensorBoard on a disk that
    step 2's save fills."""
    first = step_dir(trained / "runs" / "run", 1)
    weights = (first / "model" / "model.safetensors").stat().st_size
    disk = small_disk(tree_bytes(first) + weights // 2 + (512 << 10))
    extra = ["trainer.async_save=true", "trainer.loggers=[jsonl,tensorboard]"]
    rc, lines = run_cli(capsys, trained, disk, "trainer.total_steps=3", *extra)
    line = error_line(lines)
    assert rc == 1 and "step 2: checkpoint not saved, no space left on device" in line
    assert [c.name for c in list_checkpoints(disk / "run")] == ["step_000001"]
    assert not list((disk / "run" / "checkpoints").glob(".*"))


def test_a_run_that_fails_during_a_failing_background_save_leaves_nothing_partial(
    roles, tmp_path, monkeypatch, caplog
):
    """The run stops for another reason (e.g. a logger's write on the full disk) while the
    background write is still failing: the end of the run waits a little for the ranks, removes the
    partial directory and logs the save's failure."""
    from hybridrl.learner import state

    config, roles = roles
    run_dir = tmp_path / "run"
    saver = background(config, roles, run_dir)
    saver.save(1, STATE | {"step": 1})
    saver.wait()
    gate = threading.Event()

    def slow_then_full(path, *args, **kwargs):
        assert gate.wait(60), "the test never opened the gate"
        (Path(path) / "model.safetensors").parent.mkdir(parents=True, exist_ok=True)
        (Path(path) / "model.safetensors").write_bytes(b"\0" * 1000)
        raise OSError(
            errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(path) / "model.safetensors")
        )

    monkeypatch.setattr(state, "_write_single", slow_then_full)
    saver.save(2, STATE | {"step": 2})
    threading.Timer(0.5, gate.set).start()
    with caplog.at_level(logging.ERROR):
        saver.close(abandon=True)  # the run's way out of a failed step
    gate.set()
    assert not list((run_dir / "checkpoints").glob(".*"))
    assert list_checkpoints(run_dir) == [step_dir(run_dir, 1)]
    assert any("no space left on device" in r.getMessage() for r in caplog.records)


def test_a_partial_save_an_earlier_process_left_is_removed(roles, tmp_path):
    """A process killed mid-save leaves ``.tmp-step_N/`` (never a ``step_N/``): the next run's
    first step removes it."""
    config, roles = roles
    run_dir = tmp_path / "run"
    left = run_dir / "checkpoints" / ".tmp-step_000007"
    (left / "model").mkdir(parents=True)
    (left / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    (left / ".written-rank0").write_text("{}")
    saver = background(config, roles, run_dir)
    saver.check()
    assert not left.exists()
    saver.close()


def test_a_driver_side_write_error_names_the_file(roles, tmp_path, monkeypatch):
    from hybridrl.driver import checkpoint

    config, roles = roles
    run_dir = tmp_path / "run"

    def failing(path, text):
        raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))

    monkeypatch.setattr(checkpoint, "_write_synced", failing)
    saver = background(config, roles, run_dir)
    saver.save(1, STATE | {"step": 1})
    with pytest.raises(CheckpointError) as err:
        saver.wait()
    message = str(err.value)
    assert "\n" not in message and "Input/output error while writing" in message
    assert "trainer.json" in message and "no earlier checkpoint exists" in message
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())


def test_non_finite_weights_are_refused_in_the_saving_step(roles, tmp_path):
    config, roles = roles
    before = roles.learner.apply_all(weights_of)[0]

    def poison(learner):
        with torch.no_grad():
            next(learner.model.parameters()).view(-1)[0] = float("nan")

    roles.learner.apply_all(poison)
    saver = background(config, roles, tmp_path / "run")
    try:
        with pytest.raises(CheckpointError, match="step 1: checkpoint not saved, non-finite"):
            saver.save(1, STATE | {"step": 1})
    finally:
        roles.learner.apply_all(restore, before)
    assert saver.thread is None and not list((tmp_path / "run" / "checkpoints").glob("*"))


def test_a_run_with_async_saves_resumes_exactly(tmp_path):
    """Saves every step in the background, stops after K steps, resumes: equal to a synchronous
    run that never stopped, metric for metric and weight for weight."""
    train(cfg(tmp_path, "straight", 2 * K))
    every = ["trainer.async_save=true", "trainer.save_every=1"]
    train(cfg(tmp_path, "split", K, *every))
    assert [p.name for p in list_checkpoints(tmp_path / "runs" / "split")] == [
        f"step_{s:06d}" for s in range(K - 1, K + 1)
    ]
    resumed = train(cfg(tmp_path, "split", 2 * K, *every), resume=True)
    assert resumed["resumed_from_step"] == K
    assert_same_runs(tmp_path, "straight", "split", 2 * K)


def test_lora_and_critic_runs_save_in_the_background(tmp_path):
    """LoRA (the policy written in the step, the rest in the background) and PPO (the critic
    written in the background): complete checkpoints equal to the synchronous run's."""
    from hybridrl.learner import lora as lora_lib

    ppo = ROOT / "examples" / "arith_ppo.yaml"
    for name, base, extra in (("lora", None, ["actor.lora_rank=8"]), ("ppo", ppo, [])):
        for flag in ("false", "true"):
            overrides = [
                *TINY_RUN,
                *extra,
                "critic.ppo_minibatch_size=4",
                f"sft.checkpoint={tmp_path / 'ws'}",
                f"trainer.runs_dir={tmp_path / 'runs'}",
                f"trainer.name={name}-{flag}",
                f"trainer.async_save={flag}",
            ]
            train(load_config(Config, base, overrides))
        a, b = (step_dir(tmp_path / "runs" / f"{name}-{f}", 2) for f in ("false", "true"))
        assert verify_checkpoint(b)[0] is None
        assert files(a).keys() == files(b).keys()
        weights = [k for k in files(a) if k.endswith(".safetensors")]
        assert all(files(a)[k] == files(b)[k] for k in weights), name
        if name == "lora":
            assert lora_lib.is_lora_checkpoint(b / "model")
        else:
            assert (b / "critic" / "train_state.pt").is_file()


def test_an_asynchronous_run_saves_in_the_background_and_resumes(tmp_path):
    from test_async import make_cfg as async_cfg

    from hybridrl.driver import loop

    every = ["trainer.async_save=true", "trainer.save_every=1", "rollout.max_new_tokens=16"]
    loop.train(async_cfg(tmp_path, "trainer.total_steps=2", *every))
    run_dir = tmp_path / "runs" / "reverse_grpo"
    found = latest_checkpoint(run_dir)
    assert found is not None and found[0] == step_dir(run_dir, 2)
    assert {"pending_prompts", "trained_groups"} <= found[1].keys()
    summary = loop.train(async_cfg(tmp_path, "trainer.total_steps=3", *every), resume=True)
    assert summary["resumed_from_step"] == 2 and latest_checkpoint(run_dir)[0] == step_dir(
        run_dir, 3
    )


# --- the sharded layout ---------------------------------------------------------------------------
def sharded_main(workdir: str, port: int) -> None:
    """A critic sharded by FSDP2 on a 1-rank gloo group: saved synchronously and in the
    background (training once more while the background write runs), both loaded back."""
    import torch.distributed as dist

    from hybridrl.learner.critic import Critic
    from hybridrl.learner.state import BackgroundWriter, load_trainable, save_trainable
    from hybridrl.parallel.distributed import DistEnv
    from hybridrl.parallel.fsdp import is_sharded

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    group = DistEnv(0, 1, torch.device("cpu"), "gloo")
    work = Path(workdir)
    critic = Critic(critic_cfg(), None, group)
    batch = critic_batch(critic)
    for _ in range(2):
        critic.update(batch)
    saved = snapshot(critic)
    save_trainable(work / "sync", critic.model, critic.optimizer, critic.shuffle)
    writer = BackgroundWriter()
    save_trainable(
        work / "async", critic.model, critic.optimizer, critic.shuffle, background=writer
    )
    writer.start(str(work / "marker"))
    critic.update(batch)  # training goes on during the write
    failure = writer.wait()
    out = {"sharded": is_sharded(critic.model), "failure": failure, "saved": snapshot(critic)}
    out["saved"] = saved
    for name in ("sync", "async"):
        fresh = Critic(critic_cfg(), None, group)
        load_trainable(work / name, fresh.model, fresh.optimizer, fresh.shuffle)
        out[name] = snapshot(fresh)
    torch.save(out, work / "out.pt")


def test_sharded_async_save_equals_the_synchronous_one(tmp_path):
    from test_resume import assert_bitwise_equal

    from hybridrl.controller.worker import find_free_port
    from hybridrl.parallel.sharded_checkpoint import is_complete

    env = os.environ | {
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}"
        + os.environ.get("PYTHONPATH", ""),
    }
    proc = subprocess.run(
        [sys.executable, __file__, "sharded", str(tmp_path), str(find_free_port("127.0.0.1"))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = torch.load(tmp_path / "out.pt", weights_only=False)
    assert out["sharded"] and out["failure"] is None
    assert json.loads((tmp_path / "marker").read_text()) == {"ok": True}
    assert_bitwise_equal(out["saved"], out["sync"])
    assert_bitwise_equal(out["saved"], out["async"])  # the snapshot, not the later update
    for name in ("sync", "async"):
        assert is_complete(tmp_path / name / "dcp")
        assert not list((tmp_path / name).glob(".*.tmp"))
    hf = ("model.safetensors", "config.json")
    assert all(
        (tmp_path / "sync" / f).read_bytes() == (tmp_path / "async" / f).read_bytes() for f in hf
    )


@pytest.mark.slow
def test_two_sharded_learner_ranks_under_ray_save_in_the_background(tmp_path):
    """The learner as 2 FSDP2 ranks (Ray actors): background saves every step write complete
    checkpoints (``dcp/`` of both ranks, the gathered weights) equal to synchronous saves."""
    import ray

    from hybridrl.parallel.sharded_checkpoint import is_complete

    example = ROOT / "examples" / "arith_grpo_fsdp_disaggregated.yaml"
    try:
        for name, flag in (("sync", "false"), ("async", "true")):
            overrides = [
                *TINY_RUN,
                f"sft.checkpoint={tmp_path / 'ws'}",
                f"trainer.runs_dir={tmp_path / 'runs'}",
                f"trainer.name={name}",
                f"trainer.async_save={flag}",
            ]
            train(load_config(Config, example, overrides))
    finally:
        if ray.is_initialized():
            ray.shutdown()
    runs = tmp_path / "runs"
    for step in (1, 2):
        a, b = step_dir(runs / "sync", step), step_dir(runs / "async", step)
        assert verify_checkpoint(b)[0] is None and is_complete(b / "model" / "dcp")
        weights = "model/model.safetensors"
        assert (a / weights).read_bytes() == (b / weights).read_bytes(), step
    assert not list((runs / "async" / "checkpoints").glob(".*"))


if __name__ == "__main__":
    if sys.argv[1] == "sharded":
        sharded_main(sys.argv[2], int(sys.argv[3]))
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(0)  # FSDP2's hooks keep the gloo group alive past the end (tests/test_resume.py)
