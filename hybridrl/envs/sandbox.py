"""Run untrusted code (a model's tool call) in a separate, limited process.

The threat model (what a sandboxed program may try, and what stops it) is written down in
docs/agentic.md, "The sandbox". Isolation, strongest available first (``Sandbox.isolation`` says
which one is active):

* ``"namespaces"``: the program sees a file system of its own, built in new user, mount, PID,
  network, IPC, UTS and cgroup namespaces: the system directories and the interpreter's prefixes
  bound read-only, a fresh ``/proc``, a few device nodes, and one size-capped tmpfs as its private
  ``/tmp`` (also ``/var/tmp`` and ``/dev/shm``). It then runs in a second user and mount namespace
  of its own, so every mount it inherited is locked (the kernel refuses to make it writable or to
  unmount it), with no capabilities. The network namespace has only a down loopback device. When
  the PID namespace's init ends, the kernel kills everything left in it, and the tmpfs goes with
  the namespace: nothing of the call stays on the machine.
* ``"landlock"`` (where unprivileged namespaces are unavailable): Landlock limits the program to
  reading the same directories and to writing its private directory (a fresh directory on the
  machine); from kernel 6.12 it also cannot signal processes outside the call.
* ``"seccomp"`` (neither): only the filter below and file permissions.

In all of them a seccomp filter refuses what the isolation does not cover: sockets other than
internet ones (none at all outside the namespaces, whose network is empty), new user namespaces
(a program that is root in one could mount a tmpfs, memory outside every limit), io_uring,
ptrace and the kernel's keyrings; outside the namespaces also ``setsid``/``setpgid`` (no process
leaves the process group killed at the end) and signals to process groups (``kill(-1)``). The
program runs as an unprivileged user (as root: a user id of its own per call, with no
supplementary groups), in a new session, with setrlimit limits per process, memory and process
limits for the whole call in a cgroup where one is writable, a scrubbed environment and no home
directory. stdout and stderr are read through pipes and capped. Nothing here is a boundary
against a kernel exploit.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import marshal
import os
import resource
import secrets
import selectors
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

NOBODY = 65534
ISOLATIONS = ("namespaces", "landlock", "seccomp")

# Runs as the sandbox user: stdin carries its configuration (in marshal, much quicker to import
# than json), sent once the caller has placed this process in the call's cgroup, so that
# everything it starts is counted there. It isolates itself, forks the program (its last isolation
# steps and limits set in the child), waits for it, and writes the program's wait status and CPU
# time to the status pipe. In the namespaces it is the PID namespace's init, so its exit kills
# whatever the program left running.
_BOOTSTRAP = r"""
import ctypes, marshal, os, resource, struct, sys
import _signal as signal  # what we need of signal, without its import of enum (milliseconds)
cfg = marshal.loads(sys.stdin.buffer.read())
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: a caller that dies ends the call
if os.getppid() != cfg["caller"]:
    os._exit(125)
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_BIND, MS_REC, MS_PRIVATE = 2, 4, 8, 4096, 16384, 1 << 18
RDONLY, NOSUID, NODEV = 1, 2, 4  # MOUNT_ATTR_*

def check(ret, what):
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")

def put(path, text):
    with open(path, "w") as f:
        f.write(text)

def c(text):
    return None if text is None else text.encode()

def mount(src, dst, fstype=None, flags=0, data=None):
    check(libc.mount(c(src), c(dst), c(fstype), flags, c(data)), "mount " + dst)

def set_attr(path, attr, recursive=False):  # mount_setattr(2): sets only these flags
    buf = ctypes.create_string_buffer(struct.pack("QQQQ", attr, 0, 0, 0), 32)
    flags = 0x8000 if recursive else 0  # AT_RECURSIVE
    check(libc.syscall(442, -100, path.encode(), flags, buf, 32), "mount_setattr " + path)

def own_ids(inside, uid, gid):  # the one mapping an unprivileged user may write
    put("/proc/self/setgroups", "deny")
    put("/proc/self/uid_map", f"{inside} {uid} 1")
    put("/proc/self/gid_map", f"{inside} {gid} 1")

