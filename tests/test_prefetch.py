"""Prompt prefetch (data/prefetch.py): the same prompt samples in the same order as without it, for
the synchronous driver's consecutive rounds and the asynchronous stream's admissions (a resume's
retried prompts first); a prompt source that raises makes the run stop at once with its own error
(both drivers); a tiny run is the same with and without prefetch, metric for metric."""

import threading
import time

import pytest
from test_async import make_cfg as async_cfg
from test_resume import assert_same_runs, cfg

from hybridrl.config import Config, load_config
from hybridrl.data.prefetch import PromptPrefetcher
from hybridrl.driver import loop
from hybridrl.models.loading import make_task
from hybridrl.protocol import prompt_sample
from hybridrl.tasks.reverse import ReverseTask

BROKEN_AT = 6


class FailingTask(ReverseTask):
    """W3 whose prompt stream breaks at prompt ``BROKEN_AT`` (a bug in a user's data)."""

    def prompt(self, index):
        if index >= BROKEN_AT:
            raise ValueError(f"row {index} of the prompt source is unreadable")
        return super().prompt(index)


class SlowTask(ReverseTask):
    """Every prompt takes ``delay`` seconds to prepare; records the preparing threads."""

    delay = 0.05

    def prompt(self, index):
        self.threads = getattr(self, "threads", set()) | {threading.current_thread().name}
        time.sleep(self.delay)
        return super().prompt(index)


def task_and_tokenizer(name: str = "reverse"):
    task = make_task(load_config(Config, None, [f"task.name={name}"]))
    return task, task.tokenizer()


def same(a, b) -> bool:
    return (a.prompt_ids, a.uid, a.task_id, a.metadata) == (
        b.prompt_ids,
        b.uid,
        b.task_id,
        b.metadata,
    )


def test_the_same_prompts_in_the_same_order():
    task, tok = task_and_tokenizer()
    plain = [prompt_sample(task.prompt(i), tok) for i in range(40)]
    for ahead in (0, 4, 8):
        p = PromptPrefetcher(task, tok, ahead)
        got = p.take(0, 4) + p.take(4, 4) + p.take(8, 4)  # consecutive rounds (sync)
        got += p.take(20, 4)  # a resume elsewhere in the stream
        # asynchronous admissions: retried prompts first, then fresh ones, one at a time
        got += [p.get(i) for i in (13, 17, 30, 31, 32, 33)]
        p.close()
        order = [*range(12), *range(20, 24), 13, 17, 30, 31, 32, 33]
        assert len(got) == len(order)
        assert all(same(g, plain[i]) for g, i in zip(got, order)), ahead


def test_the_next_prompts_are_prepared_while_the_step_runs():
    task, tok = task_and_tokenizer(f"{__name__}:SlowTask")
    p = PromptPrefetcher(task, tok, 4)
    p.take(0, 4)
    time.sleep(6 * SlowTask.delay)  # the step runs; the next 4 are prepared meanwhile
    t0 = time.perf_counter()
    p.take(4, 4)
    waited = time.perf_counter() - t0
    p.close()
    assert waited < 2 * SlowTask.delay and task.threads == {"prompt-prefetch_0"}


def test_a_failing_prompt_source_raises_its_own_error_at_once():
    task, tok = task_and_tokenizer(f"{__name__}:FailingTask")
    p = PromptPrefetcher(task, tok, 4)
    assert len(p.take(0, 4)) == 4  # 4..7 queued; 6 fails on the thread, silently for now
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="row 6 of the prompt source is unreadable"):
        p.take(4, 4)
    assert time.perf_counter() - t0 < 5
    p.close()


def test_a_failing_prompt_source_stops_a_synchronous_run_with_its_error(tmp_path):
    config = async_cfg(
        tmp_path, f"task.name={__name__}:FailingTask", "trainer.total_steps=5", "trainer.mode=sync"
    )
    t0 = time.perf_counter()
    # the rollout reads the prompts in both modes: its error names the row
    with pytest.raises(Exception, match="row 6 of the prompt source is unreadable"):
        loop.train(config)
    assert time.perf_counter() - t0 < 120
    rows = (tmp_path / "runs" / "failingtask_grpo" / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2  # the evaluation before training and step 1 (prompts 0..3)


def test_a_failing_prompt_source_stops_an_asynchronous_run_with_its_error(tmp_path):
    config = async_cfg(
        tmp_path,
        f"task.name={__name__}:FailingTask",
        "trainer.total_steps=5",
        "asynchronous.batch_timeout_s=600",
    )
    t0 = time.perf_counter()
    with pytest.raises(Exception, match="row 6 of the prompt source is unreadable"):
        loop.train(config)
    assert time.perf_counter() - t0 < 120  # not the batch timeout


def test_a_tiny_run_is_the_same_with_and_without_prefetch(tmp_path):
    """Dynamic sampling (a variable number of prompts per step) and the adaptive KL coefficient
    (tests/test_resume.py's run): every metric equal, bit for bit."""
    loop.train(cfg(tmp_path, "plain", 3, "trainer.prefetch_steps=0"))
    loop.train(cfg(tmp_path, "ahead", 3, "trainer.prefetch_steps=2"))
    rows = assert_same_runs(tmp_path, "plain", "ahead", 3)
    assert any(rows[s]["rollout/dropped_groups"] > 0 for s in rows if s > 0)
