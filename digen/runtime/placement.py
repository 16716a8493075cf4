"""Which device each worker computes on, and how tensors cross between two workers.

- A pool's devices are ``runtime.<pool>_devices`` when given. Otherwise every worker of the
  pool uses ``model.device``, except that a bare ``cuda`` splits the visible GPUs between the
  pools in proportion to their sizes (both share one GPU when only one is visible). Worker
  ``i`` of a pool takes device ``i mod len(devices)``. Under ``torchrun`` a CUDA pool's worker
  takes ``cuda:LOCAL_RANK``: one GPU per rank on its node.
- Between two CUDA workers tensors travel GPU to GPU: every pair gets a TensorPipe device
  map (:func:`device_maps`). Anything else is staged through the CPU: the sender moves
  tensors to the CPU before they leave (:func:`wire_device`), and every actor method moves
  what it receives onto its own device before using it. The driver holds no device: what
  reaches it is always on the CPU.
- A process group is NCCL when all its members are on CUDA, gloo otherwise
  (:func:`group_backend`); a mixed group (CPU generators, GPU trainers) stages through the
  CPU.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from digen.sched.schedule import Pool, worker_name

if TYPE_CHECKING:
    from digen.config import DigenConfig

__all__ = [
    "all_devices",
    "device_maps",
    "group_backend",
    "is_cuda",
    "peak_memory_gb",
    "pool_devices",
    "wire_device",
    "worker_device",
]


def is_cuda(device: str) -> bool:
    return device == "cuda" or device.startswith("cuda:")


def pool_devices(cfg: DigenConfig, pool: Pool | str, visible_gpus: int | None = None) -> list[str]:
    """The devices of ``pool`` (module docstring); ``visible_gpus`` defaults to torch's count."""
    rt = cfg.runtime
    explicit = getattr(rt, f"{pool}_devices")
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
    g, t = rt.generators, rt.trainers
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
    """The device of worker ``index`` of ``pool``."""
    devices = pool_devices(cfg, pool, visible_gpus)
    device = devices[index % len(devices)]
    env = os.environ if env is None else env
    if is_cuda(device) and "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env:
        return f"cuda:{int(env['LOCAL_RANK'])}"
    return device


def all_devices(cfg: DigenConfig, visible_gpus: int | None = None) -> dict[str, str]:
    """Every worker's device, by worker name."""
    out = {}
    for pool, count in (
        (Pool.GENERATOR, cfg.runtime.generators),
        (Pool.TRAINER, cfg.runtime.trainers),
    ):
        for i in range(count):
            out[worker_name(pool, i)] = worker_device(cfg, pool, i, visible_gpus=visible_gpus)
    return out


def device_maps(devices: Mapping[str, str]) -> dict[str, dict[str, dict[str, str]]]:
    """For each worker, its TensorPipe device map to every other CUDA worker: ``{worker:
    {peer: {own device: peer device}}}`` (responses travel the inverse map)."""
    cuda = {w: _indexed(d) for w, d in devices.items() if is_cuda(d)}
    return {w: {p: {d: pd} for p, pd in cuda.items() if p != w} for w, d in cuda.items()}


def wire_device(own: str, peer: str) -> str | None:
    """Where tensors sent from a worker on ``own`` to one on ``peer`` must be: None (as they
    are: GPU to GPU over a device map, or CPU to CPU) or ``"cpu"`` (staged)."""
    if is_cuda(own) and is_cuda(peer):
        return None
    return None if not is_cuda(own) else "cpu"


def group_backend(devices: Iterable[str]) -> str:
    """``nccl`` when every member is on CUDA, else ``gloo`` (staged through the CPU)."""
    devices = list(devices)
    return "nccl" if devices and all(is_cuda(d) for d in devices) else "gloo"


def _indexed(device: str) -> str:
    return "cuda:0" if device == "cuda" else device


def peak_memory_gb(device: str) -> float:
    """The process's peak memory: ``max_memory_allocated`` on a GPU, peak RSS otherwise."""
    if is_cuda(device):
        import torch

        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated(torch.device(device)) / 1e9
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KB on Linux, bytes on macOS
    return kb / (1e9 if sys.platform == "darwin" else 1e6)
