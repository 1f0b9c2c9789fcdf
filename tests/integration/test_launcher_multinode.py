"""``slipstream run`` end to end: real training jobs on one node, on two "nodes" of this machine
(two agents, and the ssh runner against a local sshd), a SIGKILLed rank with and without
restarts, and a rank that skips a collective.

Every job is ``launcher_job.py`` (a small regression model, ZeRO-0, 2 ranks, gloo); the one-node
world-2 run is the reference every other run must reproduce exactly.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.integration.sshd import Sshd, SshdUnavailable, start_sshd

JOB = str(Path(__file__).with_name("launcher_job.py"))
REPO = Path(__file__).resolve().parents[2]
STEPS = 8


def _slipstream(*args: str, cwd: Path | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """Run the command. [Note: no durations] A misbehaving job here sleeps 300 s; the launcher
    ending it before ``timeout`` (a hang guard, not a measured duration) is what the tests rely on,
    plus the messages that name what happened and the timeout that fired."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOGLEVEL")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run(
        [sys.executable, "-m", "slipstream.launcher.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        check=False,
    )
    return done


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _losses(out: Path, rank: int, attempt: int = 0) -> dict[str, float]:
    return json.loads((out / f"losses_rank{rank}_attempt{attempt}.json").read_text())


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "final.pt", weights_only=True)


def _assert_same_run(out: Path, reference: Path) -> None:
    for rank in range(2):
        assert _losses(out, rank) == _losses(reference, rank), f"rank {rank} losses differ"
    _assert_same_weights(out, reference)


def _assert_same_weights(out: Path, reference: Path) -> None:
    got, want = _weights(out), _weights(reference)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One node, two ranks, uninterrupted: the run everything else must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    done = _slipstream("run", "--nproc_per_node", "2", JOB, "--out", str(out), "--steps", str(STEPS))
    assert done.returncode == 0, done.stderr
    return out


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Sshd:
    try:
        server = start_sshd(tmp_path_factory.mktemp("sshd"))
    except SshdUnavailable as err:
        print(f"ssh runner tests skipped: {err}", file=sys.stderr)
        pytest.skip(f"no local sshd: {err}")
    yield server
    server.stop()


def test_one_node_trains_the_example(tmp_path):
    done = _slipstream(
        "run", "--nproc_per_node", "2", str(REPO / "examples" / "train_gpt2.py"), "--steps", "2", "--print-every", "1"
    )
    assert done.returncode == 0, done.stderr
    assert "step    2 | loss" in done.stdout


def test_reference_run_records_torchrun_environment(reference):
    for rank in range(2):
        env = json.loads((reference / f"env_rank{rank}.json").read_text())
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
    losses = _losses(reference, 0)
    assert len(losses) == STEPS and losses["7"] < losses["0"]


def _two_agents(port: str, job_args: list[str], agent_args: tuple[str, ...] = ()) -> list[str]:
    """Start node 1's agent, then node 0's (node 1 must wait for node 0's store, not fail); their stderr."""
    common = ["--num_nodes", "2", "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "LOGLEVEL")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "slipstream.launcher.cli",
                "run",
                *common,
                *agent_args,
                "--node_rank",
                str(node),
                JOB,
                *job_args,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for node in (1, 0)
    ]
    results = [agent.communicate(timeout=180) for agent in agents]
    for agent, (_, err) in zip(agents, results, strict=True):
        assert agent.returncode == 0, err
    return [err for _, err in results]


def test_two_agents_as_two_nodes_match_one_node(tmp_path, reference):
    port = str(_free_port())
    _two_agents(port, ["--out", str(tmp_path), "--steps", str(STEPS)])
    for rank in range(2):
        env_seen = json.loads((tmp_path / f"env_rank{rank}.json").read_text())
        assert env_seen["RANK"] == str(rank) and env_seen["LOCAL_RANK"] == "0"  # node r holds rank r
        assert env_seen["WORLD_SIZE"] == "2" and env_seen["LOCAL_WORLD_SIZE"] == "1"
        assert env_seen["MASTER_PORT"] == port
    _assert_same_run(tmp_path, reference)


def _ssh_args(server: Sshd, hostfile: Path) -> list[str]:
    return [
        "run",
        "--hostfile",
        str(hostfile),
        "--launcher",
        "ssh",
        "--ssh_port",
        str(server.port),
        f"--launcher_args={' '.join(server.ssh_options())}",
        "--master_port",
        str(_free_port()),
    ]


