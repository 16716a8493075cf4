"""What crosses the driver, per-call overhead and step time, by image size; and the cost of
summing gradients in a fixed order.

    python benchmarks/data_plane.py [--sizes 64 128 256] [--steps 6] [--repeats 2]

Tiny FLUX, Flow-GRPO, 2 generators + 1 trainer (one thread each), 2 prompts x 8 samples a
step, TAG off (so both variants run the same schedule). For each image size it reports,
as medians over the steps after the first:

- ``driver_mb``: megabytes through the driver process per step (arguments and results of
  its actor calls, tensors and the rest), on steps without a sample grid and on steps
  with one (thumbnails);
- ``overhead_ms/<kind>``: per-call time outside the actors' own work;
- ``step_s``: step time.

Then, at the middle size, ``train.grad_order=fixed`` against ``arrival`` (repetitions
interleaved so machine drift hits both alike): step time and the extra memory the fixed
order holds (one fp32 gradient copy per micro-batch a trainer holds until the step).
Last, per tiny backbone: what encoding one prompt costs a trainer (median ms, one thread)
against the bytes its embedding would be if a generator shipped it instead.
Prints one JSON line per measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile

from digen import DigenRunner, load_config
from digen.presets import preset


def run(size: int, steps: int, extra: list[str]) -> dict[str, float]:
    over = [f"steps={steps}", f"model.height={size}", f"model.width={size}"]
    over += ["runtime.generators=2", "runtime.trainers=1", "runtime.schedule.tag=none", *extra]
    cfg = load_config(base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=over)
    with tempfile.TemporaryDirectory() as out:
        runner = DigenRunner(cfg, out_dir=out, progress=False, save_weights=False)
        res = asyncio.run(runner.run())
    rows = res.metrics[1:]
    grid = [r for r in res.metrics if runner.samples_at(r["step"])]
    plain = [r for r in rows if not runner.samples_at(r["step"])]
    lora = sum(v.numel() for v in res.final_state.values())
    return {
        "size_px": size,
        "driver_mb": statistics.median(r["driver_mb"] for r in plain),
        "driver_mb_with_grid": statistics.median(r["driver_mb"] for r in grid),
        **{
            f"overhead_ms/{k}": statistics.median(r[f"overhead_ms/{k}"] for r in rows)
            for k in ("generate", "score", "update")
        },
        "step_s": statistics.median(r["step_time_s"] for r in rows),
        "lora_params": lora,
        "reward_last": res.metrics[-1]["reward_mean"],
    }


def embedding_cost(model: str, prompts: int = 12) -> dict[str, float]:
    """Encode-once-per-prompt cost on this machine vs the bytes of shipping the embedding."""
    import time

    import torch

    from digen.models import load_adapter
    from digen.prompts import PromptSet

    torch.set_num_threads(1)
    adapter = load_adapter(model, None, device="cpu", dtype=torch.float32)
    texts = PromptSet.builtin().prompts[:prompts]
    times, sizes = [], []
    with torch.no_grad():
        adapter.encode_prompts(texts[:1])  # warm-up
        for text in texts:
            t0 = time.perf_counter()
            emb = adapter.encode_prompts([text])
            times.append(time.perf_counter() - t0)
            sizes.append(sum(t.nbytes for t in emb.tensors.values()))
    return {
        "model": model,
        "encode_ms": 1e3 * statistics.median(times),
        "embedding_kb": statistics.median(sizes) / 1e3,
    }


def ordered_sum_cost(numel: int, microbatches: int, repeats: int = 5) -> dict[str, float]:
    """Extra time of the fixed order for a LoRA of ``numel`` parameters, per train step:
    keeping each micro-batch's gradient apart and adding them in order at the step, against
    accumulating in place. The backward passes themselves are the same in both."""
    import time

    import torch

    from digen.runtime.worker.grads import GradAccumulator

    torch.set_num_threads(1)
    param = torch.nn.Parameter(torch.zeros(numel))
    grad = torch.randn(numel)
    out = {}
    for ordered in (True, False):
        acc = GradAccumulator([param], ordered=ordered)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for mb in range(microbatches):
                with acc.micro_batch(mb):  # stands in for the backward: set / add .grad
                    param.grad = grad.clone() if param.grad is None else param.grad + grad
            acc.reduce(microbatches)
            times.append(time.perf_counter() - t0)
            param.grad = None
        out["fixed_ms" if ordered else "arrival_ms"] = 1e3 * statistics.median(times)
    held = microbatches * numel * 4 / 1e6
    return {"lora_params": numel, "microbatches": microbatches, **out, "held_mb": held}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    for size in args.sizes:
        print(json.dumps(run(size, args.steps, [])), flush=True)
    size = args.sizes[len(args.sizes) // 2]
    times: dict[str, list[float]] = {"fixed": [], "arrival": []}
    last: dict[str, dict] = {}
    for _ in range(args.repeats):
        for order in times:
            last[order] = run(size, args.steps, [f"train.grad_order={order}"])
            times[order].append(last[order]["step_s"])
    for order, ts in times.items():
        row = {"grad_order": order, "size_px": size, "step_s": statistics.median(ts)}
        # fixed: 16 samples / 4 per micro-batch = 4 fp32 copies of the LoRA until the step
        row["held_mb"] = 4 * 4 * last[order]["lora_params"] / 1e6 if order == "fixed" else 0
        row["reward_last"] = last[order]["reward_last"]
        print(json.dumps(row), flush=True)
    for numel in (29_696, 10_000_000):
        print(json.dumps(ordered_sum_cost(numel, 16)), flush=True)
    for model in ("flux", "sd3", "hunyuanvideo"):
        print(json.dumps(embedding_cost(model)), flush=True)


if __name__ == "__main__":
    main()
