"""Tests of the generic strict config loader (hybridrl/config/loader.py) on small test schemas."""

from __future__ import annotations

import math
import string
from dataclasses import dataclass, field
from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridrl.config.loader import (
    ConfigError,
    apply_overrides,
    dump_yaml,
    from_dict,
    load_config,
    to_dict,
)


# ----------------------------------------------------------------------------- test schema
@dataclass
class Optim:
    lr: float = field(default=1e-5, metadata={"gt": 0, "help": "learning rate"})
    eps: float = 1e-8
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999], metadata={"ge": 0, "lt": 1})
    weight_decay: float = field(default=0.0, metadata={"ge": 0})


@dataclass
class Trainer:
    total_steps: int = field(default=100, metadata={"ge": 1})
    prompts_per_step: int = 4
    samples_per_prompt: int = 2
    minibatch_size: int = 4
    clip_ratio: float = field(default=0.2, metadata={"gt": 0, "lt": 1})
    mode: Literal["ppo", "grpo"] = "grpo"
    seed: int | None = None
    device: str = field(default="cpu", metadata={"choices": ["cpu", "cuda"]})
    use_kl: bool = False
    optim: Optim = field(default_factory=Optim)

    def validate(self) -> None:
        if (self.prompts_per_step * self.samples_per_prompt) % self.minibatch_size:
            raise ValueError(
                "prompts_per_step*samples_per_prompt must be divisible by minibatch_size"
            )


@dataclass
class Model:
    name: str  # required
    dtype: Literal["bf16", "fp32"] | None = "bf16"
    extra: dict[str, float] = field(default_factory=dict)
    layers: tuple[int, ...] = (1, 2)
    shape: tuple[int, str] = (3, "x")


@dataclass
class Pool:
    nodes: int = field(default=1, metadata={"ge": 1})


@dataclass
class Root:
    model: Model
    trainer: Trainer = field(default_factory=Trainer)
    tags: list[str] = field(default_factory=list)
    pools: dict[str, Pool] = field(default_factory=lambda: {"global": Pool()})
    note: list[int] | None = None

    def validate(self) -> None:
        if "bad" in self.tags:
            raise ConfigError("tag 'bad' is\nnot allowed")


@dataclass
class OldTyping:  # typing-module spellings
    counts: list[int] = field(default_factory=list)
    table: dict[str, int] = field(default_factory=dict)
    either: int | str = 0
    maybe: float | None = None


@dataclass
class Seeded:
    seed: int = field(default=0, metadata={"ge": 0, "le": 2**63 - 1})


def err(fn, *args, **kwargs) -> str:
    """The message of the ConfigError that fn(*args) raises; it must be one line."""
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    msg = str(info.value)
    assert "\n" not in msg
    return msg


MODEL = {"model": {"name": "m"}}


# ----------------------------------------------------------------------------- building
def test_defaults_fill_missing_keys():
    assert from_dict(Root, MODEL) == Root(model=Model(name="m"))
    assert from_dict(Trainer, {}) == Trainer()


def test_nested_values_and_conversions():
    cfg = from_dict(
        Root,
        {
            "model": {"name": "m", "layers": [3, 4], "extra": {"a": 1}, "shape": [5, "y"]},
            "trainer": {"optim": {"lr": 1, "betas": [0, 0.5]}, "seed": 7},
            "pools": {"gpu": {"nodes": 2}},
        },
    )
    assert cfg.model.layers == (3, 4) and cfg.model.shape == (5, "y")
    assert cfg.model.extra == {"a": 1.0} and type(cfg.model.extra["a"]) is float
    assert cfg.trainer.optim.lr == 1.0 and type(cfg.trainer.optim.lr) is float
    assert cfg.trainer.optim.betas == [0.0, 0.5] and all(
        type(b) is float for b in cfg.trainer.optim.betas
    )
    assert cfg.trainer.seed == 7 and cfg.pools == {"gpu": Pool(nodes=2)}


