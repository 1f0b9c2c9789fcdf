"""Run a runner's commands (ssh per host, or one pdsh/srun/mpirun) and stop them together.

The agents on the nodes report their own ranks' failures (rank, host, signal, traceback tail);
this level says which *node* failed first and stops the rest:

* ssh: each agent's stdin is a pipe from here. Closing it makes the remote agent terminate its
  ranks (``--exit_on_stdin_close``), the same path as Ctrl-C. ssh processes that are still alive
  after a grace period get SIGTERM, then SIGKILL, by process id; nothing is matched by name.
* pdsh, srun (``--kill-on-bad-exit``) and mpirun stop the other nodes themselves; SIGINT/SIGTERM
  given to the launcher is passed on to them.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from slipstream.launcher.agent import PREFIX

STOP_GRACE_S = 20.0  # for the other nodes' agents to stop their ranks after their stdin closed
POLL_S = 0.1


@dataclass
class _Node:
    label: str
    process: subprocess.Popen


@dataclass
class _Signals:
    received: list[int] = field(default_factory=list)


def run(runner: str, argvs: list[list[str]], labels: list[str]) -> int:
    """Start every command, wait, return 0 or the exit code of the node that failed first."""
    watch_stdin = runner == "ssh"
    signals = _Signals()
    try:
        processes = [subprocess.Popen(argv, stdin=subprocess.PIPE if watch_stdin else None) for argv in argvs]
    except FileNotFoundError as err:
        _say(f"--launcher {runner}: {err.filename} is not installed or not on PATH")
        return 127
    nodes = [_Node(label, process) for label, process in zip(labels, processes, strict=True)]
    with _forward_signals(signals, nodes, watch_stdin):
        while True:
            if signals.received:
                _stop(nodes, watch_stdin)
                return 128 + signals.received[0]
            failed = next((n for n in nodes if n.process.poll() not in (None, 0)), None)
            if failed is not None:
                code = failed.process.returncode
                if len(nodes) > 1:
                    _say(f"{failed.label} failed first ({_how(runner, code)}); stopping the other nodes")
                elif code == 255 and runner == "ssh":
                    _say(f"{failed.label}: {_how(runner, code)}")
                _stop([n for n in nodes if n is not failed], watch_stdin)
                return code if code > 0 else 128 - code
            if all(n.process.poll() == 0 for n in nodes):
                return 0
            time.sleep(POLL_S)


def _how(runner: str, code: int) -> str:
    if code < 0:
        return f"{runner} was killed by signal {signal.Signals(-code).name}"
    if runner == "ssh" and code == 255:
        return "exit code 255: ssh could not connect or authenticate, see its message above"
    if code > 128:
        try:
            return f"exit code {code}: a rank was killed by signal {signal.Signals(code - 128).name}"
        except ValueError:
            pass
    return f"exit code {code}"


def _stop(nodes: list[_Node], watch_stdin: bool) -> None:
    alive = [n for n in nodes if n.process.poll() is None]
    for node in alive:
        if watch_stdin and node.process.stdin is not None:
            try:
                node.process.stdin.close()  # the remote agent terminates its ranks
            except OSError:
                pass
        else:
            node.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for node in alive:
        try:
            node.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            node.process.terminate()
    for node in alive:
        try:
            node.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            node.process.kill()
            node.process.wait()
    if alive:
        _say(f"stopped {', '.join(n.label for n in alive)}")


@contextmanager
def _forward_signals(signals: _Signals, nodes: list[_Node], watch_stdin: bool) -> Iterator[None]:
    """Ctrl-C / SIGTERM stop the nodes through the same path as a failure (see _stop)."""

    def handler(signum: int, frame: object) -> None:
        if signum not in signals.received:
            _say(f"received {signal.Signals(signum).name}; stopping all nodes")
        signals.received.append(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        for node in nodes:  # never leave a runner process behind, whatever happened above
            if node.process.poll() is None:
                node.process.kill()
                node.process.wait()


def _say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)
