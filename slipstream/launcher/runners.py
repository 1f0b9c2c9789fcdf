"""The command each multi-node runner executes: one per-node agent on every node.

Every runner starts the same thing on each node: ``python -m slipstream.launcher.cli run
--launcher local --num_nodes N --node_rank R ...``, the per-node agent (``agent.py``) that starts
that node's ranks. The runners only differ in how they reach the nodes and how a node learns its
rank:

* ``ssh``: one ``ssh`` per host; the node rank is written into each command.
* ``pdsh``: one ``pdsh`` for all hosts; pdsh puts each node's rank where ``%n`` stands. pdsh
  rewrites ``%h``, ``%u``, ``%n`` and ``%%`` anywhere in the command, so every ``%`` of ours (paths,
  environment values, script arguments) is doubled (:func:`pdsh_escape`) and only that ``%n``
  is substituted: the script receives its arguments unchanged.
* ``slurm``: one ``srun`` with one task per node; the agent reads ``SLURM_NODEID``.
* ``mpi``: one ``mpirun`` (Open MPI syntax) with one process per node; the agent reads
  ``OMPI_COMM_WORLD_RANK`` (or ``PMIX_RANK``/``PMI_RANK``).

Commands are argument lists. Where a remote shell will parse a string (ssh, pdsh), every piece is
``shlex.quote``d, so a host name or script argument can never become shell syntax.
Building commands is pure (no processes), which is what ``--dry_run`` prints and tests compare.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from slipstream.errors import SlipstreamError

RUNNERS = ("ssh", "pdsh", "slurm", "mpi")


@dataclass(frozen=True)
class Node:
    host: str
    slots: tuple[int, ...] | None  # None: the node's agent decides (one rank per local device)


@dataclass(frozen=True)
class Job:
    """Everything a runner needs to write the per-node commands."""

    nodes: tuple[Node, ...]
    script: str
    script_args: tuple[str, ...]
    master_addr: str
    master_port: int
    max_restarts: int = 0
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = "."
    python: str = sys.executable
    launcher_args: tuple[str, ...] = ()
    ssh_port: int | None = None


class RunnerError(SlipstreamError, ValueError):
    """The job cannot be expressed with the chosen runner (one line, says what to do instead)."""


def commands(runner: str, job: Job) -> list[list[str]]:
    """The commands to start, one per ssh host, or a single one for pdsh/slurm/mpi."""
    if runner == "ssh":
        return [ssh_command(job, rank) for rank in range(len(job.nodes))]
    if runner == "pdsh":
        return [pdsh_command(job)]
    if runner == "slurm":
        return [srun_command(job)]
    if runner == "mpi":
        return [mpirun_command(job)]
    raise RunnerError(f"--launcher: unknown runner {runner!r}; choose one of local, {', '.join(RUNNERS)}")


def verbatim(word: str) -> str:
    return word


def pdsh_escape(word: str) -> str:
    """``word`` as pdsh must see it to pass it on unchanged: pdsh turns ``%%`` into ``%`` and
    ``%h``/``%u``/``%n`` into the host, user and node rank (any other ``%x`` it leaves alone)."""
    return word.replace("%", "%%")


def agent_argv(
    job: Job,
    node_rank: str,
    slots: tuple[int, ...] | None,
    watch_stdin: bool = False,
    escape: Callable[[str], str] = verbatim,
) -> list[str]:
    """The per-node agent's command line (no environment, no directory).

    ``escape`` applies to every word that comes from the job (interpreter, address, script and
    its arguments), never to ``node_rank``, which is pdsh's own ``%n`` with the pdsh runner.
    """
    argv = [escape(job.python), "-m", "slipstream.launcher.cli", "run", "--launcher", "local"]
    argv += ["--num_nodes", str(len(job.nodes)), "--node_rank", node_rank]
    if slots is not None:
        argv += ["--nproc_per_node", str(len(slots))]
    argv += ["--master_addr", escape(job.master_addr), "--master_port", str(job.master_port)]
    if job.max_restarts:
        argv += ["--max_restarts", str(job.max_restarts)]
    if watch_stdin:
        argv.append("--exit_on_stdin_close")
    return [*argv, escape(job.script), *map(escape, job.script_args)]


def node_env(job: Job, slots: tuple[int, ...] | None) -> dict[str, str]:
    """The exported variables, plus ``CUDA_VISIBLE_DEVICES`` when only some devices were chosen."""
    env = dict(job.env)
    if slots is not None and list(slots) != list(range(len(slots))):
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    return env


def remote_shell_command(
    job: Job, node_rank: str, slots: tuple[int, ...] | None, watch_stdin: bool, escape: Callable[[str], str] = verbatim
) -> str:
    """One string for a remote login shell: change directory, then exec the agent under ``env``.

    ``escape`` applies to the directory, the environment and the agent's words (see ``agent_argv``).
    """
    env = [escape(f"{key}={value}") for key, value in node_env(job, slots).items()]
    agent = shlex.join(["env", *env, *agent_argv(job, node_rank, slots, watch_stdin, escape)])
    # shlex.join leaves '%' unquoted (not shell syntax), so pdsh's substitution still sees "%n".
    return f"cd {shlex.quote(escape(job.cwd))} && exec {agent}"


def ssh_command(job: Job, node_rank: int) -> list[str]:
    node = job.nodes[node_rank]
    port = ["-p", str(job.ssh_port)] if job.ssh_port else []
    # "--" ends ssh's options: the host can never be read as one (hostfile.py also refuses
    # names starting with "-"). The agent exits when its stdin closes, i.e. when this ssh dies.
    remote = remote_shell_command(job, str(node_rank), node.slots, watch_stdin=True)
    return ["ssh", *port, *job.launcher_args, "--", node.host, remote]


def pdsh_command(job: Job) -> list[str]:
    slots = _uniform_slots(job, "pdsh")
    hosts = ",".join(node.host for node in job.nodes)
    remote = remote_shell_command(job, "%n", slots, watch_stdin=False, escape=pdsh_escape)
    return ["pdsh", "-S", "-R", "ssh", "-f", "1024", "-w", hosts, *job.launcher_args, remote]


def srun_command(job: Job) -> list[str]:
    slots = _uniform_slots(job, "slurm")
    count = str(len(job.nodes))
    argv = ["srun", "--nodes", count, "--ntasks", count, "--ntasks-per-node", "1", "--kill-on-bad-exit=1"]
    if all(node.host for node in job.nodes):
        argv += ["--nodelist", ",".join(node.host for node in job.nodes)]
    argv += ["--chdir", job.cwd, *job.launcher_args]
    env = [f"{key}={value}" for key, value in node_env(job, slots).items()]
    return [*argv, "env", *env, *agent_argv(job, "slurm", slots)]


def mpirun_command(job: Job) -> list[str]:
    slots = _uniform_slots(job, "mpi")
    count = str(len(job.nodes))
    hosts = ",".join(node.host for node in job.nodes)
    # One agent per node, not bound to a core: the agent's ranks need all of them.
    argv = ["mpirun", "-n", count, "--host", hosts, "--map-by", "node", "--bind-to", "none", "-wdir", job.cwd]
    env = [f"{key}={value}" for key, value in node_env(job, slots).items()]
    return [*argv, *job.launcher_args, "env", *env, *agent_argv(job, "mpi", slots)]


def _uniform_slots(job: Job, runner: str) -> tuple[int, ...] | None:
    """pdsh/srun/mpirun run one command on every node, so every node must get the same slots."""
    distinct = {node.slots for node in job.nodes}
    if len(distinct) > 1:
        detail = ", ".join(f"{node.host}:{','.join(map(str, node.slots or ()))}" for node in job.nodes)
        raise RunnerError(
            f"--launcher {runner} starts the same command on every node, but the selected slots differ "
            f"({detail}); select the same slots on every host, or use --launcher ssh"
        )
    return distinct.pop()


def format_commands(runner: str, job: Job, argvs: list[list[str]]) -> str:
    """What ``--dry_run`` prints: one line per command, copy-pasteable into a shell."""
    lines = []
    for index, argv in enumerate(argvs):
        label = f"node {index} ({job.nodes[index].host})" if runner == "ssh" else f"all {len(job.nodes)} nodes"
        lines.append(f"# {label}\n{shlex.join(argv)}")
    return "\n".join(lines)