def test_numeric_strings_for_float_fields():
    assert from_dict(Optim, {"lr": "1e-3", "eps": "3e-4", "weight_decay": " 0.5 "}) == Optim(
        lr=1e-3, eps=3e-4, weight_decay=0.5
    )
    assert "must be a float, got 'abc' (str)" in err(from_dict, Optim, {"eps": "abc"})
    assert "must be a float, got 10000" in err(from_dict, Optim, {"eps": 10**400})


@pytest.mark.parametrize(
    "data, shown",
    [
        ({"lr": math.inf}, "lr' must be a finite number, got inf"),
        ({"eps": "-inf"}, "eps' must be a finite number, got -inf"),
        ({"eps": "Infinity"}, "eps' must be a finite number, got inf"),
        ({"eps": math.nan}, "eps' must be a finite number, got nan"),
        ({"eps": "nan"}, "eps' must be a finite number, got nan"),
        ({"betas": [0.5, math.nan]}, "betas[1]' must be a finite number, got nan"),
    ],
)
def test_floats_must_be_finite(data, shown):
    assert err(from_dict, Optim, data) == f"config key '{shown}"
    # an optional float, a dict of floats and a YAML override are held to the same rule
    assert "'maybe' must be a finite number" in err(from_dict, OldTyping, {"maybe": math.inf})
    assert "'model.extra.k' must be a finite number, got nan" in err(
        load_config, Root, None, ["model.name=m", "model.extra.k=.nan"]
    )
    assert "'trainer.optim.lr' must be a finite number, got inf" in err(
        load_config, Root, None, ["model.name=m", "trainer.optim.lr=.inf"]
    )
    assert from_dict(Optim, {"lr": 1e30, "eps": -1e308}).lr == 1e30  # large but finite is a number


def test_ints_must_fit_64_bits():
    top = 2**63 - 1
    assert from_dict(Trainer, {"seed": top}).seed == top
    assert from_dict(Trainer, {"seed": -(2**63)}).seed == -(2**63)
    msg = err(load_config, Trainer, None, ["seed=1180591620717411303424"])
    assert msg == (
        "config key 'seed' must be a 64-bit integer, in [-9223372036854775808, "
        "9223372036854775807], got 1180591620717411303424"
    )
    assert "'counts[0]' must be a 64-bit integer" in err(from_dict, OldTyping, {"counts": [2**64]})
    # an int field with its own range names that range, also for a value beyond 64 bits
    assert err(from_dict, Seeded, {"seed": 2**70}) == (
        f"config key 'seed' must be >= 0 and <= {top}, got 1180591620717411303424"
    )
    assert (
        err(from_dict, Seeded, {"seed": -1})
        == f"config key 'seed' must be >= 0 and <= {top}, got -1"
    )
    assert from_dict(Seeded, {"seed": top}).seed == top


def test_dataclass_instance_accepted_for_section():
    assert from_dict(Trainer, {"optim": Optim(lr=0.5)}).optim.lr == 0.5


def test_typing_module_spellings():
    cfg = from_dict(OldTyping, {"counts": [1, 2], "table": {"a": 1}, "either": "x", "maybe": 2})
    assert cfg == OldTyping(counts=[1, 2], table={"a": 1}, either="x", maybe=2.0)
    assert from_dict(OldTyping, {"either": 3}).either == 3
    assert "config key 'either' must be an int or a string, got 1.5 (float)" in err(
        from_dict, OldTyping, {"either": 1.5}
    )
    assert "config key 'counts[1]' must be an int, got 'b' (str)" in err(
        from_dict, OldTyping, {"counts": [1, "b"]}
    )
    assert "config key 'table.a' must be an int" in err(
        from_dict, OldTyping, {"table": {"a": None}}
    )


