"""Virtual GPUs: a test mode in which a process believes its host has N CUDA devices while every
tensor lives on the CPU, so the GPU paths of placement, process groups, device maps, FSDP and
the actors run here and a device mix-up fails the way it would on GPUs.

Switched on in every process of a test by the environment: ``DIGEN_VIRTUAL_GPUS=N`` (devices
per host) with ``tests/vgpu_site`` on ``PYTHONPATH`` (its ``sitecustomize`` calls
:func:`install` at interpreter start, so workers, torchrun ranks and joiners all take it).

What it does in a process:
- ``torch.cuda`` answers as a host with N devices: ``is_available``, ``device_count``,
  ``set_device`` / ``current_device``, streams and events (recorded, waited on: no-ops),
  ``synchronize``, memory queries (zeros), ``is_bf16_supported``.
- Every tensor created on or moved to ``cuda:k`` is a CPU tensor tagged ``cuda:k`` (a
  ``TorchFunctionMode`` entered in every thread); ``tensor.device`` and ``is_cuda`` answer as on
  a GPU. An operation whose tensor arguments carry two different devices (``cuda:0`` with
  ``cuda:1``, or a GPU tensor with one known to be on the CPU) raises
  :class:`VirtualDeviceError`, as CUDA would; 0-dimensional tensors mix freely, as in torch.
  A tensor made by code the mode does not see (autograd's gradients, unpickled ones) has no
  tag and meets any device; one that crosses RPC takes the device its receiver would see (the
  sender's device through a device map, else the CPU), and a GPU tensor sent to a peer with
  no device map raises, as TensorPipe does.
- Process groups asked for NCCL get gloo (every tensor is on the CPU); the backend asked for
  is logged. TensorPipe device maps are checked (every peer named must be in the world, each
  device a virtual one) and logged, then left out of the real agent.
- Under torchrun, ``socket.gethostname()`` answers ``vhost-<GROUP_RANK>``, so two torchrun
  agents on this machine are two hosts (``DIGEN_VIRTUAL_HOST`` names it outright).
- With ``DIGEN_VIRTUAL_LOG=path`` every process appends what it saw (its devices, groups,
  device maps, errors) to ``path`` as JSON lines, for the test to read.
- With ``DIGEN_VIRTUAL_MEMORY=seconds`` as well, a thread in every process tells its host
  memory apart from its devices': device memory is the live storages that tensors tagged with
  a virtual GPU use, host memory the resident memory less that; their peaks are logged as
  ``host_memory`` rows.

Limits: no kernel runs on a GPU, so nothing here measures GPU speed, NCCL or CUDA streams'
ordering, nor the CUDA allocator's memory (its caching, fragmentation, workspaces); a tensor
with no tag (made where the mode cannot see) is not checked, and its memory counts as the
host's: autograd's gradients of activations, while a backward pass runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

ENV = "DIGEN_VIRTUAL_GPUS"
HOST_ENV = "DIGEN_VIRTUAL_HOST"
LOG_ENV = "DIGEN_VIRTUAL_LOG"
MEMORY_ENV = "DIGEN_VIRTUAL_MEMORY"
SITE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vgpu_site")

_TAG = "_virtual_device"
_state = threading.local()
_current = [0]
_installed: list[VirtualCuda] = []


class VirtualDeviceError(RuntimeError):
    """Two virtual devices met where CUDA would refuse it."""


def env(gpus: int, log: str | os.PathLike | None = None, **extra: str) -> dict[str, str]:
    """``os.environ`` plus what switches virtual GPUs on in every process a test starts."""
    out = dict(os.environ)
    out[ENV] = str(gpus)
    out["PYTHONPATH"] = os.pathsep.join(p for p in (SITE, out.get("PYTHONPATH")) if p)
    if log is not None:
        out[LOG_ENV] = str(log)
    return {**out, **extra}


def log(kind: str, **fields: Any) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    row = {"kind": kind, "pid": os.getpid(), "host": socket.gethostname(), **fields}
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")


def read_log(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# ---------------------------------------------------------------------------------- tags


def _count() -> int:
    return int(os.environ.get(ENV, "0"))


def _virtual(device: Any) -> str | None:
    """``"cuda:k"`` for a CUDA device (checked against the host's count), ``"cpu"`` for the
    CPU, None for anything else (not a device)."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return None
    if not isinstance(device, torch.device):
        return None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        return None
    index = _current[0] if device.index is None else device.index
    if not 0 <= index < _count():
        raise VirtualDeviceError(
            f"cuda:{index} does not exist: this virtual host has {_count()} devices"
        )
    return f"cuda:{index}"


def tag_of(t: Any) -> str | None:
    if not isinstance(t, torch.Tensor):
        return None
    tag = getattr(t, _TAG, None)
    if tag is None and hasattr(t, "_local_tensor"):  # a DTensor: where its shard is, or
        # (a shard made inside DTensor's dispatch, where the mode cannot see) its mesh's
        tag = getattr(t._local_tensor, _TAG, None)
        if tag is None and getattr(t.device_mesh, "device_type", None) == "cuda":
            tag = f"cuda:{_current[0]}"
    return tag


def _set_tag(t: torch.Tensor, tag: str | None) -> None:
    if tag is None:
        return
    with contextlib.suppress(AttributeError, RuntimeError):  # subclasses without a dict
        setattr(t, _TAG, tag)
        if _sampling and tag != "cpu":
            _on_device(t)


def _tensors(obj: Any, depth: int = 0) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth + 1)


