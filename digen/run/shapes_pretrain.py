"""Pretraining of the ``shapes`` flavour: FLUX.1 or SD3.5 components at toy size taught to
draw the shapes world (:mod:`digen.shapes`) from its training captions, so RL starts from a
model that already draws scenes and has room to improve on the held-out ones.

    python -m digen.run.shapes_pretrain --out DIR --seed 0 --tokens words --width 128 \
        --mix position=3,color_attr=2 --layout ordered --text-lr 0 --t5-position-bias 16 \
        --eval-every 0 --steps 4000 --resume
    python -m digen.run.shapes_pretrain --model sd3 --out DIR --seed 0 --steps 2700

The first is the recipe of the shipped FLUX weights (``recipe.json`` beside them holds it
and their evaluation); with ``--piece-minutes`` it runs in pieces.

**Model** (``build_shapes_components`` of :class:`~digen.models.flux.FluxAdapter` or
:class:`~digen.models.sd3.SD3Adapter`): the backbone's diffusers transformer over the image
itself, averaged in 2x2 blocks (the VAE is fixed, so colours are exact and nothing but the
transformer and text encoders learns), its CLIP and T5 text encoders on digen's byte or
word tokenizer, trained together or (``text_lr=0``) kept at their seeded random init, and
the flow-matching scheduler with a fixed shift.

**Word order**: the transformer reads the text tokens as a set (FLUX gives them all one
position), so which colour goes with which shape, and which object a relation puts where,
reaches it only through the text encoders' contextual vectors. Trained from scratch on
word tokens, the encoders learn to drop that context (:func:`order_sensitivity`, logged at
every evaluation as ``text_order``, falls to 0.003: a caption and its swapped binding
encode alike), and colour attribution and position stay a coin toss: so it was with the
FLUX weights shipped before 2026-12-08. Frozen at an init whose T5 relative-position bias
is at the scale of a trained T5's (``--text-lr 0 --t5-position-bias 16``, as the shipped
FLUX weights are), the encoders keep word order and the transformer learns to read it
(docs/TRAINING.md has the figures).

**Data**: pairs made on the fly from the *training* prompts only (never a held-out one): a
category drawn uniformly first, then one of its captions (position has 3/4 of the captions
and would otherwise crowd the rest out), then a random scene for it
(:func:`~digen.shapes.scene_for`, in the recipe's ``layout``) from one seeded numpy
Generator; ``mix`` weighs the categories' draw. A fraction of captions
(``text_dropout``) is replaced by the empty prompt, the unconditional prompt digen samples
classifier-free guidance with.

**Objective**: rectified flow as FLUX in diffusers: ``x_t = (1 - sigma) x0 + sigma noise``,
target ``noise - x0`` (:meth:`~digen.models.flux.FluxAdapter.forward_velocity` is the model
call), with ``sigma`` drawn logit-normal and then shifted by the scheduler's ``shift``
(``shift * s / (1 + (shift - 1) s)``), the same map the scheduler applies to the sampling
sigmas. AdamW with warm-up and a cosine decay, gradient clipping, an exponential moving
average (EMA) of the weights; the EMA weights are what is evaluated and saved.

**Evaluation**: the saved directory loaded back with
:meth:`~digen.models.base.DiffusionAdapter.from_pretrained` and sampled with digen's own
deterministic sampler (:func:`~digen.algos.rollout.sample_rollout` with no noisy steps, as
:meth:`~digen.runtime.worker.policy.Policy.evaluate`), judged by
:func:`digen.rewards.shapes.evaluate`: strict accuracy per category on held-out and on
training captions.

**Reproducibility**: the same seed, recipe, step count and thread count give the same
weights. ``--minutes`` picks the step count from the speed of the first steps, which varies
between machines; it is written to ``recipe.json``, and ``--steps`` with that number
repeats the run exactly. At the end the run compares its weights with those the package
ships for the same backbone (:func:`compare_to_shipped`: bit-for-bit equal or the largest
difference, per component, and the shipped weights' evaluation beside its own), in the
log and in ``recipe.json`` under ``shipped``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from digen.shapes import (
    CATEGORIES,
    LAYOUTS,
    caption,
    parse,
    render,
    scene_for,
    split_prompts,
    vocabulary,
)

__all__ = [
    "Recipe",
    "TrainingPairs",
    "compare_to_shipped",
    "evaluate_model",
    "main",
    "order_sensitivity",
    "pretrain",
    "sample_sigmas",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class Recipe:
    """Everything a pretraining run depends on, besides the thread count."""

    model: str = "flux"
    """The backbone: flux or sd3 (the two with a ``build_shapes_components``)."""
    seed: int = 0
    steps: int = 0
    """Optimizer steps; 0: as many as ``minutes`` allow (measured on the first steps)."""
    minutes: float = 20.0
    """Wall-clock budget for training when ``steps`` is 0 (evaluation not counted)."""
    batch: int = 32
    lr: float = 2e-3
    warmup: int = 200
    """Steps of linear warm-up; then a cosine decay to ``lr_final`` times ``lr``."""
    lr_final: float = 0.1
    weight_decay: float = 0.01
    ema: float = 0.999
    """EMA decay (with the usual ``(1 + n) / (10 + n)`` ramp early on)."""
    text_dropout: float = 0.1
    text_lr: float = 1.0
    """The text encoders' learning rate, as a fraction of ``lr``; 0 keeps them at their
    random init. Trained from scratch at the full rate, they learn to ignore word order (a
    caption and its swapped binding encode alike), which makes colour attribution and
    position a coin toss; frozen they keep the order their init gives them (at a tenth of the
    rate they lose it too)."""
    t5_position_bias: float = 1.0
    """Multiplies the T5 encoder's relative-position bias at init (std ``0.125 x`` this at
    ``text_width`` 64). At 1 a random T5 barely tells word orders apart; 16 (std 2, the
    scale a trained T5's biases have) makes it encode which word follows which."""
    logit_mean: float = 0.0
    logit_std: float = 1.0
    shift: float = 1.0
    """The scheduler's fixed shift: training sigmas and sampling sigmas both pass through it."""
    width: int = 96
    heads: int = 4
    double_layers: int = 2
    """flux: double-stream blocks."""
    single_layers: int = 4
    """flux: single-stream blocks."""
    layers: int = 4
    """sd3: joint blocks."""
    text_width: int = 64
    tokens: str = "bytes"
    """The text encoders' tokens: ``bytes`` (any text; 50 tokens hold a caption) or
    ``words`` (the world's vocabulary, :func:`~digen.shapes.vocabulary`, one token a word;
    16 tokens)."""
    downsample: int = 2
    """The VAE's down-sampling (1 or 2): the model works on 32 x 32 or 16 x 16 latents (64
    tokens rather than 256: about 2.8x more steps in the same time, which matters more than
    the 2 px steps the images are then drawn in)."""
    balanced: bool = True
    """Draw a category first, then a caption (else captions uniformly)."""
    mix: str = ""
    """With ``balanced``: how often each category is drawn, relative to the others, as
    ``position=3,color_attr=2`` (categories not named: 1); empty: all alike."""
    layout: str = "free"
    """Where the two objects of a two-object caption go (:func:`~digen.shapes.scene_for`):
    ``free`` (anywhere the caption allows) or ``ordered`` (in the halves the caption's word
    order names)."""
    eval_every: int = 0
    """Evaluate every this many steps (0: only at the end)."""
    eval_steps: int = 20
    eval_guidance: float = 3.0
    eval_per_category: int = 16
    """Samples per category and prompt set at each evaluation."""

    def __post_init__(self) -> None:
        if self.steps < 0 or (self.steps == 0 and self.minutes <= 0):
            raise ValueError("give a positive --steps or --minutes.")
        if self.t5_position_bias <= 0:
            raise ValueError(f"t5_position_bias {self.t5_position_bias} must be positive.")
        if self.text_lr < 0:
            raise ValueError(f"text_lr {self.text_lr} must be 0 (frozen) or more.")
        if not 0.0 <= self.text_dropout < 1.0:
            raise ValueError(f"text_dropout {self.text_dropout} must be in [0, 1).")
        if self.batch < 1 or self.lr <= 0 or self.shift <= 0:
            raise ValueError("batch, lr and shift must be positive.")
        if self.model not in ("flux", "sd3"):
            raise ValueError(f"model {self.model!r}: choose flux or sd3.")
        if self.tokens not in ("bytes", "words"):
            raise ValueError(f"tokens {self.tokens!r}: choose bytes or words.")
        if self.mix and not self.balanced:
            raise ValueError("a category mix needs balanced drawing; drop one of the two.")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout {self.layout!r}: choose one of {', '.join(LAYOUTS)}.")
        category_mix(self.mix)

    def model_kwargs(self) -> dict[str, Any]:
        """What the backbone's ``build_shapes_components`` takes."""
        depth = (
            {"double_layers": self.double_layers, "single_layers": self.single_layers}
            if self.model == "flux"
            else {"layers": self.layers}
        )
        return {
            "width": self.width,
            "heads": self.heads,
            **depth,
            "text_width": self.text_width,
            "shift": self.shift,
            "downsample": self.downsample,
            **({"words": vocabulary(), "text_length": 16} if self.tokens == "words" else {}),
        }


def category_mix(mix: str) -> list[float] | None:
    """The relative weights ``mix`` (``position=3,color_attr=2``) gives each category, in
    :data:`CATEGORIES` order; ``None`` for an empty ``mix`` (all alike)."""
    if not mix.strip():
        return None
    weights = dict.fromkeys(CATEGORIES, 1.0)
    for part in mix.split(","):
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in weights:
            raise ValueError(
                f"mix {part.strip()!r}: write category=weight, the categories being "
                f"{', '.join(CATEGORIES)}."
            )
        try:
            weights[name] = float(value)
        except ValueError:
            raise ValueError(f"mix {part.strip()!r}: {value.strip()!r} is not a number.") from None
        if not weights[name] >= 0:
            raise ValueError(f"mix {part.strip()!r}: a weight must be 0 or more.")
    total = sum(weights.values())
    if total <= 0:
        raise ValueError(f"mix {mix!r}: at least one category needs a positive weight.")
    return [weights[c] / total for c in CATEGORIES]


class TrainingPairs:
    """(image, caption) pairs of the shapes world's training captions, from one seeded
    numpy Generator: the same seed gives the same stream."""

    def __init__(
        self,
        seed: int,
        *,
        balanced: bool = True,
        mix: str = "",
        layout: str = "free",
        resolution: int = 32,
    ) -> None:
        train, _ = split_prompts()
        self.captions = train
        self.by_category = {c: [p for p in train if parse(p).category == c] for c in CATEGORIES}
        self.specs = {p: parse(p) for p in train}
        self.balanced = balanced
        self.weights = category_mix(mix)
        self.layout = layout
        self.resolution = resolution
        self.rng = np.random.default_rng(seed)

    def caption(self) -> str:
        if self.balanced and self.weights is not None:
            pool = self.by_category[
                CATEGORIES[int(self.rng.choice(len(CATEGORIES), p=self.weights))]
            ]
        elif self.balanced:
            pool = self.by_category[CATEGORIES[int(self.rng.integers(len(CATEGORIES)))]]
        else:
            pool = self.captions
        return pool[int(self.rng.integers(len(pool)))]

    def batch(self, n: int) -> tuple[torch.Tensor, list[str]]:
        """``n`` pairs: images ``[n, 3, H, W]`` in ``[-1, 1]`` and their captions."""
        captions = [self.caption() for _ in range(n)]
        images = np.stack(
            [
                render(scene_for(self.specs[c], self.rng, self.resolution, self.layout))
                for c in captions
            ]
        )  # [n, H, W, 3] uint8
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0  # [n, 3, H, W]
        return x, captions


def sample_sigmas(
    n: int, generator: torch.Generator, *, mean: float, std: float, shift: float
) -> torch.Tensor:
    """``[n]`` training sigmas: logit-normal, then the scheduler's static shift."""
    s = torch.sigmoid(mean + std * torch.randn(n, generator=generator))
    return shift * s / (1 + (shift - 1) * s)


def _lr_factor(step: int, recipe: Recipe, total: int) -> float:
    if step < recipe.warmup:
        return (step + 1) / recipe.warmup
    done = min(1.0, (step - recipe.warmup) / max(1, total - recipe.warmup))
    return recipe.lr_final + (1 - recipe.lr_final) * 0.5 * (1 + math.cos(math.pi * done))


def _trained_modules(pipe: Any) -> dict[str, torch.nn.Module]:
    """The transformer, then every text encoder the pipeline has, by component name."""
    names = ("transformer", "text_encoder", "text_encoder_2", "text_encoder_3")
    return {n: getattr(pipe, n) for n in names if getattr(pipe, n, None) is not None}


def _scale_t5_position_bias(encoders: Sequence[torch.nn.Module], factor: float) -> None:
    """Multiply the relative-position bias of every T5 encoder among ``encoders``."""
    if factor == 1.0:
        return
    for m in encoders:
        for name, weight in m.named_parameters():
            if name.endswith("relative_attention_bias.weight"):
                with torch.no_grad():
                    weight.mul_(factor)


def evaluate_model(
    path: str | Path,
    *,
    steps: int = 20,
    guidance: float = 3.0,
    per_category: int = 16,
    seed: int = 0,
    prompt_sets: Sequence[str] = ("heldout", "train"),
    lora: str | Path | None = None,
    text_order: bool = False,
) -> tuple[dict[str, dict[str, float]], dict[str, torch.Tensor]]:
    """Strict accuracy per category of the pipeline at ``path``, loaded as digen loads it
    (with the LoRA a run saved, ``<run>/lora``, loaded onto it when ``lora`` names one),
    and with ``text_order`` the same pipeline's :func:`order_sensitivity` on
    :func:`order_captions` under ``results["text_order"]``.

    For each prompt set, up to 8 prompts per category (a fixed choice) and
    ``per_category`` samples spread over them; deterministic sampling from
    :func:`~digen.seeding.eval_generator` noise with ``steps`` Euler steps of the model's
    scheduler and classifier-free guidance ``guidance`` against the empty prompt. Returns
    the accuracies and the images ``uint8 [B, 1, H, W, 3]`` per prompt set
    (:func:`evaluation_prompts` gives their prompts).
    """
    from digen.algos.rollout import SamplerSpec, sample_rollout
    from digen.models import get_adapter_class
    from digen.models._quiet import no_loading_bars
    from digen.models.checks import model_of_dir
    from digen.rewards.shapes import accuracy, evaluate
    from digen.seeding import eval_generator

    with no_loading_bars():
        adapter = get_adapter_class(model_of_dir(path)).from_pretrained(path)
        if lora is not None:
            adapter.pipe.load_lora_weights(str(lora))
    spec = SamplerSpec(
        sigmas=adapter.sigmas(steps), window=(), stochastic=(), guidance_scale=guidance
    )
    results, images = {}, {}
    chosen = evaluation_prompts(per_category)
    for name in prompt_sets:
        prompts = chosen[name]
        keys = [(i, 0) for i in range(len(prompts))]
        with torch.no_grad():
            cond = adapter.encode_prompts(prompts)
            neg = adapter.encode_prompts([""] * len(prompts)) if guidance > 1 else None
            gens = [eval_generator(seed, i, j) for i, j in keys]
            rollout = sample_rollout(adapter, cond, gens, spec, neg)
            pixels = adapter.decode(rollout.final)  # [B, 1, H, W, 3]
        results[name] = accuracy(evaluate(pixels, prompts))
        images[name] = pixels
    if text_order:
        results["text_order"] = order_sensitivity(adapter.encode_prompts, order_captions())
    return results, images


def evaluation_prompts(per_category: int) -> dict[str, list[str]]:
    """The prompts :func:`evaluate_model` samples, per prompt set (``heldout``, ``train``):
    up to 8 captions of each category (a fixed choice), cycled to ``per_category``."""
    train, held_out = split_prompts()
    pick = np.random.default_rng(1234)
    out = {}
    for name, pool in (("heldout", held_out), ("train", train)):
        prompts = []
        for c in CATEGORIES:
            mine = [p for p in pool if parse(p).category == c]
            chosen = [mine[i] for i in sorted(pick.permutation(len(mine))[:8])]
            prompts += [chosen[j % len(chosen)] for j in range(per_category)]
        out[name] = prompts
    return out


def swapped_binding(text: str) -> str:
    """``text`` with the colours of its two objects exchanged: "a red circle to the left of
    a green square" -> "a green circle to the left of a red square", the same words in
    another order. Only a caption of two coloured objects has one."""
    spec = parse(text)
    if len(spec.objects) != 2 or any(o.colour is None for o in spec.objects):
        raise ValueError(f"{text!r} does not name two coloured objects.")
    a, b = spec.objects
    objects = (dataclasses.replace(a, colour=b.colour), dataclasses.replace(b, colour=a.colour))
    return caption(dataclasses.replace(spec, objects=objects))


def order_sensitivity(encode: Any, captions: Sequence[str]) -> dict[str, float]:
    """How much the text conditioning ``encode(captions)`` (a
    :class:`~digen.models.base.PromptEmbeds`) tells a caption from its
    :func:`swapped_binding`, as the transformer can see it.

    The transformer reads the sequence of text vectors as a set (FLUX's text tokens share
    one position, SD3's have none), so a sequence is compared as a set: ``sequence`` is the
    mean over captions of the largest distance from one of its vectors to the nearest vector
    of the swapped caption, relative to that vector's norm; ``pooled`` the mean relative
    distance of the pooled vectors. Both 0 mean the conditioning is a bag of words, and the
    model cannot learn which colour goes with which shape or which object is where."""
    swapped = [swapped_binding(c) for c in captions]
    with torch.no_grad():
        mine, theirs = encode(list(captions)).tensors, encode(swapped).tensors
    a, b = mine["prompt_embeds"].float(), theirs["prompt_embeds"].float()  # [N, L, D]
    nearest = (
        torch.cdist(a, b, compute_mode="donot_use_mm_for_euclid_dist").min(-1).values
    )  # [N, L]
    sequence = (nearest / a.norm(dim=-1).clamp_min(1e-12)).max(dim=-1).values
    p, q = mine["pooled_prompt_embeds"].float(), theirs["pooled_prompt_embeds"].float()
    pooled = (p - q).norm(dim=-1) / p.norm(dim=-1).clamp_min(1e-12)
    return {"sequence": float(sequence.mean()), "pooled": float(pooled.mean())}


def order_captions() -> list[str]:
    """The captions :func:`order_sensitivity` is measured on during pretraining: every
    colour-attribution caption, held out or not (each names two coloured objects)."""
    train, held_out = split_prompts()
    return [c for c in train + held_out if parse(c).category == "color_attr"]


def save_grid(path: Path, pixels: torch.Tensor, columns: int = 16) -> None:
    """``pixels [B, 1, H, W, 3]`` uint8 as one PNG, ``columns`` to a row, 2 px apart."""
    from PIL import Image

    b, _, h, w, _ = pixels.shape
    rows = math.ceil(b / columns)
    canvas = np.full((rows * (h + 2), columns * (w + 2), 3), 128, dtype=np.uint8)
    for i in range(b):
        r, c = divmod(i, columns)
        canvas[r * (h + 2) : r * (h + 2) + h, c * (w + 2) : c * (w + 2) + w] = pixels[i, 0].numpy()
    Image.fromarray(canvas).save(path)


CHECKPOINT = "checkpoint.pt"
"""The file in ``out`` a run in pieces goes on from: live and EMA weights, the optimizer,
every random stream and the step; removed when the run completes."""


EXIT_STOPPED = 75
"""The command's exit status when a piece stopped before the end (EX_TEMPFAIL: run it again)."""


@contextlib.contextmanager
def _terminate_as_a_stop() -> Iterator[threading.Event]:
    """While inside, SIGTERM (what a scheduler or a closing session sends) only sets the
    event, which the training loop reads after each step to save a checkpoint and stop;
    the previous handler is back on the way out. Off the main thread, where no handler
    can be set, the event never fires."""
    event = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield event
        return
    previous = signal.signal(signal.SIGTERM, lambda *_: event.set())
    try:
        yield event
    finally:
        signal.signal(signal.SIGTERM, previous)


class Stopped(Exception):
    """A piece ended (``piece_minutes`` spent) with its checkpoint saved."""


def pretrain(
    recipe: Recipe,
    out: Path,
    log: Any = sys.stderr,
    *,
    resume: bool = False,
    checkpoint_every: int = 500,
    piece_minutes: float = 0.0,
) -> dict[str, Any]:
    """Train from ``recipe`` and save the EMA pipeline to ``out``; returns the last
    evaluation. ``out`` also gets ``recipe.json``, ``log.jsonl`` and evaluation grids.

    A long run goes in pieces: every ``checkpoint_every`` steps (and when a piece has trained
    ``piece_minutes`` or the process gets SIGTERM, which then raise :class:`Stopped`) the
    state is saved to
    ``out/checkpoint.pt``, and ``resume=True`` goes on from it (or starts, when there is
    none yet, so every piece is the same command). A run resumed any number of
    times ends with the same weights as one that was never stopped (the same steps, batches,
    noise and optimizer state), so the seed alone still reproduces it."""
    from digen.models import get_adapter_class
    from digen.models.base import _save_whatever_the_rank

    out.mkdir(parents=True, exist_ok=True)
    checkpoint = out / CHECKPOINT
    if checkpoint.exists() and not resume:
        raise ValueError(
            f"{out} holds a checkpoint of an unfinished run; pass --resume to go on from it, "
            f"or choose another --out."
        )
    resume = resume and checkpoint.exists()
    torch.manual_seed(recipe.seed)
    cls = get_adapter_class(recipe.model)
    pipe = cls.pipeline_class(**cls.build_shapes_components(**recipe.model_kwargs()))
    pipe.set_progress_bar_config(disable=True)
    adapter = cls(pipe, height=32, width=32)
    named = _trained_modules(pipe)
    n_params = {
        f"{name} ({type(m).__name__})": sum(p.numel() for p in m.parameters())
        for name, m in named.items()
    }
    transformer, *encoders = named.values()
    _scale_t5_position_bias(encoders, recipe.t5_position_bias)
    transformer.requires_grad_(True).train()
    for m in encoders:  # no dropout inside the text encoders; caption dropout is the regulariser
        m.requires_grad_(recipe.text_lr > 0).eval()
    groups = [([*transformer.parameters()], 1.0)]
    if recipe.text_lr > 0:
        groups.append(([p for m in encoders for p in m.parameters()], recipe.text_lr))
    params = [p for group, _ in groups for p in group]
    ema = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(
        [{"params": group, "lr_scale": scale} for group, scale in groups],
        lr=recipe.lr,
        betas=(0.9, 0.99),
        weight_decay=recipe.weight_decay,
    )
    data = TrainingPairs(
        recipe.seed, balanced=recipe.balanced, mix=recipe.mix, layout=recipe.layout
    )
    noise_gen = torch.Generator().manual_seed(recipe.seed + 1)
    drop_gen = np.random.default_rng(recipe.seed + 2)
    shift_factor, scaling = pipe.vae.config.shift_factor, pipe.vae.config.scaling_factor
    total = recipe.steps or 10**9  # fixed once the first steps have been timed
    start, train_seconds, wall_before, losses = time.perf_counter(), 0.0, 0.0, []
    last_eval: dict[str, Any] = {}
    step, pieces = 0, []
    if resume:
        state = torch.load(checkpoint, weights_only=False)
        changed = _recipe_changes(state["recipe"], recipe)
        if changed:
            raise ValueError(
                f"the checkpoint in {out} is of another recipe ({', '.join(changed)} differ); "
                f"resume with the flags it was started with."
            )
        with torch.no_grad():
            for p, saved in zip(params, state["params"], strict=True):
                p.copy_(saved)
            for e, saved in zip(ema, state["ema"], strict=True):
                e.copy_(saved)
        opt.load_state_dict(state["optimizer"])
        data.rng.bit_generator.state = state["data_rng"]
        drop_gen.bit_generator.state = state["drop_rng"]
        noise_gen.set_state(state["noise_rng"])
        step, total, train_seconds = state["step"], state["total"], state["train_seconds"]
        wall_before = state["wall_seconds"]
        losses, last_eval, pieces = state["losses"], state["last_eval"], state["pieces"]
    log_file = (out / "log.jsonl").open("a" if resume else "w")
    piece_start = train_seconds

    def emit(row: dict[str, Any]) -> None:
        print(json.dumps(row), file=log_file, flush=True)
        print(json.dumps(row), file=log, flush=True)

    def save_checkpoint() -> None:
        state = {
            "recipe": dataclasses.asdict(recipe),
            "params": [p.detach() for p in params],
            "ema": ema,
            "optimizer": opt.state_dict(),
            "data_rng": data.rng.bit_generator.state,
            "drop_rng": drop_gen.bit_generator.state,
            "noise_rng": noise_gen.get_state(),
            "step": step,
            "total": total,
            "train_seconds": train_seconds,
            "wall_seconds": wall_before + time.perf_counter() - start,
            "losses": losses[-50:],
            "last_eval": last_eval,
            "pieces": [*pieces, round((train_seconds - piece_start) / 60, 2)],
        }
        torch.save(state, checkpoint.with_suffix(".tmp"))
        checkpoint.with_suffix(".tmp").replace(checkpoint)  # never a half-written checkpoint

    with _terminate_as_a_stop() as terminated:  # SIGTERM: a checkpoint, then stop
        emit({"event": "resumed" if resume else "started", "step": step, "steps": total})
        while step < total:
            t0 = time.perf_counter()
            for group in opt.param_groups:
                group["lr"] = group["lr_scale"] * recipe.lr * _lr_factor(step, recipe, total)
            x, captions = data.batch(recipe.batch)  # [B, 3, 32, 32] in [-1, 1]
            with torch.no_grad():  # the latent: the image, block-averaged when down-sampled
                z = pipe.vae.encode(x).latent_dist.mode()  # [B, 3, 32 / d, 32 / d]
            x0 = (z - shift_factor) * scaling
            dropped = drop_gen.random(len(captions)) < recipe.text_dropout
            captions = ["" if d else c for c, d in zip(captions, dropped)]
            cond = adapter._encode_prompts(captions)  # with gradients: the encoders train
            noise = torch.randn(x0.shape, generator=noise_gen)  # [B, 3, h, w]
            sigma = sample_sigmas(
                len(x0), noise_gen, mean=recipe.logit_mean, std=recipe.logit_std, shift=recipe.shift
            )  # [B]
            s = sigma.view(-1, 1, 1, 1)
            x_t = (1 - s) * x0 + s * noise
            v = adapter.forward_velocity(x_t, sigma, cond)  # [B, 3, h, w]
            loss = torch.nn.functional.mse_loss(v, noise - x0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            decay = min(recipe.ema, (1 + step) / (10 + step))
            with torch.no_grad():
                torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
            losses.append(loss.item())
            step += 1
            train_seconds += time.perf_counter() - t0
            if recipe.steps == 0 and step == 20:
                total = max(step + 1, int(recipe.minutes * 60 / (train_seconds / step)))
                emit(
                    {
                        "event": "steps_chosen",
                        "steps": total,
                        "seconds_per_step": train_seconds / 20,
                    }
                )
            if step % 50 == 0 or step == total:
                emit(
                    {
                        "step": step,
                        "loss": float(np.mean(losses[-50:])),
                        "grad_norm": float(grad_norm),
                        "lr": opt.param_groups[0]["lr"],
                        "train_minutes": round(train_seconds / 60, 2),
                    }
                )
            if step == total or (recipe.eval_every and step % recipe.eval_every == 0):
                _save(pipe, params, ema, out, _save_whatever_the_rank)
                t_eval = time.perf_counter()
                results, images = _evaluate_as(recipe, out)
                for name, pixels in images.items():
                    save_grid(out / f"eval-{name}-{step:06d}.png", pixels, recipe.eval_per_category)
                last_eval = {"step": step, **{f"{k}": v for k, v in results.items()}}
                emit({**last_eval, "eval_minutes": round((time.perf_counter() - t_eval) / 60, 2)})
            if step < total:
                piece_over = piece_minutes > 0 and train_seconds - piece_start >= piece_minutes * 60
                stop = piece_over or terminated.is_set()
                if stop or (checkpoint_every and step % checkpoint_every == 0):
                    save_checkpoint()
                if stop:
                    why = "piece_over" if piece_over else "terminated"
                    emit({"event": "stopped", "step": step, "steps": total, "why": why})
                    log_file.close()
                    raise Stopped(
                        f"stopped at step {step} of {total} with a checkpoint in {checkpoint}; "
                        f"run the same command with --resume to go on."
                    )
    pieces = [*pieces, round((train_seconds - piece_start) / 60, 2)]
    final = dataclasses.replace(recipe, steps=total)
    shipped = compare_to_shipped(out, recipe.model, list(named))
    if shipped is not None:
        emit({"shipped": shipped})
    (out / "recipe.json").write_text(
        json.dumps(
            {
                "recipe": dataclasses.asdict(final),
                "threads": torch.get_num_threads(),
                "parameters": n_params,
                "train_minutes": round(train_seconds / 60, 2),
                "wall_minutes": round((wall_before + time.perf_counter() - start) / 60, 2),
                "pieces": pieces,
                "final_loss": float(np.mean(losses[-50:])),
                "eval": last_eval,
                "shipped": shipped,
            },
            indent=2,
        )
        + "\n"
    )
    log_file.close()
    checkpoint.unlink(missing_ok=True)
    return last_eval


def compare_to_shipped(
    out: Path, model: str, components: Sequence[str], root: Path | None = None
) -> dict[str, Any] | None:
    """How close the pipeline in ``out`` is to the ``shapes`` weights shipped for ``model``
    (under ``root``, default the package's): per component, whether every tensor is equal
    bit for bit and the largest absolute difference, and the shipped weights' own
    evaluation (from their ``recipe.json``) to set beside this run's. None when nothing
    ships for ``model`` or its tensors have other names or shapes (another recipe)."""
    from safetensors.torch import load_file

    from digen.models.base import PRETRAINED_ROOT

    ref = Path(root if root is not None else PRETRAINED_ROOT) / f"{model}-shapes"
    if not (ref / "model_index.json").is_file() or ref.resolve() == out.resolve():
        return None
    report: dict[str, Any] = {"path": str(ref), "components": {}}
    for name in components:
        mine, theirs = {}, {}
        for folder, into in ((out / name, mine), (ref / name, theirs)):
            for file in sorted(folder.glob("*.safetensors")):
                into.update(load_file(str(file)))
        same_shapes = mine.keys() == theirs.keys() and all(
            mine[k].shape == theirs[k].shape for k in mine
        )
        if not mine or not same_shapes:
            return None
        diff = max(float((mine[k].float() - theirs[k].float()).abs().max()) for k in mine)
        equal = all(torch.equal(mine[k], theirs[k]) for k in mine)
        report["components"][name] = {"identical": equal, "max_abs_diff": diff}
    report["identical"] = all(c["identical"] for c in report["components"].values())
    recipe_file = ref / "recipe.json"
    if recipe_file.is_file():
        report["shipped_eval"] = json.loads(recipe_file.read_text()).get("eval")
    return report


def _recipe_changes(saved: dict[str, Any], recipe: Recipe) -> list[str]:
    """The settings in which ``recipe`` differs from a checkpoint's ``saved`` one; a setting
    added since the checkpoint was made counts as its default there."""
    now = dataclasses.asdict(recipe)
    defaults = {f.name: f.default for f in dataclasses.fields(Recipe)}
    return sorted(
        {k for k in now if saved.get(k, defaults[k]) != now[k]} | {k for k in saved if k not in now}
    )


def _evaluate_as(recipe: Recipe, out: Path) -> Any:
    """:func:`evaluate_model` of the pipeline in ``out`` with ``recipe``'s evaluation
    settings, with its :func:`order_sensitivity` beside the accuracies as ``text_order``."""
    return evaluate_model(
        out,
        steps=recipe.eval_steps,
        guidance=recipe.eval_guidance,
        per_category=recipe.eval_per_category,
        seed=recipe.seed,
        text_order=True,
    )


def _save(
    pipe: Any,
    params: list[torch.nn.Parameter],
    ema: list[torch.Tensor],
    out: Path,
    save_context: Any,
) -> None:
    """Save ``pipe`` with the EMA weights in place of the live ones, then put those back
    (without the libraries' saving bars, which would fill the log between its rows)."""
    from digen.models._quiet import no_loading_bars

    live = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, e in zip(params, ema):
            p.copy_(e)
        with save_context(), no_loading_bars():
            pipe.save_pretrained(str(out), safe_serialization=True)
        for p, v in zip(params, live):
            p.copy_(v)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m digen.run.shapes_pretrain",
        description="Pretrain the shapes flavour (FLUX.1 or SD3.5 components) on the shapes world.",
    )
    ap.add_argument("--out", required=True, type=Path, help="the pipeline directory to write")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument(
        "--resume",
        action="store_true",
        help="go on from the checkpoint in --out, if it holds one (else start): the same "
        "command runs every piece of a long run",
    )
    ap.add_argument(
        "--piece-minutes",
        type=float,
        default=0.0,
        help="stop after this many minutes of training, with a checkpoint, and exit with "
        f"status {EXIT_STOPPED}; 0: train to the end",
    )
    ap.add_argument(
        "--checkpoint-every",
        type=int,
        default=500,
        help="save a checkpoint every this many steps (a killed run loses at most these)",
    )
    ap.add_argument(
        "--evaluate-only",
        action="store_true",
        help="evaluate the pipeline already in --out with the --eval-* settings; no training",
    )
    for f in dataclasses.fields(Recipe):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kind = {"int": int, "float": float, "str": str}[f.type]
            choices = {
                "model": ("flux", "sd3"),
                "tokens": ("bytes", "words"),
                "layout": LAYOUTS,
            }.get(f.name)
            ap.add_argument(
                flag, type=kind, default=f.default, choices=choices, help=(f.__doc__ or None)
            )
    return ap


def main(argv: Sequence[str] | None = None) -> None:
    args = vars(_parser().parse_args(argv))
    out, threads, only = args.pop("out"), args.pop("threads"), args.pop("evaluate_only")
    pieces = {k: args.pop(k) for k in ("resume", "piece_minutes", "checkpoint_every")}
    torch.set_num_threads(threads)
    recipe = Recipe(**args)
    if not only:
        try:
            pretrain(recipe, out, **pieces)
        except Stopped as stop:
            print(stop, file=sys.stderr)
            sys.exit(EXIT_STOPPED)
        except ValueError as bad:
            print(f"error: {bad}", file=sys.stderr)
            sys.exit(2)
        return
    results, images = _evaluate_as(recipe, out)
    tag = f"{recipe.eval_steps}steps-cfg{recipe.eval_guidance:g}"
    for name, pixels in images.items():
        save_grid(out / f"eval-{name}-{tag}.png", pixels, recipe.eval_per_category)
    print(
        json.dumps({"eval_steps": recipe.eval_steps, "guidance": recipe.eval_guidance, **results})
    )


if __name__ == "__main__":
    main()