# ----------------------------------------------------------------------------- type errors
@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("total_steps", "abc", "config key 'trainer.total_steps' must be an int, got 'abc' (str)"),
        ("total_steps", True, "config key 'trainer.total_steps' must be an int, got True (bool)"),
        ("total_steps", 2.5, "config key 'trainer.total_steps' must be an int, got 2.5 (float)"),
        ("clip_ratio", False, "config key 'trainer.clip_ratio' must be a float, got False (bool)"),
        ("use_kl", 1, "config key 'trainer.use_kl' must be a bool (true/false), got 1 (int)"),
        (
            "use_kl",
            "true",
            "config key 'trainer.use_kl' must be a bool (true/false), got 'true' (str)",
        ),
        ("device", 5, "config key 'trainer.device' must be a string, got 5 (int)"),
        ("seed", "x", "config key 'trainer.seed' must be an int or null, got 'x' (str)"),
        (
            "optim",
            5,
            "config key 'trainer.optim' must be a mapping (keys: lr, eps, betas, weight_decay), "
            "got 5 (int)",
        ),
        (
            "optim",
            None,
            "config key 'trainer.optim' must be a mapping (keys: lr, eps, betas, weight_decay), "
            "got null",
        ),
    ],
)
def test_type_errors(key, value, expected):
    assert err(from_dict, Root, {**MODEL, "trainer": {key: value}}) == expected


def test_literal_lists_allowed_values_and_suggests():
    msg = err(from_dict, Trainer, {"mode": "gpro"}, "trainer")
    assert (
        msg == "config key 'trainer.mode' must be one of 'ppo', 'grpo', got 'gpro' (str); "
        "did you mean 'grpo'?"
    )
    assert "must be one of 'ppo', 'grpo', got 1 (int)" in err(from_dict, Trainer, {"mode": 1})


def test_optional_literal():
    assert from_dict(Model, {"name": "m", "dtype": None}).dtype is None
    assert from_dict(Model, {"name": "m", "dtype": "fp32"}).dtype == "fp32"
    msg = err(from_dict, Model, {"name": "m", "dtype": "fp16"}, "model")
    assert msg.startswith(
        "config key 'model.dtype' must be one of 'bf16', 'fp32' or null, got 'fp16' (str)"
    )


def test_container_errors_name_the_item():
    assert (
        err(from_dict, Optim, {"betas": [0.9, "x"]})
        == "config key 'betas[1]' must be a float, got 'x' (str)"
    )
    assert (
        err(from_dict, Optim, {"betas": 0.9})
        == "config key 'betas' must be a list, got 0.9 (float)"
    )
    assert (
        err(from_dict, Model, {"name": "m", "extra": {"a": "x"}}, "model")
        == "config key 'model.extra.a' must be a float, got 'x' (str)"
    )
    assert (
        err(from_dict, Model, {"name": "m", "extra": [1]})
        == "config key 'extra' must be a mapping, got [1] (list)"
    )
    assert "config key 'shape' must be a list of 2 items, got [1] (list)" in err(
        from_dict, Model, {"name": "m", "shape": [1]}
    )
    assert "config key 'pools.gpu.nodes' must be >= 1, got 0" in err(
        from_dict, Root, {**MODEL, "pools": {"gpu": {"nodes": 0}}}
    )
    # an error inside an Optional[...] arm names the item, not the union
    assert (
        err(from_dict, Root, {**MODEL, "note": [1, "x"]})
        == "config key 'note[1]' must be an int, got 'x' (str)"
    )
    assert from_dict(Root, {**MODEL, "note": None}).note is None


# ----------------------------------------------------------------------------- metadata ranges
@pytest.mark.parametrize(
    "data, expected",
    [
        ({"clip_ratio": -0.2}, "config key 'trainer.clip_ratio' must be > 0 and < 1, got -0.2"),
        ({"clip_ratio": 1}, "config key 'trainer.clip_ratio' must be > 0 and < 1, got 1.0"),
        ({"total_steps": 0}, "config key 'trainer.total_steps' must be >= 1, got 0"),
        (
            {"device": "tpu"},
            "config key 'trainer.device' must be one of 'cpu', 'cuda', got 'tpu' (str)",
        ),
        ({"optim": {"lr": 0}}, "config key 'trainer.optim.lr' must be > 0, got 0.0"),
        (
            {"optim": {"betas": [0.5, 1.0]}},
            "config key 'trainer.optim.betas[1]' must be >= 0 and < 1, got 1.0",
        ),
    ],
)
def test_metadata_ranges(data, expected):
    assert err(from_dict, Trainer, data, "trainer") == expected


