"""The worker processes of a disaggregated run and the actors in them.

:class:`Cluster` spawns one process per generator and trainer (or joins those a launcher
started), builds a :class:`~digen.runtime.worker.generator.GeneratorActor` or
:class:`~digen.runtime.worker.trainer.TrainerActor` in each, wires the trainers' data-parallel group
and the weight-broadcast group (addresses and free ports on trainer 0's machine), and gives
every generator version 0. The driver (:mod:`digen.runtime.driver.loop`) then only calls methods;
everything about sockets and processes stays here.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Collection, Coroutine, Sequence
from pathlib import Path
from typing import Any, NoReturn, Self

import torch

from digen.checkpoint import PROFILER, Checkpoint
from digen.config import DigenConfig, config_to_dict
from digen.runtime.driver.handles import GeneratorHandle, ScorerHandle, TrainerHandle
from digen.runtime.messages import LossStats, TimedResult
from digen.runtime.notes import NOTES_ENV
from digen.runtime.placement import (
    all_devices,
    check_groups,
    device_maps,
    placed_here,
    run_groups,
)
from digen.runtime.transport.actors import (
    ActorHandle,
    ActorSystem,
    Arrival,
    WorkerDied,
    WorkerSpec,
    active_launch,
)
from digen.runtime.transport.forkserver import PRELOAD, WORKER_ENV
from digen.runtime.transport.groups import listen
from digen.runtime.transport.sockets import local_address_toward
from digen.sched.names import Pool, member_name, worker_names

__all__ = ["Cluster", "ShardedTrainers"]

# The actors' classes, named for the workers to import: the driver never imports what they
# import (diffusers, peft), which would cost it seconds of CPU beside the workers' own start.
GENERATOR = "digen.runtime.worker.generator:GeneratorActor"
SCORER = "digen.runtime.worker.scorer:ScorerActor"
TRAINER = "digen.runtime.worker.trainer:TrainerActor"


class Cluster:
    """``runtime.generators`` generator actors and ``runtime.trainers`` trainer actors."""

    def __init__(
        self,
        cfg: DigenConfig,
        rewards: Sequence[Any] | None = None,
        resume: Checkpoint | None = None,
        notes: Path | None = None,
        join_secret: str | None = None,
    ) -> None:
        """rewards: reward hooks as objects, sent to the generators as they are; None loads
        ``cfg.rewards`` by name in each generator. resume: a checkpoint every trainer loads
        before the generators get its weights. notes: the run's log, where the workers'
        notes go (a prompt the text encoder truncates, ...), as the driver's do.
        join_secret: with ``runtime.elastic.accept_generators``, what a generator joining the run
        must prove it knows (``digen join``)."""
        self.cfg = cfg
        self.resume = resume
        self.rewards = None if rewards is None else list(rewards)
        rt = cfg.runtime
        self.gen_names = list(worker_names(Pool.GENERATOR, rt.generators))
        group = rt.placement.generator_group
        self.gen_members = {
            name: [member_name(name, m) for m in range(group)] for name in self.gen_names
        }
        """Each generator's processes: itself, and its members where it runs on several
        devices (``runtime.placement.generator_sequence`` / ``generator_cfg``)."""
        self.trainer_names = list(worker_names(Pool.TRAINER, rt.trainers))
        elastic = rt.elastic.respawn_generators or rt.elastic.accept_generators
        self.launched = active_launch() is not None
        self.hosts: dict[str, str] = {}
        """Every worker's machine, under an external launcher (several machines)."""
        if self.launched:  # each rank finds its node and GPU itself, once started (start)
            self.devices: dict[str, str] = {}
        else:
            self.devices = all_devices(cfg)
            _check_placement(cfg, self.devices, {})
        # GPU to GPU between workers where every end is a GPU. Staged through the CPU under
        # an external launcher (each rank picks its GPU itself) and in a dynamic world
        # (torch's membership updates rewrite the agents' device tables while RPC threads
        # read them, and a joiner has no map)
        self.direct = not self.launched and not elastic
        maps = device_maps(self.devices) if self.direct else {}
        env = WORKER_ENV | ({NOTES_ENV: str(notes)} if notes else {})
        self.system = ActorSystem(
            [
                WorkerSpec(
                    name,
                    threads=rt.placement.threads_per_worker,
                    env=env,
                    device_maps=maps.get(name, {}),
                )
                for name in self._processes()
            ],
            address=rt.transport.address,
            port=rt.transport.port,
            rpc_timeout_s=rt.transport.rpc_timeout_s,
            heartbeat_s=rt.transport.heartbeat_s,
            preload=PRELOAD,  # torch, diffusers, the backbones: imported once
            # a dynamic world: a lost generator can come back, a new one join
            elastic=elastic,
            joiners=(
                WorkerSpec(Pool.GENERATOR.value, threads=rt.placement.threads_per_worker, env=env)
                if rt.elastic.accept_generators
                else None
            ),
            join_secret=join_secret,
        )
        self.started_here = set(self.gen_names)
        """Generators this driver started (a lost one may be started again); the others
        joined by themselves (``digen join``)."""
        self.gens: list[GeneratorHandle] = []
        self.scorers: list[ScorerHandle] = []
        """With ``runtime.schedule.score_overlap``: one per generator, in its process, holding the
        rewards (else the generators score)."""
        self.trainers: list[TrainerHandle] = []

    async def start(self) -> None:
        """Spawn the workers and build the actors; generators end up holding version 0."""
        await self.system.start()
        cfg_dict = config_to_dict(self.cfg)
        rt = self.cfg.runtime
        if self.launched:  # the ranks' own nodes and GPUs (the driver's LOCAL_RANK is its own)
            names = self._processes()
            places = await asyncio.gather(
                *(self.system.run(n, placed_here, cfg_dict, n) for n in names)
            )
            self.hosts = {n: host for n, (host, _) in zip(names, places, strict=True)}
            self.devices = {n: device for n, (_, device) in zip(names, places, strict=True)}
            if len(set(self.hosts.values())) == 1:
                self.hosts = {}  # one machine: the devices say it all
            _check_placement(self.cfg, self.devices, self.hosts)
        # Trainer 0 hosts the store of each process group, so the address is one of its
        # machine's (the RPC address itself on loopback) and the ports are free there.
        host, dp_port, sync_port = self.system.address, 0, 0
        if rt.trainers > 1 or rt.transport.weight_sync == "broadcast":
            lead = self.trainer_names[0]
            host = await self.system.run(lead, local_address_toward, self.system.address)
            # bound (on that address only) and held there until its store takes it over
            dp_port = await self.system.run(lead, listen, host)
            sync_port = await self.system.run(lead, listen, host)
        where = {"devices": self.devices, "direct": self.direct, "hosts": self.hosts}
        self._built = (cfg_dict, where)
        self.gens = [
            GeneratorHandle(await self._generator(name, cfg_dict, where)) for name in self.gen_names
        ]
        if rt.schedule.score_overlap:  # the rewards beside each generator, on a thread of their own
            self.scorers = [
                ScorerHandle(self.system.actor(name, SCORER, cfg_dict, self.rewards, name, **where))
                for name in self.gen_names
            ]
        trainers = [
            self.system.actor(name, TRAINER, cfg_dict, i, rt.trainers, dp_port, host, name, **where)
            for i, name in enumerate(self.trainer_names)
        ]
        self.trainers = [TrainerHandle(t) for t in trainers]
        await asyncio.gather(*(a.ping() for a in self.gens + self.scorers + self.trainers))
        version = 0
        if self.resume is not None:
            path, version = str(self.resume.path), self.resume.version
            await asyncio.gather(*(t.restore(path, version) for t in self.trainers))
        if rt.trainers > 1 and rt.placement.sharded:
            self.trainers = [TrainerHandle(ShardedTrainers(trainers))]
        if rt.transport.weight_sync == "broadcast":
            size = 1 + len(self.gens)
            await asyncio.gather(
                self.trainers[0].join_sync_group(sync_port, 0, size, host),
                *(g.join_sync_group(sync_port, i + 1, size, host) for i, g in enumerate(self.gens)),
            )
        served = self.serve_weights(version)
        await asyncio.gather(
            *([served] if served is not None else []),
            *(self.send_weights(i, version) for i in range(len(self.gens))),
        )

    async def stop(self) -> None:
        await self.system.stop()

    def _processes(self) -> list[str]:
        """Every worker process: the generators' (their members after each), the trainers'."""
        return [m for name in self.gen_names for m in self.gen_members[name]] + self.trainer_names

    async def _generator(self, name: str, cfg_dict: dict, where: dict) -> Any:
        """Generator ``name``'s actor: one process's, or where it runs on several devices
        its members' as one (:class:`GeneratorGroup`), their sequence/CFG groups formed."""
        members = [
            self.system.actor(m, GENERATOR, cfg_dict, self.rewards, m, **where)
            for m in self.gen_members.get(name, [name])
        ]
        if len(members) == 1:
            return members[0]
        # the group's store is on the first member's machine, on a port it holds free
        host = await self.system.run(name, local_address_toward, self.system.address)
        port = await self.system.run(name, listen, host)
        await asyncio.gather(
            *(a.call("join_generation_group", port, r, host) for r, a in enumerate(members))
        )
        return GeneratorGroup(members)

    async def respawn_generator(self, i: int) -> None:
        """Start lost generator ``i`` again (``runtime.elastic.respawn_generators``): a new process
        under its name, with its actors built; it holds no weights until it pulls some."""
        name = self.gen_names[i]
        await self.system.respawn(name)
        cfg_dict, where = self._built
        gen = GeneratorHandle(
            self.system.actor(name, GENERATOR, cfg_dict, self.rewards, name, **where)
        )
        scorer = None
        if self.cfg.runtime.schedule.score_overlap:
            scorer = ScorerHandle(
                self.system.actor(name, SCORER, cfg_dict, self.rewards, name, **where)
            )
        await asyncio.gather(*(a.ping() for a in (gen, scorer) if a is not None))
        self.gens[i] = gen
        if scorer is not None:
            self.scorers[i] = scorer

    async def next_arrival(self) -> Arrival:
        """The next generator that joined the world by itself
        (``runtime.elastic.accept_generators``), once there is one."""
        return await self.system.next_arrival()

    async def add_generator(self, name: str) -> int:
        """Build the actors of ``name``, a generator that joined the world by itself; its
        index, the next one. It holds no weights until it pulls some. Its tensors travel
        through the CPU (no device map was set up for it)."""
        cfg_dict, where = self._built
        where = {**where, "direct": False}
        gen = GeneratorHandle(
            self.system.actor(name, GENERATOR, cfg_dict, self.rewards, name, **where)
        )
        scorers = []
        if self.cfg.runtime.schedule.score_overlap:
            scorers.append(
                ScorerHandle(self.system.actor(name, SCORER, cfg_dict, self.rewards, name, **where))
            )
        await asyncio.gather(*(a.ping() for a in [gen, *scorers]))
        self.gen_names.append(name)
        self.gens.append(gen)
        self.scorers += scorers
        return len(self.gens) - 1

    def can_respawn(self, i: int) -> bool:
        """Whether lost generator ``i`` can be started again here (this driver started it)."""
        return self.gen_names[i] in self.started_here

    @property
    def rendezvous(self) -> str:
        """``address:port`` of the run's RPC rendezvous (where ``digen join`` finds it)."""
        address = self.system.address
        return (
            f"[{address}]:{self.system.port}" if ":" in address else f"{address}:{self.system.port}"
        )

    def pid_of(self, worker: str) -> int | None:
        """The process id of ``worker`` (its latest process), when this machine started it."""
        return self.system.pids().get(worker)

    async def lost(self) -> Exception:
        """The error of the first worker lost (exited, killed, hung past its heartbeat),
        once there is one."""
        return (await self.system.lost()).again()

    async def next_loss(self) -> WorkerDied:
        """The next worker lost (exited, killed, hung past its heartbeat), once there is one;
        each loss once, in the order found."""
        return await self.system.next_loss()

    async def death_of(self, worker: str) -> WorkerDied | None:
        """``worker``'s loss, checked now (:meth:`ActorSystem.death_of`), or None."""
        return await self.system.death_of(worker)

    async def lost_behind(
        self, error: BaseException, skip: Collection[str] = ()
    ) -> Exception | None:
        """The error of a lost worker that explains ``error`` (see
        :meth:`ActorSystem.lost_behind`), or None when no worker outside ``skip`` was lost."""
        died = await self.system.lost_behind(error, skip)
        return None if died is None else died.again()

    # --- weights ---------------------------------------------------------------------------

    def serve_weights(self, version: int) -> Coroutine[Any, Any, TimedResult] | None:
        """Trainer 0's side of a weight sync: the call that enters the broadcast; None when
        the generators pull (trainer 0 serves its live weights, bucket by bucket)."""
        if self.cfg.runtime.transport.weight_sync != "broadcast":
            return None
        return self.trainers[0].broadcast_weights(version)

    async def send_weights(self, i: int, version: int) -> TimedResult:
        """Generator ``i``'s side: it pulls ``version`` from trainer 0, or receives the
        broadcast. Queued behind whatever that generator is running."""
        if self.cfg.runtime.transport.weight_sync == "broadcast":
            return await self.gens[i].broadcast_weights(version)
        return await self.gens[i].pull_weights(self.trainer_names[0], version)

    async def save_weights(self, out_dir: str | Path) -> Path:
        """Trainer 0 saves the trained weights (LoRA or full) into ``out_dir``."""
        return Path(await self.trainers[0].save_weights(str(out_dir)))

    async def final_state(self) -> dict[str, torch.Tensor]:
        return await self.trainers[0].trainable_state()

    async def whereabouts(self) -> dict[str, dict[str, Any]]:
        """``{worker: {"host", "pid"}}`` as each live worker reports it (torchrun ranks too)."""
        dead = self.system.dead()
        names = [n for n in self.gen_names + self.trainer_names if n not in dead]
        found = await asyncio.gather(*(self.system.run(n, _whereabouts) for n in names))
        return dict(zip(names, found))

    async def release(self, holder: str, keys: list[tuple[int, int]]) -> None:
        """Drop micro-batches nothing will train from ``holder``'s store (from every
        sharded trainer's, when the trainers as one made them)."""
        from digen.runtime.worker.store import release

        lead = self.trainers[0] if self.trainers else None
        holders = lead.members if lead is not None and holder == lead.worker else []
        dead = self.system.dead()  # a lost holder's store went with it
        await asyncio.gather(
            *(self.system.run(h, release, keys) for h in holders or [holder] if h not in dead)
        )

    async def forget(self, holder: str, keys: list[tuple[int, int]]) -> None:
        """Drop what ``holder`` keeps of micro-batches made again elsewhere (as :meth:`release`)."""
        await self.release(holder, keys)

    @property
    def payload(self) -> Any:
        """Bytes the driver's calls moved so far (:attr:`ActorSystem.payload`)."""
        return self.system.payload


