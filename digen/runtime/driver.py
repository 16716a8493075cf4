"""The disaggregated driver: Algorithm 1 of the paper as asyncio coroutines.

The driver holds no model. It owns the prompt stream, the two queues, advantages, versions
and the trace, and keeps ``G`` generator actors and ``T`` trainer actors busy:

- **SQ** (scoring queue) holds generated micro-batches waiting for their rewards; **UQ**
  (update queue, one per train step) holds scored micro-batches with advantages.
- Each generator runs :meth:`Driver._generator_loop` for the whole run: score first (if SQ is
  non-empty, take one and score it here), else generate the next micro-batch that the
  staleness rule admits, else wait.
- Each trainer runs :meth:`Driver._trainer_loop` during a step: update if UQ has work, else a
  *bubble* has emerged: the TAG policy (bubble-triggered search by default) decides whether
  this trainer generates the next micro-batch itself (trainer-assisted generation, with the
  trainer's current weights; the result is scored by a generator like any other).
- A group's advantages are computed the moment its last sample is scored, and its
  micro-batches enter UQ right away (so, with micro-batches cut along the generation axis,
  training starts after the first group instead of after the whole batch).
- When every update of step ``s`` is done, all trainers ``step()`` (gradients all-reduced
  among them, one optimizer step), and the new weights — the LoRA only, when LoRA is on — go
  to the generators with version ``s + 1``.
- TCSS: with ``runtime.max_staleness = W > 0``, generators may start micro-batches of steps
  up to ``s + W`` while step ``s`` trains, at most ``staleness_ratio`` of each step's
  micro-batches. Weight loads queue behind a running generation on the same actor, so a
  trajectory is made by one version. ``W = 0`` is the on-policy schedule.

Gradients accumulate over a step's updates whatever trainer and order they run in, each
scaled by ``1 / terms of the step``, so an on-policy step ends where the colocated trainer
would.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from digen.algos.advantages import best_of_n, group_advantages
from digen.config import DigenConfig, config_to_dict
from digen.prompts import PromptSet
from digen.runtime.actors import ActorHandle, ActorSystem, WorkerDied, WorkerSpec
from digen.runtime.policy import Generated, SampleKey, StepResult, StepStats, TrainItem
from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.microbatch import MicroBatch, form_microbatches
from digen.sched.state import SchedState, WorkerClock, stale_cap
from digen.sched.tag import BTS, StaticTAG, TagPolicy
from digen.sched.trace import Trace

__all__ = ["Driver"]


@dataclass(slots=True)
class _Made:
    """A generated micro-batch as the driver holds it."""

    mb: MicroBatch
    gen: Generated
    worker: str


@dataclass(slots=True)
class _StepState:
    """Book-keeping of one train step (all touched from the event loop only)."""

    step: int
    texts: list[str]
    meta: list[dict[str, Any]]
    mbs: list[MicroBatch]
    mbs_per_group: int
    next_mb: int = 0
    """Index of the next micro-batch to hand out."""
    made: dict[int, _Made] = field(default_factory=dict)
    rewards: dict[tuple[int, int], float] = field(default_factory=dict)
    components: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    scored_in_group: dict[int, int] = field(default_factory=dict)
    scored_mbs: int = 0
    uq: deque = field(default_factory=deque)
    enqueued: int = 0
    updated: int = 0
    stale: int = 0
    """Micro-batches handed out to a worker holding an older version (TCSS)."""
    tags: int = 0
    bubbles: int = 0
    stats: StepStats = field(default_factory=StepStats)
    compute_s: float = 0.0
    """Time the actors spent in generate / score / update calls of this step."""
    overhead_s: float = 0.0
    """Driver-side span of those calls minus the actors' own: RPC, pickling, scheduling."""
    overhead_by_kind: dict[str, list[float]] = field(default_factory=dict)

    @property
    def n_microbatches(self) -> int:
        return len(self.mbs)

    @property
    def pending(self) -> bool:
        return self.next_mb < len(self.mbs)

    @property
    def all_scored(self) -> bool:
        return self.scored_mbs == len(self.mbs)

    @property
    def all_updated(self) -> bool:
        return self.all_scored and self.updated == self.enqueued


