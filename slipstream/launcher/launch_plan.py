"""From ``slipstream run``'s arguments to what runs: this node's agent, or a runner for many nodes.

Three shapes:

* one node, no hostfile: the agent runs here (``--nproc_per_node`` ranks);
* one node of a multi-node job started by hand or by a runner (``--num_nodes N --node_rank R``):
  the agent runs here and meets the other nodes' agents at ``--master_addr:--master_port``;
* a hostfile (or a Slurm allocation): a runner (ssh, pdsh, slurm, mpi) starts one agent per node.
  A hostfile that selects only this machine runs here without a runner.

Mistakes raise :class:`PlanError` (one line); the CLI prints it as a usage error.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slipstream.errors import SlipstreamError
from slipstream.launcher.agent import LocalLaunch
from slipstream.launcher.environment import EnvFileError, exported_env
from slipstream.launcher.hostfile import (
    HostfileError,
    check_host,
    expand_nodelist,
    parse_host_spec,
    parse_hostfile,
    select,
)
from slipstream.launcher.runners import Job, Node, RunnerError, commands
from slipstream.launcher.usage import shown

DEFAULT_MULTI_NODE_PORT = 29500
# Where an agent started by a runner finds its node rank (one agent per node, so the runner's
# process rank is the node rank).
NODE_RANK_ENV = {"slurm": ("SLURM_NODEID", "SLURM_PROCID"), "mpi": ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK")}


class PlanError(SlipstreamError, ValueError):
    """An impossible or inconsistent combination of arguments (one line)."""


@dataclass(frozen=True)
class Plan:
    local: LocalLaunch | None = None  # run this node's agent in this process
    env: dict[str, str] = field(default_factory=dict)  # set before the local agent starts
    runner: str | None = None  # or start one agent per node with this runner
    job: Job | None = None
    argvs: list[list[str]] = field(default_factory=list)


def make_plan(args: Any, environ: Mapping[str, str], cwd: str, home: str | None) -> Plan:
    try:
        if args.master_addr is not None:  # it reaches every rank and, quoted, the runners' commands
            check_host(args.master_addr, "--master_addr")
        if args.hostfile is None and args.launcher in (None, "local"):
            return _this_node(args, environ)
        return _with_hosts(args, environ, cwd, home)
    except (HostfileError, RunnerError, EnvFileError) as err:
        raise PlanError(str(err)) from None


def node_rank_from(value: str, environ: Mapping[str, str]) -> int:
    """``--node_rank``: an integer, or ``slurm``/``mpi`` to read it from the runner's environment."""
    if value in NODE_RANK_ENV:
        for name in NODE_RANK_ENV[value]:
            if name in environ:
                return _non_negative(environ[name], f"--node_rank {value}: {name}")
        names = ", ".join(NODE_RANK_ENV[value])
        raise PlanError(
            f"--node_rank {value}: none of {names} is set; is this running under the {value} runner? "
            "Otherwise pass the node's rank as a number"
        )
    return _non_negative(value, "--node_rank")


def _this_node(args: Any, environ: Mapping[str, str]) -> Plan:
    num_nodes = args.num_nodes or 1
    nproc = args.nproc_per_node
    env: dict[str, str] = {}
    if args.include is not None or args.exclude is not None:
        # No hostfile: this machine alone, its slots being its devices ("localhost:1" picks GPU 1).
        from slipstream.launcher.agent import default_nproc_per_node

        pool = {"localhost": nproc or default_nproc_per_node()}
        include, exclude = _local_spec(args.include, "--include"), _local_spec(args.exclude, "--exclude")
        slots = select(pool, include, exclude, pool="this machine")["localhost"]
        nproc = len(slots)
        if slots != list(range(len(slots))):
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
    if num_nodes == 1:
        if args.node_rank not in (None, "0"):
            raise PlanError(
                "--node_rank: only meaningful with --num_nodes greater than 1; drop it, or give --num_nodes N"
            )
        local = LocalLaunch(
            script=args.script,
            script_args=tuple(args.script_args),
            nproc_per_node=nproc,
            master_addr=args.master_addr or "127.0.0.1",
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            exit_on_stdin_close=args.exit_on_stdin_close,
        )
        return Plan(local=local, env=env)
    if args.node_rank is None:
        raise PlanError(
            f"--num_nodes {num_nodes} without a hostfile starts one node of the job: pass --node_rank "
            "(0 to N-1) on each node, or give a --hostfile and let a --launcher start every node"
        )
    node_rank = node_rank_from(args.node_rank, environ)
    if node_rank >= num_nodes:
        raise PlanError(f"--node_rank {node_rank}: must be less than --num_nodes {num_nodes} (nodes count from 0)")
    if args.master_addr is None or args.master_port is None:
        raise PlanError(
            "--master_addr and --master_port: required with --num_nodes > 1 "
            "(node 0's address and a free port on it, the same on every node)"
        )
    local = LocalLaunch(
        script=args.script,
        script_args=tuple(args.script_args),
        nproc_per_node=nproc,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        num_nodes=num_nodes,
        node_rank=node_rank,
        exit_on_stdin_close=args.exit_on_stdin_close,
    )
    return Plan(local=local, env=env)