def build_view(private):
    # The new root is a tmpfs mounted over /tmp (in this mount namespace only).
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    new = "/tmp"
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=256k")
    for path, target in cfg["view"]:
        dst = new + path
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if target is not None:
            os.symlink(target, dst)
            continue
        os.mkdir(dst) if os.path.isdir(path) else open(dst, "x").close()
        mount(path, dst, None, MS_BIND | MS_REC)
        set_attr(dst, RDONLY | NOSUID | NODEV, recursive=True)
    os.mkdir(new + "/proc")
    mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    dev = new + "/dev"
    os.mkdir(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=16k")
    for name in ("null", "zero", "full", "random", "urandom"):
        open(f"{dev}/{name}", "x").close()
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, fd in (("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2"), ("fd", "")):
        os.symlink("/proc/self/fd" + fd, f"{dev}/{name}")
    os.mkdir(new + private)
    size = f"mode=0700,size={cfg['disk_kb']}k,nr_inodes={cfg['inodes']}"
    mount("tmpfs", new + private, "tmpfs", MS_NOSUID | MS_NODEV, size)
    for alias in ("/var/tmp", "/dev/shm"):
        os.makedirs(new + alias)
        mount(new + private, new + alias, None, MS_BIND)
    set_attr(dev, RDONLY)
    os.chdir(new)
    check(libc.syscall(cfg["pivot_root"], b".", b"."), "pivot_root")
    check(libc.umount2(b".", 2), "umount the old root")  # MNT_DETACH
    os.chdir("/")
    set_attr("/", RDONLY)

def lock_mounts():
    # A user namespace of its own: mounts copied from a more privileged one are locked.
    check(libc.unshare(0x10000000 | 0x00020000), "unshare")  # CLONE_NEWUSER | CLONE_NEWNS
    own_ids(cfg["inside_id"], 0, 0)  # not 0: exec leaves it without capabilities
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP

def landlock(rules, scoped):
    abi = libc.syscall(444, None, 0, 1)  # LANDLOCK_CREATE_RULESET_VERSION
    check(abi, "landlock")
    fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # the access rights this ABI has
    kinds = {"read": 1 | 4 | 8, "device": 2 | 4 | (1 << 14) | (1 << 15), "all": fs}
    attr = struct.pack("QQQ", fs, 0, scoped if abi >= 6 else 0)
    size = 24 if abi >= 6 else 16 if abi >= 4 else 8
    ruleset = libc.syscall(444, ctypes.create_string_buffer(attr, 24), size, 0)
    check(ruleset, "landlock ruleset")
    for path, kind in rules:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        rule = ctypes.create_string_buffer(struct.pack("=Qi", kinds[kind] & fs, fd), 12)
        check(libc.syscall(445, ruleset, 1, rule, 0), "landlock rule " + path)
        os.close(fd)
    check(libc.syscall(446, ruleset, 0), "landlock")
    os.close(ruleset)

def become_program(workdir):
    fd = os.open(workdir + "/.stdin", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    os.unlink(workdir + "/.stdin")
    os.chdir(workdir)
    check(libc.prctl(38, 1, 0, 0, 0), "no_new_privs")
    if cfg["landlock"] is not None:
        landlock(*cfg["landlock"])
    for res, soft, hard in cfg["rlimits"]:
        resource.setrlimit(res, (soft, hard))
    bpf = bytes.fromhex(cfg["filter"])
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    fprog = struct.pack("HxxxxxxP", len(bpf) // 8, ctypes.addressof(buf))
    fprog = ctypes.create_string_buffer(fprog)
    check(libc.prctl(22, 2, fprog, 0, 0), "seccomp")  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # killed with its parent (not its own children)
    os.execv(cfg["argv"][0], cfg["argv"])

def run(workdir, isolate_child):
    for name, text in cfg["files"].items():
        put(f"{workdir}/{name}", text)
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)
    libc.prctl(4, 0, 0, 0, 0)  # not dumpable: the program (the same user) cannot ptrace us
    pid = os.fork()
    if pid == 0:
        try:
            libc.prctl(4, 1, 0, 0, 0)  # its own /proc files stay its own (to write its id maps)
            isolate_child()
            become_program(workdir)
        except BaseException as e:
            os.write(2, f"sandbox: {e}\n".encode())
        finally:
            os._exit(125)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # as init: signals from inside are then ignored
    while True:  # reap orphans too (zombies would count against the process limit)
        got, status, usage = os.wait4(-1, 0)
        if got == pid:
            break
    os.write(status_fd, f"{status} {usage.ru_utime + usage.ru_stime}".encode())

try:
    if cfg["mode"] == "namespaces":
        uid, gid = os.geteuid(), os.getegid()
        check(libc.unshare(0x7E020000), "unshare")  # user, mount, PID, net, IPC, UTS, cgroup
        own_ids(0, uid, gid)
        init = os.fork()
        if init:  # outside the PID namespace: wait for its init, whose end ends all in it
            _, status = os.waitpid(init, 0)
            if os.WIFSIGNALED(status):  # killed before it could report: pass that on
                sig = os.WTERMSIG(status)
                if sig not in (signal.SIGKILL, signal.SIGSTOP):
                    signal.signal(sig, signal.SIG_DFL)
                os.kill(os.getpid(), sig)
            os._exit(os.waitstatus_to_exitcode(status))
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: killed with us
        build_view(cfg["workdir"])
        run(cfg["workdir"], lock_mounts)
    else:
        run(cfg["workdir"], lambda: None)
except OSError as e:
    sys.stderr.write(f"sandbox: {e}\n")
    os._exit(125)
"""

# The syscalls the filter names, per machine, and the audit architecture it checks (with whether
# to refuse the x32 ABI, whose numbers would bypass the list).
_SYSCALLS = {
    "x86_64": {
        "socket": 41, "io_uring_setup": 425, "unshare": 272, "clone": 56, "clone3": 435,
        "setns": 308, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
        "add_key": 248, "request_key": 249, "keyctl": 250, "bpf": 321, "perf_event_open": 298,
        "userfaultfd": 323, "setsid": 112, "setpgid": 109, "kill": 62, "pivot_root": 155,
    },
    "aarch64": {
        "socket": 198, "io_uring_setup": 425, "unshare": 97, "clone": 220, "clone3": 435,
        "setns": 268, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
        "add_key": 217, "request_key": 218, "keyctl": 219, "bpf": 280, "perf_event_open": 241,
        "userfaultfd": 282, "setsid": 157, "setpgid": 154, "kill": 129, "pivot_root": 41,
    },
}  # fmt: skip
_AUDIT_ARCH = {"x86_64": (0xC000003E, True), "aarch64": (0xC00000B7, False)}

# Read-only in the program's view (with the interpreter's prefixes), where they exist.
_SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
_PRIVATE = "/tmp"  # the private directory's path inside the namespaces
_INSIDE_ID = 65534  # the program's user and group id inside the namespaces
_FRESH_IDS = (0x7F000000, 1 << 24)  # as root, each call's user id is drawn from this range
_INODES = 8192  # files and directories the private tmpfs may hold


@dataclass(frozen=True)
class Limits:
    """Per-run limits. ``memory_mb`` and ``max_procs`` bound the whole call (its processes and
    threads, its own helper processes and, for memory, the files in its private directory) when
    a cgroup is available (``Sandbox.cgroup``); without one, memory is bounded per process (address
    space) and processes by setrlimit."""

    cpu_s: int = 5  # CPU seconds per process (SIGXCPU, then SIGKILL one second later)
    wall_s: float = 10.0  # wall time of the whole run, then everything is killed
    memory_mb: int = 1024
    disk_mb: int = 64  # size of the private directory (in the namespaces)
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
    limit: str | None  # which limit fired: wall, cpu, memory, disk, file_size, processes, output
    truncated: bool  # stdout or stderr was longer than the cap
    isolation: str
    wall_s: float
    workdir: str  # the private directory as the program saw it (already gone)


class Sandbox:
    """Runs programs under :class:`Limits` with the strongest isolation this machine allows.

    ``python``: the interpreter (default: ``sys.executable`` when the sandbox user may run it,
    else the system ``python3``). ``isolation``: ``"auto"`` or one of ``ISOLATIONS``.
    ``uid``/``gid``: the user to run as when we are root (default: a user id of its own per
    call). ``tmp_root``: where the private directories are made outside the namespaces (default:
    the system's temp directory; the sandbox user must be able to reach it).
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        python: str | None = None,
        isolation: str = "auto",
        uid: int | None = None,
        gid: int | None = None,
        tmp_root: str | None = None,
    ):
        if isolation != "auto" and isolation not in ISOLATIONS:
            raise ValueError(f"isolation {isolation!r}: expected 'auto' or one of {ISOLATIONS}")
        self.limits, self.tmp_root = limits or Limits(), tmp_root
        fixed = None if uid is None else (uid, uid if gid is None else gid)
        self._fixed_ids = fixed if os.geteuid() == 0 else None
        candidates = [python] if python else _python_candidates()
        modes = list(ISOLATIONS) if isolation == "auto" else [isolation]
        failed = []  # why each (isolation, interpreter) tried does not work
        for mode, interpreter in itertools.product(modes, candidates):
            reason = _probe(mode, interpreter, self._fixed_ids)
            if reason is None:
                break
            failed.append(f"{mode} with {interpreter}: {reason}")
        else:
            raise RuntimeError(f"no sandbox isolation works here ({'; '.join(failed)})")
        self._configure(mode, interpreter, _cgroup_place())

    def _configure(self, isolation: str, python: str, cgroup_place) -> None:
        self.isolation, self.python = isolation, python
        self._view = _view(python)
        self._filter = _seccomp_filter(isolation)
        self._cgroup_place = cgroup_place
        self.cgroup = None if cgroup_place is None else f"v{cgroup_place.version}"

    def run_python(self, code: str, stdin: str = "") -> SandboxResult:
        """Run ``code`` as ``main.py`` in the private directory."""
        return self.run(["{python}", "-I", "{workdir}/main.py"], {"main.py": code}, stdin)

    async def arun_python(self, code: str, stdin: str = "") -> SandboxResult:
        return await asyncio.to_thread(self.run_python, code, stdin)

    def run(
        self, argv: list[str], files: dict[str, str] | None = None, stdin: str = ""
    ) -> SandboxResult:
        """Run ``argv`` (``{python}`` and ``{workdir}`` are substituted) with ``files`` (by
        name) written into the private directory first."""
        files = {**(files or {}), ".stdin": stdin}
        bad = [n for n in files if not n or n in (".", "..") or "/" in n]
        if bad:
            raise ValueError(f"file names must be single path components, got {bad}")
        ids = self._fixed_ids or (_fresh_ids() if os.geteuid() == 0 else None)
        outer = None
        if self.isolation == "namespaces":
            workdir = _PRIVATE
        else:  # inside a directory of ours, which the program can neither rename nor replace
            outer = tempfile.mkdtemp(prefix="hybridrl-sandbox-", dir=self.tmp_root)
            os.chmod(outer, 0o711)
            workdir = os.path.join(outer, "work")
            os.mkdir(workdir, 0o700)
            if ids is not None:
                os.chown(workdir, *ids)
        try:
            argv = [a.format(python=self.python, workdir=workdir) for a in argv]
            return self._execute(argv, files, workdir, ids)
        finally:
            if outer is not None:
                _remove_tree(outer)

    def _execute(self, argv: list[str], files: dict, workdir: str, ids) -> SandboxResult:
        limits, machine = self.limits, os.uname().machine
        shared_user = ids is None or ids == self._fixed_ids or ids[0] == NOBODY
        cfg = {
            "mode": self.isolation,
            "caller": os.getpid(),
            "workdir": workdir,
            "files": files,
            "argv": argv,
            "rlimits": _rlimits(limits, self.isolation, ids, shared_user),
            "filter": self._filter.hex(),
            "view": self._view,
            "disk_kb": limits.disk_mb * 1024,
            "inodes": _INODES,
            "inside_id": _INSIDE_ID,
            "pivot_root": _SYSCALLS[machine]["pivot_root"],
            "landlock": _landlock_rules(self._view, workdir)
            if self.isolation == "landlock"
            else None,
        }
        cgroup = _Cgroup(self._cgroup_place, limits) if self._cgroup_place else None
        status_r, status_w = os.pipe()
        cfg["status_fd"] = status_w
        start = time.monotonic()
        try:
            try:
                proc = subprocess.Popen(
                    [self.python, "-I", "-S", "-c", _BOOTSTRAP],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    cwd="/",
                    env=_scrubbed_env(workdir),
                    start_new_session=True,
                    pass_fds=(status_w,),
                    **_user_kwargs(ids),
                )
            finally:
                os.close(status_w)
            try:
                if cgroup is not None:
                    cgroup.add(proc.pid)
                _send(proc.stdin, marshal.dumps(cfg))
                out, timed_out = _drain(proc, limits.wall_s, limits.output_bytes, start)
            except BaseException:  # interrupted: leave nothing running
                _killpg(proc.pid)
                if cgroup is not None:
                    cgroup.kill()
                proc.wait()
                raise
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            oom = cgroup is not None and cgroup.oom_kills() > 0
        finally:
            report = _read_report(status_r)
            if cgroup is not None:
                cgroup.remove()
        if report is not None:  # the program's own status (else: the sandbox's, when killed)
            status, cpu = report
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
            limit=_which_limit(timed_out, sig, cpu, oom, stderr, out["truncated"], limits),
            truncated=out["truncated"],
            isolation=self.isolation,
            wall_s=time.monotonic() - start,
            workdir=workdir,
        )


def _send(pipe, data: bytes) -> None:
    """Write the config to the bootstrap (which may already have died: it then reports)."""
    fd = pipe.fileno()
    with contextlib.suppress(BrokenPipeError):
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    pipe.close()


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


def _read_report(fd: int) -> tuple[int, float] | None:
    """The bootstrap's report: the program's wait status and CPU seconds (None when it was killed
    before writing one)."""
    os.set_blocking(fd, False)
    try:
        status, cpu = os.read(fd, 256).split()
        return int(status), float(cpu)
    except (BlockingIOError, ValueError):
        return None
    finally:
        os.close(fd)


def _killpg(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _which_limit(timed_out, sig, cpu, oom, stderr, truncated, limits: Limits) -> str | None:
    """Best effort: signals tell wall and CPU, the cgroup an out-of-memory kill; the rest is read
    from a Python traceback."""
    if timed_out:
        return "wall"
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= limits.cpu_s):
        return "cpu"
    if oom:
        return "memory"
    markers = {
        "MemoryError": "memory",
        "No space left on device": "disk",
        "File too large": "file_size",
        "Resource temporarily unavailable": "processes",
        "can't start new thread": "processes",
        "Too many open files": "open_files",
    }
    found = next((name for text, name in markers.items() if text in stderr), None)
    return found or ("output" if truncated else None)


def _rlimits(limits: Limits, mode: str, ids, shared_user: bool) -> list[tuple[int, int, int]]:
    mb = 1024 * 1024
    nproc = limits.max_procs
    if mode != "namespaces" and shared_user:
        # The count is per user, machine-wide: add what that user already runs, less the
        # bootstrap to come.
        nproc += _count_processes(ids[0] if ids else os.getuid()) - 1
    return [
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),
        (resource.RLIMIT_AS, limits.memory_mb * mb, limits.memory_mb * mb),
        (resource.RLIMIT_FSIZE, limits.file_size_mb * mb, limits.file_size_mb * mb),
        (resource.RLIMIT_NPROC, nproc, nproc),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_CORE, 0, 0),
    ]


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