def _name(func: Any) -> str:
    return getattr(func, "__name__", "")


_MOVES = {"to", "cuda", "cpu", "_to_copy"}
_CROSS = {
    "copy_",
    "set_",
    "swap_tensors",
    "record_stream",
    "is_pinned",
    "_has_compatible_shallow_copy_type",
    "is_same_size",
    "is_set_to",
    "view_as",  # takes the other's shape only
    "type_as",
    "expand_as",
    "reshape_as",
}


class VirtualCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        name = _name(func)
        owner = getattr(func, "__self__", None)
        if name in ("__get__", "__set__") and owner is not None:
            return self._attribute(func, getattr(owner, "__name__", ""), args, kwargs)
        if name in _MOVES and args and isinstance(args[0], torch.Tensor):
            return self._move(func, name, args, kwargs)
        if name in ("pin_memory",) and args:
            return args[0]
        if name == "backward":  # the hooks it runs (FSDP's) must see virtual devices too
            with VirtualCuda():
                return _backward(*args, **kwargs)
        target = None
        if "device" in kwargs:
            target = _virtual(kwargs["device"])
            if target is not None and target != "cpu":
                kwargs["device"] = "cpu"
        checked = (args, kwargs)
        if name in ("__getitem__", "__setitem__") and args:  # indices may be on the CPU
            checked = (args[0], args[2:])
        known = {tag_of(t) for t in _tensors(checked) if t.dim() > 0} - {None}
        if name not in _CROSS and len(known) > 1:
            where = ", ".join(
                f"{tuple(t.shape)} on {tag_of(t)}"
                for t in _tensors((args, kwargs))
                if t.dim() > 0 and tag_of(t) is not None
            )
            raise VirtualDeviceError(
                f"{name or func} got tensors on {', '.join(sorted(known))} ({where}): CUDA "
                "refuses to mix devices in one operation"
            )
        out = func(*args, **kwargs)
        if name == "copy_" or (name.endswith("_") and not name.endswith("__")):
            own = tag_of(args[0]) if args else None
            if own is not None or name == "copy_":
                return out
        tag = target or (known.pop() if len(known) == 1 else None)
        if tag is None and "like" in name and args:
            tag = tag_of(args[0])
        if tag is not None:
            for t in _tensors(out):
                _set_tag(t, tag)
        return out

    def _attribute(self, func, attr: str, args, kwargs):
        if func.__name__ == "__set__":
            func(*args, **kwargs)
            if attr == "data" and len(args) == 2:
                _set_tag(args[0], tag_of(args[1]) or "cpu")
            elif attr == "grad" and len(args) == 2 and args[1] is not None:
                _set_tag(args[1], tag_of(args[0]))
            return None
        out = func(*args, **kwargs)
        t = args[0] if args else None
        tag = tag_of(t)
        if attr == "device" and tag is not None and tag != "cpu":
            return torch.device(tag)
        if attr == "is_cuda" and tag is not None:
            return tag != "cpu"
        derived = attr in ("grad", "data", "T", "mT", "real", "imag")
        if derived and isinstance(out, torch.Tensor) and tag_of(out) is None:
            _set_tag(out, tag)
        return out

    def _move(self, func, name: str, args, kwargs):
        t = args[0]
        rest = list(args[1:])
        target: str | None = None
        if name == "cuda":
            device = rest[0] if rest else kwargs.pop("device", None)
            rest = []
            target = _virtual("cuda" if device is None else torch.device("cuda", _index(device)))
            kwargs.pop("non_blocking", None)
            kwargs.pop("memory_format", None)
        elif name == "cpu":
            target = "cpu"
        else:
            if "device" in kwargs:
                target = _virtual(kwargs["device"])
                if target is not None:
                    kwargs["device"] = "cpu"
            for i, a in enumerate(rest):
                if isinstance(a, torch.Tensor):
                    target = tag_of(a) or "cpu"
                    rest[i] = a.dtype  # to(other): its dtype, on the CPU
                    if a.dtype == t.dtype:
                        rest.pop(i)
                    break
                if isinstance(a, int) and i:  # an int is a device index only as to()'s first
                    continue
                v = _virtual(a) if isinstance(a, (str, torch.device, int)) else None
                if v is not None:
                    target = v
                    rest[i] = "cpu"
                    break
        here = tag_of(t) or "cpu"
        if name == "cuda" or name == "cpu":
            out = t if here == target else t.clone()
        else:
            out = func(t, *rest, **kwargs)
            if target is not None and out is t and here != target:
                out = t.clone()
        if target is not None:
            _set_tag(out, target)
        elif out is not t:
            _set_tag(out, tag_of(t))
        return out


