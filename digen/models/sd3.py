"""Stable Diffusion 3 / 3.5 over diffusers' ``StableDiffusion3Pipeline``.

The MMDiT patchifies the VAE latents itself, so latents go in and out in the VAE layout
``[B, C, H, W]``. Text conditioning joins two CLIP encoders (penultimate hidden states and
projected pooled outputs) with T5; classifier-free guidance uses a negative conditioning
encoded the same way (``encode_prompts([""] * B)`` for the usual empty negative prompt).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    SD3Transformer2DModel,
    StableDiffusion3Pipeline,
)

from digen.errors import DigenError
from digen.models.base import (
    JOINT_ATTENTION_TARGETS,
    DiffusionAdapter,
    PromptEmbeds,
    make_byte_tokenizer,
)
from digen.models.parallel import Cut, SequencePlan
from digen.models.tiny import (
    medium_autoencoder_kl,
    pixel_autoencoder_kl,
    tiny_autoencoder_kl,
    tiny_clip_text,
    tiny_clip_tokenizer,
    tiny_t5_encoder,
)

__all__ = ["SD3Adapter"]

#: T5 sequence length the SD3 pipeline uses when nothing else is set
_PIPELINE_MAX_SEQUENCE_LENGTH = 256


def _text_components(
    *,
    clip_widths: tuple[int, int],
    t5_width: int,
    clip_length: int,
    t5_length: int,
    words: Sequence[str] | None = None,
) -> dict[str, Any]:
    """CLIP-L, CLIP-G (both with projections) and T5 stand-ins of the given widths, taking
    ``clip_length`` and ``t5_length`` tokens (of bytes, or of ``words`` when given)."""
    tokenizer = tiny_clip_tokenizer(clip_length, words)
    tokenizer_2 = tiny_clip_tokenizer(clip_length, words)
    tokenizer_3 = make_byte_tokenizer(model_max_length=t5_length, eos_token="</s>", words=words)
    clip_l, clip_g = clip_widths
    return {
        "tokenizer": tokenizer,
        "text_encoder": tiny_clip_text(tokenizer, clip_l, with_projection=True, act="gelu"),
        "tokenizer_2": tokenizer_2,
        "text_encoder_2": tiny_clip_text(tokenizer_2, clip_g, with_projection=True, act="gelu"),
        "tokenizer_3": tokenizer_3,
        "text_encoder_3": tiny_t5_encoder(tokenizer_3, t5_width),
    }


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    """SD3's and SD3.5's scheduler: a static shift of 3."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)


