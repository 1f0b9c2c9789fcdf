"""LR schedules against values produced by DeepSpeed 0.19.8.

Reference values: ``deepspeed==0.19.8`` (with torch 2.13.0 CPU) was installed in a throwaway venv;
each case below was built as ``getattr(deepspeed.runtime.lr_schedules, TYPE)(optimizer, **params)``
on the same optimizer, and the optimizer's ``lr`` (and ``betas``) were recorded before each of
``len(expected)`` calls to ``step()``. Entry k is therefore the lr optimizer step k runs with; entry 0
is what construction writes. Our implementation matched every value bit for bit; the tolerance here
only guards against platform libm differences. DeepSpeed is not needed to run these tests.
"""

from __future__ import annotations

import io

import pytest
import torch
from pydantic import ValidationError

from slipstream.engine.lr_schedules import (
    SCHEDULER_PARAMS,
    OneCycle,
    OneCycleParams,
    WarmupCosineLRParams,
    WarmupDecayLRParams,
    WarmupLRParams,
    build_lr_scheduler,
)


def make_optimizer(kind: str) -> torch.optim.Optimizer:
    p = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))]
    if kind == "adam":
        return torch.optim.Adam(p, lr=0.1)
    if kind == "adam2":  # two param groups with different lrs
        return torch.optim.Adam([{"params": [p[0]], "lr": 0.1}, {"params": [p[1]], "lr": 0.2}], lr=0.1)
    return torch.optim.SGD(p, lr=0.1, momentum=0.9)


def record(type_name: str, params: dict, kind: str, n: int) -> tuple[list, list]:
    opt = make_optimizer(kind)
    sched = build_lr_scheduler(type_name, params, opt)
    lrs, betas = [], []
    for _ in range(n):
        lrs.append([float(g["lr"]) for g in opt.param_groups])
        betas.append(opt.param_groups[0].get("betas"))
        assert sched.get_last_lr() == lrs[-1]
        sched.step()
    return lrs, betas


