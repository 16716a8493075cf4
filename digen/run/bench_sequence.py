"""``digen bench --sequence``: one generator's sampling on one device, and on two sharing it.

Three arms sample the same micro-batch (guided, so every pass runs both branches) with the
real policy, each a set of real processes of one thread (gloo between them):

- *one process*: the whole micro-batch, and again half of it (what the prediction needs);
- *sequence-parallel, 2 processes*: every sample's tokens split over the two
  (:func:`~digen.runtime.worker.sequence.apply_sequence_parallel`);
- *CFG-parallel, 2 processes*: one branch of guidance each
  (:func:`~digen.runtime.worker.sequence.apply_cfg_parallel`).

Each arm warms up, then times ``repeats`` calls; the table reports medians.

**The prediction** of a two-process arm uses the one-process arm only, and the planner's
terms: a sample's sampling is the time inside the transformer ``x`` and the rest (the
sampler's arithmetic, the VAE, the text encoder), which both processes do whole. Splitting
the tokens (or the branches) over two halves each process's transformer work, which is what
the transformer does for half the micro-batch: ``x(n / 2)``, measured. So a two-process arm
takes ``t(n) - x(n) + x(n / 2)`` plus its traffic: for the sequence split, every pass's
all-to-alls as :func:`~digen.planning.hardware.ulysses_s` prices them, with this machine's
all-to-all latency and bandwidth (measured by the sequence arm's processes on two buffer
sizes) and the model's own blocks, width and tokens; for the CFG split, one exchange of a
velocity a pass, priced the same way.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ARMS",
    "SequenceBenchSettings",
    "check_settings",
    "format_sequence",
    "run_sequence_bench",
    "summarise_sequence",
]

ONE, HALF, SEQUENCE, CFG = "one", "one-half", "sequence", "cfg"
ARMS = {
    ONE: ("one process", 1),
    HALF: ("one process, half the micro-batch", 1),
    SEQUENCE: ("sequence-parallel, 2 processes", 2),
    CFG: ("CFG-parallel, 2 processes", 2),
}
"""arm -> (what the table calls it, processes)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceBenchSettings:
    model: str = "flux"
    size: int = 128
    """Image height and width in pixels."""
    samples: int = 2
    """Samples a micro-batch (even: the prediction times half of it)."""
    inference_steps: int = 8
    guidance: float = 4.5
    repeats: int = 5
    """Timed calls of each arm (after one warm-up call)."""
    overrides: tuple[str, ...] = ()


def check_settings(s: SequenceBenchSettings) -> None:
    """Refuse, in one sentence, settings no arm can run (a bad override in the config's)."""
    from digen.errors import DigenError

    cfg = _config(s)
    if cfg["rollout"]["guidance_scale"] <= 1.0:
        raise DigenError(
            "--sequence compares splitting the guidance branches too: leave "
            "rollout.guidance_scale above 1"
        )


def _config(s: SequenceBenchSettings) -> dict[str, Any]:
    from digen.config import config_to_dict, load_config
    from digen.presets import preset

    over = [
        f"model.height={s.size}",
        f"model.width={s.size}",
        f"rollout.num_inference_steps={s.inference_steps}",
        f"rollout.guidance_scale={s.guidance}",
        *s.overrides,
    ]
    return config_to_dict(load_config(base=preset(s.model, "flowgrpo"), overrides=over))


