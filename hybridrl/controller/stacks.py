"""Python stacks of a Ray rank's process on demand (the step watchdog's hang dump,
``RayBackend.dump_stacks``): each rank registers :mod:`faulthandler` for :data:`STACKS_SIGNAL` at
startup, writing into an unlinked temporary file; :func:`read_stacks` signals the processes of one
node and reads what they wrote (plus ``py-spy``'s view when it is installed). It runs on the driver
for its own node and in a Ray task pinned to each other node; :func:`dump_stacks` does that for a
whole group and writes each rank's file. faulthandler writes from its C signal handler, so a rank
stuck in a C call (a collective, a CUDA sync) still reports its Python stacks."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

# signal that makes a rank's process write its Python stacks (faulthandler)
STACKS_SIGNAL = signal.SIGUSR1
# seconds to wait for the stacks of the signalled processes (of one node)
STACKS_WAIT_S = 3.0
# seconds to wait for a remote node's stack-reading task
STACKS_REMOTE_TIMEOUT_S = 20.0


def dump_stacks(where: list[tuple], stack_fds: list[int], contexts: list, directory) -> list[str]:
    """Every rank's Python stacks into ``<directory>/<role>-rank<r>.txt``; a rank whose stacks could
    not be had gets a file saying why. ``where``: each rank's ``(node id, ip, port, pid)``;
    ``stack_fds``: the fd each rank's stacks are written to; ``contexts``: the ranks'
    ``WorkerContext``. Ranks on the driver's node are read from here, the others through a zero-CPU
    Ray task pinned to their node. The paths."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    here = ray.get_runtime_context().get_node_id()
    by_node: dict[str, list[int]] = {}
    for rank, (node, _, _, _) in enumerate(where):
        by_node.setdefault(node, []).append(rank)
    texts: dict[int, str] = {}
    remote = {}
    for node, ranks in by_node.items():
        procs = [(where[r][3], stack_fds[r]) for r in ranks]
        if node == here:
            texts |= dict(zip(ranks, read_stacks(procs)))
            continue
        task = ray.remote(read_stacks).options(
            num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
        )
        remote[node] = (ranks, task.remote(procs))
    for node, (ranks, ref) in remote.items():
        try:
            found = ray.get(ref, timeout=STACKS_REMOTE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001 - a lost node must not stop the other dumps
            found = [f"(no stacks: the task on node {node[:12]} failed: {exc!r})"] * len(ranks)
        texts |= dict(zip(ranks, found))
    paths = []
    for rank, ctx in enumerate(contexts):
        node, ip, _, pid = where[rank]
        path = directory / f"{ctx.role}-rank{rank}.txt"
        head = f"# role {ctx.role} rank {rank}: pid {pid} on node {ip} ({node[:12]})\n"
        path.write_text(head + texts.get(rank, "(no stacks)\n"))
        paths.append(str(path))
    return paths


def read_stacks(procs: list[tuple[int, int]], wait_s: float = STACKS_WAIT_S) -> list[str]:
    """Signal each ``(pid, fd)`` process of this node to write its stacks to its ``fd`` and return
    what each wrote (waits up to ``wait_s`` in all). With ``py-spy`` on the PATH its dump (native
    frames too) is appended. Runs on the driver, or in a Ray task on the processes' node."""
    starts: list[int | str] = []
    for pid, fd in procs:
        try:
            starts.append(os.stat(f"/proc/{pid}/fd/{fd}").st_size)
            os.kill(pid, STACKS_SIGNAL)
        except OSError as exc:
            starts.append(f"(no stacks: pid {pid}: {exc})\n")
    deadline, sizes = time.monotonic() + wait_s, {}
    while time.monotonic() < deadline:  # until every file grew and stopped growing
        now = {}
        for (pid, fd), start in zip(procs, starts):
            if isinstance(start, int):
                try:
                    now[pid] = os.stat(f"/proc/{pid}/fd/{fd}").st_size
                except OSError:
                    now[pid] = start
        grown = all(now[p] > s for (p, _), s in zip(procs, starts) if isinstance(s, int))
        if grown and now == sizes:
            break
        sizes = now
        time.sleep(0.1)
    texts = []
    for (pid, fd), start in zip(procs, starts):
        if not isinstance(start, int):
            texts.append(start)
            continue
        try:
            with open(f"/proc/{pid}/fd/{fd}") as f:
                f.seek(start)
                text = f.read() or f"(pid {pid} wrote no stacks within {wait_s:g} s)\n"
        except OSError as exc:
            text = f"(no stacks: pid {pid}: {exc})\n"
        texts.append(text + _py_spy(pid))
    return texts


def _py_spy(pid: int) -> str:
    exe = shutil.which("py-spy")
    if exe is None:
        return ""
    try:
        out = subprocess.run(
            [exe, "dump", "--native", "--pid", str(pid)],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return f"\n# py-spy dump --native --pid {pid}\n{out.stdout}{out.stderr}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"\n# py-spy dump failed: {exc}\n"
