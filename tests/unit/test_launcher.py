"""The ``slipstream`` command: fast help, local multi-rank launch, failure reporting, report."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.launcher.agent import describe_failure

RANK_DUMP = textwrap.dedent(
    """
    import json, os, sys
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT"]
    record = {key: os.environ.get(key) for key in keys}
    record["argv"] = sys.argv[1:]
    with open(os.path.join(__OUT_DIR__, "rank%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(record, f)
    """
)


def _slipstream(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOGLEVEL")}
    return subprocess.run(
        [sys.executable, "-m", "slipstream.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def _write(path: Path, source: str) -> str:
    path.write_text(source)
    return str(path)


def test_help_never_imports_torch():
    program = textwrap.dedent(
        """
        import sys
        from slipstream.cli import main
        for argv in (["--help"], ["run", "--help"]):
            try:
                main(argv)
            except SystemExit as exit:
                assert exit.code == 0, exit.code
        assert "torch" not in sys.modules, "slipstream --help imported torch"
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert "--nproc_per_node" in done.stdout and "--master_port" in done.stdout


def test_version(capsys):
    from slipstream import __version__

    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.strip() == f"slipstream {__version__}"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["run", "--nproc_per_node", "0", "x.py"], "must be at least 1"),
        (["run", "--master_port", "0", "x.py"], "omit --master_port"),
        (["run", "does_not_exist.py"], "script not found: does_not_exist.py"),
        ([], "required: COMMAND"),
    ],
)
def test_bad_arguments_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    assert message in capsys.readouterr().err


