"""One train step's row of ``metrics.jsonl``: the same keys whatever the mode.

Both the colocated trainer and the disaggregated driver build their rows here, so a run's
metrics can be compared across modes column by column (``tests/run/test_run.py`` checks the keys
match). Per-reward means appear as ``reward/<name>``, one column per configured reward, and
``reward_latency_ms/<name>`` the mean time of one call of that reward in the step (a
generator's micro-batch, or a colocated worker's share of the batch; retries included).

Columns:

- ``reward_mean / _std / _min / _max``: over the step's ``B x n`` samples (those of the
  groups kept: ``dropped_groups`` counts groups left out for a non-finite reward);
- ``loss``, ``kl``, ``clip_fraction``, ``approx_kl``: means over trained (sample, timestep)
  terms;
- ``train/logprob_drift_max``, ``_mean`` and ``_over``: over the terms trained with the
  very weights that sampled them (the step's first optimizer step, samples not stale;
  algorithms with log-probs), ``|logp - logp recorded|``: zero but for rounding, and
  ``_over`` counts the terms beyond what rounding in the compute dtype allows
  (:func:`~digen.algos.rollout.logprob_drift_bound`; a warning names the step). Absent
  where no term was measured; ``grad_norm`` before clipping (the mean over the step's optimizer steps);
  ``optimizer_steps``: one per mini-batch (``train.mini_batch_size``); ``policy_version``
  after the step (it counts train steps);
- ``dropped_microbatches``, ``skipped_steps``: loss chunks left out and optimizer updates
  skipped for a non-finite loss or gradient (``train.on_nonfinite = drop``);
- ``samples``, ``trained_samples`` (best-of-N trains fewer);
- ``step_time_s``: wall time since the previous step ended; ``time/<kind>_s``: seconds of
  work of each kind in the step (summed over workers); ``time/optimizer_s``, ``time/sync_s``;
- ``overhead_fraction`` and ``overhead_ms/<kind>``: the time calls spent outside the actors'
  own work (RPC, pickling, scheduling), relative and per call (0 when colocated);
- ``driver_mb``: megabytes that crossed the driver process through the actor layer in the
  step (0 when colocated);
- ``stale_microbatches`` (TCSS), ``tag_microbatches`` (TAG);
- ``utilisation``, ``bubble_fraction``: from the step's trace (:mod:`digen.sched.trace`);
- ``memory/peak_gb/generator`` and ``/trainer``: the largest peak memory a worker of the pool
  reported (GPU: ``max_memory_allocated``; CPU: peak resident size); colocated workers do
  both jobs and report the same number twice; ``memory/peak_gb/driver``: the peak resident
  size of the process that runs the schedule (the driver, or the colocated lead);
- ``generators_alive``: the workers generating at the step's end (colocated: all of them);
  ``remade_microbatches`` (made again because the generator holding them was lost),
  ``time/remade_s``, the seconds those remakes took, and ``lost_microbatches``: left out of
  the step's gradient (TCSS only: stale work of a lost generator, scored with a version no
  generator holds any more). Losses happen in disaggregated runs only.

An evaluation (``eval.every``) of the weights a step ends with adds to that step's row
(:func:`eval_metrics`): ``eval/reward_mean`` and ``eval/reward/<name>`` over the evaluation's
images, and, where the prompts have a judge (:mod:`digen.rewards.judge`: GenEval's rule for
captions of the shapes world), ``eval/accuracy/<group>`` (the fraction of images that meet
every requirement of their prompt, per category) and ``eval/accuracy`` (the mean over the
groups, GenEval's overall score);
``eval/policy_version``, ``eval/samples`` and ``eval/time_s`` (not part of ``step_time_s``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from digen.runtime.messages import EvalScores, LossStats
from digen.runtime.placement import peak_memory_gb
from digen.sched.names import Pool, TaskKind
from digen.sched.trace import StepUsage

__all__ = ["OVERHEAD_KINDS", "Overhead", "step_metrics"]

OVERHEAD_KINDS = (TaskKind.GENERATE, TaskKind.SCORE, TaskKind.UPDATE)
_BUSY_KINDS = (TaskKind.GENERATE, TaskKind.TAG, TaskKind.SCORE, TaskKind.UPDATE)


@dataclass(slots=True)
class Overhead:
    """Calls' time outside the actors' own work, by kind of call."""

    compute_s: float = 0.0
    """Time the actors spent working in the counted calls."""
    by_kind: dict[str, list[float]] = field(default_factory=dict)
    """Seconds of overhead of each call, by call kind."""

    def add(self, kind: str, span_s: float, work_s: float) -> None:
        self.compute_s += work_s
        self.by_kind.setdefault(kind, []).append(max(0.0, span_s - work_s))

    @property
    def total_s(self) -> float:
        return sum(sum(v) for v in self.by_kind.values())


def step_metrics(
    *,
    step: int,
    rewards: torch.Tensor,
    components: Mapping[str, float],
    loss: LossStats,
    grad_norms: Sequence[float],
    version: int,
    trained_samples: int,
    step_time_s: float,
    busy_s: Mapping[str, float],
    optimizer_s: float,
    sync_s: float,
    usage: StepUsage | None,
    overhead: Overhead | None = None,
    driver_mb: float = 0.0,
    stale: int = 0,
    tags: int = 0,
    memory_gb: Mapping[str, float] | None = None,
    reward_latency_s: Mapping[str, Sequence[float]] | None = None,
    generators_alive: int = 1,
    remade: tuple[int, float] = (0, 0.0),
    lost_microbatches: int = 0,
) -> dict[str, Any]:
    """The metrics row of one step (module docstring). ``rewards``: ``[B, n]``."""
    # one reduction order whatever the caller's layout (a strided view sums differently)
    rewards = rewards.to(torch.float64).contiguous()
    dropped = ~torch.isfinite(rewards).all(dim=1)  # [B]: groups left out (train.on_nonfinite)
    finite = rewards[~dropped] if dropped.any() else rewards
    nan = float("nan")
    row: dict[str, Any] = {
        "step": step,
        "reward_mean": float(finite.mean()) if finite.numel() else nan,
        "reward_std": float(finite.std(unbiased=False)) if finite.numel() else nan,
        "reward_min": float(finite.min()) if finite.numel() else nan,
        "reward_max": float(finite.max()) if finite.numel() else nan,
        "dropped_groups": int(dropped.sum()),
    }
    for name, value in components.items():
        row[f"reward/{name}"] = float(value)
    for name in components:
        row[f"reward_latency_ms/{name}"] = 1e3 * _mean((reward_latency_s or {}).get(name, []))
    row.update(loss.means())
    if loss.drift_over:
        logging.getLogger("digen").warning(
            f"step {step}: {loss.drift_over} of {loss.drift_terms} trained log-probs drift "
            f"from the sampled ones (up to {loss.drift_max:.3g}) further than the compute "
            "dtype's rounding allows: the trainers do not compute what the generators did "
            "(see train/logprob_drift_* in the metrics)."
        )
    over = overhead or Overhead()
    per_call = {k: over.by_kind.get(k, []) for k in OVERHEAD_KINDS}
    row.update(
        {
            "grad_norm": _mean(grad_norms),
            "optimizer_steps": len(grad_norms),
            "skipped_steps": sum(not math.isfinite(g) for g in grad_norms),
            "policy_version": version,
            "samples": rewards.numel(),
            "trained_samples": trained_samples,
            "step_time_s": step_time_s,
            **{f"time/{_busy_name(k)}_s": float(busy_s.get(k, 0.0)) for k in _BUSY_KINDS},
            "time/optimizer_s": optimizer_s,
            "time/sync_s": sync_s,
            "overhead_fraction": over.total_s / over.compute_s if over.compute_s > 0 else 0.0,
            **{f"overhead_ms/{k}": 1e3 * _mean(v) for k, v in per_call.items()},
            "driver_mb": driver_mb,
            "stale_microbatches": stale,
            "tag_microbatches": tags,
            "utilisation": usage.utilisation if usage else 1.0,
            "bubble_fraction": usage.bubble_fraction if usage else 0.0,
            **{
                f"memory/peak_gb/{pool}": float((memory_gb or {}).get(pool, 0.0))
                for pool in (Pool.GENERATOR, Pool.TRAINER)
            },
            # the process that runs the schedule (holds no weights when disaggregated)
            "memory/peak_gb/driver": peak_memory_gb("cpu"),
        }
    )
    row["generators_alive"] = generators_alive
    row["remade_microbatches"], row["time/remade_s"] = remade
    row["lost_microbatches"] = lost_microbatches
    return row


def _busy_name(kind: str) -> str:
    return "train" if kind == TaskKind.UPDATE else str(kind)


def eval_metrics(batches: Sequence[EvalScores], version: int, seconds: float) -> dict[str, Any]:
    """The ``eval/...`` columns of one evaluation (module docstring)."""
    total = [x for b in batches for x in b.total]
    row: dict[str, Any] = {
        "eval/policy_version": version,
        "eval/samples": len(total),
        "eval/time_s": seconds,
        "eval/reward_mean": _mean(total),
    }
    for name in batches[0].components if batches else ():
        row[f"eval/reward/{name}"] = _mean([x for b in batches for x in b.components[name]])
    if batches and all(b.passed is not None for b in batches):
        from digen.rewards.judge import group_order

        judged = [(g, p) for b in batches for g, p in zip(b.groups or (), b.passed or ())]
        by_group = {
            g: _mean([p for group, p in judged if group == g])
            for g in group_order([group for group, _ in judged])
        }
        row["eval/accuracy"] = _mean(list(by_group.values()))
        row.update({f"eval/accuracy/{g}": a for g, a in by_group.items()})
    return row


def eval_verdicts(batches: Sequence[EvalScores]) -> dict[str, str]:
    """Each image's verdict, ``1`` (met its caption) or ``0``, per group in the evaluation's
    image order: what :mod:`digen.run.paired` compares between evaluations. Empty where the
    prompts have no judge."""
    if not batches or any(b.passed is None for b in batches):
        return {}
    from digen.rewards.judge import group_order

    judged = [(g, p) for b in batches for g, p in zip(b.groups or (), b.passed or ())]
    return {
        g: "".join("1" if p >= 0.5 else "0" for group, p in judged if group == g)
        for g in group_order([group for group, _ in judged])
    }


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else 0.0