def _with_hosts(args: Any, environ: Mapping[str, str], cwd: str, home: str | None) -> Plan:
    if args.node_rank is not None:
        raise PlanError(
            "--node_rank: the runner numbers the nodes of a --hostfile itself; --node_rank is for "
            "starting one node by hand (--launcher local --num_nodes N)"
        )
    launcher = args.launcher
    if args.hostfile is not None:
        hosts: dict[str, int] | None = parse_hostfile(args.hostfile)
    elif launcher == "slurm":
        hosts = None
    else:
        raise PlanError(f"--launcher {launcher}: needs --hostfile (one 'HOST slots=N' line per node)")

    if hosts is None:  # inside a Slurm allocation: its nodes, each agent counts its own devices
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if not nodelist:
            raise PlanError(
                "--launcher slurm: SLURM_JOB_NODELIST is not set (not inside salloc/sbatch); "
                "run inside an allocation or pass --hostfile"
            )
        names = expand_nodelist(nodelist)
        if args.include is not None or args.exclude is not None:
            raise PlanError("--include/--exclude need a --hostfile (Slurm chooses the nodes of an allocation)")
        count = args.num_nodes or len(names)
        if count > len(names):
            raise PlanError(
                f"--num_nodes {count}: the Slurm allocation has {len(names)} node(s); "
                "lower --num_nodes or allocate more"
            )
        slots = tuple(range(args.nproc_per_node)) if args.nproc_per_node else None
        nodes = tuple(Node(name, slots) for name in names[:count])
    else:
        chosen = select(hosts, args.include, args.exclude, args.num_nodes, args.nproc_per_node)
        nodes = tuple(Node(host, tuple(slots)) for host, slots in chosen.items())

    if launcher is None:
        launcher = "local" if len(nodes) == 1 and _is_this_machine(nodes[0].host) else "ssh"
    if launcher == "local":
        if len(nodes) > 1:
            raise PlanError(
                f"--launcher local runs one node, the hostfile selects {len(nodes)}; use --launcher "
                "ssh, pdsh, slurm or mpi, or start `slipstream run --num_nodes N --node_rank R` on each node"
            )
        slots = nodes[0].slots or ()
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))} if list(slots) != list(range(len(slots))) else {}
        local = LocalLaunch(
            script=args.script,
            script_args=tuple(args.script_args),
            nproc_per_node=len(slots) or None,
            master_addr=args.master_addr or "127.0.0.1",
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            exit_on_stdin_close=args.exit_on_stdin_close,
        )
        return Plan(local=local, env=env)

    job = Job(
        nodes=nodes,
        script=args.script,
        script_args=tuple(args.script_args),
        master_addr=args.master_addr or nodes[0].host.rpartition("@")[2],
        master_port=args.master_port or DEFAULT_MULTI_NODE_PORT,
        max_restarts=args.max_restarts,
        env=exported_env(environ, cwd, home),
        cwd=cwd,
        launcher_args=tuple(_split(args.launcher_args)),
        ssh_port=args.ssh_port,
    )
    return Plan(runner=launcher, job=job, argvs=commands(launcher, job))


def _local_spec(spec: str | None, flag: str) -> str | None:
    """``localhost:1``, ``127.0.0.1:1`` or this host's name all mean this machine here."""
    if spec is None:
        return None
    parse_host_spec(spec, flag)  # the same form and the same errors as with a hostfile
    parts = []
    for part in spec.split("@"):
        host, sep, slots = part.partition(":")
        if not _is_this_machine(host):
            raise PlanError(f"{flag}: host {shown(host)} is not this machine; pass a --hostfile for other hosts")
        parts.append(f"localhost{sep}{slots}")
    return "@".join(parts)


def _is_this_machine(host: str) -> bool:
    name = host.rpartition("@")[2]
    return name in ("localhost", "127.0.0.1", "::1", socket.gethostname(), socket.getfqdn())


def _split(text: str | None) -> list[str]:
    import shlex

    try:
        return shlex.split(text) if text else []
    except ValueError as err:  # "No closing quotation", "No escaped character"
        raise PlanError(
            f"--launcher_args {shown(text or '')}: {err}; give the runner's arguments as one shell-quoted string"
        ) from None


def _non_negative(text: str, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise PlanError(f"{what}: expected a non-negative integer (or slurm/mpi), got {shown(text)}") from None
    if value < 0:
        raise PlanError(f"{what}: must be 0 or more, got {value} (nodes count from 0)")
    return value


def home_directory() -> str | None:
    home = os.path.expanduser("~")
    return None if home == "~" else home
