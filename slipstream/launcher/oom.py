"""Was a SIGKILLed rank killed by the kernel's OOM killer? Say so only with evidence.

Two places can tell, when readable: the memory cgroup's OOM-kill counter (cgroup v2
``memory.events``, or v1 ``memory.oom_control``), compared with its value when the job started,
and the kernel log (``dmesg``), which names the killed pid. In containers and for non-root users
both are often unreadable; then the note says that SIGKILL usually means out of memory but that it
could not be confirmed.
"""

from __future__ import annotations

import os
import re
import subprocess


def _cgroup_oom_files() -> list[str]:
    paths: list[str] = []
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as file:
            lines = file.read().splitlines()
    except OSError:
        return paths
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2
            paths.append(os.path.join("/sys/fs/cgroup", path.lstrip("/"), "memory.events"))
        elif "memory" in controllers.split(","):
            for root in ("/sys/fs/cgroup/memory", "/sys/fs/cgroup/memory,memsw"):
                paths.append(os.path.join(root, path.lstrip("/"), "memory.oom_control"))
                paths.append(os.path.join(root, "memory.oom_control"))  # a container sees its own at the root
    return paths


def oom_kill_count() -> int | None:
    """The OOM-kill counter of this process's memory cgroup, or None when none is readable."""
    for path in _cgroup_oom_files():
        try:
            with open(path, encoding="utf-8") as file:
                match = re.search(r"^oom_kill (\d+)$", file.read(), re.MULTILINE)
        except OSError:
            continue
        if match:
            return int(match.group(1))
    return None


def _dmesg_mentions(pid: int) -> bool | None:
    """True if the kernel log records the OOM killer killing ``pid``; None when it cannot be read."""
    try:
        done = subprocess.run(["dmesg"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    pattern = re.compile(rf"(Out of memory|oom-kill|Memory cgroup out of memory).*\b(Killed process |pid=){pid}\b")
    return any(pattern.search(line) for line in done.stdout.splitlines()[-2000:])


def sigkill_note(pid: int | None, oom_kills_at_start: int | None) -> str:
    """A parenthesised, honest explanation for a rank that died of SIGKILL."""
    now = oom_kill_count()
    if oom_kills_at_start is not None and now is not None and now > oom_kills_at_start:
        return (
            f"(out of memory: the OOM killer ran in this job's memory cgroup, oom_kill {oom_kills_at_start} -> {now})"
        )
    in_log = _dmesg_mentions(pid) if pid else None
    if in_log:
        return f"(out of memory: the kernel log records the OOM killer killing pid {pid})"
    if now is None and in_log is None:
        return (
            "(likely out of memory if nothing else killed it; dmesg and the cgroup's OOM counter are not readable here)"
        )
    return "(no OOM-killer record for it in the memory cgroup or dmesg: probably killed by something else)"
