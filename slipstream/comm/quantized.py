"""Block-wise quantized collectives: ZeRO++'s qwZ (INT8 weight all-gather) and qgZ (INT4 gradient reduce-scatter,
hierarchical: [Note: quantize only what crosses nodes]).

[Note: block-wise quantization] A tensor is cut into blocks of ``BLOCK`` elements; each block is
sent as signed integers of ``bits`` bits and one fp32 scale (its largest magnitude over the
largest integer), so an outlier costs precision only in its own block. Rounding is to nearest
(ties to even) and the decoding is the same on every rank, so every rank that receives a block
reads the same values: replicas never drift apart. On the wire a rank's piece is one byte tensor,
its integers (two per byte at INT4) followed by its scales, so the collective is a single plain
byte all-gather or all-to-all that any backend (gloo's shared-memory ring included) moves.

The quantized reduce-scatter is an all-to-all: rank ``i`` receives every rank's block-quantized
copy of chunk ``i``, decodes each to fp32 and sums them in rank order (fp32 accumulation; the
same order on every rank), then casts to the output's dtype. Per rank it sends ``(n−1)/n`` of the
quantized input, as the ring reduce-scatter sends ``(n−1)/n`` of the full-precision one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slipstream.comm.collectives import Work, all_gather_into_tensor, all_to_all_single, reduce_scatter_tensor

BLOCK = 256  # elements per scale: 1.6% overhead at INT8, 3.1% at INT4


def packed_nbytes(numel: int, bits: int, block: int = BLOCK) -> int:
    """Bytes of ``numel`` elements quantized to ``bits`` (4 or 8) with one fp32 scale per block."""
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + 4 * blocks


def quantize(values: torch.Tensor, bits: int, out: torch.Tensor | None = None, block: int = BLOCK) -> torch.Tensor:
    """``values`` (1-D, any float dtype) as the bytes of [Note: block-wise quantization]; into ``out`` when given."""
    numel = values.numel()
    out = (
        torch.empty(packed_nbytes(numel, bits, block), dtype=torch.uint8, device=values.device) if out is None else out
    )
    quantize_rows(values.reshape(1, numel), bits, out.view(1, -1), block)
    return out


def quantize_rows(rows: torch.Tensor, bits: int, out: torch.Tensor, block: int = BLOCK) -> None:
    """Each row of ``rows`` ([r, n]) quantized on its own into the same row of ``out`` ([r, packed_nbytes(n)]), in one pass."""
    if bits not in (4, 8):
        raise ValueError(f"quantize: {bits} bits; 4 and 8 are supported")
    count, numel = rows.shape
    blocks = -(-numel // block)
    x = rows.detach().float()
    if blocks * block != numel:
        x = torch.nn.functional.pad(x, (0, blocks * block - numel))
    x = x.view(count, blocks, block)
    top = 2 ** (bits - 1) - 1
    scales = x.abs().amax(dim=2).div_(top)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = x.div(scales.unsqueeze(2)).round_().clamp_(-top, top).to(torch.int8).view(count, -1)
    data = blocks * block * bits // 8
    if bits == 8:
        out[:, :data].copy_(q.view(torch.uint8))
    else:  # two per byte, offset to 0..15
        nibbles = (q + 8).to(torch.uint8).view(count, -1, 2)
        out[:, :data].copy_(nibbles[:, :, 0] | (nibbles[:, :, 1] << 4))
    out[:, data:].copy_(scales.contiguous().view(torch.uint8))


def dequantize(packed: torch.Tensor, numel: int, bits: int, block: int = BLOCK) -> torch.Tensor:
    """The fp32 values of ``quantize``'s bytes (``numel`` of them)."""
    return dequantize_rows(packed.view(1, -1), numel, bits, block)[0]


