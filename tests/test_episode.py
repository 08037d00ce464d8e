"""Episodes a user writes (``rollout.episode``, ``rollout/episode.py``): token in token out through
the configured backend, each call a request seeded by its own uid, a broken episode counted and its
group aborted, the config checked before any work, and a run trained through one, synchronous and
asynchronous."""

import json
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_rollout_engine import Tok, model, prompts, rcfg, reqs

from hybridrl.checks import check_config
from hybridrl.config import Config, ConfigError, load_config
from hybridrl.rollout import ROLLOUT_BACKENDS, SamplingParams
from hybridrl.rollout.base import InFlight
from hybridrl.rollout.episode import EpisodeRollout, request_uid

HINT = [7, 8, 9]  # tokens an episode inserts between two completions (loss mask 0)


async def refine(gen, prompt, params):
    """A draft, a hint, and a final answer generated from all of it; plus the draft alone."""
    draft = await gen.generate(prompt.prompt_ids)
    final = await gen.generate(draft.prompt_ids + draft.response_ids + HINT, max_new_tokens=3)
    return [gen.join(draft, HINT, final), draft]


async def broken(gen, prompt, params):
    if prompt.uid == "u0":
        raise RuntimeError("the episode's own bug")
    if prompt.uid == "u1":
        return [await gen.generate(prompt.prompt_ids), "not a sample"]
    if prompt.uid == "u2":
        return [await gen.generate(prompt.prompt_ids)]  # one sample where the group is two
    try:
        await gen.generate(prompt.prompt_ids * 60)  # past the model's 128 positions
    except ValueError as e:
        assert "max_position" in str(e) or "positions" in str(e), e
        return [await gen.generate(prompt.prompt_ids) for _ in range(params.n)]


def sampled(new=5):
    return SamplingParams(n=2, temperature=1.0, max_new_tokens=new, seed=11)


@pytest.mark.parametrize("backend", ["native", "hf"])
def test_an_episode_is_token_in_token_out_and_seeded_per_call(backend):
    m = model()
    inner = ROLLOUT_BACKENDS.get(backend)(m, Tok(), rcfg(backend=backend))
    ps, params = reqs(prompts([4, 6])), sampled()
    out = EpisodeRollout(inner, refine, Tok()).generate(ps, params)
    assert len(out) == 4 and [s.uid for s in out] == ["u0", "u0", "u1", "u1"]
    one = replace(params, n=1)
    for i, p in enumerate(ps):
        joined, draft = out[2 * i], out[2 * i + 1]
        # each call is a request of its own: the backend alone samples the same tokens for it
        # (their log-probs agree to float rounding: the steps batch other requests with it)
        first = request_uid(p.uid, p.prompt_ids, 0)
        [alone] = inner.generate([replace(p, uid=first)], one)
        assert draft.response_ids == alone.response_ids
        assert draft.log_probs == pytest.approx(alone.log_probs, abs=1e-5)
        context = p.prompt_ids + alone.response_ids + HINT
        [final] = inner.generate(
            [replace(p, prompt_ids=context, uid=request_uid(p.uid, context, 0))],
            replace(one, max_new_tokens=3),
        )
        assert joined.prompt_ids == p.prompt_ids
        assert joined.response_ids == alone.response_ids + HINT + final.response_ids
        expect = alone.log_probs + [0.0] * 3 + final.log_probs
        assert joined.log_probs == pytest.approx(expect, abs=1e-5)
        mask = [1] * len(alone.response_ids) + [0] * 3 + [1] * len(final.response_ids)
        assert joined.loss_mask == mask and len(joined.versions) == len(mask)
        assert joined.metadata.get("prompt") is p.metadata.get("prompt")


