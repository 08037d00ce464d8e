"""Run untrusted code (a model's tool call) in a separate, limited process.

Isolation, strongest available first (``Sandbox.isolation`` says which one is active):

* ``"namespaces"``: ``unshare -r -n -m -p -f`` puts the child in new user, network, mount and PID
  namespaces. The network namespace has only a down loopback device, so nothing can be reached.
  A bootstrap inside makes every mount read-only and bind-mounts the private directory as the one
  writable place; the PID namespace means that when the sandbox's first process ends, the kernel
  kills every process it left behind (even ones that left the process group).
* ``"seccomp"`` (where unprivileged namespaces are unavailable): a seccomp filter makes
  ``socket()`` fail (and ``io_uring_setup``, which could open sockets behind it, and ``setsid`` /
  ``setpgid``, so that no process leaves the process group); writes are then limited only by file
  permissions.

In both, the child runs as an unprivileged user (``nobody`` when we are root: root is exempt from
the process-count limit, and ``nobody`` owns no files), in a new session (the whole process group
is killed at the wall-time limit), with setrlimit limits on CPU time, address space, file size,
processes and open files, a scrubbed environment, and a private temporary directory as its cwd
(removed afterwards). stdout and stderr are read through pipes and capped. Nothing here is a
security boundary against a kernel exploit; see docs/agentic.md for what is and is not covered.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534

# Runs inside the sandbox: argv[1] is a JSON config, argv[2:] the program. It isolates itself, then
# forks the program (with the limits set in the child), waits for it, and writes its wait status
# and CPU time to the status pipe: ``unshare -f`` cannot pass on death by a signal, and in the
# PID namespace this process is init, so that its exit kills whatever the program left running.
_BOOTSTRAP = r"""
import ctypes, json, os, resource, struct, sys
cfg = json.loads(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
def check(ret, what):
    if ret != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
if cfg["mode"] == "namespaces":
    work = cfg["workdir"]
    libc.syscall.restype = ctypes.c_long
    def setattr(path, flags, attr_set, attr_clr):  # mount_setattr(2): changes only these flags
        attr = ctypes.create_string_buffer(struct.pack("QQQQ", attr_set, attr_clr, 0, 0), 32)
        check(libc.syscall(442, -100, path.encode(), flags, attr, 32), "mount_setattr " + path)
    check(libc.mount(work.encode(), work.encode(), None, 4096 | 16384, None), "bind")  # MS_BIND|REC
    setattr("/", 0x8000, 1, 0)  # AT_RECURSIVE, set MOUNT_ATTR_RDONLY
    setattr(work, 0, 0, 1)  # clear it on the private directory
    os.chdir(work)
elif cfg["mode"] == "seccomp":
    arch, x32, denied = cfg["seccomp"]
    LD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06
    ALLOW, KILL, ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if x32:
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]
    for nr, errno in denied:
        prog += [(JEQ, 0, 1, nr), (RET, 0, 0, ERRNO | errno)]
    prog.append((RET, 0, 0, ALLOW))
    buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in prog))
    fprog = struct.pack("HxxxxxxP", len(prog), ctypes.addressof(buf))
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    check(libc.prctl(22, 2, ctypes.create_string_buffer(fprog), 0, 0), "seccomp")
os.set_inheritable(cfg["status_fd"], False)
pid = os.fork()
if pid == 0:
    try:
        for res, soft, hard in cfg["rlimits"]:
            resource.setrlimit(res, (soft, hard))
        os.execv(sys.argv[2], sys.argv[2:])
    finally:
        os._exit(127)
while True:  # reap orphans too (zombies would count against the process limit)
    got, status, usage = os.wait4(-1, 0)
    if got == pid:
        break
report = {"status": status, "cpu": usage.ru_utime + usage.ru_stime}
os.write(cfg["status_fd"], json.dumps(report).encode())
"""

# Per machine, for the seccomp fallback: (audit arch, whether to refuse the x32 ABI, [(syscall,
# errno)]). Refused: socket (EACCES), io_uring_setup (ENOSYS: it could open sockets behind the
# filter's back), setsid and setpgid (EPERM: so no process leaves the group killed at the end).
_SECCOMP_ARCH = {
    "x86_64": (0xC000003E, True, [(41, 13), (425, 38), (112, 1), (109, 1)]),
    "aarch64": (0xC00000B7, False, [(198, 13), (425, 38), (157, 1), (154, 1)]),
}


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``max_procs`` counts the sandbox's processes and threads, its own helper
    processes included (in the seccomp mode, on top of those the sandbox user already runs)."""

    cpu_s: int = 5  # CPU seconds per process (SIGXCPU, then SIGKILL one second later)
    wall_s: float = 10.0  # wall time of the whole run, then the process group is killed
    memory_mb: int = 1024  # address space per process
    file_size_mb: int = 16  # largest file a process may write
    max_procs: int = 32
    open_files: int = 64
    output_bytes: int = 64 * 1024  # per stream; the rest is read and dropped