class ClusterBackend:
    """The :class:`~digen.runtime.backend.TrainingBackend` calls of a disaggregated run
    that its cluster answers (the schedule is the driver's): starting and stopping the
    workers, the final weights, where every worker is."""

    cluster: Any
    """A :class:`Cluster` (tests: fakes with its methods)."""
    resume: Checkpoint | None
    """The checkpoint the trainers started from."""
    accounts: Any
    """The run's cost ledger, whose estimates (its ``profiler``) a checkpoint keeps."""

    @property
    def gens(self) -> list[GeneratorHandle]:
        return self.cluster.gens

    @property
    def trainers(self) -> list[TrainerHandle]:
        return self.cluster.trainers

    async def __aenter__(self) -> Self:
        try:
            await self.cluster.start()
        except BaseException:
            await self.cluster.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.cluster.stop()

    async def restore(self, ckpt: Checkpoint) -> None:
        """The trainers loaded ``ckpt`` as they started (``resume``): nothing left to do."""
        if self.resume is None or ckpt.path != self.resume.path:
            raise ValueError(
                f"the driver's trainers start from the checkpoint it was made with "
                f"({self.resume.path if self.resume else 'none'}), not {ckpt.path}"
            )

    async def write_checkpoint(self, directory: Any) -> None:
        """Trainer 0 writes its weights and optimizer state into a checkpoint directory
        (behind whatever it is running: only ``step`` changes them, and the next step waits
        for this; sharded trainers all take part), and the cost estimates beside them."""
        await self.cluster.trainers[0].write_checkpoint(str(directory))
        self.accounts.profiler.save(Path(directory) / PROFILER)

    async def save_weights(self, out_dir: Any) -> Any:
        return await self.cluster.save_weights(out_dir)

    async def final_state(self) -> dict[str, torch.Tensor]:
        return await self.cluster.final_state()

    async def trained_names(self) -> list[str]:
        """The names of the trained weights, in the order weight syncs carry them."""
        return await self.cluster.trainers[0].trained_names()

    @property
    def rendezvous(self) -> str | None:
        """``address:port`` where the run's workers (and generators joining it) find it."""
        return getattr(self.cluster, "rendezvous", None)

    async def whereabouts(self) -> dict[str, dict[str, Any]]:
        """Host and pid of every worker, by name."""
        return await self.cluster.whereabouts()

    async def _raise_failure(self, group: BaseExceptionGroup, went_on: Collection[int]) -> NoReturn:
        """Raise the error a failed run reports: a dead worker first, else the first failure;
        a call between two workers that met a loss first reports the loss. ``went_on``: the
        generators whose loss the run survived."""
        died = group.subgroup(WorkerDied)
        leaves, stack = [], [died if died is not None else group]
        while stack:
            exc = stack.pop(0)
            if isinstance(exc, BaseExceptionGroup):
                stack[:0] = exc.exceptions
            else:
                leaves.append(exc)
        error = leaves[0]
        if not isinstance(error, WorkerDied):
            survived = [self.gens[i].worker for i in went_on]
            if loss := await self.cluster.lost_behind(error, survived):
                raise loss from error  # a call between two workers met the loss first
        raise error from None


