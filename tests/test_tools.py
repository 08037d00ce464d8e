"""Tools: schemas from signatures, parsing model text, running calls (errors, timeouts, async),
the calculator's safety, and ToolEnv over a scripted conversation."""

from __future__ import annotations

import asyncio
import time
from typing import Literal

import pytest

from hybridrl.envs import ENVIRONMENTS, TOOLS, ToolBox, ToolEnv, parse_tool_calls
from hybridrl.envs.builtin_tools import calculator
from hybridrl.envs.sandbox import Sandbox
from hybridrl.envs.tools import ToolCall, check_arguments, get_tool, tool_from_function
from hybridrl.tasks.base import Prompt


def search(
    query: str,
    top_k: int = 3,
    lang: Literal["en", "fr"] = "en",
    tags: list[str] | None = None,
    min_score: float = 0.0,
    *,
    index: str = "main",
) -> list[str]:
    """Search the documents.

    Longer explanation that is not part of the description.

    Args:
        query: what to look for,
            over two lines.
        top_k (int): how many results.
        lang: the language.
    """
    return [f"{index}:{query}:{top_k}:{lang}"] * top_k


async def slow_echo(text: str, delay: float = 0.2) -> str:
    """Echo ``text`` after ``delay`` seconds."""
    await asyncio.sleep(delay)
    return text


def sleepy(seconds: float) -> str:
    """Block for ``seconds``."""
    time.sleep(seconds)
    return "woke"


def broken(x: int) -> int:
    """Always fails."""
    raise RuntimeError(f"broken by {x}")


def run(coro):
    return asyncio.run(coro)


def test_schema_from_signature_and_docstring():
    schema = tool_from_function(search).schema()
    assert schema == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the documents.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "what to look for, over two lines."},
                    "top_k": {"type": "integer", "description": "how many results."},
                    "lang": {
                        "type": "string",
                        "enum": ["en", "fr"],
                        "description": "the language.",
                    },
                    "tags": {"type": "array", "items": {"type": "string"}, "nullable": True},
                    "min_score": {"type": "number"},
                },
                "required": ["query"],
            },
        },
    }  # the keyword-only ``index`` is configuration: not shown to the model


def test_signatures_a_model_cannot_call_are_refused():
    def star(*args: int) -> None:
        """x"""

    def untyped(x) -> None:
        """x"""

    for fn in (star, untyped):
        with pytest.raises(TypeError):
            tool_from_function(fn)


def test_builtin_tools_are_registered():
    assert {"calculator", "python"} <= set(TOOLS.names())
    assert "tools" in ENVIRONMENTS.names()
    assert get_tool("calculator").parameters["required"] == ["expression"]
    assert "code" in get_tool("python").parameters["properties"]
    assert "limits" not in get_tool("python").parameters["properties"]
    assert get_tool("tests.test_tools:search").name == "search"  # by dotted path


def test_parse_one_and_several_calls():
    text = (
        "Let me compute. <tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "1+2"}}\n'
        "</tool_call> and <tool_call>"
        '{"name": "search", "arguments": "{\\"query\\": \\"x\\"}"}</tool_call>'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "1+2"}, None),
        ("search", {"query": "x"}, None),  # arguments as a JSON string, OpenAI style
    ]
    assert parse_tool_calls("The answer is 3.") == []
    # generation stopped at the closing tag, which was not kept
    unclosed = parse_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "2"}}'
    )
    assert unclosed[0].arguments == {"expression": "2"}
    # the closing tag inside an argument does not end the call
    code = '{"name": "python", "arguments": {"code": "print(\'</tool_call>\')"}}'
    (call,) = parse_tool_calls(f"<tool_call>{code}</tool_call>")
    assert call.arguments == {"code": "print('</tool_call>')"} and call.error is None
    # a malformed call does not hide the next one
    two = parse_tool_calls('<tool_call>{"name": </tool_call><tool_call>{"name": "a"}</tool_call>')
    assert two[0].error and (two[1].name, two[1].error) == ("a", None)