@dataclass
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when killed by a signal
    timed_out: bool  # the wall-time limit fired
    killed_by_signal: int | None
    limit: str | None  # which limit fired: wall, cpu, memory, file_size, processes, output
    truncated: bool  # stdout or stderr was longer than the cap
    isolation: str
    wall_s: float
    workdir: str  # the private directory (already removed)


class Sandbox:
    """Runs programs under :class:`Limits` with the strongest isolation this machine allows.

    ``python``: the interpreter for :meth:`run_python` (default: ``sys.executable`` when the
    sandbox user may run it, else the system ``python3``). ``isolation``: ``"auto"``,
    ``"namespaces"`` or ``"seccomp"``. ``uid``/``gid``: the user to run as when we are root.
    ``tmp_root``: where the private directories are made (default: the system's temp directory;
    the sandbox user must be able to reach it).
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        python: str | None = None,
        isolation: str = "auto",
        uid: int = NOBODY,
        gid: int = NOBODY,
        tmp_root: str | None = None,
    ):
        self.limits, self.tmp_root = limits or Limits(), tmp_root
        self._ids = (uid, gid) if os.geteuid() == 0 else None
        candidates = [python] if python else _python_candidates()
        modes = ["namespaces", "seccomp"] if isolation == "auto" else [isolation]
        works = ((m, p) for m in modes for p in candidates if _probe(m, p, self._ids))
        found = next(works, None)
        if found is None:
            raise RuntimeError(
                f"no sandbox isolation works here (tried {modes} with interpreters {candidates})"
            )
        self.isolation, self.python = found

    def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` as ``main.py`` in the private directory."""
        return self.run(["{python}", "-I", "{workdir}/main.py"], {"main.py": code}, stdin)

    async def arun_python(self, code: str, stdin: str = "") -> SandboxResult:
        return await asyncio.to_thread(self.run_python, code, stdin)

    def run(
        self, argv: list[str], files: dict[str, str] | None = None, stdin: str = ""
    ) -> SandboxResult:
        """Run ``argv`` (``{python}`` and ``{workdir}`` are substituted) with ``files`` written
        into the private directory first."""
        workdir = tempfile.mkdtemp(prefix="hybridrl-sandbox-", dir=self.tmp_root)
        try:
            for name, text in {**(files or {}), ".stdin": stdin}.items():
                with open(os.path.join(workdir, name), "w", encoding="utf-8") as f:
                    f.write(text)
            if self._ids is not None:
                for path in [workdir, *(os.path.join(workdir, n) for n in os.listdir(workdir))]:
                    os.chown(path, *self._ids)
            argv = [a.format(python=self.python, workdir=workdir) for a in argv]
            return self._execute(argv, workdir)
        finally:
            _force_rmtree(workdir)

    def _execute(self, argv: list[str], workdir: str) -> SandboxResult:
        limits, (status_r, status_w) = self.limits, os.pipe()
        cmd = _command(self.isolation, self.python, workdir, self._ids, limits, status_w)
        start = time.monotonic()
        try:
            with open(os.path.join(workdir, ".stdin"), "rb") as stdin:
                proc = subprocess.Popen(
                    cmd + argv,
                    stdin=stdin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd=workdir,
                    env=_scrubbed_env(workdir),
                    start_new_session=True,
                    pass_fds=(status_w,),
                    **_user_kwargs(self._ids),
                )
        finally:
            os.close(status_w)
        try:
            out, timed_out = _drain(proc, limits.wall_s, limits.output_bytes, start)
        except BaseException:  # interrupted: leave nothing running
            _killpg(proc.pid)
            raise
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        report = _read_report(status_r)
        if report is not None:  # the program's own status (else: the sandbox's, when killed)
            status, cpu = report["status"], report["cpu"]
        else:
            cpu = usage.ru_utime + usage.ru_stime
        code = os.waitstatus_to_exitcode(status)
        sig = -code if code < 0 else None
        stdout, stderr = (b.decode("utf-8", "replace") for b in out["data"])
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=None if sig else code,
            timed_out=timed_out,
            killed_by_signal=sig,
            limit=_which_limit(timed_out, sig, cpu, stderr, out["truncated"], limits),
            truncated=out["truncated"],
            isolation=self.isolation,
            wall_s=time.monotonic() - start,
            workdir=workdir,
        )


