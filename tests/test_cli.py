"""The command line: config errors are one line on stderr and exit code 2, before any work."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrl.cli import main
from hybridrl.config import Config, ConfigError, load_config


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["trainer.totl_steps=3"], "did you mean 'trainer.total_steps'"),
        (["trainer.total_steps=abc"], "trainer.total_steps"),
        (["actor.lr=-1"], "actor.lr"),
        (["model.path=/nonexistent/model"], "/nonexistent/model"),
        (["algorithm.advantage=grpoo"], "did you mean 'grpo'"),
        (["task.reward_fn=no.such.module:fn"], "cannot import module"),
        (["rollout.temperature=-0.5"], "rollout.temperature"),
        (["trainer.prompts_per_step=3", "actor.ppo_minibatch_size=5"], "multiple of"),
        # numbers that are no real values, or too large for where they go
        (["actor.lr=.inf"], "config key 'actor.lr' must be a finite number, got inf"),
        (["rollout.temperature=.inf"], "'rollout.temperature' must be a finite number, got inf"),
        (["algorithm.kl_coef=.nan"], "'algorithm.kl_coef' must be a finite number, got nan"),
        (["controller.pools.global.cpus_per_worker=nan"], "must be a finite number, got nan"),
        (["trainer.seed=1180591620717411303424"], "'trainer.seed' must be >= 0 and <= 92233"),
        (["model.seed=-1"], "'model.seed' must be >= 0 and <= 9223372036854775807, got -1"),
        (["rollout.max_new_tokens=1180591620717411303424"], "max_new_tokens' must be a 64-bit"),
        (
            ["rollout.backend_options.kv_cache_bytes=1180591620717411303424"],
            "must be a 64-bit integer",
        ),
        (["trainer.prompts_per_step=100000000"], "hybridrl memory"),
        # paths and names that would fail only after the run directory exists
        (
            ["rollout.backend_options.draft_model_path=/nonexistent"],
            "'/nonexistent' does not exist",
        ),
        (["actor.lora_rank=4", "actor.lora_target_modules=[q_proj, qkv]"], "[1] = 'qkv'"),
        (["actor.lora_rank=4", "actor.lora_target_modules=[all-linear, q_proj]"], "stands alone"),
        (["sft.checkpoint=/etc/passwd/ckpt"], "'/etc/passwd' is not a directory"),
        (["controller.num_threads=100000"], "'controller.num_threads' must be >= 1 and <= 1024"),
        (
            ["rollout.backend_options.kv_cache_bytes=1000", "rollout.max_new_tokens=64"],
            "bytes hold 2 blocks of 16 tokens (16384 bytes each in this model), fewer than the 4",
        ),
        (
            ["rollout.backend_options.block_size=100000"],
            "'rollout.backend_options.block_size' must be >= 1 and <= 1024",
        ),
        # a run name is one directory name: a path would move aside and write any directory
        (["trainer.name=."], "config 'trainer': name '.' is not a run name: one path component"),
        (["trainer.name=.."], "name '..' is not a run name"),
        (["trainer.name=../elsewhere"], "name '../elsewhere' is not a run name"),
        (["trainer.name=/tmp/x"], "name '/tmp/x' is not a run name"),
        (["trainer.name=" + "n" * 201], "at most 200 bytes"),
        (
            ["trainer.runs_dir=/etc/passwd"],
            "'trainer.runs_dir': trainer.runs_dir '/etc/passwd' is a file",
        ),
        (["trainer.runs_dir=/etc/passwd/runs"], "'/etc/passwd' is not a directory"),
    ],
)
def test_bad_overrides_exit_2_with_one_line(capsys, argv, needle):
    code, _, err = run(capsys, "train", *argv)
    assert code == 2
    assert needle in err and err.count("\n") == 1, err


def test_a_run_name_derived_from_a_plug_in_path_is_one_component(tmp_path):
    plugin = tmp_path / "my_adv.py"
    plugin.write_text("from hybridrl.algorithms.advantages import grpo_advantage as my_estimator\n")
    cfg = load_config(Config, None, [f"algorithm.advantage={plugin}:my_estimator"])
    assert cfg.trainer.name == "arith_my_estimator"


def test_a_small_kv_pool_is_checked_only_for_the_native_engine():
    from hybridrl.checks import check_config

    long = ["rollout.max_new_tokens=64"]
    check_config(load_config(Config, None, [*long, "rollout.backend=hf"]))  # no pool to size
    with pytest.raises(ConfigError, match="rollout.backend_options.kv_cache_bytes': 1000 bytes"):
        check_config(
            load_config(Config, None, [*long, "rollout.backend_options.kv_cache_bytes=1000"])
        )


def test_large_finite_values_are_numbers(capsys):
    # no bound on how large a positive float may be: 1e30 is a (bad) learning rate, not an error
    code, out, _ = run(capsys, "train", "actor.lr=1e30", "--print-config")
    assert code == 0 and "lr: 1.0e+30" in out


def test_draft_model_path_must_be_a_checkpoint(tmp_path, capsys):
    code, _, err = run(capsys, "train", f"rollout.backend_options.draft_model_path={tmp_path}")
    assert code == 2 and "holds no config.json" in err and err.count("\n") == 1


def test_lora_target_modules_known_names(capsys):
    ok = "actor.lora_target_modules=[self_attn.q_proj, v_proj, down_proj]"
    code, _, _ = run(capsys, "train", "actor.lora_rank=4", ok, "--print-config")
    assert code == 0
    # with LoRA off the list is not used, so it is not checked
    code, _, _ = run(capsys, "train", "actor.lora_target_modules=[qkv]", "--print-config")
    assert code == 0


def test_dotted_override_into_the_default_placement_and_pools(capsys):
    code, out, err = run(capsys, "train", "controller.placement.learner=global", "--print-config")
    assert code == 0, err
    assert "placement:\n    learner: global\n    rollout: global\n" in out
    code, out, err = run(
        capsys,
        "train",
        "controller.pools.gen.workers_per_node=2",
        "controller.placement.rollout=gen",
        "--print-config",
    )
    assert code == 0, err
    assert "  global:\n" in out and "  gen:\n" in out and "workers_per_node: 2" in out
    assert "learner: global\n    rollout: gen\n" in out


def test_dotted_override_into_a_yaml_pool(capsys):
    example = "examples/arith_grpo_fsdp_disaggregated.yaml"
    code, out, err = run(
        capsys, "train", example, "controller.pools.gen.workers_per_node=2", "--print-config"
    )
    assert code == 0, err
    # the YAML's pools are kept (no default 'global' is added back) and gen's other fields too
    assert "global:" not in out and "learner: train\n    rollout: gen\n" in out
    gen = out[out.index("    gen:\n") :]
    assert "workers_per_node: 2" in gen.split("placement:")[0]


def test_unwritable_sft_checkpoint_parent(tmp_path, capsys):
    if os.geteuid() == 0:  # root writes anywhere: a parent that is a regular file instead
        (tmp_path / "file").write_text("")
        target, needle = tmp_path / "file" / "ckpt", "is not a directory"
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        target, needle = ro / "sub" / "ckpt", "no write permission"
    for cmd in (["train"], ["sft", "sft.enabled=false"]):
        code, _, err = run(capsys, *cmd, f"sft.checkpoint={target}")
        assert code == 2 and needle in err and err.count("\n") == 1, err
    # not trained (warm start off) or cached (a config.json is only read): no check
    code, _, err = run(
        capsys, "train", f"sft.checkpoint={target}", "sft.enabled=false", "--print-config"
    )
    assert code == 0, err


def test_an_immutable_sft_checkpoint_directory_is_refused_before_the_warm_start(tmp_path, capsys):
    """The warm start replaces sft.checkpoint when done: a directory there that cannot be written
    (immutable, even for root) is refused at once, not after the training."""
    ckpt = tmp_path / "ws"
    ckpt.mkdir()
    (ckpt / "junk").write_text("")
    if subprocess.run(["chattr", "+i", str(ckpt)], capture_output=True).returncode:
        pytest.skip("chattr +i needs root on a filesystem that supports it")
    try:
        assert main(["train", "examples/arith_grpo.yaml", f"sft.checkpoint={ckpt}"]) == 2
    finally:
        subprocess.run(["chattr", "-i", str(ckpt)])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot be written" in err and "sft.checkpoint" in err, err


def test_cached_sft_checkpoint_is_only_read(tmp_path, capsys):
    cached = tmp_path / "ckpt"
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    tmp_path.chmod(0o555)
    try:
        code, _, err = run(capsys, "train", f"sft.checkpoint={cached}", "--print-config")
    finally:
        tmp_path.chmod(0o755)
    assert code == 0, err


EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def example_assets(example: Path, tmp_path: Path) -> list[str]:
    """Overrides that point an example at assets it makes first (a model, data files)."""
    if not example.name.startswith("chat_math_"):
        return []
    from hybridrl.models.chat_model import build_chat_model
    from hybridrl.tasks.word_problems import write_word_problems

    model = build_chat_model(tmp_path / "model", ["user assistant 12 apples"], vocab_size=280)
    train = write_word_problems(tmp_path / "train.jsonl", 8, seed=0)
    val = write_word_problems(tmp_path / "val.jsonl", 4, seed=1)
    data = [f"data.train_files={train}", f"data.val_files={val}"]
    sft = [f"sft.train_files={train}", f"sft.val_files={val}", f"sft.checkpoint={tmp_path / 'o'}"]
    return [f"model.path={model}", *(sft if "sft" in example.name else data)]


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_examples_load(capsys, tmp_path, example):
    assert len(EXAMPLES) >= 5
    overrides = example_assets(example, tmp_path)
    capsys.readouterr()  # what making the assets printed
    code, out, err = run(capsys, "train", str(example), *overrides, "--print-config")
    assert code == 0 and err == "", err


def test_yaml_syntax_error(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  total_steps: 3\n   name: x\n")
    code, _, err = run(capsys, "train", str(bad))
    assert code == 2 and "cannot parse" in err and "line 3" in err and err.count("\n") == 1


def test_missing_config_file(capsys):
    code, _, err = run(capsys, "train", "does/not/exist.yaml")
    assert code == 2 and "not found" in err


def test_print_config_resolves_overrides(capsys):
    code, out, _ = run(
        capsys, "train", "examples/arith_grpo.yaml", "trainer.total_steps=7", "--print-config"
    )
    assert code == 0 and "total_steps: 7" in out and "backend: native" in out


def test_console_script_exit_code():
    proc = subprocess.run(
        [sys.executable, "-m", "hybridrl.cli", "train", "trainer.nme=x"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "did you mean 'trainer.name'" in proc.stderr


def test_config_reference_is_up_to_date():
    proc = subprocess.run(
        [sys.executable, "docs/gen_config_reference.py", "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, (
        "docs/configuration.md is stale: run python docs/gen_config_reference.py\n"
        + proc.stdout
        + proc.stderr
    )


@pytest.mark.parametrize("error", ["StepTimeoutError", "CheckpointError", "RewardsFailedError"])
def test_a_run_stopped_for_a_known_reason_exits_1_with_one_line(monkeypatch, capsys, error):
    from hybridrl.driver import checkpoint, loop
    from hybridrl.rollout import scoring
    from hybridrl.telemetry import watchdog

    cls = {
        "StepTimeoutError": watchdog.StepTimeoutError,
        "CheckpointError": checkpoint.CheckpointError,
        "RewardsFailedError": scoring.RewardsFailedError,
    }
    message = f"step 3: {error} for the test"

    def stopped(cfg, resume=False, **kwargs):
        raise cls[error](message)

    monkeypatch.setattr(loop, "train", stopped)
    assert main(["train", "examples/arith_grpo.yaml"]) == 1
    assert capsys.readouterr().err.strip() == f"hybridrl: error: {message}"


def test_help_lists_every_command_and_points_to_the_config_reference(capsys):
    from hybridrl.cli import RUN_COMMANDS, TOOLS

    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for name, text in [*RUN_COMMANDS.items(), *((n, t) for n, (t, _) in TOOLS.items())]:
        assert name in out and " ".join(text.split()[:4]) in " ".join(out.split())
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "docs/configuration.md" in capsys.readouterr().out


def test_config_prints_a_key_and_refuses_an_unknown_one(capsys):
    assert main(["config", "actor.lr", "trainer"]) == 0
    out = capsys.readouterr().out
    assert "actor.lr: AdamW learning rate" in out and "1e-6 for a model.path" in out
    assert "trainer.total_steps: int" in out  # a section lists its keys
    assert main(["config", "algorithm.adv_estimator"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "use 'algorithm.advantage'" in err


def test_model_path_and_export_take_the_same_path_forms(tmp_path, capsys):
    from hybridrl.models.chat_model import build_chat_model

    run = tmp_path / "runs" / "x"
    model = build_chat_model(run / "checkpoints/step_000002/model", ["1+1=2"], size="tiny")
    (run / "checkpoints/step_000001/model").mkdir(parents=True)  # an older one
    for form in (run, run / "checkpoints/step_000002", model):
        assert load_config(Config, None, [f"model.path={form}"]).model.path == str(model)
        out = tmp_path / f"out-{len(str(form))}"
        assert main(["export", str(form), str(out)]) == 0
        assert (out / "config.json").is_file()
    sharded = tmp_path / "sharded"
    (sharded / "dcp").mkdir(parents=True)
    (sharded / "config.json").write_text("{}")
    assert main(["train", f"model.path={sharded}"]) == 2
    err = capsys.readouterr().err
    assert "is a sharded checkpoint" in err and "hybridrl export" in err
    assert main(["export", str(tmp_path / "runs"), str(tmp_path / "o")]) == 2  # none of them


def test_overrides_may_follow_an_option(capsys):
    example = str(EXAMPLES[0])
    code, out, _ = run(
        capsys, "generate", example, "--output", "x.jsonl", "eval.n=3", "--print-config"
    )
    assert code == 0 and "n: 3" in out
    with pytest.raises(SystemExit) as exit_:
        main(["generate", example, "--output", "x.jsonl", "stray", "--print-config"])
    assert exit_.value.code == 2 and "unrecognized arguments: stray" in capsys.readouterr().err
