"""Wan (text-to-video) over diffusers' ``WanPipeline``.

A video DiT with self-attention over 3D-RoPE patches and cross-attention to UMT5 text
states; no pooled text vector and no guidance embedding, so classifier-free guidance runs
through ``predict_velocity``'s ``neg_cond``. Latents stay in the VAE layout
``[B, C, F, H, W]``, normalised per channel by the VAE's ``latents_mean`` / ``latents_std``.

Sampling uses flow-matching Euler sigmas with Wan2.1's ``flow_shift``: 3.0 (the 480p value,
used by the random-init flavours); 720p checkpoints use 5.0. Released Wan checkpoints ship a UniPC
scheduler; its ``flow_shift`` carries over to the Euler scheduler put in its place.
Single-expert checkpoints only (Wan2.1, Wan2.2 TI2V-5B): the two-expert Wan2.2 A14B
(``transformer_2``) is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    WanPipeline,
    WanTransformer3DModel,
)

from digen.errors import DigenError
from digen.models.base import DiffusionAdapter, PromptEmbeds, make_byte_tokenizer
from digen.models.parallel import Cut, SequencePlan
from digen.models.tiny import tiny_t5_encoder

__all__ = ["WanAdapter"]

#: UMT5 tokens the Wan pipeline keeps when nothing else is set
_PIPELINE_MAX_SEQUENCE_LENGTH = 226
#: Wan2.1's flow shift at 480p (720p uses 5.0)
DEFAULT_FLOW_SHIFT = 3.0
#: text tokens of the tiny flavour (kept small so its tests stay fast)
_TINY_MAX_SEQUENCE_LENGTH = 32


def _euler_scheduler(scheduler: Any) -> FlowMatchEulerDiscreteScheduler:
    """The scheduler itself when it is flow-matching Euler, else Euler with its flow shift."""
    if isinstance(scheduler, FlowMatchEulerDiscreteScheduler):
        return scheduler
    cfg = scheduler.config
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=cfg.get("num_train_timesteps", 1000),
        shift=float(cfg.get("flow_shift", None) or DEFAULT_FLOW_SHIFT),
    )


def _text_components(*, width: int, length: int) -> dict[str, Any]:
    """A UMT5 stand-in ``width`` wide whose tokenizer takes ``length`` tokens."""
    tokenizer = make_byte_tokenizer(model_max_length=length)
    return {"tokenizer": tokenizer, "text_encoder": tiny_t5_encoder(tokenizer, width, umt5=True)}


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Flow-matching Euler with Wan2.1's 480p flow shift."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=DEFAULT_FLOW_SHIFT)


class WanAdapter(DiffusionAdapter):
    """Wan2.1-style video DiT with UMT5 text cross-attention."""

    name: ClassVar[str] = "wan"
    pipeline_class: ClassVar[type[WanPipeline]] = WanPipeline
    is_video: ClassVar[bool] = True
    # Self-attention (attn1) and text cross-attention (attn2) projections of every block.
    #: the video tokens are cut as they enter the first block, with their rotary tables (and
    #: Wan 2.2's per-token timesteps); the prompt is not cut: cross-attention (``attn2``) from
    #: each device's tokens to the whole prompt needs nothing from the others
    sequence_plan: ClassVar[SequencePlan] = SequencePlan(
        inputs={
            "": {"timestep": Cut(("image",), 1, ndim=2)},  # [B, N] in Wan 2.2 TI2V only
            "blocks.0": {"hidden_states": Cut(("image",), 1)},  # [B, N, D]
        },
        outputs={"rope": {0: Cut(("image",), 1), 1: Cut(("image",), 1)}},  # [1, N, 1, d]
        attention=("blocks.*.attn1",),
    )
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    tiny_version: ClassVar[int] = 1
    tiny_height: ClassVar[int] = 32
    tiny_width: ClassVar[int] = 32
    tiny_num_frames: ClassVar[int] = 5  # 4k + 1 frames -> k + 1 latent frames
    medium_height: ClassVar[int] = 320
    medium_width: ClassVar[int] = 512
    medium_num_frames: ClassVar[int] = 33

    def __init__(self, pipe: WanPipeline, **geometry: Any) -> None:
        if getattr(pipe, "transformer_2", None) is not None:
            raise DigenError(
                "two-expert Wan checkpoints (transformer_2, Wan2.2 A14B) are not supported; "
                "use a single-transformer Wan checkpoint."
            )
        if pipe.transformer is None:
            raise DigenError("the Wan checkpoint has no transformer.")
        pipe.scheduler = _euler_scheduler(pipe.scheduler)
        super().__init__(pipe, **geometry)
        f_s, f_t = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        f_hw = f_s * self.transformer.config.patch_size[1]
        if self.height % f_hw or self.width % f_hw:
            raise DigenError(
                f"Wan needs height and width divisible by {f_hw}, got {self.height}x{self.width}."
            )
        if (self.num_frames - 1) % f_t:
            raise DigenError(f"Wan needs num_frames = {f_t}k + 1, got {self.num_frames}.")

    # --- random-init flavours -----------------------------------------------------------

    @classmethod
    def build_tiny_components(cls) -> dict[str, Any]:
        """Random-init Wan2.1 at toy size: 8x/4x VAE with 16 latent channels, 16-wide UMT5."""
        text = _text_components(width=16, length=_TINY_MAX_SEQUENCE_LENGTH)
        vae = AutoencoderKLWan(
            base_dim=4,
            z_dim=16,  # matches the 16 default latents_mean / latents_std of Wan2.1's VAE
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
        )
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=8,
            in_channels=16,
            out_channels=16,
            text_dim=16,  # UMT5 d_model
            freq_dim=32,
            ffn_dim=32,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            rope_max_seq_len=32,
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    @classmethod
    def build_medium_components(cls) -> dict[str, Any]:
        """Random-init Wan2.1-T2V-1.3B, 1.41B transformer parameters, for measuring on one GPU.

        The transformer is Wan2.1-1.3B's (1536 wide, 12 heads of 128, 30 layers, FFN 8960)
        and the VAE Wan2.1's (8x / 4x down-sampling to 16 channels, 127M parameters). The text
        encoder is a 2-layer UMT5 stand-in 256 wide (Wan2.1: UMT5-XXL, 4096), since it is not
        what is measured, but keeps the pipeline's 226 text tokens. About 6.2 GB on disk (fp32).
        """
        text = _text_components(width=256, length=512)  # UMT5's tokenizer limit
        vae = AutoencoderKLWan()  # the defaults are Wan2.1's VAE
        transformer = WanTransformer3DModel(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=256,  # UMT5 d_model
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=1024,
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    # --- the protocol -------------------------------------------------------------------

    def image_seq_len(self) -> int:
        """Video tokens per sample after the transformer's ``(p_t, p_h, p_w)`` patching."""
        _, f, h, w = self.latent_shape()
        p_t, p_h, p_w = self.transformer.config.patch_size
        return (f // p_t) * (h // p_h) * (w // p_w)

    def _text_length(self) -> int:
        if self.max_sequence_length is not None:
            return int(self.max_sequence_length)
        return min(_PIPELINE_MAX_SEQUENCE_LENGTH, int(self.pipe.tokenizer.model_max_length))

    def _encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """``prompt_embeds [B, L, D_umt5]``, zero past each prompt's last token (as the
        pipeline does; the transformer takes no text mask)."""
        embeds, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            do_classifier_free_guidance=False,
            num_videos_per_prompt=1,
            max_sequence_length=self._text_length(),
            device=self.device,
            dtype=self.dtype,
        )
        return PromptEmbeds({"prompt_embeds": embeds.to(self.dtype)})

    def forward_velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds
    ) -> torch.Tensor:
        """``latents [B, C, F, H, W]``, ``sigma [B]`` -> velocity ``[B, C, F, H, W]``."""
        b, _, f, h, w = latents.shape
        device = latents.device
        # The pipeline passes the scheduler's timestep, sigma * num_train_timesteps, in fp32.
        timestep = sigma.to(device, torch.float32) * self.scheduler.config.num_train_timesteps
        if self.pipe.config.get("expand_timesteps", False):
            # Wan2.2 TI2V: one timestep per video token, [B, F * ceil(H/2) * ceil(W/2)]
            n = f * ((h + 1) // 2) * ((w + 1) // 2)
            timestep = timestep[:, None].expand(b, n)
        return self.transformer(
            hidden_states=latents.to(self.dtype),
            timestep=timestep,
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(device, self.dtype),
            return_dict=False,
        )[0]  # [B, C, F, H, W]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents [B, C, F, H, W]`` -> ``uint8 [B, 4(F - 1) + 1, 8H, 8W, 3]``."""
        vae = self.pipe.vae
        z = latents.to(vae.device, vae.dtype)
        c = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(
            z.device, z.dtype
        )
        z = z / inv_std + mean  # undo the per-channel normalisation, as the pipeline does
        pixels = vae.decode(z, return_dict=False)[0]  # [B, 3, F_px, H_px, W_px] in [-1, 1]
        return self.to_uint8(pixels)
