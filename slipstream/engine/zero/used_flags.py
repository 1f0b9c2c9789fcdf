"""Which trainable parameters got a gradient in an accumulation window, on any rank of their group.

[Note: flags on the host] The gradient hooks run once per parameter per backward, so marking a parameter must
cost a byte store: a tensor element write is a dispatcher call (microseconds; a kernel launch on CUDA), paid per
parameter per step. The flags cross to the device once per step for the MAX reduction over each group and come
back once as a list of bools, which the masters read: one host synchronisation per step, where reading a device
tensor's element per parameter (``if used[i]``) waited for the device once per parameter.

[Note: used here, used everywhere] A parameter that got a gradient on this rank got one on some rank of its
group, so where this rank marked every flag (a dense model: every step of most trainings) the answer is known
without the reduced flags: they are not read back, and the step has no host synchronisation for them ([Note:
the step does not wait for the device] in ``optimizer_step.py``). The all-reduce itself still runs: a peer that
missed a parameter needs this rank's flags.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream import comm


class UsedFlags:
    def __init__(self, count: int, device: torch.device) -> None:
        self.device = device
        # this rank's: a hook stores 1 at a parameter's index (arrivals.py, stage3/reducer.py)
        self.local = bytearray(count)
        self._all = [True] * count

    def reduce(self, members: list[tuple[dist.ProcessGroup | None, list[int]]]) -> list[bool]:
        """Any rank's flags (MAX over each parameter's group: reduce_flags); collective."""
        flags = torch.zeros(len(self.local), dtype=torch.float32, device=self.device)
        self.write(flags)
        reduce_flags(flags, members)
        return self._all if self.all_here() else flags.bool().tolist()

    def write(self, into: torch.Tensor) -> None:
        """This rank's flags into ``into`` (for a sum: reduce_flags', or grad_buckets' tail)."""
        if self.local:  # one copy of the bytes (frombuffer shares them, and refuses none): no Python work per parameter
            into.copy_(torch.frombuffer(self.local, dtype=torch.uint8))

    def read(self, summed: torch.Tensor) -> list[bool]:
        """Any rank's flags from what :meth:`write` wrote after a sum (any positive scaling of it)."""
        return self._all if self.all_here() else (summed > 0).tolist()

    def all_here(self) -> bool:
        """Every flag set on this rank: every parameter was used on some rank ([Note: used here, used everywhere])."""
        return 0 not in self.local

    def reset(self) -> None:
        self.local[:] = bytes(len(self.local))


def reduce_flags(used: torch.Tensor, members: list[tuple[dist.ProcessGroup | None, list[int]]]) -> None:
    """``used[i]`` = 1 where parameter ``i`` got a gradient on any rank of its group (MAX, in place)."""
    if len(members) == 1:
        comm.all_reduce(used, op=dist.ReduceOp.MAX, group=members[0][0], tag="used-parameter flags", inline=True).wait()
        return
    for group, indices in members:
        if not indices:  # the same on every rank of the group: its ranks share their parameter groups
            continue
        mine = torch.tensor(indices, dtype=torch.long, device=used.device)
        flags = used.index_select(0, mine)
        comm.all_reduce(flags, op=dist.ReduceOp.MAX, group=group, tag="used-parameter flags", inline=True).wait()
        used.index_copy_(0, mine, flags)
