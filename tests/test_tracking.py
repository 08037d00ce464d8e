"""Experiment tracking: trainer.loggers (jsonl, TensorBoard, wandb offline), tables of sample
completions (samples.jsonl, TensorBoard text, wandb.Table) and reward extras in the metrics, in
unit tests and tiny real runs in both modes. wandb runs offline and never touches the network."""

import json
import struct
import sys
import time

import pytest

from hybridrl.cli import main
from hybridrl.protocol import Sample
from hybridrl.telemetry import MetricsLogger, read_metrics
from hybridrl.telemetry.samples import RecentSamples, columns, markdown, pick, sample_rows
from hybridrl.telemetry.tracking import RUN_ID_FILE, wandb_mode


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb offline, its files under tmp_path, no API key."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var, sub in [
        ("WANDB_DIR", "wandb_dir"),
        ("WANDB_CONFIG_DIR", "wandb_config"),
        ("WANDB_CACHE_DIR", "wandb_cache"),
        ("WANDB_DATA_DIR", "wandb_data"),
    ]:
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(var, str(tmp_path / sub))


def wandb_records(run_dir):
    """The protobuf records of the offline wandb runs under ``run_dir/wandb`` (the .wandb file:
    a 7-byte header, then leveldb-log blocks of 32 KiB), with the run's id."""
    from google.protobuf.message import DecodeError
    from wandb.proto import wandb_internal_pb2 as pb

    out = []
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        data, pos, block, buf = path.read_bytes(), 7, 32768, b""
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # block trailer
                pos += block - pos % block
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            buf += data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind == 0:
                break
            if kind in (1, 4):  # a full record, or the last piece of one
                rec = pb.Record()
                try:
                    rec.ParseFromString(buf)
                except DecodeError:  # still being written
                    break
                out.append(rec)
                buf = b""
    return out


def finished_records(run_dir, runs: int = 1, timeout_s: float = 60.0):
    """:func:`wandb_records` once ``runs`` runs have their exit record: wandb's service process may
    still be writing the file when ``finish()`` returns."""
    deadline = time.monotonic() + timeout_s
    while True:
        records = wandb_records(run_dir)
        kinds = [r.WhichOneof("record_type") for r in records]
        if kinds.count("exit") >= runs or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def wandb_history(run_dir, runs: int = 1) -> list[dict]:
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in finished_records(run_dir, runs)
        if r.WhichOneof("record_type") == "history"
    ]


def tb_text(run_dir) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"), size_guidance={"tensors": 0})
    acc.Reload()
    if "samples/text_summary" not in acc.Tags()["tensors"]:
        return []
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("samples/text_summary")]


class Tok:
    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i == 0))


def sample(uid, reward, response=(5, 6, 0), **extras):
    from hybridrl.tasks import Prompt

    return Sample(
        prompt_ids=[1, 2],
        response_ids=list(response),
        status="finished",
        uid=uid,
        reward=reward,
        reward_extras=dict(extras),
        metadata={"prompt": Prompt(uid, f"q {uid} | x\nline", "a", "t")},
    )


# --- tables ---------------------------------------------------------------------------------------
def test_pick_spreads_over_groups_deterministically():
    batch = [sample(u, float(i)) for u in "abc" for i in range(2)]
    assert [(s.uid, s.reward) for s in pick(batch, 4)] == [
        ("a", 0.0),
        ("b", 0.0),
        ("c", 0.0),
        ("a", 1.0),
    ]
    assert pick(batch, 100) == pick(batch, 6) and pick([], 3) == []


