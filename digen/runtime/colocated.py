"""The colocated reference trainer: every worker samples, then every worker trains.

This is the shape of today's tools (one pool alternating between rollout and training) and
the baseline every digen speed-up is measured against. One train step:

1. sample ``B`` prompts x ``n`` samples (this worker: every ``W``-th sample of the step);
2. decode and score them; gather every worker's rewards; group advantages;
3. for each mini-batch of prompts: forward/backward the trained timesteps one at a time,
   accumulating over micro-batches; all-reduce gradients across workers; one optimizer step.

With ``W == 1`` it runs in one process; with ``W > 1`` the workers form a torch.distributed
group (gloo on CPU, NCCL on GPU) and gradients are summed, each backward already scaled by
``1 / total terms``, so ``W`` workers reach the parameters one process would.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from digen.algos.advantages import best_of_n, group_advantages
from digen.algos.rewards import CompositeReward
from digen.algos.rollout import Rollout
from digen.config import DigenConfig
from digen.prompts import PromptSet
from digen.runtime.policy import (
    Generated,
    Policy,
    SampleKey,
    StepResult,
    StepStats,
    TrainItem,
)
from digen.sched.trace import Trace

__all__ = ["ColocatedTrainer"]


class ColocatedTrainer:
    """One worker of the colocated trainer (``rank`` of ``world``)."""

    def __init__(
        self,
        cfg: DigenConfig,
        reward: CompositeReward,
        prompts: PromptSet,
        *,
        rank: int = 0,
        world: int = 1,
        policy: Policy | None = None,
        trace: Trace | None = None,
    ) -> None:
        self.cfg = cfg
        self.reward = reward
        self.prompts = prompts
        self.rank, self.world = rank, world
        self.policy = policy or Policy(cfg, trainable=True)
        self.trace = trace
        self.worker = f"worker-{rank}"

    async def __aenter__(self) -> ColocatedTrainer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def save_weights(self, out_dir: str | os.PathLike) -> Path:
        return self.policy.save_weights(out_dir)

    async def final_state(self) -> dict[str, torch.Tensor]:
        return self.policy.trainable_state()

    # --- one step -----------------------------------------------------------------------

    def step_prompts(self, step: int) -> tuple[list[str], list[dict[str, Any]]]:
        idx = self.prompts.indices_for_step(self.cfg.seed, step, self.cfg.data.train_batch_size)
        return [self.prompts.prompts[i] for i in idx], [self.prompts.metadata[i] for i in idx]

    def my_keys(self, step: int) -> list[SampleKey]:
        """This worker's share: every ``world``-th sample of the step, in (prompt, sample) order."""
        b, n = self.cfg.data.train_batch_size, self.cfg.rollout.n
        keys = [SampleKey(step, p, j) for p in range(b) for j in range(n)]
        return keys[self.rank :: self.world]

    async def train_step(
        self, step: int, on_phase: Callable[[str], None] | None = None
    ) -> StepResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        texts, meta = self.step_prompts(step)
        keys = self.my_keys(step)

        # 1. sample, micro-batch by micro-batch
        _phase(on_phase, "generate")
        t0 = time.perf_counter()
        parts: list[Generated] = []
        mb = cfg.train.micro_batch_size
        for i in range(0, len(keys), mb):
            chunk = keys[i : i + mb]
            with self._span("generate", step, i // mb):
                parts.append(self.policy.generate(chunk, [texts[k.prompt] for k in chunk]))
        rollout = Rollout.cat([p.rollout for p in parts])
        pixels = torch.cat([p.pixels for p in parts])
        t_generate = time.perf_counter() - t0

        # 2. score, gather, advantages
        _phase(on_phase, "score")
        t0 = time.perf_counter()
        with self._span("score", step, -1):
            scored = await self.reward(
                pixels, [texts[k.prompt] for k in keys], [meta[k.prompt] for k in keys]
            )
        t_score = time.perf_counter() - t0
        names = list(scored.components)
        mine = torch.stack([scored.total] + [scored.components[c] for c in names], dim=1)
        table = self._gather_rows(mine)  # [B*n, 1 + C], global (prompt, sample) order
        b, n = cfg.data.train_batch_size, cfg.rollout.n
        rewards = table[:, 0].view(b, n)
        adv = group_advantages(
            rewards, norm=cfg.algo.adv_norm, eps=cfg.algo.adv_eps, clip_max=cfg.algo.adv_clip_max
        )
        keep = torch.ones(b, n, dtype=torch.bool)
        if cfg.algo.best_of_n:
            keep.zero_()
            keep.scatter_(1, best_of_n(adv, cfg.algo.best_of_n), True)

        # 3. train: mini-batches of prompts, micro-batches of this worker's samples
        _phase(on_phase, "train")
        t0 = time.perf_counter()
        stats = StepStats()
        grad_norms = []
        mini = cfg.train.mini_batch_size or b
        row_of = {k: i for i, k in enumerate(keys)}
        for m0 in range(0, b, mini):
            prompts_m = range(m0, m0 + mini)
            total_terms = int(keep[m0 : m0 + mini].sum()) * self._trained_per_sample(step)
            mine_m = [k for k in keys if k.prompt in prompts_m and keep[k.prompt, k.sample]]
            for i in range(0, len(mine_m), mb):
                chunk = mine_m[i : i + mb]
                rows = torch.tensor([row_of[k] for k in chunk])
                item = TrainItem(
                    keys=chunk,
                    prompts=[texts[k.prompt] for k in chunk],
                    rollout=rollout.select(rows),
                    advantages=torch.stack([adv[k.prompt, k.sample] for k in chunk]),
                )
                with self._span("update", step, i // mb):
                    stats.add(self.policy.accumulate(item, 1.0 / total_terms))
            with self._span("step", step, -1):
                self._all_reduce_grads()
                grad_norms.append(self.policy.optimizer_step())
        t_train = time.perf_counter() - t0
        stats = self._reduce_stats(stats)

        metrics: dict[str, Any] = {
            "step": step,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std(unbiased=False)),
            "reward_min": float(rewards.min()),
            "reward_max": float(rewards.max()),
        }
        for j, c in enumerate(names):
            metrics[f"reward/{c}"] = float(table[:, 1 + j].mean())
        metrics.update(stats.means())
        metrics.update(
            {
                "grad_norm": sum(grad_norms) / len(grad_norms),
                "policy_version": self.policy.version,
                "samples": b * n,
                "trained_samples": int(keep.sum()),
                "step_time_s": time.perf_counter() - t_start,
                "time/generate_s": t_generate,
                "time/score_s": t_score,
                "time/train_s": t_train,
            }
        )
        captions = [texts[k.prompt] for k in keys]
        return StepResult(metrics=metrics, pixels=pixels, captions=captions)

    @contextlib.contextmanager
    def _span(self, kind: str, step: int, mb: int) -> Iterator[None]:
        """Record the enclosed work as a trace event of this worker."""
        version, t0 = self.policy.version, time.time()
        yield
        if self.trace is not None:
            self.trace.record(kind, self.worker, step, mb, version, t0, time.time())

    def _trained_per_sample(self, step: int) -> int:
        window = self.policy.sampler_spec(step).window
        frac = self.cfg.rollout.timestep_fraction
        return len(window) if frac >= 1.0 else max(1, int(len(window) * frac))

    # --- collectives (no-ops in one process) ---------------------------------------------

    def _gather_rows(self, mine: torch.Tensor) -> torch.Tensor:
        """Every worker's rows, back in global sample order (worker r holds rows r::W)."""
        if self.world == 1:
            return mine
        parts = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(parts, mine.contiguous())
        out = torch.empty((mine.shape[0] * self.world,) + tuple(mine.shape[1:]), dtype=mine.dtype)
        for r, part in enumerate(parts):
            out[r :: self.world] = part
        return out

    def _all_reduce_grads(self) -> None:
        if self.world == 1:
            return
        grads = self.policy.grads()
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        offset = 0
        for p, g in zip(self.policy.params, grads):
            numel = g.numel()
            p.grad = flat[offset : offset + numel].view_as(p).to(p.dtype)
            offset += numel

    def _reduce_stats(self, stats: StepStats) -> StepStats:
        if self.world == 1:
            return stats
        t = stats.as_tensor()
        dist.all_reduce(t)
        return StepStats.from_tensor(t)


def _phase(cb: Callable[[str], None] | None, name: str) -> None:
    if cb is not None:
        cb(name)
