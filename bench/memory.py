"""Measured peak memory of one actor training step vs ``hybridrl.parallel.memory.estimate``.

    python bench/memory.py [--model small] [--tokens 2048,8192] [--seq-len 32] [--micro-batches 2]

One training step as the actor runs it (``zero_grad``; per micro-batch:
``response_log_probs`` with entropy over all tokens but the first, a
policy-gradient-like loss plus an entropy term, ``backward``; then
``clip_grad_norm_`` and ``AdamW.step``), with AdamW states already allocated
(a step has happened before) and ``--micro-batches`` micro-batches of
``tokens`` tokens accumulating gradients, for each micro-batch size with
activation checkpointing off and on. A mixture-of-experts model (``--model tiny_moe``) trains as
an MoE run does: every forward replays a random recorded routing (R3), with both balancing losses
and the expert bias.

How the peak is measured: each configuration runs in fresh subprocesses
(1 torch thread). After the imports and the tokenizer, before the model is
built, the process's resident set size (VmRSS) is the baseline; after the
model and the optimizer states exist, the kernel's high-water mark is reset
(``/proc/self/clear_refs`` = 5) and the step runs; VmHWM − baseline is the
memory the step needed (model, gradients, optimizer, activations, library
and allocator overhead). Where clear_refs is not writable, ``ru_maxrss`` (the
process's lifetime peak) is used instead; the step is by far the largest
point of the process.

The allocator matters. With glibc's defaults, the mmap threshold rises
after each large free (up to 32 MiB), so activation-sized tensors then come
from the heap, whose freed holes are kept and fragment: the RSS peak is 1.4
to 2.6 times the live tensor bytes and depends on the allocation history.
So each configuration runs twice: with glibc's defaults
(``rss_peak_glibc_default``) and with the mmap threshold pinned at 128 KiB
(``MALLOC_MMAP_THRESHOLD_``, same as ``mallopt(M_MMAP_THRESHOLD)``), where
every tensor over 128 KiB is its own mapping returned on free, so RSS tracks
the memory actually live (``rss_peak``, the headline). In the pinned run a
second, identical step runs under a dispatch-mode tracker that sums the
bytes of the live tensor storages after every operator (``tensor_peak``:
exactly what the estimator models, no allocator overhead). ``ratio`` =
estimate (total) / rss_peak, goal within 25%; ``ratio_glibc_default`` and
``ratio_tensor_peak`` likewise.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import weakref

# a mixture-of-experts model trains as an MoE run does: R3 replay, both balancing losses, the
# expert bias (with activation checkpointing each layer is recomputed with its forward's routing)
MOE = argparse.Namespace(
    routing_replay="r3",
    aux_loss_coef=0.01,
    z_loss_coef=0.001,
    bias_update_rate=0.01,
    health_max_mean_threshold=3.0,
    health_empty_steps=2,
)
MMAP_THRESHOLD = 128 * 1024  # glibc default start value, pinned (no dynamic raise up to 32 MiB)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _trim():
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class LiveTensorPeak:
    """Peak of the summed bytes of live tensor storages seen by the dispatcher (plus those
    registered)."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        tracker = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                tracker._see(out)
                return out

        self.mode, self.live, self.current, self.peak = Mode(), {}, 0, 0

    def _add(self, storage):
        key = id(storage)
        if key in self.live:
            return
        nbytes = storage.nbytes()

        def gone(_ref, key=key, nbytes=nbytes):
            if self.live.pop(key, None) is not None:
                self.current -= nbytes

        self.live[key] = weakref.ref(storage, gone)
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _see(self, out):
        import torch
        from torch.utils._pytree import tree_leaves

        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_sparse:
                self._add(t.untyped_storage())

    def register(self, tensors):
        for t in tensors:
            self._add(t.untyped_storage())

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def child(args) -> dict:
    import torch

    torch.set_num_threads(1)
    from hybridrl.algorithms import agg_totals
    from hybridrl.learner import moe
    from hybridrl.learner.logprob import response_log_probs
    from hybridrl.models.factory import build_model
    from hybridrl.moe.routing import NOT_ROUTED, ROUTING_DTYPE, is_moe, routing_shape
    from hybridrl.parallel.fsdp import enable_activation_checkpointing
    from hybridrl.protocol import Batch
    from hybridrl.tasks import build_char_tokenizer

    tok = build_char_tokenizer()
    _trim()
    baseline = _status("VmRSS")
    model = build_model(args.model, tok, seed=0)
    if args.ac:
        enable_activation_checkpointing(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    runtime = moe.start(moe.prepare(model, MOE), opt, MOE) if is_moe(model) else None
    for p in model.parameters():  # allocate m and v as a previous step would have
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)

    rows, T = args.tokens // args.seq_len, args.seq_len
    gen = torch.Generator().manual_seed(0)

    def micro_batch():
        ids = torch.randint(3, 17, (rows, T), generator=gen)
        attn = torch.ones(rows, T, dtype=torch.long)
        attn[: rows // 2, :2] = 0  # some left padding, as the actor's batches have
        ids[attn == 0] = 0
        resp = ids[:, 1:]
        mb = Batch(
            {
                "input_ids": ids,
                "attention_mask": attn,
                "responses": resp,
                "response_mask": attn[:, 1:].float(),
            }
        )
        if runtime is not None:  # R3: every forward replays a random recorded routing
            layers, experts, k = routing_shape(model)
            routing = torch.rand(rows, T, layers, experts, generator=gen).argsort(-1)[..., :k]
            routing[attn == 0] = NOT_ROUTED
            mb[moe.ROUTING] = routing.to(ROUTING_DTYPE)
            mb[moe.REPLAY] = torch.ones(rows, dtype=torch.long)
        return mb

    mbs = [micro_batch() for _ in range(args.micro_batches)]

    def step():
        opt.zero_grad(set_to_none=True)
        for mb in mbs:
            logp, ent = response_log_probs(model, mb, 1.0, with_entropy=True)
            n = mb["response_mask"].sum()
            loss = -(logp.sum() + 1e-3 * ent.sum()) / n
            moe.note_minibatch(model, agg_totals(mb["response_mask"]))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    _trim()
    reset = _reset_hwm()
    before = _status("VmRSS")
    t0 = time.perf_counter()
    step()
    seconds = time.perf_counter() - t0
    if reset:
        peak = _status("VmHWM")
    else:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "rss_peak": peak - baseline,
        "rss_before_step": before - baseline,
        "hwm_reset": reset,
        "step_seconds": round(seconds, 2),
    }
    if args.tensor_peak:
        opt.zero_grad(set_to_none=True)
        _trim()
        tracker = LiveTensorPeak()
        tracker.register(
            [p for p in model.parameters()]
            + [b for b in model.buffers()]
            + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
            + [t for mb in mbs for t in mb.tensors.values()]
        )
        with tracker:
            step()
        out["tensor_peak"] = tracker.peak
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument(
        "--tokens", default="2048,8192", help="micro-batch sizes in tokens, comma-separated"
    )
    p.add_argument(
        "--seq-len", type=int, default=32, help="padded row width (W1 rows are ~25 tokens)"
    )
    p.add_argument(
        "--micro-batches", type=int, default=2, help="micro-batches accumulated in the step"
    )
    p.add_argument("--no-tensor-peak", dest="tensor_peak", action="store_false")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ac", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        args.tokens = int(args.tokens)
        print(json.dumps(child(args)))
        return 0

    sys.path.insert(0, ROOT)
    from hybridrl.parallel.memory import Layout, estimate
    from hybridrl.parallel.memory_cli import human, resolve_model

    cfg = resolve_model(args.model)
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    results = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        tokens = tokens // args.seq_len * args.seq_len
        for ac in (False, True):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                "--model",
                args.model,
                "--tokens",
                str(tokens),
                "--seq-len",
                str(args.seq_len),
                "--micro-batches",
                str(args.micro_batches),
            ]
            cmd += ["--ac"] if ac else []
            measured = {}
            for name, extra_env, extra in (
                ("glibc_default", {}, ["--no-tensor-peak"]),
                (
                    "mmap_pinned",
                    {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)},
                    [] if args.tensor_peak else ["--no-tensor-peak"],
                ),
            ):
                proc = subprocess.run(
                    cmd + extra, env=env | extra_env, capture_output=True, text=True, cwd=ROOT
                )
                if proc.returncode:
                    sys.stderr.write(proc.stderr)
                    return 1
                measured[name] = json.loads(proc.stdout.strip().splitlines()[-1])
            pinned, default = measured["mmap_pinned"], measured["glibc_default"]
            est = estimate(
                cfg,
                Layout(
                    micro_batch_tokens=tokens, seq_len=args.seq_len, activation_checkpointing=ac
                ),
            )
            row = {
                "micro_batch_tokens": tokens,
                "activation_checkpointing": ac,
                "estimate": {
                    k: est[k] for k in ("weights", "gradients", "optimizer", "activations", "total")
                },
                "measured": {
                    "rss_peak": pinned["rss_peak"],
                    "rss_peak_glibc_default": default["rss_peak"],
                    "tensor_peak": pinned.get("tensor_peak"),
                    "rss_before_step": pinned["rss_before_step"],
                    "step_seconds": pinned["step_seconds"],
                    "step_seconds_glibc_default": default["step_seconds"],
                    "hwm_reset": pinned["hwm_reset"],
                },
                "ratio": round(est["total"] / pinned["rss_peak"], 3),
                "ratio_glibc_default": round(est["total"] / default["rss_peak"], 3),
            }
            if pinned.get("tensor_peak"):
                row["ratio_tensor_peak"] = round(est["total"] / pinned["tensor_peak"], 3)
            results.append(row)
    worst = max(abs(r["ratio"] - 1) for r in results)
    report = {
        "bench": "memory",
        "model": args.model,
        "n_params": est["n_params"],
        "seq_len": args.seq_len,
        "micro_batches": args.micro_batches,
        "threads": 1,
        "results": results,
        "max_abs_error": round(worst, 3),
        "goal": 0.25,
        "within_goal": worst <= 0.25,
        "max_abs_error_glibc_default": round(
            max(abs(r["ratio_glibc_default"] - 1) for r in results), 3
        ),
        "malloc_mmap_threshold": MMAP_THRESHOLD,
    }
    print(json.dumps(report))
    print(
        f"\n{'tokens':>7} {'AC':>3} {'estimate':>10} {'rss peak':>10} {'rss glibc':>10} "
        f"{'tensor pk':>10} "
        f"{'est/rss':>8} {'est/glibc':>9} {'est/tens':>8}",
        file=sys.stderr,
    )
    for r in results:
        m = r["measured"]
        print(
            f"{r['micro_batch_tokens']:>7} {'on' if r['activation_checkpointing'] else 'off':>3} "
            f"{human(r['estimate']['total']):>10} {human(m['rss_peak']):>10} "
            f"{human(m['rss_peak_glibc_default']):>10} "
            f"{human(m.get('tensor_peak')):>10} {r['ratio']:>8.3f} "
            f"{r['ratio_glibc_default']:>9.3f} "
            f"{r.get('ratio_tensor_peak', float('nan')):>8.3f}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