def _seccomp_filter(mode: str, refuse_userns: bool = True) -> bytes:
    """The program's seccomp filter (classic BPF) for ``mode``: see the module docstring."""
    return _build_filter(os.uname().machine, mode, refuse_userns)


@functools.cache
def _build_filter(machine: str, mode: str, refuse_userns: bool) -> bytes:
    nr, (arch, x32) = _SYSCALLS[machine], _AUDIT_ARCH[machine]
    LD, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06
    ALLOW, KILL, ERRNO = 0x7FFF0000, 0x80000000, 0x00050000
    EPERM, EACCES, ENOSYS = 1, 13, 38
    ARG0 = 16  # offset of the low half of the first argument in seccomp_data
    prog = [(LD, 0, 0, 4), (JEQ, 1, 0, arch), (RET, 0, 0, KILL), (LD, 0, 0, 0)]
    if x32:
        prog += [(JGE, 0, 1, 0x40000000), (RET, 0, 0, KILL)]

    def refuse(name: str, err: int) -> None:
        prog.extend([(JEQ, 0, 1, nr[name]), (RET, 0, 0, ERRNO | err)])

    def refuse_if(name: str, test: int, k: int, err: int) -> None:
        """Refuse ``name`` when its first argument passes ``test`` against ``k``."""
        prog.extend(
            [
                (JEQ, 0, 4, nr[name]),
                (LD, 0, 0, ARG0),
                (test, 0, 1, k),
                (RET, 0, 0, ERRNO | err),
                (RET, 0, 0, ALLOW),
            ]
        )

    if mode == "namespaces":  # internet sockets only: the network namespace is empty
        prog += [
            (JEQ, 0, 5, nr["socket"]),
            (LD, 0, 0, ARG0),
            (JEQ, 2, 0, 2),  # AF_INET
            (JEQ, 1, 0, 10),  # AF_INET6
            (RET, 0, 0, ERRNO | EACCES),
            (RET, 0, 0, ALLOW),
        ]
    else:
        refuse("socket", EACCES)
        refuse("setsid", EPERM)
        refuse("setpgid", EPERM)
        refuse_if("kill", JGE, 0x80000000, EPERM)  # a negative pid: a process group, or all
    for name in ("ptrace", "process_vm_readv", "process_vm_writev", "add_key", "request_key"):
        refuse(name, EPERM)
    for name in ("keyctl", "bpf", "perf_event_open", "userfaultfd"):
        refuse(name, EPERM)
    refuse("io_uring_setup", ENOSYS)
    if refuse_userns:
        refuse("unshare", EPERM)
        refuse("setns", EPERM)
        refuse("clone3", ENOSYS)  # its flags are out of the filter's reach; libc falls back
        refuse_if("clone", JSET, 0x10000000, EPERM)  # CLONE_NEWUSER
    prog.append((RET, 0, 0, ALLOW))
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _landlock_rules(view, workdir: str) -> tuple[list[tuple[str, str]], int]:
    """Landlock rules (path, access) and scopes: read the view, use the device nodes, write the
    private directory; abstract sockets and signals only within the call."""
    rules = [(path, "read") for path, target in view if target is None]
    rules += [(path, "device") for path in _DEVICES if os.path.exists(path)]
    rules.append((workdir, "all"))
    return rules, 1 | 2  # LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET | LANDLOCK_SCOPE_SIGNAL


