"""A sharded trainer's log-probs against a generator's, run as a script by test_fsdp.py:

    python sharded_drift.py MODEL LORA_RANK OUT.json

In one process, a generator's policy (unsharded) samples a micro-batch in bf16, and a
trainer's policy sharded with FSDP2 over a mesh of this one process recomputes its
log-probs at the same weights (:meth:`~digen.runtime.worker.policy.Policy.accumulate`). One
member computes every row in the same batch shape as the generator, on the same kernels, so
the drift must be exactly 0: anything else is the sharding changing what is computed
(casting inputs or fp32 LoRA weights to bf16). With LoRA, its B matrices are first set to
the same nonzero values in both copies, so the adapter's dtype shows.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from fsdp_ranks import end_rank


def main(model: str, lora_rank: int, out: str) -> None:
    from digen.config import load_config
    from digen.presets import preset
    from digen.runtime.messages import SampleKey, TrainItem
    from digen.runtime.worker.fsdp import local, make_mesh
    from digen.runtime.worker.policy import Policy

    torch.set_num_threads(1)
    overrides = ["model.dtype=bfloat16", f"train.lora_rank={lora_rank}", "algo.kl_coef=0.0"]
    overrides += ["rollout.num_inference_steps=4", "train.lora_dtype=float32"]
    cfg = load_config(base=preset(model, "flowgrpo"), overrides=overrides)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    generator = Policy(cfg, trainable=False)
    trainer = Policy(cfg, trainable=True, mesh=make_mesh("fsdp", 1, "cpu"))
    if lora_rank:
        named = dict(trainer.synced_parameters())
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(1)
            for name, p in generator.synced_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn_like(p) * 0.1)
                    local(named[name]).copy_(p)
    keys = [SampleKey(0, 0, j) for j in range(2)]
    prompts = ["a red cube"] * len(keys)
    made = generator.generate(keys, prompts)
    item = TrainItem(keys, prompts, made.rollout, torch.tensor([1.0, -1.0]))
    stats = trainer.accumulate(item, loss_scale=1.0)
    dist.destroy_process_group()
    report = {"drift_terms": stats.drift_terms, "drift_max": stats.drift_max}
    report["drift_over"] = stats.drift_over
    with open(out, "w") as f:
        json.dump(report, f)
    end_rank()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
