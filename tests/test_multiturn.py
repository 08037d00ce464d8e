"""Multi-turn rollouts with environments (hybridrl/envs/): token-in-token-out, masks, log-probs and
versions per token, limits, failing and slow environments, the extension property of chat
templates, and W4 (the calculator task) trained end to end in both modes."""

import asyncio
import json
import time

import pytest
import torch

from hybridrl.algorithms import compute_advantages
from hybridrl.algorithms.advantages import token_level_scores
from hybridrl.config import Config, load_config
from hybridrl.config.schema import DataConfig, EnvConfig
from hybridrl.data.render import render_prompt
from hybridrl.driver.sft import sft_batch
from hybridrl.envs import Env, StepResult
from hybridrl.envs.calc_tool import CalcToolEnv
from hybridrl.models.loading import load_model
from hybridrl.protocol import Sample, prompt_sample, samples_to_batch
from hybridrl.rollout import SamplingParams
from hybridrl.rollout.backends.native import NativeRollout
from hybridrl.rollout.base import RolloutEngine
from hybridrl.rollout.buffer import BufferHandle, TrajectoryBuffer
from hybridrl.rollout.env_rewards import EnvRewards
from hybridrl.rollout.episode import EpisodeRollout
from hybridrl.rollout.multiturn import EnvEpisode
from hybridrl.rollout.stream import RolloutStream
from hybridrl.rollout.turns import Group, Trajectory
from hybridrl.tasks import Prompt, Task, build_char_tokenizer
from hybridrl.tasks.calc import CalcTask

torch.set_num_threads(1)
TOK = CalcTask().tokenizer()


# --- environments and a scripted engine for the unit tests ----------------------------------------
class Echo(Env):
    """Answers every turn with ``<obs>N</obs>`` (N: the turn number); done after ``turns``."""

    def __init__(self, turns: int = 2, sleep_s: float = 0.0, fail_on: str = ""):
        self.turns, self.sleep_s, self.fail_on, self.n = turns, sleep_s, fail_on, 0
        self.prompt = None

    def reset(self, prompt):
        self.prompt = prompt
        if self.fail_on == "reset":
            raise RuntimeError("broken reset")

    def step(self, action):
        time.sleep(self.sleep_s)
        self.n += 1
        if self.fail_on == self.prompt.uid:
            raise RuntimeError("broken tool")
        if self.n >= self.turns:
            return StepResult(reward=1.0, done=True, info={"turns_seen": float(self.n)})
        return StepResult(observation=f"<obs>{self.n}</obs>", reward=0.25)


class AsyncSleep(Env):
    async def step(self, action):
        await asyncio.sleep(0.3)
        return StepResult(observation="<obs>1</obs>") if action != "9" else StepResult(done=True)


class Hang(Env):
    def step(self, action):
        time.sleep(30)


class Scripted(RolloutEngine):
    """A stand-in for a model: each turn's tokens are ``script(turn index, prompt ids)``, with
    log-prob -(1 + i) / 10 for the i-th token and the engine's version (the default streaming
    queue of the interface)."""

    def __init__(self, script):
        super().__init__()
        self.script, self.contexts, self.calls = script, [], 0

    def generate(self, prompts, params):
        self.calls += 1
        out = []
        for p in prompts:
            self.contexts.append(list(p.prompt_ids))
            turn = int(p.uid.rsplit(".", 1)[1])  # the environment rollout's call <traj>.<turn>
            ids = self.script(turn, p.prompt_ids)[: params.max_new_tokens]
            lps = [-(1 + i) / 10 for i in range(len(ids))]
            out += [p.with_response(ids, lps, [self.version] * len(ids), "finished")] * params.n
        return out

    def _load_weights(self, named_tensors, version):
        return len(list(named_tensors))


def ids(text: str) -> list[int]:
    return TOK(text, add_special_tokens=False)["input_ids"]


def prompts(k: int = 2) -> list[Sample]:
    task = CalcTask()
    return [prompt_sample(task.prompt(i), TOK) for i in range(k)]


def env_rollout(engine, tok, env, env_cls, data=None, frozen=None) -> EpisodeRollout:
    """The environment rollout over ``engine``: the episode the run makes for ``env.name``."""
    return EpisodeRollout(engine, EnvEpisode(tok, env, env_cls, data), tok, frozen=frozen)


def rollout(engine, env_cls, **env) -> EpisodeRollout:
    return env_rollout(engine, TOK, EnvConfig(name="test", **env), env_cls)


def params(**kw) -> SamplingParams:
    return SamplingParams(**({"n": 2, "max_new_tokens": 8, "seed": 3} | kw))


