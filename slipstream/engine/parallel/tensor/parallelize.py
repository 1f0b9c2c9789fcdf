"""``parallelize_tensor``: cut an unchanged model for tensor (and sequence) parallelism, in one fixed order.

1. make the default random generator identical on the tp group (rank 0 of the group wins; see
   ``parallel/rng.py``; the weights already are: ``parallel/weights.py``);
2. record the self-check probe on the whole model and the leaves' execution order;
3. build the plan (config → ``base_model_tp_plan`` → inferred) and check it divides (heads, sizes);
4. replace the planned leaves by sharded ones, rewrite sharded size attributes on their parents,
   shard the embedding and the LM head on the vocabulary;
5. record every parameter's placement (``utils.placement``) so checkpoints and the norm see the
   global model;
6. the self-check (fails ``initialize`` naming the block);
7. gradients of replicated parameters that see sharded activations summed over tp (``partial_grads``);
   sequence parallel: the region edges.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from slipstream.engine.config import ConfigError
from slipstream.engine.parallel.anatomy import find_blocks
from slipstream.engine.parallel.mesh import Mesh
from slipstream.engine.parallel.rng import ShardedRegionRng, sync_default_rng
from slipstream.engine.parallel.tensor import probe as probing
from slipstream.engine.parallel.tensor import sequence
from slipstream.engine.parallel.tensor.layers import ShardedLinear, SharedInput, TPContext, VocabEmbedding, VocabHead
from slipstream.engine.parallel.tensor.options import TensorOptions
from slipstream.engine.parallel.tensor.partial_grads import params_in_sharded_regions, sum_gradients_over_tp
from slipstream.engine.parallel.tensor.plan import PlanEntry, build_plan, in_features, is_linear_like, out_features
from slipstream.engine.parallel.twin import harness as twin
from slipstream.engine.parallel.twin.tensor_blocks import verify
from slipstream.utils.logging import get_logger, log_rank0
from slipstream.utils.placement import place, place_parts, placement_of

logger = get_logger(__name__)

# Integer attributes of a sharded leaf's parent that hold a sharded size (rewritten on that module only).
SIZE_ATTRIBUTES = ("split_size", "embed_dim", "all_head_size", "inner_dim", "hidden_size_per_partition")
HEAD_ATTRIBUTES = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads")


@dataclasses.dataclass
class TensorParallel:
    """What ``parallelize_tensor`` did: the plan, the context, the vocabulary layers it sharded."""

    ctx: TPContext
    plan: list[PlanEntry]
    vocab_sharded: list[str]
    hooks: list[Any]

    def close(self) -> None:
        """Remove the gradient reductions and sequence-parallel region hooks (the sharded leaves stay)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []


def _named(model: torch.nn.Module, module: torch.nn.Module) -> str | None:
    return next((n for n, m in model.named_modules() if m is module), None)


def _replace(model: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, attr, new)


def _check_divides(
    plan: list[PlanEntry], leaves: dict[str, torch.nn.Module], model: torch.nn.Module, t: int
) -> list[PlanEntry]:
    """Sizes and heads that divide by t; a column projection with fewer heads than t (and t a multiple) becomes ``kv``."""
    checked = []
    for entry in plan:
        leaf = leaves[entry.name]
        size = out_features(leaf) // entry.parts if entry.style == "column" else in_features(leaf)
        if entry.gathered:  # whole tensors between the pair: only the weight's cut must divide
            if size % t or entry.parts > 1:
                raise ConfigError(
                    f"tensor_parallel.autotp_size: {entry.name} ({entry.style}, gathered) has size {size}, which does not divide by {t}"
                )
            checked.append(entry)
            continue
        parent = model.get_submodule(entry.name.rpartition(".")[0])
        head_dim = getattr(parent, "head_dim", None)
        heads = size // head_dim if isinstance(head_dim, int) and head_dim > 0 and size % head_dim == 0 else 0
        if entry.style == "column" and entry.parts == 1 and 0 < heads < t and t % heads == 0:
            checked.append(dataclasses.replace(entry, style="kv", kv_heads=heads))
            continue
        if (out_features(leaf) % entry.parts) or size % t:
            raise ConfigError(
                f"tensor_parallel.autotp_size: {entry.name} ({entry.style}) has size {size}, which does not divide by {t}"
            )
        if entry.style == "column" and heads and heads % t:
            raise ConfigError(
                f"tensor_parallel.autotp_size: {entry.name} holds {heads} heads, which neither divide by {t} nor divide {t}; "
                f"choose a tp size that divides the number of heads (or a multiple of the key/value heads)"
            )
        checked.append(entry)
    return checked