# (type, params, optimizer, expected lr of every group, one row per optimizer step)
LR_CASES = [
    (
        "WarmupLR",
        {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 5},
        "adam",
        [0.0, 0.0, 0.00430676558073393, 0.006826061944859854, 0.00861353116146786, 0.01, 0.01, 0.01, 0.01, 0.01],
    ),
    (
        "WarmupLR",
        {"warmup_min_lr": 0.001, "warmup_max_lr": 0.01, "warmup_num_steps": 4, "warmup_type": "linear"},
        "adam",
        [0.001, 0.001, 0.00325, 0.0055, 0.00775, 0.01, 0.01, 0.01],
    ),
    # warmup_max_lr omitted: each group's optimizer lr (0.1) is the target.
    ("WarmupLR", {"warmup_num_steps": 3}, "adam", [0.0, 0.0, 0.06309297535714574, 0.1, 0.1, 0.1]),
    # Per-group lists; warmup_num_steps=1 is raised to 2 by DeepSpeed.
    (
        "WarmupLR",
        {"warmup_min_lr": [0.0, 0.001], "warmup_max_lr": [0.01, 0.02], "warmup_num_steps": 1},
        "adam2",
        [(0.0, 0.001), (0.0, 0.001), (0.01, 0.02), (0.01, 0.02)],
    ),
    (
        "WarmupDecayLR",
        {"total_num_steps": 10, "warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 4},
        "adam",
        [
            0.0,
            0.0,
            0.005,
            0.007924812503605782,
            0.01,
            0.01,
            0.008333333333333333,
            0.006666666666666666,
            0.005,
            0.003333333333333333,
            0.0016666666666666666,
            0.0,
            0.0,
            0.0,
        ],
    ),
    # warmup_max_lr omitted: DeepSpeed's WarmupDecayLR default is 1e-3, not the optimizer lr.
    (
        "WarmupDecayLR",
        {"total_num_steps": 8, "warmup_num_steps": 3, "warmup_type": "linear"},
        "adam",
        [0.0, 0.0, 0.0003333333333333333, 0.0006666666666666666, 0.001, 0.0008, 0.0006, 0.0004, 0.0002, 0.0],
    ),
    # Defaults: warmup_min_ratio 0, cos_min_ratio 1e-4. Construction writes 0.0.
    (
        "WarmupCosineLR",
        {"total_num_steps": 10, "warmup_num_steps": 4},
        "adam",
        [
            0.0,
            0.0,
            0.05,
            0.07924812503605783,
            0.1,
            0.09330194006220302,
            0.0750025,
            0.050005,
            0.025007500000000012,
            0.006708059937796987,
            1e-05,
            1e-05,
            1e-05,
        ],
    ),
    # Linear warmup never reaches the peak: the cosine starts one step in.
    (
        "WarmupCosineLR",
        {
            "total_num_steps": 12,
            "warmup_num_steps": 3,
            "warmup_min_ratio": 0.1,
            "cos_min_ratio": 0.05,
            "warmup_type": "linear",
        },
        "adam2",
        [
            (0.0, 0.0),
            (0.01, 0.02),
            (0.04, 0.08),
            (0.07, 0.14),
            (0.09713539948733066, 0.19427079897466132),
            (0.08888711104815145, 0.1777742220963029),
            (0.07625, 0.1525),
            (0.060748288439179204, 0.12149657687835841),
            (0.044251711560820806, 0.08850342312164161),
            (0.02875, 0.0575),
            (0.016112888951848547, 0.03222577790369709),
            (0.007864600512669356, 0.015729201025338712),
            (0.005, 0.01),
            (0.005, 0.01),
            (0.005, 0.01),
        ],
    ),
    (
        "OneCycle",
        {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 4},
        "adam",
        [0.01, 0.0325, 0.055, 0.0775, 0.1, 0.0775, 0.055, 0.0325, 0.01, 0.01, 0.01, 0.01],
    ),
    # Asymmetric cycle, then lr = min_lr / (1 + rate * k / decay_step_size).
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 3,
            "cycle_second_step_size": 5,
            "decay_step_size": 2,
            "decay_lr_rate": 0.5,
            "decay_mom_rate": 0.1,
            "cycle_min_mom": 0.85,
            "cycle_max_mom": 0.95,
        },
        "adam",
        [
            0.001,
            0.004,
            0.007,
            0.01,
            0.0082,
            0.0064,
            0.0046,
            0.0028,
            0.001,
            0.0008,
            0.0006666666666666666,
            0.0005714285714285715,
            0.0005,
            0.00044444444444444447,
        ],
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.001,
            "cycle_max_lr": 0.01,
            "cycle_first_step_size": 6,
            "cycle_first_stair_count": 3,
            "cycle_second_step_size": 4,
            "cycle_second_stair_count": 2,
        },
        "adam",
        [0.001, 0.001, 0.004, 0.004, 0.007, 0.007, 0.01, 0.0055, 0.0055, 0.001, 0.001, 0.001],
    ),
    (
        "OneCycle",
        {
            "cycle_min_lr": 0.01,
            "cycle_max_lr": 0.1,
            "cycle_first_step_size": 2,
            "decay_step_size": 1,
            "decay_lr_rate": 1.0,
        },
        "sgd",
        [0.01, 0.055, 0.1, 0.055, 0.01, 0.005, 0.0033333333333333335, 0.0025],
    ),
]


@pytest.mark.parametrize("type_name,params,kind,expected", LR_CASES, ids=[c[0] for c in LR_CASES])
def test_lr_matches_deepspeed(type_name: str, params: dict, kind: str, expected: list) -> None:
    lrs, _ = record(type_name, params, kind, len(expected))
    groups = len(lrs[0])
    want = [list(e) if isinstance(e, tuple) else [e] * groups for e in expected]
    assert lrs == [pytest.approx(w, rel=1e-12, abs=1e-18) for w in want]


