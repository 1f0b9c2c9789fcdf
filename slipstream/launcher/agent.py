"""The per-node agent: launch this node's ranks of a training script, torchrun-style.

Process management (spawning, watching, restarts, tearing the survivors down when a rank dies,
forwarding SIGTERM/SIGINT) is torch elastic's ``LocalElasticAgent``; this module only chooses its
settings and turns its failure report into one readable line per failed rank, with the tail of
its traceback (recorded by ``worker.py``) and, for SIGKILL, whether the OOM killer did it.

One node is the whole job by default; with ``num_nodes > 1`` this is one node of a multi-node
job (started on every node by a runner, see ``runners.py``, or by hand like torchrun).

torch is imported inside ``launch`` only, so importing this module stays cheap.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.launcher.flight_report import exit_description, report_failed_attempt, run_directory
from slipstream.launcher.oom import oom_kill_count, sigkill_note

PREFIX = "slipstream run:"


@dataclass(frozen=True)
class LocalLaunch:
    """What to run and how; ``None`` means "choose at launch" (see ``launch``)."""

    script: str
    script_args: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    max_restarts: int = 0
    num_nodes: int = 1
    node_rank: int = 0
    exit_on_stdin_close: bool = False  # the runner's ssh went away: stop this node's ranks

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1


def launch(spec: LocalLaunch) -> int:
    """Run ``spec.script`` in ``nproc_per_node`` local processes; return the exit code for the shell.

    0 when every rank succeeded; otherwise the first failed rank's exit code (128 + signal number
    when it was killed by a signal), after printing which ranks failed and how.
    """
    nproc = spec.nproc_per_node or default_nproc_per_node()
    oom_kills_at_start = oom_kill_count()

    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # [Note: rendezvous choice]
    # Without --master_port we use the c10d rendezvous on port 0: the agent binds a TCPStore to a
    # port the OS picks and hands that very port to the workers as MASTER_PORT, so two concurrent
    # runs cannot collide and there is no probe-then-bind race. With --master_port the static
    # rendezvous binds exactly that port. local_addr makes MASTER_ADDR the address we were given
    # instead of the machine's FQDN.
    # Several nodes use the static rendezvous too: node N's ranks are N * nproc + local rank, in
    # hostfile order, as DeepSpeed users expect (c10d would order nodes by host name and pid).
    # Node 0's agent hosts the store on --master_port; every node must use the same run id.
    # After a failure each agent restarts its own ranks; the other nodes' ranks notice the dead
    # peer (a closed connection, or at worst comms_timeout_seconds) and restart too, so all nodes
    # meet again in the next attempt.
    run_id = uuid.uuid4().hex
    if spec.multi_node:
        assert spec.master_port is not None, "the CLI requires --master_port with several nodes"
        run_id = f"slipstream-{spec.master_port}"
        backend, endpoint = "static", f"{spec.master_addr}:{spec.master_port}"
        rdzv_configs = {"rank": spec.node_rank, "timeout": RENDEZVOUS_TIMEOUT_S}
    elif spec.master_port is None:
        backend, endpoint, rdzv_configs = "c10d", f"{spec.master_addr}:0", {"is_host": True}
    else:
        backend, endpoint, rdzv_configs = "static", f"{spec.master_addr}:{spec.master_port}", {"rank": 0}
    who = _Describer(spec, nproc, oom_kills_at_start)

    # The agent writes per-rank error files (and, if asked, logs) under log_dir; by default it
    # leaves a torchelastic_* directory in /tmp on every run, so we own and remove it.
    with (
        tempfile.TemporaryDirectory(prefix="slipstream_run_") as log_dir,
        run_directory(run_id) as flight_dir,
        _rank_defaults(nproc),
        _quiet_torch_elastic(who, flight_dir, nproc * spec.num_nodes),
        _exit_on_stdin_close(spec.exit_on_stdin_close),
    ):
        config = LaunchConfig(
            min_nodes=spec.num_nodes,
            max_nodes=spec.num_nodes,
            nproc_per_node=nproc,
            run_id=run_id,
            rdzv_backend=backend,
            rdzv_endpoint=endpoint,
            rdzv_configs=rdzv_configs,
            max_restarts=spec.max_restarts,
            local_addr=None if spec.multi_node else spec.master_addr,
            logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        )
        # -u as torchrun does: ranks' output reaches the terminal as it is written. The worker
        # module runs the script as __main__ and records an uncaught exception for the report.
        entrypoint_args = ["-u", "-m", "slipstream.launcher.worker", spec.script, *spec.script_args]
        try:
            elastic_launch(config, sys.executable)(*entrypoint_args)
        except ChildFailedError as err:
            return _report_failures(err.failures, who)
        except SignalException as err:
            _say(f"{who.node}stopped by {err.sigval.name}; all ranks were terminated")
            return 128 + int(err.sigval)
        except Exception as err:  # rendezvous/store errors: the job never started
            _say(f"{who.node}could not start the job: {_startup_error(err, spec)}")
            return 1
    return 0


def agent_command_line(spec: LocalLaunch, env: dict[str, str]) -> str:
    """What ``--dry_run`` prints for a run on this node: the agent's exact command line."""
    import shlex

    argv = [sys.executable, "-m", "slipstream.launcher.cli", "run", "--launcher", "local"]
    if spec.multi_node:
        argv += ["--num_nodes", str(spec.num_nodes), "--node_rank", str(spec.node_rank)]
    if spec.nproc_per_node is not None:
        argv += ["--nproc_per_node", str(spec.nproc_per_node)]
    argv += ["--master_addr", spec.master_addr]
    if spec.master_port is not None:
        argv += ["--master_port", str(spec.master_port)]
    if spec.max_restarts:
        argv += ["--max_restarts", str(spec.max_restarts)]
    argv += [spec.script, *spec.script_args]
    prefix = ["env", *(f"{key}={value}" for key, value in env.items())] if env else []
    return f"# node {spec.node_rank} (this machine)\n{shlex.join(prefix + argv)}"