class _Members:
    """Several worker processes called as one worker, under the first one's name: the
    calls in ``_EVERY_MEMBER`` go to every member at once with the same arguments, their
    span from the first member's start to the last one's end; the rest go to the first."""

    _EVERY_MEMBER: tuple[str, ...] = ()

    def __init__(self, members: Sequence[ActorHandle]) -> None:
        self.handles = list(members)
        self.worker = self.handles[0].worker
        self.members = [h.worker for h in self.handles]

    async def call(self, method: str, /, *args: Any) -> Any:
        if method not in self._EVERY_MEMBER:
            return await self.handles[0].call(method, *args)
        results = await asyncio.gather(*(h.call(method, *args) for h in self.handles))
        return _one_span(results, self._merged(method, results))

    def _merged(self, method: str, results: Sequence[Any]) -> Any:
        """The value of an every-member call in place of the first member's (None: its)."""
        return None


class ShardedTrainers(_Members):
    """Sharded trainers (FSDP / HSDP) called as one trainer named ``trainer-0``.

    Their collectives need every member, so the calls that run the model (generate, update,
    step) go to all of them at once, with the same arguments (each trainer takes its own
    share of an update's rows); the rest go to trainer 0, which holds the full weights.
    An update's value is every member's terms, in member order.
    """

    _EVERY_MEMBER = (
        "generate",
        "update",
        "update_group",
        "step",
        "write_checkpoint",
        "ping",
        "statistics",
        "lend_ema",  # gathered from every member's shards
        "save_weights",  # so are the trained weights beside an old policy
        "trainable_state",
    )

    def _merged(self, method: str, results: Sequence[Any]) -> Any:
        if method not in ("update", "update_group"):
            return None
        value = LossStats()
        for r in results:
            value.add(r.value)
        return value


