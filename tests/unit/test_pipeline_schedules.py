"""Pipeline schedules as data: torch's generators as the oracle, bubbles and activations from the action lists.

Single process: nothing here runs a model except the split-backward check, so every schedule ×
size combination is cheap.
"""

from __future__ import annotations

import types

import pytest
import torch

from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.pipeline import schedules as S
from slipstream.engine.parallel.pipeline.actions import Action, Op, StageLayout, with_communication
from slipstream.engine.parallel.pipeline.cut import partition
from slipstream.engine.parallel.pipeline.simulate import Costs, peak_in_flight, predicted_bubble, simulate
from slipstream.engine.parallel.pipeline.split_backward import backward_input

CASES = [("afab", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb1p", 1), ("zb1p", 2), ("zbv", 2), ("dualpipev", 2)]


def _torch_order(name: str, p: int, m: int, v: int) -> dict[int, list[str]]:
    """torch.distributed.pipelining's per-rank compute actions ("1F0"), its F&B pairs flattened in order."""
    from torch.distributed.pipelining import schedules as ts

    def flat(actions: list) -> list[str]:
        out = []
        for a in actions:
            if a is None:
                continue
            if a.computation_type == ts.OVERLAP_F_B:
                out += [str(x) for x in a.sub_actions]
            elif a.computation_type in (ts.F, ts.B, ts.I, ts.W):
                out.append(str(a))
        return out

    if name in ("afab", "1f1b"):
        cls = ts.ScheduleGPipe if name == "afab" else ts.Schedule1F1B
        order = cls._get_pipeline_order(types.SimpleNamespace(_num_stages=p, _n_microbatches=m))
        return {r: flat(a) for r, a in order.items()}
    cls = {
        "interleaved_1f1b": ts.ScheduleInterleaved1F1B,
        "zb1p": ts.ScheduleInterleavedZeroBubble,
        "zbv": ts.ScheduleZBVZeroBubble,
        "dualpipev": ts.ScheduleDualPipeV,
    }[name]
    rounds = max(1, m // p)
    state = types.SimpleNamespace(
        pp_group_size=p,
        n_local_stages=v,
        _n_microbatches=m,
        number_of_rounds=rounds,
        microbatches_per_round=m // rounds,
        num_stages=p * v,
        _num_stages=p * v,
    )
    return {r: flat(cls._calculate_single_rank_operations(state, r)) for r in range(p)}


@pytest.mark.parametrize("name,v", CASES)
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_generators_match_torch(name: str, v: int, p: int, m: int) -> None:
    schedule = S.build(name, p, m, v)
    mine = {r: [str(a) for a in schedule.compute[r]] for r in range(p)}
    ref = _torch_order(name, p, m, v)
    if name == "1f1b":
        # torch's 1F1B *display* order (not its runtime) numbers the last rank's forwards from 1,
        # naming micro-batch m, which does not exist; every other rank must match exactly.
        assert any(a.endswith(f"F{m}") for a in ref[p - 1])
        ref.pop(p - 1)
        mine.pop(p - 1)
    assert mine == ref
    simulate(schedule)  # and dependency-valid


@pytest.mark.parametrize("name,v", CASES)
@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 16)])
def test_bubble_matches_closed_form(name: str, v: int, p: int, m: int) -> None:
    schedule = S.build(name, p, m, v)
    assert simulate(schedule).bubble() == pytest.approx(predicted_bubble(schedule), abs=1e-9)
    if name in ("afab", "1f1b"):
        assert simulate(schedule).bubble() == pytest.approx((p - 1) / m)
    if name == "interleaved_1f1b":
        assert simulate(schedule).bubble() == pytest.approx((p - 1) / (v * m))
    # unequal costs: the 1F1B family keeps (p-1)/m; zero bubble shrinks as weight passes grow
    costs = Costs(forward=1.0, backward_input=1.5, backward_weight=0.5)
    if name in ("afab", "1f1b"):
        assert simulate(schedule, costs).bubble() == pytest.approx((p - 1) / m)


