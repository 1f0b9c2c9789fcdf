"""Which hosts and slots a job runs on: the hostfile, ``--include``/``--exclude``, Slurm node lists.

The hostfile is DeepSpeed's (and MPI's) format, one host per line::

    # comments and blank lines are ignored
    worker-1 slots=4
    worker-2 slots=4

A *slot* is one process (one GPU on a GPU node). ``--include``/``--exclude`` take
``host1:0,1@host2``: ``@`` separates hosts, ``:`` lists slot indices, a bare host means all its
slots. The result of every function here is an ordered ``{host: [slot, ...]}``; the first host
is node 0 and, unless told otherwise, the master.

Every mistake raises :class:`HostfileError` with one line naming the problem.
"""

from __future__ import annotations

import re

from slipstream.errors import SlipstreamError
from slipstream.launcher.textfile import read_small_text
from slipstream.launcher.usage import shown

Resources = dict[str, list[int]]
# More processes than any node has devices: a typo (slots=80000), refused before it allocates a
# slot list of that length (and before a rank count like that reaches torch elastic).
MAX_SLOTS = 1024
MAX_NODELIST_HOSTS = 65536  # a Slurm node list that expands to more is a malformed range
_SLURM_FIX = "run inside salloc/sbatch or pass --hostfile"

# Hostnames, IPv4/IPv6 addresses and ssh's user@host. Anything else (spaces, quotes, ';', a
# leading '-' that ssh would read as an option) is refused here, before it can reach a command.
_HOST = re.compile(r"[A-Za-z0-9_.:\[\]%][A-Za-z0-9_.:\[\]%@-]*")


class HostfileError(SlipstreamError, ValueError):
    """A hostfile, ``--include``/``--exclude`` or node-list mistake (one line, names the problem)."""


def check_host(name: str, where: str) -> str:
    if not _HOST.fullmatch(name):
        raise HostfileError(
            f"{where}: {shown(name)} is not a valid host name; use a name or address "
            "(letters, digits, '.', '-', '_', ':', optionally 'user@' before it)"
        )
    return name


def parse_hostfile_text(text: str, source: str = "hostfile") -> dict[str, int]:
    """``{host: slots}`` in file order from the text of a hostfile."""
    hosts: dict[str, int] = {}
    first_line: dict[str, int] = {}  # the machine (user@ removed) -> the line that named it
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        fields = line.split()
        host = check_host(fields[0], where)
        if len(fields) != 2 or not fields[1].startswith("slots="):
            raise HostfileError(
                f"{where}: expected 'HOST slots=N', got {shown(raw.strip())}; write one host and its "
                "process count per line, e.g. 'worker-1 slots=8'"
            )
        slots = _slot_count(fields[1][len("slots=") :], where)
        machine = host.rpartition("@")[2]
        if machine in first_line:
            raise HostfileError(
                f"{where}: host {machine!r} is listed twice (first on line {first_line[machine]}); "
                "keep one line per host with all its slots"
            )
        first_line[machine] = number
        hosts[host] = slots
    if not hosts:
        raise HostfileError(f"{source}: no hosts in it; add one 'HOST slots=N' line per node")
    return hosts


def _slot_count(count: str, where: str) -> int:
    # ASCII digits only: str.isdigit() also accepts '²', which int() then refuses with a traceback.
    digits = count.lstrip("0")
    if not re.fullmatch(r"[0-9]+", count) or not digits:
        raise HostfileError(f"{where}: slots must be a positive integer, got {shown(count)}; e.g. 'slots=8'")
    # Compared by length first: int() of thousands of digits raises instead of converting.
    if len(digits) > len(str(MAX_SLOTS)) or int(digits) > MAX_SLOTS:
        value = count if len(count) <= 20 else f"{count[:20]}... ({len(count)} digits)"
        raise HostfileError(
            f"{where}: slots={value} is more than {MAX_SLOTS} processes on one node; "
            "set slots to the node's number of devices (GPUs)"
        )
    return int(digits)


def parse_hostfile(path: str) -> dict[str, int]:
    return parse_hostfile_text(read_small_text(path, "--hostfile", HostfileError), source=path)


def parse_host_spec(spec: str, flag: str) -> dict[str, list[int] | None]:
    """``host1:0,1@host2`` → ``{"host1": [0, 1], "host2": None}`` (None: all slots)."""
    parsed: dict[str, list[int] | None] = {}
    for part in spec.split("@"):
        if not part:
            raise HostfileError(
                f"{flag}: empty host in {shown(spec)}; separate hosts with one '@', e.g. 'host1:0,1@host2'"
            )
        host, _, slots = part.partition(":")
        check_host(host, flag)
        if not _:
            parsed[host] = None
            continue
        try:
            indices = [int(s) for s in slots.split(",")]
        except ValueError:
            raise HostfileError(
                f"{flag}: slots of {host!r} must be integers like '{host}:0,1', got {shown(slots)}"
            ) from None
        if any(i < 0 for i in indices):
            raise HostfileError(
                f"{flag}: slot indices of {host!r} cannot be negative, got {shown(slots)}; slots count from 0"
            )
        previous = parsed.get(host) or []
        parsed[host] = sorted(set(previous) | set(indices))
    return parsed