def test_rows_have_text_reward_extras_status_and_turns():
    rows = sample_rows(
        [sample("a", 1.0, **{"reward/format": 0.5}), sample("b", float("nan"))], Tok(), 7, 5
    )
    assert rows[0] == {
        "step": 7,
        "uid": "a",
        "prompt": "q a | x\nline",
        "completion": "5 6",  # special tokens (here 0) skipped
        "reward": 1.0,
        "status": "finished",
        "turns": 1,
        "reward/format": 0.5,
    }
    assert rows[1]["reward"] is None  # not finite: null, as in metrics.jsonl
    assert columns(rows)[-1] == "reward/format"
    md = markdown(rows).splitlines()
    assert md[0].startswith("| step | uid | prompt | completion | reward |")
    assert "q a \\| x<br>line" in md[2] and len(md) == 4  # one line per row


def test_recent_samples_keeps_the_latest_groups_since_the_last_table():
    recent = RecentSamples(2)
    for u in "abc":
        assert recent.keep([sample(u, 1.0)]) == [sample(u, 1.0)]
    assert [s.uid for s in recent.take()] == ["b", "c"]
    recent.keep([sample("d", 1.0)])
    assert [s.uid for s in recent.take()] == ["d"]  # not c again: it was in the last table
    assert recent.take() == []


# --- sinks ----------------------------------------------------------------------------------------
def test_jsonl_only_writes_no_tensorboard(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"reward/mean": 0.5})
        logger.log_samples(1, sample_rows([sample("a", 1.0)], Tok(), 1, 1))
    assert not (tmp_path / "tb").exists() and not (tmp_path / "wandb").exists()
    assert read_metrics(tmp_path) == [{"step": 1, "reward/mean": 0.5}]
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["uid"]) for r in rows] == [(1, "a")]


def test_tensorboard_gets_the_table_as_text_and_resume_trims_samples(tmp_path):
    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3):
            logger.log(step, {"reward/mean": step / 10})
            logger.log_samples(step, sample_rows([sample(f"p{step}", 1.0)], Tok(), step, 1))
    texts = tb_text(tmp_path)
    assert len(texts) == 3 and "| p2 |" in texts[1]
    with MetricsLogger(tmp_path, tensorboard=False, resume_step=2) as logger:
        logger.log_samples(3, sample_rows([sample("again", 1.0)], Tok(), 3, 1))
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(r["step"], r["uid"]) for r in rows] == [(1, "p1"), (2, "p2"), (3, "again")]


def test_wandb_mode_follows_the_environment():
    assert wandb_mode({}) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k"}) == "online"
    assert wandb_mode({"WANDB_API_KEY": "k", "WANDB_MODE": "disabled"}) is None  # wandb reads it


