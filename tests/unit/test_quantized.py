"""Block-wise quantization (comm/quantized.py): error within half a step per block, exact where representable."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slipstream.comm.quantized import BLOCK, dequantize, packed_nbytes, quantize


@settings(max_examples=40, deadline=None)
@given(
    numel=st.integers(1, 3 * BLOCK + 7),
    bits=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
    scale=st.floats(1e-6, 1e3),
)
def test_round_trip_error_is_at_most_half_a_step_of_each_block(numel: int, bits: int, seed: int, scale: float) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * scale
    packed = quantize(x, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(numel, bits)
    y = dequantize(packed, numel, bits)
    top = 2 ** (bits - 1) - 1
    blocks = -(-numel // BLOCK)
    padded = torch.nn.functional.pad(x, (0, blocks * BLOCK - numel)).view(blocks, BLOCK)
    step = padded.abs().amax(dim=1, keepdim=True) / top  # one integer step of each block
    error = torch.nn.functional.pad(y - x, (0, blocks * BLOCK - numel)).view(blocks, BLOCK).abs()
    assert bool((error <= step * 0.5 * (1 + 1e-5) + 1e-30).all())
    assert torch.equal(quantize(x, bits), packed)  # deterministic: every rank decodes the same values


@pytest.mark.parametrize("bits", [4, 8])
def test_values_on_the_grid_survive_exactly_and_zero_blocks_stay_zero(bits: int) -> None:
    top = 2 ** (bits - 1) - 1
    grid = torch.arange(-top, top + 1, dtype=torch.float32).repeat(BLOCK // (2 * top + 1) + 1)[:BLOCK] * 0.5
    grid[0] = top * 0.5  # the block's largest magnitude sets its scale to 0.5
    x = torch.cat([grid, torch.zeros(BLOCK)])
    assert torch.equal(dequantize(quantize(x, bits), x.numel(), bits), x)


def test_low_precision_inputs_quantize_from_their_float_values() -> None:
    x = torch.randn(1000, dtype=torch.bfloat16)
    assert torch.equal(quantize(x, 8), quantize(x.float(), 8))
    with pytest.raises(ValueError, match="4 and 8 are supported"):
        quantize(x, 2)
