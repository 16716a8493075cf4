"""The adapter protocol every backbone implements, and what the adapters share.

An adapter wraps one diffusers pipeline (transformer + VAE + text encoders + scheduler) and
exposes the few operations RL post-training needs, for image and video models alike:

- ``encode_prompts(prompts)`` -> :class:`PromptEmbeds` (batch-first tensors);
- ``initial_latents(generators)`` -> ``[B, *latent_shape]`` Gaussian noise, one generator per
  sample so a sample does not depend on the batch it is made in;
- ``predict_velocity(latents, sigma, cond, neg_cond, guidance_scale)`` -> velocity, fp32, the
  same shape as ``latents`` (packing for FLUX / Qwen-Image happens inside);
- ``decode(latents)`` -> ``uint8`` pixels ``[B, F, H, W, 3]`` (``F == 1`` for images);
- ``sigmas(num_inference_steps)`` -> the flow-matching sigmas, ``[N + 1]`` ending in 0.

Latents are always kept in the VAE's own layout, ``[B, C, H, W]`` for images and
``[B, C, F, H, W]`` for video. Models are single-device code: nothing here knows about RPC or
``torch.distributed``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NamedTuple
from unittest import mock

import torch
from diffusers import DiffusionPipeline, FlowMatchEulerDiscreteScheduler

from digen.errors import DigenError
from digen.models._quiet import NOTES, caught_truncation, truncation_note
from digen.models.checks import check_model_dir
from digen.models.parallel import GuidanceBranch, SequencePlan

#: LoRA targets of joint (MMDiT-style) attention: the image stream's and the text stream's
#: projections, as diffusers names them in FLUX, SD3 and HunyuanVideo
JOINT_ATTENTION_TARGETS = (
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
)

#: where shipped flavours live: ``<PRETRAINED_ROOT>/<backbone>-<flavour>/``, a diffusers
#: pipeline directory (``python -m digen.run.shapes_pretrain`` writes the shapes one)
PRETRAINED_ROOT = Path(__file__).resolve().parent / "pretrained"

#: pipeline attributes that hold text encoders (absent ones are skipped)
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")

__all__ = [
    "JOINT_ATTENTION_TARGETS",
    "PRETRAINED_ROOT",
    "TEXT_ENCODERS",
    "DiffusionAdapter",
    "PromptEmbeds",
    "cache_root",
    "make_byte_tokenizer",
]


@dataclass(frozen=True)
class PromptEmbeds:
    """Text conditioning for a batch of prompts. Every tensor is batch-first."""

    tensors: dict[str, torch.Tensor]

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def select(self, index: torch.Tensor | Sequence[int] | slice) -> PromptEmbeds:
        """Rows ``index`` of every tensor (a list of indices may repeat rows)."""
        if not isinstance(index, slice):
            index = torch.as_tensor(index, dtype=torch.long)
        return PromptEmbeds({k: v[index] for k, v in self.tensors.items()})

    def repeat_interleave(self, n: int) -> PromptEmbeds:
        """Each prompt ``n`` times in a row: ``[p0, p0, p1, p1, ...]`` for ``n == 2``."""
        return PromptEmbeds({k: v.repeat_interleave(n, dim=0) for k, v in self.tensors.items()})

    def to(self, device: torch.device | str) -> PromptEmbeds:
        return PromptEmbeds({k: v.to(device) for k, v in self.tensors.items()})

    @staticmethod
    def cat(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
        """Concatenate along the batch; sequence lengths must already agree."""
        keys = parts[0].tensors.keys()
        return PromptEmbeds({k: torch.cat([p.tensors[k] for p in parts], dim=0) for k in keys})


def cache_root() -> Path:
    """Where random-init flavours are saved, one folder per flavour: ``$DIGEN_CACHE`` or
    ``~/.cache/digen``."""
    return Path(os.environ.get("DIGEN_CACHE") or os.path.join(Path.home(), ".cache", "digen"))


def make_byte_tokenizer(
    *,
    model_max_length: int,
    bos_token: str | None = None,
    eos_token: str | None = "</s>",
    pad_token: str = "<pad>",
    unk_token: str = "<unk>",
    extra_special_tokens: Sequence[str] = (),
    add_bos: bool = False,
    add_eos: bool = True,
    words: Sequence[str] | None = None,
):
    """An offline byte-level tokenizer: 256 byte tokens + special tokens, no merges.

    Any text tokenizes, nothing is downloaded, and the result saves as ``tokenizer.json`` and
    reloads with ``PreTrainedTokenizerFast.from_pretrained``. Tiny flavours use it in place of
    the real CLIP / T5 / Llama / Qwen tokenizers.

    With ``words``, a word-level tokenizer instead: one token per word of that closed
    vocabulary (split on spaces and punctuation), any other word ``unk_token``. For a world
    whose captions use a few dozen words (the shapes world), so that a small text encoder
    sees a caption as its words, not as the bytes it has to group into them first.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [t for t in (pad_token, unk_token, bos_token, eos_token) if t is not None]
    specials += [t for t in extra_special_tokens if t not in specials]
    vocab: dict[str, int] = {tok: i for i, tok in enumerate(specials)}
    if words is None:
        for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
            vocab.setdefault(ch, len(vocab))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk_token))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
    else:
        for word in words:
            vocab.setdefault(word, len(vocab))
        tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=unk_token))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = " ".join(
        ([bos_token] if add_bos and bos_token else [])
        + ["$A"]
        + ([eos_token] if add_eos and eos_token else [])
    )
    special_pairs = [(t, vocab[t]) for t in (bos_token, eos_token) if t is not None]
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=special_pairs)
    kwargs: dict[str, Any] = {"pad_token": pad_token, "unk_token": unk_token}
    if bos_token is not None:
        kwargs["bos_token"] = bos_token
    if eos_token is not None:
        kwargs["eos_token"] = eos_token
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, model_max_length=model_max_length, padding_side="right", **kwargs
    )
    if extra_special_tokens:
        fast.add_special_tokens({"additional_special_tokens": list(extra_special_tokens)})
    return fast