def _arm(
    rank: int,
    world: int,
    store: str,
    cfg_dict: dict,
    arm: str,
    s: Any,
    out: str,
) -> None:
    """One process of an arm: sample ``repeats`` times after a warm-up; rank 0 writes the
    times (whole and inside the transformer), the model's geometry and, for the sequence
    arm, the all-to-all figures, to ``out``."""
    import torch
    import torch.distributed as dist

    from digen.config import load_config
    from digen.runtime.messages import SampleKey
    from digen.runtime.worker.policy import Policy
    from digen.runtime.worker.sequence import (
        apply_cfg_parallel,
        apply_sequence_parallel,
        process_group,
    )

    torch.set_num_threads(1)
    cfg = load_config(base=cfg_dict)
    if world > 1:  # (a file store: no port to find free)
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    policy = Policy(cfg, trainable=False)
    sp = None
    if arm == SEQUENCE:
        sp = apply_sequence_parallel(policy.adapter)
    elif arm == CFG:
        apply_cfg_parallel(policy.adapter, None)
    transformer = policy.adapter.transformer
    inside, passes, started = [0.0], [0], [0.0]

    def before(module: Any, args: Any) -> None:
        started[0] = time.perf_counter()

    def after(module: Any, args: Any, output: Any) -> None:
        inside[0] += time.perf_counter() - started[0]
        passes[0] += 1

    transformer.register_forward_pre_hook(before, prepend=True)
    transformer.register_forward_hook(after)
    n = s.samples // 2 if arm == HALF else s.samples
    keys = [SampleKey(0, 0, j) for j in range(n)]
    prompts = ["a red cube beside a blue ball"] * n
    policy.generate(keys, prompts)  # warm-up: first calls allocate and pick kernels
    if sp is not None:
        sp.spanned = sp.tokens = sp.tokens_here = 0
        sp.trading_s = 0.0
    times, insides = [], []
    for _ in range(s.repeats):
        if world > 1:
            dist.barrier()
        inside[0], passes[0] = 0.0, 0
        t0 = time.perf_counter()
        policy.generate(keys, prompts)
        times.append(time.perf_counter() - t0)
        insides.append(inside[0])
    report: dict[str, Any] = {"times": times, "inside": insides, "passes": passes[0]}
    config = transformer.config
    heads = config.get("num_attention_heads") or config.get("num_heads")
    report["width"] = int(heads * (config.get("attention_head_dim") or config.get("head_dim")))
    report["rows"] = n * 2  # both branches of guidance, one batch
    report["latent"] = math.prod(policy.adapter.latent_shape())  # a velocity's elements
    if sp is not None:
        report["spanning"] = sp.spanned / s.repeats / passes[0]  # attention calls a pass
        report["tokens"] = sp.tokens / sp.spanned  # the whole sequence of each
        report["trading_s"] = sp.trading_s / s.repeats  # measured, waits included
        local = report["rows"] * -(-round(report["tokens"]) // 2) * report["width"] * 4
        report["all_to_all"] = _all_to_all_figures(process_group(), local)
    if rank == 0:
        Path(out).write_text(json.dumps(report))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _all_to_all_figures(group: Any, nbytes: int, rounds: int = 30) -> dict[str, float]:
    """This machine's all-to-all between the group's processes as sequence parallelism
    makes them (its own exchange of one tensor a process, fp32), medians of ``rounds``: the
    latency and the GB/s of the line through ``nbytes`` (an attention's q on one process)
    and four times that."""
    import torch

    from digen.runtime.worker.sequence import _all_to_all

    size = group.size()

    def exchange(count: int) -> None:
        piece = torch.zeros(max(count // 4 // size, 1))
        _all_to_all([piece] * size, [tuple(piece.shape)] * size, group)

    def timed(work: Any) -> float:
        got = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            work()
            got.append(time.perf_counter() - t0)
        return statistics.median(got)

    exchange(nbytes)  # warm-up
    one, four = timed(lambda: exchange(nbytes)), timed(lambda: exchange(4 * nbytes))
    moved = nbytes * (size - 1) / size  # what a process sends of it
    per_byte = max((four - one) / (3 * moved), 1e-15)
    latency = max(one - moved * per_byte, 0.0)
    return {"latency_s": latency, "gb_s": 1 / per_byte / 1e9, "bytes": nbytes}


def run_sequence_bench(s: SequenceBenchSettings, say: Any = None) -> dict[str, Any]:
    """Run the arms in turn; their raw reports by arm."""
    import torch.multiprocessing as mp

    say = say or (lambda text: None)
    cfg = _config(s)
    got: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="digen-bench-sequence-") as tmp:
        for arm, (name, world) in ARMS.items():
            say(f"{name} ...")
            out = str(Path(tmp) / f"{arm}.json")
            args = (world, str(Path(tmp) / f"{arm}.store"), cfg, arm, s, out)
            mp.start_processes(_arm, args=args, nprocs=world, start_method="spawn")
            got[arm] = json.loads(Path(out).read_text())
            say(f"  {statistics.median(got[arm]['times']):.3f} s a micro-batch")
    return got


def summarise_sequence(
    s: SequenceBenchSettings, got: dict[str, Any], *, command: str | None = None
) -> dict[str, Any]:
    """The measured arms and the predictions of the two-process ones (module docstring)."""
    from digen.planning.hardware import ModelSize, ulysses_s
    from digen.run.bench import machine_info

    med = {arm: statistics.median(r["times"]) for arm, r in got.items()}
    x = {arm: statistics.median(r["inside"]) for arm, r in got.items()}
    rest = med[ONE] - x[ONE]
    seq = got[SEQUENCE]
    figures = seq["all_to_all"]
    passes = seq["passes"]
    geometry = ModelSize(
        params=0.0,
        blocks=round(seq["spanning"]),
        trained=0.0,
        hidden=seq["width"],
        tokens=round(seq["tokens"]),
    )
    trade = passes * ulysses_s(
        geometry,
        seq["rows"],
        2,
        figures["gb_s"],
        latency_s=figures["latency_s"],
        value_bytes=4,  # fp32 on this CPU
    )
    velocity = s.samples * got[ONE]["latent"] * 4  # fp32
    exchange = passes * (figures["latency_s"] + velocity / 2 / (figures["gb_s"] * 1e9))
    predicted = {
        SEQUENCE: rest + x[HALF] + trade,
        CFG: rest + x[HALF] + exchange,
    }
    rows = []
    for arm, (name, world) in ARMS.items():
        row = {"arm": arm, "name": name, "processes": world, "seconds": med[arm]}
        row["inside_transformer_s"] = x[arm]
        row["speedup_vs_one"] = med[ONE] / med[arm]
        if arm in predicted:
            row["predicted_s"] = predicted[arm]
            row["prediction_error"] = (predicted[arm] - med[arm]) / med[arm]
        rows.append(row)
    return {
        "sequence": {
            "arms": rows,
            "model": {
                "outside_transformer_s": rest,
                "passes": passes,
                "spanning_attention_a_pass": geometry.blocks,
                "tokens": geometry.tokens,
                "width": geometry.hidden,
                "all_to_all_latency_s": figures["latency_s"],
                "all_to_all_gb_s": figures["gb_s"],
                "all_to_all_s": trade,
                "all_to_all_measured_s": seq["trading_s"],
                "exchange_s": exchange,
            },
        },
        "settings": asdict(s),
        "machine": machine_info(),
        "command": command if command is not None else " ".join(sys.argv),
    }


def format_sequence(report: dict[str, Any]) -> str:
    """The arms as a markdown table."""
    sq = report["sequence"]
    lines = [
        "| arm | processes | s a micro-batch | inside the transformer (s) | vs one | "
        "predicted (s) | error |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in sq["arms"]:
        pred = f"{r['predicted_s']:.3f}" if "predicted_s" in r else "-"
        err = f"{r['prediction_error']:+.1%}" if "prediction_error" in r else "-"
        lines.append(
            f"| {r['name']} | {r['processes']} | {r['seconds']:.3f} | "
            f"{r['inside_transformer_s']:.3f} | {r['speedup_vs_one']:.2f}x | {pred} | {err} |"
        )
    m = sq["model"]
    lines.append(
        f"\nall-to-all here: {m['all_to_all_latency_s'] * 1e6:.0f} us + "
        f"{m['all_to_all_gb_s']:.2f} GB/s; a sequence-parallel micro-batch trades "
        f"{m['passes']} passes x {m['spanning_attention_a_pass']} attentions x 4 "
        f"({m['all_to_all_s']:.3f} s)"
    )
    return "\n".join(lines)