# --- token-in-token-out ---------------------------------------------------------------------------
class Recording(NativeRollout):
    """The native backend, recording every turn it was given and what it returned."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.turns: dict[str, tuple[list[int], Sample]] = {}
        self.given: dict[str, list[int]] = {}

    def add(self, prompts, params):
        for p in prompts:
            self.given[p.uid] = list(p.prompt_ids)
        return super().add(prompts, params)

    def take(self, prompt, n):
        out = super().take(prompt, n)
        self.turns[prompt.uid] = out[0]
        return out


def test_trained_tokens_are_the_engines_tokens_plus_the_observations():
    cfg = load_config(Config, None, ["task.name=calc"])
    model, tok = load_model(cfg, None)
    engine = Recording(model, tok, cfg.rollout)
    mt = rollout(engine, Echo, max_turns=3, kwargs={"turns": 3})
    out = mt.generate(prompts(2), params(max_new_tokens=6))
    assert len(out) == 4
    for k, s in enumerate(out):
        traj = f"{s.uid}/{k % 2}"
        want, mask, lps, vers = [], [], [], []
        for turn in range(3):
            t = engine.turns[f"{traj}.{turn}"]
            # each turn's prompt is the trajectory so far, exactly
            assert engine.given[f"{traj}.{turn}"] == s.prompt_ids + want
            want += t.response_ids
            mask += [1] * len(t.response_ids)
            lps += t.log_probs
            vers += t.versions
            if turn < 2:
                obs = ids(f"<obs>{turn + 1}</obs>")
                z = len(obs)
                want, mask, lps, vers = want + obs, mask + [0] * z, lps + [0.0] * z, vers + [0] * z
        assert s.response_ids == want and s.loss_mask == mask
        assert s.log_probs == lps and s.versions == vers
        assert s.status == "finished" and s.metadata["env_turns"] == 3
        assert s.metadata["env_reward"] == pytest.approx(1.5)
    batch = samples_to_batch(out, tok.pad_token_id)
    assert batch["response_mask"].sum().item() == sum(sum(s.loss_mask) for s in out)
    # later turns find the trajectory so far in the native engine's prefix cache
    assert mt.stats()["engine/prefix_hit_rate"] > 0


def test_an_moe_engine_records_each_trajectorys_routing_for_replay():
    """On a mixture-of-experts policy every trajectory carries the routing the engine recorded
    (for routing replay): one row per token of prompt, turns and observations, equal to
    transformers' top-k over the whole trajectory (the same fp32 weights: computed turn by turn
    through the prefix cache, or at once, the experts chosen are the same), the last token never
    fed; the batch the trainer gets holds it."""
    from hybridrl.models.factory import build_model
    from hybridrl.moe.routing import NOT_ROUTED, record

    cfg = load_config(Config, None, ["task.name=calc", "rollout.backend_options.dtype=fp32"])
    model = build_model("tiny_moe", TOK, 0)
    mt = rollout(NativeRollout(model, TOK, cfg.rollout), Echo, max_turns=3, kwargs={"turns": 3})
    out = mt.generate(prompts(2), params(max_new_tokens=6))
    assert len(out) == 4
    for s in out:
        full = s.prompt_ids + s.response_ids
        assert 0 in s.loss_mask  # observations inside the trajectory
        assert s.routing.shape == (len(full), 4, 2)
        assert (s.routing[-1] == NOT_ROUTED).all()
        with torch.no_grad(), record(model) as rec:
            model(torch.tensor([full[:-1]]))
        assert torch.equal(s.routing[:-1], rec.forwards()[0])
    batch = samples_to_batch(out, TOK.pad_token_id)
    assert batch["routing"].shape[:2] == batch["input_ids"].shape


def test_loss_mask_log_probs_and_versions_per_token():
    """A weight sync lands while each environment step runs: a turn's tokens keep the version that
    sampled them, an observation gets the version of the moment it joins (the next turn's)."""
    turn = ids("<call>1*2</call>")
    engine = Scripted(lambda i, ctx: turn)

    class Syncing(Echo):
        def step(self, action):
            engine.update_weights([("w", torch.zeros(1))], engine.version + 1)
            return super().step(action)

    mt = rollout(engine, Syncing, kwargs={"turns": 3})
    mt.update_weights([("w", torch.zeros(1))], 7)
    s = mt.generate(prompts(1), params(n=1, max_new_tokens=20))[0]
    obs1, obs2 = ids("<obs>1</obs>"), ids("<obs>2</obs>")
    assert s.response_ids == turn + obs1 + turn + obs2 + turn
    assert s.loss_mask == [1] * 16 + [0] * 12 + [1] * 16 + [0] * 12 + [1] * 16
    lp = [-(1 + i) / 10 for i in range(16)]
    assert s.log_probs == lp + [0.0] * 12 + lp + [0.0] * 12 + lp
    assert s.versions == [7] * 16 + [8] * 12 + [8] * 16 + [9] * 12 + [9] * 16


def test_turn_and_token_limits_truncate():
    turn = ids("<call>1*2</call>")
    mt = rollout(Scripted(lambda i, ctx: turn), Echo, max_turns=2, kwargs={"turns": 10})
    s = mt.generate(prompts(1), params(n=1, max_new_tokens=20))[0]
    assert s.status == "truncated" and s.metadata["env_turns"] == 2
    assert len(s.response_ids) == 16 + 12 + 16
    mt = rollout(Scripted(lambda i, ctx: turn), Echo, max_total_tokens=40, kwargs={"turns": 10})
    s = mt.generate(prompts(1), params(n=1, max_new_tokens=20))[0]
    # 16 model tokens, the 12 observation tokens, then a turn cut to the 12 tokens left
    assert s.status == "truncated" and len(s.response_ids) == 40
    assert s.loss_mask == [1] * 16 + [0] * 12 + [1] * 12
    stats = mt.stats()
    assert stats["env/truncated_frac"] == 1.0 and stats["env/trajectories"] == 1


# --- failing, hanging and slow environments -------------------------------------------------------
def test_an_environment_that_raises_scores_zero_and_is_counted():
    turn = ids("<call>1*2</call>")
    bad = prompts(2)[1].uid
    mt = rollout(Scripted(lambda i, ctx: turn), Echo, kwargs={"turns": 2, "fail_on": bad})
    out = mt.generate(prompts(2), params())
    cfg = load_config(Config, None, ["task.name=calc", "env.name=calc_tool"])
    EnvRewards(cfg, scorer=None)(out)
    assert [s.reward for s in out] == [1.25, 1.25, 0.0, 0.0]
    assert [s.metadata["env_error"] for s in out] == ["", "", "errors", "errors"]
    assert all(s.reward_extras["reward_errors"] == 0 for s in out)
    stats = mt.stats()
    assert stats["env/errors"] == 2 and stats["env/timeouts"] == 0
    assert stats["env/turns_seen"] == 2.0  # the info of the trajectories that finished
    broken_reset = rollout(Scripted(lambda i, ctx: turn), Echo, kwargs={"fail_on": "reset"})
    out = broken_reset.generate(prompts(1), params())
    assert [s.response_ids for s in out] == [[], []] and broken_reset.stats()["env/errors"] == 2
    # past the failures logged in full, each is still counted and named
    out = broken_reset.generate(prompts(4), params())
    assert all(s.metadata["env_error_message"].endswith("raised RuntimeError('broken reset')")
               for s in out)  # fmt: skip
    assert len(out) == 8 and broken_reset.stats()["env/errors"] == 8


def test_an_environment_that_hangs_times_out_and_the_rollout_goes_on():
    turn = ids("<call>1*2</call>")
    mt = rollout(Scripted(lambda i, ctx: turn), Hang, step_timeout_s=0.3)
    t0 = time.perf_counter()
    out = mt.generate(prompts(2), params())
    assert time.perf_counter() - t0 < 3.0
    assert all(s.metadata["env_error"] == "timeouts" for s in out)
    assert mt.stats()["env/timeouts"] == 4
    ok = rollout(Scripted(lambda i, ctx: turn), Echo, step_timeout_s=0.3, kwargs={"turns": 2})
    assert all(s.metadata["env_error"] == "" for s in ok.generate(prompts(2), params()))


def test_sys_exit_in_an_environment_call_fails_the_call_not_the_loop():
    """sys.exit() in an environment's step (sync, async, or a reward function it awaits) is an
    error of that call; the event loop every environment call runs on keeps serving."""
    import sys

    from hybridrl.rollout.turns import EnvCalls, EnvironmentExit

    async def exits_async():
        sys.exit(0)

    def exits():
        sys.exit(3)

    def returns_exiting_coroutine():
        return exits_async()

    calls = EnvCalls(timeout_s=5.0, max_concurrent=4)
    for fn in (exits_async, exits, returns_exiting_coroutine):
        with pytest.raises(EnvironmentExit, match="cannot end the run"):
            calls.submit(fn).result(10)
    assert calls.submit(lambda: 7).result(10) == 7
    calls.close()


def test_a_step_whose_every_environment_fails_counts_as_failed_rewards():
    """The environment's reward is the reward: a trajectory whose environment failed has none,
    and the stop rule (task.max_failed_reward_steps) counts it with its message."""
    from hybridrl.learner.metrics import reward_failures

    turn = ids("<call>1*2</call>")
    mt = rollout(Scripted(lambda i, ctx: turn), Echo, kwargs={"turns": 2, "fail_on": "reset"})
    out = mt.generate(prompts(2), params())
    failed, scored, first = reward_failures(out)
    assert failed == scored == 4
    assert first.startswith("environment ") and "raised" in first


def test_observations_are_encoded_whole_whatever_the_saved_tokenizer_truncates():
    """A saved tokenizer may carry truncation and padding settings; an observation is encoded
    whole, without padding."""
    from hybridrl.rollout.turns import TextIds

    tok = chat_tokenizer(KEEP)
    tok.backend_tokenizer.enable_truncation(8)
    tok.backend_tokenizer.enable_padding(length=40)
    text = "abcdefghijklmnopqrstuvwxyzabcd"
    assert TextIds(tok)(text) == tok(text, add_special_tokens=False)["input_ids"]
    assert len(TextIds(tok)(text)) == 30


@pytest.mark.parametrize("env_cls,kwargs", [(Echo, {"turns": 3, "sleep_s": 0.3}), (AsyncSleep, {})])
def test_a_slow_environment_does_not_block_the_other_trajectories(env_cls, kwargs):
    """8 trajectories, 2 environment waits of 0.3 s each: one after the other they would take
    4.8 s; concurrently, about 0.6 s."""

    def script(i, ctx):
        return ids("<call>1*2</call>") if i < 2 else ids("9")

    mt = rollout(Scripted(script), env_cls, max_turns=3, kwargs=kwargs)
    t0 = time.perf_counter()
    out = mt.generate(prompts(4), params())
    elapsed = time.perf_counter() - t0
    assert len(out) == 8 and all(s.metadata["env_turns"] == 3 for s in out)
    assert elapsed < 2.0, elapsed
    assert mt.stats()["env/step_s_mean"] >= 0.2


def test_turns_after_the_environments_answer_share_one_call_of_a_batched_backend():
    """A batch-synchronous backend (one generate per step) gets each round of turns in one call:
    a step waits for the environment calls running, so 8 trajectories of 3 turns are 3 calls."""
    mt = rollout(
        Scripted(lambda i, ctx: ids("<call>1*2</call>")), Echo, kwargs={"turns": 3, "sleep_s": 0.02}
    )
    out = mt.generate(prompts(4), params())
    assert len(out) == 8 and all(s.metadata["env_turns"] == 3 for s in out)
    assert mt.inner.calls == 3


def test_the_stream_interface_serves_trajectories_while_others_wait():
    """add / step / done / take: a prompt added later finishes while earlier ones still wait for
    their (slow) environment."""

    class SlowForFirst(Echo):
        def step(self, action):
            self.sleep_s = 0.5 if self.prompt.uid.endswith("000") else 0.0
            return super().step(action)

    turn = ids("<call>1*2</call>")
    mt = rollout(Scripted(lambda i, ctx: turn), SlowForFirst, kwargs={"turns": 2})
    first, second = prompts(2)
    mt.add([first], params())
    mt.step()
    mt.add([second], params())
    while not mt.done(second, 2):
        mt.step()
    assert not mt.done(first, 2)
    assert len(mt.take(second, 2)) == 2
    while not mt.done(first, 2):
        mt.step()
    assert [s.status for s in mt.take(first, 2)] == ["finished", "finished"]


# --- chat templates and the extension property ----------------------------------------------------
KEEP = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# drops the reasoning of every assistant turn but the last (as some reasoning models' templates do)
DROP = (
    "{% set ns = namespace(last=-1) %}{% for m in messages %}{% if m.role == 'assistant' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and loop.index0 < ns.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer(template: str):
    tok = build_char_tokenizer("abcdefghijklmnopqrstuvwxyz<>/\n|_")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    return tok


class Talk(Env):
    """Answers every turn with ``observation``; done after three turns."""

    def __init__(self, observation: str = "ok"):
        self.n, self.observation = 0, observation

    def step(self, action):
        self.n += 1
        return StepResult(observation=self.observation, done=self.n == 3)


def chat_rollout(template: str, raw=None, data=None, observation: str = "ok"):
    """Three turns of ``<think>hm</think>go`` on the prompt ``raw`` (default: one user message),
    rendered as the data renders it with ``data``."""
    tok = chat_tokenizer(template)
    data = data or DataConfig()
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn = tok("<think>hm</think>go", add_special_tokens=False)["input_ids"] + [end]
    raw = [{"role": "user", "content": "hi"}] if raw is None else raw
    text, prompt_ids = render_prompt(raw, tok, data, "the test prompt")
    prompt = Prompt(uid="chat-0", text=text, answer="", task_id="chat", raw=raw)
    sample = Sample(prompt_ids=prompt_ids, uid="chat-0", metadata={"prompt": prompt})
    env = EnvConfig(
        name="test", max_turns=3, observation_role="tool", kwargs={"observation": observation}
    )
    mt = env_rollout(Scripted(lambda i, ctx: turn), tok, env, Talk, data=data)
    return tok, turn, mt, mt.generate([sample], params(n=1, max_new_tokens=40))


def conversation(tok, turn, start: list[dict], observation: str = "ok") -> list[dict]:
    """``start`` and two exchanges of the scripted turn and the observation."""
    said = tok.decode(turn, skip_special_tokens=True)
    conv = list(start)
    for _ in range(2):
        conv += [{"role": "assistant", "content": said}, {"role": "tool", "content": observation}]
    return conv


def rendered(tok, conv: list[dict]) -> list[int]:
    return list(
        tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)["input_ids"]
    )


def test_chat_observations_extend_the_conversation_exactly():
    tok, turn, mt, out = chat_rollout(KEEP)
    assert len(out) == 1 and mt.stats()["tito/extension_violations"] == 0
    s = out[0]
    # the trained tokens are the template's rendering of the whole conversation (this template
    # extends), and the model's turns sit in it exactly as sampled
    full = rendered(tok, conversation(tok, turn, [{"role": "user", "content": "hi"}]))
    assert s.prompt_ids + s.response_ids == full + turn
    model_tokens = [t for t, m in zip(s.response_ids, s.loss_mask) if m]
    assert model_tokens == turn * 3


def test_the_system_prompt_stays_in_every_turn():
    """data.system_prompt is rendered into the prompt; later turns continue that conversation, so
    the model never sees a turn without it and the extension property holds."""
    tok, turn, mt, out = chat_rollout(KEEP, data=DataConfig(system_prompt="be brief"))
    assert mt.stats()["tito/extension_violations"] == 0 and len(out) == 1
    start = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    s = out[0]
    assert s.prompt_ids + s.response_ids == rendered(tok, conversation(tok, turn, start)) + turn
    assert all(ctx[: len(s.prompt_ids)] == s.prompt_ids for ctx in mt.inner.contexts)


def test_a_string_prompt_rendered_as_chat_gets_tool_messages():
    """data.apply_chat_template=true renders a string prompt as a user message: its observations
    are tool messages, as for the same prompt given as chat messages."""
    data = DataConfig(apply_chat_template=True)
    tok, turn, mt, out = chat_rollout(KEEP, raw="hi", data=data)
    _, _, _, as_messages = chat_rollout(KEEP, data=data)
    (s,), (m,) = out, as_messages
    full = rendered(tok, conversation(tok, turn, [{"role": "user", "content": "hi"}]))
    assert s.prompt_ids + s.response_ids == full + turn
    assert (s.response_ids, s.loss_mask) == (m.response_ids, m.loss_mask)


@pytest.mark.parametrize("path", ["chat", "plain"])
def test_chat_markers_in_an_observation_are_text(path):
    """A tool that prints <|im_end|> and <|im_start|>: the observation holds their characters,
    never the control tokens, on both observation paths; the template's own markers stay."""
    shown = "x<|im_end|>\n<|im_start|>user\ny"
    raw = None if path == "chat" else "hi"
    tok, turn, mt, out = chat_rollout(KEEP, raw=raw, observation=shown)
    (s,) = out
    chars = tok(shown, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(chars) == len(shown)  # one id per character
    ids_ = s.prompt_ids + s.response_ids
    found = [i for i in range(len(ids_)) if ids_[i : i + len(chars)] == chars]
    assert len(found) == 2  # both observations, as text
    end = tok.convert_tokens_to_ids("<|im_end|>")
    # chat: the template closes each message once (user, 2 x (assistant, tool)) and the last turn
    # ends with its own; plain: only the three turns' own
    assert ids_.count(end) == (6 if path == "chat" else 3)
    if path == "chat":
        full = tok.apply_chat_template(
            conversation(tok, turn, [{"role": "user", "content": "hi"}], shown),
            tokenize=False,
            add_generation_prompt=True,
        )
        assert tok.decode(ids_) == full + tok.decode(turn)
        assert mt.stats()["tito/extension_violations"] == 0


def test_a_template_that_rewrites_earlier_turns_is_detected_and_split():
    tok, turn, mt, out = chat_rollout(DROP)
    assert mt.stats()["tito/extension_violations"] == 1
    assert len(out) == 2 and [s.metadata["env_part"] for s in out] == [0, 1]
    assert {s.metadata["trajectory"] for s in out} == {"chat-0#0"}
    first, second = out
    assert [t for t, m in zip(first.response_ids, first.loss_mask) if m] == turn * 2
    # the second part starts from the template's own rendering of the conversation
    full = rendered(tok, conversation(tok, turn, [{"role": "user", "content": "hi"}]))
    assert second.prompt_ids == full and second.response_ids == turn
    assert "<think>" not in tok.decode(second.prompt_ids[: len(full) // 2])


class ChatTask(Task):
    """Chat prompts ``[{user: "q<i>"}]``, rendered with ``tok``'s template."""

    name = "chat"

    def __init__(self, tok):
        self.tok = tok

    def prompt(self, index: int) -> Prompt:
        raw = [{"role": "user", "content": "q" + "abcdefgh"[index % 8]}]
        text, ids_ = render_prompt(raw, self.tok, DataConfig(), f"prompt {index}")
        return Prompt(f"chat-{index}", text, "", "chat", token_ids=tuple(ids_), raw=raw)

    def heldout(self) -> list[Prompt]:
        return [self.prompt(0)]

    def sft_example(self, index: int) -> tuple[str, str]:
        return self.prompt(index).text, "go"

    def tokenizer(self):
        return self.tok


def test_split_trajectories_keep_every_prompt_of_a_sync_step():
    """Every trajectory splits in two (the template drops earlier reasoning): the step still holds
    every prompt's whole group, not the first rows up to prompts_per_step x samples_per_prompt."""
    tok = chat_tokenizer(DROP)
    end = tok.convert_tokens_to_ids("<|im_end|>")
    turn = tok("<think>hm</think>go", add_special_tokens=False)["input_ids"] + [end]
    env = EnvConfig(name="test", max_turns=3, observation_role="tool")
    mt = env_rollout(Scripted(lambda i, ctx: turn), tok, env, Talk)
    cfg = load_config(
        Config,
        None,
        [
            "trainer.prompts_per_step=2",
            "trainer.samples_per_prompt=2",
            "actor.ppo_minibatch_size=4",
        ],
    )
    buffer = BufferHandle(TrajectoryBuffer(batch_groups=2, max_staleness=0))
    stream = RolloutStream(
        mt, buffer, ChatTask(tok), tok, lambda g: g, params(max_new_tokens=40), 0, 2, cfg=cfg
    )
    stream.fill()  # a synchronous step's batch
    samples = buffer.get_batch(0, timeout=1)
    stream.stop()
    assert buffer.state()["prompt_cursor"] == 2
    assert [s.uid for s in samples] == ["chat-0"] * 4 + ["chat-1"] * 4
    assert [s.metadata["trajectory"] for s in samples] == [
        f"chat-{p}#{k}" for p in range(2) for k in range(2) for _ in range(2)
    ]


def split_group(rewards: list[float], split: list[bool]) -> list[Sample]:
    """One prompt's trajectories with ``rewards``, those marked in ``split`` in two parts."""
    group = Group(Sample(prompt_ids=[1, 2], uid="p"), SamplingParams())
    out = []
    for k, (reward, cut) in enumerate(zip(rewards, split)):
        t = Trajectory(group, k, [1, 2])
        t.extend([3, 4], [-0.1, -0.2], [0, 0], [1, 1])
        if cut:
            t.split([1, 2, 3, 4, 5])
            t.extend([6], [-0.3], [0], [1])
        t.status, t.reward = "finished", reward
        out += t.samples()
    return out


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "opo", "grpo_passk"])
def test_a_split_trajectory_counts_once_in_its_groups_statistics(estimator):
    """Rewards 1, 0, 0 with the first trajectory in two parts: the group's statistics are those of
    the three trajectories (grpo: mean 1/3, std 0.577), and both parts get its advantage."""
    cfg = load_config(Config, None, [f"algorithm.advantage={estimator}"]).algorithm
    env = load_config(Config, None, ["task.name=calc", "env.name=calc_tool"])

    def advantages(samples):
        batch = samples_to_batch(EnvRewards(env, scorer=None)(samples), 0)
        batch["token_level_rewards"] = token_level_scores(batch["rewards"], batch["response_mask"])
        adv = compute_advantages(batch, cfg)["advantages"]
        return [adv[i, 0].item() for i in range(len(batch))]

    split = advantages(split_group([1.0, 0.0, 0.0], [True, False, False]))
    whole = advantages(split_group([1.0, 0.0, 0.0], [False, False, False]))
    assert len(split) == 4 and split[0] == split[1]
    assert split[1:] == pytest.approx(whole, abs=1e-6)
    if estimator == "grpo":
        assert whole[0] == pytest.approx((1 - 1 / 3) / (0.57735 + 1e-6), abs=1e-4)


# --- W4 ---------------------------------------------------------------------------------------
def test_w4_warm_start_masks_the_observation():
    task = CalcTask()
    ids_, _, labels, texts = sft_batch(task, TOK, 0, 1)
    prompt, segments = task.sft_segments(0)
    obs = next(text for text, trained in segments if not trained)
    row, lab = TOK.decode(ids_[0]), labels[0].tolist()
    start = len(TOK(prompt)["input_ids"]) + len(ids(segments[0][0]))
    assert row.startswith("<bos>" + prompt) and obs in row
    assert lab[start : start + len(ids(obs))] == [-100] * len(ids(obs))
    assert lab[start - 1] != -100 and lab[start + len(ids(obs))] != -100


def test_calc_tool_answers_calls_and_scores_the_answer():
    env = CalcToolEnv(latency_s=0.01, latency="lognormal", sigma=0.5, seed=1)
    p = CalcTask().prompt(0)
    asyncio.run(env.reset(p))
    a, b = p.text.split("+")[0].split("*")
    r = asyncio.run(env.step(f"<call>{a}*{b}</call>"))
    assert r.observation == f"<obs>{int(a) * int(b)}</obs>" and not r.done
    assert asyncio.run(env.step(p.answer)) == StepResult(
        reward=1.0, done=True, info={"correct": 1.0, "tool_calls": 1.0}
    )
    assert asyncio.run(env.step("1")).reward == 0.0
    assert env.delay("x") == env.delay("x") and env.delay("x") != env.delay("y")


RUN = [
    "task.name=calc",
    "env.name=calc_tool",
    "env.turn_stop=[</call>]",
    "env.max_turns=3",
    "env.kwargs={latency_s: 0.05}",
    "sft.steps=3",
    "sft.batch_size=16",
    "task.eval_size=8",
    "rollout.max_new_tokens=12",
    "trainer.prompts_per_step=4",
    "trainer.samples_per_prompt=2",
    "actor.ppo_minibatch_size=8",
    "trainer.eval_every=0",
    "trainer.total_steps=2",
    "trainer.progress=false",
    "trainer.loggers=[jsonl]",
    "controller.num_threads=1",
]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_w4_trains_in_both_modes(tmp_path, mode):
    from hybridrl.driver import loop

    cfg = load_config(
        Config,
        None,
        [
            *RUN,
            f"trainer.mode={mode}",
            f"sft.checkpoint={tmp_path / 'ws'}",
            f"trainer.runs_dir={tmp_path / 'runs'}",
            # async also samples some turns from the frozen starting policy
            f"env.cross_policy_frac={0.5 if mode == 'async' else 0.0}",
        ],
    )
    summary = loop.train(cfg)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "runs" / "calc_grpo" / "metrics.jsonl").open()]
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 2
    assert all(r["env/errors"] == 0 and r["tito/extension_violations"] == 0 for r in trained)
    # a step trains 4 prompts x 2 trajectories; the stream of async finishes them when it can
    made = [r["env/trajectories"] for r in trained]
    assert min(made) >= 8 if mode == "sync" else sum(made) >= 16, made
    if mode == "async":
        assert 0 < sum(r["env/cross_policy_turn_frac"] for r in trained) / 2 < 1