def _backward(
    tensors: Any,
    grad_tensors: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
    **kwargs: Any,
) -> None:
    """``torch.autograd.backward`` without its torch-function check (a mode's handler runs
    with the mode off; this runs the engine with it on)."""
    from torch.autograd import _make_grads, _tensor_or_tensors_to_tuple
    from torch.autograd.graph import _engine_run_backward

    grad_tensors = kwargs.pop("gradient", grad_tensors)
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    if inputs is None:
        inputs = ()
    elif isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    grads = _make_grads(
        tensors, _tensor_or_tensors_to_tuple(grad_tensors, len(tensors)), is_grads_batched=False
    )
    retain = create_graph if retain_graph is None else retain_graph
    _engine_run_backward(
        tensors,
        grads,
        retain,
        create_graph,
        tuple(inputs),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _index(device: Any) -> int:
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return _current[0] if d.index is None else d.index


# ------------------------------------------------------------------------- torch.cuda


class _Event:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.recorded = False

    def record(self, stream: Any = None) -> None:
        self.recorded = True

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", _current[0] if device is None else _index(device))
        self.priority = priority

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream) and other.device == self.device

    def __hash__(self) -> int:
        return hash(("stream", str(self.device)))


_streams: dict[int, _Stream] = {}


def _current_stream(device: Any = None) -> _Stream:
    index = _current[0] if device is None else _index(device)
    return _streams.setdefault(index, _Stream(index))


def _set_device(device: Any) -> None:
    index = _index(device)
    if not 0 <= index < _count():
        raise VirtualDeviceError(
            f"cuda:{index} does not exist: this virtual host has {_count()} devices"
        )
    _current[0] = index
    log("set_device", device=f"cuda:{index}")


class _DeviceContext:
    def __init__(self, device: Any) -> None:
        self.index = None if device is None else _index(device)

    def __enter__(self) -> None:
        self.saved = _current[0]
        if self.index is not None and self.index >= 0:
            _current[0] = self.index

    def __exit__(self, *exc: Any) -> None:
        _current[0] = self.saved


class _Properties:
    def __init__(self, index: int) -> None:
        self.name = "Virtual GPU"
        self.total_memory = 80 * 2**30
        self.major, self.minor = 9, 0
        self.multi_processor_count = 132
        self.index = index