def select(
    hosts: dict[str, int],
    include: str | None = None,
    exclude: str | None = None,
    num_nodes: int | None = None,
    nproc_per_node: int | None = None,
    pool: str = "the hostfile",
) -> Resources:
    """Apply ``--include``/``--exclude``, then ``--num_nodes`` (first N hosts), then
    ``--nproc_per_node`` (first N slots of each host). Order follows the hostfile.

    ``pool`` names where ``hosts`` came from in error messages ("this machine" without a hostfile).
    """
    if include is not None and exclude is not None:
        raise HostfileError("--include and --exclude cannot be used together; give one of them")
    available: Resources = {host: list(range(slots)) for host, slots in hosts.items()}
    chosen: Resources
    if include is not None:
        chosen = {}
        wanted = parse_host_spec(include, "--include")
        for host, slots in wanted.items():
            _check_known(host, slots, available, "--include", pool)
        for host in available:  # keep hostfile order, not the order on the command line
            if host in wanted:
                chosen[host] = list(available[host]) if wanted[host] is None else wanted[host]  # type: ignore[assignment]
    elif exclude is not None:
        chosen = {host: list(slots) for host, slots in available.items()}
        for host, slots in parse_host_spec(exclude, "--exclude").items():
            _check_known(host, slots, available, "--exclude", pool)
            if slots is None:
                del chosen[host]
            else:
                chosen[host] = [s for s in chosen[host] if s not in slots]
                if not chosen[host]:
                    del chosen[host]
    else:
        chosen = available
    if not chosen:
        raise HostfileError("no hosts left after --include/--exclude; leave at least one host and slot selected")
    if num_nodes is not None:
        if num_nodes > len(chosen):
            raise HostfileError(
                f"--num_nodes {num_nodes}: only {len(chosen)} host(s) available ({', '.join(chosen)}); "
                "lower --num_nodes or add hosts to the hostfile"
            )
        chosen = dict(list(chosen.items())[:num_nodes])
    if nproc_per_node is not None:
        for host, slots in chosen.items():
            if nproc_per_node > len(slots):
                raise HostfileError(
                    f"--nproc_per_node {nproc_per_node}: host {host!r} has only {len(slots)} slot(s) selected; "
                    "lower --nproc_per_node or select more slots of that host"
                )
        chosen = {host: slots[:nproc_per_node] for host, slots in chosen.items()}
    return chosen


def _check_known(host: str, slots: list[int] | None, available: Resources, flag: str, pool: str) -> None:
    if host not in available:
        raise HostfileError(
            f"{flag}: host {host!r} is not in {pool} (hosts: {', '.join(available)}); name one of those"
        )
    if slots:
        count = len(available[host])
        beyond = [str(s) for s in slots if s >= count]
        if beyond:
            listed = ", ".join(beyond[:8]) + (f", ... ({len(beyond)} in all)" if len(beyond) > 8 else "")
            raise HostfileError(
                f"{flag}: host {host!r} has {count} slot(s) in {pool} (0-{count - 1}), "
                f"asked for slot {listed}; slots count from 0"
            )


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list: ``gpu[01-03,7],login1`` → ``gpu01, gpu02, gpu03, gpu7, login1``.

    Covers the forms ``SLURM_JOB_NODELIST`` uses (one bracket group per name, zero-padded
    ranges); ``scontrol show hostnames`` is the authority when it is available.
    """
    names: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        match = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if not match:
            names.append(check_host(item, "SLURM_JOB_NODELIST"))
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            if not re.fullmatch(r"[0-9]{1,9}", low) or (high and not re.fullmatch(r"[0-9]{1,9}", high)):
                raise HostfileError(f"SLURM_JOB_NODELIST: cannot expand {shown(item)}; {_SLURM_FIX}")
            if len(names) + int(high or low) - int(low) >= MAX_NODELIST_HOSTS:
                raise HostfileError(
                    f"SLURM_JOB_NODELIST: {shown(item)} expands to more than {MAX_NODELIST_HOSTS} hosts; {_SLURM_FIX}"
                )
            for number in range(int(low), int(high or low) + 1):
                names.append(check_host(f"{prefix}{number:0{len(low)}d}{suffix}", "SLURM_JOB_NODELIST"))
    if not names:
        raise HostfileError(f"SLURM_JOB_NODELIST: no hosts in {shown(nodelist)}; {_SLURM_FIX}")
    return names