def dequantize_rows(packed: torch.Tensor, numel: int, bits: int, block: int = BLOCK) -> torch.Tensor:
    """``quantize_rows``' bytes ([r, packed_nbytes(numel)]) decoded to fp32 ([r, numel]), in one pass."""
    count = packed.shape[0]
    blocks = -(-numel // block)
    data = blocks * block * bits // 8
    scales = packed[:, data : data + 4 * blocks].contiguous().view(torch.float32)
    if bits == 8:
        q = packed[:, :data].view(torch.int8).float()
    else:
        b = packed[:, :data]
        q = torch.stack(((b & 0x0F).to(torch.int8) - 8, (b >> 4).to(torch.int8) - 8), dim=2).view(count, -1).float()
    return q.view(count, blocks, block).mul_(scales.unsqueeze(2)).view(count, -1)[:, :numel]


def all_gather_quantized(
    output: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None, tag: str = "", bits: int = 8
) -> Work:
    """``all_gather_into_tensor`` with every shard sent block-quantized; ``output`` holds the decoded values on wait."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    numel = shard.numel()
    piece = packed_nbytes(numel, bits)
    wire = torch.empty(world * piece, dtype=torch.uint8, device=shard.device)
    quantize(shard, bits, out=wire[rank * piece : (rank + 1) * piece])
    work = all_gather_into_tensor(wire, wire[rank * piece : (rank + 1) * piece], group=group, tag=f"{tag} (INT{bits})")

    def decode() -> None:
        output.view(world, numel).copy_(dequantize_rows(wire.view(world, piece), numel, bits))

    return _Then(work, decode)


def reduce_scatter_quantized(
    output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None, tag: str = "", bits: int = 4
) -> Work:
    """``reduce_scatter_tensor`` (a sum) with every chunk sent block-quantized, summed in fp32 in rank order on arrival."""
    world = dist.get_world_size(group)
    numel = input.numel() // world
    piece = packed_nbytes(numel, bits)
    send = torch.empty(world, piece, dtype=torch.uint8, device=input.device)
    quantize_rows(input.view(world, numel), bits, send)
    received = torch.empty_like(send)
    work = all_to_all_single(received, send, group=group, tag=f"{tag} (INT{bits} reduce-scatter)")

    def decode() -> None:
        rows = dequantize_rows(received, numel, bits)
        total = rows[0].clone()
        for r in range(1, world):  # rank order, the same on every rank
            total += rows[r]
        output.copy_(total)

    return _Then(work, decode)


def reduce_scatter_across_nodes(
    output: torch.Tensor,
    input: torch.Tensor,
    node: dist.ProcessGroup,
    across: dist.ProcessGroup,
    tag: str = "",
    bits: int = 4,
) -> Work:
    """``reduce_scatter_tensor`` over a group of ``nodes × L`` ranks (rank ``k·L + j``: node ``k``, local ``j``) in two
    hops: a full-precision reduce-scatter inside the node, then a block-quantized one across nodes.

    [Note: quantize only what crosses nodes] ZeRO++'s qgZ is hierarchical: the node's fast links
    first sum its ranks' gradients, so what crosses the slow links is already 1/L of the data,
    and only that is quantized. Inside the node, chunk ``k'·L + j'`` of every rank goes to local
    rank ``j'`` (the input viewed ``[nodes, L, c]`` and transposed to ``[L, nodes, c]``); local
    rank ``j`` then holds its node's sum of the ``nodes`` chunks ``k'·L + j`` and sends chunk
    ``k'`` to node ``k'`` (the across group, local ranks ``j`` of every node). ``across`` spans
    two nodes or more: on one node the reducer reduce-scatters as plain ZeRO-3 does.
    """
    local, nodes = dist.get_world_size(node), dist.get_world_size(across)
    chunk = input.numel() // (local * nodes)
    staged = input.view(nodes, local, chunk).transpose(0, 1).contiguous().view(-1)
    node_sum = torch.empty(nodes * chunk, dtype=input.dtype, device=input.device)
    reduce_scatter_tensor(node_sum, staged, group=node, tag=f"{tag} (inside the node)").wait()
    return reduce_scatter_quantized(output, node_sum, group=across, tag=f"{tag} (across nodes)", bits=bits)


class _Then:
    """A collective's handle that runs ``then`` once it has completed (the decoding of quantized bytes)."""

    def __init__(self, work: Work, then: object) -> None:
        self.work, self.then, self.decoded = work, then, False

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def wait(self) -> None:
        self.work.wait()
        if not self.decoded:
            self.decoded = True
            self.then()  # type: ignore[operator]