def test_one_cycle_momentum_matches_deepspeed() -> None:
    # betas[0] runs opposite to the lr; DeepSpeed writes beta2 = 0.99, replacing Adam's 0.999, and
    # writes cycle_min_mom at construction although step 0 is already near cycle_max_mom.
    _, betas = record("OneCycle", LR_CASES[8][1], "adam", 12)
    assert [b[1] for b in betas] == [0.99] * 12
    assert [b[0] for b in betas] == pytest.approx(
        [0.8, 0.875, 0.85, 0.825, 0.8, 0.825, 0.85, 0.875, 0.9, 0.9, 0.9, 0.9], rel=1e-12
    )


def test_one_cycle_momentum_decay_multiplies() -> None:
    # After the cycle DeepSpeed multiplies max_mom by (1 + rate * k / decay_step_size): beta1 grows past 1.
    _, betas = record("OneCycle", LR_CASES[9][1], "adam", 14)
    assert [b[0] for b in betas] == pytest.approx(
        [
            0.85,
            0.9166666666666666,
            0.8833333333333333,
            0.85,
            0.87,
            0.89,
            0.91,
            0.93,
            0.95,
            0.9975,
            1.045,
            1.0925,
            1.14,
            1.1875,
        ],
        rel=1e-12,
    )


def test_one_cycle_stair_momentum() -> None:
    _, betas = record("OneCycle", LR_CASES[10][1], "adam", 12)
    assert [b[0] for b in betas] == pytest.approx(
        [
            0.8,
            0.9,
            0.8666666666666667,
            0.8666666666666667,
            0.8333333333333334,
            0.8333333333333334,
            0.8,
            0.85,
            0.85,
            0.9,
            0.9,
            0.9,
        ],
        rel=1e-12,
    )


def test_one_cycle_leaves_sgd_momentum_alone() -> None:
    # DeepSpeed cycles only optimizers with 'betas' in their defaults; SGD keeps its momentum.
    opt = make_optimizer("sgd")
    sched = build_lr_scheduler("OneCycle", LR_CASES[11][1], opt)
    for _ in range(5):
        sched.step()
    assert all(g["momentum"] == 0.9 and "betas" not in g for g in opt.param_groups)


def test_one_cycle_momentum_off_keeps_betas() -> None:
    opt = make_optimizer("adam")
    sched = build_lr_scheduler("OneCycle", {**LR_CASES[8][1], "cycle_momentum": False}, opt)
    sched.step()
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("case", [1, 4, 7, 9], ids=lambda i: LR_CASES[i][0])
def test_state_dict_round_trip_resumes_sequence(case: int) -> None:
    type_name, params, kind, expected = LR_CASES[case]
    n, cut = len(expected), len(expected) // 2
    reference = record(type_name, params, kind, n)

    opt = make_optimizer(kind)
    sched = build_lr_scheduler(type_name, params, opt)
    for _ in range(cut):
        sched.step()
    buf = io.BytesIO()
    torch.save(sched.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)

    # A fresh run: construction rewrites the lr for step 0, loading must put the schedule back.
    opt = make_optimizer(kind)
    resumed = build_lr_scheduler(type_name, params, opt)
    resumed.load_state_dict(state)
    lrs, betas = [], []
    for _ in range(n - cut):
        lrs.append([float(g["lr"]) for g in opt.param_groups])
        betas.append(opt.param_groups[0].get("betas"))
        resumed.step()
    assert lrs == reference[0][cut:]
    assert betas == reference[1][cut:]
    assert resumed.state_dict() == {"last_batch_iteration": n - 1}


def test_tensor_lr_is_filled_in_place() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.1), foreach=False)
    lr = opt.param_groups[0]["lr"]
    sched = build_lr_scheduler("WarmupCosineLR", {"total_num_steps": 10, "warmup_num_steps": 4}, opt)
    sched.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.05)
    assert sched.get_last_lr() == pytest.approx([0.05])


