"""The sandbox: each test runs hostile code and checks the limit or isolation that stops it, and
that nothing of it is left on the machine afterwards."""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from hybridrl.envs.sandbox import Limits, Sandbox, SandboxResult

REPO = Path(__file__).resolve().parents[1]
TIGHT = Limits(cpu_s=1, wall_s=3.0, memory_mb=256, file_size_mb=1, max_procs=8, open_files=32)


def make(isolation: str = "auto", limits: Limits = TIGHT, **kw) -> Sandbox:
    try:
        return Sandbox(limits, isolation=isolation, **kw)
    except RuntimeError as e:
        pytest.skip(f"{isolation} isolation unavailable here: {e}")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return make()


@pytest.fixture
def reachable_tmp():
    """A fresh directory under the system temp dir that the sandbox user can reach (pytest's
    tmp_path sits in a directory only its owner may enter)."""
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


def test_runs_code_and_reports_exit_status(sandbox):
    ok = sandbox.run_python("import sys; print('hi'); print('err', file=sys.stderr)")
    assert (ok.stdout, ok.stderr, ok.exit_code, ok.limit) == ("hi\n", "err\n", 0, None)
    assert sandbox.run_python("raise SystemExit(3)").exit_code == 3
    killed = sandbox.run_python("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert (killed.exit_code, killed.killed_by_signal) == (None, 15)
    assert sandbox.run_python("print(input()[::-1])", stdin="abc\n").stdout == "cba\n"


@pytest.mark.parametrize("isolation", ["namespaces", "seccomp"])
def test_network_connection_fails(isolation):
    """A server listening on this machine's loopback, which any unsandboxed process could reach,
    is out of reach: the namespace's loopback is down (ENETUNREACH), or socket() is refused
    (EACCES)."""
    box = make(isolation)
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
    assert result.isolation == isolation
    expected = {"namespaces": errno.ENETUNREACH, "seccomp": errno.EACCES}[isolation]
    assert result.stdout == f"refused {expected}\n", result


def test_memory_limit(sandbox):
    result = sandbox.run_python("x = bytearray(400 * 1024 * 1024); print('allocated')")
    assert "allocated" not in result.stdout
    assert (result.exit_code, result.limit) == (1, "memory"), result
    assert sandbox.run_python("x = bytearray(50 * 1024 * 1024); print(len(x))").exit_code == 0


def test_infinite_loop_killed_at_cpu_limit(sandbox):
    result = sandbox.run_python("while True: pass")
    assert result.limit == "cpu" and result.killed_by_signal is not None, result
    assert result.wall_s < TIGHT.wall_s + 1


def test_sleeping_program_killed_at_wall_limit():
    box = make(limits=Limits(wall_s=1.5))
    result = box.run_python("import time; print('start', flush=True); time.sleep(60)")
    assert result.timed_out and result.limit == "wall" and result.killed_by_signal == 9
    assert result.stdout == "start\n"  # what came before the kill is kept
    assert 1.5 <= result.wall_s < 4.0


@pytest.mark.parametrize("isolation", ["namespaces", "seccomp"])
def test_fork_bomb_contained_and_killed(isolation, reachable_tmp):
    """A fork bomb never exceeds the process limit and leaves no process behind. The private
    directory's path is on every sandbox process's command line, which is how they are found."""
    limits = Limits(cpu_s=1, wall_s=1.0, max_procs=8)
    box = make(isolation, limits=limits, tmp_root=reachable_tmp)
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], len(processes_matching(reachable_tmp)))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    try:
        result = box.run_python(bomb)
    finally:
        done.set()
        watcher.join()
    assert result.timed_out and result.limit == "wall", result
    assert 3 <= peak[0] <= 8, peak  # it did fork, and no more than the limit allows
    assert processes_matching(reachable_tmp) == []


@pytest.mark.parametrize("isolation", ["namespaces", "seccomp"])
def test_background_process_does_not_outlive_the_run(isolation, reachable_tmp):
    box = make(isolation, tmp_root=reachable_tmp)
    escape = "import os, time\ntry:\n    os.setsid()\nexcept OSError:\n    pass\ntime.sleep(60)"
    code = (
        "import subprocess, sys\n"
        f"subprocess.Popen([sys.executable, '-c', {escape!r}])\n"
        "print('left a child')\n"
    )
    result = box.run_python(code)
    assert result.exit_code == 0 and result.stdout == "left a child\n"
    assert processes_matching(reachable_tmp) == []


def test_writes_outside_the_private_dir_fail(sandbox, reachable_tmp):
    if sandbox.isolation != "namespaces":
        pytest.skip("only the mount namespace makes the rest of the file system read-only")
    targets = [
        os.path.join(reachable_tmp, "escaped"),  # world-writable on the host
        str(REPO / f"escaped-{uuid.uuid4().hex}"),
        f"/dev/shm/escaped-{uuid.uuid4().hex}",
        f"{tempfile.gettempdir()}/escaped-{uuid.uuid4().hex}",
    ]
    os.chmod(reachable_tmp, 0o777)
    code = (
        "import sys\n"
        "for path in sys.argv[1:]:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('refused', e.errno)\n"
        "open('inside.txt', 'w').write('fine'); print('inside ok')\n"
    )
    result = sandbox.run(["{python}", "-I", "{workdir}/main.py", *targets], {"main.py": code})
    assert result.stdout.count("refused 30") == len(targets), result  # EROFS
    assert "inside ok" in result.stdout
    assert not any(os.path.exists(t) for t in targets)


def test_private_dir_is_the_cwd_and_is_removed(sandbox):
    code = (
        "import os; open('f', 'w').write('x'); os.mkdir('d'); os.chmod('d', 0); print(os.getcwd())"
    )
    result = sandbox.run_python(code)
    assert result.exit_code == 0, result
    assert result.stdout.strip() == result.workdir
    assert not os.path.exists(result.workdir)


def test_output_is_capped():
    box = make(limits=Limits(output_bytes=1000))
    result = box.run_python("import sys; print('x' * 10**6); print('y' * 10**6, file=sys.stderr)")
    assert (len(result.stdout), len(result.stderr)) == (1000, 1000)
    assert result.truncated and result.limit == "output" and result.exit_code == 0


def test_file_size_limit(sandbox):
    result = sandbox.run_python("open('big', 'wb').write(b'x' * (2 * 1024 * 1024))")
    assert (result.exit_code, result.limit) == (1, "file_size"), result


def test_environment_is_scrubbed(sandbox, monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", "hunter2")
    result = sandbox.run_python("import os; print(sorted(os.environ))")
    assert "HYBRIDRL_TEST_SECRET" not in result.stdout and "PATH" in result.stdout


def test_concurrent_runs_are_independent(sandbox):
    async def both():
        import asyncio

        return await asyncio.gather(
            sandbox.arun_python("import time; time.sleep(0.3); print(1)"),
            sandbox.arun_python("import time; time.sleep(0.3); print(2)"),
        )

    import asyncio

    start = time.monotonic()
    results: list[SandboxResult] = asyncio.run(both())
    assert [r.stdout for r in results] == ["1\n", "2\n"]
    assert results[0].workdir != results[1].workdir
    assert time.monotonic() - start < 1.5  # they overlapped
