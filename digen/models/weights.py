"""A transformer with no weights yet, and reading a saved one's tensors a few rows at a time.

A sharded trainer never holds a whole transformer: it builds one whose parameters are on the
``meta`` device (shapes and dtypes, no memory), shards it, gives each shard memory on its own
device, and reads only its own rows of each weight from the saved files
(:func:`digen.runtime.worker.fsdp.shard_and_load`). What it ends with equals what ``from_pretrained``
loads, shard for shard: the same dtypes (``_keep_in_fp32_modules`` kept in fp32) and the same
buffers.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

from digen.checkpoint import SAFETENSORS_DTYPES
from digen.config import Dtype
from digen.errors import DigenError

__all__ = ["WeightFiles", "empty_transformer", "file_key", "meta_stand_ins", "torch_dtype"]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype a config names (``model.dtype``, ``train.lora_dtype``, a pool's dtype:
    one of :class:`digen.config.Dtype`)."""
    if name not in tuple(Dtype):
        raise ValueError(f"dtype {name!r} is not one of {', '.join(Dtype)}")
    return getattr(torch, name)


def empty_transformer(path: str | Path, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer of the pipeline saved at ``path``, built from its config as diffusers'
    ``from_pretrained`` builds it (in ``dtype`` as the default dtype), with every parameter
    on the meta device. Buffers are real (a model computes some of them, and they are small);
    the ones saved with the weights take ``dtype`` as ``from_pretrained`` gives them."""
    import diffusers

    path = Path(path)
    _, class_name = json.loads((path / "model_index.json").read_text())["transformer"]
    model_cls = getattr(diffusers, class_name)
    config = model_cls.load_config(str(path / "transformer"))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else previous)
    try:
        with _parameters_on_meta():
            model = model_cls.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    keep = list(getattr(model_cls, "_keep_in_fp32_modules", None) or [])
    with WeightFiles(path / "transformer") as files:
        saved = set(files.keys())
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, p in list(module._parameters.items()):
            if p is not None and p.is_floating_point():
                want = _loaded_dtype(prefix + name, dtype, keep)
                module._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=want, device="meta"), requires_grad=p.requires_grad
                )
        for name, b in list(module._buffers.items()):
            if b is not None and b.is_floating_point() and prefix + name in saved:
                module._buffers[name] = b.to(_loaded_dtype(prefix + name, dtype, keep))
    return model.eval()


def _loaded_dtype(name: str, dtype: torch.dtype, keep: list[str]) -> torch.dtype:
    """The dtype ``from_pretrained`` gives a saved floating tensor: fp32 in a module the class
    keeps in fp32 (a name part equal to one of them), else the load's dtype."""
    return torch.float32 if any(k in name.split(".") for k in keep) else dtype


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Modules built inside have their parameters on the meta device (moved there as they are
    registered, so a layer's initialisation runs on no data); buffers stay where made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = type(param)(
                param.to("meta"), requires_grad=param.requires_grad
            )

    torch.nn.Module.register_parameter = on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register  # type: ignore[method-assign]


@contextlib.contextmanager
def meta_stand_ins(module: torch.nn.Module) -> Iterator[None]:
    """Inside, every meta parameter of ``module`` is a CPU tensor of its shape that holds one
    element (all its strides zero); after, the meta parameter is back (with the stand-in's
    ``requires_grad``). Code that looks at where a weight lives, as peft does to place a LoRA
    adapter beside its layer, then works on the CPU as it would with the real weights."""
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    for owner in module.modules():
        for name, p in list(owner._parameters.items()):
            if p is not None and p.is_meta:
                stand_in = torch.zeros((), dtype=p.dtype).expand(p.shape)
                owner._parameters[name] = torch.nn.Parameter(stand_in, requires_grad=False)
                swapped.append((owner, name, p))
    try:
        yield
    finally:
        for owner, name, p in swapped:
            p.requires_grad_(owner._parameters[name].requires_grad)
            owner._parameters[name] = p


def file_key(name: str) -> str:
    """The saved name of a parameter: peft's LoRA wrapper puts a layer's own weights under
    ``base_layer``."""
    return name.replace(".base_layer.", ".")


_FILE_DTYPES = {code: getattr(torch, name) for name, code in SAFETENSORS_DTYPES.items()}
"""A safetensors header's dtype code -> the torch dtype."""


class WeightFiles:
    """The safetensors of one saved diffusers model (one file or an index of several), read a
    tensor's rows at a time: only those rows' bytes are read, with plain reads rather than a
    memory map, so a member's resident memory holds its rows and nothing of the rest."""

    def __init__(self, directory: str | Path) -> None:
        from diffusers.utils.constants import SAFE_WEIGHTS_INDEX_NAME, SAFETENSORS_WEIGHTS_NAME

        self.directory = Path(directory)
        index = self.directory / SAFE_WEIGHTS_INDEX_NAME
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        elif (self.directory / SAFETENSORS_WEIGHTS_NAME).is_file():
            files = [SAFETENSORS_WEIGHTS_NAME]
        else:
            raise DigenError(
                f"{self.directory} holds no {SAFETENSORS_WEIGHTS_NAME} (nor its index), so its "
                "weights cannot be read shard by shard."
            )
        self._fds: list[int] = []
        self._where: dict[str, tuple[int, dict, int]] = {}
        try:
            for name in files:
                fd = os.open(self.directory / name, os.O_RDONLY)
                self._fds.append(fd)
                (size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
                header = json.loads(os.pread(fd, size, 8))
                header.pop("__metadata__", None)
                for key, entry in header.items():
                    self._where[key] = (fd, entry, 8 + size)
        except BaseException:
            self.close()
            raise

    def keys(self) -> list[str]:
        return list(self._where)

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def rows(self, key: str, rows: slice = slice(None)) -> torch.Tensor:
        """Rows ``rows`` (a step-1 slice along the first dim) of the saved tensor ``key``, on
        the CPU in its saved dtype; the whole tensor for one without dims."""
        fd, entry, base = self._where[key]
        dtype, shape = _FILE_DTYPES[entry["dtype"]], list(entry["shape"])
        begin, end = entry["data_offsets"]
        if shape:
            lo, hi, _ = rows.indices(shape[0])
            row_bytes = (end - begin) // shape[0] if shape[0] else 0
            begin, end = begin + lo * row_bytes, begin + max(hi, lo) * row_bytes
            shape[0] = max(hi - lo, 0)
        data = bytearray(end - begin)
        view, done = memoryview(data), 0
        while done < len(data):  # pread may return less than asked
            got = os.preadv(fd, [view[done:]], base + begin + done)
            if got <= 0:
                raise DigenError(f"{self.directory}: the weights file ends inside '{key}'.")
            done += got
        if not data:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(data, dtype=dtype).reshape(shape)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> WeightFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