def test_ssh_runner_trains_on_two_hosts(tmp_path, sshd, reference):
    # Two hostfile entries that are both this machine: one ssh session per "node".
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# two nodes, one rank each\n127.0.0.1 slots=1\n\nlocalhost slots=1  # second\n")
    (tmp_path / ".slipstream_env").write_text("SLIPSTREAM_TEST_MARK='from the env file'\n")
    out = tmp_path / "out"
    out.mkdir()
    done = _slipstream(*_ssh_args(sshd, hostfile), JOB, "--out", str(out), "--steps", str(STEPS), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    for rank in range(2):
        env_seen = json.loads((out / f"env_rank{rank}.json").read_text())
        assert env_seen["RANK"] == str(rank) and env_seen["WORLD_SIZE"] == "2"
        assert env_seen["MASTER_ADDR"] == "127.0.0.1"  # the hostfile's first host
        assert env_seen["SLIPSTREAM_TEST_MARK"] == "from the env file"  # carried over ssh
    _assert_same_run(out, reference)


FAIL_ON_NODE_1 = """
import os, sys, time
from pathlib import Path
Path(sys.argv[1], "pid%s" % os.environ["RANK"]).write_text(str(os.getpid()))
if os.environ["RANK"] == "1":
    time.sleep(1)
    Path(sys.argv[1], "failed_at").write_text(repr(time.time()))
    raise ValueError("bad batch on purpose")
time.sleep(300)
"""


def test_ssh_runner_failure_stops_the_other_node(tmp_path, sshd):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    script = tmp_path / "fail.py"
    script.write_text(FAIL_ON_NODE_1)
    done = _slipstream(*_ssh_args(sshd, hostfile), str(script), str(tmp_path), cwd=tmp_path)
    assert done.returncode == 1, done.stderr
    host = socket.gethostname()
    assert f"rank 1 (local rank 0 on {host}) exited with code 1: ValueError: bad batch on purpose" in done.stderr
    assert "| " in done.stderr and 'raise ValueError("bad batch on purpose")' in done.stderr  # traceback tail
    assert "node 1 (localhost) failed first (exit code 1); stopping the other nodes" in done.stderr
    # Rank 0 (sleeping on node 0) was stopped through its agent, not left behind.
    pid = int((tmp_path / "pid0").read_text())
    deadline = time.monotonic() + 60  # a wait for the exit, not a duration under test
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.2)
    assert not _alive(pid), "rank 0 outlived the job"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_sigkilled_rank_without_restarts_fails_fast(tmp_path):
    done = _slipstream(
        "run",
        "--nproc_per_node",
        "2",
        JOB,
        "--out",
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--kill_rank",
        "1",
        "--kill_after_step",
        "3",
    )
    assert done.returncode == 128 + signal.SIGKILL, done.stderr
    assert "slipstream run: rank 1 (local rank 1) was killed by signal SIGKILL (" in done.stderr
    assert "stopped the other rank(s) (0) with SIGTERM after rank 1 failed" in done.stderr


def test_sigkilled_rank_restarts_and_resumes_from_checkpoint(tmp_path, reference):
    save_dir = tmp_path / "checkpoints"
    done = _slipstream(
        "run",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        JOB,
        "--out",
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--save_dir",
        str(save_dir),
        "--interval",
        "2",
        "--kill_rank",
        "1",
        "--kill_after_step",
        "5",
    )
    assert done.returncode == 0, done.stderr
    assert "rank 1 (local rank 1) was killed by signal SIGKILL" in done.stderr
    assert "restarting all ranks (restart 1 of 1)" in done.stderr
    # The first attempt got to step 5; the restart resumed from the step-4 checkpoint, not step 0.
    first, resumed = _losses(tmp_path, 1, attempt=0), _losses(tmp_path, 1, attempt=1)
    assert sorted(map(int, first)) == list(range(5))
    assert sorted(map(int, resumed)) == list(range(4, STEPS))
    want = _losses(reference, 1)
    assert all(resumed[step] == want[step] for step in resumed)
    _assert_same_weights(tmp_path, reference)


def test_two_node_job_restarts_on_both_nodes_and_resumes(tmp_path, reference):
    # Rank 1 (node 1) dies; node 1's agent restarts it, node 0's rank sees the dead peer and fails,
    # node 0's agent restarts too, and both meet again and resume from the step-4 checkpoint.
    stderr = _two_agents(
        str(_free_port()),
        [
            "--out",
            str(tmp_path),
            "--steps",
            str(STEPS),
            "--save_dir",
            str(tmp_path / "checkpoints"),
            "--interval",
            "2",
            "--kill_rank",
            "1",
            "--kill_after_step",
            "5",
        ],
        ("--max_restarts", "1"),
    )
    node1 = stderr[0]
    assert (
        f"node 1 ({socket.gethostname()}): rank 1 (local rank 0 on {socket.gethostname()}) was killed by signal SIGKILL"
        in node1
    )
    assert "restarting this node's ranks (restart 1 of 1)" in node1
    resumed = _losses(tmp_path, 1, attempt=1)
    assert sorted(map(int, resumed)) == list(range(4, STEPS))
    _assert_same_weights(tmp_path, reference)


def test_rank_skipping_a_collective_fails_the_others_within_the_timeout(tmp_path):
    # The job creates its process group itself (30-minute default), so this also checks that
    # comms_timeout_seconds reaches a group slipstream did not create. The limit is one a healthy rank never reaches
    # on a loaded machine (two suites at once), where a step can stall for seconds.
    done = _slipstream(
        "run",
        "--nproc_per_node",
        "2",
        JOB,
        "--out",
        str(tmp_path),
        "--steps",
        str(STEPS),
        "--comms_timeout",
        "15",
        "--skip_rank",
        "1",
        "--skip_step",
        "2",
        "--own_process_group",
    )
    assert done.returncode == 1, done.stderr
    # Rank 1 sleeps 300 s instead of stepping; rank 0 gives up when its 15 s collective timeout fires.
    line = next(line for line in done.stderr.splitlines() if line.startswith("slipstream run: rank 0 (local rank 0)"))
    assert "exited with code 1: CollectiveError: rank 0/2: all_reduce of gradient bucket 0" in line
    # the wait it reports is measured: on a loaded machine it ends a little after the limit
    assert re.search(r"in step 2 timed out after \d+\.\ds \(the limit is comms_timeout_seconds = 15;", line), line
    assert "stopped the other rank(s) (1) with SIGTERM after rank 0 failed" in done.stderr
