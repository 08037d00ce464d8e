"""Runs that come back (``driver/restarts.py``): a worker that dies or a rollout call past
``rollout.timeout_s`` restarts the run from its newest checkpoint, up to ``trainer.max_restarts``
times, and nothing is trained twice.

Local runs with an injected death (``Learner.train_step`` raising :class:`WorkerDiedError` once at
given versions) check the bookkeeping cheaply: counters, trimmed metrics, lineage, weights bit for
bit. Ray runs kill real processes (SIGKILL by pid, from a thread, once the run has logged a given
step): a learner rank, a rollout rank, and the rollout of an asynchronous run (replaced in place,
the learner going on: ``driver/replace.py``); and a rollout whose generation outlasts its timeout
goes through the restart path and then stops with one line."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from hybridrl.api import run
from hybridrl.config import Config, load_config
from hybridrl.controller import WorkerDiedError, WorkerError
from hybridrl.controller.health import CallTimeoutError, Progress, describe_heartbeat
from hybridrl.driver.checkpoint import CheckpointError
from hybridrl.driver.restarts import Faults, RestartsExhaustedError, restart_reason
from hybridrl.telemetry.watchdog import StepTimeoutError

TINY = [
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=8",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=4",
    "trainer.eval_every=0",
    "trainer.save_every=2",
    "rollout.max_new_tokens=8",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "trainer.log_samples_every=0",
    "controller.num_threads=1",
    # partial credit, so that the tiny warm start gets rewards that differ and the weights move
    f"task.reward_fn={__file__}:digit_credit",
]
RAY = [
    "controller.backend=ray",
    "controller.pools={train: {cpus_per_worker: 0.5}, gen: {cpus_per_worker: 0.5}}",
    "controller.placement={learner: train, rollout: gen}",
]
IGNORED = ("timing/", "engine/", "perf/", "fault/")  # wall times, engine counters, the counters


def digit_credit(prompt, response: str, **_) -> float:
    """The answer's digits in place (tests/test_resume.py's reward)."""
    return sum(a == b for a, b in zip(response, prompt.answer)) / len(prompt.answer)


def slow_credit(prompt, response: str, **_) -> float:
    """:func:`digit_credit`, one second late: scoring is part of the rollout's generate call."""
    time.sleep(1.0)
    return digit_credit(prompt, response)


@pytest.fixture(scope="module")
def warm(tmp_path_factory) -> Path:
    """One cached warm start for the module."""
    return tmp_path_factory.mktemp("warm") / "ws"


def make_cfg(root: Path, warm: Path, name: str, *extra: str) -> Config:
    return load_config(
        Config,
        None,
        [
            *TINY,
            f"sft.checkpoint={warm}",
            f"trainer.runs_dir={root / 'runs'}",
            f"trainer.name={name}",
            *extra,
        ],
    )


def rows(run_dir: Path, name: str = "metrics.jsonl") -> list[dict]:
    path = run_dir / name
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def final_weights(summary: dict) -> dict:
    ckpts = sorted((Path(summary["run_dir"]) / "checkpoints").glob("step_*"))
    return load_file(ckpts[-1] / "model" / "model.safetensors")


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def assert_lineage(summary: dict, steps: int) -> list[str]:
    """One trajectories.jsonl line per step 1..steps, and no prompt trained twice."""
    trace = rows(Path(summary["run_dir"]), "trajectories.jsonl")
    assert [r["step"] for r in trace] == list(range(1, steps + 1))
    uids = [u for r in trace for u in r["uids"]]
    assert len(uids) == len(set(uids))
    return uids


