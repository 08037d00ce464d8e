"""``hybridrl`` command line: ``train``, ``sft``, ``eval``, ``config``, ``export``, ``memory``,
``distill-draft``, ``profile`` (``hybridrl --help`` lists them, one line each).

    hybridrl train examples/arith_grpo.yaml trainer.total_steps=20 [--resume] [--print-config]
    hybridrl train ... --resume-from runs/arith_grpo/checkpoints/step_000100
    hybridrl train ... --resume-changed-data   # --resume although the data files changed
    hybridrl export runs/arith_grpo/checkpoints/step_000200 exported_model
    hybridrl distill-draft TARGET_DIR DRAFT_DIR_OR_SIZE OUT_DIR --task arith --steps 300
    hybridrl memory small --world-size 2 --sharding full
    hybridrl profile runs/arith_grpo [--steps 5:8]
    hybridrl config actor.lr                 # a key's meaning, type, default and allowed values
    hybridrl generate CONFIG eval.n=4 --output out.jsonl [--train 100]
    printf 'hello\n' | hybridrl chat MODEL_DIR [--temperature 0]

Configuration errors (unknown key, wrong type, out-of-range value, YAML
syntax, missing model path, unknown plug-in) print one line and exit 2
before any work starts; so do problems of the data found when the run reads
it (a file that is not UTF-8, data files changed before --resume).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import sys
from pathlib import Path

from hybridrl.checks import check_config
from hybridrl.config import Config, ConfigError, dump_yaml, load_config

EXIT_CONFIG = 2
EXIT_RUN_FAILED = 1  # a run stopped by a hung step or a checkpoint that could not be saved
EXIT_SIGNAL = {"SIGINT": 130, "SIGTERM": 143}  # a run stopped (and saved) by a signal: 128 + it


# the commands that run a config (parse_args below), with their one line
RUN_COMMANDS = {
    "train": "RL training (runs or reuses the warm start first)",
    "sft": "supervised fine-tuning (sft.train_files, or the built-in warm start) only",
    "eval": "the held-out evaluation of the start checkpoint (eval section), as JSON",
    "generate": "batch inference over the held-out (or training) prompts, written to a jsonl",
}
CONFIG_HELP = (
    "every key, its type, default and meaning: docs/configuration.md, or `hybridrl config KEY` "
    "(e.g. hybridrl config actor.lr; a section name lists its keys)"
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="hybridrl",
        description="RL post-training of LLMs with a single controller.",
        epilog=f"`hybridrl COMMAND --help` for a command's arguments; {CONFIG_HELP}.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in RUN_COMMANDS.items():
        s = sub.add_parser(name, help=text, description=text, epilog=CONFIG_HELP + ".")
        s.add_argument("config", nargs="?", help="YAML config file (optional)")
        s.add_argument(
            "overrides", nargs="*", help="dotted overrides such as trainer.total_steps=20"
        )
        s.add_argument(
            "--print-config", action="store_true", help="print the resolved config and exit"
        )
        if name == "generate":
            s.add_argument(
                "--output", required=True, metavar="FILE.jsonl", help="one line per prompt"
            )
            s.add_argument(
                "--train",
                type=int,
                metavar="N",
                help="the first N training prompts instead of the held-out ones",
            )
        if name == "train":
            s.add_argument(
                "--resume", action="store_true", help="continue the run from its latest checkpoint"
            )
            s.add_argument(
                "--resume-from",
                metavar="PATH",
                help="continue from a chosen checkpoint (runs/<name>/checkpoints/step_N), or a "
                "run directory's latest; the run goes on in that checkpoint's run directory",
            )
            s.add_argument(
                "--resume-changed-data",
                action="store_true",
                help="resume although the data files changed since the checkpoint (the run "
                "goes on with other prompts than it would have)",
            )
            s.add_argument(
                "--resume-changed-config",
                action="store_true",
                help="resume although keys that change training differ from the checkpoint's "
                "config (they are listed when refused)",
            )
    for name, (text, _) in TOOLS.items():  # parsed by their own handlers; listed here
        sub.add_parser(name, help=text, add_help=False)
    args, extra = p.parse_known_args(argv)
    # overrides after an option (`--output out.jsonl eval.n=4`): argparse leaves them over
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray:
        p.error(f"unrecognized arguments: {' '.join(stray)}")
    args.overrides += extra
    if args.config and "=" in args.config:  # no config file given, only overrides
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def export(argv: list[str]) -> int:
    """``hybridrl export CHECKPOINT OUT_DIR``: a transformers-format directory (safetensors) from
    any checkpoint."""
    p = argparse.ArgumentParser(prog="hybridrl export", description=export.__doc__)
    p.add_argument(
        "checkpoint",
        help="a run checkpoint (runs/<name>/checkpoints/step_N), a run directory (its newest "
        "checkpoint) or a model directory: the forms model.path takes",
    )
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    from hybridrl.config.sections.model import model_dir
    from hybridrl.parallel.sharded_checkpoint import export_hf

    try:
        ckpt = model_dir(args.checkpoint, "checkpoint")
    except ValueError as e:
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if not (ckpt / "config.json").is_file() and not (ckpt / "dcp").is_dir():
        print(
            f"hybridrl: error: {args.checkpoint!r} is not a checkpoint (no config.json or dcp/ in "
            f"{str(ckpt)!r})",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    print(f"exported to {export_hf(ckpt, args.out_dir)}")
    return 0


def distill_draft(argv: list[str]) -> int:
    """``hybridrl distill-draft TARGET DRAFT OUT``: fit a speculative-decoding draft to its target
    (forward KL on the target's samples of the task's prompts) and save it as a transformers
    checkpoint."""
    p = argparse.ArgumentParser(prog="hybridrl distill-draft", description=distill_draft.__doc__)
    p.add_argument("target", help="the target model's checkpoint directory")
    p.add_argument(
        "draft", help="the draft's checkpoint directory, or a built-in size (tiny, small)"
    )
    p.add_argument("out_dir")
    p.add_argument(
        "--task", default="arith", help="task whose training prompts are used (default: arith)"
    )
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="the rollout temperature the draft will serve",
    )
    p.add_argument("--max-new-tokens", type=int, default=16)
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    if out.exists() and any(out.iterdir()):
        print(
            f"hybridrl: error: {args.out_dir!r} exists and is not empty (choose a new directory)",
            file=sys.stderr,
        )
        return EXIT_CONFIG
    from hybridrl.driver.distill import distill_draft as run
    from hybridrl.models.factory import SIZES, load_model_and_tokenizer, save_model_dir
    from hybridrl.tasks import TASKS

    try:
        task = TASKS.get(args.task)(seed=0)
        target, tok = load_model_and_tokenizer(args.target, "", 0, task.tokenizer())
        # a built-in size: built on the task's tokenizer
        draft_path = args.draft if Path(args.draft).exists() else None
        if draft_path is None and args.draft not in SIZES:
            raise FileNotFoundError(
                f"draft {args.draft!r} is neither a checkpoint directory nor a built-in size "
                f"({', '.join(SIZES)})"
            )
        draft, _ = load_model_and_tokenizer(draft_path, args.draft, 0, task.tokenizer())
        prompts = [
            tok(task.prompt(i).text)["input_ids"] for i in range(args.steps * args.batch_size)
        ]
        res = run(
            target,
            draft,
            tok,
            prompts,
            steps=args.steps,
            batch_size=args.batch_size,
            lr=args.lr,
            temperature=args.temperature,
            max_new_tokens=args.max_new_tokens,
            progress=sys.stderr.isatty(),
        )
    except (KeyError, ValueError, FileNotFoundError) as e:
        print(f"hybridrl: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return EXIT_CONFIG
    save_model_dir(args.out_dir, draft, tok)
    print(json.dumps({**res, "out_dir": args.out_dir}, indent=1))
    return 0


def config_key(argv: list[str]) -> int:
    """``hybridrl config KEY [KEY ...]``: each key's meaning, type, default and allowed values (a
    section lists its keys)."""
    p = argparse.ArgumentParser(prog="hybridrl config", description=config_key.__doc__)
    p.add_argument("keys", nargs="+", metavar="KEY", help="a dotted key (actor.lr) or a section")
    from hybridrl.config_reference import describe

    try:
        print("\n\n".join(describe(k) for k in p.parse_args(argv).keys))
    except ConfigError as e:
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    return 0


def memory(argv: list[str]) -> int:
    from hybridrl.parallel.memory_cli import main as memory_main

    return memory_main(argv)


def chat(argv: list[str]) -> int:
    from hybridrl.driver.chat import main as chat_main

    return chat_main(argv)


def profile(argv: list[str]) -> int:
    from hybridrl.telemetry.profile_report import main as profile_main

    return profile_main(argv)


# the commands with arguments of their own: name -> (one line for --help, handler(argv) -> exit)
TOOLS = {
    "config": ("a config key's meaning, type, default and allowed values", config_key),
    "chat": ("talk to a model with its chat template, one message per line of input", chat),
    "export": ("a transformers-format model directory from a run checkpoint", export),
    "memory": ("the memory a model needs per device under a layout, estimated", memory),
    "distill-draft": ("train a draft model for speculative decoding", distill_draft),
    "profile": ("a run's phases, idle time and timeline.png", profile),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TOOLS:
        return TOOLS[argv[0]][1](argv[1:])
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_config(Config, args.config, args.overrides)
        check_config(cfg)
        if args.command == "sft" and not args.print_config:
            # `sft` trains and writes even when sft.enabled is false or a cached one exists
            try:
                cfg.sft.check_checkpoint_writable(reuse=False)
            except ValueError as e:
                raise ConfigError(f"config 'sft': {e}") from None
    except ConfigError as e:
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    import torch

    torch.set_num_threads(cfg.controller.num_threads)
    if args.command == "sft":
        from hybridrl.driver.sft import run_sft, warm_start_path

        try:
            out = run_sft(cfg, warm_start_path(cfg), cfg.trainer.progress)
        except ConfigError as e:  # the SFT data, read in full: one line
            print(f"hybridrl: error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        record = json.loads((out / "sft.json").read_text())
        record.pop("checks", None)
        print(json.dumps({"checkpoint": str(out), **record}, indent=1))
        print(
            f"SFT model written to {out}: RL starts from it with model.path={out}",
            file=sys.stderr,
        )
        return 0
    if args.command in ("eval", "generate"):
        from hybridrl.driver.evaluate import evaluate_checkpoint

        output, train = getattr(args, "output", None), getattr(args, "train", None)
        try:
            print(json.dumps(evaluate_checkpoint(cfg, output, train), indent=1))
        except ConfigError as e:  # the data, read in full: one line
            print(f"hybridrl: error: {e}", file=sys.stderr)
            return EXIT_CONFIG
        return 0
    from hybridrl.api import run
    from hybridrl.driver.checkpoint import CheckpointError
    from hybridrl.driver.restarts import RestartsExhaustedError
    from hybridrl.driver.resume import Resume
    from hybridrl.rollout.scoring import RewardsFailedError
    from hybridrl.telemetry.watchdog import StepTimeoutError

    try:
        resume = args.resume or args.resume_from or args.resume_changed_data
        resume = resume or args.resume_changed_config
        how = Resume(args.resume_from, args.resume_changed_data, args.resume_changed_config)
        summary = run(cfg, resume=how if resume else False)
    except ConfigError as e:  # the data, read in full when the run starts: one line
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (
        StepTimeoutError,
        CheckpointError,
        RestartsExhaustedError,
        RewardsFailedError,
    ) as e:  # one line each
        print(f"hybridrl: error: {e}", file=sys.stderr)
        return EXIT_RUN_FAILED
    print(json.dumps(summary, indent=1))
    print(f"report: {Path(summary['run_dir']) / 'report.png'}")
    if summary["stopped_by"]:  # the run saved and ended early: say how to go on
        again = _resume_command(argv, summary["run_dir"])
        print(
            f"hybridrl: stopped by {summary['stopped_by']} after step {summary['steps']}; "
            f"checkpoint {summary['final_checkpoint']}; go on with: {again}",
            file=sys.stderr,
        )
        return EXIT_SIGNAL[summary["stopped_by"]]
    return 0


def _resume_command(argv: list[str], run_dir: str) -> str:
    """The command line that goes on with a stopped run: ``argv`` with ``--resume-from RUN_DIR``
    instead of its resume options."""
    out, skip = ["hybridrl"], False
    for arg in argv:
        if skip or arg.startswith("--resume"):
            skip = arg == "--resume-from"
            continue
        out.append(arg)
    return shlex.join([*out, "--resume-from", run_dir])


if __name__ == "__main__":
    sys.exit(main())
