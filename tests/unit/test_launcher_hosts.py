"""``slipstream run`` without running anything: hostfiles, host selection, the environment carried
to other nodes, the exact commands of every runner (``--dry_run`` golden lines), and one-line
errors for bad input."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import textwrap

import pytest

from slipstream.launcher.cli import main
from slipstream.launcher.environment import EXPORT_PREFIXES, EnvFileError, exported_env, parse_env_file
from slipstream.launcher.hostfile import HostfileError, expand_nodelist, parse_hostfile_text, select
from slipstream.launcher.launch_plan import PlanError, node_rank_from
from slipstream.launcher.runners import Job, Node, pdsh_command, pdsh_escape, remote_shell_command

HOSTFILE = """
# the cluster
node-a slots=4
node-b slots=4   # trailing comment

node-c slots=2
"""


def test_help_is_fast_and_never_imports_torch():
    # Whole command, interpreter start included; best of three so one scheduler hiccup on a
    # shared machine does not fail it.
    program = textwrap.dedent(
        """
        import sys
        from slipstream.launcher.cli import main
        try:
            main(["run", "--help"])
        except SystemExit as exit:
            assert exit.code == 0
        assert "torch" not in sys.modules, "slipstream run --help imported torch"
        """
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "--hostfile" in done.stdout and "--launcher" in done.stdout


def test_hostfile_comments_blank_lines_and_order():
    assert parse_hostfile_text(HOSTFILE) == {"node-a": 4, "node-b": 4, "node-c": 2}


@pytest.mark.parametrize(
    "text, message",
    [
        ("node-a slots=4\nnode-b\n", "hostfile line 2: expected 'HOST slots=N', got 'node-b'"),
        ("node-a slots=four\n", "hostfile line 1: slots must be a positive integer, got 'four'"),
        ("node-a slots=0\n", "slots must be a positive integer, got '0'"),
        ("node-a slots=2 gpus=2\n", "expected 'HOST slots=N'"),
        ("node-a slots=2\nnode-a slots=2\n", "hostfile line 2: host 'node-a' is listed twice"),
        ("n;rm -rf / slots=2\n", "hostfile line 1: 'n;rm' is not a valid host name"),
        ("-oProxyCommand=x slots=1\n", "is not a valid host name"),
        ("# only comments\n\n", "hostfile: no hosts in it"),
    ],
)
def test_malformed_hostfile_lines(text, message):
    with pytest.raises(HostfileError) as error:
        parse_hostfile_text(text)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_include_exclude_num_nodes_nproc():
    hosts = parse_hostfile_text(HOSTFILE)
    assert select(hosts) == {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3], "node-c": [0, 1]}
    assert select(hosts, include="node-c@node-a:0,2") == {"node-a": [0, 2], "node-c": [0, 1]}  # hostfile order
    assert select(hosts, exclude="node-b@node-a:3") == {"node-a": [0, 1, 2], "node-c": [0, 1]}
    assert select(hosts, num_nodes=2, nproc_per_node=1) == {"node-a": [0], "node-b": [0]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"include": "node-z"}, "--include: host 'node-z' is not in the hostfile (hosts: node-a, node-b, node-c)"),
        ({"exclude": "node-a@node-q:1"}, "--exclude: host 'node-q' is not in the hostfile"),
        ({"include": "node-c:0,2"}, "--include: host 'node-c' has 2 slot(s) in the hostfile (0-1), asked for slot 2"),
        ({"include": "node-a:x"}, "slots of 'node-a' must be integers"),
        ({"include": "node-a", "exclude": "node-b"}, "--include and --exclude cannot be used together"),
        ({"exclude": "node-a@node-b@node-c"}, "no hosts left after --include/--exclude"),
        ({"num_nodes": 4}, "--num_nodes 4: only 3 host(s) available"),
        ({"nproc_per_node": 3}, "--nproc_per_node 3: host 'node-c' has only 2 slot(s) selected"),
    ],
)
def test_selection_errors(kwargs, message):
    with pytest.raises(HostfileError) as error:
        select(parse_hostfile_text(HOSTFILE), **kwargs)
    assert message in str(error.value)


def test_slurm_nodelist_expansion():
    assert expand_nodelist("gpu[01-03,7],login1") == ["gpu01", "gpu02", "gpu03", "gpu7", "login1"]
    assert expand_nodelist("node5") == ["node5"]


def test_env_export_and_env_files(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "job"
    home.mkdir()
    cwd.mkdir()
    (home / ".slipstream_env").write_text("# user-wide\nNCCL_DEBUG=WARN\nexport HF_HOME=/data/hf\n")
    (cwd / ".slipstream_env").write_text('NCCL_DEBUG=INFO\nQUOTED="a b"\n\n')
    environ = {
        "NCCL_IB_DISABLE": "1",
        "PYTHONPATH": "/src",
        "OMP_NUM_THREADS": "4",
        "CUDA_HOME": "/cuda",
        "HOME": "/x",
        "SECRET": "no",
    }
    assert exported_env(environ, str(cwd), str(home)) == {
        "CUDA_HOME": "/cuda",
        "NCCL_IB_DISABLE": "1",
        "OMP_NUM_THREADS": "4",
        "PYTHONPATH": "/src",
        "NCCL_DEBUG": "INFO",
        "HF_HOME": "/data/hf",
        "QUOTED": "a b",
    }
    with pytest.raises(EnvFileError, match=r"\.slipstream_env line 2: expected KEY=VALUE, got 'not a pair'"):
        parse_env_file("A=1\nnot a pair\n", "/job/.slipstream_env")


def test_node_rank_from_runner_environment():
    assert node_rank_from("3", {}) == 3
    assert node_rank_from("slurm", {"SLURM_NODEID": "2"}) == 2
    assert node_rank_from("mpi", {"PMI_RANK": "1"}) == 1
    assert node_rank_from("mpi", {"OMPI_COMM_WORLD_RANK": "4", "PMI_RANK": "1"}) == 4
    with pytest.raises(PlanError, match="none of OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK is set"):
        node_rank_from("mpi", {})


def test_remote_command_cannot_be_shell_injected():
    nasty = ("; touch /tmp/pwned", "$(touch /tmp/pwned)", "`id`", "a'b\"c", "--flag=x y")
    job = Job(
        nodes=(Node("node-a", (0, 1)),),
        script="train script.py",
        script_args=nasty,
        master_addr="node-a",
        master_port=29500,
        env={"NCCL_SOCKET_IFNAME": "eth0,eth1", "ODD": "$HOME;x"},
        cwd="/shared/my job",
        python="/opt/py/bin/python",
    )
    remote = remote_shell_command(job, "0", (0, 1), watch_stdin=True)
    # What the remote shell will see, word by word: nothing became syntax.
    words = shlex.split(remote)
    assert words[:4] == ["cd", "/shared/my job", "&&", "exec"]
    assert words[4:7] == ["env", "NCCL_SOCKET_IFNAME=eth0,eth1", "ODD=$HOME;x"]
    assert words[-6:] == ["train script.py", *nasty]


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    """A job directory and an environment with nothing to export, so golden lines are stable."""
    for key in list(os.environ):
        if key.startswith(EXPORT_PREFIXES) or key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("print('hi')\n")
    (tmp_path / "hostfile").write_text(HOSTFILE)
    (tmp_path / ".slipstream_env").write_text("NCCL_DEBUG=INFO\n")
    return tmp_path


def _dry_run(argv: list[str], capsys) -> str:
    assert main(["run", "--dry_run", *argv]) == 0
    return capsys.readouterr().out.strip()


def _agent(node_rank: str, nproc: str | None, extra: str = "") -> str:
    py = shlex.quote(sys.executable)
    nproc_part = f" --nproc_per_node {nproc}" if nproc else ""
    return (
        f"{py} -m slipstream.launcher.cli run --launcher local --num_nodes 2 --node_rank {node_rank}{nproc_part} "
        f"--master_addr node-a --master_port 29500{extra}"
    )


def test_dry_run_ssh(clean_env, capsys):
    out = _dry_run(
        [
            "--hostfile",
            "hostfile",
            "--num_nodes",
            "2",
            "--ssh_port",
            "2222",
            "--launcher_args=-o ConnectTimeout=5",
            "--max_restarts",
            "1",
            "train.py",
            "--lr",
            "0.1",
        ],
        capsys,
    )
    cwd = shlex.quote(str(clean_env))
    expected = []
    for rank, host in enumerate(("node-a", "node-b")):
        remote = (
            f"cd {cwd} && exec env NCCL_DEBUG=INFO {_agent(str(rank), '4', ' --max_restarts 1 --exit_on_stdin_close')} "
            "train.py --lr 0.1"
        )
        expected.append(f"# node {rank} ({host})\nssh -p 2222 -o ConnectTimeout=5 -- {host} {shlex.quote(remote)}")
    assert out == "\n".join(expected)


def test_dry_run_pdsh(clean_env, capsys):
    out = _dry_run(
        ["--hostfile", "hostfile", "--include", "node-a:2,3@node-b:2,3", "--launcher", "pdsh", "train.py"], capsys
    )
    remote = f"cd {shlex.quote(str(clean_env))} && exec env NCCL_DEBUG=INFO CUDA_VISIBLE_DEVICES=2,3 {_agent('%n', '2')} train.py"
    assert out == f"# all 2 nodes\npdsh -S -R ssh -f 1024 -w node-a,node-b {shlex.quote(remote)}"


def test_dry_run_slurm_inside_an_allocation(clean_env, capsys, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    out = _dry_run(["--launcher", "slurm", "--launcher_args=--gres=gpu:4", "train.py"], capsys)
    agent = _agent("slurm", None).replace("node-a", "gpu07")
    assert out == (
        "# all 2 nodes\nsrun --nodes 2 --ntasks 2 --ntasks-per-node 1 --kill-on-bad-exit=1 --nodelist gpu07,gpu08 "
        f"--chdir {shlex.quote(str(clean_env))} --gres=gpu:4 env NCCL_DEBUG=INFO {agent} train.py"
    )


def test_dry_run_mpi(clean_env, capsys):
    out = _dry_run(["--hostfile", "hostfile", "--exclude", "node-c", "--launcher", "mpi", "train.py", "x y"], capsys)
    assert out == (
        "# all 2 nodes\nmpirun -n 2 --host node-a,node-b --map-by node --bind-to none "
        f"-wdir {shlex.quote(str(clean_env))} env NCCL_DEBUG=INFO {_agent('mpi', '4')} train.py 'x y'"
    )


def test_dry_run_one_node(clean_env, capsys):
    out = _dry_run(["--nproc_per_node", "2", "--master_port", "29600", "train.py"], capsys)
    assert out == (
        f"# node 0 (this machine)\n{shlex.quote(sys.executable)} -m slipstream.launcher.cli run --launcher local "
        "--nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29600 train.py"
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--hostfile", "hostfile", "--include", "node-z", "train.py"],
            "--include: host 'node-z' is not in the hostfile",
        ),
        (
            ["--hostfile", "hostfile", "--include", "node-c:5", "train.py"],
            "host 'node-c' has 2 slot(s) in the hostfile (0-1), asked for slot 5",
        ),
        (
            ["--hostfile", "hostfile", "--nproc_per_node", "8", "train.py"],
            "--nproc_per_node 8: host 'node-a' has only 4 slot(s)",
        ),
        (
            ["--hostfile", "missing_hostfile", "train.py"],
            "--hostfile: cannot read missing_hostfile: No such file or directory",
        ),
        (
            ["--hostfile", "bad_hostfile", "train.py"],
            "bad_hostfile line 2: expected 'HOST slots=N', got 'node-b slots 4'",
        ),
        (["--hostfile", "hostfile", "missing.py"], "script not found: missing.py"),
        (["--launcher", "ssh", "train.py"], "--launcher ssh: needs --hostfile"),
        (["--launcher", "slurm", "train.py"], "--launcher slurm: SLURM_JOB_NODELIST is not set"),
        (
            ["--hostfile", "hostfile", "--launcher", "local", "train.py"],
            "--launcher local runs one node, the hostfile selects 3",
        ),
        (
            ["--hostfile", "hostfile", "--launcher", "mpi", "train.py"],
            "--launcher mpi starts the same command on every node, but the selected slots differ",
        ),
        (["--num_nodes", "2", "train.py"], "pass --node_rank (0 to N-1) on each node"),
        (
            ["--num_nodes", "2", "--node_rank", "2", "--master_addr", "a", "--master_port", "1", "train.py"],
            "--node_rank 2: must be less than --num_nodes 2",
        ),
        (
            ["--num_nodes", "2", "--node_rank", "1", "train.py"],
            "--master_addr and --master_port: required with --num_nodes > 1",
        ),
        (
            ["--hostfile", "hostfile", "--node_rank", "1", "train.py"],
            "--node_rank: the runner numbers the nodes of a --hostfile itself",
        ),
        (["--include", "elsewhere:0", "train.py"], "host 'elsewhere' is not this machine"),
    ],
)
def test_bad_input_is_a_one_line_usage_error(clean_env, capsys, argv, message):
    (clean_env / "bad_hostfile").write_text("node-a slots=4\nnode-b slots 4\n")
    with pytest.raises(SystemExit) as exit:
        main(["run", *argv])
    assert exit.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("slipstream run: error: ") and message in error, error


def test_missing_runner_program_is_named(clean_env, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(clean_env))  # no pdsh (nor anything else) on it
    assert main(["run", "--hostfile", "hostfile", "--exclude", "node-c", "--launcher", "pdsh", "train.py"]) == 127
    assert "slipstream run: --launcher pdsh: pdsh is not installed or not on PATH" in capsys.readouterr().err


def _pdsh_substitute(argument: str, host: str, user: str, rank: int) -> str:
    """What pdsh does to each word of the remote command (pipecmd_format_arg in pdsh's sources):
    %h host, %u user, %n rank, %% a single %, any other %x left as it is."""
    out, i = [], 0
    while i < len(argument):
        if argument[i] == "%" and i + 1 < len(argument):
            code = argument[i + 1]
            out.append({"h": host, "u": user, "n": str(rank), "%": "%"}.get(code, "%" + code))
            i += 2
        else:
            out.append(argument[i])
            i += 1
    return "".join(out)


PERCENT_ARGS = ["--name", "%h-%u", "50%", "%%n", "100%x"]


def test_dry_run_pdsh_escapes_percent_signs(clean_env, capsys, monkeypatch):
    # Issue 20 #13: pdsh rewrites %h/%u/%n/%% anywhere in the command; only its %n may be ours.
    job = clean_env / "run%h"
    job.mkdir()
    (job / "train.py").write_text("print('hi')\n")
    (job / "hostfile").write_text(HOSTFILE)
    (job / ".slipstream_env").write_text("TAG=100%n%%\n")
    monkeypatch.chdir(job)
    out = _dry_run(
        ["--hostfile", "hostfile", "--exclude", "node-c", "--launcher", "pdsh", "train.py", *PERCENT_ARGS], capsys
    )
    remote = (
        f"cd {shlex.quote(str(clean_env))}/run%%h && exec env NCCL_DEBUG=INFO TAG=100%%n%%%% {_agent('%n', '4')} "
        "train.py --name %%h-%%u 50%% %%%%n 100%%x"
    )
    assert out == f"# all 2 nodes\npdsh -S -R ssh -f 1024 -w node-a,node-b {shlex.quote(remote)}"


def test_pdsh_passes_arguments_environment_and_paths_unchanged():
    job = Job(
        nodes=(Node("node-a", (0,)), Node("node-b", (0,))),
        script="/jobs/%u/train.py",
        script_args=tuple(PERCENT_ARGS),
        master_addr="fe80::1%eth0",
        master_port=29500,
        env={"TAG": "100%n%%", "P": "%"},
        cwd="/shared/50%/%h",
        python="/opt/%n/python",
    )
    remote = pdsh_command(job)[-1]
    # What the remote shell receives on node 1 after pdsh's substitution, word by word.
    words = shlex.split(_pdsh_substitute(remote, host="node-b", user="alice", rank=1))
    assert words[:4] == ["cd", "/shared/50%/%h", "&&", "exec"]
    assert words[4:7] == ["env", "TAG=100%n%%", "P=%"]
    agent = words[7:]
    assert agent[0] == "/opt/%n/python"
    assert agent[agent.index("--node_rank") + 1] == "1"  # pdsh's own %n, substituted
    assert agent[agent.index("--master_addr") + 1] == "fe80::1%eth0"
    assert agent[-len(PERCENT_ARGS) - 1 :] == ["/jobs/%u/train.py", *PERCENT_ARGS]
    assert pdsh_escape("%h %u %n %% %") == "%%h %%u %%n %%%% %%"


@pytest.mark.parametrize("slots", ["99999999999999", "1025", "9" * 5000])
def test_huge_slots_are_refused_before_anything_is_allocated(slots):
    # Issue 20 #15: select() built a list of that many slots (MemoryError or a traceback).
    with pytest.raises(HostfileError) as error:
        parse_hostfile_text(f"node-a slots=2\nnode-b slots={slots}\n", "hosts.txt")
    message = str(error.value)
    assert message.startswith("hosts.txt line 2: slots=") and "is more than 1024 processes on one node" in message
    assert "set slots to the node's number of devices" in message and "\n" not in message and len(message) < 200
    assert parse_hostfile_text("node-a slots=1024\n") == {"node-a": 1024}