@pytest.mark.parametrize(
    "body, expected",
    [
        ('{"name": "calculator", "arguments": {"expression": }', "malformed JSON"),
        ('["calculator"]', "needs"),
        ('{"arguments": {}}', "needs"),
        ('{"name": "calculator", "arguments": [1]}', "arguments must be an object"),
        ('{"name": "calculator", "arguments": "{x"}', "arguments must be an object"),
        ('{"name": "calculator"} trailing words', "malformed JSON"),
        ("", "malformed JSON"),
    ],
)
def test_parse_malformed_calls_become_errors(body, expected):
    (call,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert call.error is not None and expected in call.error


def test_unknown_tool_and_bad_arguments_are_errors_not_exceptions():
    box = ToolBox([search, broken])
    results = run(
        box.call_all(
            [
                ToolCall("nope", {}),
                ToolCall("search", {}),
                ToolCall("search", {"query": "q", "colour": "red"}),
                ToolCall("search", {"query": 3}),
                ToolCall("search", {"query": "q", "top_k": True}),
                ToolCall("search", {"query": "q", "lang": "de"}),
                ToolCall("broken", {"x": 7}),
                ToolCall("", error="tool call 1: malformed JSON"),
                ToolCall("search", {"query": "q", "top_k": 1, "tags": None}),
            ]
        )
    )
    assert [r.error for r in results] == [True] * 8 + [False]
    texts = [r.content for r in results]
    assert "unknown tool 'nope'" in texts[0] and "search" in texts[0]
    assert "missing query" in texts[1]
    assert "unknown colour" in texts[2]
    assert "query=3" in texts[3] and "top_k=True" in texts[4] and "lang='de'" in texts[5]
    assert texts[6] == "Error: RuntimeError: broken by 7"
    assert texts[8] == '["main:q:1:en"]'


def test_check_arguments_accepts_ints_for_numbers():
    t = tool_from_function(search)
    assert check_arguments(t, {"query": "q", "min_score": 1}) is None
    assert check_arguments(t, {"query": "q", "min_score": "1"}) is not None


def test_tool_config_sets_keyword_only_parameters():
    box = ToolBox([search], config={"search": {"index": "wiki"}})
    (result,) = run(box.call_all([ToolCall("search", {"query": "q", "top_k": 1})]))
    assert result.content == '["wiki:q:1:en"]'
    # the model cannot set a setting
    (denied,) = run(box.call_all([ToolCall("search", {"query": "q", "index": "secret"})]))
    assert denied.error and "unknown index" in denied.content
    with pytest.raises(KeyError):
        ToolBox([search], config={"calculator": {}})


def test_async_tools_run_concurrently():
    box = ToolBox([slow_echo])
    calls = [ToolCall("slow_echo", {"text": str(i), "delay": 0.2}) for i in range(5)]
    start = time.monotonic()
    results = run(box.call_all(calls))
    assert [r.content for r in results] == ["0", "1", "2", "3", "4"]
    assert time.monotonic() - start < 0.6  # five 0.2 s calls overlapped


@pytest.mark.parametrize(
    "fn, name, args",
    [(slow_echo, "slow_echo", {"text": "x", "delay": 5.0}), (sleepy, "sleepy", {"seconds": 0.5})],
)
def test_timeouts_become_errors(fn, name, args):
    box = ToolBox([fn], timeout_s=0.1)
    start = time.monotonic()
    (result,) = run(box.call_all([ToolCall(name, args)]))
    assert result.error and "timed out after 0.1 s" in result.content
    assert time.monotonic() - start < 1.0


@pytest.mark.parametrize(
    "expression, value",
    [
        ("2 + 3 * 4", "14"),
        ("10 / 4", "2.5"),
        ("-(2 ** 10) // 3", "-342"),
        ("7 % 3", "1"),
        ("1.5e3 + 0.5", "1500.5"),
        ("2 ** 0.5", "1.4142135623730951"),
        ("((1))", "1"),
    ],
)
def test_calculator(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    "expression",
    [
        "__import__('os').system('echo hi')",  # a call and a name
        "x + 1",  # a name
        "(1).real",  # attribute access
        "().__class__",
        "[1, 2][0]",
        "'a' * 3",  # strings
        "9 ** 9 ** 9",  # a huge exponent: refused before it is computed
        "2 ** 5000",
        "10 ** 2000 * 10 ** 2000",
        "1 / 0",
        "1e308 * 10",
        "(-8) ** 0.5",
        "lambda: 1",
        "1 if 1 else 2",
        "1" * 600,  # too long
        "",
    ],
)
def test_calculator_refuses(expression):
    start = time.monotonic()
    with pytest.raises(ValueError):
        calculator(expression)
    assert time.monotonic() - start < 0.5


def _prompt(answer: str) -> Prompt:
    return Prompt(
        uid="t-0",
        text="What is 6 * 7?",
        answer=answer,
        task_id="test",
        columns={"solution": answer},
    )


def test_tool_env_scripted_episode():
    env = ENVIRONMENTS.get("tools")(
        tools=["calculator"], max_turns=4, reward_fn="exact_match", describe_tools=True
    )
    intro = env.reset(_prompt("42"))
    assert '"name": "calculator"' in intro and "<tool_call>" in intro
    first = run(
        env.step(
            'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": '
            '"6 * 7"}}</tool_call><tool_call>{"name": "calculator", "arguments": {"expr": "1"}}'
            "</tool_call><tool_call>{oops}</tool_call>"
        )
    )
    assert not first.done and first.reward == 0.0
    assert first.info == {"tool_calls": 3, "tool_errors": 2, "answered": 0}
    responses = first.observation.split("</tool_response>")
    assert responses[0] == "<tool_response>\n42\n"
    assert "missing expression" in responses[1] and "malformed JSON" in responses[2]
    final = run(env.step("42"))
    assert final.done and final.reward == 1.0 and final.observation is None
    assert final.info["tool_calls"] == 0 and final.info["answered"] == 1
    # a wrong answer scores 0
    env.reset(_prompt("41"))
    assert run(env.step("42")).reward == 0.0


def test_tool_env_ends_at_max_turns_and_caps_calls_per_turn():
    env = ToolEnv(tools=["calculator"], max_turns=2, max_calls_per_turn=2, reward_fn="exact_match")
    env.reset(_prompt("3"))
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}</tool_call>'
    first = run(env.step(call * 3))
    assert not first.done and first.info["tool_calls"] == 3 and first.info["tool_errors"] == 1
    assert "at most 2 tool calls" in first.observation
    second = run(env.step(call))
    assert second.done and second.reward == 0.0  # out of turns without an answer