def test_ranges_pass_at_bounds():
    assert (
        from_dict(
            Trainer, {"total_steps": 1, "optim": {"weight_decay": 0, "betas": [0, 0.99]}}
        ).total_steps
        == 1
    )


# ----------------------------------------------------------------------------- keys
def test_unknown_key_did_you_mean():
    msg = err(from_dict, Root, {**MODEL, "trainer": {"totl_steps": 5}})
    assert msg == (
        "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'? (keys of "
        "trainer: "
        "total_steps, prompts_per_step, samples_per_prompt, minibatch_size, clip_ratio, mode, "
        "seed, "
        "device, use_kl, optim)"
    )


def test_unknown_top_level_key_without_suggestion():
    assert (
        err(from_dict, Root, {**MODEL, "zzz": 1})
        == "unknown config key 'zzz' (top-level keys: model, trainer, tags, pools, note)"
    )


def test_missing_required_keys():
    assert err(from_dict, Root, {}) == "missing required config key 'model'"
    assert err(from_dict, Root, {"model": {}}) == "missing required config key 'model.name'"


def test_validate_errors_get_the_section_path():
    msg = err(from_dict, Root, {**MODEL, "trainer": {"minibatch_size": 3}})
    assert (
        msg == "config 'trainer': "
        "prompts_per_step*samples_per_prompt must be divisible by minibatch_size"
    )
    # a ConfigError from validate() is whole already (it names its key): kept as it is, and a
    # multi-line message becomes one line
    assert err(from_dict, Root, {**MODEL, "tags": ["ok", "bad"]}) == "tag 'bad' is not allowed"


def test_from_dict_rejects_non_mapping_and_non_dataclass():
    assert err(from_dict, Trainer, [1]).startswith("config must be a mapping (keys: total_steps,")
    with pytest.raises(TypeError):
        from_dict(dict, {})


# ----------------------------------------------------------------------------- overrides
@pytest.mark.parametrize(
    "text, value",
    [
        ("20", 20),
        ("-3", -3),
        ("0.5", 0.5),
        ("1e-3", 1e-3),
        ("3e-4", 3e-4),
        ("5E3", 5000.0),
        ("1.5e3", 1500.0),
        ("true", True),
        ("false", False),
        ("null", None),
        ("", None),
        ("[1,2]", [1, 2]),
        ("{x: 1}", {"x": 1}),
        ("hello", "hello"),
        ("'20'", "20"),
        ("'1e-3'", "1e-3"),
        ("a=b", "a=b"),
        ("cuda:0", "cuda:0"),
    ],
)
def test_override_values_are_yaml(text, value):
    out = apply_overrides({}, [f"a={text}"])["a"]
    assert out == value and type(out) is type(value)


def test_overrides_create_and_merge_nested_dicts_without_mutating_input():
    data = {"a": {"x": 1}, "b": None}
    out = apply_overrides(data, ["a.b.c=1", "a.y=2", "b.z=3", "c = 4"])
    assert out == {"a": {"x": 1, "b": {"c": 1}, "y": 2}, "b": {"z": 3}, "c": 4}
    assert data == {"a": {"x": 1}, "b": None}
    assert apply_overrides({"a": 1}, ["a=2", "a=3"]) == {"a": 3}  # last one wins


