"""Hang detection: a driver step past ``trainer.step_timeout_s`` dumps every process's stacks into
``<run>/hang/`` and stops the run with one line naming the call still waited for (local backend:
the hung call runs in the driver's thread and is interrupted; ray: the hung actor is dumped through
faulthandler, abandoned and killed)."""

from __future__ import annotations

import functools
import os
import re
import sys
import time

os.environ["HF_HUB_OFFLINE"] = "1"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytest
from controller_workers import ray_cluster  # noqa: F401 (fixture)

from hybridrl.config import Config, load_config
from hybridrl.controller import ResourcePool, WorkerError, WorkerGroup
from hybridrl.controller.dispatch import Dispatch, register
from hybridrl.controller.worker import Worker
from hybridrl.telemetry.watchdog import StepTimeoutError, Watchdog


class SleepyWorker(Worker):
    @register(Dispatch.ONE_TO_ALL)
    def pid(self) -> int:
        return os.getpid()

    @register(Dispatch.ONE_TO_ALL)
    def quick(self) -> int:
        return self.rank

    @register(Dispatch.ONE_TO_ALL)
    def nap_for_a_long_time(self, seconds: float) -> int:
        time.sleep(seconds)
        return self.rank


def run_steps(watchdog: Watchdog, group: WorkerGroup, hang_at: int, steps: int = 3) -> list:
    done = []
    with watchdog:
        for step in watchdog.steps(range(steps)):
            if step == hang_at:
                group.nap_for_a_long_time(600)
            group.quick()
            done.append(step)
    return done


def test_local_hung_call_is_interrupted_and_named(tmp_path):
    group = WorkerGroup(SleepyWorker, ResourcePool("p"), role="sleeper", backend="local")
    watchdog = Watchdog(1.5, tmp_path / "hang", [group])
    t0 = time.monotonic()
    with pytest.raises(StepTimeoutError) as err:
        run_steps(watchdog, group, hang_at=1)
    assert time.monotonic() - t0 < 10
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("step 2 exceeded trainer.step_timeout_s=1.5 s: still waiting for ")
    assert re.search(r"for sleeper\.nap_for_a_long_time \(running \d s\); stacks in ", msg)
    assert f"stacks in {tmp_path / 'hang'}/" in msg
    driver = (tmp_path / "hang" / "driver.txt").read_text()
    assert "nap_for_a_long_time" in driver and "run_steps" in driver
    assert group.in_flight() == []  # the interrupted call is no longer listed
    assert group.quick() == [0]  # a local group goes on working (nothing was abandoned)


SIGINT_IGNORED = """
import signal, sys, time
from hybridrl.telemetry.watchdog import StepTimeoutError, Watchdog
assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # inherited, as under nohup or `&`
t0 = time.monotonic()
try:
    with Watchdog(1.0, sys.argv[1]) as watchdog:
        for step in watchdog.steps(range(3)):
            time.sleep(600 if step == 1 else 0)
except StepTimeoutError as err:
    assert str(err).startswith("step 2 exceeded"), err
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # restored
    print("interrupted after", round(time.monotonic() - t0))
"""


def test_a_driver_that_inherited_sigint_ignored_is_interrupted(tmp_path):
    import signal
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", SIGINT_IGNORED, str(tmp_path / "hang")],
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("interrupted after"), out.stdout + out.stderr


def test_steps_within_the_timeout_leave_nothing_behind(tmp_path):
    group = WorkerGroup(SleepyWorker, ResourcePool("p"), role="sleeper", backend="local")
    watchdog = Watchdog(5, tmp_path / "hang", [group])
    assert run_steps(watchdog, group, hang_at=-1) == [0, 1, 2]
    time.sleep(0.2)
    assert not (tmp_path / "hang").exists() and watchdog.error is None


