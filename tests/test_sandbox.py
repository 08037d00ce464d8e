"""The sandbox: each test runs hostile code that tries one escape (or hits one limit) and checks
that it fails, and that nothing of it is left on the machine afterwards. Every test runs against
each isolation that works here (``ISOLATIONS``). The tests about a trainer that runs as a normal
user run the trainer's side of the call as a test user (when we are root) or as ourselves."""

from __future__ import annotations

import asyncio
import errno
import grp
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from hybridrl.envs import sandbox as sandbox_module
from hybridrl.envs.sandbox import Limits, Sandbox, SandboxResult

REPO = Path(__file__).resolve().parents[1]
# An interpreter any user may run: for the processes the tests start as other users.
SYSTEM_PYTHON = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
ISOLATIONS = list(sandbox_module.ISOLATIONS)
TIGHT = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, file_size_mb=1, max_procs=8, open_files=32)
ROOT = os.geteuid() == 0

# Prepended to hostile programs: everything a program can try to win back write access to the
# machine's files. On each path, clear the read-only flag of every mount below it (mount_setattr,
# recursive) and remount it read-write (a bind remount); then again as root in a fresh user and
# mount namespace, where it may make one (full capabilities there). Prints what worked.
UNLOCK = r"""
import ctypes, os, struct, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def attempt(what, ret):
    print(what, 'ok' if ret == 0 else 'refused', flush=True)
    return ret == 0
def unlock():
    clear_ro = ctypes.create_string_buffer(struct.pack('QQQQ', 0, 1, 0, 0), 32)
    for path in ['/', '/tmp', '/var/tmp', '/dev/shm', *UNLOCK_PATHS]:
        if os.path.isdir(path):
            attempt('mount_setattr ' + path,
                    libc.syscall(442, -100, path.encode(), 0x8000, clear_ro, 32))
            attempt('remount ' + path, libc.mount(None, path.encode(), None, 0x1020, None))
unlock()
uid, gid = os.geteuid(), os.getegid()
if attempt('unshare', libc.unshare(0x10000000 | 0x00020000)):  # CLONE_NEWUSER | CLONE_NEWNS
    for name, text in (('setgroups', 'deny'), ('uid_map', f'0 {uid} 1'), ('gid_map', f'0 {gid} 1')):
        try:
            with open(f'/proc/self/{name}', 'w') as f:
                f.write(text)
        except OSError:
            pass
    unlock()
"""

# Tries to write "escaped" into each path given on the command line; prints what happened.
WRITE_ARGS = r"""
for path in sys.argv[1:]:
    try:
        with open(path, 'w') as f:
            f.write('escaped')
        print('wrote', path, flush=True)
    except OSError as e:
        print('refused', path, e.errno, flush=True)
"""


def hostile(code: str, unlock_paths=()) -> str:
    return f"UNLOCK_PATHS = {list(unlock_paths)!r}\n{UNLOCK}\n{code}"


def needs_file_isolation(isolation: str) -> None:
    if isolation == "seccomp":
        pytest.skip("the seccomp isolation limits files by their permissions only (documented)")


def make(isolation: str = "auto", limits: Limits = TIGHT, **kw) -> Sandbox:
    try:
        return Sandbox(limits, isolation=isolation, **kw)
    except RuntimeError as e:
        pytest.skip(f"{isolation} isolation unavailable here: {e}")


_boxes: dict[str, Sandbox] = {}


@pytest.fixture(params=ISOLATIONS)
def box(request) -> Sandbox:
    """A sandbox with the ``TIGHT`` limits, for each isolation (made once)."""
    if request.param not in _boxes:
        _boxes[request.param] = make(request.param)
    return _boxes[request.param]


