"""LoRA adapters (peft) on a backbone's transformer, and full fine-tuning.

Single-device code: sharding and data parallelism wrap this from :mod:`digen.runtime`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from digen.models.weights import meta_stand_ins, torch_dtype

__all__ = ["adapters_disabled", "apply_lora", "enable_full_finetune", "trainable_parameters"]

_LORA_LAYERS = (
    torch.nn.Linear,
    torch.nn.Conv1d,
    torch.nn.Conv2d,
    torch.nn.Conv3d,
    torch.nn.Embedding,
)


def apply_lora(
    transformer: torch.nn.Module,
    *,
    rank: int,
    alpha: float,
    targets: Sequence[str],
    init: str | bool = "gaussian",
    dtype: str | None = None,
) -> list[torch.nn.Parameter]:
    """Attach a LoRA adapter to ``targets``; only its parameters train. Returns them.

    The B matrices start at zero, so the adapted model equals the base model until trained.
    ``dtype`` (``float32``, ``bfloat16``, ...) casts the LoRA weights, e.g. fp32 LoRA on a
    bf16 backbone for a stabler update.

    On a transformer whose weights are not loaded yet (on the meta device: a sharded trainer's
    before it reads its shards) the adapter is made on the CPU, with the values it would have
    beside loaded weights.
    """
    from peft import LoraConfig

    _check_targets(transformer, targets)
    transformer.requires_grad_(False)
    init_value: str | bool = {"true": True, "false": False}.get(str(init).lower(), init)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=init_value
    )
    with meta_stand_ins(transformer):
        transformer.add_adapter(config)
    params = [p for n, p in transformer.named_parameters() if "lora_" in n]
    if not params:
        raise ValueError(f"LoRA targets {list(targets)} matched no module of the transformer")
    for p in params:
        p.requires_grad_(True)
        if dtype is not None:
            p.data = p.data.to(torch_dtype(dtype))
    return params


def _check_targets(transformer: torch.nn.Module, targets: Sequence[str]) -> None:
    """Refuse LoRA targets that name no layer of ``transformer``, naming what is there.

    A target matches as peft matches a plain name: a layer whose dotted name is it or ends
    with ``.<target>``; the layer must be one LoRA can wrap (linear, convolution, embedding).
    """
    from digen.errors import DigenError

    layers = [n for n, m in transformer.named_modules() if isinstance(m, _LORA_LAYERS)]
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in layers)]
    if not missing:
        return
    leaves = sorted({n.rsplit(".", 1)[-1] for n in layers} - {str(i) for i in range(100)})
    raise DigenError(
        f"train.lora_targets {missing} name no layer of the {type(transformer).__name__}; "
        f"its layers are called: {', '.join(leaves[:24])}."
    )


def enable_full_finetune(transformer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Make every transformer parameter trainable (no LoRA). Returns them."""
    transformer.requires_grad_(True)
    return list(transformer.parameters())


def trainable_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """``(name, parameter)`` of everything that trains, in a stable order."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad]


@contextlib.contextmanager
def adapters_disabled(transformer: torch.nn.Module) -> Iterator[None]:
    """Run the base model (the KL reference) with LoRA switched off, then switch it back."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()