@functools.cache
def _view(python: str) -> tuple[tuple[str, str | None], ...]:
    """What the program sees of the machine's files, read-only, as (path, symlink target or
    None): the system directories and the interpreter's prefixes, but never the home directory
    or anything above it."""
    found = []
    for path in _SYSTEM_PATHS:
        if os.path.islink(path):
            found.append((path, os.readlink(path)))
        elif os.path.isdir(path):
            found.append((path, None))
    script = "import sys; print(sys.prefix, sys.base_prefix, sys.exec_prefix, sep='\\n')"
    try:
        out = subprocess.run(
            [python, "-I", "-c", script], capture_output=True, text=True, timeout=60, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    home = os.path.realpath(os.path.expanduser("~"))
    dirs = [p for p, target in found if target is None]
    for prefix in sorted({os.path.realpath(p) for p in out.splitlines() if p}):
        inside = any(prefix == d or prefix.startswith(d + "/") for d in dirs)
        if inside or prefix == "/" or (home + "/").startswith(prefix + "/"):
            continue
        dirs.append(prefix)
        found.append((prefix, None))
    return tuple(found)


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


@functools.cache
def _fresh_range() -> bool:
    """Whether the fresh user and group ids exist here (a container may map fewer)."""
    lo, n = _FRESH_IDS
    for name in ("uid_map", "gid_map"):
        try:
            with open(f"/proc/self/{name}") as f:
                rows = [tuple(map(int, line.split())) for line in f]
        except OSError:
            return False
        if not any(a <= lo and lo + n <= a + count for a, _, count in rows):
            return False
    return True


def _fresh_ids() -> tuple[int, int]:
    """A user (and group) id for one call: no other process on the machine has it, so the call
    can neither signal nor read anything of another's (``nobody`` where the range is unmapped)."""
    if not _fresh_range():
        return NOBODY, NOBODY
    n = _FRESH_IDS[0] + secrets.randbelow(_FRESH_IDS[1])
    return n, n


def _python_candidates() -> list[str]:
    found = [
        sys.executable,
        os.path.realpath(sys.executable),
        shutil.which("python3", path="/usr/bin:/bin"),
    ]
    return list(dict.fromkeys(p for p in found if p))


@functools.cache
def _probe(mode: str, python: str, fixed_ids) -> str | None:
    """Why ``mode`` does not work here with ``python`` as the sandbox user (None: it works). Run
    once per process."""
    if os.uname().machine not in _SYSCALLS:
        return f"no seccomp filter for {os.uname().machine}"
    sandbox = object.__new__(Sandbox)  # not probed: that is what this is
    vars(sandbox).update(tmp_root=None, limits=Limits(), _fixed_ids=fixed_ids)
    sandbox._configure(mode, python, None)
    try:
        result = sandbox.run(["{python}", "-I", "-S", "-c", "print('ok')"])
    except OSError as e:
        return str(e)
    if result.exit_code == 0 and result.stdout.strip() == "ok":
        return None
    return result.stderr.strip().splitlines()[-1] if result.stderr.strip() else "no output"


def _remove_tree(path: str) -> None:
    """Remove ``path`` whatever the program made of it: any depth (paths past PATH_MAX are never
    formed: each directory is opened from its parent's descriptor) and directories it took the
    permissions off (given back where we own them; root needs none)."""
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        return
    names: list[str] = []  # the directories from ``path`` down to ``fd``
    while True:
        with contextlib.suppress(OSError):
            os.fchmod(fd, stat.S_IRWXU)
        child = None
        with os.scandir(fd) as entries:
            for entry in entries:
                if entry.is_dir(follow_symlinks=False):
                    child = entry.name
                    break
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.name, dir_fd=fd)
        if child is not None:
            with contextlib.suppress(OSError):  # a directory, not a link: ours to open
                os.chmod(child, stat.S_IRWXU, dir_fd=fd)
            below = os.open(child, flags, dir_fd=fd)
            os.close(fd)
            fd = below
            names.append(child)
            continue
        if not names:
            os.close(fd)
            os.rmdir(path)
            return
        up = os.open("..", flags & ~os.O_NOFOLLOW, dir_fd=fd)
        os.close(fd)
        fd = up
        os.rmdir(names.pop(), dir_fd=fd)