def test_zero_bubble_beats_1f1b() -> None:
    for p, m in [(2, 8), (4, 8)]:
        one = simulate(S.build("1f1b", p, m)).bubble()
        assert simulate(S.build("zb1p", p, m)).bubble() == pytest.approx(one / 3)  # (p-1)(F+B-2W) with F=I=W
        assert simulate(S.build("zbv", p, m, 2)).bubble() < one / 3


@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 8)])
def test_activations_in_flight(p: int, m: int) -> None:
    assert peak_in_flight(S.build("afab", p, m)) == {s: m for s in range(p)}
    assert peak_in_flight(S.build("1f1b", p, m)) == {s: min(p - s, m) for s in range(p)}


def test_a_reordered_schedule_is_refused() -> None:
    schedule = S.build("1f1b", 2, 4)
    rank1 = list(schedule.compute[1])
    rank1[0], rank1[1] = rank1[1], rank1[0]  # a backward before its forward
    broken = S.Schedule("1f1b", 4, schedule.layout, (schedule.compute[0], tuple(rank1)))
    with pytest.raises(ValueError, match="deadlocks"):
        simulate(broken)
    missing = S.Schedule("1f1b", 4, schedule.layout, (schedule.compute[0][:-1], schedule.compute[1]))
    with pytest.raises(ValueError, match="stage 0 micro-batch 3"):
        simulate(missing)


def test_communication_pairs() -> None:
    """Every send has its receive on the neighbour; V layouts hand over inside a rank without one."""
    for name, v in CASES:
        schedule = S.build(name, 2, 4, v)
        plans = with_communication([list(a) for a in schedule.compute], schedule.layout)
        sends = {(a.op, a.stage, a.micro) for plan in plans for a in plan if a.op in (Op.SEND_F, Op.SEND_B)}
        recvs = {(a.op, a.stage, a.micro) for plan in plans for a in plan if a.op in (Op.RECV_F, Op.RECV_B)}
        assert {(Op.RECV_F, s + 1, i) for _, s, i in (x for x in sends if x[0] is Op.SEND_F)} == {
            x for x in recvs if x[0] is Op.RECV_F
        }
        assert {(Op.RECV_B, s - 1, i) for _, s, i in (x for x in sends if x[0] is Op.SEND_B)} == {
            x for x in recvs if x[0] is Op.RECV_B
        }
        crossings = schedule.layout.num_stages - 1 - (1 if schedule.layout.style == "v" else 0)
        assert len(sends) == 2 * 4 * crossings


def _runs_to_the_end(schedule: S.Schedule) -> bool:
    """Play every rank's plan (transfers included) with asynchronous sends and blocking receives; False on a deadlock."""
    plans = with_communication([list(a) for a in schedule.compute], schedule.layout, schedule.pairs)
    cursor, arrived = [0] * len(plans), set()
    moved = True
    while moved:
        moved = False
        for rank, plan in enumerate(plans):
            while cursor[rank] < len(plan):
                a = plan[cursor[rank]]
                if a.op is Op.RECV_F and (a.stage - 1, "F", a.micro) not in arrived:
                    break
                if a.op is Op.RECV_B and (a.stage + 1, "B", a.micro) not in arrived:
                    break
                if a.op in (Op.SEND_F, Op.SEND_B):
                    arrived.add((a.stage, a.op.value[-1], a.micro))
                cursor[rank] += 1
                moved = True
    return all(c == len(plan) for c, plan in zip(cursor, plans))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_dualpipev_pairs_forward_and_backward_and_its_plan_cannot_deadlock(p: int) -> None:
    """A pair receives both halves' tensors before it starts and sends after both (its halves take turns)."""
    for m in range(2 * p, 2 * p + 5):
        schedule = S.build("dualpipev", p, m, 2)
        assert all(schedule.pairs[r] for r in range(p)), (p, m)
        for rank in range(p):
            for f, b in schedule.partners(rank).items():
                assert (
                    f.op is Op.FORWARD
                    and b.op in (Op.BACKWARD, Op.BACKWARD_INPUT)
                    and (f.stage, f.micro) != (b.stage, b.micro)
                )
        assert _runs_to_the_end(schedule), (p, m)
    for name, v in CASES:  # the unpaired schedules' plans too
        assert _runs_to_the_end(S.build(name, 2, 4, v)), name
    assert (
        S.build("dualpipev", 2, 4, 2).text(0)
        == "0F0 0F1 0F2 3F0 3I0 3W0 3F1 (0F3;3B1) (3F2;0B0) 3B2 (3F3;0B1) 3B3 0I2 0W2 0I3 0W3"
    )
    one = S.build("1f1b", 2, 4)
    early = Action(0, Op.BACKWARD, 0)  # rank 0 waiting for a gradient before it sent the activation: stuck
    eager = (early, *(a for a in one.compute[0] if a != early))
    assert not _runs_to_the_end(S.Schedule("1f1b", 4, one.layout, (eager, one.compute[1])))