def test_defaults_follow_deepspeed() -> None:
    assert WarmupLRParams().model_dump() == {
        "last_batch_iteration": -1,
        "warmup_min_lr": 0.0,
        "warmup_max_lr": None,
        "warmup_num_steps": 1000,
        "warmup_type": "log",
    }
    assert WarmupDecayLRParams(total_num_steps=2000).warmup_max_lr == 0.001
    cos = WarmupCosineLRParams(total_num_steps=2000)
    assert (cos.warmup_min_ratio, cos.cos_min_ratio, cos.warmup_num_steps) == (0.0, 0.0001, 1000)
    one = OneCycleParams(cycle_min_lr=0.01, cycle_max_lr=0.1)
    assert (one.cycle_first_step_size, one.cycle_momentum) == (2000, True)
    assert (one.cycle_min_mom, one.cycle_max_mom, one.decay_step_size) == (0.8, 0.9, 0)
    assert set(SCHEDULER_PARAMS) == {"WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle"}


def test_build_accepts_a_params_model() -> None:
    params = OneCycleParams(cycle_min_lr=0.01, cycle_max_lr=0.1)
    sched = build_lr_scheduler("OneCycle", params, make_optimizer("adam"))
    assert isinstance(sched, OneCycle) and sched.get_last_lr() == [0.01]
    with pytest.raises(TypeError, match="OneCycleParams"):
        build_lr_scheduler("OneCycle", WarmupLRParams(), make_optimizer("adam"))


AFTER_WARMUP = "total_num_steps\n.*greater than warmup_num_steps"


@pytest.mark.parametrize(
    "type_name,params,match",
    [
        ("WarmupLR", {"warmup_max_lr": 0.01, "warmup_steps": 10}, "warmup_steps"),  # unknown key
        ("WarmupCosineLR", {"total_num_steps": 10, "warmup_max_lr": 0.01}, "warmup_max_lr"),  # ratios only
        ("WarmupLR", {"warmup_num_steps": 0}, "greater than 0"),
        ("WarmupLR", {"warmup_type": "cosine"}, "'log' or 'linear'"),
        ("WarmupLR", {"warmup_min_lr": -0.1}, "warmup_min_lr\n.*must be >= 0"),
        ("WarmupLR", {"warmup_max_lr": [0.1, -0.1]}, "warmup_max_lr\n.*must be >= 0"),
        ("WarmupDecayLR", {"warmup_num_steps": 10}, "total_num_steps"),  # required
        ("WarmupDecayLR", {"total_num_steps": 10, "warmup_num_steps": 10}, AFTER_WARMUP),
        ("WarmupCosineLR", {"total_num_steps": 5, "warmup_num_steps": 10}, AFTER_WARMUP),
        (
            "WarmupCosineLR",
            {"total_num_steps": 10, "warmup_num_steps": 2, "cos_min_ratio": 1.5},
            "less than or equal to 1",
        ),
        ("OneCycle", {"cycle_max_lr": 0.1}, "cycle_min_lr"),  # required
        ("OneCycle", {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_first_step_size": 0}, "greater than 0"),
        (
            "OneCycle",
            {"cycle_min_lr": 0.01, "cycle_max_lr": 0.1, "cycle_second_step_size": -1},
            ">= 0|greater than or equal",
        ),
    ],
)
def test_bad_params_are_rejected(type_name: str, params: dict, match: str) -> None:
    with pytest.raises(ValidationError, match=match):
        build_lr_scheduler(type_name, params, make_optimizer("adam"))


def test_per_group_list_must_match_param_groups() -> None:
    with pytest.raises(ValueError, match="one value per param group"):
        build_lr_scheduler("WarmupLR", {"warmup_max_lr": [0.1, 0.2, 0.3]}, make_optimizer("adam2"))


def test_unknown_type_names_the_choices() -> None:
    with pytest.raises(ValueError, match="WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle"):
        build_lr_scheduler("LRRangeTest", {}, make_optimizer("adam"))