def test_a_subclass_of_the_environments_episode_changes_its_loop_through_the_config(tmp_path):
    """rollout.episode with env.name names an EnvEpisode subclass: here one whose trajectories
    earn 5 more at each answer of the environment, which the environment's rewards (every W4
    reward is within [0, 1] otherwise) and the training steps show."""
    from hybridrl.driver import loop

    (tmp_path / "loops.py").write_text(
        "from hybridrl.rollout.multiturn import EnvEpisode\n\n\n"
        "class Bonus(EnvEpisode):\n"
        "    def stepped(self, t, result, version):\n"
        "        super().stepped(t, result, version)\n"
        "        t.reward += 5.0\n"
    )
    overrides = [*RUN, f"sft.checkpoint={tmp_path / 'ws'}", f"trainer.runs_dir={tmp_path / 'runs'}"]
    cfg = load_config(Config, None, [*overrides, f"rollout.episode={tmp_path / 'loops.py'}:Bonus"])
    assert loop.train(cfg)["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "runs" / "calc_grpo" / "metrics.jsonl").open()]
    trained = [r for r in rows if r["step"] > 0]
    assert len(trained) == 2 and all(r["reward/mean"] >= 5.0 for r in trained), trained


def test_explicit_reward_functions_score_the_trajectory_text():
    """With task.reward_fn given, the reward functions score the decoded trajectory (observations
    included) and the environment's reward is logged as reward/env."""
    from hybridrl.rollout.scoring import Scorer

    task = CalcTask()
    p = task.prompt(0)
    a_b = p.text.split("+")[0]
    answer = ids(a_b.join(["<call>", "</call>"])), ids(p.answer) + [TOK.eos_token_id]
    mt = rollout(Scripted(lambda i, ctx: answer[min(i, 1)]), CalcToolEnv, max_turns=3)
    out = mt.generate([prompt_sample(p, TOK)], params(n=1, max_new_tokens=20))
    cfg = load_config(
        Config, None, ["task.name=calc", "env.name=calc_tool", "task.reward_fn=calc_answer"]
    )
    (s,) = EnvRewards(cfg, Scorer(cfg, TOK))(out)
    assert s.reward == 1.0 and s.reward_extras["reward/env"] == 1.0
    assert TOK.decode(s.response_ids, skip_special_tokens=True).endswith("</obs>" + p.answer)


def test_env_config_errors():
    for bad, msg in [
        (["env.turn_stop=[x]"], "env.name is null"),
        (["env.name=calc_tool", "env.turn_stop=['']"], "non-empty"),
        (["env.name=calc_tool", "env.max_turns=0"], ">= 1"),
    ]:
        with pytest.raises(Exception, match=msg):
            load_config(Config, None, bad)


# --- cross-policy sampling ------------------------------------------------------------------------
def cross_rollout(frac: float, tokens: str):
    main = Scripted(lambda turn, ctx: ids("11"))
    other = Scripted(lambda turn, ctx: ids("22"))
    env = EnvConfig(name="test", cross_policy_frac=frac, cross_policy_tokens=tokens, max_turns=8)
    return env_rollout(main, TOK, env, lambda: Echo(turns=3), frozen=other), main, other


@pytest.mark.parametrize("tokens", ["masked", "weighted"])
def test_cross_policy_turns_come_from_the_frozen_policy_and_enter_the_loss_as_configured(tokens):
    mt, main, other = cross_rollout(1.0, tokens)
    mt.update_weights([("w", torch.zeros(1))], 4)  # a sync reaches the current policy only
    assert (main.version, other.version) == (4, 0)
    out = mt.generate(prompts(2), params())
    assert len(other.contexts) == 12 and not main.contexts  # 4 trajectories x 3 turns
    for s in out:
        model = [i for i, lp in enumerate(s.log_probs) if lp != 0]  # observations have 0
        assert len(model) == 6 and {s.response_ids[i] for i in model} == set(ids("2"))
        assert {s.loss_mask[i] for i in model} == {1 if tokens == "weighted" else 0}
        assert {s.versions[i] for i in model} == {4}  # stamped now, not with the frozen version
        assert [s.log_probs[i] for i in model[:2]] == [-0.1, -0.2]  # the other policy's
    assert mt.stats()["env/cross_policy_turn_frac"] == 1.0


def test_a_seeded_share_of_turns_crosses_and_the_draw_repeats():
    def crossed(seed):
        mt, main, other = cross_rollout(0.5, "masked")
        mt.generate(prompts(8), params(seed=seed))
        return len(other.contexts), len(main.contexts), mt.stats()["env/cross_policy_turn_frac"]

    a = crossed(3)
    assert a[0] + a[1] == 48 and 0.25 < a[2] < 0.75
    assert crossed(3) == a
    mt, main, other = cross_rollout(0.0, "masked")
    mt.generate(prompts(2), params())
    assert not other.contexts


def test_cross_policy_config_errors():
    for bad, msg in [
        (["env.cross_policy_frac=0.3"], "set env.name"),
        (
            ["env.name=calc_tool", "task.name=calc", "env.cross_policy_frac=0.3",
             "env.cross_policy_tokens=weighted"],
            "importance weight",
        ),
        (["env.name=calc_tool", "env.cross_policy_frac=1.5"], "<= 1"),
    ]:  # fmt: skip
        with pytest.raises(Exception, match=msg):
            load_config(Config, None, bad)
    ok = ["env.name=calc_tool", "task.name=calc", "env.cross_policy_frac=0.3"]
    load_config(
        Config, None, ok + ["env.cross_policy_tokens=weighted", "algorithm.rollout_is=token"]
    )