def test_a_pair_that_cannot_overlap_is_refused() -> None:
    schedule = S.build("1f1b", 2, 4)
    first = schedule.compute[0]
    own = first.index(Action(0, Op.FORWARD, 1))
    assert first[own + 1] == Action(0, Op.BACKWARD, 0)  # 1F1B's steady state: F1 then B0 (independent)
    S.Schedule("1f1b", 4, schedule.layout, schedule.compute, (frozenset({own}), frozenset()))
    with pytest.raises(ValueError, match="cannot overlap"):
        S.Schedule("1f1b", 4, schedule.layout, schedule.compute, (frozenset({own + 1}), frozenset()))


def test_layouts_and_text() -> None:
    assert StageLayout(2, 2, "v").stages_of(0) == (0, 3)
    assert StageLayout(2, 2, "loop").stages_of(1) == (1, 3)
    assert Action.parse("3W12") == Action(3, Op.BACKWARD_WEIGHT, 12)
    assert str(Action(0, Op.SEND_B, 2)) == "0SEND_B2"
    with pytest.raises(ValueError, match="not a pipeline action"):
        Action.parse("F0")


@pytest.mark.parametrize(
    "name,p,m,v,key",
    [
        ("1f1b", 4, 2, 1, "gradient_accumulation_steps"),
        ("dualpipev", 2, 3, 2, "gradient_accumulation_steps"),
        ("zbv", 2, 4, 3, "pipeline.virtual_stages"),
        ("1f1b", 2, 4, 2, "pipeline.virtual_stages"),
        ("interleaved_1f1b", 4, 9, 2, "gradient_accumulation_steps"),
        ("chimera", 2, 4, 1, "pipeline.schedule"),
    ],
)
def test_impossible_combinations_name_the_key(name: str, p: int, m: int, v: int, key: str) -> None:
    with pytest.raises(ValueError, match=f"^{key}:"):
        S.check(name, p, m, v)


def test_partition_methods() -> None:
    from tests.reference import tiny_gpt2

    model = tiny_gpt2(n_layer=6)
    blocks = find_blocks(model)
    assert blocks is not None
    assert partition(blocks, 3, "uniform") == [range(0, 2), range(2, 4), range(4, 6)]
    block = sum(p.numel() for p in blocks.modules[0].parameters())
    # the embeddings weigh on the first stage: it gets fewer blocks
    ranges = partition(blocks, 2, "parameters", prologue_numel=2 * block, epilogue_numel=0)
    assert len(ranges[0]) < len(ranges[1]) and ranges[0].start == 0 and ranges[-1].stop == 6
    assert partition(blocks, 2, "type:gpt2block") == [range(0, 3), range(3, 6)]
    with pytest.raises(ValueError, match="^pipeline.partition: 'type:Linear' matches 0 blocks"):
        partition(blocks, 2, "type:Linear")
    with pytest.raises(ValueError, match="^pipeline.stages: 8 stages need at least 8 blocks"):
        partition(blocks, 8, "uniform")
    # blocks the forward skips never start a stage; each goes with the stage of the block before it
    assert partition(blocks, 3, "uniform", skipped=frozenset({2, 3})) == [range(0, 1), range(1, 4), range(4, 6)]
    assert partition(blocks, 2, "uniform", skipped=frozenset({0})) == [range(0, 3), range(3, 6)]
    with pytest.raises(
        ValueError,
        match=r"^pipeline.stages: 4 stages need at least 4 blocks; the model has 3 \(transformer.h, 3 of which run\)",
    ):
        partition(blocks, 4, "uniform", skipped=frozenset({0, 1, 5}))