def default_nproc_per_node() -> int:
    """One process per visible CUDA device, or 1 without CUDA (imports torch: call at launch only)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


RENDEZVOUS_TIMEOUT_S = 900  # how long node agents wait for each other (nodes boot at different speeds)
TRACEBACK_LINES = 10  # of a failed rank's traceback (its innermost frames), printed under its failure line


def describe_failure(rank: int, local_rank: int, exitcode: int, host: str | None = None, note: str = "") -> str:
    """``rank 1 (local rank 1) exited with code 3`` or ``... was killed by signal SIGKILL``.

    With ``host`` (a multi-node job) the rank is placed: ``rank 5 (local rank 1 on node-b)``.
    ``note`` follows a signal name (the OOM explanation for SIGKILL).
    """
    who = f"rank {rank} (local rank {local_rank}{f' on {host}' if host else ''})"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"number {-exitcode}"
        return f"{who} was killed by signal {name}" + (f" {note}" if note else "")
    return f"{who} exited with code {exitcode}"


class _Describer:
    """Names ranks the way this node sees them: global rank, local rank, host when multi-node."""

    def __init__(self, spec: LocalLaunch, nproc: int, oom_kills_at_start: int | None) -> None:
        self.host = socket.gethostname() if spec.multi_node else None
        self.node = f"node {spec.node_rank} ({self.host}): " if spec.multi_node else ""
        self.rank_base = spec.node_rank * nproc  # the static rendezvous numbers nodes in order
        self.oom_kills_at_start = oom_kills_at_start

    def failure(self, rank: int | None, local_rank: int, exitcode: int, pid: int | None) -> str:
        note = sigkill_note(pid, self.oom_kills_at_start) if exitcode == -signal.SIGKILL else ""
        global_rank = rank if rank is not None else self.rank_base + local_rank
        return describe_failure(global_rank, local_rank, exitcode, self.host, note)


def _report_failures(failures: dict[int, Any], who: _Describer) -> int:
    # The agent's own report is a multi-line banner with a docs link; print one line per failed
    # rank instead, root cause first. A rank that only failed *because* another one did (its
    # collective saw the peer vanish, or the agent stopped it) comes after the ranks that failed on
    # their own: under load a survivor can record its CollectiveError before the agent notices the
    # SIGKILLed peer. Otherwise by time; timestamps have one-second resolution, so ties keep the
    # agent's order, which lists the ranks that failed before the ones it tore down afterwards.
    ordered = _root_cause_first(failures)
    root_rank, root = ordered[0]
    stopped: list[int] = []
    for i, (rank, failure) in enumerate(ordered):
        if i > 0 and failure.exitcode == -signal.SIGTERM:
            stopped.append(rank)  # the agent's SIGTERM to the survivors, not a failure of its own
            continue
        line = who.failure(rank, failure.local_rank, failure.exitcode, failure.pid)
        detail = _error_file_message(failure)
        _say(f"{who.node}{line}: {detail}" if detail else f"{who.node}{line}")
        tail = _traceback_tail(failure)
        if tail:
            print(tail, file=sys.stderr, flush=True)
    if stopped:
        ranks = ", ".join(str(r) for r in sorted(stopped))
        _say(f"{who.node}stopped the other rank(s) ({ranks}) with SIGTERM after rank {root_rank} failed")
    return 128 - root.exitcode if root.exitcode < 0 else (root.exitcode or 1)


def _root_cause_first(failures: dict[int, Any]) -> list[tuple[int, Any]]:
    """(rank, failure) pairs, the ranks that failed on their own first, then by time (see above)."""
    return sorted(failures.items(), key=lambda item: (_consequence_order(item[1]), item[1].timestamp))


PEER_FAILURE_MARK = "Another rank probably died"  # comm.collectives' wording for a collective a peer broke


def _consequence_order(failure: Any) -> int:
    """0: failed on its own; 1: a collective that failed because a peer went away (or took another path); 2: stopped
    by the agent (SIGTERM). A rank stopped by the agent is never the root: when every rank's error is a peer's
    (a rank that took another code path breaks the collective for all), a stopped rank recorded in the same second
    as the first to time out must not be reported as the failure, nor give the job its exit status 143."""
    if failure.exitcode == -signal.SIGTERM:
        return 2
    return 1 if PEER_FAILURE_MARK in _error_file_message(failure) else 0


def _error_file_message(failure: Any) -> str:
    """The exception a rank recorded (``worker.py`` or torch's ``@record``): its last line."""
    data = failure.error_file_data or {}
    message = data.get("message")
    if isinstance(message, dict):  # the structured form @record writes
        message = message.get("message")
    if not isinstance(message, str) or not message.strip() or message == "<NONE>":
        return ""
    return message.strip().splitlines()[-1]


def _traceback_tail(failure: Any) -> str:
    """The last lines of the rank's recorded traceback, indented under its failure line."""
    data = failure.error_file_data or {}
    message = data.get("message")
    extra = message.get("extraInfo") if isinstance(message, dict) else None
    stack = extra.get("py_callstack") if isinstance(extra, dict) else None
    if not isinstance(stack, str) or not stack.strip():
        return ""
    lines = stack.rstrip().splitlines()
    # The exception line itself is already on the failure line above; keep the frames before it.
    for end in range(len(lines), 0, -1):
        if lines[end - 1].startswith(("Traceback", "  ")):
            break
    lines = lines[:end][-TRACEBACK_LINES:]
    return "\n".join(f"    | {line}" for line in lines)


def _startup_error(err: Exception, spec: LocalLaunch) -> str:
    text = str(err)
    if spec.master_port is not None and ("EADDRINUSE" in text or "address already in use" in text.lower()):
        return (
            f"port {spec.master_port} on {spec.master_addr} is already in use; pass another "
            "--master_port, or omit it to let slipstream pick a free one"
        )
    return f"{type(err).__name__}: {text}"


@contextlib.contextmanager
def _rank_defaults(nproc: int) -> Iterator[None]:
    """Environment defaults for the ranks, each applied only where the user has not chosen.

    * ``OMP_NUM_THREADS``: share the cores between ranks; without it every rank starts one
      OpenMP thread per core and N ranks oversubscribe the machine N times over. A single rank
      keeps torch's own default.
    * ``THP_MEM_ALLOC_ENABLE=1`` (Linux): torch backs large CPU tensors with transparent huge
      pages. ZeRO-3 allocates a unit's storage at every gather; with 4 KiB pages each fresh
      12.6 MB buffer cost ~7 ms of page faults here, with huge pages ~3 ms. torch reads it once at
      start-up, so only the launcher can set it.

    The variables are restored afterwards so an in-process caller (tests) sees no change.
    """
    defaults = {}
    if "OMP_NUM_THREADS" not in os.environ and nproc > 1:
        threads = max(1, _usable_cores() // nproc)
        _say(f"OMP_NUM_THREADS={threads} for each of {nproc} ranks (set OMP_NUM_THREADS to override)")
        defaults["OMP_NUM_THREADS"] = str(threads)
    if sys.platform.startswith("linux") and "THP_MEM_ALLOC_ENABLE" not in os.environ:
        defaults["THP_MEM_ALLOC_ENABLE"] = "1"
    os.environ.update(defaults)
    try:
        yield
    finally:
        for key in defaults:
            del os.environ[key]


def _usable_cores() -> int:
    # Cores this process may run on (taskset, cgroup cpusets), not every core in the box.
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_AGENT_LOGGER = "torch.distributed.elastic.agent.server.api"
_PROCS_LOGGER = "torch.distributed.elastic.multiprocessing.api"


class _RestartNotice(logging.Filter):
    """Turns the agent's restart log into one line of ours and drops every record it sees.

    With --max_restarts the agent restarts all ranks after a failure and only says so at INFO,
    so the user would see the script's output twice with no explanation. As in
    ``_report_failures`` the root cause is named, not a consequence (see [Note: every failure of
    an attempt]).
    """

    def __init__(self, who: _Describer, flight_dir: Path | None = None, world: int = 0) -> None:
        super().__init__()
        self._who = who
        self._failures: list[tuple[int, str]] = []  # (exit code, description) logged since the last restart
        self._attempt_failures: dict[int, Any] = {}  # global rank -> ProcessFailure, from the agent's result
        self._flight_dir, self._world = flight_dir, world
        self._attempt = 0  # restarts so far: the ranks' TORCHELASTIC_RESTART_COUNT
        self._reported = False  # the flight report of this attempt is out

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if record.name == _PROCS_LOGGER and record.msg.startswith("Sending process") and not self._reported:
                self._report_flight(None)  # the teardown's first signal: the survivors still run, their rings are fresh
            elif record.name == _PROCS_LOGGER and record.msg.startswith("failed (exitcode"):
                exitcode, local_rank = int(record.args[0]), int(record.args[1])  # type: ignore[index]
                pid = int(record.args[2]) if len(record.args) > 2 else None  # type: ignore[arg-type,index]
                if not self._reported:  # no rank was left to stop
                    self._report_flight((local_rank, exitcode))
                self._failures.append((exitcode, self._who.failure(None, local_rank, exitcode, pid)))
            elif record.name == _AGENT_LOGGER and "will restart worker group" in record.msg:
                self._attempt += 1
                self._reported = False
                left, total = int(record.args[2]), int(record.args[3])  # type: ignore[index]
                ranks = "this node's ranks" if self._who.host else "all ranks"
                _say(f"{self._who.node}{self._cause()}; restarting {ranks} (restart {total - left + 1} of {total})")
                self._failures, self._attempt_failures = [], {}
        except (AttributeError, IndexError, TypeError, ValueError):
            pass  # another torch version worded it differently; staying quiet is fine
        return False

    def saw_failures(self, failures: dict[int, Any]) -> None:
        """Every failed rank of the attempt that just ended, as the agent's monitor returned them."""
        self._attempt_failures = dict(failures)

    def _cause(self) -> str:
        if self._attempt_failures:
            rank, failure = _root_cause_first(self._attempt_failures)[0]
            return self._who.failure(rank, failure.local_rank, failure.exitcode, failure.pid)
        # Only the agent's log to go by (a torch whose monitor we could not wrap).
        killed = [text for code, text in self._failures if code < 0 and code != -signal.SIGTERM]
        return (killed or [text for _, text in self._failures] or ["a rank failed"])[0]

    def _report_flight(self, failed: tuple[int, int] | None) -> None:
        """The hang report of this attempt, once, before the agent signals the survivors (see flight_report.py).

        ``failed``: (local rank, exit code) of the rank that failed, when the agent said so first."""
        self._reported = True
        if self._flight_dir is None:
            return
        try:
            exited = {self._who.rank_base + failed[0]: exit_description(failed[1])} if failed else {}
            lines = report_failed_attempt(self._flight_dir, self._attempt, self._world, exited)
        except Exception as err:  # noqa: BLE001 - the failure report itself must still print
            lines = [f"flight recorder: no report ({type(err).__name__}: {err})"]
        for line in lines:
            _say(f"{self._who.node}{line}")


@contextlib.contextmanager
def _quiet_torch_elastic(who: _Describer, flight_dir: Path | None = None, world: int = 0) -> Iterator[None]:
    """Mute torch elastic's launch-config dump, teardown warnings and failure banner.

    We print the failures (and restarts) ourselves. ``LOGLEVEL`` is torch elastic's own switch
    for its logs, so when the user sets it we leave them alone. Everything is restored afterwards.
    """
    if "LOGLEVEL" in os.environ:
        yield
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    # Older torch sets a level on each module's logger, newer leaves them NOTSET under one parent.
    names = set(prefixes) | {name for name in logging.root.manager.loggerDict if name.startswith(prefixes)}
    levels = {name: logging.CRITICAL for name in names}
    levels[_AGENT_LOGGER] = levels[_PROCS_LOGGER] = logging.INFO  # seen by _RestartNotice only
    notice = _RestartNotice(who, flight_dir, world)
    saved = {name: logging.getLogger(name).level for name in levels}
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    for name in (_AGENT_LOGGER, _PROCS_LOGGER):
        logging.getLogger(name).addFilter(notice)
    try:
        with _failures_told_to(notice):
            yield
    finally:
        for name in (_AGENT_LOGGER, _PROCS_LOGGER):
            logging.getLogger(name).removeFilter(notice)
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


@contextlib.contextmanager
def _failures_told_to(notice: _RestartNotice) -> Iterator[None]:
    """Hand every failed attempt's failures to ``notice`` as the agent's monitor returns them.

    [Note: every failure of an attempt]
    When an attempt fails, the agent logs one "failed (exitcode ...)" record: the failure with the
    earliest timestamp, which has one-second resolution. Under load the rank whose collective lost
    a SIGKILLed peer can exit before the agent polls, carry the same second, and be the one logged,
    so the restart line named the survivor's CollectiveError, not the killed rank. The monitor's
    result holds every failure; ``_monitor_workers`` is the method torch elastic's agents
    override, so we wrap it for the launch and restore it afterwards. A torch without it leaves
    the log records as the only source.
    """
    try:
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
    except ImportError:
        yield
        return
    original = getattr(LocalElasticAgent, "_monitor_workers", None)
    if original is None:
        yield
        return

    def monitor(agent: Any, worker_group: Any) -> Any:
        result = original(agent, worker_group)
        failures = getattr(result, "failures", None)
        if failures:
            notice.saw_failures(failures)
        return result

    LocalElasticAgent._monitor_workers = monitor  # type: ignore[method-assign]
    try:
        yield
    finally:
        LocalElasticAgent._monitor_workers = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _exit_on_stdin_close(enabled: bool) -> Iterator[None]:
    """Stop this node's ranks when stdin reaches end of file.

    The ssh runner keeps a pipe open to every node's agent; when the launcher stops the job (or
    dies), the pipe closes, ssh passes the end of file on, and this agent sends itself SIGTERM:
    torch elastic's handler then terminates its ranks the same way as on Ctrl-C. No ``pkill``.
    """
    if enabled:

        def watch() -> None:
            try:
                while os.read(0, 4096):
                    pass
            except OSError:
                pass
            os.kill(os.getpid(), signal.SIGTERM)

        threading.Thread(target=watch, name="slipstream-stdin-watch", daemon=True).start()
    yield


def _say(message: str) -> None:
    print(f"{PREFIX} {message}", file=sys.stderr, flush=True)
