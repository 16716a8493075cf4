"""Sample grids: tiles scaled up until a caption fits, captions wrapped over a few lines."""

from __future__ import annotations

from importlib import resources

import numpy as np
import pytest
import torch

from digen.run.outputs import (
    CAPTION_LINES,
    MIN_TILE_WIDTH,
    _caption_font,
    caption_lines,
    sample_grid,
)

WIDTH = MIN_TILE_WIDTH - 4  # the room a caption has in the narrowest tile
BUILTIN = [
    line.strip()
    for name in ("prompts.txt", "ocr_prompts.txt")
    for line in resources.files("digen.data").joinpath(name).read_text().splitlines()
    if line.strip()
]


@pytest.mark.parametrize("prompt", BUILTIN[::7])
def test_builtin_prompts_fit_whole(prompt: str) -> None:
    lines = caption_lines(prompt, WIDTH)
    assert " ".join(lines) == prompt  # nothing cut, nothing added
    assert len(lines) <= CAPTION_LINES
    font = _caption_font()
    assert all(font.getlength(line) <= WIDTH for line in lines)


def test_long_caption_ends_in_an_ellipsis_and_long_words_break() -> None:
    prompt = " ".join(["a tall lighthouse on a rocky coast at dusk"] * 4)
    lines = caption_lines(prompt, WIDTH)
    assert len(lines) == CAPTION_LINES and lines[-1].endswith("\u2026")
    assert prompt.startswith(" ".join(lines)[:-1])
    word = "x" * 50
    broken = caption_lines(word, WIDTH)
    assert "".join(broken) == word and len(broken) > 1
    assert caption_lines("", WIDTH) == []


def test_grid_scales_tiny_samples_and_leaves_room_for_captions() -> None:
    pixels = torch.randint(0, 256, (5, 1, 32, 32, 3), dtype=torch.uint8)
    captions = [BUILTIN[0], "short", max(BUILTIN, key=len), "b", "c"]
    grid = sample_grid(pixels, captions, cols=4)
    zoom = -(-MIN_TILE_WIDTH // 32)
    rows = max(len(caption_lines(c, 32 * zoom - 4)) for c in captions)
    assert rows >= 2
    label_h = grid.height // 2 - 32 * zoom
    assert grid.width == 4 * 32 * zoom and label_h > rows * 10
    img = np.asarray(grid)
    tile = img[label_h : label_h + 32 * zoom, : 32 * zoom]  # nearest-pixel blocks of a sample
    assert (tile == np.repeat(np.repeat(pixels[0, 0].numpy(), zoom, 0), zoom, 1)).all()
    # the longest caption (third tile) is drawn over several lines: ink in each line's band
    ink = (img[:label_h, 2 * 32 * zoom : 3 * 32 * zoom] < 128).any(axis=(1, 2))
    line_h = label_h // rows
    assert all(ink[k * line_h : (k + 1) * line_h].any() for k in range(rows))

    big = sample_grid(torch.zeros(2, 1, 48, 512, 3, dtype=torch.uint8), ["a", "b"])
    assert big.size[0] == 2 * 512  # wide samples are drawn as they are
    assert sample_grid(pixels[:2]).size == (2 * 32 * zoom, 32 * zoom)  # no captions, no band


def test_safetensors_written_a_tensor_at_a_time_read_back_as_written(tmp_path) -> None:
    """The streaming writer's files are the library's: every dtype a model holds, scalars,
    empty and non-contiguous tensors read back bit for bit with ``safetensors``, metadata
    included."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from digen.checkpoint import write_safetensors

    g = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(5, 3, generator=g),
        "half": torch.randn(4, generator=g).half(),
        "brain": torch.randn(2, 7, generator=g).bfloat16(),
        "t": torch.randn(3, 4, generator=g).T,  # not contiguous
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "ids": torch.arange(6).reshape(2, 3),
        "mask": torch.tensor([True, False, True]),
        "none": torch.zeros(0, 4),
    }
    path = tmp_path / "w.safetensors"
    write_safetensors(path, tensors, {"format": "pt"})
    back = load_file(str(path))
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_the_sharded_checkpoint_writer_writes_the_files_its_library_writes(tmp_path) -> None:
    """A sharded checkpoint's files, written a tensor at a time, have the names, tensors and
    header metadata of ``torch.distributed.checkpoint``'s own safetensors writer (which holds
    every tensor of a file twice in memory), and its reader loads them back bit for bit."""
    import json
    import struct
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

    from digen.checkpoint import _streaming_writer

    def header(path):
        raw = path.read_bytes()
        (size,) = struct.unpack("<Q", raw[:8])
        head = json.loads(raw[8 : 8 + size])
        meta = head.pop("__metadata__")
        tensors = {k: (v["dtype"], v["shape"]) for k, v in head.items()}
        return tensors, {
            k: json.loads(v) if k == "DCP_SHARDING_INFO" else v for k, v in meta.items()
        }

    g = torch.Generator().manual_seed(0)
    state = {
        "weights::proj.weight": torch.randn(6, 4, generator=g),
        "weights::norm": torch.randn(4, generator=g).bfloat16(),
        "optimizer::proj.weight::step": torch.tensor(3.0),
        "optimizer::proj.weight::exp_avg": torch.randn(6, 4, generator=g),
        "ema::proj.weight": torch.randn(6, 4, generator=g),
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        library = HuggingFaceStorageWriter(str(tmp_path / "library"), save_distributed=True)
        dcp.save(state, storage_writer=library, no_dist=True)
        dcp.save(state, storage_writer=_streaming_writer(tmp_path / "ours"), no_dist=True)
        back = {k: torch.zeros_like(v) for k, v in state.items()}
        dcp.load(
            back, storage_reader=HuggingFaceStorageReader(str(tmp_path / "ours")), no_dist=True
        )
    names = sorted(p.name for p in (tmp_path / "library").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "ours").iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            assert header(tmp_path / "ours" / name) == header(tmp_path / "library" / name)
    for key, value in state.items():
        assert back[key].dtype == value.dtype and torch.equal(back[key], value), key