def test_tool_env_observation_format_is_configurable():
    env = ToolEnv(
        tools=["calculator"],
        response_template="[{name}] {content}",
        observation_prefix="<|im_start|>user\n",
        observation_suffix="<|im_end|>\n<|im_start|>assistant\n",
    )
    env.reset(_prompt(""))
    step = run(
        env.step(
            '<tool_call>{"name": "calculator", "arguments": {"expression": "2*2"}}</tool_call>'
        )
    )
    assert step.observation == "<|im_start|>user\n[calculator] 4<|im_end|>\n<|im_start|>assistant\n"


def test_tool_env_runs_python_in_the_sandbox():
    try:
        Sandbox()
    except RuntimeError as e:
        pytest.skip(f"no sandbox here: {e}")
    env = ToolEnv(tools=["python"], tool_config={"python": {"limits": {"cpu_s": 1, "wall_s": 5}}})
    env.reset(_prompt(""))
    code = '{"name": "python", "arguments": {"code": "print(sum(range(10)))\\n1/0"}}'
    step = run(env.step(f"<tool_call>{code}</tool_call>"))
    assert step.observation.startswith("<tool_response>\n45\n[stderr]\nTraceback")
    assert "ZeroDivisionError" in step.observation and "[exit code 1]" in step.observation
    assert step.info["tool_errors"] == 0  # the program failed, not the call