class _Flavour(NamedTuple):
    """What a random-init flavour of one backbone is made of."""

    build: Callable[[], dict[str, Any]]
    version: int
    geometry: dict[str, int]


class DiffusionAdapter(ABC):
    """One backbone over its diffusers pipeline. Subclasses live one per file.

    Without weights, a backbone is built from code in one of two random-init flavours: ``tiny``
    (toy width, builds in seconds on a CPU: tests and the default run) or ``medium`` (the real
    architectures at about 1B transformer parameters: for measuring on one GPU). Either is
    saved once to the cache and loaded back through :meth:`from_pretrained`, like real weights.
    """

    #: registry name used by configs and the CLI (``flux``, ``sd3``, ...)
    name: ClassVar[str]
    #: the diffusers pipeline class whose ``from_pretrained`` loads the components
    pipeline_class: ClassVar[type[DiffusionPipeline]]
    #: True for video backbones (latents ``[B, C, F, H, W]``)
    is_video: ClassVar[bool] = False
    #: LoRA target modules (peft names) used when the config gives none
    lora_targets: ClassVar[tuple[str, ...]]
    #: bump when a flavour's architecture changes so stale caches are rebuilt
    tiny_version: ClassVar[int] = 1
    medium_version: ClassVar[int] = 1
    #: flavours of :data:`~digen.registry.models.FLAVOURS` that ship pretrained weights in
    #: the package (:data:`PRETRAINED_ROOT`) instead of being built from code
    shipped_flavours: ClassVar[tuple[str, ...]] = ()
    #: default geometry of each flavour, in pixels / frames
    tiny_height: ClassVar[int] = 32
    tiny_width: ClassVar[int] = 32
    tiny_num_frames: ClassVar[int] = 1
    medium_height: ClassVar[int] = 512
    medium_width: ClassVar[int] = 512
    medium_num_frames: ClassVar[int] = 1
    shapes_height: ClassVar[int] = 32
    shapes_width: ClassVar[int] = 32
    #: where the transformer's tokens may be cut for sequence parallelism (None: nowhere)
    sequence_plan: ClassVar[SequencePlan | None] = None

    def __init__(
        self,
        pipe: DiffusionPipeline,
        *,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        max_sequence_length: int | None = None,
        offload_text_encoders: bool = False,
    ) -> None:
        self.pipe = pipe
        #: the folder the weights were loaded from (None for a pipeline built in memory)
        self.path: Path | None = None
        self.height = int(height or self.tiny_height)
        self.width = int(width or self.tiny_width)
        self.num_frames = int(num_frames or self.tiny_num_frames) if self.is_video else 1
        self.max_sequence_length = max_sequence_length
        self._cut_noted = False  # a truncated prompt has been noted (once per adapter)
        self.encoder_visits = 0
        """How many times offloaded text encoders came to the device (two copies each)."""
        #: the text encoders live on the CPU and visit the model's device in encode_prompts
        self.offload_text_encoders = offload_text_encoders
        #: set by the runtime's CFG parallelism: this device runs one branch of guidance
        self.guidance_branch: GuidanceBranch | None = None
        for comp in self.frozen_modules():
            comp.requires_grad_(False)
            comp.eval()
        self.transformer.requires_grad_(False)
        self.transformer.eval()
        if offload_text_encoders:
            for encoder in self.text_encoders():
                encoder.to("cpu")

    # --- loading ------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        vae_tiling: bool = False,
        offload_text_encoders: bool = False,
        transformer_device: torch.device | str | None = None,
        **geometry: Any,
    ) -> DiffusionAdapter:
        """Load a local diffusers-format directory (``model_index.json`` + subfolders).

        ``transformer_device`` puts the transformer elsewhere than the rest (default:
        ``device``). ``"meta"`` builds it without weights (parameters on the meta device,
        :func:`~digen.models.weights.empty_transformer`): a sharded trainer shards it first,
        then reads only its own rows of each weight, never holding a whole copy anywhere.

        ``vae_tiling`` makes the VAE decode one sample at a time and in overlapping spatial
        tiles (blended, so close to but not bit-equal with a whole decode) where its class can;
        ``offload_text_encoders`` leaves the text encoders on the CPU (see
        :meth:`encode_prompts`).
        """
        path = Path(path)
        check_model_dir(path, cls.name)
        parts: dict[str, Any] = {}
        if transformer_device is not None and torch.device(transformer_device).type == "meta":
            from digen.models.weights import empty_transformer

            parts["transformer"] = empty_transformer(path, dtype)
        try:
            pipe = cls.pipeline_class.from_pretrained(str(path), dtype=dtype, **parts)
        except (OSError, ValueError) as exc:  # a damaged weight file, a missing piece
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise DigenError(f"model path '{path}' cannot be loaded: {first}") from None
        pipe.set_progress_bar_config(disable=True)
        stay = TEXT_ENCODERS if offload_text_encoders else ()
        for key, part in pipe.components.items():
            if isinstance(part, torch.nn.Module) and key not in stay and key not in parts:
                part.to(
                    transformer_device if key == "transformer" and transformer_device else device
                )
        if vae_tiling:
            if hasattr(pipe.vae, "enable_slicing"):
                pipe.vae.enable_slicing()
            if hasattr(pipe.vae, "enable_tiling"):
                pipe.vae.enable_tiling()
        adapter = cls(pipe, offload_text_encoders=offload_text_encoders, **geometry)
        adapter.path = path
        return adapter

    @classmethod
    def random_init(
        cls,
        flavour: str = "tiny",
        *,
        cache_dir: str | os.PathLike | None = None,
        **options: Any,
    ) -> DiffusionAdapter:
        """The random-init ``flavour``, saved once to the cache and loaded back from disk.

        ``options`` are :meth:`from_pretrained`'s; a ``height``, ``width`` or ``num_frames``
        left out or None takes the flavour's default.
        """
        for key, default in cls._flavour(flavour).geometry.items():
            if options.get(key) is None:
                options[key] = default
        return cls.from_pretrained(cls.flavour_path(flavour, cache_dir), **options)

    @classmethod
    def tiny(cls, **options: Any) -> DiffusionAdapter:
        """The tiny flavour: :meth:`random_init` with ``flavour="tiny"``."""
        return cls.random_init("tiny", **options)

    @classmethod
    def tiny_path(cls, cache_dir: str | os.PathLike | None = None) -> Path:
        """The tiny flavour's directory: :meth:`flavour_path` with ``flavour="tiny"``."""
        return cls.flavour_path("tiny", cache_dir)

    @classmethod
    def flavour_path(cls, flavour: str, cache_dir: str | os.PathLike | None = None) -> Path:
        """Build (if needed) and save ``flavour``; return its directory.

        The directory is ``<cache_dir>/<flavour>/<name>-<hash>`` (``cache_dir`` defaults to
        :func:`cache_root`), the hash covering the flavour's version and the diffusers and
        transformers versions. Weights are saved as the build made them, fp32 safetensors, so
        any ``dtype`` loads from them.
        """
        if flavour in cls.shipped_flavours:
            return cls.shipped_path(flavour)
        spec = cls._flavour(flavour)
        root = (Path(cache_dir) if cache_dir is not None else cache_root()) / flavour
        import diffusers
        import transformers

        tag = f"{cls.name}-v{spec.version}-{diffusers.__version__}-{transformers.__version__}"
        target = root / f"{cls.name}-{hashlib.sha1(tag.encode()).hexdigest()[:10]}"
        if (target / "model_index.json").is_file():
            return target
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cls.name}-", dir=root))
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model dir
        try:
            with _fork_rng(seed=0):
                components = spec.build()
            pipe = cls.pipeline_class(**components)
            with _save_whatever_the_rank():
                pipe.save_pretrained(str(tmp), safe_serialization=True)
            _check_saved(pipe, tmp)
            (tmp / f"digen_{flavour}.json").write_text(json.dumps({"tag": tag}) + "\n")
            try:
                os.rename(tmp, target)  # atomic: concurrent builders race harmlessly
            except OSError:
                if not (target / "model_index.json").is_file():
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return target

    @classmethod
    def shipped_path(cls, flavour: str, root: str | os.PathLike | None = None) -> Path:
        """The directory of a flavour shipped with pretrained weights, under ``root``
        (default :data:`PRETRAINED_ROOT`); one sentence when it is missing."""
        target = Path(root if root is not None else PRETRAINED_ROOT) / f"{cls.name}-{flavour}"
        if not (target / "model_index.json").is_file():
            raise DigenError(
                f"model.flavour '{flavour}' needs the pretrained {cls.name} weights in "
                f"'{target}', which are missing; write them with "
                f"`python -m digen.run.shapes_pretrain --out {target}`."
            )
        return target

    @classmethod
    def _flavour(cls, flavour: str) -> _Flavour:
        """The flavour named ``flavour``; an unknown name is refused, naming the choices."""
        flavours = {
            "tiny": _Flavour(
                cls.build_tiny_components,
                cls.tiny_version,
                {
                    "height": cls.tiny_height,
                    "width": cls.tiny_width,
                    "num_frames": cls.tiny_num_frames,
                },
            ),
            "medium": _Flavour(
                cls.build_medium_components,
                cls.medium_version,
                {
                    "height": cls.medium_height,
                    "width": cls.medium_width,
                    "num_frames": cls.medium_num_frames,
                },
            ),
        }
        if flavour in cls.shipped_flavours:
            size = {"height": cls.shapes_height, "width": cls.shapes_width, "num_frames": 1}
            flavours[flavour] = _Flavour(cls.build_shapes_components, 1, size)
        elif flavour == "shapes":
            raise DigenError(
                f"model.flavour 'shapes' has pretrained weights for flux and sd3 only, not "
                f"for {cls.name}; choose model.name=flux or sd3, or model.flavour tiny or medium."
            )
        if flavour not in flavours:
            raise DigenError(
                f"model.flavour '{flavour}' is not a flavour; choose one of: {', '.join(flavours)}."
            )
        return flavours[flavour]

    @classmethod
    @abstractmethod
    def build_tiny_components(cls) -> dict[str, Any]:
        """Random-init components of the tiny flavour, as ``pipeline_class(**components)`` takes."""

    @classmethod
    @abstractmethod
    def build_medium_components(cls) -> dict[str, Any]:
        """Random-init components of the medium flavour, as ``pipeline_class(**components)``
        takes. Call it under ``torch.device("meta")`` to inspect it without the memory."""

    @classmethod
    def build_shapes_components(cls, **recipe: Any) -> dict[str, Any]:
        """Random-init components at the shapes world's size, which the ``shapes`` flavour's
        pretraining starts from; only backbones in whose ``shipped_flavours`` it is have one."""
        raise DigenError(f"{cls.name} has no shapes-size model; flux and sd3 have one.")

    # --- the protocol -------------------------------------------------------------------

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipe.transformer

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        """The transformer's compute dtype (diffusers' own answer, which skips the modules it
        keeps in fp32, such as Wan's first parameter, ``scale_shift_table``)."""
        return self.transformer.dtype

    def frozen_modules(self) -> list[torch.nn.Module]:
        """Modules that never train (VAE, text encoders)."""
        return self._pipe_modules(("vae", *TEXT_ENCODERS))

    def text_encoders(self) -> list[torch.nn.Module]:
        """The pipeline's text encoders, in ``TEXT_ENCODERS`` order."""
        return self._pipe_modules(TEXT_ENCODERS)

    def _pipe_modules(self, names: Sequence[str]) -> list[torch.nn.Module]:
        return [m for n in names if isinstance(m := getattr(self.pipe, n, None), torch.nn.Module)]

    @property
    def scheduler(self) -> FlowMatchEulerDiscreteScheduler:
        return self.pipe.scheduler

    def latent_shape(self) -> tuple[int, ...]:
        """Per-sample latent shape in the VAE layout: ``(C, H, W)`` or ``(C, F, H, W)``.

        The default reads the pipeline's VAE scale factors: ``vae_scale_factor`` for images,
        ``vae_scale_factor_spatial`` / ``_temporal`` for video (``4k + 1`` frames -> ``k + 1``
        latent frames).
        """
        if not self.is_video:
            f = int(self.pipe.vae_scale_factor)
            return (self.pipe.vae.config.latent_channels, self.height // f, self.width // f)
        f_s, f_t = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        c = self.transformer.config.in_channels
        return (c, (self.num_frames - 1) // f_t + 1, self.height // f_s, self.width // f_s)

    def image_seq_len(self) -> int:
        """Tokens the transformer sees per sample (used by dynamic shifting)."""
        shape = self.latent_shape()
        return int(torch.tensor(shape[1:]).prod().item()) // 4

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """Sigmas ``[N + 1]`` from the pipeline's scheduler (with its shift), ending in 0.

        ``shift``: a fixed time shift ``s t / (1 + (s - 1) t)`` of the uniform grid instead
        of the scheduler's own (a dynamic, resolution-dependent one included)."""
        base = torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps).tolist()
        return self.shifted_sigmas(base, shift)

    def tail_sigmas(
        self, num_inference_steps: int, start: int, count: int, shift: float | None = None
    ) -> torch.Tensor:
        """``[count + 1]`` sigmas of ``count`` steps from step ``start`` of the
        ``num_inference_steps`` schedule (:meth:`sigmas`) down to 0, uniform in the grid's
        time and shifted as it is (MixGRPO-Flash's compressed steps after the window)."""
        grid = torch.linspace(1.0, 1.0 / num_inference_steps, num_inference_steps)
        times = torch.linspace(float(grid[start]), 0.0, count + 1)[:-1]
        return self.shifted_sigmas(times.tolist(), shift)

    def shifted_sigmas(self, times: Sequence[float], shift: float | None = None) -> torch.Tensor:
        """The sigmas ``[len(times) + 1]`` of descending grid times in (0, 1], shifted as
        :meth:`sigmas` shifts its uniform grid, with the terminal 0 appended."""
        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        kwargs: dict[str, Any] = {}
        if shift is not None:
            sched = FlowMatchEulerDiscreteScheduler.from_config(
                self.scheduler.config, shift=shift, use_dynamic_shifting=False
            )
        elif sched.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self._dynamic_shift_mu(sched)
        sched.set_timesteps(sigmas=list(times), device="cpu", **kwargs)
        return sched.sigmas.to(torch.float32).clone()

    def _dynamic_shift_mu(self, sched: FlowMatchEulerDiscreteScheduler) -> float:
        cfg = sched.config
        seq = self.image_seq_len()
        m = (cfg.max_shift - cfg.base_shift) / (cfg.max_image_seq_len - cfg.base_image_seq_len)
        return seq * m + (cfg.base_shift - m * cfg.base_image_seq_len)

    def initial_latents(self, generators: Sequence[torch.Generator]) -> torch.Tensor:
        """Standard normal latents ``[B, *latent_shape]``, one CPU generator per sample."""
        shape = self.latent_shape()
        rows = [torch.randn(shape, generator=g, dtype=torch.float32) for g in generators]
        return torch.stack(rows).to(self.device, non_blocking=True)  # staged: no wait

    @torch.no_grad()
    def encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Text conditioning for ``prompts`` (an empty string is the unconditional prompt), on
        the model's device.

        A prompt longer than a text encoder takes is truncated, as the pipeline does; the
        first time, one note goes to the ``digen.models`` logger (a run's ``trainer.log``)
        instead of the libraries' warning per prompt on stderr.

        With ``offload_text_encoders`` the text encoders come to the model's device for this
        call only and go back to the CPU after it: the same embeddings, and no accelerator
        memory held by the encoders between calls (at the cost of two copies per call).
        """
        return self.encode_each([list(prompts)])[0]

    @torch.no_grad()
    def encode_each(self, batches: Sequence[Sequence[str]]) -> list[PromptEmbeds]:
        """:meth:`encode_prompts` of each batch of prompts in turn (each its own encoder pass,
        so its bits do not depend on the other batches), with offloaded text encoders moved
        to the device once for all of them."""
        encoders = self.text_encoders() if self.offload_text_encoders else []
        self.encoder_visits += bool(encoders)
        for encoder in encoders:
            encoder.to(self.device)
        try:
            with caught_truncation(self.pipe) as cuts:  # else a warning per prompt on stderr
                embeds = [self._encode_prompts(list(batch)) for batch in batches]
        finally:
            for encoder in encoders:
                encoder.to("cpu")
        if cuts.first is not None and not self._cut_noted:
            self._cut_noted = True
            NOTES.warning(truncation_note(self.name, cuts.first))
        return embeds

    @abstractmethod
    def _encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """The backbone's text conditioning, its text encoders already on the model's device."""

    @abstractmethod
    def forward_velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds
    ) -> torch.Tensor:
        """One transformer call: ``latents [B, ...]``, ``sigma [B]`` -> velocity ``[B, ...]``."""

    def predict_velocity(
        self,
        latents: torch.Tensor,
        sigma: torch.Tensor | float,
        cond: PromptEmbeds,
        neg_cond: PromptEmbeds | None = None,
        guidance_scale: float = 1.0,
    ) -> torch.Tensor:
        """Velocity in fp32, with classifier-free guidance when ``guidance_scale > 1``
        (:meth:`combine_guidance` of the two branches, :meth:`guided_pair`).

        ``latents``: ``[B, *latent_shape]``; ``sigma``: scalar or ``[B]``.
        """
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=latents.device)
        if sigma.ndim == 0:
            sigma = sigma.expand(b)
        if guidance_scale > 1.0 and neg_cond is not None:
            v_pos, v_neg = self.guided_pair(latents, sigma, cond, neg_cond)
            return self.combine_guidance(v_pos, v_neg, guidance_scale)
        return self.forward_velocity(latents.to(self.dtype), sigma, cond).float()

    def guided_pair(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds, neg_cond: PromptEmbeds
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The prompt's and the negative prompt's velocities ``([B, ...], [B, ...])``, fp32.

        In one process both branches run as one batch of ``2B``; with a
        :attr:`guidance_branch` this device runs its branch's rows of that same batch (the
        conditionings padded alike) and swaps velocities with the device running the other.
        """
        x = latents.to(self.dtype)
        both = _cat_padded([cond, neg_cond])
        if self.guidance_branch is None:
            v = self.forward_velocity(torch.cat([x, x]), torch.cat([sigma, sigma]), both)
            v_pos, v_neg = v.float().chunk(2)
            return v_pos, v_neg
        b = x.shape[0]
        rows = slice(0, b) if self.guidance_branch.index == 0 else slice(b, 2 * b)
        mine = self.forward_velocity(x, sigma, both.select(rows)).float()
        return self.guidance_branch.exchange(mine)

    def combine_guidance(
        self, v_pos: torch.Tensor, v_neg: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Classifier-free guidance of the two branches: ``v_neg + scale (v_pos - v_neg)``."""
        return v_neg + scale * (v_pos - v_neg)

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents [B, *latent_shape]`` -> ``uint8`` pixels ``[B, F, H, W, 3]``."""

    # --- helpers for subclasses ---------------------------------------------------------

    @staticmethod
    def to_uint8(pixels: torch.Tensor) -> torch.Tensor:
        """VAE output in ``[-1, 1]``, ``[B, 3, F, H, W]`` or ``[B, 3, H, W]`` -> ``[B, F, H, W, 3]``."""
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2)
        x = ((pixels.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return x.permute(0, 2, 3, 4, 1).contiguous()


def _cat_padded(parts: Sequence[PromptEmbeds]) -> PromptEmbeds:
    """Concatenate conditionings whose sequence lengths (dim 1) may differ, zero-padding."""
    keys = parts[0].tensors.keys()
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        ts = [p.tensors[k] for p in parts]
        if ts[0].ndim >= 2 and len({t.shape[1] for t in ts}) > 1:
            n = max(t.shape[1] for t in ts)
            ts = [torch.nn.functional.pad(t, _pad_spec(t, n)) for t in ts]
        out[k] = torch.cat(ts, dim=0)
    return PromptEmbeds(out)


def _pad_spec(t: torch.Tensor, n: int) -> list[int]:
    spec = [0, 0] * (t.ndim - 2)
    return spec + [0, n - t.shape[1]]


@contextlib.contextmanager
def _save_whatever_the_rank() -> Iterator[None]:
    """transformers writes a model's weights only on rank 0 of an initialised process group;
    a flavour is built by whichever process needs it first (a trainer of rank 1 may be)."""
    from transformers import PreTrainedModel

    if not hasattr(PreTrainedModel, "should_save_on_this_rank"):
        yield
        return
    with mock.patch.object(
        PreTrainedModel, "should_save_on_this_rank", lambda self, is_main_process: True
    ):
        yield


def _check_saved(pipe: DiffusionPipeline, directory: Path) -> None:
    """Every module of ``pipe`` left a weights file in ``directory`` (a flavour saved only in
    part must never reach the cache)."""
    for key, part in pipe.components.items():
        if isinstance(part, torch.nn.Module) and not list((directory / key).glob("*.safetensors")):
            raise DigenError(f"saving the random-init flavour wrote no weights for '{key}'.")


@contextlib.contextmanager
def _fork_rng(seed: int) -> Iterator[None]:
    """Deterministic init of tiny weights without touching the caller's global RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