# -- cgroups -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _CgroupPlace:
    """Where the calls' cgroups are made: one directory (cgroup v2) or the memory and pids
    hierarchies' directories (v1)."""

    version: int
    dirs: tuple[str, ...]


_names = itertools.count()


class _Cgroup:
    """One call's cgroup: memory (swap none) and process limits for all its processes together."""

    def __init__(self, place: _CgroupPlace, limits: Limits):
        name = f"hybridrl-sandbox-{os.getpid()}-{next(_names)}"
        self.version, self.dirs = place.version, [os.path.join(d, name) for d in place.dirs]
        made = []
        try:
            for d in self.dirs:
                os.mkdir(d)
                made.append(d)
            memory, procs = str(limits.memory_mb << 20), str(limits.max_procs)
            if self.version == 2:
                _put(self.dirs[0], "memory.max", memory)
                _put(self.dirs[0], "memory.swap.max", "0", optional=True)
                _put(self.dirs[0], "pids.max", procs)
            else:
                _put(self.dirs[0], "memory.limit_in_bytes", memory)
                _put(self.dirs[0], "memory.memsw.limit_in_bytes", memory, optional=True)
                _put(self.dirs[1], "pids.max", procs)
        except OSError:
            for d in made:
                os.rmdir(d)
            raise

    def add(self, pid: int) -> None:
        for d in self.dirs:
            _put(d, "cgroup.procs", str(pid))

    def oom_kills(self) -> int:
        events = "memory.events" if self.version == 2 else "memory.oom_control"
        with contextlib.suppress(OSError), open(os.path.join(self.dirs[0], events)) as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        return 0

    def kill(self) -> None:
        if self.version == 2 and _put(self.dirs[0], "cgroup.kill", "1", optional=True):
            return
        for d in self.dirs:
            with contextlib.suppress(OSError), open(os.path.join(d, "cgroup.procs")) as f:
                for pid in map(int, f.read().split()):
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)

    def remove(self) -> None:
        """Kill what is left and remove the cgroup (once its processes have gone)."""
        deadline = time.monotonic() + 5.0
        for d in self.dirs:
            while True:
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    self.kill()
                    time.sleep(0.005)


