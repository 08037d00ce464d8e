"""``hybridrl memory MODEL [flags]``: the command-line face of the memory estimator
(``parallel/memory.py``): it turns a model spec (a built-in size, a config, a parameter count) into
a config, the flags into a ``Layout``, and the estimate into a table or JSON.

Apart from the estimator because none of this is arithmetic: the estimator stays importable and
testable on its own, and ``bench/memory.py`` uses both.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from hybridrl.parallel.memory import DTYPE_BYTES, SHARDING, Layout, estimate


def human(n: int | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def format_table(result: dict) -> str:
    lay = result["layout"]
    head = (
        f"params {result['n_params']:,} (trainable {result['trainable_params']:,}); "
        f"world {lay['world_size']}, sharding {lay['sharding']}, {lay['param_dtype']}"
        f"{' + fp32 master' if lay['param_dtype'] != 'fp32' and lay['master_fp32'] else ''}, "
        f"offload {'on' if lay['cpu_offload'] else 'off'}, LoRA r={lay['lora_rank']}, "
        f"AC {'on' if lay['activation_checkpointing'] else 'off'}, micro-batch "
        f"{lay['micro_batch_tokens']} tokens"
    )
    experts = result["breakdown"].get("experts")
    if experts:
        head += (
            f"\nexperts {experts['params']:,} of the params ({experts['params_per_ep_rank']:,} per "
            f"EP rank at ep_size {lay['ep_size']}); active per token "
            f"{experts['active_params_per_token']:,}"
        )
    rows = [("term", "bytes/device", "where")]
    opt = result["breakdown"]["optimizer"]
    for key in ("weights", "gradients", "optimizer"):
        rows.append((key, human(result[key]), result["device"][key]))
    rows += [(f"  {k}", human(v), "") for k, v in opt.items() if v]
    rows.append(
        (
            "activations",
            human(result["activations"]),
            "accelerator" if result["activations"] is not None else "(needs a config)",
        )
    )
    for k, v in result["breakdown"].get("activations", {}).items():
        rows.append((f"  {k}", human(v), ""))
    if result["workspace"]:
        rows.append(("workspace", human(result["workspace"]), "accelerator"))
    rows += [
        ("states", human(result["states"]), ""),
        ("total", human(result["total"]), ""),
        ("  on device", human(result["device_total"]), ""),
        ("  on host", human(result["host_total"]), ""),
    ]
    w0, w1 = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    lines = [head] + [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


_SUFFIX = {
    "k": 1e3,
    "K": 1e3,
    "m": 1e6,
    "M": 1e6,
    "b": 1e9,
    "B": 1e9,
    "g": 1e9,
    "G": 1e9,
    "t": 1e12,
    "T": 1e12,
}


def resolve_model(spec: str):
    """A built-in size name, a config.json / checkpoint directory, or a parameter count (7e9, 70B,
    1.5M)."""
    from hybridrl.models.factory import builtin_names

    if spec in builtin_names():
        from hybridrl.models.factory import model_size_config
        from hybridrl.tasks import build_char_tokenizer

        return model_size_config(spec, build_char_tokenizer())
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([kKmMbBgGtT]?)\s*", spec)
    if m:
        return float(m.group(1)) * _SUFFIX.get(m.group(2), 1)
    path = Path(spec).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model {spec!r} is not a built-in size, a parameter count or a config path"
        )
    from transformers import AutoConfig, PretrainedConfig

    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {str(path)!r}: {e}") from None
    try:
        return AutoConfig.for_model(**data) if "model_type" in data else PretrainedConfig(**data)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot build a config from {str(path)!r}: {e}") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def parse_args(argv):
    p = _Parser(
        prog="hybridrl memory",
        description="Estimate the training memory per device (ZeRO formulas).",
    )
    p.add_argument(
        "model",
        help="tiny | small | tiny_moe | a config.json or checkpoint directory | a parameter "
        "count (7e9, 70B)",
    )
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument(
        "--sharding",
        choices=SHARDING,
        default="none",
        help="none, optim (ZeRO-1), grad_op (ZeRO-2), full (ZeRO-3)",
    )
    p.add_argument(
        "--dtype", choices=tuple(DTYPE_BYTES), default="fp32", help="parameter/compute dtype"
    )
    p.add_argument("--no-master", action="store_true", help="bf16 without an fp32 master copy")
    p.add_argument(
        "--offload",
        action="store_true",
        help="weights, gradients and optimizer states in host memory",
    )
    p.add_argument("--lora-rank", type=int, default=0)
    p.add_argument(
        "--ep-size",
        type=int,
        default=1,
        help="expert parallelism (MoE): ranks splitting the experts",
    )
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--micro-batch-tokens", type=int, default=8192)
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="padded row width (default min(tokens, max positions))",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """``hybridrl memory MODEL [flags]``: print the table; 2 and one line on stderr for bad
    input."""
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
        layout = Layout(
            world_size=args.world_size,
            sharding=args.sharding,
            param_dtype=args.dtype,
            master_fp32=not args.no_master,
            cpu_offload=args.offload,
            lora_rank=args.lora_rank,
            activation_checkpointing=args.activation_checkpointing,
            micro_batch_tokens=args.micro_batch_tokens,
            seq_len=args.seq_len,
            ep_size=args.ep_size,
        )
        result = estimate(resolve_model(args.model), layout)
    except ValueError as e:
        print(f"hybridrl memory: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
