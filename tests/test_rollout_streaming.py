"""Streaming through the rollout interface (``add`` / ``step`` / ``done`` / ``take``): the native
backend's continuous batch and the default over ``generate`` (the hf backend) give what
``generate`` gives."""

import threading

import pytest
import torch
from test_rollout_engine import Tok, model, prompts, rcfg

from hybridrl.protocol import Sample
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.base import InFlight

torch.set_num_threads(1)
BACKENDS = ["native", "hf"]


def engine(backend, m):
    return ROLLOUT_BACKENDS.get(backend)(m, Tok(), rcfg(backend=backend))


def prompt_samples(lengths):
    return [
        Sample(prompt_ids=p, uid=f"u{i}", task_id="t", metadata={"index": i})
        for i, p in enumerate(prompts(lengths))
    ]


def stream(eng, ps, n):
    """Step until every prompt is done; the samples in prompt order and the number of steps."""
    pending, steps = list(ps), 0
    while pending:
        eng.step()
        steps += 1
        pending = [p for p in pending if not eng.done(p, n)]
    return [s for p in ps for s in eng.take(p, n)], steps


def assert_same(got, want):
    assert [(s.uid, s.task_id, s.status, s.metadata) for s in got] == [
        (s.uid, s.task_id, s.status, s.metadata) for s in want
    ]
    assert [s.prompt_ids for s in got] == [s.prompt_ids for s in want]
    assert [s.response_ids for s in got] == [s.response_ids for s in want]
    assert [s.versions for s in got] == [s.versions for s in want]
    for a, b in zip(got, want):
        torch.testing.assert_close(torch.tensor(a.log_probs), torch.tensor(b.log_probs))


@pytest.mark.parametrize("backend", BACKENDS)
def test_streamed_samples_equal_the_generated_ones(backend):
    m = model()
    ps = prompt_samples([5, 9])
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3)
    want = engine(backend, m).generate(ps, params)
    eng = engine(backend, m)
    assert eng.add(ps, params) == ps
    assert not any(eng.done(p, 2) for p in ps)
    got, steps = stream(eng, ps, 2)
    assert len(got) == 4 and [s.uid for s in got] == ["u0", "u0", "u1", "u1"]
    assert_same(got, want)
    assert all(s.metadata == {"index": int(s.uid[1])} for s in got)  # the prompt's metadata kept
    # native: one token per step for each sequence; the default: one generate for the queue
    assert steps >= 8 if backend == "native" else steps == 1
    assert eng.take(ps[0], 2) == [ps[0].aborted()] * 2  # taken: nothing left


@pytest.mark.parametrize("backend", BACKENDS)
def test_prompts_added_with_their_own_params(backend):
    """As asynchronous training adds them: one prompt at a time, each with its own seed."""
    m = model()
    ps = prompt_samples([4, 7, 6])
    base = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    per_prompt = [SamplingParams(**{**base.__dict__, "seed": 10 + i}) for i in range(len(ps))]
    gen = engine(backend, m)
    want = [s for p, sp in zip(ps, per_prompt) for s in gen.generate([p], sp)]
    eng = engine(backend, m)
    for p, sp in zip(ps, per_prompt):
        eng.add([p], sp)
    got, _ = stream(eng, ps, 2)
    assert_same(got, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_aborted_prompt_is_done_with_aborted_samples(backend):
    m = model()
    ps = prompt_samples([5, 6, 4])
    params = SamplingParams(temperature=0, max_new_tokens=5)
    eng = engine(backend, m)
    eng.abort(["u0"])
    assert eng.add(ps, params) == ps[1:]  # aborted before it was added: not queued
    assert eng.done(ps[0], 1) and eng.take(ps[0], 1) == [ps[0].aborted()]
    eng.abort(["u2"])  # added, not finished yet
    got, _ = stream(eng, ps[1:], 1)
    assert [s.status for s in got] == ["truncated", "aborted"]
    assert got[1].response_ids == [] and got[1].metadata == {"index": 2}


@pytest.mark.parametrize("backend", BACKENDS)
def test_in_flight_takes_each_group_when_it_is_done(backend):
    """InFlight, the loop every caller drives a backend through: a prompt aborted before it was
    added comes back at once as its aborted samples, without an engine step; the others as each
    finishes, with what ``generate`` gives."""
    m = model()
    ps = prompt_samples([5, 9, 4])
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2, seed=3)
    want = engine(backend, m).generate(ps[1:], params)
    eng = engine(backend, m)
    eng.abort(["u0"])
    steps, step = [], eng.step
    eng.step = lambda: steps.append(1) or step()
    flight = InFlight(eng)
    flight.add(ps, params)
    assert len(flight) == 3
    first = flight.step()
    assert not steps and [(p.uid, samples) for p, samples in first] == [
        ("u0", [ps[0].aborted()] * 2)
    ]
    got = {}
    while flight:
        got |= {p.uid: samples for p, samples in flight.step()}
    assert_same(got["u1"] + got["u2"], want)
    assert steps  # the queued prompts needed engine steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_waits_while_paused(backend):
    m = model()
    ps = prompt_samples([5])
    eng = engine(backend, m)
    eng.add(ps, SamplingParams(temperature=0, max_new_tokens=4))
    eng.pause()
    stepped = threading.Event()
    t = threading.Thread(target=lambda: (eng.step(), stepped.set()))
    t.start()
    assert not stepped.wait(0.2)  # a paused engine does not step
    eng.resume()
    t.join(30)
    assert stepped.is_set()
    got, _ = stream(eng, ps, 1)
    assert len(got[0].response_ids) == 4


def test_a_weight_sync_waits_for_the_default_step_in_flight():
    """Asynchronous training syncs weights from another thread while the stream steps: with the
    default streaming (one ``generate`` per step) the sync must wait until that call returns, so
    that all tokens of a call come from one version and carry it."""
    eng = engine("hf", model())
    events, started = [], threading.Event()
    generate = eng.generate

    def slow_generate(ps, params):
        started.set()
        events.append("generate starts")
        out = generate(ps, params)
        threading.Event().wait(0.3)  # the sync below arrives while this call is still running
        events.append("generate ends")
        return out

    eng.generate = slow_generate
    weights = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]
    eng.add(prompt_samples([3]), SamplingParams(max_new_tokens=4, n=1, seed=0))
    stepper = threading.Thread(target=eng.step)
    stepper.start()
    assert started.wait(30)
    eng.update_weights(iter(weights), version=1)
    events.append("sync done")
    stepper.join()
    assert events == ["generate starts", "generate ends", "sync done"]
    assert eng.version == 1
