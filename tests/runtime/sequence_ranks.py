"""One member of a sequence-parallel (and CFG-parallel) group, run by test_sequence_parallel.py:

    python sequence_ranks.py RANK WORLD PORT OUT.json CFG [--checkpointing] [--bf16] MODEL ...

For each MODEL every member loads the tiny flavour twice from its saved directory, in fp32
and in fp64, and on the same inputs (two prompts of different lengths against two empty
negative prompts, guidance 4.5, seeded latents, two sigmas) computes on its own, as one
device would:

- the fp32 velocity and the gradient of every transformer weight for a fixed random loss;
- the same in fp64: the reference the fp32 results are measured against;

(``--bf16``: the bf16 base a GPU run trains in place of fp32), then the same with the transformer split over the WORLD members
(``CFG == 1``: all of them sequence-parallel; ``CFG == 2``: the two guidance branches, each
on WORLD / 2 sequence-parallel members), the gradients summed over the members. Member 0
writes per model, for the one-device and the split results, their L2 distances from the fp64
reference (the velocity; the gradients of all weights together), the split velocity's
largest spread over the members, how many attention calls spanned the group and what share
of their tokens this member held, and the bytes of the tensors each pass saved for its
backward (distinct storages), to OUT.json.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

GUIDANCE = 4.5


def saved_bytes() -> tuple[dict[int, int], torch.autograd.graph.saved_tensors_hooks]:
    """A map of storage -> bytes of every tensor saved for backward while the hooks are on."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
        return t

    return seen, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


def measure(
    rank: int, world: int, cfg: int, model: str, groups: tuple, ckpt: bool, dtype: torch.dtype
) -> dict:
    from digen.models import get_adapter_class
    from digen.models.base import PromptEmbeds
    from digen.runtime.worker.sequence import apply_cfg_parallel, apply_sequence_parallel

    cls = get_adapter_class(model)
    a32 = cls.tiny(dtype=dtype)
    if ckpt:  # every block recomputed in the backward, its all-to-alls again
        a32.transformer.enable_gradient_checkpointing()
    a64 = cls.tiny(dtype=torch.float64)
    cond = a32.encode_prompts(["a red cube", "two small blue balls beside a green cone"])
    neg = a32.encode_prompts(["", ""])
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(2, *a32.latent_shape(), generator=gen)
    sigma = torch.tensor([0.9, 0.4])
    weight = torch.randn(2, *a32.latent_shape(), generator=gen)  # the loss: sum(weight * v)

    def run(adapter) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        dtype = adapter.dtype
        params = dict(adapter.transformer.named_parameters())
        for p in params.values():
            p.requires_grad_(True)
            p.grad = None

        def cast(e: PromptEmbeds) -> PromptEmbeds:
            return PromptEmbeds(
                {k: v.to(dtype) if v.is_floating_point() else v for k, v in e.tensors.items()}
            )

        seen, hooks = saved_bytes()
        with torch.enable_grad(), hooks:
            v = adapter.predict_velocity(latents.to(dtype), sigma, cast(cond), cast(neg), GUIDANCE)
        (v * weight.to(v.dtype)).sum().backward()
        # (a weight no pass uses, such as a modulation row, has no gradient)
        grads = {k: p.grad.detach().clone() for k, p in params.items() if p.grad is not None}
        return v.detach(), grads, sum(seen.values())

    v64, g64, _ = run(a64)
    v32, g32, saved_one = run(a32)
    seq_group, cfg_group = groups
    if cfg == 2:
        apply_cfg_parallel(a32, cfg_group)
    sp = apply_sequence_parallel(a32, seq_group) if seq_group is not None else None
    v_split, g_split, saved_split = run(a32)
    for g in g_split.values():
        # a weight's gradient is split over the members by the tokens (and with CFG
        # parallelism the branch) each computed: summed over all of them it is one device's
        dist.all_reduce(g)
    high, low = v_split.clone(), v_split.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)

    def distance(a, b) -> float:
        if isinstance(a, dict):
            assert a.keys() == b.keys()
            return sum(distance(a[k], b[k]) ** 2 for k in b) ** 0.5
        return float((a.double() - b.double()).norm())

    def size(a) -> float:
        if isinstance(a, dict):
            return sum(size(t) ** 2 for t in a.values()) ** 0.5
        return float(a.double().norm())

    return {
        "velocity": {"one": distance(v32, v64), "split": distance(v_split, v64), "size": size(v64)},
        "grads": {"one": distance(g32, g64), "split": distance(g_split, g64), "size": size(g64)},
        "spread": float((high - low).abs().max()),
        "spanned": sp.spanned if sp else 0,
        "share": sp.tokens_here / sp.tokens if sp else 1.0,
        "saved": {"one": saved_one, "split": saved_split},
    }


def main(
    rank: int, world: int, port: int, out: str, cfg: int, models: list[str], flags: set[str]
) -> None:
    from digen.runtime.worker.sequence import split_generation_group

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    groups = split_generation_group(cfg, world // cfg)
    ckpt, dtype = "--checkpointing" in flags, torch.bfloat16 if "--bf16" in flags else torch.float32
    report = {m: measure(rank, world, cfg, m, groups, ckpt, dtype) for m in models}
    if rank == 0:
        with open(out, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    r, w, p, o, c, *rest = sys.argv[1:]
    flags = {a for a in rest if a.startswith("--")}
    main(int(r), int(w), int(p), o, int(c), [a for a in rest if a not in flags], flags)