def test_dotted_override_merges_into_the_default_map():
    # without the schema a missing level starts empty; with it, as the field's default
    assert apply_overrides({}, ["pools.gpu.nodes=2"]) == {"pools": {"gpu": {"nodes": 2}}}
    assert apply_overrides({}, ["pools.gpu.nodes=2"], Root) == {
        "pools": {"global": {"nodes": 1}, "gpu": {"nodes": 2}}
    }
    cfg = load_config(Root, None, ["model.name=m", "pools.gpu.nodes=2", "pools.global.nodes=3"])
    assert cfg.pools == {"global": Pool(nodes=3), "gpu": Pool(nodes=2)}
    # a key into a default dataclass section, and one inside a default map's dataclass value
    assert load_config(Root, None, ["model.name=m", "model.extra.k=1.5"]).model.extra == {"k": 1.5}
    assert load_config(Trainer, None, ["optim.betas=[0.5]"]).optim == Optim(betas=[0.5])


def test_dotted_override_merges_into_the_yaml_map(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  name: m\npools:\n  a: {nodes: 3}\n")
    # the YAML's map is the one merged into (no default 'global' pool is added back)
    cfg = load_config(Root, path, ["pools.a.nodes=4", "pools.b.nodes=5"])
    assert cfg.pools == {"a": Pool(nodes=4), "b": Pool(nodes=5)}
    # a whole mapping as the value still replaces the map; an explicit null level starts empty
    assert load_config(Root, path, ["pools={c: {nodes: 6}}"]).pools == {"c": Pool(nodes=6)}
    path.write_text("model:\n  name: m\npools: null\n")
    assert load_config(Root, path, ["pools.c.nodes=7"]).pools == {"c": Pool(nodes=7)}
    # an unknown section or key is still reported by from_dict, with its did-you-mean
    assert "unknown config key 'pool'" in err(load_config, Root, path, ["pool.c.nodes=7"])
    assert "unknown config key 'pools.c.node'" in err(load_config, Root, path, ["pools.c.node=7"])


@pytest.mark.parametrize(
    "item, expected",
    [
        ("trainer", "invalid override 'trainer': expected KEY=VALUE"),
        ("=3", "invalid override '=3': expected KEY=VALUE"),
        ("a..b=3", "invalid override 'a..b=3': expected KEY=VALUE"),
        ("a=[1,2", "cannot parse the value of override 'a=[1,2':"),
        ("a={x: 1, x: 2}", "duplicate key 'x'"),
        ("s.t.u=1", "cannot apply override 's.t.u=1': 's.t' is 5 (int), not a mapping"),
    ],
)
def test_bad_overrides(item, expected):
    assert expected in err(apply_overrides, {"s": {"t": 5}}, [item])


def test_overrides_must_be_a_sequence_of_strings():
    with pytest.raises(TypeError):
        apply_overrides({}, "a=1")


def test_load_config_with_overrides_typed_by_schema():
    cfg = load_config(
        Root,
        None,
        [
            "model.name=m",
            "trainer.optim.lr=1e-3",
            "trainer.optim.eps=3e-4",
            "trainer.total_steps=20",
            "trainer.use_kl=true",
            "trainer.seed=null",
            "tags=[a, b]",
            "trainer.clip_ratio=0.5",
        ],
    )
    assert (
        cfg.trainer.optim.lr == 1e-3
        and cfg.trainer.optim.eps == 3e-4
        and cfg.trainer.total_steps == 20
    )
    assert cfg.trainer.use_kl is True and cfg.trainer.seed is None and cfg.tags == ["a", "b"]
    assert type(cfg.trainer.clip_ratio) is float


def test_bad_override_keys_and_sections():
    assert "unknown config key 'trainer.totl_steps'; did you mean 'trainer.total_steps'?" in err(
        load_config, Root, None, ["model.name=m", "trainer.totl_steps=3"]
    )
    assert err(load_config, Root, None, ["model.name=m", "trainer=5"]).startswith(
        "config key 'trainer' must be a mapping (keys: total_steps,"
    )
    assert "config key 'trainer.total_steps' must be an int, got 'abc' (str)" in err(
        load_config, Root, None, ["model.name=m", "trainer.total_steps=abc"]
    )


# ----------------------------------------------------------------------------- files
def test_load_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "model:\n  name: m\ntrainer:\n  total_steps: 5\n  optim:\n    lr: 1e-4  # YAML 1.1 string\n"
    )
    cfg = load_config(Root, path, ["trainer.total_steps=7"])
    assert cfg.trainer.total_steps == 7 and cfg.trainer.optim.lr == 1e-4
    assert load_config(Root, str(path)).trainer.total_steps == 5


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_yaml_file_is_all_defaults(tmp_path, text):
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    assert load_config(Trainer, path) == Trainer()
    assert load_config(Trainer) == Trainer()


