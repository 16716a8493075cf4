"""Which device each worker computes on, and how tensors cross between two workers.

- A pool's devices are ``runtime.<pool>_devices`` when given. Otherwise every worker of the
  pool uses ``model.device``, except that a bare ``cuda`` splits the visible GPUs between the
  pools in proportion to their sizes (both share one GPU when only one is visible). Worker
  ``i`` of a pool takes device ``i mod len(devices)``. Under ``torchrun`` a CUDA pool's worker
  takes ``cuda:LOCAL_RANK``: one GPU per rank on its node.
- Between two CUDA workers tensors travel GPU to GPU: every pair gets a TensorPipe device
  map (:func:`device_maps`). Anything else is staged through the CPU: the sender moves
  tensors to the CPU before they leave (:func:`wire_device`: the receiver says where, the
  sender puts them there), and every actor method moves
  what it receives onto its own device before using it. The driver holds no device: what
  reaches it is always on the CPU.
- A process group is NCCL when each of its members is on a GPU of its own, gloo otherwise
  (:func:`group_backend`): a mixed group (CPU generators, GPU trainers) stages through the
  CPU, and so does a group with two members on one GPU, which NCCL refuses at its first
  collective (the run's log says so). A sharded trainer group (FSDP,
  HSDP) cannot fall back -- gloo has no reduce-scatter on GPUs -- so such a placement is
  refused before any worker starts (:func:`check_groups`, which also gives the log's notes). A default process group on GPUs
  is NCCL with gloo beside it (:func:`default_group_backend`), for the small CPU tensors a
  run's control values travel in.
"""

from __future__ import annotations

import os
import resource
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from digen.sched.names import Pool, index_of, member_name, member_of, pool_of, worker_name

if TYPE_CHECKING:
    from digen.config import DigenConfig

__all__ = [
    "check_devices_here",
    "all_devices",
    "Group",
    "check_groups",
    "colocated_groups",
    "default_group_backend",
    "device_maps",
    "group_backend",
    "run_groups",
    "shared_gpus",
    "is_cuda",
    "DEVICE_ENV",
    "peak_memory_gb",
    "placed_here",
    "pool_devices",
    "pool_index",
    "wire_device",
    "worker_device",
]


def is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def check_devices_here(cfg: DigenConfig) -> None:
    """Every device a run started on this machine names (``model.device`` and the pools'
    ``runtime.*_devices``) exists here, or :class:`~digen.errors.DigenError` in one sentence:
    said before the run writes anything (imports torch)."""
    import torch

    from digen.errors import DigenError

    rt = cfg.runtime
    named = [("model.device", cfg.model.device)]
    for pool in (Pool.GENERATOR, Pool.TRAINER):
        named += [
            (f"runtime.placement.{pool}_devices", d)
            for d in getattr(rt.placement, f"{pool}_devices") or ()
        ]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for key, device in named:
        if is_cuda(device):
            index = int(device.partition(":")[2] or 0)
            if gpus == 0:
                raise DigenError(
                    f"{key} = {device}, but torch sees no GPU here (torch.cuda.is_available() is "
                    "False): use cpu, or install the torch build for your CUDA."
                )
            if index >= gpus:
                raise DigenError(
                    f"{key} = {device}, but this machine shows {gpus} GPU(s): cuda:0 to "
                    f"cuda:{gpus - 1}."
                )
        elif device == "mps" and not torch.backends.mps.is_available():
            raise DigenError(f"{key} = mps, but torch has no MPS device here: use cpu.")


def pool_devices(cfg: DigenConfig, pool: Pool | str, visible_gpus: int | None = None) -> list[str]:
    """The devices of ``pool`` (module docstring); ``visible_gpus`` defaults to torch's count."""
    rt = cfg.runtime
    explicit = getattr(rt.placement, f"{pool}_devices")
    if explicit:
        return list(explicit)
    device = cfg.model.device
    if device != "cuda":
        return [device]
    if visible_gpus is None:
        import torch

        visible_gpus = torch.cuda.device_count()
    if visible_gpus < 1:
        raise RuntimeError("model.device is cuda but no GPU is visible to this process")
    if visible_gpus == 1:
        return ["cuda:0"]
    g, t = rt.generators * rt.placement.generator_group, rt.trainers
    split = min(max(1, round(visible_gpus * g / (g + t))), visible_gpus - 1)
    ids = range(split) if pool == Pool.GENERATOR else range(split, visible_gpus)
    return [f"cuda:{i}" for i in ids]


def worker_device(
    cfg: DigenConfig,
    pool: Pool | str,
    index: int,
    *,
    visible_gpus: int | None = None,
    env: Mapping[str, str] | None = None,
) -> str:
    """The device of worker ``index`` of ``pool`` (under torchrun, of the rank in ``env``:
    its own node's GPUs are what count, not this process's)."""
    env = os.environ if env is None else env
    explicit = getattr(cfg.runtime.placement, f"{pool}_devices")
    on_gpu = is_cuda(explicit[index % len(explicit)] if explicit else cfg.model.device)
    if on_gpu and "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env:
        return f"cuda:{int(env['LOCAL_RANK'])}"
    devices = pool_devices(cfg, pool, visible_gpus)
    return devices[index % len(devices)]


