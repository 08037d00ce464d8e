"""What the driver says when a Ray rank dies.

Ray reports an actor's death as an ``ActorDiedError`` whose text mixes the cause with boilerplate
and cannot name a signal, and the dead rank's peers often fail first, with connection errors that
are only a consequence. The driver's :class:`~hybridrl.controller.worker.WorkerDiedError` must say
which rank died, where it ran, why in plain words, and what its peers did meanwhile. Reading Ray's
report into that is a concern of its own, apart from launching the actors and calling them
(``controller/ray_backend.py``), and is tested on its own (:func:`exit_cause`).
"""

from __future__ import annotations

import re

from hybridrl.controller.worker import WorkerDiedError, describe_exception


def died_error(
    role: str,
    rank: int,
    method: str,
    err: BaseException,
    where: tuple | None,
    failed: dict[int, BaseException],
    unawaited: list[int],
) -> WorkerDiedError:
    """The error naming dead ``rank`` of ``role`` in ``method``: where it ran (``where``: its
    ``(node id, ip, port, pid)``, or None when it died before saying), why it died (from Ray's
    report ``err``), what its peers did meanwhile (``failed``: the ranks that raised;
    ``unawaited``: the ranks still running)."""
    report = str(getattr(err, "error_msg", "") or err)
    if where is not None:
        node_id, ip, _, pid = where
    else:  # died before it could say where it runs: Ray's report names pid and ip
        node_id, found = "?", dict(re.findall(r"^\t(pid|ip): (\S+)$", report, re.M))
        pid, ip = found.get("pid", "?"), found.get("ip", "?")
    lines = [
        f"  rank {r} failed too, most likely because its peer died: "
        f"{_first_line(describe_exception(_cause(e)))}"
        for r, e in sorted(failed.items())
    ]
    lines += [
        f"  rank {r}: not awaited (it may be blocked in a collective with the dead rank)"
        for r in unawaited
    ]
    lines += [
        f"  node id {node_id}; Ray's report:",
        *("    " + line.strip() for line in report.splitlines() if line.strip()),
    ]
    return WorkerDiedError(
        role,
        rank,
        method,
        exit_cause(report),
        f"pid {pid} on node {ip}, node id {node_id[:12]}",
        "\n".join(lines),
    )


def _cause(err: BaseException) -> BaseException:
    cause = getattr(err, "cause", None)
    return cause if isinstance(cause, BaseException) else err


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def exit_cause(report: str) -> str:
    """A short cause of an actor's death from Ray's report (``ActorDiedError`` text), in plain words
    first. Ray cannot name a signal: a process that vanished shows as a dropped connection."""
    text = " ".join(
        line.strip() for line in report.splitlines() if line.strip() and not line.startswith("\t")
    )
    text = re.split(r" (?:Some common causes|There are some potential root causes)", text)[0]
    text = text.replace("The actor died unexpectedly before finishing this task. ", "")
    found = re.search(r"Worker exit type: (\w+) Worker exit detail: (.*)", text)
    ray_says = f"{found.group(1)}: {found.group(2)}" if found else text
    low = text.lower()
    if "memory" in low:
        plain = "out of memory"
    elif "ray.kill" in low:
        plain = "killed by ray.kill"
    elif "node" in low and (
        "has died" in low or "node died" in low or "is dead because its node" in low
    ):
        plain = "its node was lost"
    elif "connection error" in low or "end of file" in low:
        plain = (
            "its process vanished "
            "(killed by a signal such as SIGKILL or the OOM killer, or crashed)"
        )
    else:
        plain = "its process exited"
    return f"{plain} [Ray: {ray_says}]"