# --- the rules, without a run ---------------------------------------------------------------------
def test_what_restarts_and_what_stops():
    died = WorkerDiedError("learner", 1, "train_step", "its process vanished", "pid 7 on node x")
    assert restart_reason(died, "ray").startswith("worker role 'learner' rank 1 died")
    # the death reached the driver first; the shutdown that followed failed too
    try:
        try:
            raise died
        except WorkerDiedError:
            raise WorkerError("rollout", 0, "close", "RuntimeError: gone") from None
    except WorkerError as late:
        assert "rank 1 died" in restart_reason(late, "ray")
    slow = CallTimeoutError("rollout", 0, "generate", "exceeded rollout.timeout_s=5 s")
    assert "exceeded rollout.timeout_s" in restart_reason(slow, "ray")
    batch = WorkerError("learner", 0, "train_step", "TimeoutError: (asynchronous.batch_timeout_s)")
    assert restart_reason(batch, "ray") and restart_reason(batch, "local") is None
    assert restart_reason(WorkerError("learner", 0, "train_step", "ValueError: bad"), "ray") is None
    # a rollout rank whose reward-model actor died
    scorer = WorkerError("rollout", 0, "generate", "ActorDiedError: The actor died unexpectedly")
    assert restart_reason(scorer, "ray") and restart_reason(scorer, "local") is None
    for stop in (StepTimeoutError("step 3 exceeded"), CheckpointError("disk full")):
        try:  # a hang or a failed save stops the run even when a death follows it
            try:
                raise stop
            except type(stop):
                raise died from None
        except WorkerDiedError as e:
            assert restart_reason(e, "ray") is None


def test_counters_and_heartbeat_words():
    faults = Faults(3)
    assert faults.metrics() == {}
    faults.load({"restarts": 2, "lost_steps": 3})
    assert faults.metrics() == {"fault/restarts": 2.0, "fault/lost_steps": 3.0}
    progress = Progress()
    step = progress.counting(lambda: 5)
    with progress.busy():
        assert step() == 5 and progress.beat()["steps"] == 1 and progress.beat()["busy_s"] >= 0
    assert progress.beat()["busy_s"] == 0.0
    assert describe_heartbeat({"steps": 37, "step_age_s": 412.3, "busy_s": 415.0}) == (
        "no engine step for 412 s, 37 taken, 415 s into the call"
    )
    assert describe_heartbeat({"steps": 8, "step_age_s": 0.42, "busy_s": 0.0}) == (
        "no engine step for 0.4 s, 8 taken"
    )
    assert describe_heartbeat(None) == "no heartbeat"


# --- local runs with an injected death ------------------------------------------------------------
def die_at(monkeypatch, versions: set[int]) -> list[int]:
    """``Learner.train_step`` raises WorkerDiedError once at each of ``versions``; the versions it
    died at."""
    from hybridrl.learner.learner import Learner

    original, died = Learner.train_step, []

    @functools.wraps(original)  # keeps the dispatch mark
    def train_step(self, version, source):
        if version in versions - set(died):
            died.append(version)
            raise WorkerDiedError("learner", 0, "train_step", "injected death", "pid 0 on test")
        return original(self, version, source)

    monkeypatch.setattr(Learner, "train_step", train_step)
    return died


def test_injected_deaths_restart_from_the_checkpoint_exactly(tmp_path, warm, monkeypatch):
    """Deaths at the 2nd step (no checkpoint yet: from step 0) and the 4th (from step 2): the run
    finishes, each death loses one step, the metrics of every step and the final weights are those
    of the run that never died, and no prompt is trained twice."""
    steps = 5
    straight = run(make_cfg(tmp_path, warm, "straight", f"trainer.total_steps={steps}"))
    died = die_at(monkeypatch, {1, 3})
    summary = run(make_cfg(tmp_path, warm, "killed", f"trainer.total_steps={steps}"))
    assert died == [1, 3] and (summary["restarts"], summary["lost_steps"]) == (2, 2)
    run_dir = Path(summary["run_dir"])
    got, want = rows(run_dir), rows(Path(straight["run_dir"]))
    assert [r["step"] for r in got] == list(range(steps + 1))
    assert [(r.get("fault/restarts"), r.get("fault/lost_steps")) for r in got] == [
        (None, None),
        (1.0, 1.0),
        (1.0, 1.0),
        (2.0, 2.0),  # done again after the second death
        (2.0, 2.0),
        (2.0, 2.0),
    ]
    for a, b in zip(got, want):
        a = {k: v for k, v in a.items() if not k.startswith(IGNORED)}
        assert a == {k: v for k, v in b.items() if not k.startswith(IGNORED)}
    assert_same_weights(final_weights(summary), final_weights(straight))
    assert assert_lineage(summary, steps) == assert_lineage(straight, steps)
    alerts = [r for r in rows(run_dir, "alerts.jsonl") if r["alert"] == "worker_restart"]
    assert [(r["step"], r["value"]) for r in alerts] == [(0, 1), (2, 2)]
    assert "injected death" in alerts[0]["message"]
    ckpt = sorted((run_dir / "checkpoints").glob("step_*"))[-1]
    assert json.loads((ckpt / "trainer.json").read_text())["fault"] == {
        "restarts": 2,
        "lost_steps": 2,
    }
    # a later --resume counts on
    more = run(make_cfg(tmp_path, warm, "killed", f"trainer.total_steps={steps + 1}"), resume=True)
    assert (more["restarts"], rows(run_dir)[-1]["fault/restarts"]) == (2, 2.0)