def test_run_two_ranks_with_env_and_args(tmp_path):
    script = _write(tmp_path / "dump.py", RANK_DUMP.replace("__OUT_DIR__", repr(str(tmp_path))))
    done = _slipstream("run", "--nproc_per_node", "2", script, "a", "--b", "c")
    assert done.returncode == 0, done.stderr

    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for rank, record in enumerate(ranks):
        assert record["RANK"] == record["LOCAL_RANK"] == str(rank)
        assert record["WORLD_SIZE"] == record["LOCAL_WORLD_SIZE"] == "2"
        assert record["MASTER_ADDR"] == "127.0.0.1"
        assert record["OMP_NUM_THREADS"] == str(max(1, cores // 2))
        # Script arguments pass through untouched, even ones that look like options.
        assert record["argv"] == ["a", "--b", "c"]
    # A port the OS picked at launch, the same for every rank.
    assert ranks[0]["MASTER_PORT"] == ranks[1]["MASTER_PORT"] != "0"
    assert "OMP_NUM_THREADS=" in done.stderr
    assert "torch/distributed/elastic" not in done.stderr  # none of torch elastic's log lines


def test_failed_rank_is_named_and_fails_the_run(tmp_path):
    script = _write(
        tmp_path / "fail.py", "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(60)\n"
    )
    done = _slipstream("run", "--nproc_per_node", "2", script)
    assert done.returncode == 3, done.stderr
    assert "slipstream run: rank 1 (local rank 1) exited with code 3" in done.stderr
    # Rank 0 was torn down because of rank 1, and is reported as such, not as a second failure.
    assert "stopped the other rank(s) (0) with SIGTERM after rank 1 failed" in done.stderr


def test_rank_failing_after_its_script_returned_is_named_with_its_exit_code(tmp_path):
    # Issue 20 #3: a background checkpoint save that fails at exit makes the process exit non-zero
    # after training finished; the report names the rank, the code and that it happened at shutdown.
    source = """
        import atexit, os, sys, time

        def failed_save():  # once rank 0 is done too: the whole run had finished
            while not os.path.exists(__FINISHED__ + "0") and time.time() < deadline:
                time.sleep(0.05)
            print("checkpoint save failed: No space left on device", file=sys.stderr, flush=True)
            os._exit(5)

        deadline = time.time() + 30
        if os.environ["RANK"] == "1":
            atexit.register(failed_save)
        # One write per line: the two ranks share the pipe, and print() of two arguments writes them apart.
        sys.stdout.write(f"training finished {os.environ['RANK']}\\n")
        sys.stdout.flush()
        open(__FINISHED__ + os.environ["RANK"], "w").close()
    """.replace("__FINISHED__", repr(str(tmp_path / "finished")))
    done = _slipstream("run", "--nproc_per_node", "2", _write(tmp_path / "finish.py", textwrap.dedent(source)))
    assert done.returncode == 5, done.stderr
    assert sorted(done.stdout.splitlines()) == ["training finished 0", "training finished 1"]
    report = [line for line in done.stderr.splitlines() if line.startswith("slipstream run: rank")]
    assert report == [
        "slipstream run: rank 1 (local rank 1) exited with code 5: finish.py had returned: the process failed while "
        "shutting down (an atexit handler or background work such as an asynchronous checkpoint save; its own "
        "message is in this rank's output)"
    ], done.stderr
    assert "checkpoint save failed: No space left on device" in done.stderr


def test_restart_is_announced_and_uses_the_given_port(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = _write(
        tmp_path / "flaky.py",
        RANK_DUMP.replace("__OUT_DIR__", repr(str(tmp_path)))
        + "if os.environ['TORCHELASTIC_RESTART_COUNT'] == '0' and os.environ['RANK'] == '1':\n"
        "    sys.exit(4)\n",
    )
    done = _slipstream("run", "--nproc_per_node", "2", "--max_restarts", "1", "--master_port", str(port), script)
    assert done.returncode == 0, done.stderr
    assert "rank 1 (local rank 1) exited with code 4; restarting all ranks (restart 1 of 1)" in done.stderr
    final = json.loads((tmp_path / "rank1.json").read_text())
    assert final["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert final["MASTER_PORT"] == str(port)


def test_describe_failure_names_signals():
    assert describe_failure(3, 1, 7) == "rank 3 (local rank 1) exited with code 7"
    assert describe_failure(0, 0, -signal.SIGSEGV) == "rank 0 (local rank 0) was killed by signal SIGSEGV"
    note = "(out of memory: the kernel log records the OOM killer killing pid 7)"
    assert describe_failure(2, 0, -signal.SIGKILL, "node-b", note) == (
        f"rank 2 (local rank 0 on node-b) was killed by signal SIGKILL {note}"
    )


def test_report_prints_torch_version(capsys):
    import torch

    assert main(["report"]) == 0
    out = capsys.readouterr().out
    torch_line = next(line for line in out.splitlines() if line.startswith("torch ."))
    assert torch.__version__ in torch_line
    for key in ("slipstream ", "python ", "torch.distributed backends ", "ninja ", "g++ ", "ram "):
        assert any(line.startswith(key) for line in out.splitlines()), key


def test_sigkill_note_says_out_of_memory_only_with_evidence(monkeypatch):
    from slipstream.launcher import oom

    monkeypatch.setattr(oom, "oom_kill_count", lambda: 3)
    monkeypatch.setattr(oom, "_dmesg_mentions", lambda pid: False)
    assert oom.sigkill_note(42, 2) == "(out of memory: the OOM killer ran in this job's memory cgroup, oom_kill 2 -> 3)"
    assert oom.sigkill_note(42, 3).startswith("(no OOM-killer record for it")
    monkeypatch.setattr(oom, "_dmesg_mentions", lambda pid: True)
    assert oom.sigkill_note(42, 3) == "(out of memory: the kernel log records the OOM killer killing pid 42)"
    monkeypatch.setattr(oom, "oom_kill_count", lambda: None)
    monkeypatch.setattr(oom, "_dmesg_mentions", lambda pid: None)
    assert oom.sigkill_note(42, None).startswith("(likely out of memory if nothing else killed it; dmesg and")


def test_oom_counter_and_kernel_log_parsing(monkeypatch, tmp_path):
    from slipstream.launcher import oom

    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 2\n")
    monkeypatch.setattr(oom, "_cgroup_oom_files", lambda: [str(tmp_path / "missing"), str(events)])
    assert oom.oom_kill_count() == 2
    log = "[ 12.3] Out of memory: Killed process 4242 (python) total-vm:100kB\n[ 12.4] other\n"
    monkeypatch.setattr(oom.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=log, stderr=""))
    assert oom._dmesg_mentions(4242) is True
    assert oom._dmesg_mentions(424) is False
    log = "[ 9.1] oom-kill:constraint=CONSTRAINT_MEMCG,task=python,pid=777,uid=0\n"
    monkeypatch.setattr(oom.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=log, stderr=""))
    assert oom._dmesg_mentions(777) is True


def test_root_cause_is_the_rank_that_failed_on_its_own(capsys):
    # Under load the survivor's CollectiveError can carry an earlier timestamp than the agent's
    # record of the SIGKILLed peer; the report must still name the killed rank first and exit 137.
    from types import SimpleNamespace

    from slipstream.launcher.agent import _report_failures

    collective = (
        "CollectiveError: rank 0/2: all_reduce of gradient bucket 0 failed after 0.1s. Another rank probably died"
    )
    failures = {
        0: SimpleNamespace(
            exitcode=-signal.SIGTERM, local_rank=0, pid=None, timestamp=100, error_file_data={"message": collective}
        ),
        1: SimpleNamespace(exitcode=-signal.SIGKILL, local_rank=1, pid=None, timestamp=101, error_file_data={}),
    }
    # _Describer's interface without a launch spec
    who = SimpleNamespace(node="", failure=lambda rank, local, code, pid: describe_failure(rank, local, code))
    assert _report_failures(failures, who) == 128 + signal.SIGKILL
    lines = capsys.readouterr().err.splitlines()
    assert "rank 1 (local rank 1) was killed by signal SIGKILL" in lines[0]
    assert "stopped the other rank(s) (0)" in lines[-1]


def test_a_rank_the_agent_stopped_is_never_the_root_cause(capsys):
    # Seen with two suites at once: a rank took another code path, so every rank's error is a timed-out collective
    # (a peer's fault) and rank 0, stopped by the agent, was recorded in the same second as the rank that timed out.
    # The report must name the rank whose collective failed, exit 1 (not 143), and list rank 0 among the stopped.
    from types import SimpleNamespace

    from slipstream.launcher.agent import _report_failures

    timed_out = "CollectiveError: rank 3/4: reduce_scatter of gradient bucket 0 timed out after 5.0s. Another rank probably died"
    failures = {
        0: SimpleNamespace(
            exitcode=-signal.SIGTERM, local_rank=0, pid=None, timestamp=100, error_file_data={"message": timed_out}
        ),
        3: SimpleNamespace(exitcode=1, local_rank=3, pid=None, timestamp=100, error_file_data={"message": timed_out}),
    }
    who = SimpleNamespace(node="", failure=lambda rank, local, code, pid: describe_failure(rank, local, code))
    assert _report_failures(failures, who) == 1
    lines = capsys.readouterr().err.splitlines()
    assert "rank 3 (local rank 3) exited with code 1" in lines[0]
    assert "stopped the other rank(s) (0) with SIGTERM after rank 3 failed" in lines[-1]


def test_the_error_file_appears_whole_or_not_at_all(tmp_path, monkeypatch):
    """A rank stopped while writing its error file must never leave half a JSON document: the
    agent parses the file as soon as another rank fails, and a partial one made the whole report
    fail ("could not start the job: JSONDecodeError") instead of naming the killed rank."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from slipstream.launcher import worker

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped_mid_write(data, file):
        file.write('{"message": {"mess')
        file.flush()
        raise OSError("stopped while writing")

    monkeypatch.setattr(worker.json, "dump", stopped_mid_write)
    worker.record_exception(RuntimeError("boom"), "train.py")
    assert not path.exists() and list(tmp_path.iterdir()) == []
    monkeypatch.undo()

    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    worker.record_exception(RuntimeError("boom"), "train.py")
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: boom"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