DEVICE_ENV = "DIGEN_DEVICE"
"""In a worker's environment: its device, over the placement rule (``digen join --device``:
a joiner's own GPU on its own machine)."""


def placed_here(
    cfg: DigenConfig | Mapping, worker: str, env: Mapping[str, str] | None = None
) -> tuple[str, str]:
    """``(host, device)`` of ``worker``, asked in its own process: under torchrun only the
    worker knows its node and its ``LOCAL_RANK`` (the driver's are its own)."""
    from digen.config import DigenConfig, load_config

    cfg = cfg if isinstance(cfg, DigenConfig) else load_config(base=dict(cfg))
    env = os.environ if env is None else env
    device = env.get(DEVICE_ENV) or worker_device(cfg, *pool_index(cfg, worker), env=env)
    return socket.gethostname(), device


def pool_index(cfg: DigenConfig, worker: str) -> tuple[str, int]:
    """``(pool, index)`` of a worker's process among its pool's processes, which take the
    pool's devices in turn: a generator of ``g`` devices (``generator_group``) is processes
    ``g i .. g i + g - 1``, its members (:func:`~digen.sched.names.member_name`) in order."""
    lead, member = member_of(worker)
    pool, index = pool_of(lead), max(index_of(lead), 0)
    if pool == Pool.GENERATOR:
        return pool, index * cfg.runtime.placement.generator_group + member
    return pool, index


def all_devices(cfg: DigenConfig, visible_gpus: int | None = None) -> dict[str, str]:
    """Every worker's device, by worker name."""
    out = {}
    group = cfg.runtime.placement.generator_group
    for i in range(cfg.runtime.generators):
        for m in range(group):  # a generator's processes, when it runs on several devices
            name = member_name(worker_name(Pool.GENERATOR, i), m)
            out[name] = worker_device(cfg, Pool.GENERATOR, i * group + m, visible_gpus=visible_gpus)
    for i in range(cfg.runtime.trainers):
        out[worker_name(Pool.TRAINER, i)] = worker_device(
            cfg, Pool.TRAINER, i, visible_gpus=visible_gpus
        )
    return out


def device_maps(devices: Mapping[str, str]) -> dict[str, dict[str, dict[str, str]]]:
    """For each worker, its TensorPipe device map to every other CUDA worker: ``{worker:
    {peer: {own device: peer device}}}`` (responses travel the inverse map)."""
    cuda = {w: _indexed(d) for w, d in devices.items() if is_cuda(d)}
    return {w: {p: {d: pd} for p, pd in cuda.items() if p != w} for w, d in cuda.items()}


def wire_device(own: str, peer: str, direct: bool = True) -> str | None:
    """Where a worker on ``peer`` must put the tensors it sends to a worker on ``own``: None
    (as they are: GPU to GPU over a device map) or ``"cpu"`` (staged: either end on the CPU,
    or ``direct`` False, a world without device maps)."""
    return None if direct and is_cuda(own) and is_cuda(peer) else "cpu"


def group_backend(devices: Iterable[str], hosts: Iterable[str] | None = None) -> str:
    """``nccl`` when every member is on a GPU of its own, else ``gloo`` (CPU members, or two
    members on one GPU: gloo carries GPU tensors through the host). ``hosts``: each member's
    machine, in the same order (None: all on one)."""
    devices = list(devices)
    if devices and all(is_cuda(d) for d in devices) and not shared_gpus(devices, hosts):
        return "nccl"
    return "gloo"


def default_group_backend(devices: Iterable[str], hosts: Iterable[str] | None = None) -> str:
    """The backend of a default process group (``init_process_group``): on GPUs NCCL for
    GPU tensors with gloo for CPU ones (flags, loss statistics, gathered rewards), else
    gloo."""
    return "cpu:gloo,cuda:nccl" if group_backend(devices, hosts) == "nccl" else "gloo"


def shared_gpus(devices: Iterable[str], hosts: Iterable[str] | None = None) -> list[str]:
    """The GPUs that more than one of ``devices`` names (``cuda`` counts as ``cuda:0``); a
    GPU is one of a machine, so with ``hosts`` (each device's machine, in the same order)
    ``cuda:0`` of two machines are two GPUs."""
    devices = list(devices)
    hosts = [""] * len(devices) if hosts is None else list(hosts)
    if len(hosts) != len(devices):
        raise ValueError(f"{len(hosts)} hosts for {len(devices)} devices")
    seen: dict[str, int] = {}
    for d, h in zip(devices, hosts, strict=True):
        if is_cuda(d):
            gpu = _indexed(d) + (f" of {h}" if h else "")
            seen[gpu] = seen.get(gpu, 0) + 1
    return sorted(d for d, n in seen.items() if n > 1)


