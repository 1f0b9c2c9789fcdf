"""The per-node agent: launch this node's ranks of a training script, torchrun-style.

Process management (spawning, watching, restarts, tearing the survivors down when a rank dies,
forwarding SIGTERM/SIGINT) is torch elastic's ``LocalElasticAgent``, run through a subclass that
reports at the methods its agents override ([Note: the agent's seams]); this module chooses its
settings and turns its failure report into one readable line per failed rank, with the tail of
its traceback (recorded by ``worker.py``) and, for SIGKILL, whether the OOM killer did it. No log
record of torch's is read and no class of torch's is patched.

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
    local_addr = None if spec.multi_node else spec.master_addr

    # The agent writes per-rank error files (and, if asked, logs) under log_dir; by default it
    # leaves a torchelastic_* directory in /tmp on every run, so we own and remove it.
    with (
        tempfile.TemporaryDirectory(prefix="slipstream_run_") as log_dir,
        run_directory(run_id) as flight_dir,
        _rank_defaults(nproc),
        _quiet_torch_elastic(),
        _exit_on_stdin_close(spec.exit_on_stdin_close),
    ):
        report = _AttemptReport(who, flight_dir, nproc * spec.num_nodes)
        rendezvous = _Rendezvous(backend, endpoint, run_id, spec.num_nodes, rdzv_configs, local_addr)
        # -u as torchrun does: ranks' output reaches the terminal as it is written. The worker
        # module runs the script as __main__ and records an uncaught exception for the report.
        entrypoint_args = ["-u", "-m", "slipstream.launcher.worker", spec.script, *spec.script_args]
        try:
            result = _run_agent(
                rendezvous, nproc, spec.max_restarts, entrypoint_args, DefaultLogsSpecs(log_dir), report
            )
        except SignalException as err:
            _say(f"{who.node}stopped by {err.sigval.name}; all ranks were terminated")
            return 128 + int(err.sigval)
        except Exception as err:  # rendezvous/store errors: the job never started
            _say(f"{who.node}could not start the job: {_startup_error(err, spec)}")
            return 1
        if result.is_failed():
            return _report_failures(result.failures, who)
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


@dataclass(frozen=True)
class _Rendezvous:
    """How this node's agent meets the others (see [Note: rendezvous choice])."""

    backend: str
    endpoint: str
    run_id: str
    num_nodes: int
    configs: dict[str, Any]
    local_addr: str | None


def _run_agent(
    rendezvous: _Rendezvous, nproc: int, max_restarts: int, args: list[str], logs_specs: Any, report: _AttemptReport
) -> Any:
    """Run torch elastic's agent (our subclass of it) until the job ends; its ``RunResult``.

    What torchrun's ``launch_agent`` does, less its event log, metrics and health-check server: the
    rendezvous handler, one worker spec, the agent, and the handler shut down at the end, except
    after a signal (which would close the rendezvous for good, as torch notes).
    """
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    parameters = RendezvousParameters(
        backend=rendezvous.backend,
        endpoint=rendezvous.endpoint,
        run_id=rendezvous.run_id,
        min_nodes=rendezvous.num_nodes,
        max_nodes=rendezvous.num_nodes,
        local_addr=rendezvous.local_addr,
        **rendezvous.configs,
    )
    master_addr = master_port = None
    if rendezvous.backend == "static":  # the store is where the endpoint says; c10d's agent picks and passes it on
        master_addr, master_port = parse_rendezvous_endpoint(rendezvous.endpoint, default_port=-1)
    spec = WorkerSpec(
        role="default",
        local_world_size=nproc,
        entrypoint=sys.executable,
        args=tuple(args),
        rdzv_handler=get_rendezvous_handler(parameters),
        max_restarts=max_restarts,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=rendezvous.local_addr,
    )
    agent = _agent_class()(spec=spec, logs_specs=logs_specs, start_method="spawn")
    agent.report = report
    shutdown = True
    try:
        return agent.run()
    except SignalException:
        shutdown = False
        raise
    finally:
        if shutdown:
            spec.rdzv_handler.shutdown()


def _agent_class() -> type:
    """torch elastic's ``LocalElasticAgent`` with our report at the two methods its agents override.

    [Note: the agent's seams]
    ``SimpleElasticAgent`` declares ``_monitor_workers`` and ``_restart_workers`` for its
    subclasses to implement (``LocalElasticAgent`` is one): the monitor's result holds every
    failure of an attempt, and a restart is a call, not a log line. So the report needs neither
    torch's log wording nor a patched class; a torch that renamed the methods would fail the
    launcher's restart test, not mute the report.
    One moment is not a seam: the poll that finds a failed rank also stops the survivors, inside
    the monitor, and the flight report must come first (a rank frozen by SIGSTOP is resumed by it
    and then stops on SIGTERM; stopped, it would wait for the SIGKILL 30 s later). So before each
    poll the subclass asks the kernel whether a worker has exited, without reaping it
    (``waitid(WNOWAIT)``: torch's poll still collects its status), from the workers' public pids.
    A rank that exits between that look and torch's poll, a few microseconds, is reported just
    after the survivors were signalled instead.
    """
    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class SlipstreamAgent(LocalElasticAgent):
        report: _AttemptReport

        def _monitor_workers(self, worker_group: Any) -> Any:
            if not self.report.flight_reported:
                gone = _exited_workers(worker_group.workers)
                if gone:
                    self.report.before_teardown(gone)
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                self.report.attempt_failed(result.failures)
            return result

        def _restart_workers(self, worker_group: Any) -> None:
            if worker_group.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):  # not a membership change
                self.report.restarting(worker_group.spec.max_restarts)
            super()._restart_workers(worker_group)

    return SlipstreamAgent


