"""FLUX.1 (dev / schnell) over diffusers' ``FluxPipeline``.

The transformer works on 2x2-packed latent tokens with 3-axis RoPE position ids; the adapter
keeps latents in the VAE layout ``[B, C, H, W]`` and packs / unpacks inside
:meth:`FluxAdapter.forward_velocity`. FLUX.1-dev is guidance-distilled: the guidance value
enters the transformer as an embedding (``guidance_embeds=True``), unrelated to
classifier-free guidance, which stays available through ``predict_velocity``'s ``neg_cond``
("true CFG" in diffusers' terms). FLUX.1-schnell has no guidance embedding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxPipeline,
    FluxTransformer2DModel,
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

__all__ = ["FluxAdapter", "pack_latents", "unpack_latents"]

#: T5 sequence length the FLUX pipeline uses when nothing else is set
_PIPELINE_MAX_SEQUENCE_LENGTH = 512
#: the pipeline's default for the distilled guidance value (FLUX.1-dev)
DEFAULT_EMBEDDED_GUIDANCE = 3.5


def pack_latents(latents: torch.Tensor) -> torch.Tensor:
    """``[B, C, H, W]`` -> ``[B, (H/2)(W/2), 4C]``: one token per 2x2 latent patch."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2)  # [B, C, H/2, 2, W/2, 2]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [B, H/2, W/2, C, 2, 2]
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """``[B, (H/2)(W/2), 4C]`` -> ``[B, C, H, W]`` (``height``/``width`` in latent pixels)."""
    b, _, d = tokens.shape
    c = d // 4
    x = tokens.view(b, height // 2, width // 2, c, 2, 2)  # [B, H/2, W/2, C, 2, 2]
    x = x.permute(0, 3, 1, 4, 2, 5)  # [B, C, H/2, 2, W/2, 2]
    return x.reshape(b, c, height, width)


def _text_components(
    *, width: int, clip_length: int, t5_length: int, words: Sequence[str] | None = None
) -> dict[str, Any]:
    """CLIP (pooled) and T5 stand-ins ``width`` wide, taking ``clip_length`` and ``t5_length``
    tokens (of bytes, or of ``words`` when given)."""
    tokenizer = tiny_clip_tokenizer(clip_length, words)
    tokenizer_2 = make_byte_tokenizer(model_max_length=t5_length, eos_token="</s>", words=words)
    return {
        "tokenizer": tokenizer,
        "text_encoder": tiny_clip_text(tokenizer, width),
        "tokenizer_2": tokenizer_2,
        "text_encoder_2": tiny_t5_encoder(tokenizer_2, width),
    }


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    """FLUX.1-dev's scheduler: the shift depends on the image token count."""
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


class FluxAdapter(DiffusionAdapter):
    """FLUX.1: MMDiT with double- and single-stream blocks, CLIP (pooled) + T5 text encoders."""

    name: ClassVar[str] = "flux"
    pipeline_class: ClassVar[type[FluxPipeline]] = FluxPipeline
    is_video: ClassVar[bool] = False
    #: the packed latent tokens and the prompt's, with the ids their rotary tables are made
    #: from, are cut as they enter; joint attention in both kinds of block spans the cut
    sequence_plan: ClassVar[SequencePlan] = SequencePlan(
        inputs={
            "": {
                "hidden_states": Cut(("image",), 1),  # [B, N, 4C]
                "encoder_hidden_states": Cut(("text",), 1),  # [B, L, D]
                "img_ids": Cut(("image",), 0),  # [N, 3]
                "txt_ids": Cut(("text",), 0),  # [L, 3]
            }
        },
        attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    )
    lora_targets: ClassVar[tuple[str, ...]] = (
        *JOINT_ATTENTION_TARGETS,
        "ff.net.0.proj",
        "ff.net.2",
        "ff_context.net.0.proj",
        "ff_context.net.2",
        "proj_mlp",
    )
    shipped_flavours: ClassVar[tuple[str, ...]] = ("shapes",)
    tiny_version: ClassVar[int] = 1
    tiny_height: ClassVar[int] = 32
    tiny_width: ClassVar[int] = 32

    def __init__(
        self,
        pipe: FluxPipeline,
        *,
        embedded_guidance: float = DEFAULT_EMBEDDED_GUIDANCE,
        **geometry: Any,
    ) -> None:
        super().__init__(pipe, **geometry)
        #: value fed to the guidance embedding (ignored when the transformer has none)
        self.embedded_guidance = float(embedded_guidance)
        self._image_ids_made: dict[tuple, torch.Tensor] = {}
        f = self.vae_scale_factor * 2
        if self.height % f or self.width % f:
            raise DigenError(
                f"FLUX needs height and width divisible by {f}, got {self.height}x{self.width}."
            )

    # --- random-init flavours -----------------------------------------------------------

    @classmethod
    def build_tiny_components(cls, *, guidance_embeds: bool = True) -> dict[str, Any]:
        """Random-init FLUX.1 at toy size: 8x VAE with 4 latent channels, 32-wide text."""
        text = _text_components(width=32, clip_length=32, t5_length=32)
        vae = tiny_autoencoder_kl(scaling_factor=0.3611, shift_factor=0.1159)  # FLUX.1's VAE
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=4 * 4,  # 2x2-packed latent channels
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 d_model
            pooled_projection_dim=32,  # CLIP hidden size
            guidance_embeds=guidance_embeds,
            axes_dims_rope=(4, 4, 8),  # sums to attention_head_dim
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    @classmethod
    def build_shapes_components(
        cls,
        *,
        width: int = 96,
        heads: int = 4,
        double_layers: int = 2,
        single_layers: int = 4,
        text_width: int = 64,
        text_length: int = 50,
        shift: float = 1.0,
        downsample: int = 2,
        words: Sequence[str] | None = None,
    ) -> dict[str, Any]:
        """Random-init FLUX.1 sized for the shapes world (:mod:`digen.shapes`) at 32 px: what
        :mod:`digen.run.shapes_pretrain` trains into the ``shapes`` flavour.

        The VAE is the identity (:func:`~digen.models.tiny.pixel_autoencoder_kl`): the latent
        is the RGB image (averaged over ``downsample`` x ``downsample`` blocks), packed 2x2
        into tokens of 12 channels (256 at 32 px; 64 with ``downsample=2``), so colours come
        out exact and nothing but the transformer and text encoders has to learn. Captions of
        the world are at most 48 bytes, so 50 text tokens hold each with CLIP's start and
        end tokens; with ``words`` (the world's vocabulary, :func:`digen.shapes.vocabulary`)
        the tokenizers are word-level and 16 tokens hold a caption. No guidance embedding
        (the model is not guidance-distilled; classifier-free guidance works instead, as it is
        trained with dropped captions). The scheduler has a fixed ``shift`` (no dynamic
        shifting: one resolution), the one training draws its sigmas with.
        """
        if width % heads or (width // heads) % 4:
            raise ValueError(f"width {width} must split into {heads} heads of a multiple of 4.")
        head = width // heads
        spatial = 3 * head // 16 * 2  # RoPE dims per image axis (even); the rest for axis 0
        text = _text_components(
            width=text_width, clip_length=text_length, t5_length=text_length, words=words
        )
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=3 * 4,  # 2x2-packed RGB
            num_layers=double_layers,
            num_single_layers=single_layers,
            attention_head_dim=head,
            num_attention_heads=heads,
            joint_attention_dim=text_width,  # T5 d_model
            pooled_projection_dim=text_width,  # CLIP hidden size
            guidance_embeds=False,
            axes_dims_rope=(head - 2 * spatial, spatial, spatial),  # sums to attention_head_dim
        )
        scheduler = FlowMatchEulerDiscreteScheduler(
            num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False
        )
        return {
            **text,
            "vae": pixel_autoencoder_kl(downsample),
            "transformer": transformer,
            "scheduler": scheduler,
        }

    @classmethod
    def build_medium_components(cls) -> dict[str, Any]:
        """Random-init FLUX.1-dev at 0.95B transformer parameters, for measuring on one GPU.

        The transformer keeps FLUX.1's blocks, head dim (128) and RoPE axes with 12 heads
        (1536 wide; FLUX.1: 24) and 6 double + 12 single blocks (FLUX.1: 19 + 38); the VAE is
        FLUX.1's own architecture (16 latent channels, 84M parameters). The text encoders are
        2-layer stand-ins 256 wide, since they are not what is measured, but keep the real
        token counts (77 CLIP, 512 T5). About 4.1 GB on disk (fp32).
        """
        text = _text_components(width=256, clip_length=77, t5_length=_PIPELINE_MAX_SEQUENCE_LENGTH)
        vae = medium_autoencoder_kl(scaling_factor=0.3611, shift_factor=0.1159)
        transformer = FluxTransformer2DModel(
            patch_size=1,
            in_channels=16 * 4,  # 2x2-packed latent channels
            num_layers=6,
            num_single_layers=12,
            attention_head_dim=128,
            num_attention_heads=12,
            joint_attention_dim=256,  # T5 d_model
            pooled_projection_dim=256,  # CLIP hidden size
            guidance_embeds=True,
            axes_dims_rope=(16, 56, 56),  # FLUX.1's, sums to attention_head_dim
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    # --- the protocol -------------------------------------------------------------------

    @property
    def vae_scale_factor(self) -> int:
        return int(self.pipe.vae_scale_factor)

    def image_seq_len(self) -> int:
        """Packed tokens per sample: one per 2x2 latent patch."""
        _, h, w = self.latent_shape()
        return (h // 2) * (w // 2)

    def _text_length(self) -> int:
        if self.max_sequence_length is not None:
            return int(self.max_sequence_length)
        return min(_PIPELINE_MAX_SEQUENCE_LENGTH, int(self.pipe.tokenizer_2.model_max_length))

    def _encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """``prompt_embeds [B, L, D_t5]`` (T5) and ``pooled_prompt_embeds [B, D_clip]`` (CLIP)."""
        prompt_embeds, pooled, _ = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_2=None,
            device=self.device,
            num_images_per_prompt=1,
            max_sequence_length=self._text_length(),
        )
        return PromptEmbeds({"prompt_embeds": prompt_embeds, "pooled_prompt_embeds": pooled})

    def _image_ids(self, h: int, w: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """FLUX's position ids of an ``h x w`` token grid ``[h w, 3]``, made once per grid
        and device (made on the host, they would be copied to the device at every step)."""
        key = (h, w, str(device), dtype)
        if key not in self._image_ids_made:
            ids = self.pipe._prepare_latent_image_ids(1, h, w, device, dtype)
            self._image_ids_made[key] = ids
        return self._image_ids_made[key]

    def forward_velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds
    ) -> torch.Tensor:
        """``latents [B, C, H, W]``, ``sigma [B]`` -> velocity ``[B, C, H, W]``."""
        b, _, h, w = latents.shape
        dtype, device = self.dtype, latents.device
        tokens = pack_latents(latents.to(dtype))  # [B, N, 4C], N = (H/2)(W/2)
        img_ids = self._image_ids(h // 2, w // 2, device, dtype)  # [N, 3]
        text = cond.tensors["prompt_embeds"].to(device, dtype)  # [B, L, D]
        pooled = cond.tensors["pooled_prompt_embeds"].to(device, dtype)  # [B, D_pool]
        txt_ids = torch.zeros(text.shape[1], 3, device=device, dtype=dtype)  # [L, 3]
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.embedded_guidance, device=device, dtype=torch.float32)
        out = self.transformer(
            hidden_states=tokens,
            timestep=sigma.to(device, dtype),  # the pipeline passes t / 1000, i.e. sigma
            guidance=guidance,
            pooled_projections=pooled,
            encoder_hidden_states=text,
            txt_ids=txt_ids,
            img_ids=img_ids,
            return_dict=False,
        )[0]  # [B, N, 4C]
        return unpack_latents(out, h, w)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents [B, C, H, W]`` -> ``uint8 [B, 1, 8H, 8W, 3]``."""
        vae = self.pipe.vae
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        pixels = vae.decode(z, return_dict=False)[0]  # [B, 3, 8H, 8W] in [-1, 1]
        return self.to_uint8(pixels)
