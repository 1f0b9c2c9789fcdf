"""The command line's promise: every bad input to ``slipstream run`` is one line on stderr naming
the file, line or option, the value and the fix, with no argparse usage block and no traceback.

Each case runs the real command (``python -m slipstream.cli``) as a subprocess, so a traceback
anywhere on the way (argparse, reading files, building commands) would show up.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.launcher.environment import EXPORT_PREFIXES

HOSTFILE = "node-a slots=4\nnode-b slots=4\nnode-c slots=2\n"
MULTI = ["--hostfile", "hostfile"]  # a multi-node job: reads the hostfile and .slipstream_env

# (files to write in the job directory, arguments after "run", environment additions, what the
# line must say). A file's content is bytes; a value of None makes a directory of that name.
CASES = {
    # hostfile
    "hostfile malformed line": (
        {"hf": b"node-a slots=4\nnode-b slots 4\n"},
        ["-H", "hf", "train.py"],
        {},
        "hf line 2: expected 'HOST slots=N', got 'node-b slots 4'; write one host",
    ),
    "hostfile slots not a number": (
        {"hf": b"node-a slots=four\n"},
        ["-H", "hf", "train.py"],
        {},
        "hf line 1: slots must be a positive integer, got 'four'; e.g. 'slots=8'",
    ),
    "hostfile slots zero": ({"hf": b"node-a slots=0\n"}, ["-H", "hf", "train.py"], {}, "got '0'"),
    "hostfile slots huge": (
        {"hf": b"node-a slots=99999999999999\n"},
        ["-H", "hf", "train.py"],
        {},
        "hf line 1: slots=99999999999999 is more than 1024 processes on one node; set slots",
    ),
    "hostfile slots thousands of digits": (
        {"hf": b"node-a slots=" + b"9" * 5000 + b"\n"},
        ["-H", "hf", "train.py"],
        {},
        "(5000 digits) is more than 1024",
    ),
    "hostfile slots superscript digit": (
        {"hf": "node-a slots=²\n".encode()},
        ["-H", "hf", "train.py"],
        {},
        "slots must be a positive integer, got '²'",
    ),
    "hostfile duplicate host": (
        {"hf": b"node-a slots=2\nnode-b slots=2\nnode-a slots=2\n"},
        ["-H", "hf", "train.py"],
        {},
        "hf line 3: host 'node-a' is listed twice (first on line 1); keep one line",
    ),
    "hostfile duplicate host as user@host": (
        {"hf": b"node-a slots=2\nme@node-a slots=2\n"},
        ["-H", "hf", "train.py"],
        {},
        "hf line 2: host 'node-a' is listed twice",
    ),
    "hostfile not UTF-8": (
        {"hf": b"node-a slots=2\nn\xe9ud slots=2\n"},
        ["-H", "hf", "train.py"],
        {},
        "--hostfile: hf line 2 is not UTF-8 text (byte 0xe9); save the file as UTF-8",
    ),
    "hostfile bad host name": (
        {"hf": b"n;rm slots=2\n"},
        ["-H", "hf", "train.py"],
        {},
        "hf line 1: 'n;rm' is not a valid host name; use",
    ),
    "hostfile without hosts": ({"hf": b"# nothing\n\n"}, ["-H", "hf", "train.py"], {}, "hf: no hosts in it; add one"),
    "hostfile missing": (
        {},
        ["-H", "nowhere", "train.py"],
        {},
        "--hostfile: cannot read nowhere: No such file or directory",
    ),
    "hostfile is a directory": (
        {"hf": None},
        ["-H", "hf", "train.py"],
        {},
        "--hostfile: cannot read hf: Is a directory",
    ),
    "hostfile far too large": (
        {"hf": b"# padding\n" * 110_000},
        ["-H", "hf", "train.py"],
        {},
        "--hostfile: hf is larger than 1024 KiB; it should hold a few lines of text",
    ),
    # .slipstream_env (read for a multi-node job)
    "env file bad line": (
        {".slipstream_env": b"A=1\nnot a pair\n"},
        [*MULTI, "train.py"],
        {},
        ".slipstream_env line 2: expected KEY=VALUE, got 'not a pair'; write one variable per line",
    ),
    "env file bad name": (
        {".slipstream_env": b"1A=1\n"},
        [*MULTI, "train.py"],
        {},
        ".slipstream_env line 1: expected KEY=VALUE",
    ),
    "env file not UTF-8": (
        {".slipstream_env": b"A=caf\xe9\n"},
        [*MULTI, "train.py"],
        {},
        ".slipstream_env: {cwd}/.slipstream_env line 1 is not UTF-8 text (byte 0xe9)",
    ),
    "env file NUL in a value": (
        {".slipstream_env": b"A=x\x00y\n"},
        [*MULTI, "train.py"],
        {},
        ".slipstream_env line 1: the value of A contains a NUL byte; remove it",
    ),
    "env file is a directory": ({".slipstream_env": None}, [*MULTI, "train.py"], {}, ".slipstream_env: cannot read"),
    # --include / --exclude
    "include unknown host": (
        {},
        [*MULTI, "--include", "node-z", "train.py"],
        {},
        "--include: host 'node-z' is not in the hostfile (hosts: node-a, node-b, node-c); name one",
    ),
    "include slots not numbers": (
        {},
        [*MULTI, "--include", "node-a:x", "train.py"],
        {},
        "--include: slots of 'node-a' must be integers",
    ),
    "include negative slot": ({}, [*MULTI, "--include", "node-a:-1", "train.py"], {}, "cannot be negative, got '-1'"),
    "include slot beyond the host": (
        {},
        [*MULTI, "--include", "node-c:5", "train.py"],
        {},
        "--include: host 'node-c' has 2 slot(s) in the hostfile (0-1), asked for slot 5",
    ),
    "include empty": ({}, [*MULTI, "--include", "", "train.py"], {}, "--include: empty host in ''"),
    "include empty host between @": (
        {},
        [*MULTI, "--include", "node-a@@node-b", "train.py"],
        {},
        "empty host in 'node-a@@node-b'",
    ),
    "include and exclude": (
        {},
        [*MULTI, "--include", "node-a", "--exclude", "node-b", "train.py"],
        {},
        "--include and --exclude cannot be used together; give one",
    ),
    "exclude everything": (
        {},
        [*MULTI, "--exclude", "node-a@node-b@node-c", "train.py"],
        {},
        "no hosts left after --include/--exclude",
    ),
    "include another machine without hostfile": (
        {},
        ["--include", "elsewhere:0", "train.py"],
        {},
        "--include: host 'elsewhere' is not this machine; pass a --hostfile",
    ),
    # ports and numbers
    "master port not a number": (
        {},
        ["--master_port", "abc", "train.py"],
        {},
        "argument --master_port/--master-port: expected an integer, got 'abc'",
    ),
    "master port too large": ({}, ["--master_port", "70000", "train.py"], {}, "must be between 1 and 65535, got 70000"),
    "master port zero": ({}, ["--master_port", "0", "train.py"], {}, "omit --master_port to pick a free one"),
    "master port thousands of digits": ({}, ["--master_port", "9" * 5000, "train.py"], {}, "(5000 characters)"),
    "ssh port negative": (
        {},
        [*MULTI, "--ssh_port=-5", "train.py"],
        {},
        "argument --ssh_port/--ssh-port: must be between 1 and 65535, got -5",
    ),
    "nproc zero": ({}, ["--nproc_per_node", "0", "train.py"], {}, "must be at least 1, got 0"),
    "nproc huge": (
        {},
        ["--nproc_per_node", "100000", "train.py"],
        {},
        "100000 processes on one node is more than 1024",
    ),
    "max restarts negative": ({}, ["--max_restarts=-1", "train.py"], {}, "must be 0 or more, got -1"),
    # other options
    "script missing": (
        {},
        ["missing.py"],
        {},
        "script not found: missing.py (looked in {cwd}); give the training script's path",
    ),
    "script is a directory": (
        {"job": None},
        ["job"],
        {},
        "SCRIPT 'job' is a directory; give the training script's .py file",
    ),
    "no script": ({}, [], {}, "the following arguments are required: SCRIPT"),
    "unknown option": (
        {},
        ["--bogus", "train.py"],
        {},
        "slipstream run: error: unrecognized arguments: --bogus; see 'slipstream run --help'",
    ),
    "unknown launcher": ({}, ["--launcher", "rsh", "train.py"], {}, "argument --launcher: invalid choice: 'rsh'"),
    "launcher args unbalanced quote": (
        {},
        [*MULTI, "--launcher_args", "-o 'x", "train.py"],
        {},
        "--launcher_args \"-o 'x\": No closing quotation; give the runner's arguments as one",
    ),
    "master addr with a space": (
        {},
        ["--master_addr", "bad host", "train.py"],
        {},
        "--master_addr: 'bad host' is not a valid host name",
    ),
    "node rank not a number": (
        {},
        ["--num_nodes", "2", "--node_rank", "x", "--master_addr", "a", "--master_port", "1", "train.py"],
        {},
        "--node_rank: expected a non-negative integer (or slurm/mpi), got 'x'",
    ),
    "slurm node list too long": (
        {},
        ["--launcher", "slurm", "train.py"],
        {"SLURM_JOB_NODELIST": "gpu[1-70000]"},
        "SLURM_JOB_NODELIST: 'gpu[1-70000]' expands to more than 65536 hosts",
    ),
    "slurm node list malformed": (
        {},
        ["--launcher", "slurm", "train.py"],
        {"SLURM_JOB_NODELIST": "gpu[a-b]"},
        "SLURM_JOB_NODELIST: cannot expand 'gpu[a-b]'",
    ),
    "plan is reserved": ({}, None, {}, "slipstream plan: error: not available yet; 'slipstream estimate' gives"),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, subprocess.CompletedProcess[str]]]:
    """Every case's run, started all at once: each is an interpreter start-up (~0.1 s of CPU),
    and waiting for them one after another would add their latencies on a busy machine."""
    started = {}
    for case, (files, argv, environ, _) in CASES.items():
        job = tmp_path_factory.mktemp("job")
        (job / "train.py").write_text("print('hi')\n")
        (job / "hostfile").write_text(HOSTFILE)
        for name, content in files.items():
            if content is None:
                (job / name).mkdir()
            else:
                (job / name).write_bytes(content)
        env = {k: v for k, v in os.environ.items() if not k.startswith((*EXPORT_PREFIXES, "SLURM_"))}
        env.update(environ, HOME=str(job), PYTHONPATH=os.pathsep.join(sys.path))
        # --dry_run everywhere: should a check ever stop working, the case prints commands instead
        # of starting processes (an unchecked '--nproc_per_node 100000' would start them all).
        command = [sys.executable, "-m", "slipstream.cli", *(["plan"] if argv is None else ["run", "--dry_run", *argv])]
        process = subprocess.Popen(
            command, cwd=job, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        started[case] = (job, command, process)
    done = {}
    try:
        for case, (job, command, process) in started.items():
            stdout, stderr = process.communicate(timeout=60)
            done[case] = (job, subprocess.CompletedProcess(command, process.returncode, stdout, stderr))
    finally:
        for _, _, process in started.values():  # one that hangs must not outlive the test
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    return done


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_without_traceback(outcomes, case: str) -> None:
    job, done = outcomes[case]
    lines = done.stderr.splitlines()
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr and "usage:" not in done.stderr, done.stderr
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(("slipstream run: error: ", "slipstream plan: error: ")), lines[0]
    assert CASES[case][3].format(cwd=job) in lines[0], lines[0]
    assert done.stdout == ""  # nothing ran, not even --dry_run's commands


def _attempt_report():  # an _AttemptReport with _Describer's interface, no launch spec
    from slipstream.launcher import agent

    class Who:
        node, host = "", None

        def failure(self, rank: int | None, local_rank: int, exitcode: int, pid: int | None) -> str:
            return agent.describe_failure(local_rank, local_rank, exitcode)

    return agent._AttemptReport(Who())  # type: ignore[arg-type]


def test_the_restart_line_names_the_killed_rank_not_the_peer_that_failed_after_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The agent's log names one failure per attempt, the earliest by a one-second timestamp: under load
    # that can be the survivor whose collective lost the SIGKILLed rank. The monitor's result has both.
    from types import SimpleNamespace

    report = _attempt_report()
    collective = "CollectiveError: rank 0/2: all_reduce failed after 0.1s. Another rank probably died"
    report.attempt_failed(
        {
            0: SimpleNamespace(
                exitcode=1, local_rank=0, pid=11, timestamp=100, error_file_data={"message": collective}
            ),
            1: SimpleNamespace(exitcode=-signal.SIGKILL, local_rank=1, pid=12, timestamp=100, error_file_data={}),
        }
    )
    report.restarting(2)
    said = capsys.readouterr().err
    assert said.strip() == (
        "slipstream run: rank 1 (local rank 1) was killed by signal SIGKILL; restarting all ranks (restart 1 of 2)"
    ), said
    report.attempt_failed({0: SimpleNamespace(exitcode=3, local_rank=0, pid=13, timestamp=200, error_file_data={})})
    report.restarting(2)
    assert "rank 0 (local rank 0) exited with code 3; restarting all ranks (restart 2 of 2)" in capsys.readouterr().err


def test_the_agent_reports_at_its_monitor_and_restart_seams(monkeypatch: pytest.MonkeyPatch) -> None:
    # [Note: the agent's seams]: the subclass gives the flight report its moment before torch's poll stops
    # the survivors, hands a failed attempt's failures to the report, and says a restart only when it
    # follows a failure (not a membership change).
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    from slipstream.launcher import agent

    said: list[tuple] = []
    exited = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        while os.waitid(os.P_PID, exited.pid, os.WEXITED | os.WNOWAIT) is None:
            pass
        groups = {
            "healthy": SimpleNamespace(workers=[SimpleNamespace(id=running.pid, global_rank=0)]),
            "failed": SimpleNamespace(
                workers=[SimpleNamespace(id=running.pid, global_rank=0), SimpleNamespace(id=exited.pid, global_rank=1)]
            ),
        }
        results = {
            "healthy": SimpleNamespace(is_failed=lambda: False, failures={}),
            "failed": SimpleNamespace(is_failed=lambda: True, failures={1: "exited"}),
        }

        def monitor(self, group):  # torch's poll: by now it would have stopped the survivors
            said.append(("polled",))
            return results["failed" if len(group.workers) == 2 else "healthy"]

        monkeypatch.setattr(LocalElasticAgent, "_monitor_workers", monitor)
        monkeypatch.setattr(LocalElasticAgent, "_restart_workers", lambda self, group: said.append(("restarted",)))
        subclass = agent._agent_class()
        assert issubclass(subclass, LocalElasticAgent)
        instance = object.__new__(subclass)  # the seams need no rendezvous

        class Report:
            flight_reported = False

            def before_teardown(self, gone: dict[int, int]) -> None:
                self.flight_reported = True
                said.append(("flight", gone))

            def attempt_failed(self, failures: dict) -> None:
                said.append(("failed", failures))

            def restarting(self, total: int) -> None:
                said.append(("restarting", total))

        instance.report = Report()
        assert instance._monitor_workers(groups["healthy"]) is results["healthy"]
        assert instance._monitor_workers(groups["failed"]) is results["failed"]
        spec = SimpleNamespace(max_restarts=3)
        instance._restart_workers(SimpleNamespace(state=WorkerState.FAILED, spec=spec))
        instance._restart_workers(SimpleNamespace(state=WorkerState.HEALTHY, spec=spec))  # new nodes joined
        assert said == [
            ("polled",),
            ("flight", {1: 3}),  # before the poll, and only the rank that exited
            ("polled",),
            ("failed", {1: "exited"}),
            ("restarting", 3),
            ("restarted",),
            ("restarted",),
        ]
        assert exited.wait(timeout=10) == 3  # looked at, not reaped: torch's poll still reads the code
        running.kill()
        while os.waitid(os.P_PID, running.pid, os.WEXITED | os.WNOWAIT) is None:
            pass
        assert agent._exited_workers([SimpleNamespace(id=running.pid, global_rank=5)]) == {5: -signal.SIGKILL}
    finally:
        running.kill()
        running.wait()