def _put(directory: str, name: str, value: str, optional: bool = False) -> bool:
    try:
        with open(os.path.join(directory, name), "w") as f:
            f.write(value)
        return True
    except FileNotFoundError:
        if optional:
            return False
        raise


@functools.cache
def _cgroup_place() -> _CgroupPlace | None:
    """Where this process may make cgroups with memory and pids limits: its own cgroup v2 (with
    both controllers enabled for children, or enabled by us), or the parent of its cgroup v2 (with
    them enabled); else its cgroups in the v1 memory and pids hierarchies. None when none is
    writable."""
    try:
        with open("/proc/self/cgroup") as f, open("/proc/self/mountinfo") as g:
            dirs = _cgroup_dirs(f.read(), g.read())
    except (OSError, ValueError):
        return None
    if "" in dirs:
        own, top = dirs[""]
        parent = os.path.dirname(own)
        if _v2_ready(own, may_enable=True) and _can_make_children(own):
            return _CgroupPlace(2, (own,))
        if own != top and _v2_ready(parent, may_enable=False) and _can_make_children(parent):
            return _CgroupPlace(2, (parent,))
    v1 = (dirs.get("memory", (None,))[0], dirs.get("pids", (None,))[0])
    if None not in v1 and all(_can_make_children(d) for d in v1):
        return _CgroupPlace(1, v1)
    return None


