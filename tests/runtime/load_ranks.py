"""One trainer loading a full fine-tune policy, for test_fsdp.py (which forks it from the
fork server), or as a script:

    python load_ranks.py RANK WORLD STORE_PORT MODEL_DIR OUT_DIR

With WORLD > 1 the member joins a gloo group over the test's store and builds the policy
sharded over a mesh of WORLD members (FSDP2); with WORLD == 1 it builds it whole. It measures
its resident memory while building (the peak since just before, from /proc: ``clear_refs``
resets the peak; every weight is read once inside, as training will), and writes ``OUT_DIR/rank-RANK.json`` (the memory) and
``OUT_DIR/rank-RANK.safetensors`` (its own part of every transformer weight).
"""

from __future__ import annotations

import gc
import json
import re
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def _status_kb(field: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"^{field}:\s+(\d+) kB", text, re.M).group(1))


def main(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    from safetensors.torch import save_file

    from digen.config import load_config
    from digen.models import load_adapter
    from digen.presets import preset
    from digen.runtime.worker.fsdp import local, make_mesh
    from digen.runtime.worker.policy import Policy

    torch.set_num_threads(1)
    overrides = [f"model.path={model_dir}", "train.lora_rank=0", "algo.kl_coef=0.0"]
    cfg = load_config(base=preset("sd3", "flowgrpo", mode="colocated"), overrides=overrides)
    mesh = None
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, is_master=False)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        mesh = make_mesh("fsdp", world, "cpu")
    load_adapter("sd3")  # the code a load runs is imported before measuring
    gc.collect()
    Path("/proc/self/clear_refs").write_text("5")  # the peak restarts from here
    before = _status_kb("VmRSS")
    policy = Policy(cfg, trainable=True, mesh=mesh)
    with torch.no_grad():  # read every weight (a load may map the files and read lazily)
        for p in policy.adapter.transformer.parameters():
            local(p).sum()
    peak = _status_kb("VmHWM")
    parts = {n: local(p).detach().clone() for n, p in policy.adapter.transformer.named_parameters()}
    save_file(parts, str(Path(out) / f"rank-{rank}.safetensors"))
    report = {"before_kb": before, "peak_kb": peak}
    (Path(out) / f"rank-{rank}.json").write_text(json.dumps(report))
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    rank_, world_, port_, model_dir_, out_ = sys.argv[1:6]
    main(int(rank_), int(world_), int(port_), model_dir_, out_)
