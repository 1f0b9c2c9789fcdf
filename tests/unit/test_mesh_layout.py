"""The mesh's rank layout as pure arithmetic (no process group): rank order and expert groups."""

from __future__ import annotations

import itertools

import pytest

from slipstream.engine.config import ALL_AXES, AXES, MeshSizes
from slipstream.engine.parallel.mesh import canonical, coordinates, partition

SIZES = MeshSizes(pp=2, dp=2, cp=2, sp=2, tp=2, ep=4)  # 32 ranks, ep borrows 4 of each stage's 16


def test_rank_is_the_mixed_radix_pp_dp_cp_sp_tp() -> None:
    for rank, digits in enumerate(itertools.product(*(range(SIZES.size(a)) for a in AXES))):
        coords = coordinates(SIZES, rank)
        assert tuple(coords[a] for a in AXES) == digits  # tp innermost


@pytest.mark.parametrize("axis", AXES)
def test_each_axis_groups_ranks_that_differ_only_there(axis: str) -> None:
    groups = partition(SIZES, (axis,))
    assert sorted(r for g in groups for r in g) == list(range(SIZES.world))
    for group in groups:
        assert len(group) == SIZES.size(axis)
        fixed = [{a: c for a, c in coordinates(SIZES, r).items() if a not in (axis, "ep")} for r in group]
        assert all(f == fixed[0] for f in fixed)
        assert [coordinates(SIZES, r)[axis] for r in group] == list(range(SIZES.size(axis)))


def test_expert_groups_are_contiguous_blocks_inside_a_stage() -> None:
    groups = partition(SIZES, ("ep",))
    assert groups == [tuple(range(s, s + 4)) for s in range(0, 32, 4)]
    stage = SIZES.world // SIZES.pp
    assert all(g[0] // stage == g[-1] // stage for g in groups)  # never crosses a pipeline stage
    assert [coordinates(SIZES, r)["ep"] for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_dense_group_spans_dp_cp_sp() -> None:
    group = partition(SIZES, ("sp", "dp", "cp"))[0]  # any order names the same group
    assert group == (0, 2, 4, 6, 8, 10, 12, 14) and canonical(("sp", "dp", "cp")) == ("dp", "cp", "sp")


def test_unknown_and_mixed_axes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown axis"):
        canonical(("xp",))
    with pytest.raises(ValueError, match="ep borrows"):
        canonical(("ep", "dp"))
    assert set(ALL_AXES) == {"pp", "dp", "cp", "sp", "tp", "ep"}
