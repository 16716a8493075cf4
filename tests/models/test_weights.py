"""A transformer built without weights, filled from its saved files, against ``from_pretrained``.

A sharded trainer builds every backbone this way (:mod:`digen.models.weights`), then reads
its rows of each weight; here the whole of each weight is read, on one process, and compared
with what diffusers loads: same names, shapes, dtypes (in fp32 and bf16, with Wan keeping
some modules in fp32) and values, bit for bit, buffers included.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from digen.models import load_adapter
from digen.models.lora import apply_lora
from digen.models.weights import WeightFiles, empty_transformer, file_key
from digen.registry.models import MODEL_NAMES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_an_empty_transformer_filled_from_its_files_equals_from_pretrained(name, dtype) -> None:
    whole = load_adapter(name, dtype=dtype)
    loaded = dict(
        itertools.chain(whole.transformer.named_parameters(), whole.transformer.named_buffers())
    )
    empty = empty_transformer(whole.path, dtype)
    assert all(p.is_meta for p in empty.parameters())
    built = dict(itertools.chain(empty.named_parameters(), empty.named_buffers()))
    assert built.keys() == loaded.keys()
    read = 0
    with WeightFiles(whole.path / "transformer") as files:
        for key, t in built.items():
            want = loaded[key]
            assert (t.shape, t.dtype) == (want.shape, want.dtype), key
            if key in files:
                value, read = files.rows(key).to(t.dtype), read + 1
            else:
                value = t  # a buffer the model computes as it is built
            assert torch.equal(value, want), key
        assert read == len(files.keys())  # every saved tensor belongs to the model
    if name == "wan" and dtype == torch.bfloat16:  # its _keep_in_fp32_modules
        assert {t.dtype for t in built.values() if t.is_floating_point()} == {
            torch.float32,
            torch.bfloat16,
        }


def test_the_rows_read_are_the_rows_saved_and_only_those() -> None:
    whole = load_adapter("flux")
    with WeightFiles(whole.path / "transformer") as files:
        for key, t in whole.transformer.state_dict().items():
            if t.dim() == 0:
                continue
            n = t.shape[0]
            for rows in (slice(0, n), slice(1, n), slice(n // 2, n // 2 + 1), slice(n, n)):
                part = files.rows(key, rows)
                assert torch.equal(part, t[rows]), (key, rows)
                assert part.nbytes == t[rows].nbytes


def test_a_lora_adapter_on_an_empty_transformer_equals_one_on_the_loaded_one() -> None:
    """peft places an adapter beside its layer's weight: on a transformer without weights
    the adapter is made on the CPU with the values it gets beside loaded weights, and the
    transformer's own weights are left on the meta device."""
    whole = load_adapter("sd3")
    empty = load_adapter("sd3", transformer_device="meta").transformer
    made = []
    for transformer in (whole.transformer, empty):
        torch.manual_seed(7)
        made.append(apply_lora(transformer, rank=4, alpha=4, targets=["to_q", "to_k"]))
    assert len(made[0]) == len(made[1]) > 0
    for a, b in zip(*made, strict=True):
        assert b.device.type == "cpu" and b.requires_grad
        assert torch.equal(a, b)
    assert any(not torch.equal(p, torch.zeros_like(p)) for p in made[1])  # A is random
    base = [(n, p) for n, p in empty.named_parameters() if "lora_" not in n]
    assert base and all(p.is_meta and not p.requires_grad for _, p in base)
    with WeightFiles(whole.path / "transformer") as files:  # each is a saved weight
        assert {file_key(n) for n, _ in base} <= set(files.keys())


def test_a_transformer_to_shard_is_built_without_weights_and_the_rest_on_the_device() -> None:
    """``transformer_device="meta"``: the pipeline's other parts go to ``device`` as usual
    (meta stands in for a GPU here), the transformer's buffers stay real, on the CPU."""
    ad = load_adapter("sd3", None, device="meta", transformer_device="meta")
    assert all(p.is_meta for p in ad.transformer.parameters())
    assert all(not b.is_meta for b in ad.transformer.buffers())
    assert all(p.is_meta for p in ad.pipe.vae.parameters())
    assert ad.path is not None and (ad.path / "transformer").is_dir()
