"""The noise-aware weight tolerance (tests/noise.py) lets float noise through and stops a real error.

A second float32 run that sums its gradients in another order (two half-batches, as two
data-parallel ranks would) must pass against the reference; the same run with the gradient sign of
one element flipped at one step must fail; and the allowance must stay at the base tolerance for
almost every element (else it would hide errors).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.noise import assert_weights_close
from tests.reference import tiny_llama, tiny_mixtral, train_lm_reference

LR, STEPS, ROWS, SEQ = 1e-3, 3, 4, 16


def _batches(vocab: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, vocab, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _halves_run(
    model: torch.nn.Module, batches: list[torch.Tensor], edit: Callable[[int, dict[str, torch.Tensor]], None]
) -> dict[str, torch.Tensor]:
    """float32 AdamW whose gradient is the mean of two half-batch gradients, summed in the other order; ``edit`` may change them."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)
    for step, tokens in enumerate(batches):
        halves = []
        for part in (tokens[ROWS // 2 :], tokens[: ROWS // 2]):
            model.zero_grad(set_to_none=True)
            model(input_ids=part, labels=part).loss.backward()
            halves.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        grads = {n: (halves[0][n] + halves[1][n]) / 2 for n in halves[0]}
        edit(step, grads)
        for n, p in model.named_parameters():
            p.grad = grads.get(n)
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    "build", [tiny_llama, lambda: tiny_mixtral(vocab=256, positions=SEQ)], ids=["llama", "mixtral"]
)
def test_noise_passes_and_one_flipped_gradient_sign_fails(build: Callable[[], torch.nn.Module]) -> None:
    batches = _batches(128)
    _, reference = train_lm_reference(build(), batches, LR)

    # float noise only: another summation order
    assert_weights_close(_halves_run(build(), batches, lambda step, grads: None), reference, rtol=1e-4, atol=5e-5)

    # the allowance is not a blanket: all but a sliver of the elements keep the base tolerance
    total = sum(b.numel() for b in reference.bounds.values())
    loose = sum(int((b > 5e-5).sum()) for b in reference.bounds.values())
    assert loose <= 0.01 * total, f"{loose} of {total} elements have a noise allowance above the base tolerance"

    # one element's gradient with the wrong sign at step 1: an element that carries signal (its gradient well above noise)
    name = "model.layers.0.self_attn.q_proj.weight"

    def flip(step: int, grads: dict[str, torch.Tensor]) -> None:
        if step == 1:
            g = grads[name].view(-1)
            i = int(torch.argsort(g.abs())[g.numel() // 2])  # the median element by magnitude
            g[i] = -g[i]

    with pytest.raises(AssertionError, match=name):
        assert_weights_close(_halves_run(build(), batches, flip), reference, rtol=1e-4, atol=5e-5)


def test_a_plain_dict_reference_keeps_the_fixed_tolerance() -> None:
    ref = {"w": torch.zeros(4)}
    assert_weights_close({"w": torch.full((4,), 4e-5)}, ref, rtol=0.0, atol=5e-5)
    with pytest.raises(AssertionError, match=r"w: 1 of 4 elements off; worst at flat index 2"):
        assert_weights_close({"w": torch.tensor([0.0, 0.0, 6e-5, 0.0])}, ref, rtol=0.0, atol=5e-5)