def test_yaml_syntax_error_names_file_line_column(tmp_path):
    path = tmp_path / "x.yaml"
    path.write_text("trainer:\n  total_steps: 5\n  seed: [1, 2\n")
    msg = err(load_config, Root, path)
    assert msg.startswith(f"cannot parse {path}: line ") and ", column " in msg
    path.write_text("a: 1\nb: c: d\n")
    assert (
        err(load_config, Root, path)
        == f"cannot parse {path}: line 2, column 5: mapping values are not allowed here"
    )


def test_duplicate_yaml_keys_are_rejected(tmp_path):
    path = tmp_path / "dup.yaml"
    path.write_text("total_steps: 1\nseed: 2\ntotal_steps: 3\n")
    assert (
        err(load_config, Trainer, path)
        == f"cannot parse {path}: line 3, column 1: duplicate key 'total_steps'"
    )
    path.write_text(
        "base: &b {lr: 0.5, eps: 1.0}\nother:\n  <<: *b\n  lr: 0.25\n"
    )  # merge keys may be overridden
    assert apply_overrides(load_config.__globals__["_read_yaml"](path), [])["other"] == {
        "lr": 0.25,
        "eps": 1.0,
    }


def test_missing_file_and_non_mapping_top_level(tmp_path):
    assert err(load_config, Trainer, "nope.yaml") == "config file 'nope.yaml' not found"
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert (
        err(load_config, Trainer, path)
        == f"config file '{path}' must hold a mapping at the top level, got [1, 2] (list)"
    )
    assert "cannot read config file" in err(load_config, Trainer, tmp_path)  # a directory


# ----------------------------------------------------------------------------- dump / round trip
def test_to_dict_is_plain_and_ordered():
    d = to_dict(Root(model=Model(name="m")))
    assert list(d) == ["model", "trainer", "tags", "pools", "note"]
    assert list(d["trainer"])[:3] == ["total_steps", "prompts_per_step", "samples_per_prompt"]
    assert d["model"]["layers"] == [1, 2] and d["pools"] == {"global": {"nodes": 1}}


def test_dump_yaml_round_trip(tmp_path):
    cfg = from_dict(
        Root,
        {
            "model": {"name": "1e-3", "extra": {"k": 2.5e-10}},
            "tags": ["true", "null", "5", "3e-4", ""],
            "trainer": {"seed": 3, "optim": {"lr": 3e-4}},
            "note": [1],
        },
    )
    text = dump_yaml(cfg)
    assert text.index("model:") < text.index("trainer:") < text.index("tags:")
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_config(Root, path) == cfg


# ----------------------------------------------------------------------------- properties
@st.composite
def trainers(draw):
    p, s = draw(st.integers(1, 64)), draw(st.integers(1, 16))
    return Trainer(
        total_steps=draw(st.integers(1, 10**12)),
        prompts_per_step=p,
        samples_per_prompt=s,
        minibatch_size=draw(st.sampled_from([d for d in range(1, p * s + 1) if (p * s) % d == 0])),
        clip_ratio=draw(st.floats(0, 1, exclude_min=True, exclude_max=True)),
        mode=draw(st.sampled_from(["ppo", "grpo"])),
        seed=draw(st.none() | st.integers(-(2**63), 2**63 - 1)),
        device=draw(st.sampled_from(["cpu", "cuda"])),
        use_kl=draw(st.booleans()),
        optim=Optim(
            lr=draw(st.floats(min_value=0, exclude_min=True, allow_infinity=False)),
            eps=draw(st.floats(allow_nan=False, allow_infinity=False)),
            betas=draw(st.lists(st.floats(0, 1, exclude_max=True), max_size=4)),
        ),
    )