def test_the_stream_takes_each_episode_when_it_is_done_and_an_aborted_one_with_what_it_has():
    """An aborted prompt's completion in the engine comes back to its episode with the tokens it
    has, its later calls aborted at once without reaching the engine, and the episode returns."""
    inner = ROLLOUT_BACKENDS.get("native")(model(), Tok(), rcfg())
    rollout = EpisodeRollout(inner, refine, Tok())
    ps, params = reqs(prompts([4, 6, 5])), sampled(new=12)
    flight = InFlight(rollout)
    flight.add(ps, params)
    got = {}
    while not any(r.uid.startswith("u1/") for _, r, _, _ in rollout.running.values()):
        flight.step()  # until u1's draft is in the engine
    for _ in range(3):  # and has sampled some tokens
        got |= {prompt.uid: samples for prompt, samples in flight.step()}
    rollout.abort(["u1"])
    assert any(uid.startswith("u1/") for uid in inner.engine.aborted)  # dropped at its next step
    while len(flight):
        for prompt, samples in flight.step():
            got[prompt.uid] = samples
    assert [s.status for s in got["u1"]] == ["aborted", "aborted"]
    joined, draft = got["u1"]
    assert draft.response_ids and len(draft.log_probs) == len(draft.response_ids)
    assert joined.response_ids == draft.response_ids + HINT  # the final answer never ran
    assert not rollout.running and not rollout.groups and not inner.engine.has_unfinished()
    alone = EpisodeRollout(ROLLOUT_BACKENDS.get("native")(model(), Tok(), rcfg()), refine, Tok())
    expect = alone.generate([ps[0], ps[2]], params)
    assert [s.response_ids for s in got["u0"] + got["u2"]] == [s.response_ids for s in expect]


def test_a_broken_episode_comes_back_aborted_and_counted(caplog):
    inner = ROLLOUT_BACKENDS.get("native")(model(), Tok(), rcfg())
    rollout = EpisodeRollout(inner, broken, Tok())
    out = rollout.generate(reqs(prompts([4, 6, 5, 3])), sampled())
    # u0 raised, u1 returned a str, u2 one sample of a group of two
    assert [s.status for s in out[:6]] == ["aborted"] * 6
    assert {s.status for s in out[6:]} <= {"finished", "truncated"} and len(out) == 8
    stats = rollout.stats()
    assert (stats["episode/errors"], stats["episode/count"]) == (3, 1)
    for why in ("the episode's own bug", "not a Sample", "params.n = 2 Samples"):
        assert why in caplog.text


def episode_file(tmp_path) -> Path:
    path = tmp_path / "episodes.py"
    path.write_text(
        textwrap.dedent(
            """
            import asyncio


            async def refine(gen, prompt, params):
                hint = gen.tokenizer.encode(" ok?", add_special_tokens=False)

                async def attempt():
                    draft = await gen.generate(prompt.prompt_ids)
                    context = draft.prompt_ids + draft.response_ids + hint
                    return gen.join(draft, hint, await gen.generate(context, max_new_tokens=4))

                return await asyncio.gather(*(attempt() for _ in range(params.n)))


            def not_async(gen, prompt, params):
                return []
            """
        )
    )
    return path


def test_the_episode_is_checked_before_any_work(tmp_path):
    path = episode_file(tmp_path)
    with pytest.raises(ConfigError, match="rollout.episode.*async def"):
        check_config(load_config(Config, None, [f"rollout.episode={path}:not_async"]))
    with pytest.raises(ConfigError, match="rollout.episode.*no_such"):
        check_config(load_config(Config, None, [f"rollout.episode={path}:no_such"]))
    with pytest.raises(ConfigError, match="rollout.episode.*subclass of .*EnvEpisode"):
        with_env = [f"rollout.episode={path}:refine", "env.name=calc_tool", "task.name=calc"]
        check_config(load_config(Config, None, with_env))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_run_trains_through_an_episode(tmp_path, mode):
    """examples/arith_refine.yaml, two short steps: its attempts answer twice, through the stream
    too."""
    import hybridrl

    root = Path(__file__).resolve().parents[1]
    summary = hybridrl.train(
        root / "examples" / "arith_refine.yaml",
        overrides=[
            f"rollout.episode={root / 'examples' / 'arith_refine.py'}:refine",
            f"task.reward_fn={root / 'examples' / 'arith_refine.py'}:second_answer",
            f"trainer.mode={mode}",
            "sft.steps=3",
            "sft.batch_size=16",
            "trainer.total_steps=2",
            "trainer.prompts_per_step=4",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=8",
            "task.eval_size=8",
            "trainer.eval_every=0",
            "trainer.progress=false",
            "trainer.loggers=[jsonl]",
            "controller.num_threads=1",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            "trainer.name=episode",
        ],
    )
    assert summary["steps"] == 2
    lines = [json.loads(x) for x in (tmp_path / "runs" / "episode" / "metrics.jsonl").open()]
    steps = [x for x in lines if "episode/count" in x]
    assert steps and all(x["episode/errors"] == 0 for x in steps)
    assert sum(x["episode/count"] for x in steps) >= 8  # 2 steps x 4 prompts, each one episode
    # each attempt is two calls: a training episode makes two attempts, an evaluation's one
    calls = [x["episode/generate_calls_mean"] for x in steps if x["episode/count"]]
    assert all(2 <= c <= 4 for c in calls) and max(calls) == 4, calls