def length_reward(prompt: Prompt, response: str) -> dict:
    """A reward function given by dotted path, with an extra value to log."""
    return {"score": 0.5, "length": len(response), "note": "not a number"}


def test_tool_env_reward_fn_by_dotted_path_logs_numeric_extras():
    env = ToolEnv(tools=["calculator"], reward_fn="tests.test_tools:length_reward")
    env.reset(_prompt(""))
    final = run(env.step("four"))
    assert final.done and final.reward == 0.5
    assert final.info["length"] == 4.0 and "note" not in final.info


def trl_reward(prompts, completions, solution, **kwargs) -> list[float]:
    """TRL-style: a batch of completions, one score each; the rows' columns by name."""
    return [float(c == s) for c, s in zip(completions, solution)]


def verl_reward(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """veRL-style: one response against the ground truth."""
    return float(solution_str == ground_truth)


async def async_reward(prompt: Prompt, response: str) -> dict:
    """Per-sample and async."""
    await asyncio.sleep(0)
    return {"score": float(response == prompt.answer), "checked": 1}


@pytest.mark.parametrize(
    "reward_fn",
    ["exact_match", "tests.test_tools:trl_reward", "tests.test_tools:verl_reward",
     "tests.test_tools:async_reward"],
)  # fmt: skip
def test_tool_env_reward_fn_takes_every_form_task_reward_fn_takes(reward_fn):
    env = ToolEnv(tools=["calculator"], reward_fn=reward_fn)
    env.reset(_prompt("42"))
    assert run(env.step("42")).reward == 1.0
    env.reset(_prompt("41"))
    assert run(env.step("42")).reward == 0.0


def trl_needs_solution(prompts, completions, solution, **kwargs):
    return [float(c == s) for c, s in zip(completions, solution)]


def test_env_reward_fn_naming_a_missing_column_is_refused_at_start():
    """The tools environment's TRL-style reward_fn gets the prompt's columns as task.reward_fn
    does: one that needs a column the data lacks would fail every trajectory (reward 0)."""
    from hybridrl.checks import check_config
    from hybridrl.config import Config, ConfigError, load_config

    kwargs = "{tools: [calculator], reward_fn: 'tests.test_tools:trl_needs_solution'}"
    cfg = load_config(Config, None, ["env.name=tools", f"env.kwargs={kwargs}"])
    with pytest.raises(ConfigError, match=r"'env.kwargs.reward_fn': TRL-style .* \['solution'\]"):
        check_config(cfg)


def test_env_kwargs_are_checked_when_the_config_loads():
    """An unknown tool, an unknown keyword, max_turns 0 or an unusable reward function would end
    every trajectory with reward 0: each fails the config, in one line naming what is allowed."""
    from hybridrl.config import Config, ConfigError, load_config

    def refused(kwargs: str, *words: str, name: str = "tools") -> None:
        with pytest.raises(ConfigError) as e:
            load_config(Config, None, [f"env.name={name}", f"env.kwargs={kwargs}"])
        msg = str(e.value)
        assert "\n" not in msg and all(w in msg for w in words), msg

    refused("{tools: [calculater]}", "unknown tool 'calculater'", "calculator, python")
    refused("{colour: red}", "no argument colour", "max_turns", "describe_tools")
    refused("{max_turns: 0}", "max_turns must be at least 1, got 0")
    refused("{reward_fn: nope}", "env.kwargs.reward_fn", "unknown reward function 'nope'")
    refused("{reward_fn: 'tests.test_tools:sleepy'}", "unrecognised signature")
    refused("{tools: [calculator], tool_config: {python: {}}}", "names tools not in use")
    refused("{}", "unknown environment 'toolz'", "tools", name="toolz")
    refused("{latency: slow}", "fixed or lognormal", name="calc_tool")
    load_config(Config, None, ["env.name=tools", "env.kwargs={tools: [calculator], max_turns: 2}"])