class GeneratorGroup(_Members):
    """A generator that runs on several devices (sequence and CFG parallelism), called as
    one generator under its first member's name.

    The calls that run the model or change its weights go to every member (each computes
    its share of every sample); the rest (scoring, the micro-batches it holds, its pixels)
    go to the first member, which alone keeps what the group made.
    """

    _EVERY_MEMBER = (
        "generate",
        "evaluate",
        "pull_weights",
        "pull_eval_weights",
        "drop_eval_weights",
        "ping",
    )


def _one_span(results: Sequence[Any], value: Any = None) -> Any:
    """The first member's result; for timed ones, spanning every member's (``value`` in
    place of the first member's, where given)."""
    if not isinstance(results[0], TimedResult):
        return results[0]
    return TimedResult(
        results[0].value if value is None else value,
        min(r.t0 for r in results),
        max(r.t1 for r in results),
        max(r.memory_gb for r in results),
    )


def _whereabouts() -> dict[str, Any]:
    """Where this process runs (run in a worker by :meth:`Cluster.whereabouts`)."""
    import os

    return {"host": socket.gethostname(), "pid": os.getpid()}


def _check_placement(cfg: DigenConfig, devices: dict[str, str], hosts: dict[str, str]) -> None:
    """Refuse a placement whose groups cannot work (one sentence), else log its notes."""
    for note in check_groups(cfg, run_groups(cfg, devices, hosts)):
        logging.getLogger("digen").info(note)
