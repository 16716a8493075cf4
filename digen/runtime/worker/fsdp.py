"""Sharded trainers: FSDP2 (``fully_shard``) over a ``DeviceMesh``.

With ``runtime.placement.trainer_parallel: fsdp`` every transformer block (the classes
diffusers lists in the model's ``_no_split_modules``), then the whole transformer, is sharded
over all the trainers: each holds ``1 / T`` of the weights, of the gradients and of the
optimizer state, and a block's full weights exist only while it runs (one all-gather in the
forward pass, one in the backward pass, then a reduce-scatter of its gradients). ``hsdp``
shards inside groups of ``runtime.placement.shard_size`` trainers (the GPUs of a node) and
replicates across them, all-reducing gradients between groups.

Every collective needs every member, so sharded trainers move in lockstep: they act as one
trainer that is ``T`` devices wide. Each update call is split over the members, by rows
(``runtime.placement.shard_deal: samples``) or by (row, trained timestep) terms (``terms``),
and each member runs the same number of forward/backward passes (a member short of work runs
a pass on a copy of a term, with its loss scaled by zero). The pieces that follow from that:

- :func:`shard_transformer` wraps a policy's transformer (before its optimizer is built, so
  the optimizer holds the sharded parameters: sharded optimizer state);
- :func:`lockstep_chunks` splits a call's rows over the members into equal numbers of chunks;
- :func:`lockstep_terms` does the same with a call's terms, a timestep batch per chunk;
- :func:`gather_dealt` puts rows dealt over the members back together on every member (a
  TAG micro-batch: each member samples ``1 / T`` of its rows);
- :func:`full_tensors` gathers the trained weights in full (one parameter at a time) for
  the generators, for saving and for the final state.

Precision: the weights keep their own dtype in the shards (a bf16 base, fp32 LoRA) and are
gathered in it, and the model's inputs reach it as the model gives them (its fp32 timesteps
and rotary tables), so a sharded trainer computes what an unsharded copy, a generator's,
does: its recomputed log-probs are the recorded ones at the same weights (the
``train/logprob_drift_*`` metrics). With a base in bf16 or fp16 gradients are reduced in
fp32. The log-prob and loss math is fp32 as everywhere else.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from digen.errors import DigenError

# diffusers' blocks return views of their inputs; FSDP2 warns that an in-place op on such a
# view would skip its backward hook. The models only use these outputs out of place (the
# sharded == whole-model tests check the gradients).
warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")

__all__ = [
    "block_modules",
    "full_tensors",
    "gather_dealt",
    "local",
    "lockstep_chunks",
    "lockstep_terms",
    "hsdp_shard_size",
    "make_mesh",
    "shard_and_load",
    "shard_transformer",
]


def make_mesh(kind: str, world: int, device_type: str, shard_size: int | None = None) -> Any:
    """The trainers' ``DeviceMesh`` over the default process group: 1-D for ``fsdp``; for
    ``hsdp`` 2-D ``(replicate, shard)`` with ``shard_size`` trainers per sharding group."""
    from torch.distributed.device_mesh import init_device_mesh

    if kind == "fsdp":
        return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
    size = shard_size or hsdp_shard_size(world, device_type)
    if world % size:
        raise ValueError(
            f"runtime.placement.shard_size={size} does not divide the {world} trainers"
        )
    return init_device_mesh(
        device_type, (world // size, size), mesh_dim_names=("replicate", "shard")
    )


def hsdp_shard_size(world: int, device_type: str) -> int:
    """HSDP's default sharding group: the trainers of one node (torchrun's
    ``LOCAL_WORLD_SIZE``, else the GPUs this node shows), capped at ``world``. When that is
    every trainer, HSDP is plain FSDP: the run's log says so (``runtime.placement.shard_size``
    sets it)."""
    import logging
    import os

    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is not None:
        size = int(local)
    elif device_type == "cuda" and torch.cuda.is_available():
        size = torch.cuda.device_count()
    else:
        size = world
    size = max(1, min(world, size))
    if size == world:
        logging.getLogger("digen").info(
            f"runtime.placement.trainer_parallel=hsdp over {world} trainers of one node shards "
            "over all of them, as fsdp does (no replicas); set runtime.placement.shard_size to "
            "shard in smaller groups and replicate across them"
        )
    return size


def block_modules(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks: instances of the classes in its ``_no_split_modules`` (the
    units diffusers itself never splits across devices)."""
    names = set(getattr(transformer, "_no_split_modules", None) or ())
    blocks = [m for m in transformer.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(transformer).__name__} names no transformer blocks (_no_split_modules), "
            "so it cannot be sharded block by block"
        )
    return blocks