@settings(max_examples=150, deadline=None)
@given(
    trainer=trainers(),
    tags=st.lists(st.text(max_size=20), max_size=4),
    extra=st.dictionaries(
        st.text(max_size=10), st.floats(allow_nan=False, allow_infinity=False), max_size=3
    ),
)
def test_property_dump_load_round_trip(tmp_path_factory, trainer, tags, extra):
    cfg = Root(model=Model(name="m", extra=extra), trainer=trainer, tags=tags)
    path = tmp_path_factory.mktemp("rt") / "c.yaml"
    path.write_text(dump_yaml(cfg), encoding="utf-8")
    assert load_config(Root, path) == cfg
    assert from_dict(Root, to_dict(cfg)) == cfg


@settings(max_examples=200, deadline=None)
@given(x=st.floats(allow_nan=False, allow_infinity=False), n=st.integers(-(2**63), 2**63 - 1))
def test_property_override_numbers(x, n):
    cfg = load_config(Trainer, None, [f"optim.eps={x!r}", f"seed={n}"])
    assert cfg.optim.eps == x and cfg.seed == n


@settings(max_examples=100, deadline=None)
@given(key=st.text(string.ascii_lowercase + "_", min_size=1, max_size=15))
def test_property_unknown_keys_always_rejected(key):
    names = {
        "total_steps",
        "prompts_per_step",
        "samples_per_prompt",
        "minibatch_size",
        "clip_ratio",
        "mode",
        "seed",
        "device",
        "use_kl",
        "optim",
    }
    if key in names:
        return
    msg = err(from_dict, Trainer, {key: 1}, "trainer")
    assert (
        msg.startswith(f"unknown config key 'trainer.{key}'")
        and "(keys of trainer: total_steps," in msg
    )


def test_async_takes_dynamic_sampling():
    """Dynamic sampling is a group hook of both modes (tests/test_async.py trains it)."""
    from hybridrl.config import Config, load_config

    cfg = load_config(Config, None, ["algorithm.filter_groups=true", "trainer.mode=async"])
    assert cfg.trainer.mode == "async" and cfg.algorithm.filter_groups


# --- names from TRL and veRL (hybridrl/config/aliases.py) -----------------------------------------
@pytest.mark.parametrize(
    "override, ours",
    [
        ("algorithm.adv_estimator=grpo", "algorithm.advantage"),  # difflib said kl_estimator
        ("data.max_response_length=8", "rollout.max_new_tokens"),  # difflib: max_prompt_length
        ("num_generations=8", "trainer.samples_per_prompt"),
        ("beta=0.0", "algorithm.kl_coef"),
        ("learning_rate=1e-6", "actor.lr"),
        ("trainer.test_freq=5", "trainer.eval_every"),
        ("rollout.n=8", "trainer.samples_per_prompt"),
        ("actor_rollout_ref={rollout: {n: 8}}", "actor"),
    ],
)
def test_trl_and_verl_names_are_refused_with_ours(override, ours):
    from hybridrl.config import Config

    msg = err(load_config, Config, None, [override])
    key = override.split("=")[0]
    assert msg.startswith(f"unknown config key '{key}'; ") and f"use '{ours}'" in msg
    assert "did you mean" not in msg


def test_verl_minibatch_unit_is_named_and_a_string_is_a_list_of_one():
    from hybridrl.config import Config

    msg = err(load_config, Config, None, ["actor.ppo_mini_batch_size=8"])
    assert "veRL counts prompts, hybridrl counts samples" in msg
    cfg = load_config(Config, None, ["trainer.loggers=wandb", "data.stop=</s>"])
    assert cfg.trainer.loggers == ["wandb"] and cfg.data.stop == ["</s>"]
    assert "must be one of" in err(load_config, Config, None, ["trainer.loggers=nope"])