def test_split_backward_equals_full_backward() -> None:
    """Input gradient first, weight gradients later: the same numbers as one backward, weights untouched in between."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8), torch.nn.Linear(8, 8))
    apart = torch.nn.Parameter(torch.randn(8))  # reaches the output without meeting the input's path

    def f(x: torch.Tensor) -> torch.Tensor:
        return net(x) * 2 + apart.sum() * x.new_ones(8) + net[0](x)  # net[0] used twice: no double counting

    weights = [*net.parameters(), apart]
    x, seed = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    f(x).backward(seed)
    expected, expected_x = [w.grad.clone() for w in weights], x.grad.clone()
    for w in weights:
        w.grad = None
    x2 = x.detach().clone().requires_grad_()
    found, weight_pass = backward_input([f(x2)], [seed], [x2], weights)
    torch.testing.assert_close(found[0], expected_x)
    assert all(w.grad is None for w in weights)
    weight_pass.run()
    for w, e in zip(weights, expected):
        torch.testing.assert_close(w.grad, e)


def test_split_backward_of_a_stage_handing_on_two_tensors_matches_one_backward() -> None:
    """A stage that hands on its hidden state and the router logits it carries (pipeline/carry.py): two outputs,
    two received inputs (the carried one passes through and grows), one of them unused downstream of a weight."""
    torch.manual_seed(0)
    net, router = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)

    def stage(x: torch.Tensor, carried: torch.Tensor) -> list[torch.Tensor]:
        hidden = torch.tanh(net(x))
        return [hidden, torch.cat([carried, router(hidden).unsqueeze(0)])]

    weights = [*net.parameters(), *router.parameters()]
    x, carried = torch.randn(4, 8, requires_grad=True), torch.randn(1, 4, 3, requires_grad=True)
    seeds = [torch.randn(4, 8), torch.randn(2, 4, 3)]
    torch.autograd.backward(stage(x, carried), seeds)
    expected, expected_in = [w.grad.clone() for w in weights], [x.grad.clone(), carried.grad.clone()]
    for w in weights:
        w.grad = None
    inputs = [x.detach().clone().requires_grad_(), carried.detach().clone().requires_grad_()]
    found, weight_pass = backward_input(stage(*inputs), seeds, inputs, weights)
    for got, want in zip(found, expected_in):
        torch.testing.assert_close(got, want)
    assert all(w.grad is None for w in weights)
    weight_pass.run()
    for w, e in zip(weights, expected):
        torch.testing.assert_close(w.grad, e)


def test_partition_balances_ranks_when_a_rank_runs_several_stages() -> None:
    """A V puts the first and the last stage on rank 0: balanced stages can leave that rank the busiest."""
    from slipstream.engine.parallel.anatomy import Blocks
    from slipstream.engine.parallel.pipeline.cut import _balance_ranks, _balanced

    v = StageLayout(2, 2, "v")

    def loads(weights: list[float], ranges: list[range]) -> list[float]:
        return [sum(weights[i] for s in v.stages_of(r) for i in ranges[s]) for r in range(2)]

    weights = [1.0] * 16 + [2.5]  # a heavy head on the last block
    stage_balanced = _balanced(weights, 4)
    assert max(loads(weights, stage_balanced)) == 10.0
    assert max(loads(weights, _balance_ranks(weights, stage_balanced, v.rank_of))) == 9.5  # the best contiguous cut
    blocks = Blocks("", tuple(str(i) for i in range(17)), tuple(torch.nn.Linear(1, 1) for _ in range(17)))
    measured = partition(blocks, 4, "profile", measured=weights, rank_of=v.rank_of)
    assert max(loads(weights, measured)) == 9.5 and measured[0].start == 0 and measured[-1].stop == 17
    assert partition(blocks, 4, "uniform", rank_of=v.rank_of) == [range(0, 4), range(4, 8), range(8, 12), range(12, 17)]