def shard_transformer(transformer: torch.nn.Module, mesh: Any, compute_dtype: torch.dtype) -> int:
    """``fully_shard`` each block, then the root, over ``mesh``; returns the block count.

    Parameters are replaced by sharded ones (``DTensor``) in place: build optimizers after.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Compute exactly as an unsharded copy does (the generators' log-probs are its): each
    # weight gathered in its own dtype (a bf16 base, fp32 LoRA), inputs left as the model
    # gives them (its fp32 timesteps and rotary tables); FSDP's defaults would cast both to
    # the compute dtype on sharded trainers only. Gradients are reduced in fp32.
    low = compute_dtype in (torch.bfloat16, torch.float16)
    mp = MixedPrecisionPolicy(
        param_dtype=None,
        reduce_dtype=torch.float32 if low else None,
        cast_forward_inputs=False,
    )
    blocks = block_modules(transformer)
    for module in [*blocks, transformer]:
        fully_shard(module, mesh=mesh, mp_policy=mp)
        # Each backward is already scaled by 1 / (the step's terms): members' gradients add
        # up, they are not averaged (FSDP's default divides by the member count).
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain sum (gloo has no pre-scaled op)
    return len(blocks)


def shard_and_load(
    transformer: torch.nn.Module,
    mesh: Any,
    compute_dtype: torch.dtype,
    device: str,
    weights: str | Path,
) -> int:
    """Shard a transformer built without weights (parameters on the meta device:
    :func:`digen.models.weights.empty_transformer`), then give this member's shards memory on
    ``device`` and fill them: each weight's own rows read from the saved files in
    ``weights`` (a diffusers model folder), the rest (a LoRA adapter, buffers the model
    computes) from what the module holds now. No member ever holds a whole copy. Returns the
    block count (:func:`shard_transformer`)."""
    from digen.models.weights import WeightFiles, file_key

    with WeightFiles(weights) as files:
        named = [*transformer.named_parameters(), *transformer.named_buffers()]
        missing = [n for n, t in named if t.is_meta and file_key(n) not in files]
        if missing:
            raise DigenError(
                f"the weights in {files.directory} have no tensor '{file_key(missing[0])}' "
                f"({len(missing)} missing), so the transformer cannot be read shard by shard."
            )
        # what is not read from the files is small (adapters, computed buffers): kept aside
        kept = {n: t.detach().clone() for n, t in named if file_key(n) not in files}
        blocks = shard_transformer(transformer, mesh, compute_dtype)
        transformer.to_empty(device=device)
        with torch.no_grad():
            for name, t in [*transformer.named_parameters(), *transformer.named_buffers()]:
                rows = _own_rows(t)
                target = local(t)
                if target.numel() == 0:
                    continue
                if name in kept:
                    source = kept[name] if target.dim() == 0 else kept[name][rows]
                else:
                    source = files.rows(file_key(name), rows)
                target.copy_(source)
    return blocks


def _own_rows(t: torch.Tensor) -> slice:
    """The rows (first dim) of the whole tensor that this member's shard of ``t`` holds:
    FSDP2 cuts dim 0 into chunks of ``ceil(rows / members)``, member ``i`` holding chunk
    ``i`` (the last ones shorter or empty); all of them for a tensor that is not sharded."""
    placements = getattr(t, "placements", ())
    for mesh_dim, placement in enumerate(placements):
        if placement.is_shard():
            if placement.dim != 0:
                raise ValueError(f"expected shards along dim 0, got {placement}")
            members = t.device_mesh.size(mesh_dim)
            index = t.device_mesh.get_local_rank(mesh_dim)
            chunk = -(-t.shape[0] // members)
            lo = min(index * chunk, t.shape[0])
            return slice(lo, lo + local(t).shape[0])
    return slice(None)


def local(t: torch.Tensor) -> torch.Tensor:
    """This member's shard of ``t`` (``t`` itself when it is not sharded)."""
    return t.to_local() if hasattr(t, "to_local") else t