def test_in_flight_names_role_and_method(tmp_path):
    group = WorkerGroup(SleepyWorker, ResourcePool("p"), role="sleeper", backend="local")
    seen = []
    group.apply_all(lambda w: seen.extend(group.in_flight()))
    assert [what for what, _ in seen] == [
        "sleeper.apply(test_in_flight_names_role_and_method.<locals>.<lambda>)"
    ]


class PeekWorker(Worker):
    watched: list = []  # the group whose in-flight calls the method reports

    @register(Dispatch.ONE_TO_ALL)
    def peek(self) -> list:
        return self.watched[0].in_flight()


def test_colocated_role_calls_are_named_by_role(tmp_path, monkeypatch):
    from hybridrl.controller.colocated import ColocatedWorker, RoleView

    parts = {"learner": (PeekWorker, ()), "rollout": (SleepyWorker, ())}
    group = WorkerGroup(
        ColocatedWorker, ResourcePool("p"), role="learner+rollout", backend="local", args=(parts,)
    )
    monkeypatch.setattr(PeekWorker, "watched", [group])
    view = RoleView(group, "learner", PeekWorker)
    [seen] = view.peek()
    assert [what for what, _ in seen] == ["learner.peek"]
    [seen] = view.apply_all(lambda w: group.in_flight())
    assert seen[0][0].startswith("learner.apply(") and group.in_flight() == []


def test_train_with_a_hung_learner_stops_with_the_role_named(tmp_path, monkeypatch):
    from test_train_e2e import make_cfg

    from hybridrl.driver.loop import train
    from hybridrl.learner.learner import Learner

    started = []

    @functools.wraps(Learner.train_step)  # keeps its dispatch mark
    def train_step_that_hangs(self, version, source):
        started.append(time.monotonic())
        time.sleep(600)

    monkeypatch.setattr(Learner, "train_step", train_step_that_hangs)
    cfg = make_cfg(tmp_path, "trainer.step_timeout_s=4", "trainer.name=hang")
    assert isinstance(cfg, Config)
    with pytest.raises(StepTimeoutError) as err:
        train(cfg)
    assert started and time.monotonic() - started[0] < 4 + 6
    run_dir = tmp_path / "runs" / "hang"
    assert str(err.value).startswith(
        "step 1 exceeded trainer.step_timeout_s=4 s: still waiting for learner.train_step (running "
    )
    assert str(err.value).endswith(f"stacks in {run_dir / 'hang'}/")
    assert "train_step_that_hangs" in (run_dir / "hang" / "driver.txt").read_text()


def test_step_timeout_must_be_positive():
    with pytest.raises(Exception, match="step_timeout_s"):
        load_config(Config, None, ["trainer.step_timeout_s=0"])


@pytest.mark.distributed
def test_ray_hung_worker_is_dumped_abandoned_and_killed(tmp_path, ray_cluster):  # noqa: F811
    import ray
    from test_worker_failure import process_gone

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    pool = ResourcePool("sleepy", workers_per_node=2)
    group = WorkerGroup(SleepyWorker, pool, role="sleeper", backend="ray")
    try:
        pids = group.pid()
        assert [p["pid"] for p in group.processes()] == pids
        watchdog = Watchdog(3, tmp_path / "hang", [group])
        t0 = time.monotonic()
        with pytest.raises(StepTimeoutError) as err:
            run_steps(watchdog, group, hang_at=0)
        assert time.monotonic() - t0 < 3 + 8
        assert re.search(
            r"waiting for sleeper\.nap_for_a_long_time \(running \d s\)", str(err.value)
        )
        for rank, pid in enumerate(pids):
            dump = (tmp_path / "hang" / f"sleeper-rank{rank}.txt").read_text()
            assert f"pid {pid}" in dump and "nap_for_a_long_time" in dump, dump
        with pytest.raises(WorkerError, match="abandoned: step 1 exceeded"):
            group.quick()  # refused at once: the ranks are still asleep
    finally:
        group.shutdown()
        pool.release()
    assert all(process_gone(pid) for pid in pids)