def _rewrite_attributes(parent: torch.nn.Module, part_sizes: set[int], t: int) -> list[str]:
    changed = []
    for attr in SIZE_ATTRIBUTES + HEAD_ATTRIBUTES:
        value = parent.__dict__.get(attr)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if (attr in SIZE_ATTRIBUTES and value in part_sizes) or (attr in HEAD_ATTRIBUTES and value % t == 0):
            setattr(parent, attr, value // t)
            changed.append(f"{attr} {value}→{value // t}")
    return changed


def _rewrite_kv_groups(
    model: torch.nn.Module, plan: list[PlanEntry], part_sizes: dict[str, set[int]], rewritten: dict[str, list[str]]
) -> None:
    """Replicated KV heads: one KV head per rank serves all of the rank's query heads (``num_key_value_groups``)."""
    for entry in plan:
        parent_name = entry.name.rpartition(".")[0]
        parent = model.get_submodule(parent_name)
        if entry.style == "kv" and isinstance(parent.__dict__.get("num_key_value_groups"), int):
            local_q = max(size // parent.head_dim for size in part_sizes.get(parent_name, {parent.head_dim}))
            if parent.num_key_value_groups != local_q:
                rewritten.setdefault(parent_name, []).append(
                    f"num_key_value_groups {parent.num_key_value_groups}→{local_q}"
                )
                parent.num_key_value_groups = local_q


def _plain_embedding(model: torch.nn.Module, embedding: torch.nn.Module, head: torch.nn.Module | None) -> bool:
    """Whether ``VocabEmbedding`` computes what ``embedding`` computes: nn.Embedding's own forward (Gemma's scaled
    embedding multiplies in its forward), and a weight no module but it and the head holds (BART's embedding
    is shared by the encoder, the decoder and the head: sharding one holder would split the weight)."""
    if type(embedding).forward is not torch.nn.Embedding.forward:
        return False
    holders = {id(m) for m in model.modules() if getattr(m, "weight", None) is embedding.weight}
    return holders <= {id(embedding), id(head)}


def _shard_vocab(model: torch.nn.Module, ctx: TPContext) -> list[str]:
    """Embedding and LM head on the vocabulary (unevenly when it does not divide by t: see ``layers.vocab_rows``).

    Under a pipeline a stage may hold only one of them (the other is a parameter-free stand-in,
    ``parallel/pipeline/cut.py``): each is sharded where it is held.
    """
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    head = get_out() if callable(get_out) else None
    if head is not None and not isinstance(getattr(head, "weight", None), torch.Tensor):
        head = None  # a pipeline stage without the head
    done: list[str] = []
    shard_embedding = isinstance(embedding, torch.nn.Embedding) and embedding.weight.shape[0] >= 2 * ctx.size
    if shard_embedding and not _plain_embedding(model, embedding, head):
        return done  # kept whole, head too: a vocab-sharded stand-in would drop what this one does differently
    tied = shard_embedding and head is not None and head.weight is embedding.weight
    if tied and not (isinstance(head, torch.nn.Linear) and head.bias is None):
        return done  # a tied head we cannot shard (BERT's has a bias): both stay whole, as they must agree
    new_embedding = None
    if shard_embedding:
        emb_name = _named(model, embedding)
        new_embedding = VocabEmbedding(embedding, ctx)
        _replace(model, emb_name, new_embedding)
        done.append(emb_name)
    elif embedding is not None and isinstance(getattr(embedding, "weight", None), torch.Tensor):
        return done  # an embedding too small to shard: its head stays whole too
    head_name = _named(model, head) if head is not None else None
    rows = head.weight.shape[0] if isinstance(head, torch.nn.Linear) else 0
    if (
        isinstance(head, torch.nn.Linear)
        and head.bias is None
        and rows >= 2 * ctx.size
        and (new_embedding is None or rows == new_embedding.num_embeddings)
    ):
        _replace(
            model,
            head_name,
            VocabHead(head, ctx, weight=new_embedding.weight if tied and new_embedding is not None else None),
        )
        done.append(head_name)
    elif tied:
        raise ConfigError(
            f"tensor_parallel: the LM head {head_name} is tied to the embedding but is not a plain nn.Linear; cannot shard it"
        )
    return done


def _place_all(model: torch.nn.Module, ctx: TPContext) -> None:
    for module in model.modules():
        if isinstance(module, ShardedLinear):
            offsets = [0, 0]
            offsets[module.shard_dim] = module.offset
            if module.parts > 1:  # a packed projection's piece is one box per part (utils/placement.py)
                place_parts(
                    module.weight,
                    module.global_weight_shape,
                    module.packed_boxes(module.global_weight_shape, module.shard_dim),
                )
                if module.bias is not None:
                    place_parts(module.bias, module.global_bias_shape, module.packed_boxes(module.global_bias_shape, 0))
                continue
            place(module.weight, module.global_weight_shape, tuple(offsets), duplicate=module.duplicate)
            if module.bias is not None and module.style in ("column", "kv"):
                place(module.bias, module.global_bias_shape, (module.offset,), duplicate=module.duplicate)
        elif isinstance(module, VocabEmbedding):
            place(module.weight, module.global_weight_shape, (module.start, 0))
        elif isinstance(module, VocabHead) and placement_of(module.weight) is None:
            place(module.weight, module.global_weight_shape, (module.start, 0))
    for param in model.parameters():
        if placement_of(param) is None:
            place(param, tuple(param.shape), duplicate=ctx.rank != 0)


@dataclasses.dataclass
class _Shards:
    """The blocks as sharded by one plan, and how to put them back (``_gathered_fallback``)."""

    shared: dict[str, SharedInput]
    rewritten: dict[str, list[str]]
    originals: list[tuple[str, torch.nn.Module]]  # (leaf name, unsharded leaf)
    attributes: list[tuple[torch.nn.Module, dict[str, Any]]]  # parents' attributes before the rewrite

    def undo(self, model: torch.nn.Module) -> None:
        for name, leaf in self.originals:
            _replace(model, name, leaf)
        for parent, values in self.attributes:
            parent.__dict__.update(values)


def _shard_blocks(
    model: torch.nn.Module, plan: list[PlanEntry], leaves: dict[str, torch.nn.Module], ctx: TPContext, t: int
) -> _Shards:
    """Replace the planned leaves by sharded ones and rewrite their parents' sharded sizes and head counts."""
    shared: dict[str, SharedInput] = {}
    part_sizes: dict[str, set[int]] = {}
    opened: list[SharedInput] = []  # the column inputs of the group the next row closes (in another module, for BERT)
    parents = {entry.name.rpartition(".")[0] for entry in plan}
    watched = (*SIZE_ATTRIBUTES, *HEAD_ATTRIBUTES, "num_key_value_groups")
    attributes = [
        (m, {a: m.__dict__[a] for a in watched if a in m.__dict__}) for m in map(model.get_submodule, sorted(parents))
    ]
    for entry in plan:
        parent = entry.name.rpartition(".")[0]
        share = shared.setdefault(parent, SharedInput(ctx))
        leaf = leaves[entry.name]
        if entry.style in ("column", "kv"):
            share.opens = True
            opened.append(share)
        if entry.style == "column" and not entry.gathered:  # a gathered group's heads stay whole: nothing to rewrite
            part_sizes.setdefault(parent, set()).add(out_features(leaf) // entry.parts)
        elif entry.style == "row":
            for closed in (*opened, share):
                closed.closed_by_row = True
            opened = []
        _replace(
            model,
            entry.name,
            ShardedLinear(leaf, entry.style, ctx, share, entry.parts, kv_heads=entry.kv_heads, gathered=entry.gathered),
        )
    rewritten = {p: _rewrite_attributes(model.get_submodule(p), sizes, t) for p, sizes in part_sizes.items()}
    _rewrite_kv_groups(model, plan, part_sizes, rewritten)
    ctx.rng = ShardedRegionRng(ctx.rank)  # after the plan: the self-check and training fork it per sub-block
    return _Shards(shared, rewritten, [(e.name, leaves[e.name]) for e in plan], attributes)


def _group_index(plan: list[PlanEntry], block_names: Sequence[str]) -> dict[str, int]:
    """Each entry's column…row group, numbered within its block in execution order (blocks are alike)."""
    index: dict[str, int] = {}
    for block in block_names:
        group = 0
        for entry in (e for e in plan if e.name.startswith(block + ".")):
            index[entry.name] = group
            group += entry.style == "row"
    return index


def _gathered_fallback(
    model: torch.nn.Module,
    plan: list[PlanEntry],
    shards: _Shards,
    leaves: dict[str, torch.nn.Module],
    ctx: TPContext,
    t: int,
    block_names: Sequence[str],
    accept: Callable[[list[PlanEntry], _Shards], list[Any]],
) -> tuple[list[PlanEntry], _Shards, list[Any]]:
    """[Note: gathered fallback] An inferred plan shards each group's heads, which needs the code between a column
    and its row to work on this rank's heads: it does not for Falcon's or GPT-BigCode's fused Q|K|V split by the
    global head counts, Bloom's ALiBi slopes for every head, StableLM's per-head norms. When the self-check refuses
    (or the twin check, when the per-head pieces start out equal: StableLM's norms) the inferred plan, the same
    groups are tried gathered ([Note: gathered groups] in layers.py: the projections'
    weights and compute stay sharded, what runs between them sees whole tensors), one group of every block at a
    time and then all of them; the first plan the self-check and the twin check accept is kept. A plan from the
    config or the model is never changed. Called while the first refusal is being handled; re-raises it when no
    attempt passes."""
    if any(e.source != "inferred" for e in plan):
        raise  # noqa: PLE0704 - the first refusal, unchanged
    index = _group_index(plan, block_names)
    groups = sorted(set(index.values()))
    tries = [{g} for g in groups] + ([set(groups)] if len(groups) > 1 else [])
    for gathered in tries:
        candidate = [
            dataclasses.replace(e, style="row" if e.style == "row" else "column", parts=1, kv_heads=0, gathered=True)
            if index.get(e.name) in gathered
            else e
            for e in plan
        ]
        try:
            _check_divides([e for e in candidate if e.gathered], leaves, model, t)
        except ConfigError:  # a gathered weight that does not divide by t
            continue
        shards.undo(model)
        shards = _shard_blocks(model, candidate, leaves, ctx, t)
        try:
            hooks = accept(candidate, shards)
        except ConfigError:
            continue
        log_rank0(
            logger,
            "tensor parallel: this model's heads do not shard as inferred; group(s) %s of each block run gathered "
            "(weights sharded, attention whole: [Note: gathered fallback])",
            sorted(gathered),
        )
        return candidate, shards, hooks
    shards.undo(model)
    _shard_blocks(model, plan, leaves, ctx, t)  # the refused plan back in place, as the refusal describes it
    raise  # noqa: PLE0704


class ExpertsBeside(Protocol):
    """What the tensor step needs of expert parallelism (``expert.ExpertPlan``), which ran before it."""

    params: list[torch.nn.Parameter]

    def split_tokens(self, shards: Callable[[], int]) -> None: ...


def parallelize_tensor(
    model: torch.nn.Module, mesh: Mesh, options: TensorOptions | None, experts: ExpertsBeside | None = None
) -> TensorParallel | None:
    """Tensor (+ sequence) parallelism over ``mesh.group("tp")``; None when tp is 1. Collective over the world.

    [Note: experts in the sequence-parallel region] Routed experts sit outside any column/row pair,
    so under Megatron sequence parallelism they run on this rank's part of the sequence. Their
    gradients are then neither replicated over tp (each tp rank of an ep group holds other experts)
    nor to be summed over it: the tp ranks' parts reach each expert through the dispatch and add up
    there, so expert parameters are left out of the tp sum and their ep scaling counts the parts
    (``ExpertPlan.split_tokens``). This needs every tp group inside one ep group (ep a multiple of
    tp); with a smaller ep, ranks holding the same experts would each hold half the sum.

    [Note: packed placement] A packed projection's local piece (this rank's Q, K and V columns) is
    three boxes of the global tensor: it is stored part-major and placed with ``place_parts``, so
    checkpoints and ``consolidated_state_dict`` store and assemble it box by box.
    """
    if options is None:
        return None
    t = options.size
    if experts is not None and options.sequence_parallel and mesh.size("ep") % t:
        raise ConfigError(
            f"tensor_parallel.sequence_parallel: expert_parallel.autoep_size {mesh.size('ep')} is not a multiple of "
            f"tensor_parallel.autotp_size {t}: tp ranks holding the same experts would each see part of the sequence "
            "(see [Note: experts in the sequence-parallel region]); use an ep that is a multiple of tp"
        )
    # Sequence parallel switches on after the self-check, which runs blocks on whole sequences.
    ctx = TPContext(mesh.group("tp"), t, mesh.rank_of("tp"), options.sequence_parallel, enabled_sequence=False)
    sync_default_rng(ctx.group, mesh.ranks("tp")[0])  # replicated dropout alike on every tp rank
    blocks = find_blocks(model)
    if blocks is None:
        raise ConfigError(
            "tensor_parallel.autotp_size: the model has no repeated blocks (a ModuleList/Sequential of identical layers) to shard"
        )
    leaves = {
        f"{block_name}.{n}": m
        for block_name, block in zip(blocks.names, blocks.modules)
        for n, m in block.named_modules()
        if n and is_linear_like(m)
    }
    if not leaves:
        raise ConfigError("tensor_parallel.autotp_size: the model's blocks hold no nn.Linear or Conv1D to shard")
    twin_batch, expected = None, None
    if options.twin_check:  # the whole model's twin, before anything is sharded (parallel/twin/harness.py)
        found = twin.synthetic_batches(model, 1, divisor=t)
        if found is not None:
            twin_batch, expected = found[0], twin.whole_model_reference(model, found[0])
    probe = probing.capture(model, blocks.modules, leaves)
    # the modules that call the attention function, found on the unsharded model (sequence.py's [Note: replicated attention])
    attention = probing.attention_modules(model, blocks.modules, leaves) if options.sequence_parallel else []
    order = probe.order + [n for n in leaves if n not in probe.order]
    plan = build_plan(
        model, leaves, order, options.partition_config, lambda: probing.leaf_inputs(model, blocks.modules, leaves)
    )
    plan = _check_divides(plan, leaves, model, t)
    tolerance = twin.tolerance_for(model, "block")
    own_experts = set() if experts is None else {id(p) for p in experts.params}

    def accept(candidate: list[PlanEntry], shards: _Shards) -> list[Any]:
        """The self-check, the gradient hooks and the twin check of one plan; its hooks, or ConfigError (none left)."""
        verify(probe.calls, probe.outputs, blocks.modules, blocks.names, candidate, ctx.group, tolerance)
        _place_all(model, ctx)
        if ctx.sequence_parallel:  # every replicated block parameter: a superset of the sharded regions' ones
            hooks = sequence.enable(
                model, blocks.modules, ctx, shards.shared, not_replicated=own_experts, attention=attention
            )
        else:
            hooks = sum_gradients_over_tp(
                params_in_sharded_regions(blocks.modules, probe.calls[0], ctx), ctx, "tp replicated gradient"
            )
        if expected is None:
            return hooks
        name = type(model).__name__ + (" with sequence parallel" if ctx.sequence_parallel else "")
        try:
            twin.check_whole_model(
                model,
                twin_batch,
                expected,
                ctx.group,
                f"tensor_parallel.autotp_size: the {t}-way sharded {name} does not reproduce the unsharded model (twin check)",
                "the unsharded model on the same batch",
            )
        except ConfigError:  # undo this plan's hooks: the caller may try the gathered fallback
            for handle in hooks:
                handle.remove()
            ctx.enabled_sequence = False
            raise
        return hooks

    if experts is not None and ctx.sequence_parallel:  # before the twin check, which trains the experts too
        experts.split_tokens(lambda: t if ctx.sp else 1)
    shards = _shard_blocks(model, plan, leaves, ctx, t)
    vocab = _shard_vocab(model, ctx)
    try:
        hooks = accept(plan, shards)
    except ConfigError:
        plan, shards, hooks = _gathered_fallback(model, plan, shards, leaves, ctx, t, blocks.names, accept)
    rewritten = shards.rewritten
    columns = sum(e.style != "row" for e in plan)
    log_rank0(
        logger,
        "tensor parallel %d%s: %d column + %d row leaves in %d blocks (%s)%s%s",
        t,
        " + sequence parallel" if ctx.sequence_parallel else "",
        columns,
        len(plan) - columns,
        len(blocks),
        plan[0].source if plan else "empty plan",
        f"; vocabulary sharded: {', '.join(vocab)}" if vocab else "",
        "; attributes: " + "; ".join(f"{p}: {', '.join(c)}" for p, c in rewritten.items() if c)
        if any(rewritten.values())
        else "",
    )
    return TensorParallel(ctx, plan, vocab, hooks)