def full_tensors(
    named: Sequence[tuple[str, torch.Tensor]],
    keep: bool,
    device: str = "cpu",
    into: dict[str, torch.Tensor] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
) -> dict[str, torch.Tensor]:
    """``name -> full tensor`` of ``named``, gathered one at a time (every member must call,
    in the same order); only a member with ``keep`` holds the result (on ``device``, in
    ``dtypes``, one per tensor, where given). ``into``: the previous result, whose tensors
    are written over in place, so that a copy gathered every step never lives twice (and is
    not reallocated)."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(named):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            if keep:
                dtype = full.dtype if dtypes is None else dtypes[i]
                old = (into or {}).get(name)
                if old is not None and old.shape == full.shape and old.dtype == dtype:
                    out[name] = old.copy_(full)
                else:
                    out[name] = full.detach().to(device, dtype, copy=True)
            del full
    return out


def lockstep_chunks(rows: int, members: int, rank: int, size: int) -> list[list[int] | None]:
    """Member ``rank``'s chunks of a call's ``rows`` (indices ``0 .. rows-1``): it takes every
    ``members``-th row from ``rank`` and cuts them into chunks of at most ``size``. Every
    member gets the same number of chunks; None marks a chunk this member runs only to keep
    in step (on a copy of a row, contributing nothing)."""
    mine = list(range(rank, rows, members))
    most = -(-rows // members)  # the largest member's rows
    count = -(-most // size)
    chunks: list[list[int] | None] = [mine[i : i + size] for i in range(0, len(mine), size)]
    return chunks + [None] * (count - len(chunks))


def lockstep_terms(
    rows: int, timesteps: int, members: int, rank: int, size: int
) -> list[list[tuple[int, int]] | None]:
    """Member ``rank``'s chunks of a call's terms: every ``(row, j)`` pair of its ``rows``
    samples and ``timesteps`` trained timesteps (``j`` indexes a sample's trained timesteps).
    The terms are taken timestep by timestep (all rows at ``j = 0``, then at ``j = 1``, ...),
    every ``members``-th from ``rank``, and cut into chunks of at most ``size``: one forward
    pass each, as a batch of rows at their own timesteps. Every member gets the same number
    of chunks, None marking one it runs only to keep in step; every term is someone's once.

    Dealt this way, a member's terms touch few rows (with ``members`` a multiple of ``rows``,
    one), so it fetches little, and a call with fewer rows than members still gives every
    member work."""
    terms = [(i, j) for j in range(timesteps) for i in range(rows)]
    mine = terms[rank::members]
    most = -(-len(terms) // members)  # the largest member's terms
    count = -(-most // size)
    chunks: list[list[tuple[int, int]] | None] = [
        mine[i : i + size] for i in range(0, len(mine), size)
    ]
    return chunks + [None] * (count - len(chunks))


def gather_dealt(mine: torch.Tensor, rows: int, lead_only: bool = False) -> torch.Tensor | None:
    """The rows of a call dealt one chunk a member (:func:`lockstep_chunks` with ``size >=
    rows``: member ``r`` holds rows ``r, r + T, ...``), back in the call's order.

    ``mine``: ``[n_r, ...]`` this member's rows (``n_r`` may be 0; extra rows, a padding pass's,
    are ignored). Every member calls; all get ``[rows, ...]``, or with ``lead_only`` member 0
    does and the others get None. Moved as it is: a collective of the default group on the
    tensor's device (NCCL for GPU tensors, gloo for CPU ones)."""
    import torch.distributed as dist

    members, rank = dist.get_world_size(), dist.get_rank()
    most = -(-rows // members)  # the largest member's rows; every member sends as many
    count = len(range(rank, rows, members))
    padded = mine.new_zeros((most, *mine.shape[1:]))
    padded[:count] = mine[:count]
    if lead_only:
        parts = [torch.empty_like(padded) for _ in range(members)] if rank == 0 else None
        dist.gather(padded, parts, dst=0)
        if rank != 0:
            return None
    else:
        parts = [torch.empty_like(padded) for _ in range(members)]
        dist.all_gather(parts, padded)
    out = mine.new_empty((rows, *mine.shape[1:]))
    for r, part in enumerate(parts):
        out[r::members] = part[: len(range(r, rows, members))]
    return out


def map_params(
    module: torch.nn.Module, names: Sequence[str]
) -> Callable[[], list[torch.nn.Parameter]]:
    """A function returning ``module``'s parameters called ``names`` (after sharding the
    parameter objects are new ones, the names are the same)."""

    def find() -> list[torch.nn.Parameter]:
        by_name = dict(module.named_parameters())
        return [by_name[n] for n in names]

    return find