def _patch_cuda() -> None:
    cuda = torch.cuda

    def zero() -> Any:  # a function object of its own per name (torch keys rules by object)
        return lambda *a, **k: 0

    def nothing() -> Any:
        return lambda *a, **k: None

    patches = {
        "is_available": lambda: True,
        "device_count": _count,
        "is_initialized": lambda: True,
        "_lazy_init": nothing(),
        "init": nothing(),
        "current_device": lambda: _current[0],
        "set_device": _set_device,
        "device": _DeviceContext,
        "synchronize": nothing(),
        "Event": _Event,
        "Stream": _Stream,
        "current_stream": _current_stream,
        "default_stream": _current_stream,
        "stream": lambda s=None: contextlib.nullcontext(),
        "set_stream": nothing(),
        "empty_cache": nothing(),
        "memory_allocated": zero(),
        "max_memory_allocated": zero(),
        "memory_reserved": zero(),
        "max_memory_reserved": zero(),
        "reset_peak_memory_stats": nothing(),
        "reset_max_memory_allocated": nothing(),
        "mem_get_info": lambda device=None: (80 * 2**30, 80 * 2**30),
        "get_device_name": lambda device=None: "Virtual GPU",
        "get_device_capability": lambda device=None: (9, 0),
        "get_device_properties": lambda device=None: _Properties(_index(device or 0)),
        "is_bf16_supported": lambda *a, **k: True,
        "manual_seed": nothing(),
        "manual_seed_all": nothing(),
        "seed": nothing(),
        "seed_all": nothing(),
    }
    for key, value in patches.items():
        setattr(cuda, key, value)
    # FSDP and the device mesh reach the device module through this handle
    torch._utils._get_device_module = lambda device_type: (
        cuda if device_type == "cuda" else (getattr(torch, device_type))
    )


# --------------------------------------------------------------- groups and device maps