def test_wandb_offline_run_has_metrics_table_and_keeps_its_id_on_resume(tmp_path, offline_wandb):
    run = tmp_path / "run"
    cfg = {"project": "proj", "name": "tiny", "config": {"trainer": {"seed": 3}, "fn": print}}
    with MetricsLogger(run, tensorboard=False, wandb=cfg) as logger:
        logger.log(1, {"reward/mean": 0.25, "note": "text"})
        logger.log_samples(1, sample_rows([sample("a", 1.0, reward_errors=0.0)], Tok(), 1, 1))
    run_id = (run / RUN_ID_FILE).read_text().strip()
    (first,) = (run / "wandb").glob(f"offline-run-*-{run_id}")
    history = wandb_history(run)
    assert history[0]["reward/mean"] == 0.25 and history[0]["step"] == 1
    assert "note" not in history[0]  # strings go to metrics.jsonl only
    assert history[1]["samples/_type"] == "table-file" and history[1]["step"] == 1
    (table,) = (first / "files" / "media" / "table").glob("samples_*.table.json")
    data = json.loads(table.read_text())
    assert data["columns"] == [*columns([{}]), "reward_errors"]
    assert data["data"][0][:4] == [1, "a", "q a | x\nline", "5 6"]
    runs = [r.run for r in finished_records(run) if r.WhichOneof("record_type") == "run"]
    assert (runs[0].run_id, runs[0].project, runs[0].display_name) == (run_id, "proj", "tiny")
    # a resumed run continues the same wandb run
    with MetricsLogger(run, tensorboard=False, resume_step=1, wandb=cfg) as logger:
        logger.log(2, {"reward/mean": 0.5})
    assert (run / RUN_ID_FILE).read_text().strip() == run_id
    assert len(list((run / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
    assert [h["step"] for h in wandb_history(run, runs=2) if "reward/mean" in h] == [1, 2]


def test_wandb_missing_is_a_config_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb fails
    code = main(["train", "trainer.loggers=[jsonl,wandb]", f"trainer.runs_dir={tmp_path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1
    assert "trainer.loggers" in err and "pip install 'hybridrl[wandb]'" in err
    assert not any(tmp_path.iterdir())  # before any work
    assert main(["train", "trainer.loggers=[jsonl]", "--print-config"]) == 0


# --- tiny real runs -------------------------------------------------------------------------------
def length_reward(prompt, response):
    """A score and an extra number (the completion's length), which must reach the metrics."""
    return {"score": float(len(response) % 2), "length": float(len(response))}


def samples_of(run_dir) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]


def check_rows(rows, steps, per_step):
    assert [r["step"] for r in rows] == [s for s in steps for _ in range(per_step)]
    for step in steps:
        uids = [r["uid"] for r in rows if r["step"] == step]
        assert len(set(uids)) == per_step  # one sample per prompt
    for r in rows:
        assert isinstance(r["prompt"], str) and r["prompt"]
        assert isinstance(r["completion"], str) and r["turns"] == 1
        assert r["status"] in ("finished", "truncated") and r["reward"] in (0.0, 1.0)
        # the extra the reward function returned, computed on the completion the table shows
        assert r["reward/length"] == len(r["completion"]) and r["reward_errors"] == 0.0


def test_sync_run_writes_tables_everywhere_and_resume_appends(tmp_path, offline_wandb):
    from test_train_e2e import make_cfg

    from hybridrl.driver.loop import train

    extra = [
        f"task.reward_fn={__name__}:length_reward",
        "trainer.loggers=[jsonl,tensorboard,wandb]",
        "trainer.log_samples_every=1",
        "trainer.log_samples=3",
        "trainer.name=tracked",
    ]
    train(make_cfg(tmp_path, *extra))
    run_dir = tmp_path / "runs" / "tracked"
    check_rows(samples_of(run_dir), [1, 2], 3)
    metrics = read_metrics(run_dir)
    assert all(isinstance(m["reward/length"], float) for m in metrics[1:])  # the extra's mean
    texts = tb_text(run_dir)
    assert len(texts) == 2 and texts[0].startswith("| step | uid | prompt | completion |")
    run_id = (run_dir / RUN_ID_FILE).read_text().strip()
    assert any("reward/length" in h for h in wandb_history(run_dir))
    assert list((run_dir / "wandb").glob("offline-run-*/files/media/table/samples_*.table.json"))
    train(make_cfg(tmp_path, *extra, "trainer.total_steps=3"), resume=True)
    check_rows(samples_of(run_dir), [1, 2, 3], 3)
    assert (run_dir / RUN_ID_FILE).read_text().strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 2


def test_async_run_writes_tables_from_the_rollouts_latest_groups(tmp_path):
    from test_async import make_cfg

    from hybridrl.driver.loop import train

    cfg = make_cfg(
        tmp_path,
        f"task.reward_fn={__name__}:length_reward",
        "trainer.total_steps=2",
        "trainer.log_samples_every=2",
        "trainer.log_samples=2",
        "trainer.name=async_tracked",
    )
    train(cfg)
    run_dir = tmp_path / "runs" / "async_tracked"
    check_rows(samples_of(run_dir), [2], 2)  # every 2 steps: only the last
    metrics = read_metrics(run_dir)
    assert all(isinstance(m["reward/length"], float) for m in metrics[1:])
    assert not (run_dir / "tb").exists()  # trainer.loggers=[jsonl]
