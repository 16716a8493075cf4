"""One member of a sharded (FSDP2) policy, run as a script by test_fsdp.py:

    python fsdp_ranks.py RANK WORLD PORT OUT.json

Each member builds the tiny FLUX policy sharded over a gloo mesh of WORLD processes, makes
one micro-batch of samples (the same on every member: per-sample seeds), runs one update to
warm up, and for TSP degree 1, 2 and 4 runs one update of its rows, counting the all-gathers FSDP issues
(``torch.distributed.all_gather_single``, what FSDP2's all-gather goes through). Member 0
writes the counts, the modules sharded (blocks and root) and the trained timesteps per sample to OUT.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main(rank: int, world: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import FSDPModule

    from digen.algos.train_step import terms_per_sample
    from digen.config import load_config
    from digen.runtime.messages import SampleKey, TrainItem
    from digen.runtime.worker.fsdp import make_mesh
    from digen.runtime.worker.policy import Policy

    torch.set_num_threads(1)
    cfg = load_config(overrides=["rollout.num_inference_steps=5", "algo.kl_coef=0.0"])
    address = f"tcp://127.0.0.1:{port}"
    dist.init_process_group("gloo", init_method=address, rank=rank, world_size=world)
    policy = Policy(cfg, trainable=True, mesh=make_mesh("fsdp", world, "cpu"))
    keys = [SampleKey(0, 0, j) for j in range(4)]
    made = policy.generate(keys, ["a red cube"] * len(keys))
    rows = list(range(rank, len(keys), world))
    item = TrainItem(
        keys=[keys[r] for r in rows],
        prompts=["a red cube"] * len(rows),
        rollout=made.rollout.select(torch.tensor(rows)),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5])[rows],
    )
    # a first update ends what generation left gathered (the root's weights, kept after a
    # forward without gradients), so every counted update starts from the same state
    policy.accumulate(item, 1.0, 4)
    counts = {}
    original = dist.all_gather_single
    for degree in (1, 2, 4):
        calls = 0

        def counting(*args, **kwargs):
            nonlocal calls
            calls += 1
            return original(*args, **kwargs)

        dist.all_gather_single = counting
        try:
            policy.accumulate(item, 1.0, degree)
        finally:
            dist.all_gather_single = original
        counts[degree] = calls
    if rank == 0:
        report = {
            "all_gathers": counts,
            "fsdp_modules": sum(
                isinstance(m, FSDPModule) for m in policy.adapter.transformer.modules()
            ),
            "timesteps": terms_per_sample(cfg, 0),
        }
        with open(out, "w") as fh:
            json.dump(report, fh)
    dist.destroy_process_group()
    end_rank()


def end_rank() -> None:
    """Exit as digen's worker processes do: flushed, skipping the interpreter's teardown,
    whose static destructors can abort on a native thread gloo still holds ("terminate called
    without an active exception", seen once in a suite's run)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