@pytest.fixture
def reachable_tmp():
    """A fresh directory under the system temp dir that any user can reach (pytest's tmp_path sits
    in a directory only its owner may enter)."""
    path = tempfile.mkdtemp(prefix="sandbox-test-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def processes_matching(text: str) -> list[int]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if text.encode() in cmdline:
            found.append(int(pid))
    return found


def run_with_args(box: Sandbox, code: str, *args: str) -> SandboxResult:
    return box.run(["{python}", "-I", "{workdir}/main.py", *args], {"main.py": code})


def sleeper(marker: str, **popen) -> subprocess.Popen:
    """A process outside the sandbox that lives for a minute, its command line marked."""
    code = "import sys, time; time.sleep(60)"
    return subprocess.Popen([SYSTEM_PYTHON or sys.executable, "-c", code, marker], **popen)


# -- Escapes ---------------------------------------------------------------------------------


def test_mounts_cannot_be_made_writable(box, reachable_tmp):
    """Read-only mounts stay read-only whatever the program does (they are locked), and what it
    writes to its private /tmp, /var/tmp and /dev/shm is gone after the call."""
    needs_file_isolation(box.isolation)
    os.chmod(reachable_tmp, 0o777)  # world-writable on the host
    name = f"escaped-{uuid.uuid4().hex}"
    host = [os.path.join(reachable_tmp, name), str(REPO / name)]
    private = [f"/tmp/{name}", f"/var/tmp/{name}", f"/dev/shm/{name}"]
    code = hostile(WRITE_ARGS, [reachable_tmp, str(REPO)])
    result = run_with_args(box, code, *host, *private)
    assert "Traceback" not in result.stderr, result
    for path in host:
        assert f"refused {path}" in result.stdout, result
    assert not any(os.path.exists(p) for p in host + private)
    if box.isolation == "namespaces":  # elsewhere, a private /tmp needs a mount namespace
        assert result.stdout.count("wrote /") == len(private), result


def test_mounts_are_locked_even_with_capabilities(reachable_tmp):
    """With the filter that refuses new user namespaces lifted, the program becomes root in a
    user namespace of its own: the read-only mounts it inherited stay read-only (locked) and
    /proc cannot be unmounted."""
    box = make("namespaces")
    box._filter = sandbox_module._seccomp_filter("namespaces", refuse_userns=False)
    code = hostile(
        WRITE_ARGS + "print('umount /proc', libc.umount2(b'/proc', 2) == 0)\n", ["/usr", "/etc"]
    )
    result = run_with_args(box, code, f"/usr/escaped-{uuid.uuid4().hex}", "/etc/escaped")
    assert "unshare ok" in result.stdout, result  # it did get capabilities
    for path in ("/", "/usr", "/etc"):
        for what in ("mount_setattr", "remount"):
            assert result.stdout.count(f"{what} {path} refused") == 2, result
    assert result.stdout.count("refused /") == 2 and "umount /proc False" in result.stdout


def test_concurrent_sample_cannot_read_or_overwrite_another(box, reachable_tmp):
    """One sample looks for the others' private directories (where the sandbox makes them) and
    reads and overwrites every file it finds there, while another is running."""
    if box.isolation == "seccomp" and not ROOT:
        pytest.skip("the seccomp isolation runs every sample as the trainer's user (documented)")
    secret = f"secret-{uuid.uuid4().hex}"
    victim = (
        "import time\n"
        f"open('mine.txt', 'w').write({secret!r})\n"
        "time.sleep(1.2)\n"
        "print(open('mine.txt').read())\n"
    )
    attacker = hostile(
        "import glob, time\n"
        "time.sleep(0.4)\n"
        "roots = [*sys.argv[1:], '/tmp', '/var/tmp', '/dev/shm']\n"
        "for root in roots:\n"
        "    for path in glob.glob(root + '/**', recursive=True):\n"
        "        if not os.path.isfile(path):\n"
        "            continue\n"
        "        try:\n"
        "            print('read', path, open(path).read())\n"
        "            open(path, 'w').write('overwritten')\n"
        "        except OSError as e:\n"
        "            print('refused', path, e.errno)\n",
        [reachable_tmp],
    )
    shared = make(box.isolation, tmp_root=reachable_tmp)

    async def both():
        return await asyncio.gather(
            shared.arun_python(victim),
            asyncio.to_thread(
                run_with_args, shared, attacker, reachable_tmp, tempfile.gettempdir()
            ),
        )

    mine, theirs = asyncio.run(both())
    assert mine.stdout == f"{secret}\n", mine
    assert secret not in theirs.stdout, theirs


def test_unix_socket_files_unreachable(box, reachable_tmp):
    """A socket file that anyone may connect to (mode 0777, in a directory anyone may enter) is
    out of reach: a network namespace does not cover sockets in the file system."""
    path = os.path.join(reachable_tmp, "service.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen()
        code = (
            "import socket, sys\n"
            "try:\n"
            "    s = socket.socket(socket.AF_UNIX)\n"
            "    s.connect(sys.argv[1]); s.sendall(b'hello')\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        )
        result = run_with_args(box, code, path)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing came in
    assert result.stdout.startswith("refused"), result


def test_abstract_unix_socket_unreachable(box):
    name = f"\0hybridrl-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(name)
        server.listen()
        code = (
            "import socket, sys\n"
            "try:\n"
            "    socket.socket(socket.AF_UNIX).connect('\\0' + sys.argv[1])\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        )
        result = run_with_args(box, code, name[1:])
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert result.stdout.startswith("refused"), result


def test_private_dir_removed_despite_deep_paths(box, reachable_tmp):
    """A directory chain whose path is longer than PATH_MAX (4,096 bytes), under directories the
    program took the permissions off, is removed all the same."""
    box = make(box.isolation, tmp_root=reachable_tmp)
    code = (
        "import os\n"
        "top = os.getcwd()\n"
        "for _ in range(200):\n"
        "    os.mkdir('d' * 40); os.chdir('d' * 40)\n"
        "open('f', 'w').write('x')\n"
        "os.chdir(top); os.chmod('d' * 40, 0)\n"
        "print('made', 200 * 41)\n"
    )
    result = box.run_python(code)
    assert result.stdout == "made 8200\n", result
    assert os.listdir(reachable_tmp) == []


def test_private_dir_is_size_capped(box):
    """Files of the allowed size, written until refused, stop at the private directory's cap."""
    if box.isolation != "namespaces":
        pytest.skip("outside the namespaces there is no mount for a size-capped directory")
    capped = make(box.isolation, Limits(wall_s=5, disk_mb=16, file_size_mb=4))
    code = (
        "for i in range(64):\n"
        "    with open(f'f{i}', 'wb') as f:\n"
        "        f.write(b'x' * (4 << 20))\n"
        "    print(4 * (i + 1), flush=True)\n"
    )
    result = capped.run_python(code)
    assert result.limit == "disk", result
    assert int(result.stdout.split()[-1]) <= 16


def test_tmpfs_mount_cannot_escape_memory_limit(box):
    """A tmpfs the program mounts (after making itself root in a user namespace) is memory
    outside any per-process limit: mounting is refused, or what it holds is within the limit."""
    limits = Limits(cpu_s=3, wall_s=8, memory_mb=128, file_size_mb=8, max_procs=8)
    code = hostile(
        "os.makedirs('m', exist_ok=True)\n"
        "if libc.mount(b'none', b'm', b'tmpfs', 0, b'size=1g') != 0:\n"
        "    print('mount refused'); sys.exit()\n"
        "total = 0\n"
        "try:\n"
        "    for i in range(64):\n"
        "        with open(f'm/f{i}', 'wb') as f:\n"
        "            f.write(b'x' * (8 << 20))\n"
        "        total += 8\n"
        "except OSError as e:\n"
        "    print('refused', e.errno)\n"
        "print('in tmpfs', total)\n"
    )
    result = make(box.isolation, limits).run_python(code)
    assert "mount refused" in result.stdout or "in tmpfs" not in result.stdout, result
    if "in tmpfs" in result.stdout:
        assert int(result.stdout.split()[-1]) <= 128, result


def test_memory_limit_covers_the_whole_call(box):
    """Four processes of 150 MiB each under a 256 MiB limit: at most one lives to the end."""
    limits = Limits(cpu_s=3, wall_s=8, memory_mb=256, max_procs=16)
    one = make(box.isolation, limits)
    if one.cgroup is None:
        pytest.skip("no writable cgroup here: memory is bounded per process only (documented)")
    code = (
        "import os, time\n"
        "kids = []\n"
        "for _ in range(4):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            x = b'x' * (150 << 20)\n"
        "            time.sleep(1.5)\n"
        "            print('held', flush=True)\n"
        "        except MemoryError:\n"
        "            print('refused', flush=True)\n"
        "        os._exit(0)\n"
        "    kids.append(pid)\n"
        "for pid in kids:\n"
        "    os.waitpid(pid, 0)\n"
    )
    result = one.run_python(code)
    assert result.stdout.count("held") <= 1, result
    assert result.limit == "memory", result


def test_proc_shows_only_the_sandbox(box):
    """Unmounting /proc (in the program's own namespaces, then as root in new ones) does not
    reveal the machine's processes or their command lines."""
    if box.isolation == "seccomp":
        pytest.skip("the seccomp isolation shares the machine's /proc (documented)")
    marker = f"hybridrl-marker-{uuid.uuid4().hex}"
    victim = sleeper(marker)
    first = "import ctypes\nprint('umount', ctypes.CDLL(None).umount2(b'/proc', 2) == 0)\n"
    try:
        code = first + hostile(
            "print('umount', libc.umount2(b'/proc', 2) == 0)\n"
            "needle = sys.argv[1][::-1].encode()\n"
            "for pid in filter(str.isdigit, os.listdir('/proc')):\n"
            "    try:\n"
            "        if needle in open(f'/proc/{pid}/cmdline', 'rb').read():\n"
            "            print('found', pid)\n"
            "    except OSError:\n"
            "        pass\n"
        )
        result = run_with_args(box, code, marker[::-1])  # reversed: not on its own command line
    finally:
        victim.kill()
        victim.wait()
    assert "found" not in result.stdout and "umount True" not in result.stdout, result


def test_kill_all_spares_other_processes_of_the_sandbox_user(box):
    """``kill(-1)`` signals every process the caller may signal: a process of the same user
    outside the call must survive it. The sandbox is told to run as that process's user."""
    if not ROOT:
        pytest.skip("needs root to run the sandbox and the bystander as another user")
    uid = next(n for n in range(40000 + os.getpid() % 20000, 70000) if _free_id(n))
    bystander = sleeper("bystander", user=uid, group=uid)
    try:
        one = make(box.isolation, uid=uid, gid=uid)
        result = one.run_python("import os, signal\nos.kill(-1, signal.SIGKILL)\nprint('done')")
        time.sleep(0.2)
        assert bystander.poll() is None, result
    finally:
        bystander.kill()
        bystander.wait()


def test_sandbox_user_cannot_signal_a_nobody_process(box):
    """As root the sandbox runs as a user of its own (not ``nobody``, which other services use):
    a ``nobody`` process outside the call cannot be signalled."""
    if not ROOT:
        pytest.skip("needs root to start a process as nobody")
    bystander = sleeper("bystander", user=65534, group=65534)
    try:
        code = (
            "import os, sys\n"
            "try:\n"
            "    os.kill(int(sys.argv[1]), 9); print('killed')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        )
        result = run_with_args(box, code, str(bystander.pid))
        time.sleep(0.2)
        assert bystander.poll() is None, result
    finally:
        bystander.kill()
        bystander.wait()


# -- A trainer that runs as a normal user ----------------------------------------------------

# Runs the trainer's side of a call in a separate interpreter (as the test user): loads the
# sandbox module from its file and prints the result as JSON.
DRIVER = r"""
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox_under_test", sys.argv[1])
module = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = module
spec.loader.exec_module(module)
cfg = json.loads(sys.argv[2])
try:
    box = module.Sandbox(module.Limits(**cfg["limits"]), isolation=cfg["isolation"])
except RuntimeError as e:
    print(json.dumps({"unavailable": str(e)})); sys.exit()
r = box.run(["{python}", "-I", "{workdir}/main.py", *cfg["args"]], {"main.py": cfg["code"]})
print(json.dumps({"stdout": r.stdout, "stderr": r.stderr}))
"""

TEST_UID, TEST_GROUP = 42421, 42422  # the test user (its own group has the same id)

USER_PROGRAM = hostile(
    "home, checkout, group_file, group_sock, victim = sys.argv[1:6]\n"
    "print('groups', os.getgroups())\n"
    "for path in (home + '/.bashrc', checkout + '/train.py'):\n"
    "    try:\n"
    "        open(path, 'a').write('\\nimport evil\\n'); print('wrote', path)\n"
    "    except OSError as e:\n"
    "        print('refused', path, e.errno)\n"
    "for path in (home + '/.netrc', group_file):\n"
    "    try:\n"
    "        print('read', path, open(path).read())\n"
    "    except OSError as e:\n"
    "        print('refused', path, e.errno)\n"
    "import socket\n"
    "try:\n"
    "    s = socket.socket(socket.AF_UNIX); s.connect(group_sock); print('connected')\n"
    "except OSError as e:\n"
    "    print('refused socket', e.errno)\n"
    "for pid in (-1, int(victim)):\n"
    "    try:\n"
    "        os.kill(pid, 9); print('killed', pid)\n"
    "    except OSError as e:\n"
    "        print('refused kill', pid, e.errno)\n"
    "print('end')\n",
)


def _free_id(n: int) -> bool:
    try:
        pwd.getpwuid(n)
    except KeyError:
        try:
            grp.getgrgid(n)
        except KeyError:
            return True
    return False


@pytest.fixture(scope="module", params=ISOLATIONS)
def as_normal_user(request):
    """The user program run by a trainer that is a normal user with a supplementary group, a
    home with ``~/.bashrc`` and ``~/.netrc``, and a checkout. Yields (result, paths, victim)."""
    isolation = request.param
    if ROOT:
        if not (_free_id(TEST_UID) and _free_id(TEST_GROUP)):
            pytest.skip("the test user's ids are taken on this machine")
        uid, gid, group = TEST_UID, TEST_UID, TEST_GROUP
        user = {"user": uid, "group": gid, "extra_groups": [group]}
        python = SYSTEM_PYTHON
        if python is None:
            pytest.skip("no system python3 for the test user")
    else:
        uid, gid = os.getuid(), os.getgid()
        others = [g for g in os.getgroups() if g != gid]
        group, user, python = (others[0] if others else None), {}, sys.executable
    base = tempfile.mkdtemp(prefix="sandbox-user-")
    os.chmod(base, 0o755)
    home, checkout = os.path.join(base, "home"), os.path.join(base, "checkout")
    secret = f"machine api.wandb.ai password {uuid.uuid4().hex}"
    for d in (home, checkout):
        os.mkdir(d, 0o755)
    Path(home, ".bashrc").write_text("# bashrc\n")
    Path(home, ".netrc").write_text(secret)
    Path(checkout, "train.py").write_text("# trainer\n")
    os.chmod(Path(home, ".netrc"), 0o600)
    group_file, group_sock = os.path.join(base, "group-only"), os.path.join(base, "group.sock")
    Path(group_file).write_text(f"group {secret}")
    server = socket.socket(socket.AF_UNIX)
    server.bind(group_sock)
    server.listen()
    os.chmod(group_file, 0o640)
    os.chmod(group_sock, 0o660)
    if ROOT:
        for root, dirs, files in os.walk(base):
            for n in [root, *(os.path.join(root, f) for f in dirs + files)]:
                os.chown(n, uid, gid)
        os.chown(base, 0, 0)
        for n in (group_file, group_sock):
            os.chown(n, 0, group)
    elif group is not None:
        for n in (group_file, group_sock):
            os.chown(n, -1, group)
    victim = sleeper("victim", **user)
    cfg = {
        "limits": {"cpu_s": 2, "wall_s": 5},
        "isolation": isolation,
        "code": USER_PROGRAM,
        "args": [home, checkout, group_file, group_sock, str(victim.pid)],
    }
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "WANDB_API_KEY": "secret"}
    driver = subprocess.run(
        [python, "-I", "-c", DRIVER, sandbox_module.__file__, json.dumps(cfg)],
        capture_output=True,
        text=True,
        env=env,
        cwd=checkout,
        timeout=60,
        **user,
    )
    time.sleep(0.2)
    alive = victim.poll() is None
    victim.kill()
    victim.wait()
    server.settimeout(0)
    try:
        server.accept()
        accepted = True
    except BlockingIOError:
        accepted = False
    server.close()
    paths = {"home": home, "checkout": checkout, "secret": secret, "group": group}
    paths["isolation"] = isolation
    yield driver, paths, alive, accepted
    shutil.rmtree(base, ignore_errors=True)


def _user_result(as_normal_user):
    driver, paths, alive, accepted = as_normal_user
    needs_file_isolation(paths["isolation"])
    assert driver.returncode == 0, driver.stderr
    result = json.loads(driver.stdout)
    if "unavailable" in result:
        pytest.skip(f"unavailable to a normal user: {result['unavailable']}")
    assert result["stdout"].endswith("end\n"), result
    return result, paths, alive, accepted


def test_trainer_files_not_writable_as_normal_user(as_normal_user):
    """The trainer's ``~/.bashrc`` and checkout (owned by the same user as the program, when the
    trainer is not root) stay as they were."""
    result, paths, _, _ = _user_result(as_normal_user)
    assert Path(paths["home"], ".bashrc").read_text() == "# bashrc\n", result
    assert Path(paths["checkout"], "train.py").read_text() == "# trainer\n", result
    assert "wrote" not in result["stdout"], result


def test_home_unreadable_as_normal_user(as_normal_user):
    """``~/.netrc`` (the trainer's tokens, mode 0600) is out of reach: no home directory."""
    result, paths, _, _ = _user_result(as_normal_user)
    assert paths["secret"] not in result["stdout"], result


def test_group_socket_and_files_unreachable_as_normal_user(as_normal_user):
    """A socket and a file open only to a supplementary group of the trainer (as the docker group
    opens ``/var/run/docker.sock``) are out of reach."""
    result, paths, _, accepted = _user_result(as_normal_user)
    if paths["group"] is None:
        pytest.skip("we have no supplementary group to test with")
    assert "connected" not in result["stdout"] and not accepted, result
    assert f"group {paths['secret']}" not in result["stdout"], result


def test_kill_all_spares_the_trainer_as_normal_user(as_normal_user):
    """``kill(-1)`` and a kill of a pid of the trainer's user leave the trainer's processes
    running."""
    result, _, alive, _ = _user_result(as_normal_user)
    assert alive, result


def test_supplementary_groups_dropped_as_root():
    """A root trainer's supplementary groups are not passed on to the program."""
    if not ROOT:
        pytest.skip("only root can drop supplementary groups")
    for isolation in ISOLATIONS:
        cfg = {"limits": {}, "isolation": isolation, "code": "import os; print(os.getgroups())"}
        cfg["args"] = []
        driver = subprocess.run(
            [SYSTEM_PYTHON or sys.executable, "-I", "-c", DRIVER, sandbox_module.__file__]
            + [json.dumps(cfg)],
            capture_output=True,
            text=True,
            extra_groups=[TEST_GROUP],
            timeout=60,
        )
        result = json.loads(driver.stdout)
        if "unavailable" not in result:
            assert result["stdout"] == "[]\n", (isolation, result)


# -- Limits and properties that held before ---------------------------------------------------


def test_runs_code_and_reports_exit_status(box):
    ok = box.run_python("import sys; print('hi'); print('err', file=sys.stderr)")
    assert (ok.stdout, ok.stderr, ok.exit_code, ok.limit) == ("hi\n", "err\n", 0, None)
    assert box.run_python("raise SystemExit(3)").exit_code == 3
    killed = box.run_python("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert (killed.exit_code, killed.killed_by_signal) == (None, 15)
    assert box.run_python("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"
    assert ok.isolation == box.isolation


def test_network_connection_fails(box):
    """A server listening on this machine's loopback, which any unsandboxed process could reach,
    is out of reach: the namespace's loopback is down (ENETUNREACH), or socket() is refused
    (EACCES)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "    print('connected')\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
        )
        result = box.run_python(code)
        server.settimeout(0)
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing came in
    expected = errno.ENETUNREACH if box.isolation == "namespaces" else errno.EACCES
    assert result.stdout == f"refused {expected}\n", result


def test_memory_limit(box):
    result = box.run_python("x = bytearray(400 * 1024 * 1024); print('allocated')")
    assert "allocated" not in result.stdout
    assert (result.exit_code, result.limit) == (1, "memory"), result
    assert box.run_python("x = bytearray(50 * 1024 * 1024); print(len(x))").exit_code == 0


def test_infinite_loop_killed_at_cpu_limit(box):
    """The CPU limit fires first, however loaded the machine (the wall limit is far off)."""
    one = make(box.isolation, Limits(cpu_s=1, wall_s=20))
    result = one.run_python("while True: pass")
    assert result.limit == "cpu" and result.killed_by_signal is not None, result


def test_sleeping_program_killed_at_wall_limit():
    box = make(limits=Limits(wall_s=1.5))
    result = box.run_python("import time; print('start', flush=True); time.sleep(60)")
    assert result.timed_out and result.limit == "wall" and result.killed_by_signal == 9
    assert result.stdout == "start\n"  # what came before the kill is kept
    assert 1.5 <= result.wall_s < 4.0


def test_fork_bomb_contained_and_killed(box):
    """A fork bomb never exceeds the process limit and leaves no process behind. A marker on the
    program's command line (which every fork keeps) is how its processes are found."""
    marker = f"hybridrl-bomb-{uuid.uuid4().hex}"
    one = make(box.isolation, limits=Limits(cpu_s=1, wall_s=2.0, max_procs=8))
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(processes_matching(marker)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    try:
        result = run_with_args(one, bomb, marker)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out and result.limit == "wall", result
    # It did fork, and no more than the limit allows. Outside the namespaces, a normal user's
    # count is machine-wide, less what that user ran when the call began: others may end since.
    slack = 0 if box.isolation == "namespaces" or ROOT or one.cgroup else 4
    assert 3 <= peak[0] <= 8 + slack, peak
    assert processes_matching(marker) == []


def test_background_process_does_not_outlive_the_run(box):
    marker = f"hybridrl-child-{uuid.uuid4().hex}"
    escape = "import os, time\ntry:\n    os.setsid()\nexcept OSError:\n    pass\ntime.sleep(60)"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {escape!r}, sys.argv[1]])\n"
        "print('left a child')\n"
    )
    result = run_with_args(box, code, marker)
    assert result.exit_code == 0 and result.stdout == "left a child\n", result
    time.sleep(0.1)
    assert processes_matching(marker) == []


def test_writes_through_links_fail(box, reachable_tmp):
    """A world-writable file outside the private directory cannot be written through a symbolic
    or a hard link made inside it."""
    needs_file_isolation(box.isolation)
    target = os.path.join(reachable_tmp, "target")
    Path(target).write_text("original")
    os.chmod(target, 0o666)
    code = (
        "import os, sys\n"
        "os.symlink(sys.argv[1], 'soft')\n"
        "for make_link, name in ((None, 'soft'), (os.link, 'hard')):\n"
        "    try:\n"
        "        if make_link:\n"
        "            make_link(sys.argv[1], name)\n"
        "        open(name, 'w').write('escaped'); print('wrote', name)\n"
        "    except OSError as e:\n"
        "        print('refused', name, e.errno)\n"
    )
    result = run_with_args(box, code, target)
    assert Path(target).read_text() == "original", result
    assert result.stdout.count("refused") == 2, result


def test_private_dir_is_the_cwd_and_is_removed(box, reachable_tmp):
    one = make(box.isolation, tmp_root=reachable_tmp)
    code = (
        "import os; open('f', 'w').write('x'); os.mkdir('d'); os.chmod('d', 0); print(os.getcwd())"
    )
    result = one.run_python(code)
    assert result.exit_code == 0, result
    assert result.stdout.strip() == result.workdir
    assert os.listdir(reachable_tmp) == []


def test_output_is_capped():
    box = make(limits=Limits(output_bytes=1000))
    result = box.run_python("import sys; print('x' * 10**6); print('y' * 10**6, file=sys.stderr)")
    assert (len(result.stdout), len(result.stderr)) == (1000, 1000)
    assert result.truncated and result.limit == "output" and result.exit_code == 0


def test_file_size_limit(box):
    result = box.run_python("open('big', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert (result.exit_code, result.limit) == (1, "file_size"), result


def test_environment_is_scrubbed(box, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", "hunter2")
    result = box.run_python("import os; print(sorted(os.environ))")
    assert "HYBRIDRL_TEST_SECRET" not in result.stdout and "PATH" in result.stdout


def test_concurrent_runs_are_independent(box):
    async def both():
        return await asyncio.gather(
            box.arun_python("import time; time.sleep(0.3); print(1)"),
            box.arun_python("import time; time.sleep(0.3); print(2)"),
        )

    start = time.monotonic()
    results: list[SandboxResult] = asyncio.run(both())
    assert [r.stdout for r in results] == ["1\n", "2\n"]
    assert time.monotonic() - start < sum(r.wall_s for r in results)  # they overlapped


def test_no_interrupt_leaves_processes(box):
    """A caller interrupted mid-run (an exception in the waiting thread) leaves nothing running."""
    marker = f"hybridrl-interrupted-{uuid.uuid4().hex}"
    # Python's own SIGINT handler, whatever this process inherited (a job started in the
    # background of a non-interactive shell ignores SIGINT, and Python then keeps ignoring it)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            run_with_args(box, "import time; time.sleep(30)", marker)
    finally:
        timer.join()
        signal.signal(signal.SIGINT, inherited)
    time.sleep(0.1)
    assert processes_matching(marker) == []


def test_caller_death_ends_the_call(box):
    """A trainer killed mid-call (SIGKILL: no cleanup of its own) takes the call's program with
    it."""
    marker = f"hybridrl-orphan-{uuid.uuid4().hex}"
    script = (
        "import importlib.util, sys\n"
        "spec = importlib.util.spec_from_file_location('sandbox_under_test', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec)\n"
        "sys.modules[spec.name] = module\n"
        "spec.loader.exec_module(module)\n"
        "box = module.Sandbox(module.Limits(wall_s=60), isolation=sys.argv[2])\n"
        "box.run(['{python}', '-I', '-c', 'import time; time.sleep(60)', sys.argv[3]])\n"
    )
    args = [sandbox_module.__file__, box.isolation, marker]
    trainer = subprocess.Popen([sys.executable, "-I", "-c", script, *args])
    try:
        deadline = time.monotonic() + 20
        while not processes_matching(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert processes_matching(marker), "the program never started"
    finally:
        trainer.kill()
        trainer.wait()
    deadline = time.monotonic() + 2
    while processes_matching(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert processes_matching(marker) == []


def test_cgroup_directories_found_from_proc():
    """The call's cgroups are made next to this process's own: the v2 directory under its mount
    (also a bind mount of a subtree, as in a container) and the v1 memory and pids ones."""
    v2_host = "0::/user.slice/user-1000.slice/session-2.scope\n"
    mounts = "35 24 0:30 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert sandbox_module._cgroup_dirs(v2_host, mounts) == {
        "": ("/sys/fs/cgroup/user.slice/user-1000.slice/session-2.scope", "/sys/fs/cgroup")
    }
    bound = "35 24 0:30 /docker/abc /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"
    found = sandbox_module._cgroup_dirs("0::/docker/abc/init\n", bound)
    assert found == {"": ("/sys/fs/cgroup/init", "/sys/fs/cgroup")}
    assert sandbox_module._cgroup_dirs("0::/elsewhere\n", bound) == {}
    v1 = "8:pids:/\n4:memory:/jobs/7\n1:cpu,cpuacct:/\n0::/\n"
    v1_mounts = (
        "40 30 0:40 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
        "41 30 0:41 / /sys/fs/cgroup/pids rw - cgroup cgroup rw,pids\n"
        "42 30 0:42 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu,cpuacct\n"
    )
    assert sandbox_module._cgroup_dirs(v1, v1_mounts) == {
        "memory": ("/sys/fs/cgroup/memory/jobs/7", "/sys/fs/cgroup/memory"),
        "pids": ("/sys/fs/cgroup/pids", "/sys/fs/cgroup/pids"),
    }
