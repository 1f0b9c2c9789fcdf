"""The model zoo as a contract (issue 27): every architecture × every parallel mode at degree 2 either
trains to the one-process reference (loss per step within 1e-5 relative, final weights within 5e-5 + 1e-4·|w| and
their float-noise allowance) or is refused at
``initialize`` with a one-line ``ConfigError``. No cell may train to a different result or crash.

One pool of 2 ranks serves every cell; each architecture's cells run in one call. The outcome of
every cell is written to ``docs/model_zoo.md`` by ``python -m tests.zoo.table`` (the test checks
the table there is the one the cells produce, so the support table cannot go stale).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed
from tests.noise import assert_weights_close
from tests.reference import train_lm_reference
from tests.zoo.models import MOE, SEQ, VOCAB, ZOO

STEPS, ROWS, LR = 2, 4, 1e-3
MODES: dict[str, dict[str, Any]] = {
    "tp": {"tensor_parallel": {"autotp_size": 2}},
    "tp+sp": {"tensor_parallel": {"autotp_size": 2, "sequence_parallel": True}},
    "ulysses": {"sequence_parallel_size": 2},
    "ring": {"context_parallel": {"size": 2, "method": "ring"}},
    "zigzag": {"context_parallel": {"size": 2, "method": "zigzag"}},
    "allgather_kv": {"context_parallel": {"size": 2, "method": "allgather_kv"}},
    "pp-1f1b": {"pipeline": {"stages": 2, "schedule": "1f1b"}},
    "pp-zbv": {"pipeline": {"stages": 2, "schedule": "zbv", "virtual_stages": 2}},
    "ep": {"expert_parallel": {"enabled": True, "autoep_size": 2}},
    "zero3": {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}},
}
DATA_PARALLEL = ("ep", "zero3")  # dp 2: each rank half of the global batch; the others: dp 1, the whole batch


def modes_of(arch: str) -> list[str]:
    return [m for m in MODES if m != "ep" or arch in MOE]


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def reference(arch: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process's losses per step and final weights (with their float-noise allowance: tests/noise.py)."""
    return train_lm_reference(ZOO[arch](), batches(), LR)


def _config(mode: str) -> dict[str, Any]:
    pipelined = mode.startswith("pp")
    return {
        "train_micro_batch_size_per_gpu": ROWS // 2 if pipelined or mode in DATA_PARALLEL else ROWS,
        "gradient_accumulation_steps": 2 if pipelined else 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        **MODES[mode],
    }


def run_cell(arch: str, mode: str) -> dict[str, Any]:
    """One cell on this rank: ``refused`` (ConfigError at initialize), ``losses``, or ``crashed``."""
    import slipstream

    try:
        engine = slipstream.initialize(ZOO[arch](), _config(mode))
    except slipstream.ConfigError as err:
        return {"refused": str(err)}
    except Exception as err:  # noqa: BLE001 - a crash is a finding, reported per cell
        return {"crashed": f"initialize: {type(err).__name__}: {err}"}
    try:
        losses = []
        for tokens in batches():
            if mode.startswith("pp"):
                micro = [{"input_ids": t, "labels": t} for t in tokens.split(ROWS // 2)]
                losses.append(float(engine.train_batch(iter(micro))))
                continue
            if mode in DATA_PARALLEL:
                r = engine.mesh.rank_of("dp")
                tokens = tokens[r * ROWS // 2 : (r + 1) * ROWS // 2]
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            total = loss.detach().float().clone()
            dist.all_reduce(total)
            losses.append(float(total) / dist.get_world_size())
        return {"losses": losses, "state": engine.consolidated_state_dict()}  # the whole weights on rank 0
    except Exception as err:  # noqa: BLE001
        return {"crashed": f"training: {type(err).__name__}: {err}"}
    finally:
        engine.close()


def run_arch(arch: str) -> dict[str, dict[str, Any]]:
    return {mode: run_cell(arch, mode) for mode in modes_of(arch)}


def outcome(cell: dict[str, Any], expected: tuple[list[float], dict[str, torch.Tensor]]) -> tuple[str, str]:
    """("trains" | "refused" | "WRONG" | "CRASHED", detail): trains when every step's loss is within 1e-5 relative of
    one process's and (on rank 0, which holds the whole weights) every weight within 5e-5 + 1e-4·|w| and its noise
    allowance. The loss alone cannot see a gradient scaled by a constant: Adam's first steps do not either."""
    if "refused" in cell:
        return "refused", cell["refused"]
    if "crashed" in cell:
        return "CRASHED", cell["crashed"].splitlines()[0]
    losses, weights = expected
    if cell["losses"] != pytest.approx(losses, rel=1e-5):
        return "WRONG", f"losses {cell['losses']} vs one process {losses}"
    if cell.get("state") is not None:
        try:
            assert_weights_close(cell["state"], weights, rtol=1e-4, atol=5e-5)
        except AssertionError as err:
            return "WRONG", f"weights: {str(err).splitlines()[0]}"
    return "trains", ""


@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo(arch: str) -> None:
    expected = reference(arch)
    results = run_distributed(2, run_arch, arch, timeout=600)
    bad = []
    for mode in modes_of(arch):
        kinds = {outcome(rank[mode], expected)[0] for rank in results}
        kind, detail = outcome(results[0][mode], expected)
        if kinds - {"trains", "refused"} or len(kinds) > 1:
            bad.append(f"{mode}: {kind} {detail}")
        elif kind == "refused":
            assert "\n" not in detail and ":" in detail.split(" ")[0], (
                f"{mode}: refusal is not one line naming a key: {detail}"
            )
    assert not bad, f"{arch}: " + " | ".join(bad)
    documented = _documented_row(arch)
    found = {mode: outcome(results[0][mode], expected)[0] for mode in modes_of(arch)}
    assert documented == found, (
        f"docs/model_zoo.md is stale for {arch} (regenerate: python -m tests.zoo.table): {documented} vs {found}"
    )


def _documented_row(arch: str) -> dict[str, str]:
    """The support table's row for ``arch``: mode -> "trains" | "refused"."""
    from tests.zoo.table import DOC

    lines = [line for line in DOC.read_text().splitlines() if line.startswith("| ")]
    modes = [c.strip() for c in lines[0].strip("|").split("|")][1:]
    for line in lines[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == arch:
            return {m: c.split(" ")[0] for m, c in zip(modes, cells[1:], strict=True) if c != "—"}
    return {}