class SD3Adapter(DiffusionAdapter):
    """SD3 / SD3.5: joint-attention MMDiT, CLIP-L + CLIP-G + T5 text encoders."""

    name: ClassVar[str] = "sd3"
    pipeline_class: ClassVar[type[StableDiffusion3Pipeline]] = StableDiffusion3Pipeline
    is_video: ClassVar[bool] = False
    # attention projections of both streams (``attn`` and SD3.5-medium's ``attn2``)
    #: the patch tokens (position embedding added) and the prompt's are cut as they enter the
    #: first block; joint attention (and SD3.5's second, image-only attention) spans the cut
    sequence_plan: ClassVar[SequencePlan] = SequencePlan(
        inputs={
            "transformer_blocks.0": {
                "hidden_states": Cut(("image",), 1),  # [B, N, D]
                "encoder_hidden_states": Cut(("text",), 1),  # [B, L, D]
            }
        },
        attention=("transformer_blocks.*.attn", "transformer_blocks.*.attn2"),
    )
    lora_targets: ClassVar[tuple[str, ...]] = JOINT_ATTENTION_TARGETS
    shipped_flavours: ClassVar[tuple[str, ...]] = ("shapes",)
    tiny_version: ClassVar[int] = 1
    tiny_height: ClassVar[int] = 32
    tiny_width: ClassVar[int] = 32

    def __init__(self, pipe: StableDiffusion3Pipeline, **geometry: Any) -> None:
        super().__init__(pipe, **geometry)
        f = self.vae_scale_factor * int(self.transformer.config.patch_size)
        if self.height % f or self.width % f:
            raise DigenError(
                f"SD3 needs height and width divisible by {f}, got {self.height}x{self.width}."
            )

    # --- random-init flavours -----------------------------------------------------------

    @classmethod
    def build_tiny_components(cls) -> dict[str, Any]:
        """Random-init SD3.5 at toy size: 8x VAE with 4 latent channels, 2 small CLIPs + T5."""
        # CLIP-L / CLIP-G stand-ins: hidden 16 + 24 = 40 <= T5 width 48 (the pipeline pads
        # the concatenated CLIP states up to the T5 width), pooled 16 + 24 = 40
        text = _text_components(clip_widths=(16, 24), t5_width=48, clip_length=32, t5_length=32)
        vae = tiny_autoencoder_kl(scaling_factor=1.5305, shift_factor=0.0609)  # SD3's VAE
        transformer = SD3Transformer2DModel(
            sample_size=4,  # latent side at the tiny geometry
            patch_size=2,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=48,  # T5 d_model
            caption_projection_dim=32,  # = heads * head_dim
            pooled_projection_dim=40,  # CLIP-L + CLIP-G projections
            pos_embed_max_size=32,  # latents up to 64x64 (512 px)
            dual_attention_layers=(0,),  # SD3.5-medium style self-attention branch
            qk_norm="rms_norm",
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    @classmethod
    def build_shapes_components(
        cls,
        *,
        width: int = 96,
        heads: int = 4,
        layers: int = 4,
        text_width: int = 64,
        text_length: int = 50,
        shift: float = 1.0,
        downsample: int = 2,
        words: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Random-init SD3.5 sized for the shapes world (:mod:`digen.shapes`) at 32 px: what
        :mod:`digen.run.shapes_pretrain` trains into SD3's ``shapes`` flavour, the same world
        and VAE as FLUX's (:meth:`~digen.models.flux.FluxAdapter.build_shapes_components`).

        The VAE is the identity over 2x2 block averages (:func:`~digen.models.tiny.pixel_autoencoder_kl`),
        so the latent is the 16 x 16 RGB image and the MMDiT's 2x2 patches make 64 tokens.
        ``layers`` joint blocks (the first with SD3.5-medium's extra self-attention branch)
        ``width`` wide; CLIP-L and CLIP-G stand-ins half of ``text_width`` each (their
        concatenated hidden states are T5's width, so the pipeline pads nothing) and a T5
        ``text_width`` wide, each taking ``text_length`` tokens (captions of the world are at
        most 48 bytes; with ``words``, the world's vocabulary, the tokenizers are word-level and
        16 tokens hold a caption). A fixed ``shift``, the one training draws its sigmas with.
        """
        if width % heads:
            raise ValueError(f"width {width} must split into {heads} heads.")
        half = text_width // 2
        text = _text_components(
            clip_widths=(half, text_width - half),
            t5_width=text_width,
            clip_length=text_length,
            t5_length=text_length,
            words=words,
        )
        side = 32 // downsample  # the latent's side at 32 px
        transformer = SD3Transformer2DModel(
            sample_size=side,
            patch_size=2,
            in_channels=3,
            out_channels=3,
            num_layers=layers,
            attention_head_dim=width // heads,
            num_attention_heads=heads,
            joint_attention_dim=text_width,  # T5 d_model
            caption_projection_dim=width,
            pooled_projection_dim=text_width,  # CLIP-L + CLIP-G projections
            pos_embed_max_size=side // 2,
            dual_attention_layers=(0,),
            qk_norm="rms_norm",
        )
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift)
        return {
            **text,
            "vae": pixel_autoencoder_kl(downsample),
            "transformer": transformer,
            "scheduler": scheduler,
        }

    @classmethod
    def build_medium_components(cls) -> dict[str, Any]:
        """Random-init SD3.5-medium at half depth, 1.10B transformer parameters, for measuring
        on one GPU.

        The transformer is SD3.5-medium's width (24 heads of 64, 1536) with 12 of its 24 blocks,
        the first 6 with the dual attention branch (SD3.5-medium: the first 13), and SD3's
        position table (192 patches a side, up to 3072 px); the VAE is SD3's own architecture
        (16 latent channels, 84M parameters). The text encoders are 2-layer stand-ins (CLIPs
        64 and 128 wide, T5 256 wide), since they are not what is measured, but keep the real
        token counts (77 CLIP, 256 T5). About 5.0 GB on disk (fp32).
        """
        text = _text_components(clip_widths=(64, 128), t5_width=256, clip_length=77, t5_length=512)
        vae = medium_autoencoder_kl(scaling_factor=1.5305, shift_factor=0.0609)
        transformer = SD3Transformer2DModel(
            sample_size=64,  # latent side at the medium geometry
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=12,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=256,  # T5 d_model
            caption_projection_dim=1536,  # = heads * head_dim
            pooled_projection_dim=64 + 128,  # CLIP-L + CLIP-G projections
            pos_embed_max_size=192,
            dual_attention_layers=tuple(range(6)),
            qk_norm="rms_norm",
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    # --- the protocol -------------------------------------------------------------------

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def image_seq_len(self) -> int:
        """Patch tokens per sample."""
        _, h, w = self.latent_shape()
        p = int(self.transformer.config.patch_size)
        return (h // p) * (w // p)

    def sigmas(self, num_inference_steps: int, shift: float | None = None) -> torch.Tensor:
        """Sigmas ``[N + 1]`` of the SD3 pipeline's default schedule, ending in 0.

        Unlike FLUX, the SD3 pipeline passes no sigmas: the scheduler spaces the timesteps
        evenly between its shifted ``sigma_max`` (1) and ``sigma_min`` and shifts them again,
        which ends much closer to 0 than ``linspace(1, 1 / N, N)`` does. A fixed ``shift``
        takes the uniform grid of the base class instead.
        """
        if shift is not None:
            return super().sigmas(num_inference_steps, shift)
        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        kwargs: dict[str, Any] = {}
        if sched.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self._dynamic_shift_mu(sched)
        sched.set_timesteps(num_inference_steps=num_inference_steps, device="cpu", **kwargs)
        return sched.sigmas.to(torch.float32).clone()

    def tail_sigmas(
        self, num_inference_steps: int, start: int, count: int, shift: float | None = None
    ) -> torch.Tensor:
        """As the base class's, on SD3's own grid: the grid time of step ``start`` is its
        sigma with the scheduler's fixed shift undone."""
        if shift is not None:
            return super().tail_sigmas(num_inference_steps, start, count, shift)
        sched = FlowMatchEulerDiscreteScheduler.from_config(self.scheduler.config)
        if sched.config.get("use_dynamic_shifting", False):
            raise ValueError(
                "a compressed tail (rollout.post_compress < 1) on a dynamically shifted SD3 "
                "schedule needs a fixed rollout.shift"
            )
        s = float(sched.config.shift)
        sigma = float(self.sigmas(num_inference_steps)[start])
        grid = sigma / (s - (s - 1.0) * sigma)  # s g / (1 + (s - 1) g) = sigma
        times = torch.linspace(grid, 0.0, count + 1)[:-1]
        return self.shifted_sigmas(times.tolist(), None)

    def _text_length(self) -> int:
        if self.max_sequence_length is not None:
            return int(self.max_sequence_length)
        tok = self.pipe.tokenizer_3
        limit = int(tok.model_max_length) if tok is not None else _PIPELINE_MAX_SEQUENCE_LENGTH
        return min(_PIPELINE_MAX_SEQUENCE_LENGTH, limit)

    def _encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """``prompt_embeds [B, L_clip + L_t5, D_t5]`` and ``pooled_prompt_embeds [B, D_pool]``."""
        prompt_embeds, _, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            prompt_3=None,
            device=self.device,
            num_images_per_prompt=1,
            do_classifier_free_guidance=False,
            max_sequence_length=self._text_length(),
        )
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled})

    def forward_velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds
    ) -> torch.Tensor:
        """``latents [B, C, H, W]``, ``sigma [B]`` -> velocity ``[B, C, H, W]``."""
        dtype, device = self.dtype, latents.device
        # the pipeline passes the scheduler's timestep, sigma * num_train_timesteps, in fp32
        t = sigma.to(device, torch.float32) * self.scheduler.config.num_train_timesteps  # [B]
        return self.transformer(
            hidden_states=latents.to(dtype),
            timestep=t,
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(device, dtype),  # [B, L, D]
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(device, dtype),  # [B, P]
            return_dict=False,
        )[0]  # [B, C, H, W]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents [B, C, H, W]`` -> ``uint8 [B, 1, 8H, 8W, 3]``."""
        vae = self.pipe.vae
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        pixels = vae.decode(z, return_dict=False)[0]  # [B, 3, 8H, 8W] in [-1, 1]
        return self.to_uint8(pixels)