def _drain(proc: subprocess.Popen, wall_s: float, cap: int, start: float) -> tuple[dict, bool]:
    """Read stdout and stderr (keeping ``cap`` bytes of each) until both close; kill the process
    group at the wall-time limit, and any stragglers once the first process has exited (before it
    is reaped, so its process group id cannot have been reused)."""
    sel = selectors.DefaultSelector()
    data = [bytearray(), bytearray()]
    for i, pipe in enumerate((proc.stdout, proc.stderr)):
        os.set_blocking(pipe.fileno(), False)
        sel.register(pipe, selectors.EVENT_READ, i)
    truncated = timed_out = False
    deadline, killed = start + wall_s, False
    exited = os.WEXITED | os.WNOHANG | os.WNOWAIT  # for waitid: has it exited? (not reaping it)
    while sel.get_map():
        now = time.monotonic()
        if not killed and (now >= deadline or os.waitid(os.P_PID, proc.pid, exited)):
            timed_out = now >= deadline
            _killpg(proc.pid)
            killed, deadline = True, now + 1.0  # grace to read what is left in the pipes
        elif killed and now >= deadline:
            break
        for key, _ in sel.select(timeout=0.02):
            chunk = os.read(key.fd, 65536)
            if not chunk:
                sel.unregister(key.fileobj)
                continue
            buf = data[key.data]
            keep = max(0, cap - len(buf))
            truncated |= len(chunk) > keep
            buf += chunk[:keep]
    sel.close()
    proc.stdout.close()
    proc.stderr.close()
    if not killed:
        _killpg(proc.pid)
    return {"data": data, "truncated": truncated}, timed_out


def _read_report(fd: int) -> dict | None:
    """The bootstrap's report (None when it was killed before writing one)."""
    os.set_blocking(fd, False)
    try:
        return json.loads(os.read(fd, 65536) or "null")
    except (BlockingIOError, ValueError):
        return None
    finally:
        os.close(fd)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _which_limit(timed_out, sig, cpu, stderr, truncated, limits: Limits) -> str | None:
    """Best effort: signals tell wall and CPU; the rest is read from a Python traceback."""
    if timed_out:
        return "wall"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
        return "cpu"
    markers = {
        "MemoryError": "memory",
        "File too large": "file_size",
        "Resource temporarily unavailable": "processes",
        "can't start new thread": "processes",
        "Too many open files": "open_files",
    }
    found = next((name for text, name in markers.items() if text in stderr), None)
    return found or ("output" if truncated else None)


def _command(
    mode: str, python: str, workdir: str, ids, limits: Limits, status_fd: int
) -> list[str]:
    """The command line up to (not including) the program to run."""
    mb = 1024 * 1024
    nproc = limits.max_procs
    if mode != "namespaces":  # the count is per user, machine-wide; less the bootstrap to come
        nproc += _count_processes(ids[0] if ids else os.getuid()) - 1
    rlimits = [
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
        (resource.RLIMIT_AS, limits.memory_mb * mb, limits.memory_mb * mb),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * mb, limits.file_size_mb * mb),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]
    cfg = {"mode": mode, "workdir": workdir, "rlimits": rlimits, "status_fd": status_fd}
    if mode == "seccomp":
        cfg["seccomp"] = _SECCOMP_ARCH[os.uname().machine]
    boot = [python, "-I", "-S", "-c", _BOOTSTRAP, json.dumps(cfg)]
    if mode == "namespaces":
        unshare = shutil.which("unshare") or "unshare"
        return [unshare, "-r", "-n", "-m", "-p", "-f", "--mount-proc", "--kill-child", *boot]
    return boot


def _count_processes(uid: int) -> int:
    count = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uids = next(line for line in f if line.startswith("Uid:"))
            count += int(uids.split()[1]) == uid
        except (OSError, StopIteration):
            continue
    return count


def _scrubbed_env(workdir: str) -> dict[str, str]:
    one = {k: "1" for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        **one,
    }


def _user_kwargs(ids) -> dict:
    return {} if ids is None else {"user": ids[0], "group": ids[1], "extra_groups": []}


def _python_candidates() -> list[str]:
    found = [
        sys.executable,
        os.path.realpath(sys.executable),
        shutil.which("python3", path="/usr/bin:/bin"),
    ]
    return list(dict.fromkeys(p for p in found if p))


@functools.cache
def _probe(mode: str, python: str, ids) -> bool:
    """Whether ``mode`` works here with ``python`` as the sandbox user (run once per process)."""
    if mode == "seccomp" and os.uname().machine not in _SECCOMP_ARCH:
        return False
    if mode == "namespaces" and not shutil.which("unshare"):
        return False
    sandbox = object.__new__(Sandbox)  # not probed: that is what this is
    vars(sandbox).update(tmp_root=None, limits=Limits(), _ids=ids, isolation=mode, python=python)
    try:
        result = sandbox.run(["{python}", "-I", "-S", "-c", "print('ok')"])
    except OSError:
        return False
    return result.exit_code == 0 and result.stdout.strip() == "ok"


def _force_rmtree(path: str) -> None:
    """Remove ``path`` even where the sandboxed program took the permissions off its own
    directories (it ran as their owner)."""
    if not os.path.exists(path):
        return
    os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):  # top-down: each directory is opened before descending
        for d in dirs:
            full = os.path.join(root, d)
            if not os.path.islink(full):
                os.chmod(full, 0o700)
    shutil.rmtree(path, ignore_errors=True)
