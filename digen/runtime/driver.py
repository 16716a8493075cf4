"""The disaggregated driver: Algorithm 1 of the paper as asyncio coroutines.

The driver holds no model. It owns the prompt stream, the two queues, advantages, versions
and the trace, and keeps ``G`` generator actors and ``T`` trainer actors busy:

- **SQ** (scoring queue) holds generated micro-batches waiting for their rewards; **UQ**
  (update queue) holds scored micro-batches, with advantages, waiting for a trainer.
- Each generator runs :meth:`Driver._generator_loop`: score first (if SQ is non-empty, take
  one and score it here), else generate the next micro-batch of the step, else wait.
- Each trainer runs :meth:`Driver._trainer_loop`: update if UQ is non-empty, else a *bubble*
  has emerged — the place where trainer-assisted generation plugs in — so wait.
- A group's advantages are computed the moment its last sample is scored, and its
  micro-batches enter UQ right away (so, with micro-batches cut along the generation axis,
  training starts after the first group instead of after the whole batch).
- When every update of step ``s`` is done, all trainers ``step()`` (gradients all-reduced
  among them, one optimizer step: on-policy), and the new weights — the LoRA only, when LoRA
  is on — go to the generators with version ``s + 1``.

Gradients accumulate over a step's updates whatever trainer and order they run in, each
scaled by ``1 / terms of the step``, so a step ends where the colocated trainer would.
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
from digen.sched.microbatch import MicroBatch, form_microbatches
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
    pending: deque[MicroBatch]
    sq: asyncio.Queue
    uq: asyncio.Queue
    n_microbatches: int
    made: dict[int, _Made] = field(default_factory=dict)
    rewards: dict[tuple[int, int], float] = field(default_factory=dict)
    components: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    scored_in_group: dict[int, int] = field(default_factory=dict)
    scored_mbs: int = 0
    enqueued: int = 0
    updated: int = 0
    stats: StepStats = field(default_factory=StepStats)
    compute_s: float = 0.0
    """Time the actors spent in generate / score / update calls of this step."""
    overhead_s: float = 0.0
    """Driver-side span of those calls minus the actors' own: RPC, pickling, scheduling."""
    overhead_by_kind: dict[str, list[float]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def all_scored(self) -> bool:
        return self.scored_mbs == self.n_microbatches

    @property
    def all_updated(self) -> bool:
        return self.all_scored and self.updated == self.enqueued

    def notify(self) -> None:
        self.changed.set()

    async def wait(self) -> None:
        await self.changed.wait()
        self.changed.clear()


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
        self._t_origin = time.time()

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

    async def stop(self) -> None:
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
        cfg = self.cfg
        t_start = time.time()
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
        st = _StepState(
            step=step,
            texts=[self.prompts.prompts[i] for i in idx],
            meta=[self.prompts.metadata[i] for i in idx],
            pending=deque(mbs),
            sq=asyncio.Queue(maxsize=len(mbs)),
            uq=asyncio.Queue(maxsize=len(mbs)),
            n_microbatches=len(mbs),
        )
        self._loss_scale = 1.0 / self._terms_per_step(step)
        try:
            async with asyncio.TaskGroup() as tg:
                for g in self.gens:
                    tg.create_task(self._generator_loop(g, st))
                for t in self.trainers:
                    tg.create_task(self._trainer_loop(t, st))
        except ExceptionGroup as group:
            raise _main_error(group) from None

        t0 = time.time()
        results = await asyncio.gather(*(t.call("step") for t in self.trainers))
        for t, res in zip(self.trainers, results):
            self._record("step", t.worker, step, -1, self.version, res.t0, res.t1)
        self.version, grad_norm = results[0].value
        t_update_end = time.time()
        await self._sync_weights(step)
        return self._outcome(st, grad_norm, t_start, t0, t_update_end)

    def _terms_per_step(self, step: int) -> int:
        cfg = self.cfg
        kept = cfg.algo.best_of_n or cfg.rollout.n
        window = len(
            _window(cfg, step)
        )  # every sample of a step shares the window; fraction per sample
        frac = cfg.rollout.timestep_fraction
        per_sample = window if frac >= 1.0 else max(1, int(window * frac))
        return cfg.data.train_batch_size * kept * per_sample

    async def _generator_loop(self, g: ActorHandle, st: _StepState) -> None:
        """Score first; else generate the next micro-batch; else wait for news."""
        while True:
            if not st.sq.empty():
                made: _Made = st.sq.get_nowait()
                keys = made.gen.keys
                res = await self._call(
                    st,
                    g,
                    "score",
                    made.gen.pixels,
                    [st.texts[k.prompt] for k in keys],
                    [st.meta[k.prompt] for k in keys],
                )
                self._record(
                    "score", g.worker, st.step, made.mb.mb, made.gen.version, res.t0, res.t1
                )
                self._on_scored(st, made, *res.value)
            elif st.pending:
                mb = st.pending.popleft()
                keys = [SampleKey(st.step, mb.prompt, s) for s in mb.samples]
                res = await self._call(st, g, "generate", keys, [st.texts[mb.prompt]] * len(keys))
                gen: Generated = res.value
                self._record("generate", g.worker, st.step, mb.mb, gen.version, res.t0, res.t1)
                made = _Made(mb, gen, g.worker)
                st.made[mb.mb] = made
                st.sq.put_nowait(made)
                st.notify()
            elif st.all_scored:
                return
            else:
                await st.wait()

    async def _trainer_loop(self, t: ActorHandle, st: _StepState) -> None:
        """Update while UQ has work; an empty UQ before the step is done is a bubble."""
        pipelined = self.cfg.runtime.pipeline
        while True:
            if not st.uq.empty() and (pipelined or st.all_scored):
                mb_id, item = st.uq.get_nowait()
                res = await self._call(st, t, "update", item, self._loss_scale)
                self._record("update", t.worker, st.step, mb_id, self.version, res.t0, res.t1)
                st.stats.add(res.value)
                st.updated += 1
                st.notify()
            elif st.all_updated:
                st.notify()
                return
            else:
                await st.wait()

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
        st.notify()

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
            sel = torch.tensor(rows)
            keys = [made.gen.keys[i] for i in rows]
            item = TrainItem(
                keys=keys,
                prompts=[st.texts[prompt]] * len(keys),
                rollout=made.gen.rollout.select(sel),
                advantages=torch.stack([adv[k.sample] for k in keys]),
            )
            st.uq.put_nowait((made.mb.mb, item))
            st.enqueued += 1

    # --- weights --------------------------------------------------------------------------

    async def _sync_weights(self, step: int) -> None:
        """Trainer 0's trainable weights -> every generator, tagged with ``self.version``."""
        t0 = time.time()
        if self.cfg.runtime.weight_sync == "broadcast":
            res = await asyncio.gather(
                self.trainers[0].call("broadcast_weights", self.version),
                *(g.call("broadcast_weights", self.version) for g in self.gens),
            )
            spans = list(zip([self.trainers[0], *self.gens], res))
        else:
            state = await self.trainers[0].call("trainable_state")
            res = await asyncio.gather(
                *(g.call("load_weights", state, self.version) for g in self.gens)
            )
            spans = list(zip(self.gens, res))
        for actor, r in spans:
            self._record("sync", actor.worker, max(step, 0), -1, self.version, r.t0, r.t1)
        self._record("sync", "driver", max(step, 0), -1, self.version, t0, time.time())

    # --- results --------------------------------------------------------------------------

    def _record(self, kind: str, worker: str, step: int, mb: int, version: int, t0, t1) -> None:
        self.trace.record(kind, worker, step, mb, version, t0, t1)

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
        kinds = ("generate", "score", "update")
        busy = {
            k: sum(e.duration for e in self.trace.events if e.step == st.step and e.kind == k)
            for k in kinds
        }
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
                "time/score_s": busy["score"],
                "time/train_s": busy["update"],
                "time/optimizer_s": t_end - t_step,
                "time/sync_s": time.time() - t_end,
                "overhead_fraction": st.overhead_s / max(st.compute_s, 1e-12),
                **{
                    f"overhead_ms/{kind}": 1e3 * sum(v) / len(v)
                    for kind, v in st.overhead_by_kind.items()
                },
                "utilisation": stats.utilisation,
                "bubble_fraction": stats.bubble_fraction,
            }
        )
        order = sorted(st.made.values(), key=lambda m: m.mb.mb)
        pixels = torch.cat([m.gen.pixels for m in order])
        captions = [st.texts[k.prompt] for m in order for k in m.gen.keys]
        return StepResult(metrics, pixels, captions)


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