class Driver:
    """Runs train steps on a generator pool and a trainer pool over the actor layer."""

    def __init__(
        self, cfg: DigenConfig, rewards: Sequence[Any] | None, prompts: PromptSet, trace: Trace
    ) -> None:
        self.cfg = cfg
        self.rewards = None if rewards is None else list(rewards)
        self.prompts = prompts
        self.trace = trace
        rt = cfg.runtime
        self.gen_names = [f"generator-{i}" for i in range(rt.generators)]
        self.trainer_names = [f"trainer-{i}" for i in range(rt.trainers)]
        env = {
            "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error",
            "DIFFUSERS_VERBOSITY": "error",
            "TORCH_CPP_LOG_LEVEL": "ERROR",  # TensorPipe logs every closed pipe at shutdown
        }
        self.system = ActorSystem(
            [
                WorkerSpec(name, threads=rt.threads_per_worker, env=env)
                for name in self.gen_names + self.trainer_names
            ],
            address=rt.address,
            rpc_timeout_s=rt.rpc_timeout_s,
        )
        self.gens: list[ActorHandle] = []
        self.trainers: list[ActorHandle] = []
        self.version = 0
        self.tag_policy = _tag_policy(rt.tag, rt.tag_k)
        self.profiler = OnlineProfiler()
        self._steps: dict[int, _StepState] = {}
        self._sq: deque[_Made] = deque()
        self._changed = asyncio.Event()
        self._gen_version: list[int] = [0] * rt.generators
        self._busy: dict[str, tuple[str, float, int, int]] = {}
        self._waiting: set[int] = set()
        self._gen_tasks: list[asyncio.Task] = []
        self._failure: BaseException | None = None
        self._last_step = cfg.steps - 1
        self._step_end = time.time()

    # --- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Spawn the workers, build the actors, and give the generators version 0."""
        await self.system.start()
        cfg_dict = config_to_dict(self.cfg)
        rt = self.cfg.runtime
        # Trainer 0 hosts the store of each process group, so the address is one of its
        # machine's (the RPC address itself on loopback) and the ports are free there.
        host, dp_port, sync_port = self.system.address, 0, 0
        if rt.trainers > 1 or rt.weight_sync == "broadcast":
            lead = self.trainer_names[0]
            host = await self.system.run(lead, _reachable_host, self.system.address)
            dp_port = await self.system.run(lead, _free_port, host)
            sync_port = await self.system.run(lead, _free_port, host)
        self.gens = [
            self.system.actor(name, _generator_cls(), cfg_dict, self.rewards)
            for name in self.gen_names
        ]
        self.trainers = [
            self.system.actor(name, _trainer_cls(), cfg_dict, i, rt.trainers, dp_port, host)
            for i, name in enumerate(self.trainer_names)
        ]
        await asyncio.gather(*(a.call("ping") for a in self.gens + self.trainers))
        if rt.weight_sync == "broadcast":
            size = 1 + len(self.gens)
            await asyncio.gather(
                self.trainers[0].call("join_sync_group", sync_port, 0, size, host),
                *(
                    g.call("join_sync_group", sync_port, i + 1, size, host)
                    for i, g in enumerate(self.gens)
                ),
            )
        await self._sync_weights(step=-1)
        self._step_end = time.time()

    async def stop(self) -> None:
        for task in self._gen_tasks:
            task.cancel()
        await asyncio.gather(*self._gen_tasks, return_exceptions=True)
        self._gen_tasks = []
        await self.system.stop()

    async def save_weights(self, out_dir: str | os.PathLike) -> Path:
        """Trainer 0 saves the trained weights (LoRA or full) into ``out_dir``."""
        return Path(await self.trainers[0].call("save_weights", str(out_dir)))

    async def final_state(self) -> dict[str, torch.Tensor]:
        return await self.trainers[0].call("trainable_state")

    async def __aenter__(self) -> Driver:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- one train step -----------------------------------------------------------------

    async def train_step(self, step: int) -> StepResult:
        """Train step ``step``: updates, one optimizer step, weights to the generators."""
        if not self._gen_tasks:
            self._gen_tasks = [
                asyncio.create_task(self._generator_loop(i), name=f"loop-{name}")
                for i, name in enumerate(self.gen_names)
            ]
        rt = self.cfg.runtime
        for k in range(step, step + 1 + rt.max_staleness):
            self._ensure_step(k)
        st = self._steps[step]
        self._loss_scale = 1.0 / self._terms_per_step(step)
        self._waiting.clear()
        self._notify()
        try:
            async with asyncio.TaskGroup() as tg:
                for j in range(len(self.trainers)):
                    tg.create_task(self._trainer_loop(j, st))
        except ExceptionGroup as group:
            raise _main_error(group) from None
        self._raise_if_failed()

        t0 = time.time()
        results = await asyncio.gather(*(t.call("step") for t in self.trainers))
        for t, res in zip(self.trainers, results):
            self._record("step", t.worker, step, -1, self.version, res.t0, res.t1)
        self.version, grad_norm = results[0].value
        t_update_end = time.time()
        await self._sync_weights(step)
        del self._steps[step]
        self._notify()
        outcome = self._outcome(st, grad_norm, self._step_end, t0, t_update_end)
        self._step_end = time.time()
        return outcome

    def _ensure_step(self, step: int) -> None:
        """Create the book-keeping of ``step`` (no step past the run's last)."""
        if step in self._steps or step > self._last_step or step < self.version:
            return
        cfg = self.cfg
        b, n = cfg.data.train_batch_size, cfg.rollout.n
        idx = self.prompts.indices_for_step(cfg.seed, step, b)
        mbs = form_microbatches(
            step,
            b,
            n,
            generators=len(self.gens),
            axis=cfg.runtime.microbatch_axis,
            samples=cfg.runtime.samples_per_microbatch,
        )
        self._steps[step] = _StepState(
            step=step,
            texts=[self.prompts.prompts[i] for i in idx],
            meta=[self.prompts.metadata[i] for i in idx],
            mbs=mbs,
            mbs_per_group=sum(1 for m in mbs if m.prompt == 0),
        )

    def _terms_per_step(self, step: int) -> int:
        cfg = self.cfg
        kept = cfg.algo.best_of_n or cfg.rollout.n
        window = len(_window(cfg, step))  # every sample of a step shares the window
        frac = cfg.rollout.timestep_fraction
        per_sample = window if frac >= 1.0 else max(1, int(window * frac))
        return cfg.data.train_batch_size * kept * per_sample

    # --- the loops ----------------------------------------------------------------------

    async def _generator_loop(self, i: int) -> None:
        """Score first; else generate the next admitted micro-batch; else wait for news."""
        g = self.gens[i]
        try:
            while True:
                if self._sq:
                    made = self._sq.popleft()
                    await self._score(g, made)
                elif (work := self._admit(self._gen_version[i])) is not None:
                    await self._generate(g, *work, kind="generate")
                else:
                    await self._wait()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # surfaced by the step that is waiting on it
            self._failure = self._failure or exc
            self._notify()

    async def _trainer_loop(self, j: int, st: _StepState) -> None:
        """Update while UQ has work; at a bubble, ask the TAG policy; else wait."""
        t = self.trainers[j]
        pipelined = self.cfg.runtime.pipeline
        while True:
            self._raise_if_failed()
            if st.uq and (pipelined or st.all_scored):
                self._waiting.discard(j)
                mb_id, item = st.uq.popleft()
                self._busy[t.worker] = ("update", time.time(), st.step, mb_id)
                res = await self._call(st, t, "update", item, self._loss_scale)
                del self._busy[t.worker]
                self._record("update", t.worker, st.step, mb_id, self.version, res.t0, res.t1)
                st.stats.add(res.value)
                st.updated += 1
                self._notify()
            elif st.all_updated:
                self._notify()
                return
            elif j not in self._waiting and self._admit(self.version, peek=True) is not None:
                st.bubbles += 1
                if self._decide_tag(j, st):
                    work = self._admit(self.version)
                    if work is not None:
                        st.tags += 1
                        await self._generate(t, *work, kind="tag")
                        continue
                self._waiting.add(j)
            else:
                await self._wait()

    def _admit(self, version: int, *, peek: bool = False) -> tuple[_StepState, MicroBatch] | None:
        """The next micro-batch a worker holding ``version`` may generate now, if any.

        Micro-batches go out in order, step by step. One of step ``k`` is admitted when
        ``k == version``, or under TCSS when ``0 < k - version <= max_staleness`` and fewer
        than ``staleness_ratio`` of step ``k``'s micro-batches have gone out stale.
        """
        rt = self.cfg.runtime
        for k in sorted(self._steps):
            st = self._steps[k]
            if not st.pending:
                continue
            lag = k - version
            if lag > 0 and (
                lag > rt.max_staleness or st.stale >= stale_cap(len(st.mbs), rt.staleness_ratio)
            ):
                return None
            if peek:
                return st, st.mbs[st.next_mb]
            mb = st.mbs[st.next_mb]
            st.next_mb += 1
            st.stale += lag > 0
            return st, mb
        return None

    def _decide_tag(self, j: int, st: _StepState) -> bool:
        """Ask the TAG policy at trainer ``j``'s bubble (the first TAG of a run is a probe)."""
        if self.tag_policy is None:
            return False
        if not self.profiler.seen("gen_tag"):
            return True  # one TAG measures the trainer's generation speed, as the paper does
        if not self.profiler.ready():
            return False
        costs = self.profiler.costs(generator_pool="generator", trainer_pool="trainer")
        return self.tag_policy.decide(self._sched_state(j, st, costs), costs)

    def _sched_state(self, j: int, st: _StepState, costs: Costs) -> SchedState:
        """What the driver knows, as the scheduling model reads it."""
        now = time.time()
        expected = {"generate": costs.gen, "tag": costs.gen_tag, "score": costs.score}
        expected["update"] = costs.update

        def clock(worker: str, waiting: bool = False) -> WorkerClock:
            if worker not in self._busy:
                return WorkerClock(waiting=waiting)
            kind, t0, step, mb = self._busy[worker]
            return WorkerClock(kind=kind, busy_until=t0 + expected[kind], step=step, mb=mb)

        nxt = self._admit(self.version, peek=True)
        partial = tuple(
            (k, g, c)
            for k, s in sorted(self._steps.items())
            for g, c in sorted(s.scored_in_group.items())
            if 0 < c < self.cfg.rollout.n
        )
        rt = self.cfg.runtime
        return SchedState(
            now=now,
            trainer=j,
            microbatches=st.n_microbatches,
            step=self.version,
            generators=tuple(clock(n) for n in self.gen_names),
            trainers=tuple(
                WorkerClock() if i == j else clock(n, waiting=i in self._waiting)
                for i, n in enumerate(self.trainer_names)
            ),
            next_mb=(nxt[1].step, nxt[1].mb) if nxt else (self._last_step + 1, 0),
            sq=tuple((m.mb.step, m.mb.mb) for m in self._sq),
            uq=len(st.uq),
            updated=st.updated,
            partial_groups=partial,
            mbs_per_group=st.mbs_per_group,
            max_staleness=rt.max_staleness,
            stale_cap=stale_cap(st.n_microbatches, rt.staleness_ratio),
            last_step=self._last_step,
            tags=st.tags,
            bubbles=st.bubbles - 1,
        )

    # --- the work -----------------------------------------------------------------------

    async def _generate(self, actor: ActorHandle, st: _StepState, mb: MicroBatch, kind: str):
        keys = [SampleKey(st.step, mb.prompt, s) for s in mb.samples]
        self._busy[actor.worker] = (kind, time.time(), st.step, mb.mb)
        try:
            res = await self._call(st, actor, "generate", keys, [st.texts[mb.prompt]] * len(keys))
        finally:
            self._busy.pop(actor.worker, None)
        gen: Generated = res.value
        self._record(kind, actor.worker, st.step, mb.mb, gen.version, res.t0, res.t1)
        made = _Made(mb, gen, actor.worker)
        st.made[mb.mb] = made
        self._sq.append(made)
        self._notify()

    async def _score(self, g: ActorHandle, made: _Made) -> None:
        st = self._steps[made.mb.step]
        keys = made.gen.keys
        self._busy[g.worker] = ("score", time.time(), st.step, made.mb.mb)
        try:
            res = await self._call(
                st,
                g,
                "score",
                made.gen.pixels,
                [st.texts[k.prompt] for k in keys],
                [st.meta[k.prompt] for k in keys],
            )
        finally:
            self._busy.pop(g.worker, None)
        self._record("score", g.worker, st.step, made.mb.mb, made.gen.version, res.t0, res.t1)
        self._on_scored(st, made, *res.value)

    async def _call(self, st: _StepState, actor: ActorHandle, method: str, *args: Any) -> Any:
        """Call an actor's work method, accounting its compute and the call's overhead."""
        t0 = time.time()
        res = await actor.call(method, *args)
        span, work = time.time() - t0, res.t1 - res.t0
        st.compute_s += work
        st.overhead_s += max(0.0, span - work)
        st.overhead_by_kind.setdefault(method, []).append(max(0.0, span - work))
        return res

    def _on_scored(self, st: _StepState, made: _Made, total: torch.Tensor, comps: dict) -> None:
        for row, key in enumerate(made.gen.keys):
            st.rewards[(key.prompt, key.sample)] = float(total[row])
            for name, values in comps.items():
                st.components.setdefault(name, {})[(key.prompt, key.sample)] = float(values[row])
        p = made.mb.prompt
        st.scored_in_group[p] = st.scored_in_group.get(p, 0) + len(made.gen.keys)
        st.scored_mbs += 1
        if st.scored_in_group[p] == self.cfg.rollout.n:
            self._enqueue_group(st, p)
        self._notify()

    def _enqueue_group(self, st: _StepState, prompt: int) -> None:
        """Advantages of a complete group; its micro-batches (kept samples) go to UQ."""
        cfg = self.cfg
        n = cfg.rollout.n
        rewards = torch.tensor([[st.rewards[(prompt, s)] for s in range(n)]])
        adv = group_advantages(
            rewards, norm=cfg.algo.adv_norm, eps=cfg.algo.adv_eps, clip_max=cfg.algo.adv_clip_max
        )[0]
        keep = set(range(n))
        if cfg.algo.best_of_n:
            keep = set(best_of_n(adv[None], cfg.algo.best_of_n)[0].tolist())
        for made in (m for m in st.made.values() if m.mb.prompt == prompt):
            rows = [i for i, k in enumerate(made.gen.keys) if k.sample in keep]
            if not rows:
                continue
            keys = [made.gen.keys[i] for i in rows]
            item = TrainItem(
                keys=keys,
                prompts=[st.texts[prompt]] * len(keys),
                rollout=made.gen.rollout.select(torch.tensor(rows)),
                advantages=torch.stack([adv[k.sample] for k in keys]),
            )
            st.uq.append((made.mb.mb, item))
            st.enqueued += 1

    # --- waking up ------------------------------------------------------------------------

    def _notify(self) -> None:
        """Wake every loop waiting for a change of state."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait(self) -> None:
        await self._changed.wait()

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise self._failure

    # --- weights --------------------------------------------------------------------------

    async def _sync_weights(self, step: int) -> None:
        """Trainer 0's trainable weights -> every generator, tagged with ``self.version``.

        Each load is queued on its actor behind whatever it is generating, so a trajectory
        in flight finishes with the weights it started with.
        """
        t0 = time.time()
        version = self.version

        async def send(i: int, g: ActorHandle, method: str, *args: Any) -> Any:
            self._gen_version[i] = version  # the actor's next call runs with these weights
            return await g.call(method, *args)

        if self.cfg.runtime.weight_sync == "broadcast":
            res = await asyncio.gather(
                self.trainers[0].call("broadcast_weights", version),
                *(send(i, g, "broadcast_weights", version) for i, g in enumerate(self.gens)),
            )
            spans = list(zip([self.trainers[0], *self.gens], res))
        else:
            state = await self.trainers[0].call("trainable_state")
            res = await asyncio.gather(
                *(send(i, g, "load_weights", state, version) for i, g in enumerate(self.gens))
            )
            spans = list(zip(self.gens, res))
        for actor, r in spans:
            self._record("sync", actor.worker, max(step, 0), -1, version, r.t0, r.t1)
        self._record("sync", "driver", max(step, 0), -1, version, t0, time.time())

    # --- results --------------------------------------------------------------------------

    def _record(self, kind: str, worker: str, step: int, mb: int, version: int, t0, t1) -> None:
        event = self.trace.record(kind, worker, step, mb, version, t0, t1)
        if worker != "driver":
            self.profiler.observe(event)

    def _outcome(
        self, st: _StepState, grad_norm: float, t_start: float, t_step: float, t_end: float
    ) -> StepResult:
        cfg = self.cfg
        b, n = cfg.data.train_batch_size, cfg.rollout.n
        r = torch.tensor([[st.rewards[(p, s)] for s in range(n)] for p in range(b)])
        metrics: dict[str, Any] = {
            "step": st.step,
            "reward_mean": float(r.mean()),
            "reward_std": float(r.std(unbiased=False)),
            "reward_min": float(r.min()),
            "reward_max": float(r.max()),
        }
        for name, values in st.components.items():
            metrics[f"reward/{name}"] = sum(values.values()) / len(values)
        metrics.update(st.stats.means())
        workers = self.gen_names + self.trainer_names
        stats = self.trace.step_stats(st.step, workers)
        kinds = ("generate", "tag", "score", "update")
        busy = dict.fromkeys(kinds, 0.0)
        for e in self.trace.events:  # one pass over the trace, not one per kind
            if e.step == st.step and e.kind in busy:
                busy[e.kind] += e.duration
        metrics.update(
            {
                "grad_norm": grad_norm,
                "policy_version": self.version,
                "samples": b * n,
                "trained_samples": sum(len(m.gen.keys) for m in st.made.values())
                if not cfg.algo.best_of_n
                else b * cfg.algo.best_of_n,
                "step_time_s": time.time() - t_start,
                "time/generate_s": busy["generate"],
                "time/tag_s": busy["tag"],
                "time/score_s": busy["score"],
                "time/train_s": busy["update"],
                "time/optimizer_s": t_end - t_step,
                "time/sync_s": time.time() - t_end,
                "overhead_fraction": st.overhead_s / max(st.compute_s, 1e-12),
                **{
                    f"overhead_ms/{kind}": 1e3 * sum(v) / len(v)
                    for kind, v in st.overhead_by_kind.items()
                },
                "stale_microbatches": st.stale,
                "tag_microbatches": st.tags,
                "utilisation": stats.utilisation,
                "bubble_fraction": stats.bubble_fraction,
            }
        )
        order = sorted(st.made.values(), key=lambda m: m.mb.mb)
        pixels = torch.cat([m.gen.pixels for m in order])
        captions = [st.texts[k.prompt] for m in order for k in m.gen.keys]
        return StepResult(metrics, pixels, captions)


def _tag_policy(name: str, k: int) -> TagPolicy | None:
    if name == "bts":
        return BTS()
    if name == "static":
        return StaticTAG(k)
    return None


def _main_error(group: BaseExceptionGroup) -> BaseException:
    """The error to report for a failed step: a dead worker first, else the first failure."""
    died = group.subgroup(WorkerDied)
    leaves = _leaves(died if died is not None else group)
    return leaves[0]


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def _window(cfg: DigenConfig, step: int) -> list[int]:
    from digen.algos.timesteps import sde_window

    r = cfg.rollout
    return sde_window(
        seed=cfg.seed,
        step=step,
        num_inference_steps=r.num_inference_steps,
        window_size=r.sde_window_size,
        window_range=r.sde_window_range,
        sde_type=r.sde_type,
    )


def _reachable_host(peer: str) -> str:
    """This machine's address on the route to ``peer`` (``peer`` itself when it is loopback).

    Run on trainer 0, whose process-group stores the other members must reach; ``peer`` is
    the RPC rendezvous address, which every process reaches.
    """
    try:
        if ipaddress.ip_address(peer).is_loopback:
            return peer
    except ValueError:
        if peer == "localhost":
            return peer
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((peer, 9))  # a UDP connect sends nothing: it only picks the route
            return s.getsockname()[0]
    except OSError:
        return peer


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _generator_cls() -> type:
    from digen.runtime.workers import GeneratorActor

    return GeneratorActor


def _trainer_cls() -> type:
    from digen.runtime.workers import TrainerActor

    return TrainerActor