@dataclass(frozen=True, slots=True)
class Group:
    """A process group of a run: its name in messages and its members' devices."""

    name: str
    members: dict[str, str]
    """member (a worker's name, or a colocated rank) -> device"""
    sharded: bool = False
    """FSDP / HSDP over it: it cannot fall back to gloo on GPUs (no reduce-scatter there)."""
    hosts: dict[str, str] = field(default_factory=dict)
    """member -> its machine, where the members span several (empty: one machine)."""

    def member_hosts(self) -> list[str] | None:
        return [self.hosts.get(w, "") for w in self.members] if self.hosts else None

    @property
    def backend(self) -> str:
        return group_backend(self.members.values(), self.member_hosts())

    def shared(self) -> list[str]:
        return shared_gpus(self.members.values(), self.member_hosts())

    def describe(self) -> str:
        where = {w: f" of {self.hosts[w]}" if w in self.hosts else "" for w in self.members}
        return ", ".join(f"{w} on {d}{where[w]}" for w, d in self.members.items())


def run_groups(
    cfg: DigenConfig, devices: Mapping[str, str], hosts: Mapping[str, str] | None = None
) -> list[Group]:
    """The process groups of a disaggregated run, from every worker's device
    (:func:`all_devices`, or as the workers found them: :func:`placed_here`) and, where they
    span several machines, every worker's machine: the trainers' group (data-parallel, or
    their device mesh) when there are several, each generator's group when it runs on
    several devices, and the weight-broadcast group of trainer 0 and the generators."""
    rt = cfg.runtime
    hosts = dict(hosts or {})
    sharded = rt.placement.sharded
    trainers = {w: d for w, d in devices.items() if w.startswith(Pool.TRAINER.value)}
    groups = []
    if len(trainers) > 1:
        group = Group(f"trainers' {rt.placement.trainer_parallel} group", trainers, sharded, hosts)
        groups.append(group)
    if rt.placement.generator_group > 1:  # each generator's devices split its samples
        for i in range(rt.generators):
            lead = worker_name(Pool.GENERATOR, i)
            names = [member_name(lead, m) for m in range(rt.placement.generator_group)]
            members = {w: devices[w] for w in names if w in devices}
            groups.append(Group(f"{lead}'s sequence/CFG group", members, hosts=hosts))
    if rt.transport.weight_sync == "broadcast":
        lead = worker_name(Pool.TRAINER, 0)
        members = {lead: devices[lead]}
        members |= {w: d for w, d in devices.items() if w.startswith(Pool.GENERATOR.value)}
        groups.append(Group("weight-broadcast group", members, hosts=hosts))
    return groups


def colocated_groups(cfg: DigenConfig, devices: Sequence[str]) -> list[Group]:
    """The colocated workers' group (``train.num_devices`` > 1), rank ``r`` on ``devices[r]``."""
    if len(devices) < 2:
        return []
    kind = cfg.runtime.placement.trainer_parallel
    members = {f"rank {r}": d for r, d in enumerate(devices)}
    return [Group(f"colocated workers' {kind} group", members, cfg.runtime.placement.sharded)]


def check_groups(cfg: DigenConfig, groups: Sequence[Group]) -> list[str]:
    """Refuse, in one sentence, a sharded group with two members on one GPU (NCCL refuses
    it, and gloo cannot shard GPU tensors); the notes for the run's log of each GPU group
    that falls back to gloo because members share a GPU."""
    from digen.errors import DigenError

    notes = []
    for group in groups:
        shared = group.shared()
        if not shared:
            continue
        if group.sharded:
            raise DigenError(
                f"runtime.placement.trainer_parallel={cfg.runtime.placement.trainer_parallel} "
                f"cannot shard over members that share a GPU ({group.describe()}): NCCL refuses "
                "two members of a group on one GPU and gloo cannot shard; give each its own GPU "
                "(runtime.placement.trainer_devices, train.num_devices) or use "
                "runtime.placement.trainer_parallel=replicate."
            )
        if all(is_cuda(d) for d in group.members.values()):
            notes.append(
                f"the {group.name} ({group.describe()}) has members sharing "
                f"{', '.join(shared)}: it uses gloo through the host instead of NCCL, which "
                "refuses two members of a group on one GPU"
            )
    return notes


def _indexed(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def peak_memory_gb(device: str) -> float:
    """The process's peak memory: ``max_memory_allocated`` on a GPU, peak RSS otherwise."""
    if is_cuda(device):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
    try:  # this process image's own peak: getrusage's also counts what a parent held when
        # it forked this one, before its exec (a run started from a large process)
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1e6  # kB
    except OSError:
        pass
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return kb / (1e9 if sys.platform == "darwin" else 1e6)