def test_join_keeps_an_moe_models_routing_token_for_token():
    from test_rollout_moe import model as moe_model
    from test_rollout_moe import rcfg as moe_rcfg

    from hybridrl.moe.routing import NOT_ROUTED

    async def joined(gen, prompt, params):
        draft = await gen.generate(prompt.prompt_ids)
        final = await gen.generate(draft.prompt_ids + draft.response_ids + HINT)
        return [gen.join(draft, HINT, final), gen.join(draft, HINT)]

    inner = ROLLOUT_BACKENDS.get("native")(moe_model("qwen3_moe"), Tok(), moe_rcfg())
    [through, hint_last] = EpisodeRollout(inner, joined, Tok()).generate(
        reqs(prompts([5])), replace(sampled(), n=2)
    )
    for s in (through, hint_last):
        assert s.routing.shape[0] == len(s.prompt_ids) + len(s.response_ids)
    # the final call's prompt was everything joined before it, so its routing covers the draft
    # and the hint too (the hint is routed there, as a prompt); the draft's own is the same
    cut = len(hint_last.prompt_ids) + len(hint_last.response_ids) - len(HINT)
    assert torch.equal(through.routing[: cut - 1], hint_last.routing[: cut - 1])
    assert (through.routing[cut : cut + len(HINT)] != NOT_ROUTED).all()
    assert (hint_last.routing[-len(HINT) :] == NOT_ROUTED).all()  # never fed to a forward


def test_a_named_call_is_seeded_by_its_name_and_misuse_is_named(caplog):
    """A named call's uid is ``<prompt uid>/<name>`` whatever the order calls are asked in; a name
    given twice, or ``frozen=True`` with no frozen policy, fails the episode with what was wrong."""
    import asyncio

    async def named(gen, prompt, params):
        async def late(i):
            await asyncio.sleep(0.01 * (params.n - i))  # asked in the reverse order
            return await gen.generate(prompt.prompt_ids, name=f"a{i}")

        out = await asyncio.gather(*(late(i) for i in range(params.n)))
        if prompt.uid == "u1":
            await gen.generate(prompt.prompt_ids, name="a0")
        if prompt.uid == "u2":
            await gen.generate(prompt.prompt_ids, frozen=True)
        return out

    inner = ROLLOUT_BACKENDS.get("native")(model(), Tok(), rcfg())
    ps, params = reqs(prompts([4, 6, 5])), sampled()
    rollout = EpisodeRollout(inner, named, Tok())
    out = rollout.generate(ps, params)
    for i in range(2):
        [alone] = inner.generate([replace(ps[0], uid=f"u0/a{i}")], replace(params, n=1))
        assert out[i].response_ids == alone.response_ids
    assert [s.status for s in out[2:]] == ["aborted"] * 4
    assert rollout.stats()["episode/errors"] == 2
    assert "'a0' was given to an earlier call" in caplog.text and "no frozen policy" in caplog.text
