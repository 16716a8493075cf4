"""Checkpoints: what a run needs to continue exactly where it stopped.

A checkpoint is a directory ``<out>/checkpoints/step-NNNNNN`` (``NNNNNN``: the train steps
completed) holding

- ``weights.safetensors``: the trained tensors (the LoRA weights, or every weight);
- ``optimizer.pt``: the AdamW state (tensors and numbers only: it loads with
  ``weights_only=True``);
- or, from sharded (FSDP / HSDP) trainers, ``sharded/``: one safetensors file per trainer
  holding its shards of the trained weights and of their AdamW state, written by every
  trainer at once through ``torch.distributed.checkpoint`` (its safetensors storage; each
  file's header says where its pieces sit in the whole tensors). No trainer gathers the
  model, and any trainer count, sharded or not, loads them (each reads only the pieces
  its own shards need). Both layouts load into either kind of trainer;
- ``state.json``: the step and policy version to continue from, and what the weights belong
  to (model, algorithm, LoRA shape), so a checkpoint of another run is refused;
- ``config.yaml``: the resolved config of the run that wrote it;
- ``profiler.json`` (disaggregated runs): the online profiler's cost estimates, which the
  bubble-triggered search plans with;
- ``manifest.json``: every other file's size and SHA-256, written last.

Nothing else is state: prompts, initial noise, SDE noise and window choices are functions of
``(seed, step, ...)``, and the learning rate is a function of the step
(``train.lr_schedule``), so the step number restores them.

A checkpoint is written under a temporary name (``.tmp-step-NNNNNN``), each file and
directory flushed to disk (``fsync``), then renamed into place (:func:`publish`, which the
run's final weights go through too): a crash at any point leaves a complete one. Only the
newest ``keep_checkpoints`` stay, older ones deleted once the new one is on disk.
:func:`latest_checkpoint` takes the newest one whose manifest checks out, and says why it
skipped any other. What a crash or a full disk left unfinished is cleared at the next start
of a run in that directory (:func:`tidy_out_dir`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from digen.errors import DigenError

if TYPE_CHECKING:  # torch loads where tensors are read or written: a CLI check needs none
    import torch

__all__ = [
    "JOIN_SECRET_FILE",
    "PROFILER",
    "RUN_OUTPUTS",
    "SAFETENSORS_DTYPES",
    "SavedWeights",
    "check_out_dir",
    "new_run_dir",
    "point_latest",
    "previous_outputs",
    "Checkpoint",
    "CheckpointWriter",
    "check_identity",
    "checkpoint_identity",
    "latest_checkpoint",
    "is_sharded_checkpoint",
    "load_kept",
    "load_sharded_state",
    "load_trainer_state",
    "publish",
    "staging_for",
    "tidy_out_dir",
    "write_safetensors",
    "write_sharded_state",
    "write_trainer_state",
]

WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"
OLD_POLICY = "old_policy.safetensors"
"""The old policy's weights, where the algorithm keeps one (DiffusionNFT)."""
EVAL_EMA = "eval_ema.safetensors"
"""The moving average of the trained weights that evaluation samples with (``eval.ema``)."""
KEPT = {"old": "old policy", "ema": "moving average for evaluation"}
"""What a checkpoint may keep beside the weights (its key prefix -> what it is)."""
KEPT_FILES = {"old": OLD_POLICY, "ema": EVAL_EMA}
"""Where a whole-tensor checkpoint keeps each of :data:`KEPT`."""
SHARDED = "sharded"
"""Sharded trainers: the directory of per-trainer shard files."""
STATE = "state.json"
MANIFEST = "manifest.json"
PROFILER = "profiler.json"
"""Disaggregated runs: the online profiler's cost estimates, so BTS resumes informed."""
_PREFIX = "step-"
_STAGING = ".tmp-"
"""Prefix of a directory being written: ``.tmp-<name>`` beside ``<name>``."""
_ASIDE = ".old-"
"""Prefix of the directory a new one replaces, between the two renames of :func:`publish`."""


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A complete checkpoint on disk."""

    path: Path
    step: int
    """Train steps completed: the run continues with step ``step``."""
    version: int
    """The policy version of its weights."""
    identity: dict[str, Any]


def checkpoint_identity(cfg: Any) -> dict[str, Any]:
    """What a checkpoint's weights belong to; a resume must match it."""
    t = cfg.train
    return {
        "model": cfg.model.name,
        "algo": cfg.algo.name,
        "lora_rank": t.lora_rank,
        "lora_targets": list(t.lora_targets) if t.lora_targets else None,
    }


SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
}
"""A torch dtype's name -> its code in a safetensors header."""


def write_safetensors(
    path: str | os.PathLike,
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write ``tensors`` as a ``.safetensors`` file (the format ``safetensors`` and
    ``from_pretrained`` read), one tensor at a time: the header first, then each tensor's
    bytes straight from its memory (moved to the host one tensor at a time). The library's
    own writer first turns every tensor into bytes, which holds a second copy of all of them
    in memory: a full fine-tune's weights would need twice their size to be saved."""
    import struct

    import torch

    header: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        kind = SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if kind is None:
            raise ValueError(f"{name}: safetensors has no dtype {t.dtype}")
        size = t.numel() * t.element_size()
        header[name] = {
            "dtype": kind,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    if metadata:
        header["__metadata__"] = dict(metadata)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for t in tensors.values():
            if t.numel():
                one = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
                f.write(one.numpy().data)
                del one


def write_trainer_state(
    directory: str | os.PathLike,
    weights: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    kept: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Write the trainer's part (weights, optimizer state, and the tensors ``kept`` beside
    them: :data:`KEPT` -> name -> tensor) into ``directory``, flushed."""
    import torch

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    files = {WEIGHTS: weights} | {KEPT_FILES[k]: v for k, v in (kept or {}).items()}
    for name, state in files.items():
        write_safetensors(directory / name, state, {"format": "pt"})
    torch.save(optimizer, directory / OPTIMIZER)
    for name in (*files, OPTIMIZER):
        _fsync(directory / name)


class SavedWeights(Mapping[str, "torch.Tensor"]):
    """``name -> tensor`` of the weights saved in a diffusers model folder (``transformer/``,
    one or several ``.safetensors`` files), limited to ``names``, read from the files when
    first asked for: a run's final full weights reach the caller from the disk, never
    through the driver's memory."""

    def __init__(self, directory: str | os.PathLike, names: Sequence[str]) -> None:
        self.directory = Path(directory)
        self.names = list(names)
        self._tensors: dict[str, torch.Tensor] | None = None

    def _load(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            from safetensors.torch import load_file

            wanted, found = set(self.names), {}
            for path in sorted(self.directory.glob("*.safetensors")):
                found |= {k: v for k, v in load_file(str(path)).items() if k in wanted}
            missing = wanted - set(found)
            if missing:
                raise KeyError(f"{self.directory} holds no {sorted(missing)[:3]}")
            self._tensors = {n: found[n] for n in self.names}
        return self._tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_kept(directory: str | os.PathLike, prefix: str) -> dict[str, torch.Tensor]:
    """One of :data:`KEPT` (``old``, ``ema``) from a whole-tensor checkpoint, by name;
    a clear error where the checkpoint holds none (a run without it wrote it)."""
    from safetensors.torch import load_file

    path = Path(directory) / KEPT_FILES[prefix]
    if not path.exists():
        raise ValueError(
            f"the checkpoint in {directory} holds no {KEPT[prefix]}, which this run keeps; "
            "it was written by a run without one"
        )
    return load_file(str(path))


def load_trainer_state(
    directory: str | os.PathLike,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(weights, optimizer state)`` of a checkpoint (safe loaders only)."""
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    weights = load_file(str(directory / WEIGHTS))
    optimizer = torch.load(directory / OPTIMIZER, map_location="cpu", weights_only=True)
    return weights, optimizer


_W, _OPT, _SEP = "weights", "optimizer", "::"


def _flat_sharded(
    model: torch.nn.Module,
    optimizer: Any,
    names: list[str],
    kept: dict[str, dict[str, torch.Tensor]] | None = None,
):
    """This member's trained weights, their AdamW state and the tensors ``kept`` beside them
    (:data:`KEPT` -> name -> tensor) as one flat ``key -> tensor`` dict (DTensors where
    sharded), and the optimizer state dict it came from."""
    import torch
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=False)
    weights = get_model_state_dict(model, options=options)
    osd = get_optimizer_state_dict(model, optimizer, options=options)  # made if still empty
    flat = {f"{_W}{_SEP}{n}": weights[n] for n in names}
    for prefix, tensors in (kept or {}).items():
        flat |= {f"{prefix}{_SEP}{n}": t for n, t in tensors.items()}
    for fqn, state in osd["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                flat[f"{_OPT}{_SEP}{fqn}{_SEP}{key}"] = value
    return flat, osd


def _streaming_writer(path: Path) -> Any:
    """``torch.distributed.checkpoint``'s safetensors writer (one file per member), writing
    each file a tensor at a time with :func:`write_safetensors`. Its own writer moves every
    tensor of the file to the host and then serialises them all into one buffer: two host
    copies of the member's weights, optimizer state and kept tensors at once, where this
    holds one tensor. The files are the same: its reader reads them."""
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._hf_utils import (
        CUSTOM_METADATA_KEY,
        DCP_VERSION_KEY,
        FORMAT_KEY,
        FORMAT_VALUE,
        HF_DCP_VERSION,
        _gen_file_name,
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    class Writer(HuggingFaceStorageWriter):
        def write_data(self, plan: Any, planner: Any) -> Future:
            storage = plan.storage_data or {}
            index = storage.get("fqn_to_index_mapping")
            buckets = self._split_by_storage_plan(index, plan.items)
            last = max(index.values()) if index is not None else 1
            results: list[Any] = []
            for number, items in buckets.items():
                name = _gen_file_name(number, last, storage.get("shard_index"))
                tensors: dict[str, torch.Tensor] = {}
                offsets: dict[str, Any] = {}
                for item in items:
                    if item.type == WriteItemType.BYTE_IO:
                        raise ValueError(
                            f"{item.index.fqn}: a sharded checkpoint holds tensors only"
                        )
                    t = planner.resolve_data(item)  # this member's piece, where it lives
                    tensors[item.index.fqn] = t
                    offsets[item.index.fqn] = {
                        "saved_offsets": list(item.tensor_data.chunk.offsets)
                    }
                    size = t.numel() * t.element_size()
                    info = _StorageInfo(name, 0, size, transform_descriptors=None)
                    results.append(
                        WriteResult(index=item.index, size_in_bytes=size, storage_data=info)
                    )
                meta = {
                    CUSTOM_METADATA_KEY: json.dumps(offsets),
                    DCP_VERSION_KEY: str(HF_DCP_VERSION),
                    FORMAT_KEY: FORMAT_VALUE,
                }
                write_safetensors(Path(self.path) / name, tensors, meta)
            done: Future = Future()
            done.set_result(results)
            return done

    return Writer(str(path), save_distributed=True)


def write_sharded_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    names: list[str],
    kept: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Every sharded member calls this at once: each writes its own shards of the tensors
    ``names`` of ``model``, of their optimizer state and of the tensors ``kept`` beside
    them (the old policy, the moving average: :data:`KEPT`) into ``directory/sharded``."""
    import torch.distributed.checkpoint as dcp

    flat, _ = _flat_sharded(model, optimizer, names, kept)
    path = Path(directory) / SHARDED
    dcp.save(flat, storage_writer=_streaming_writer(path))
    for f in path.iterdir():  # every member's file is written once save returns
        _fsync(f)
    _fsync_dir(path)


def load_sharded_state(
    directory: str | os.PathLike,
    model: torch.nn.Module,
    optimizer: Any,
    names: list[str],
    *,
    sharded: bool,
    kept: dict[str, dict[str, torch.Tensor]] | None = None,
) -> None:
    """Load a ``sharded/`` checkpoint into ``model`` and ``optimizer`` (None: weights only)
    and, in place, the tensors ``kept`` beside them (:func:`write_sharded_state`): sharded members all call
    at once and read the pieces of their shards; an unsharded model (``sharded`` False)
    reads the whole tensors on its own."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    flat, osd = _flat_sharded(model, optimizer, names, kept)
    if optimizer is None:
        flat = {k: v for k, v in flat.items() if not k.startswith(_OPT + _SEP)}
    reader = HuggingFaceStorageReader(str(Path(directory) / SHARDED))
    held = reader.read_metadata().state_dict_metadata
    for prefix in kept or {}:
        if not any(k.startswith(prefix + _SEP) for k in held):
            raise ValueError(
                f"the checkpoint in {directory} holds no {KEPT[prefix]}, which this run "
                "keeps; it was written by a run without one"
            )
    with warnings.catch_warnings():  # alone is what no_dist says; no need to warn of it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(flat, storage_reader=reader, no_dist=not sharded)
    weights = {}
    for key, value in flat.items():
        parts = key.split(_SEP)
        if parts[0] == _W:
            weights[parts[1]] = value
        elif parts[0] in KEPT:
            target = (kept or {})[parts[0]][parts[1]]
            if value is not target:  # loaded in place unless it had to be replaced
                with torch.no_grad():
                    target.copy_(value)
        else:
            osd["state"][parts[1]][parts[2]] = value
    options = StateDictOptions(full_state_dict=False, strict=False)
    set_model_state_dict(model, weights, options=options)
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, osd, options=options)


def is_sharded_checkpoint(directory: str | os.PathLike) -> bool:
    return (Path(directory) / SHARDED).is_dir()


class CheckpointWriter:
    """Writes a run's checkpoints into ``<out>/checkpoints`` and keeps the newest ``keep``."""

    def __init__(self, out_dir: str | os.PathLike, keep: int) -> None:
        self.root = Path(out_dir) / "checkpoints"
        self.keep = keep

    def _final(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:06d}"

    def staging(self, step: int) -> Path:
        """Where the checkpoint after ``step`` completed steps is written before it is
        complete (every worker that writes a part knows it)."""
        return _staged(self._final(step))

    def begin(self, step: int) -> Path:
        """A fresh temporary directory for the checkpoint after ``step`` completed steps;
        the trainers write their part there (:func:`write_trainer_state` or
        :func:`write_sharded_state`), then :meth:`finish`."""
        return staging_for(self._final(step))

    def finish(
        self, tmp: Path, step: int, version: int, identity: dict[str, Any], config_yaml: str
    ) -> Path:
        """Add the run's state, config and manifest to ``tmp`` and move it into place
        (:func:`publish`: a checkpoint of the same step is replaced, never first deleted);
        then the checkpoints beyond the newest ``keep`` go. Should this fail (a full disk),
        ``tmp`` is removed and the checkpoints on disk are as they were."""
        try:
            state = {"step": step, "version": version, "identity": identity}
            _write_synced(tmp / STATE, json.dumps(state, indent=1) + "\n")
            _write_synced(tmp / "config.yaml", config_yaml)
            files = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file())
            manifest = {
                "step": step,
                "files": {
                    n: {"bytes": (tmp / n).stat().st_size, "sha256": _sha256(tmp / n)}
                    for n in files
                },
            }
            _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
            final = publish(tmp, self._final(step))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def _prune(self) -> None:
        for old in _step_dirs(self.root)[self.keep :]:
            shutil.rmtree(old, ignore_errors=True)


def staging_for(final: str | os.PathLike) -> Path:
    """A fresh, empty directory beside ``final`` (``.tmp-<name>``) to write it in, before
    :func:`publish` moves it into place."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _staged(final)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def publish(tmp: str | os.PathLike, final: str | os.PathLike) -> Path:
    """Move the finished directory ``tmp`` to ``final`` so that a crash at any point leaves
    a complete one on disk.

    Every file and directory of ``tmp`` is flushed (``fsync``); a ``final`` already there
    is renamed aside (``.old-<name>``), ``tmp`` renamed into its place and the parent
    directory flushed; only then is the old one deleted. Should the second rename fail, the
    old one is put back at once; should the process die between the two, the next start of
    a run puts it back (:func:`tidy_out_dir`).
    """
    tmp, final = Path(tmp), Path(final)
    _fsync_tree(tmp)
    _settle(final)  # an old one an earlier crash left aside: back in place first
    old = _aside(final)
    if final.exists():
        os.replace(final, old)
    try:
        os.replace(tmp, final)
    except BaseException:
        if old.exists() and not final.exists():
            with contextlib.suppress(OSError):  # else the next start puts it back
                os.replace(old, final)
        raise
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)
    return final


def tidy_out_dir(out_dir: str | os.PathLike) -> None:
    """Clear what a crash or a full disk left unfinished in a run's directory: a directory
    :func:`publish` had moved aside with nothing in its place goes back (else it is
    deleted), and every temporary one (``.tmp-*``: a checkpoint, the final weights) is
    deleted. Nothing complete is touched."""
    out = Path(out_dir)
    finals = [out / name for name in RUN_OUTPUTS]
    root = out / "checkpoints"
    if root.is_dir():
        for p in root.iterdir():
            for prefix in (_STAGING, _ASIDE):
                if p.name.startswith(prefix + _PREFIX):
                    finals.append(root / p.name.removeprefix(prefix))
    for final in finals:
        _settle(final)
        shutil.rmtree(_staged(final), ignore_errors=True)


def latest_checkpoint(
    out_dir: str | os.PathLike,
    warn: Callable[[str], None] | None = None,
    *,
    checksums: bool = True,
) -> Checkpoint | None:
    """The newest complete, intact checkpoint of the run in ``out_dir``, or None.

    A checkpoint whose files do not match its manifest (a truncated or altered file) is
    skipped, and ``warn`` is told which and why. ``checksums=False`` compares sizes only
    (a quick answer for a message; a resume reads every byte).
    """
    for path in _step_dirs(Path(out_dir) / "checkpoints"):
        problem = _verify(path, checksums)
        if problem is None:
            state = json.loads((path / STATE).read_text())
            return Checkpoint(path, int(state["step"]), int(state["version"]), state["identity"])
        if warn is not None:
            warn(f"checkpoint {path.name} is unusable ({problem}); trying an older one")
    return None


JOIN_SECRET_FILE = "join-secret"
"""Where in ``out_dir`` a run that takes joining generators writes the join secret it made."""

RUN_OUTPUTS = (
    "metrics.jsonl",
    "eval.jsonl",
    "checkpoints",
    "samples",
    "lora",
    "transformer",
    "trace.json",
    "trace.jsonl",
    "profile.json",
    "plan.json",
    "timeline.png",
    "trainer.log",
    "tensorboard",
    "wandb",
    JOIN_SECRET_FILE,
)
"""What a run writes into its ``out_dir``: any of them there means an earlier run, and
``--overwrite`` removes exactly these."""


RUNS = Path("runs")
"""Where ``digen run`` puts a run that names no ``--out``: a folder per run, named by its
start time, and ``runs/latest`` a link to the newest."""
LATEST = "latest"


def new_run_dir(root: Path = RUNS, now: float | None = None) -> Path:
    """A folder name under ``root`` for a new run, from its start time in local time
    (``2026-12-05_13-02-11``; ``-2``, ``-3``, ... after it when that one is taken). Creates
    nothing."""
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S", time.localtime(now))
    path, n = root / stamp, 1
    while path.exists() or path.is_symlink():
        n += 1
        path = root / f"{stamp}-{n}"
    return path


def point_latest(run_dir: Path) -> str | None:
    """Create ``run_dir`` and make ``latest`` beside it a link to it (relative, swapped in
    whole), so ``runs/latest`` is always the newest run. Returns a note instead when
    ``latest`` there is a folder, not a link (a run of an earlier digen): it is left as it
    is."""
    run_dir.mkdir(parents=True, exist_ok=True)
    latest = run_dir.parent / LATEST
    if latest.exists() and not latest.is_symlink():
        return f"{latest} is a folder, not a link, so it keeps its run; this run is in {run_dir}"
    staged = run_dir.parent / f".{LATEST}-{os.getpid()}"
    staged.unlink(missing_ok=True)
    staged.symlink_to(run_dir.name, target_is_directory=True)
    os.replace(staged, latest)
    return None


def previous_outputs(out_dir: str | os.PathLike) -> list[str]:
    """The names of :data:`RUN_OUTPUTS` an earlier run left in ``out_dir``."""
    return [name for name in RUN_OUTPUTS if (Path(out_dir) / name).exists()]


def check_out_dir(
    out_dir: str | os.PathLike,
    cfg: Any,
    *,
    resume: bool,
    overwrite: bool,
    warn: Callable[[str], None] | None = None,
    checksums: bool = True,
) -> Checkpoint | None:
    """Whether a run of ``cfg`` may write into ``out_dir``: the checkpoint it resumes from
    (``resume``), or None for a new run; one sentence (:class:`DigenError`) where it may
    not. Imports nothing heavy, so a command line is answered before torch loads
    (``checksums=False``: sizes only, for that quick answer), and deletes nothing but what
    an earlier run left unfinished (:func:`tidy_out_dir`), where this run may go ahead.

    A new run may replace, without ``overwrite``, what a run that trained no step left (it
    failed to start: ``warn`` says so); ``--resume`` is advised only where a checkpoint is."""
    out = Path(out_dir)
    if resume:
        tidy_out_dir(out)  # first: a checkpoint a crash left aside is back in place
        ckpt = latest_checkpoint(out, warn, checksums=checksums)
        if ckpt is None:
            raise DigenError(f"there is no complete checkpoint in '{out}' to resume from.")
        check_identity(ckpt, cfg)
        if ckpt.step >= cfg.steps:
            raise DigenError(
                f"the run in '{out}' has already trained {ckpt.step} steps; give a larger "
                "--steps (the total) to train more."
            )
        return ckpt
    previous = previous_outputs(out)
    if previous and not overwrite:  # what it says touches nothing
        root = out / "checkpoints"
        aside = root.is_dir() and any(p.name.startswith(_ASIDE) for p in root.iterdir())
        if aside or latest_checkpoint(out, checksums=False) is not None:
            raise DigenError(
                f"'{out}' holds a previous run ({', '.join(previous)}); continue it with "
                f"--resume {out}, replace it with --overwrite, or choose another --out."
            )
        if _trained_something(out):
            raise DigenError(
                f"'{out}' holds a previous run ({', '.join(previous)}) with no checkpoint to "
                "resume from; replace it with --overwrite, or choose another --out."
            )
        if warn is not None:  # it stopped before its first step: nothing of it to keep
            warn(f"replacing what a run that trained no step left in '{out}'")
    tidy_out_dir(out)
    return None


def _trained_something(out: Path) -> bool:
    """Whether the run in ``out`` left a result: a step's or an evaluation's row, or final
    weights (a run that failed to start leaves only its log, config and trace)."""
    rows = [out / "metrics.jsonl", out / "eval.jsonl"]
    return any(f.is_file() and f.stat().st_size > 0 for f in rows) or any(
        (out / name).exists() for name in ("lora", "transformer")
    )


def check_identity(ckpt: Checkpoint, cfg: Any) -> None:
    """Refuse to resume ``cfg`` from a checkpoint of other weights, in one sentence."""
    want = checkpoint_identity(cfg)
    for key, value in ckpt.identity.items():
        if want.get(key) != value:
            raise DigenError(
                f"checkpoint {ckpt.path} was written with {key} = {value!r}, but this run "
                f"has {key} = {want.get(key)!r}; resume it with the settings it was made with."
            )


def _verify(path: Path, checksums: bool = True) -> str | None:
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable manifest"
    for name, entry in manifest.get("files", {}).items():
        f = path / name
        if not f.is_file():
            return f"{name} is missing"
        if f.stat().st_size != entry["bytes"]:
            return f"{name} has {f.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if checksums and _sha256(f) != entry["sha256"]:
            return f"{name} does not match its checksum"
    listed = manifest.get("files", {})
    sharded = any(name.startswith(SHARDED + "/") for name in listed)
    for name in (STATE,) if sharded else (WEIGHTS, OPTIMIZER, STATE):
        if name not in listed:
            return f"the manifest lists no {name}"
    return None


def _step_dirs(root: Path) -> list[Path]:
    """Checkpoint directories, newest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)]
    return sorted(found, key=lambda p: p.name, reverse=True)


def _staged(final: Path) -> Path:
    return final.with_name(_STAGING + final.name)


def _aside(final: Path) -> Path:
    return final.with_name(_ASIDE + final.name)


def _settle(final: Path) -> None:
    """A directory :func:`publish` moved aside from ``final``: back in place where nothing
    replaced it, else deleted."""
    old = _aside(final)
    if not old.exists():
        return
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, final)
        _fsync_dir(final.parent)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _fsync(path: Path) -> None:
    with path.open("rb") as fh:
        os.fsync(fh.fileno())


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root``, ``root`` last."""
    for here, _, files in os.walk(root, topdown=False):
        for name in files:
            _fsync(Path(here) / name)
        _fsync_dir(Path(here))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