def _exited_workers(workers: list[Any]) -> dict[int, int]:
    """global rank -> exit code (minus the signal number if killed) of each worker that has exited, none reaped."""
    gone: dict[int, int] = {}
    if not hasattr(os, "waitid"):  # not on this platform: the report comes from the monitor's result
        return gone
    for worker in workers:
        if not isinstance(worker.id, int):
            continue  # not started
        try:
            status = os.waitid(os.P_PID, worker.id, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except OSError:  # ChildProcessError too: already reaped, or not our child
            continue
        if status is None or not status.si_pid:
            continue  # still running
        code = status.si_status if status.si_code == os.CLD_EXITED else -status.si_status
        if code != 0:
            gone[worker.global_rank] = code
    return gone


class _AttemptReport:
    """What we say of a failed attempt: its flight report, and with --max_restarts one restart line.

    The agent restarts all ranks after a failure and says so only at INFO, so the user would see
    the script's output twice with no explanation. As in ``_report_failures`` the root cause is
    named, not a consequence (see [Note: every failure of an attempt]).
    """

    def __init__(self, who: _Describer, flight_dir: Path | None = None, world: int = 0) -> None:
        self.who, self.flight_dir, self.world = who, flight_dir, world
        self.failures: dict[int, Any] = {}  # global rank -> ProcessFailure of the attempt that just failed
        self.attempt = 0  # restarts so far: the ranks' TORCHELASTIC_RESTART_COUNT
        self.flight_reported = False  # the flight report of this attempt is out

    def before_teardown(self, exited: dict[int, int]) -> None:
        """Ranks have failed (global rank -> exit code) and the survivors still run: the flight report now."""
        self._report_flight({rank: _gone(code) for rank, code in exited.items()})

    def attempt_failed(self, failures: dict[int, Any]) -> None:
        """Every failed rank of the attempt, as the agent's monitor returned them.

        [Note: every failure of an attempt]
        The agent's own log names one failure per attempt, the earliest by a timestamp of one-second
        resolution: under load the rank whose collective lost a SIGKILLed peer can exit before the
        agent polls, carry the same second, and be the one named. The monitor's result holds every
        failure, so the root cause is chosen from all of them (``_root_cause_first``)."""
        self.failures = dict(failures)
        if not self.flight_reported:  # the rank exited in the moment between our look and torch's poll
            self._report_flight({rank: _gone(f.exitcode) for rank, f in failures.items()})

    def _report_flight(self, exited: dict[int, str]) -> None:
        """The hang report of this attempt, once (see flight_report.py)."""
        self.flight_reported = True
        if self.flight_dir is None:
            return
        try:
            lines = report_failed_attempt(self.flight_dir, self.attempt, self.world, exited)
        except Exception as err:  # noqa: BLE001 - the failure report itself must still print
            lines = [f"flight recorder: no report ({type(err).__name__}: {err})"]
        for line in lines:
            _say(f"{self.who.node}{line}")

    def restarting(self, total: int) -> None:
        self.attempt += 1
        rank, failure = _root_cause_first(self.failures)[0] if self.failures else (None, None)
        cause = (
            "a rank failed"
            if failure is None
            else self.who.failure(rank, failure.local_rank, failure.exitcode, failure.pid)
        )
        ranks = "this node's ranks" if self.who.host else "all ranks"
        _say(f"{self.who.node}{cause}; restarting {ranks} (restart {self.attempt} of {total})")
        self.failures, self.flight_reported = {}, False


def _gone(exitcode: int) -> str:
    """How the flight report names a rank that ended: ``exited with code 1``, ``exited, killed by signal SIGKILL``."""
    text = exit_description(exitcode)
    return text if text.startswith("exited") else f"exited, {text}"


@contextlib.contextmanager
def _quiet_torch_elastic() -> Iterator[None]:
    """Mute torch elastic's teardown warnings and failure logs: we print the failures and restarts ourselves.

    ``LOGLEVEL`` is torch elastic's own switch for its logs, so when the user sets it we leave them
    alone. Every level is restored afterwards.
    """
    if "LOGLEVEL" in os.environ:
        yield
        return
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher")
    # Older torch sets a level on each module's logger, newer leaves them NOTSET under one parent.
    names = set(prefixes) | {name for name in logging.root.manager.loggerDict if name.startswith(prefixes)}
    saved = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in saved.items():
            logging.getLogger(name).setLevel(level)


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