def test_past_max_restarts_one_line_and_user_errors_never_retry(tmp_path, warm, monkeypatch):
    died = die_at(monkeypatch, {0})
    with pytest.raises(RestartsExhaustedError) as info:
        run(make_cfg(tmp_path, warm, "once", "trainer.total_steps=2", "trainer.max_restarts=0"))
    assert died == [0] and "\n" not in str(info.value)
    assert str(info.value).startswith("worker role 'learner' rank 0 died in train_step()")
    assert str(info.value).endswith("[no restart: trainer.max_restarts=0]")

    from hybridrl.learner.learner import Learner

    calls = []

    @functools.wraps(Learner.train_step)
    def broken(self, version, source):
        calls.append(version)
        raise ValueError("a bug in the user's loss")

    monkeypatch.setattr(Learner, "train_step", broken)
    with pytest.raises(WorkerError, match="a bug in the user's loss"):
        run(make_cfg(tmp_path, warm, "bug", "trainer.total_steps=2"))
    assert calls == [0]


# --- Ray: real processes killed -------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    from hybridrl.controller import init_ray

    init_ray(num_cpus=4)
    yield
    ray.shutdown()


def kill_when(run_dir: Path, step: int, role: str, monkeypatch) -> list[int]:
    """SIGKILL rank 0 of ``role``'s first Ray group once ``metrics.jsonl`` shows ``step``, from a
    thread; the pids killed. The groups are found by wrapping the session's ``build_roles``."""
    from hybridrl.driver import session

    built, killed = [], []
    original = session.build_roles

    def build_roles(*args, **kwargs):
        built.append(original(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(session, "build_roles", build_roles)

    def killer():
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if built and any(r["step"] >= step for r in rows(run_dir)):
                group = getattr(built[0], role)
                group = getattr(group, "group", group)  # a colocated role's process
                pid = group.processes()[0]["pid"]
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.05)

    threading.Thread(target=killer, daemon=True).start()
    return killed


@pytest.fixture(scope="module")
def unkilled(ray_cluster, tmp_path_factory, warm) -> dict:
    root = tmp_path_factory.mktemp("unkilled")
    return run(make_cfg(root, warm, "straight", "trainer.total_steps=5", *RAY))


# ~35 s each: the learner kill runs by default, the rollout kill with the slow tests
@pytest.mark.parametrize(
    "role",
    ["learner", pytest.param("rollout", marks=pytest.mark.slow)],
)
@pytest.mark.distributed
def test_sigkill_restarts_and_finishes_as_if_unkilled(tmp_path, warm, unkilled, role, monkeypatch):
    """A learner or rollout process SIGKILLed after step 3 (checkpoint at 2). The learner's death
    restarts the run from the checkpoint: one step done again. The rollout, on a pool of its own,
    is replaced in place (driver/replace.py): no step lost, the new one generating what the dead
    one would have. Either way the final weights are bit for bit those of the unkilled run and no
    prompt is trained twice."""
    cfg = make_cfg(tmp_path, warm, f"kill_{role}", "trainer.total_steps=5", *RAY)
    killed = kill_when(tmp_path / "runs" / f"kill_{role}", 3, role, monkeypatch)
    summary = run(cfg)
    lost = 0 if role == "rollout" else 1
    assert len(killed) == 1 and summary["restarts"] == 1 and summary["lost_steps"] == lost
    last = rows(Path(summary["run_dir"]))[-1]
    assert (last["step"], last["fault/restarts"], last["fault/lost_steps"]) == (5, 1.0, lost)
    assert last.get("fault/rollout_replacements", 0) == 1 - lost
    assert_same_weights(final_weights(summary), final_weights(unkilled))
    assert assert_lineage(summary, 5) == assert_lineage(unkilled, 5)


@pytest.mark.slow  # two Ray runs (~30 s); the call timeout itself is in test_worker_failure
def test_rollout_timeout_restarts_then_stops_with_one_line(tmp_path, warm, ray_cluster, capsys):
    """A generate call far slower than rollout.timeout_s (the evaluation before training already;
    its reward function takes a second): the rollout is killed, the run restarts once, times out
    again, and the command line prints one line naming the rank, the timeout and the heartbeat,
    exit code 1."""
    from hybridrl.cli import main

    args = [*TINY, *RAY, f"sft.checkpoint={warm}", f"trainer.runs_dir={tmp_path / 'runs'}"]
    args += ["trainer.name=slow", "trainer.total_steps=2", "trainer.max_restarts=1"]
    args += ["rollout.timeout_s=0.5", f"task.reward_fn={__file__}:slow_credit"]
    start = time.monotonic()
    assert main(["train", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("hybridrl: error: worker role 'rollout' rank 0 failed in generate(): ")
    assert "exceeded rollout.timeout_s=0.5 s (no engine step for" in err
    assert err.endswith("[1 restart(s): trainer.max_restarts=1]")
    assert time.monotonic() - start < 240
    alerts = rows(tmp_path / "runs" / "slow", "alerts.jsonl")
    assert [r["alert"] for r in alerts] == ["worker_restart"]


@pytest.mark.slow
def test_sigkill_of_a_colocated_process(tmp_path, warm, ray_cluster, monkeypatch):
    """The default layout: learner and rollout in one process (one pool). Killing it after step 3
    restarts the run once; it ends as the unkilled run of the same layout, bit for bit."""
    straight = run(make_cfg(tmp_path, warm, "colocated", "trainer.total_steps=5",
                            "controller.backend=ray"))  # fmt: skip
    cfg = make_cfg(
        tmp_path, warm, "colocated_kill", "trainer.total_steps=5", "controller.backend=ray"
    )
    killed = kill_when(tmp_path / "runs" / "colocated_kill", 3, "learner", monkeypatch)
    summary = run(cfg)
    assert len(killed) == 1 and (summary["restarts"], summary["lost_steps"]) == (1, 1)
    assert_same_weights(final_weights(summary), final_weights(straight))
    assert assert_lineage(summary, 5) == assert_lineage(straight, 5)


def _group(index: int, version: int = 0) -> list:
    from types import SimpleNamespace

    return [SimpleNamespace(uid=f"p{index}", metadata={"index": index, "admitted": version})]


def test_interrupted_buffer_hands_the_running_prompts_out_again():
    """A dead rollout (driver/replace.py): the buffer admits nothing, drops a late group of the old
    rollout, stops a waiting learner with REPLACING unless a batch is ready, and hands the
    generating prompts out first once unpaused; nothing is lost or trained twice."""
    from hybridrl.protocol import REPLACING
    from hybridrl.rollout.buffer import TrajectoryBuffer

    buf = TrajectoryBuffer(batch_groups=2, max_staleness=1)
    assert buf.admit(3, 0) == [0, 1, 2]
    buf.put(_group(1))
    buf.interrupt("rollout rank 0 died")
    assert buf.interrupted() and buf.admit(3, 0) == []
    assert buf.state()["pending_prompts"] == [0, 1, 2]
    buf.put(_group(0))  # the killed rollout's late group: dropped
    with pytest.raises(RuntimeError, match=REPLACING):
        buf.get_batch(0, timeout=5)
    buf.unpause()
    assert buf.admit(4, 0) == [0, 2, 3]  # the handed-out prompts first, then fresh ones
    for i in (0, 2):
        buf.put(_group(i))
    assert sorted(s.metadata["index"] for s in buf.get_batch(0, timeout=5)) == [0, 1]
    with pytest.raises(KeyError):
        buf.put(_group(7))


def test_replacer_retries_the_step_after_replacing(monkeypatch):
    """The learner's step that stopped on REPLACING is tried again after one replacement; any other
    learner error is raised as is."""
    from types import SimpleNamespace

    from hybridrl.driver.replace import RolloutReplacer
    from hybridrl.protocol import REPLACING

    calls = []

    def train_step(step, buffer):
        calls.append(step)
        if len(calls) == 1:
            raise WorkerError("learner", 0, "train_step", f"RuntimeError: {REPLACING}")
        if len(calls) == 3:
            raise WorkerError("learner", 0, "train_step", "ValueError: bad")
        return {"step": step}

    roles = SimpleNamespace(learner=SimpleNamespace(train_step=train_step), rollout=None)
    s = SimpleNamespace(
        roles=roles,
        watch_rollout=lambda on_death: SimpleNamespace(),
        cfg=SimpleNamespace(trainer=SimpleNamespace(mode="async")),
    )
    rep = RolloutReplacer(s, buffer=SimpleNamespace(close=None), version=0)
    rep.able, replaced = True, []
    monkeypatch.setattr(rep, "replace", lambda: replaced.append(1))
    assert rep.train_step(4) == {"step": 4} and calls == [4, 4] and replaced == [1]
    with pytest.raises(WorkerError, match="bad"):
        rep.train_step(5)


# ~50 s each. max_staleness=0: the learner is waiting for the dead rollout's groups (it stops with
# REPLACING and tries its step again); 1: it trains from groups ready, and the sync finds the death
@pytest.mark.slow
@pytest.mark.parametrize("stale", [0, 1])
def test_async_rollout_killed_is_replaced_without_stopping_the_learner(
    tmp_path, warm, ray_cluster, monkeypatch, stale
):
    """An asynchronous run whose rollout process is SIGKILLed after step 2: the rollout is replaced
    in place (driver/replace.py), the learner process is the same throughout, nothing is restored,
    and every admitted prompt is trained once or still pending at the end."""
    from hybridrl.driver import session
    from hybridrl.models.loading import make_task

    cfg = make_cfg(tmp_path, warm, "async_kill", "trainer.total_steps=6", "trainer.mode=async",
                   f"asynchronous.max_staleness={stale}", *RAY)  # fmt: skip
    run_dir = tmp_path / "runs" / "async_kill"
    built, pids = [], {}
    original = session.build_roles
    monkeypatch.setattr(session, "build_roles", lambda *a, **k: built.append(original(*a, **k))
                        or built[-1])  # fmt: skip

    def killer():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and "after" not in pids:
            done = max((r["step"] for r in rows(run_dir)), default=-1) if built else -1
            if done >= 2 and "killed" not in pids:
                pids["learner"] = built[0].learner.processes()[0]["pid"]
                pids["killed"] = built[0].rollout.processes()[0]["pid"]
                os.kill(pids["killed"], signal.SIGKILL)
            if done >= 5 and "killed" in pids:
                pids["after"] = built[0].learner.processes()[0]["pid"]
                pids["rollout"] = built[0].rollout.processes()[0]["pid"]
            time.sleep(0.05)

    threading.Thread(target=killer, daemon=True).start()
    summary = run(cfg)
    assert "killed" in pids and len(built) == 1  # one session: the run never restarted
    assert pids["after"] == pids["learner"] and pids["rollout"] != pids["killed"]
    assert summary["resumed_from_step"] is None and summary["lost_steps"] == 0
    last = rows(Path(summary["run_dir"]))[-1]
    assert last["step"] == 6 and last["fault/rollout_replacements"] >= 1
    assert last["fault/restarts"] == last["fault/rollout_replacements"]
    assert last["fault/lost_steps"] == 0
    uids = assert_lineage(summary, 6)  # no prompt trained twice
    state = json.loads((Path(summary["run_dir"]) / "checkpoints" / "step_000006" / "trainer.json")
                       .read_text())  # fmt: skip
    task = make_task(cfg)
    by_uid = {task.prompt(i).uid: i for i in range(state["prompt_cursor"])}
    trained = sorted(by_uid[u] for u in uids)
    assert sorted(trained + state["pending_prompts"]) == list(range(state["prompt_cursor"]))
