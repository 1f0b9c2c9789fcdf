"""Issue 29 acceptance 2: the bytes each rank moves per mesh axis equal their formulas, for the three recipes.

The recipes of test_composition.py at their own world 8 (ZeRO-1, fp32, the same tiny Mixtral): Llama-3-like tp 2 × cp 2 × pp 2,
DeepSeek-like pp 2 × ep 2 × dp 4, USP sp 2 × cp 2 × dp 2. Each trains two steps; the second step's comms log
(the first also holds initialize's collectives) is sorted by the axis label the step record uses (``Mesh.traffic``)
and by what the tag says it carries, and every (axis, kind) sum must equal, exactly, a formula from the model's
shapes, the mesh, the number of micro-batches and (expert parallel only) the routing the ranks chose that step.
The step record's ``comms_MB/<axis>`` must be the same totals.

Accounting (slipstream/comm/comms_log.py, collectives.py, p2p.py): an all-reduce moves 2× its tensor, an all-gather or
reduce-scatter 1× the whole (unsharded) tensor, an all-to-all (even or uneven) only what leaves the rank (its own
chunk never moves), a P2P send / ring shift what it sends, and a pipeline receive
(``p2p_recv``, ``p2p_meta``) what it receives.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

import slipstream
from slipstream.comm import comms_log
from slipstream.engine.parallel.expert.dispatch import ExpertParallelExperts
from tests.distributed.test_composition import MICRO, RECIPES, SEQ, _batches, _config, _mixtral
from tests.harness import run_distributed
from tests.reference import train_step_on_global_batch

F32, F64, I64 = 4, 8, 8
AXES = ("pp", "dp", "cp", "sp", "tp", "ep")

# Which step-record label carries each formula's bytes: the label of the group's ranks (Mesh.traffic).
LABELS: dict[str, dict[str, str]] = {
    # ZeRO's dense group dp·cp·sp is cp's ranks here (dp = sp = 1), so ZeRO and the sequence loss count as cp
    "llama3_tp2_cp2_pp2": {"tp": "tp", "cp": "cp", "pp": "pp", "seq": "cp", "dense": "cp", "world": "world"},
    # experts are ZeRO-sharded over the ranks of the stage holding the same experts ("across-ep")
    "deepseek_pp2_ep2_dp4": {"ep": "ep", "pp": "pp", "dense": "dp", "experts": "across-ep", "world": "world"},
    # dp·cp·sp spans the world, so the default group's traffic (the gradient norm) is named after it
    "usp_sp2_cp2_dp2": {"sp": "sp", "cp": "cp", "seq": "cp-sp", "dense": "dp-cp-sp", "world": "dp-cp-sp"},
}

KINDS = (  # tag prefix -> what it carries
    ("tp ", "tp"),
    ("ring ", "ring"),
    ("ulysses ", "ulysses"),
    ("sequence-parallel ", "sequence loss"),
    ("pipeline activation", "pipeline"),
    ("pipeline gradient", "pipeline"),
    ("pipeline shape", "pipeline shape"),
    ("pipeline stage costs", "pipeline bookkeeping"),
    ("pipeline losses", "pipeline bookkeeping"),
    ("expert token counts", "expert counts"),
    ("expert ids", "expert ids"),
    ("expert dispatch", "expert rows"),
    ("expert combine", "expert rows"),
    ("gradient bucket", "zero"),
    ("updated weights", "zero"),
    ("used-parameter flags", "zero flags"),
    ("gradient norm", "gradient norm"),
    ("rank health", "rank health"),
)


def _kind(op: str, tag: str) -> str:
    kind = next((k for prefix, k in KINDS if tag.startswith(prefix)), tag)  # an unknown tag stays itself: no formula
    return f"{kind} {op}" if kind == "pipeline" else kind  # sends (p2p) and receives (p2p_recv) apart


def _measure(name: str) -> dict[str, Any]:
    engine = slipstream.initialize(_mixtral(), _config(RECIPES[name], 1))
    mesh, m = engine.mesh, engine.gradient_accumulation_steps()
    routed: list[torch.Tensor] = []  # per training forward of an expert layer: this rank's choices of each expert

    def count(module: ExpertParallelExperts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        choices = (
            args[1] if len(args) > 1 else kwargs["top_k_index"]
        )  # forward(hidden_states, top_k_index, top_k_weights)
        routed.append(torch.bincount(choices.reshape(-1), minlength=module.num_experts))

    for module in engine.module.modules():
        if isinstance(module, ExpertParallelExperts):
            module.register_forward_pre_hook(count, with_kwargs=True)
    first, second = _batches(mesh.size("dp"), m)[:2]
    train_step_on_global_batch(engine, first, MICRO)  # its log also holds initialize's collectives (twin checks)
    routed.clear()
    train_step_on_global_batch(engine, second, MICRO)
    records = list(comms_log.last)  # the second step's, closed by its optimizer step
    measured: Counter[tuple[str, str]] = Counter()
    for r in records:
        (label,) = mesh.traffic([r])  # the step record's label for this record's group
        measured[(label, _kind(r.op, r.tag))] += r.moved
    result = {
        "measured": dict(measured),
        "by_axis": mesh.traffic(records),
        "m": m,
        "monitor": {k: v for k, v in engine.monitor.last.items() if k.startswith("comms_MB")},
        "sizes": {a: mesh.size(a) for a in AXES},
        "coords": {a: mesh.rank_of(a) for a in AXES},
        "ep_ranks": mesh.ranks("ep"),
        "routed": torch.stack(routed).sum(0).tolist() if routed else [],
        "expert_forwards": len(routed),
        "ranges": [list(r) for r in engine.pipeline.ranges] if engine.pipeline is not None else None,
    }
    engine.close()
    return result


def _body() -> dict[str, Any]:
    return {name: _measure(name) for name in RECIPES}


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_distributed(8, _body)


def _model_shapes() -> dict[str, Any]:
    model = _mixtral()
    c = model.config
    return {
        "hidden": c.hidden_size,
        "vocab": c.vocab_size,
        "heads": c.num_attention_heads,
        "kv": c.num_key_value_heads,
        "d": c.hidden_size // c.num_attention_heads,
        "layers": c.num_hidden_layers,
        "experts": c.num_local_experts,
        "params": {n: p.numel() for n, p in model.named_parameters()},
    }


def _padded(numel: int, ranks: int) -> int:
    quantum = ranks * 8  # zero/flat_layout.py: a bucket is padded to a multiple of group size × ALIGN (8 elements)
    return -(-numel // quantum) * quantum


def _stage_params(shapes: dict[str, Any], stage: int, p: int, t: int, ep: int) -> tuple[int, int, int, int]:
    """(numel, tensors) of this rank's dense parameters, then of its experts: the stage's layers (split evenly; the
    embedding on the first stage, the final norm and head on the last), attention projections and the vocabulary
    layers cut in t (tensor parallel), the experts in ep (expert parallel; replicated under tp)."""
    dense = [0, 0]
    expert = [0, 0]
    for name, numel in shapes["params"].items():
        if name.startswith("model.layers."):
            owner = int(name.split(".")[2]) * p // shapes["layers"]
        else:
            owner = 0 if name.startswith("model.embed_tokens") else p - 1
        if owner != stage:
            continue
        if any(part in name for part in ("_proj.weight", "embed_tokens", "lm_head")):  # q/k/v/o_proj, vocabulary
            numel //= t
        if ".experts." in name and ep > 1:
            expert[0] += numel // ep
            expert[1] += 1
        else:
            dense[0] += numel
            dense[1] += 1
    return dense[0], dense[1], expert[0], expert[1]


def _routed_pairs(results: list[dict[str, Any]], name: str, rank: int, experts: int) -> tuple[int, int]:
    """(token, choice) pairs this rank sent to another rank's experts that step, and pairs other ranks sent to its."""
    mine = results[rank][name]
    ep, me = mine["sizes"]["ep"], mine["coords"]["ep"]
    owner = [e // (experts // ep) for e in range(experts)]  # contiguous ranges of E/ep experts per rank
    out = sum(n for e, n in enumerate(mine["routed"]) if owner[e] != me)
    arrived = sum(
        results[q][name]["routed"][e] for q in mine["ep_ranks"] if q != rank for e in range(experts) if owner[e] == me
    )
    return out, arrived


def _expected(results: list[dict[str, Any]], name: str, rank: int, shapes: dict[str, Any]) -> Counter[tuple[str, str]]:
    r, lab = results[rank][name], LABELS[name]
    s, m, stage = r["sizes"], r["m"], r["coords"]["pp"]
    p, dp, c, u, t, ep = s["pp"], s["dp"], s["cp"], s["sp"], s["tp"], s["ep"]
    h, d, heads, kv, vocab = shapes["hidden"], shapes["d"], shapes["heads"], shapes["kv"], shapes["vocab"]
    first, last = int(stage == 0), int(stage == p - 1)
    layers = shapes["layers"] // p  # decoder layers on this rank's stage
    tokens = SEQ // (c * u)  # this rank's share of each sequence
    act = MICRO * tokens * h * F32  # one micro-batch's hidden states on this rank
    expect: Counter[tuple[str, str]] = Counter()

    if t > 1:
        # Tensor parallel (tensor/ops.py, layers.py): per micro-batch, forward one all-reduce of the hidden states after
        # each row-parallel o_proj and after the vocabulary-parallel embedding (first stage); backward one at each
        # column-parallel region's input (q|k|v, and the vocabulary-parallel head on the last stage), all-reduce = 2×;
        # forward the head's logits all-gathered (1×). Mixtral's fused experts and router stay replicated: no traffic.
        expect[(lab["tp"], "tp")] = m * (
            2 * act * (layers + first) + 2 * act * (layers + last) + last * MICRO * tokens * vocab * F32
        )
    if c > 1:
        # Ring attention (context/ring_attention.py, [Note: the ring] and [Note: flash blocks]): per layer and micro-batch c−1
        # sends of K|V forward, c−1 of K|V|dK|dV backward and one of dK|dV home; K|V = b·2·Hkv'·(s/c)·d with this
        # rank's KV heads Hkv' (Hkv/t under tp; max(Hkv, u)/u after Ulysses) and its context shard's s/c tokens.
        kv_bytes = MICRO * 2 * (max(kv, u) // u // t) * (SEQ // c) * d * F32
        expect[(lab["cp"], "ring")] = m * layers * ((c - 1) * kv_bytes + (c - 1) * 2 * kv_bytes + kv_bytes)
    if u > 1:
        # Ulysses (sequence/ulysses.py): per layer and micro-batch an all-to-all of the packed Q|K|V,
        # b·(H + 2·max(Hkv, u))·(s/(c·u))·d, and one of the output, b·H·(s/(c·u))·d, forward, and both again backward;
        # (u−1)/u of each leaves the rank.
        qkv, out = MICRO * (heads + 2 * max(kv, u)) * tokens * d * F32, MICRO * heads * tokens * d * F32
        expect[(lab["sp"], "ulysses")] = m * layers * 2 * (qkv + out) * (u - 1) // u
    if c * u > 1 and last:
        # The split sequence's loss (sequence/inputs.py combine): per micro-batch two fp32 all-reduces (token count, loss).
        expect[(lab["seq"], "sequence loss")] = m * 2 * 2 * F32
    if p > 1:
        # Pipeline P2P (pipeline/executor.py): per micro-batch and stage boundary the activation goes forward and its
        # gradient back, b·(s/(c·u))·h fp32 each (every tp rank sends its own copy). A rank logs what it sends and what
        # it receives: 2·m·act per boundary, half each way. Each activation is preceded by a shape header of 8 int64.
        # Per step the stage-cost table (p × 3 float64, all-reduced) and the m losses (float64, broadcast).
        sends_activations, sends_gradients = int(stage < p - 1), int(stage > 0)
        boundaries = sends_activations + sends_gradients
        expect[(lab["pp"], "pipeline p2p")] = m * act * boundaries
        expect[(lab["pp"], "pipeline p2p_recv")] = m * act * boundaries
        expect[(lab["pp"], "pipeline shape")] = m * 8 * I64 * boundaries
        expect[(lab["pp"], "pipeline bookkeeping")] = 2 * p * 3 * 8 + m * 8
    if ep > 1:
        # Expert dispatch/combine (expert/dispatch.py), logged as what leaves the rank: per layer and micro-batch the
        # int64 counts for the ep−1 other ranks; then the int64 expert id of each (token, choice) pair
        # leaving, its hidden state (dispatch) and backward the gradient of its combined row (h fp32 each), and for
        # each pair that arrived its computed row (combine) and backward its gradient (h fp32 each).
        assert r["expert_forwards"] == m * layers, r["expert_forwards"]
        out, arrived = _routed_pairs(results, name, rank, shapes["experts"])
        expect[(lab["ep"], "expert counts")] = m * layers * (ep - 1) * I64
        expect[(lab["ep"], "expert ids")] = out * I64
        expect[(lab["ep"], "expert rows")] = 2 * (out + arrived) * h * F32
    # ZeRO-1 (zero/flat_layout.py, partitioned.py): per step one reduce-scatter of the gradients and one all-gather of the
    # updated weights of each sharding group's bucket (one bucket: the model is far below reduce_bucket_size), of
    # the group's parameters on this rank padded to group × 8 elements; one all-reduce of an fp32 used-flag per
    # parameter tensor (sharding_groups.py). Dense parameters over dp·cp·sp, experts over the stage's ranks holding
    # the same experts; then the gradient norm, one fp32 all-reduced over the world (in the flags' tensor when the
    # dense group is the world and the only one).
    dense, dense_tensors, experts, expert_tensors = _stage_params(shapes, stage, p, t, ep)
    expect[(lab["dense"], "zero")] = 2 * _padded(dense, dp * c * u) * F32
    expect[(lab["dense"], "zero flags")] = 2 * dense_tensors * F32
    if ep > 1:
        expect[(lab["experts"], "zero")] = 2 * _padded(experts, dp * c * u * t // ep) * F32
        expect[(lab["experts"], "zero flags")] = 2 * expert_tensors * F32
    if p == 1 and t == 1 and ep == 1:  # one sharding group, the world: the norm rides in the flags' all-reduce
        expect[(lab["dense"], "zero flags")] += 2 * F32  # (masters_strategy.py, [Note: the flags ride the norm])
    else:
        expect[(lab["world"], "gradient norm")] = 2 * F32
    # The monitor's rank-health exchange at each progress line (steps_per_print 1; engine/monitor/health.py): one
    # all-gather over the world of three float64 per rank (its seconds per step, its first non-finite step and loss).
    expect[(lab["world"], "rank health")] = 3 * F64 * p * dp * c * u * t  # ep sits inside dp · cp · sp · tp
    return expect


@pytest.mark.parametrize("name", list(RECIPES))
def test_bytes_per_axis_equal_the_formulas(results: list[dict[str, Any]], name: str) -> None:
    shapes = _model_shapes()
    for rank, ranks in enumerate(results):
        r = ranks[name]
        if r["ranges"] is not None:  # the premise of the formulas' layers per stage
            assert r["ranges"] == [[i] for i in range(r["sizes"]["pp"])], r["ranges"]
        expected = _expected(results, name, rank, shapes)
        measured = Counter(r["measured"])
        beyond, short = sorted((measured - expected).items()), sorted((expected - measured).items())
        assert measured == expected, f"{name} rank {rank}: {beyond} logged beyond the formulas, {short} short of them"
        by_axis: Counter[str] = Counter()
        for (label, _), moved in expected.items():
            by_axis[label] += moved
        by_axis = +by_axis  # labels with bytes only
        assert r["by_axis"] == dict(by_axis), (name, rank)
        if rank == 0:  # the step record (rank 0 writes it): the same bytes by axis, in MiB
            assert {k.partition("/")[2]: v * 2**20 for k, v in r["monitor"].items() if "/" in k} == pytest.approx(
                dict(by_axis), rel=1e-12
            )
            assert r["monitor"]["comms_MB"] * 2**20 == pytest.approx(sum(by_axis.values()), rel=1e-12)