def _cgroup_dirs(proc_cgroup: str, mountinfo: str) -> dict[str, tuple[str, str]]:
    """This process's cgroup directories, by controller ("" for the v2 hierarchy; of v1, memory
    and pids), each with its hierarchy's mount point, from ``/proc/self/cgroup`` and
    ``/proc/self/mountinfo``."""
    own, mounts = {}, {}  # by controller: path in the hierarchy; (mount's root, mount point)
    for line in proc_cgroup.splitlines():
        hid, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if hid != "0" else [""]:
            own[name] = path
    for line in mountinfo.splitlines():
        fields = line.split()
        sep = fields.index("-")
        kind, root, point = fields[sep + 1], fields[3], fields[4]
        if kind == "cgroup2":
            mounts[""] = (root, point)
        elif kind == "cgroup":
            for name in set(fields[sep + 3].split(",")) & {"memory", "pids"}:
                mounts[name] = (root, point)
    found = {}
    for name in own.keys() & mounts.keys():
        (root, point), path = mounts[name], own[name]
        if root == "/":
            found[name] = (os.path.normpath(f"{point}/{path}"), point)
        elif (path + "/").startswith(root.rstrip("/") + "/"):
            found[name] = (os.path.normpath(f"{point}/{path[len(root) :]}"), point)
    return found


def _v2_ready(d: str, may_enable: bool) -> bool:
    """Whether children of ``d`` get the memory and pids controllers (enabling them if we may)."""
    try:
        with open(os.path.join(d, "cgroup.subtree_control")) as f:
            if {"memory", "pids"} <= set(f.read().split()):
                return True
        if may_enable:
            _put(d, "cgroup.subtree_control", "+memory +pids")
            return True
    except OSError:
        pass
    return False


def _can_make_children(d: str) -> bool:
    probe = os.path.join(d, f"hybridrl-sandbox-probe-{os.getpid()}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
        return True
    except OSError:
        return False
