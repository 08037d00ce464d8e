"""The command line: config errors are one line on stderr and exit code 2, before any work."""

import subprocess
import sys

import pytest

from hybridrl.cli import main


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
    ],
)
def test_bad_overrides_exit_2_with_one_line(capsys, argv, needle):
    code, _, err = run(capsys, "train", *argv)
    assert code == 2
    assert needle in err and err.count("\n") == 1, err


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