def _patch_distributed() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def gloo(backend: Any) -> Any:
        if backend is None:
            return backend
        text = str(backend)
        return "gloo" if "nccl" in text else backend

    init, new = c10d.init_process_group, c10d.new_group

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[0] if args else None)
        log("group", scope="default", backend=str(backend))
        if "backend" in kwargs:
            kwargs["backend"] = gloo(kwargs["backend"])
        elif args:
            args = (gloo(args[0]), *args[1:])
        kwargs.pop("device_id", None)
        return init(*args, **kwargs)

    def new_group(*args: Any, **kwargs: Any) -> Any:
        backend = kwargs.get("backend", args[1] if len(args) > 1 else None)
        ranks = kwargs.get("ranks", args[0] if args else None)
        log("group", scope="new", backend=str(backend), ranks=list(ranks or []))
        if "backend" in kwargs:
            kwargs["backend"] = gloo(kwargs["backend"])
        elif len(args) > 1:
            args = (args[0], gloo(args[1]), *args[2:])
        return new(*args, **kwargs)

    class _NcclOptions:
        def __init__(self) -> None:
            self._timeout = None

    made: list[Any] = []  # the gloo groups made in NCCL's place (kept: ids stay theirs)

    class _Nccl(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return any(obj is g for g in made)

    class ProcessGroupNCCL(metaclass=_Nccl):  # a group built directly on NCCL: gloo, logged
        Options = _NcclOptions

        def __new__(cls, store: Any, rank: int, size: int, options: Any = None) -> Any:
            log("group", scope="direct", backend="nccl", rank=rank, size=size)
            timeout = getattr(options, "_timeout", None)
            args = (store, rank, size) + ((timeout,) if timeout is not None else ())
            made.append(dist.ProcessGroupGloo(*args))
            return made[-1]

    dist.ProcessGroupNCCL = ProcessGroupNCCL

    for mod in (dist, c10d):
        mod.init_process_group = init_process_group
        mod.new_group = new_group
    c10d.is_nccl_available = lambda: True
    dist.is_nccl_available = lambda: True


def _patch_rpc() -> None:
    import torch.distributed.rpc as rpc
    import torch.distributed.rpc.api as api
    import torch.distributed.rpc.internal as internal
    from torch.distributed.rpc import TensorPipeRpcBackendOptions

    maps: dict[str, dict[str, str]] = {}
    me: list[str] = []

    class Options(TensorPipeRpcBackendOptions):
        def __init__(self, *args: Any, device_maps: Any = None, devices: Any = None, **kw: Any):
            super().__init__(*args, **kw)
            for peer, m in (device_maps or {}).items():
                self.set_device_map(peer, m)
            for d in devices or ():
                _check_device(d)

        def set_device_map(self, to: str, device_map: dict) -> None:
            pairs = {}
            for own, peer in device_map.items():
                pairs[_check_device(own)] = _check_device(peer)
            maps.setdefault(to, {}).update(pairs)
            log("device_map", to=to, map=pairs)

        def set_devices(self, devices: list) -> None:
            for d in devices:
                _check_device(d)

    rpc.TensorPipeRpcBackendOptions = Options
    rpc.backend_registry.TensorPipeRpcBackendOptions = Options  # type: ignore[attr-defined]

    real_init_rpc = rpc.init_rpc

    def init_rpc(name: str, *args: Any, **kwargs: Any) -> Any:
        me[:] = [name]
        out = real_init_rpc(name, *args, **kwargs)
        _check_world(maps, name)
        return out

    rpc.init_rpc = init_rpc

    pickler = internal._internal_rpc_pickler
    serialize, deserialize = pickler.serialize, pickler.deserialize

    def stamped_serialize(obj: Any) -> Any:
        """The payload with each tensor's device as its receiver will see it: a request's
        through the sender's map to its callee (refused where the map has no entry, as
        TensorPipe refuses it); a reply's as it is (its caller inverts its own map)."""
        import pickle

        payload, tensors = serialize(obj)
        tags = [tag_of(t) for t in tensors]
        sender = me[0] if me else ""
        to = getattr(_state, "dest", None)
        if to is not None:
            for i, tag in enumerate(tags):
                if tag in (None, "cpu"):
                    continue
                if tag not in maps.get(to, {}):
                    raise VirtualDeviceError(
                        f"{sender} sends a tensor on {tag} to {to} with no device map for "
                        "it: TensorPipe sends only CPU tensors without one"
                    )
                tags[i] = maps[to][tag]
        return pickle.dumps((b"vgpu", sender, to is not None, tags, payload)), tensors

    def stamped_deserialize(binary: bytes, tensors: Any) -> Any:
        import pickle

        try:
            mark, sender, request, tags, payload = pickle.loads(binary)
        except Exception:  # noqa: BLE001 (not one of ours)
            return deserialize(binary, tensors)
        if mark != b"vgpu":
            return deserialize(binary, tensors)
        inverse = {peer: own for own, peer in maps.get(sender, {}).items()}
        for t, tag in zip(tensors, tags, strict=False):
            if tag in (None, "cpu") or request:
                _set_tag(t, tag or "cpu")
            elif tag in inverse:
                _set_tag(t, inverse[tag])
            else:
                raise VirtualDeviceError(
                    f"{sender} replied with a tensor on {tag} to {me[0] if me else '?'}, "
                    "which has no device map to it: TensorPipe sends only CPU tensors "
                    "without one"
                )
        return deserialize(payload, tensors)

    invoke = api._invoke_rpc

    def invoke_rpc(to: Any, *args: Any, **kwargs: Any) -> Any:
        _state.dest = getattr(to, "name", to)
        try:
            return invoke(to, *args, **kwargs)
        finally:
            _state.dest = None

    api._invoke_rpc = invoke_rpc
    pickler.serialize = stamped_serialize
    pickler.deserialize = stamped_deserialize

    run_function = internal._run_function

    def run_in_mode(python_udf: Any) -> Any:  # RPC's own threads run calls here
        with _enter():
            return run_function(python_udf)

    internal._run_function = run_in_mode


def _check_device(device: Any) -> str:
    v = _virtual(device)
    if v is None or v == "cpu":
        raise VirtualDeviceError(f"a device map names {device!r}, not a virtual GPU")
    return v


def _check_world(maps: dict[str, dict[str, str]], name: str) -> None:
    """Log who this process is in the RPC world; refuse device maps to workers it lacks."""
    import torch.distributed.rpc as rpc

    try:
        known = {w.name for w in rpc.api._get_current_rpc_agent().get_worker_infos()}
    except Exception:  # noqa: BLE001 (a world whose agent lists no one)
        known = set()
    unknown = sorted(set(maps) - known) if known else []
    log("world", name=name, known=sorted(known), unknown=unknown)
    if unknown:
        raise VirtualDeviceError(
            f"{name}'s device maps name {', '.join(unknown)}, which the RPC world "
            f"({', '.join(sorted(known))}) does not know"
        )


# ------------------------------------------------------------------------ host memory
# Every tensor lives on the CPU here, so a process's resident memory is its host memory and
# its virtual devices' memory together. With DIGEN_VIRTUAL_MEMORY=seconds a thread of each
# process samples both: resident memory from /proc, device memory as the live storages that a
# tensor tagged with a virtual GPU has used (each once, at its size now: FSDP frees unsharded
# weights by resizing their storage to nothing). What is left is host memory; its peak goes
# to the log as ``host_memory`` rows.

_sampling: list[float] = []
_device_storages: dict[int, StorageWeakRef] = {}  # a weak reference, which a swap allows
_storages_lock = threading.Lock()


def _on_device(t: torch.Tensor) -> None:
    with torch._C.DisableTorchFunction():
        try:  # a DTensor's memory is its shard's
            ref = StorageWeakRef(getattr(t, "_local_tensor", t).untyped_storage())
        except (RuntimeError, NotImplementedError, TypeError):
            return
    with _storages_lock:
        _device_storages.setdefault(ref.cdata, ref)


def device_bytes() -> int:
    """Bytes of the live storages that tensors on this process's virtual GPUs have used."""
    total = 0
    with _storages_lock:
        for key, ref in list(_device_storages.items()):
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if storage is None:
                del _device_storages[key]
            else:
                total += storage.nbytes()
    return total


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sample_memory(every: float) -> None:
    """Sample until the process ends; log the peaks whenever one has grown by 4 MB since
    the last row. Resident memory is read before and after the device sum and the smaller
    taken, so a device tensor freed meanwhile does not count as host memory."""
    peak = {"host": 0, "resident": 0, "device": 0, "device_peak": 0}
    logged = dict(peak)
    while True:
        before = _resident_bytes()
        device = device_bytes()
        resident = min(before, _resident_bytes())
        if resident - device > peak["host"]:
            peak.update(host=resident - device, resident=resident, device=device)
        peak["device_peak"] = max(peak["device_peak"], device)
        if any(peak[k] > logged[k] + (4 << 20) for k in ("host", "device_peak")):
            log("host_memory", **{f"{k}_bytes": v for k, v in peak.items()})
            logged = dict(peak)
        time.sleep(every)


def _start_sampler() -> None:
    threading.Thread(target=_sample_memory, args=(_sampling[0],), daemon=True).start()


# ------------------------------------------------------------------------------ install


def _patch_threads() -> None:
    run = threading.Thread.run

    def run_in_mode(self: threading.Thread) -> None:
        with _enter():
            run(self)

    threading.Thread.run = run_in_mode


@contextlib.contextmanager
def _enter() -> Iterator[None]:
    if getattr(_state, "on", False):
        yield
        return
    _state.on = True
    try:
        with VirtualCuda():
            yield
    finally:
        _state.on = False


def _patch_parameters() -> None:
    """``nn.Parameter(t)`` is a new tensor object over ``t``'s memory: it keeps ``t``'s device."""
    new = torch.nn.Parameter.__new__

    def parameter(cls: type, data: Any = None, requires_grad: bool = True) -> Any:
        p = new(cls, data, requires_grad)
        _set_tag(p, tag_of(data))
        return p

    torch.nn.Parameter.__new__ = parameter  # type: ignore[method-assign]


def install() -> None:
    """Virtual GPUs in this process (module docstring); idempotent."""
    if _installed or _count() < 1:
        return
    host = os.environ.get(HOST_ENV)
    if host is None and "GROUP_RANK" in os.environ and "TORCHELASTIC_RUN_ID" in os.environ:
        host = f"vhost-{os.environ['GROUP_RANK']}"
    if host:
        socket.gethostname = lambda: host  # type: ignore[assignment]
    _patch_cuda()
    _patch_distributed()
    _patch_rpc()
    _patch_threads()
    _patch_parameters()
    mode = VirtualCuda()
    mode.__enter__()
    _state.on = True
    _installed.append(mode)
    if os.environ.get(MEMORY_ENV):
        _sampling.append(float(os.environ[MEMORY_ENV]))
        _start_sampler()
        os.register_at_fork(after_in_child=_start_sampler)  # a worker forked from a server
