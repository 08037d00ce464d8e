"""Python stacks of a Ray rank's process on demand (the step watchdog's hang dump,
``RayBackend.dump_stacks``): each rank registers :mod:`faulthandler` for :data:`STACKS_SIGNAL` at
startup, writing into an unlinked temporary file; :func:`read_stacks` signals the processes of one
node and reads what they wrote (plus ``py-spy``'s view when it is installed). It runs on the driver
for its own node and in a Ray task pinned to each other node."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

# signal that makes a rank's process write its Python stacks (faulthandler)
STACKS_SIGNAL = signal.SIGUSR1
# seconds to wait for the stacks of the signalled processes (of one node)
STACKS_WAIT_S = 3.0


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
