"""The colocated reference trainer: every worker samples, then every worker trains.

This is the shape of today's tools (one pool alternating between rollout and training) and
the baseline every digen speed-up is measured against. One train step:

1. sample ``B`` prompts x ``n`` samples (this worker: every ``W``-th sample of the step);
2. decode and score them; gather every worker's rewards; group advantages;
3. for each mini-batch of prompts: forward/backward the trained timesteps one at a time,
   accumulating over micro-batches; all-reduce gradients across workers; one optimizer step.

With ``W == 1`` it runs in one process; with ``W > 1`` the workers form a torch.distributed
group (gloo on CPU, NCCL on GPU) and gradients are summed, each backward already scaled by
``1 / total terms``, so ``W`` workers reach the parameters one process would. Gradients are
summed as the disaggregated trainers sum them (:mod:`digen.runtime.worker.grads`: per micro-batch,
in micro-batch order, by default with LoRA), so where the micro-batches coincide the two
modes end a step with the same bits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from digen.algos.rollout import Rollout
from digen.algos.train_step import mini_batches, score_groups, step_terms
from digen.checkpoint import Checkpoint
from digen.config import DigenConfig
from digen.prompts import PromptSet
from digen.rewards.loop import scoring_on
from digen.rewards.scoring import CompositeReward
from digen.runtime.messages import EvalScores, LossStats, SampleKey, StepResult, TrainItem
from digen.runtime.metrics import step_metrics
from digen.runtime.placement import is_cuda, peak_memory_gb
from digen.runtime.worker.fsdp import full_tensors, lockstep_chunks, make_mesh
from digen.runtime.worker.grads import GradAccumulator
from digen.runtime.worker.policy import Generated, Policy
from digen.runtime.worker.scorer import eval_scores
from digen.sched.names import TaskKind
from digen.sched.trace import Trace

__all__ = ["ColocatedTrainer", "worker_config"]


def worker_config(cfg: DigenConfig, rank: int) -> DigenConfig:
    """``cfg`` with data-parallel worker ``rank`` on its own GPU when ``model.device`` is a
    bare ``cuda`` (rank mod the visible GPUs), unchanged otherwise."""
    if cfg.model.device != "cuda":
        return cfg
    count = max(torch.cuda.device_count(), 1)
    model = dataclasses.replace(cfg.model, device=f"cuda:{rank % count}")
    return dataclasses.replace(cfg, model=model)


class ColocatedTrainer:
    """One worker of the colocated trainer (``rank`` of ``world``): a
    :class:`~digen.runtime.backend.TrainingBackend`."""

    rendezvous = None
    """No process joins a colocated run."""
    pool = None
    """No generator pool: every worker samples and trains."""

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
        if is_cuda(cfg.model.device):
            torch.cuda.set_device(torch.device(cfg.model.device))
        rt = cfg.runtime
        self.sharded = world > 1 and rt.placement.sharded
        mesh = None
        if self.sharded and policy is None:
            kind = "cuda" if is_cuda(cfg.model.device) else "cpu"
            mesh = make_mesh(rt.placement.trainer_parallel, world, kind, rt.placement.shard_size)
        self.policy = policy or Policy(cfg, trainable=True, mesh=mesh)
        self.trace = trace
        self.worker = f"worker-{rank}"
        self.grads = GradAccumulator(self.policy.params, ordered=cfg.train.ordered_grads)
        self._full: dict[str, torch.Tensor] | None = None
        """Sharded: the trained weights in full, gathered by every worker after the run."""
        self._stop_asked = False

    async def __aenter__(self) -> ColocatedTrainer:
        self._scoring = contextlib.ExitStack()
        self._scoring.enter_context(scoring_on(self.cfg.model.device))  # device: worker
        await self.reward.setup()  # once for the run, on the loop that scores
        return self

    async def __aexit__(self, *exc: object) -> None:
        try:
            await self.reward.close()
        finally:
            self._scoring.close()

    @property
    def version(self) -> int:
        return self.policy.version

    def request_stop(self) -> None:
        """Stop at the next micro-batch boundary before the step's first optimizer step
        (callable from a signal handler or another thread; data-parallel workers agree at
        each boundary): that step is left undone and :meth:`run` returns the steps before
        it. Past an optimizer step (several mini-batches) the step is finished first."""
        self._stop_asked = True

    def _stop_here(self) -> bool:
        """Whether to leave the step at this boundary (every worker reaches each one)."""
        return not self._all_agree(not self._stop_asked)

    async def write_checkpoint(self, directory: str | os.PathLike) -> None:
        """This worker's part of the checkpoint in ``directory`` (every worker calls):
        worker 0 writes the whole weights and optimizer state, or sharded workers each
        their shards."""
        if self.sharded:
            dist.barrier()  # worker 0 has made the directory (its caller did, before this)
        self.policy.write_checkpoint(directory, lead=self.rank == 0)

    async def restore(self, ckpt: Checkpoint) -> None:
        """Continue from ``ckpt`` (every worker loads it, sharded ones their shards)."""
        self.policy.load_checkpoint(ckpt.path, ckpt.version)

    async def whereabouts(self) -> dict[str, dict[str, Any]]:
        """No worker process besides this one (data-parallel ranks are the runner's)."""
        return {}

    async def save_weights(self, out_dir: str | os.PathLike) -> Path:
        return self.policy.save_weights(out_dir, self._full)

    async def trained_names(self) -> list[str]:
        """The names of the trained weights, in the order weight syncs carry them."""
        return [n for n, _ in self.policy.synced_parameters()]

    async def final_state(self) -> dict[str, torch.Tensor]:
        if self._full is not None:
            return dict(self._full)
        return self.policy.trainable_state("cpu")

    async def evaluate(
        self, prompts: Sequence[str], metadata: Sequence[dict], samples: int
    ) -> tuple[int, list[EvalScores]]:
        """Evaluate the current weights on ``prompts`` (``samples`` images each, key order
        ``(prompt, sample)``), a micro-batch at a time. Returns the version evaluated and
        the batches' scores (worker 0's; other data-parallel workers return none, sharded
        ones make the images with it). Training is the same with or without it."""
        if self.world > 1 and not self.sharded and self.rank != 0:
            return self.policy.version, []
        keys = [(p, j) for p in range(len(prompts)) for j in range(samples)]
        size = self.cfg.train.micro_batch_size
        out = []
        for i in range(0, len(keys), size):
            batch = keys[i : i + size]
            texts = [prompts[p] for p, _ in batch]
            pixels = self.policy.evaluate(batch, texts)
            if self.rank == 0:
                rewards = await self.reward(pixels, texts, [metadata[p] for p, _ in batch])
                out.append(eval_scores(rewards, pixels, texts))
        return self.policy.version, out

    # --- the run ------------------------------------------------------------------------

    async def run(
        self,
        steps: range | int,
        on_step: Callable[[StepResult], Any] | None = None,
        *,
        samples_at: Callable[[int], bool] | None = None,
    ) -> list[StepResult]:
        """Train ``steps``; ``on_step(result)`` (sync or async) returning False stops the
        run after that step (on every worker: they agree before each step)."""
        steps = range(steps) if isinstance(steps, int) else steps
        results: list[StepResult] = []
        go = True
        for step in steps:
            if not self._all_agree(go):
                break
            try:
                res = await self.train_step(step)
            except _Stopped:
                self.grads.reset()
                break
            if samples_at is not None and not samples_at(step):
                res.pixels, res.captions = None, []
            results.append(res)
            go = on_step is None or await _maybe_await(on_step(res)) is not False
        if self.sharded:  # every worker takes part in gathering; the lead keeps them
            self._full = full_tensors(self.policy.synced_parameters(), keep=self.rank == 0)
        return results

    def _all_agree(self, go: bool) -> bool:
        """Whether every worker wants to go on (one all-reduce when data-parallel)."""
        if self.world == 1:
            return go
        flag = torch.tensor([0.0 if go else 1.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return not bool(flag.item())

    # --- one step -----------------------------------------------------------------------

    def step_prompts(self, step: int) -> tuple[list[str], list[dict[str, Any]]]:
        return self.prompts.for_step(self.cfg.seed, step, self.cfg.data.train_batch_size)

    def my_keys(self, step: int, everyone: bool = False) -> list[SampleKey]:
        """This worker's share: every ``world``-th sample of the step, in (prompt, sample)
        order; with ``everyone``, every sample of the step."""
        b, n = self.cfg.data.train_batch_size, self.cfg.rollout.n
        keys = [SampleKey(step, p, j) for p in range(b) for j in range(n)]
        return keys if everyone else keys[self.rank :: self.world]

    async def train_step(
        self, step: int, on_phase: Callable[[str], None] | None = None
    ) -> StepResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        self.policy.set_step_lr(step)
        texts, meta = self.step_prompts(step)
        keys = self.my_keys(step)
        every = self.my_keys(step, everyone=True)

        # 1. sample, micro-batch by micro-batch
        _phase(on_phase, TaskKind.GENERATE)
        t0 = time.perf_counter()
        parts: list[Generated] = []
        mb = cfg.train.micro_batch_size
        for c, rows in enumerate(lockstep_chunks(len(every), self.world, self.rank, mb)):
            if self._stop_here():
                raise _Stopped
            if rows is None and not self.sharded:
                continue  # a pass only sharded workers run, to keep in step
            chunk = [every[i] for i in rows or [0]]
            with self._span(TaskKind.GENERATE, step, c):
                out = self.policy.generate(chunk, [texts[k.prompt] for k in chunk])
            if rows is not None:  # else made only to keep sharded workers in step
                parts.append(out)
        rollout = Rollout.cat([p.rollout for p in parts])
        pixels = torch.cat([p.pixels for p in parts])
        t_generate = time.perf_counter() - t0

        # 2. score, gather, advantages
        _phase(on_phase, TaskKind.SCORE)
        t0 = time.perf_counter()
        with self._span(TaskKind.SCORE, step, -1):
            scored = await self.reward(
                pixels, [texts[k.prompt] for k in keys], [meta[k.prompt] for k in keys]
            )
        t_score = time.perf_counter() - t0
        names = list(scored.components)
        mine = torch.stack([scored.total] + [scored.components[c] for c in names], dim=1)
        table = self._gather_rows(mine)  # [B*n, 1 + C], global (prompt, sample) order
        b, n = cfg.data.train_batch_size, cfg.rollout.n
        rewards = table[:, 0].view(b, n)
        weight = {fn.name: fn.weight for fn in self.reward.fns}
        parts = [(weight[c], table[:, 1 + j].view(b, n)) for j, c in enumerate(names)]
        adv, keep = score_groups(rewards, cfg.algo, parts)

        # 3. train: mini-batches of prompts, micro-batches of this worker's samples
        _phase(on_phase, "train")
        t0 = time.perf_counter()
        stats = LossStats()
        grad_norms = []
        optimizer_s = 0.0
        row_of = {k: i for i, k in enumerate(keys)}
        for m, prompts_m in enumerate(mini_batches(cfg)):
            # the planned count, as the driver scales: a dropped group adds nothing
            total_terms = step_terms(cfg, step, prompts=len(prompts_m))
            chosen = {k for k in every if k.prompt in prompts_m and keep[k.prompt, k.sample]}
            mine_m = [k for k in keys if k in chosen]
            chunks: list[list[SampleKey] | None] = [
                mine_m[i : i + mb] for i in range(0, len(mine_m), mb)
            ]
            # every worker counts the most chunks any worker has: sharded workers pad to it
            # (a padding chunk, None, keeps them in step and adds nothing: scale 0)
            most = max(
                -(-sum(k in chosen for k in every[r :: self.world]) // mb)
                for r in range(self.world)
            )
            chunks += [None] * (most - len(chunks))
            for c, rows in enumerate(chunks):
                if m == 0 and self._stop_here():  # no optimizer step yet: the step's weights
                    raise _Stopped
                if rows is None and not self.sharded:
                    continue
                chunk = rows if rows is not None else keys[:1]
                item = TrainItem(
                    keys=chunk,
                    prompts=[texts[k.prompt] for k in chunk],
                    rollout=rollout.select(torch.tensor([row_of[k] for k in chunk])),
                    advantages=torch.stack([adv[k.prompt, k.sample] for k in chunk]),
                )
                # micro-batch ids interleave the workers: one order for every worker
                index = c * self.world + self.rank
                scale = 1.0 / total_terms if rows is not None else 0.0
                with self._span(TaskKind.UPDATE, step, c), self.grads.micro_batch(index):
                    got = self.policy.accumulate(item, scale, cfg.runtime.schedule.tsp_degree)
                if rows is not None:
                    stats.add(got)
            t_opt = time.perf_counter()
            with self._span(TaskKind.STEP, step, -1):
                count = most * self.world
                group = dist.group.WORLD if self.world > 1 and not self.sharded else None
                self.grads.reduce(count, group)
                grad_norms.append(self.policy.optimizer_step())
            optimizer_s += time.perf_counter() - t_opt
        self.policy.finish_step()
        t_train = time.perf_counter() - t0 - optimizer_s
        stats = self._reduce_stats(stats)
        usage = None
        if self.trace is not None:  # the step's events leave memory (they are in the file)
            usage = self.trace.step_stats(step, [self.worker])
            self.trace.close_step(step)

        metrics = step_metrics(
            step=step,
            rewards=rewards,
            components={c: float(table[:, 1 + j].mean()) for j, c in enumerate(names)},
            loss=stats,
            grad_norms=grad_norms,
            version=self.policy.version,
            trained_samples=int(keep.sum()),
            step_time_s=time.perf_counter() - t_start,
            busy_s={
                TaskKind.GENERATE: t_generate,
                TaskKind.SCORE: t_score,
                TaskKind.UPDATE: t_train,
            },
            optimizer_s=optimizer_s,
            sync_s=0.0,
            usage=usage,
            memory_gb=dict.fromkeys(("generator", "trainer"), peak_memory_gb(cfg.model.device)),
            reward_latency_s={c: [t] for c, t in scored.latency_s.items()},
            generators_alive=self.world,  # every worker generates
        )
        captions = [texts[k.prompt] for k in keys]
        return StepResult(metrics=metrics, pixels=pixels, captions=captions)

    @contextlib.contextmanager
    def _span(self, kind: TaskKind, step: int, mb: int) -> Iterator[None]:
        """Record the enclosed work as a trace event of this worker."""
        version, t0 = self.policy.version, time.time()
        yield
        if self.trace is not None:
            self.trace.record(kind, self.worker, step, mb, version, t0, time.time())

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

    def _reduce_stats(self, stats: LossStats) -> LossStats:
        if self.world == 1:
            return stats
        t = stats.as_tensor()
        dist.all_reduce(t)
        top = torch.tensor([stats.drift_max], dtype=torch.float64)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        return LossStats.from_tensor(t, float(top))


class _Stopped(Exception):
    """A stop request met at a micro-batch boundary: the step is left."""


async def _maybe_await(value: Any) -> Any:
    """``value``, awaited when it is awaitable (``on_step`` may be sync or async)."""
    return await value if inspect.isawaitable(value) else value


def _phase(cb: Callable[[str], None] | None, name: str) -> None:
    if cb is not None:
        cb(name)
