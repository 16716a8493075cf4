"""HunyuanVideo (text-to-video) over diffusers' ``HunyuanVideoPipeline``.

The transformer mixes dual- and single-stream blocks over 3D-RoPE video tokens. Text enters
twice: per-token states from a Llama encoder (the prompt wrapped in a chat template whose
tokens are cut off again, the "crop") and a pooled CLIP vector. The released model is
guidance-distilled: the guidance value enters as an embedding (``guidance_embeds=True``),
independent of the classifier-free guidance that ``predict_velocity``'s ``neg_cond`` gives.
Latents stay in the VAE layout ``[B, C, F, H, W]``; the transformer patchifies internally.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

from digen.errors import DigenError
from digen.models.base import (
    JOINT_ATTENTION_TARGETS,
    DiffusionAdapter,
    PromptEmbeds,
    make_byte_tokenizer,
)
from digen.models.parallel import Cut, SequencePlan
from digen.models.tiny import tiny_clip_text

__all__ = ["HunyuanVideoAdapter", "template_crop_start"]

#: Llama tokens after the template the pipeline keeps when nothing else is set
_PIPELINE_MAX_SEQUENCE_LENGTH = 256
#: the pipeline's default for the distilled guidance value (it feeds ``1000 *`` this)
DEFAULT_EMBEDDED_GUIDANCE = 6.0
#: HunyuanVideo's flow-matching shift
_SHIFT = 7.0
#: text tokens of the tiny flavour (kept small so its tests stay fast)
_TINY_MAX_SEQUENCE_LENGTH = 32
#: Llama-3 special tokens the chat template uses
_LLAMA_SPECIALS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")


def template_crop_start(tokenizer: Any, template: str) -> int:
    """Tokens of ``template`` before its ``{}`` slot, counting special tokens added in front.

    The pipeline drops that many leading hidden states so only the prompt's own tokens remain
    (95 for the released Llama-3 tokenizer). Tokens a tokenizer appends at the end (an EOS)
    belong after the prompt and are not counted.
    """
    if "{}" not in template:
        raise DigenError("the HunyuanVideo prompt template has no '{}' slot for the prompt.")
    prefix = template.split("{}", 1)[0]
    body = tokenizer(prefix, add_special_tokens=False, verbose=False)["input_ids"]
    # Leading special tokens (BOS): where a probe's plain ids start inside its full ids.
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    lead = next(i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain)
    return lead + len(body)


def _llama_tokenizer(model_max_length: int) -> Any:
    """A byte tokenizer with Llama-3's begin-of-text token and chat-template specials."""
    return make_byte_tokenizer(
        model_max_length=model_max_length,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        extra_special_tokens=_LLAMA_SPECIALS,
        add_bos=True,
        add_eos=False,
    )


def _text_components(
    *, llama_width: int, clip_width: int, clip_layers: int, prompt_tokens: int
) -> dict[str, Any]:
    """A 3-layer Llama ``llama_width`` wide with room for ``prompt_tokens`` after the chat
    template, and a CLIP ``clip_width`` wide taking 77 tokens."""
    from transformers import LlamaConfig, LlamaModel

    # The Llama tokenizer sees template + prompt: leave room for the prompt's tokens.
    crop = template_crop_start(_llama_tokenizer(4096), DEFAULT_PROMPT_TEMPLATE["template"])
    tokenizer = _llama_tokenizer(crop + prompt_tokens)
    tokenizer_2 = make_byte_tokenizer(
        model_max_length=77,  # the pipeline always pads CLIP input to 77
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        add_bos=True,
    )
    text_encoder = LlamaModel(
        LlamaConfig(
            vocab_size=len(tokenizer),
            hidden_size=llama_width,
            intermediate_size=2 * llama_width,
            num_hidden_layers=3,  # the pipeline reads the third-to-last hidden state
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=1024,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    )
    text_encoder_2 = tiny_clip_text(tokenizer_2, clip_width, layers=clip_layers, max_positions=77)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "tokenizer_2": tokenizer_2,
        "text_encoder_2": text_encoder_2,
    }


def _scheduler() -> FlowMatchEulerDiscreteScheduler:
    """Flow-matching Euler with HunyuanVideo's shift."""
    return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=_SHIFT)


class HunyuanVideoAdapter(DiffusionAdapter):
    """HunyuanVideo: dual/single-stream video DiT, Llama (per-token) + CLIP (pooled) text."""

    name: ClassVar[str] = "hunyuanvideo"
    pipeline_class: ClassVar[type[HunyuanVideoPipeline]] = HunyuanVideoPipeline
    is_video: ClassVar[bool] = True
    # Attention projections of the dual-stream (image + text branch), single-stream and
    # token-refiner blocks.
    #: the video tokens and the refined prompt are cut as they enter the first block, the
    #: rotary tables as the model makes them and, at every block, the joint mask over image
    #: then text tokens; joint attention in both kinds of block spans the cut (the prompt's
    #: refiner runs before it, on the whole prompt)
    sequence_plan: ClassVar[SequencePlan] = SequencePlan(
        inputs={
            "transformer_blocks.0": {
                "hidden_states": Cut(("image",), 1),  # [B, N, D]
                "encoder_hidden_states": Cut(("text",), 1),  # [B, L, D]
            },
            "*transformer_blocks.*": {"attention_mask": Cut(("image", "text"), 3, ndim=4)},
        },
        outputs={"rope": {0: Cut(("image",), 0), 1: Cut(("image",), 0)}},  # [N, d]
        attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
    )
    lora_targets: ClassVar[tuple[str, ...]] = JOINT_ATTENTION_TARGETS
    tiny_version: ClassVar[int] = 1
    tiny_height: ClassVar[int] = 32
    tiny_width: ClassVar[int] = 32
    tiny_num_frames: ClassVar[int] = 5  # 4k + 1 frames -> k + 1 latent frames
    medium_height: ClassVar[int] = 320
    medium_width: ClassVar[int] = 512
    medium_num_frames: ClassVar[int] = 33

    def __init__(
        self,
        pipe: HunyuanVideoPipeline,
        *,
        embedded_guidance: float = DEFAULT_EMBEDDED_GUIDANCE,
        prompt_template: dict[str, Any] | None = None,
        **geometry: Any,
    ) -> None:
        super().__init__(pipe, **geometry)
        #: value fed to the guidance embedding (ignored when the transformer has none)
        self.embedded_guidance = float(embedded_guidance)
        template = dict(prompt_template or DEFAULT_PROMPT_TEMPLATE)
        # The template's crop must match the loaded tokenizer, whatever the template says.
        template["crop_start"] = template_crop_start(pipe.tokenizer, template["template"])
        #: chat template around each prompt, with ``crop_start`` for the loaded tokenizer
        self.prompt_template = template
        f_s, f_t = self.pipe.vae_scale_factor_spatial, self.pipe.vae_scale_factor_temporal
        f_hw = f_s * self.transformer.config.patch_size
        if self.height % f_hw or self.width % f_hw:
            raise DigenError(
                f"HunyuanVideo needs height and width divisible by {f_hw}, "
                f"got {self.height}x{self.width}."
            )
        if (self.num_frames - 1) % f_t:
            raise DigenError(f"HunyuanVideo needs num_frames = {f_t}k + 1, got {self.num_frames}.")

    # --- random-init flavours -----------------------------------------------------------

    @classmethod
    def build_tiny_components(cls) -> dict[str, Any]:
        """Random-init HunyuanVideo at toy size: 8x/4x VAE with 16 latent channels, 16-wide text."""
        text = _text_components(
            llama_width=16, clip_width=8, clip_layers=1, prompt_tokens=_TINY_MAX_SEQUENCE_LENGTH
        )
        vae = AutoencoderKLHunyuanVideo(
            in_channels=3,
            out_channels=3,
            latent_channels=16,
            down_block_types=("HunyuanVideoDownBlock3D",) * 4,
            up_block_types=("HunyuanVideoUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            layers_per_block=1,
            norm_num_groups=4,
            scaling_factor=0.476986,  # the released VAE's
            spatial_compression_ratio=8,
            temporal_compression_ratio=4,
            mid_block_add_attention=True,
        )
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=1,
            num_single_layers=1,
            num_refiner_layers=1,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=16,  # Llama hidden size
            pooled_projection_dim=8,  # CLIP hidden size
            rope_axes_dim=(2, 2, 4),  # (t, h, w), sums to attention_head_dim
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    @classmethod
    def build_medium_components(cls) -> dict[str, Any]:
        """Random-init HunyuanVideo at 1.02B transformer parameters, for measuring on one GPU.

        The transformer keeps HunyuanVideo's blocks, head dim (128) and RoPE axes with 12 heads
        (1536 wide; released: 24) and 6 dual- + 12 single-stream blocks (released: 20 + 40);
        the VAE is the released architecture (8x / 4x down-sampling to 16 channels, 246M
        parameters). The text encoders are small stand-ins (a 3-layer Llama and a 2-layer
        CLIP, 256 wide), since they are not what is measured, but keep the pipeline's 256
        prompt tokens. About 5.1 GB on disk (fp32).
        """
        text = _text_components(
            llama_width=256,
            clip_width=256,
            clip_layers=2,
            prompt_tokens=_PIPELINE_MAX_SEQUENCE_LENGTH,
        )
        vae = AutoencoderKLHunyuanVideo()  # the defaults are the released VAE
        transformer = HunyuanVideoTransformer3DModel(
            in_channels=16,
            out_channels=16,
            num_attention_heads=12,
            attention_head_dim=128,
            num_layers=6,
            num_single_layers=12,
            num_refiner_layers=2,
            patch_size=2,
            patch_size_t=1,
            guidance_embeds=True,
            text_embed_dim=256,  # Llama hidden size
            pooled_projection_dim=256,  # CLIP hidden size
            rope_axes_dim=(16, 56, 56),  # the released model's, sums to attention_head_dim
        )
        return {**text, "vae": vae, "transformer": transformer, "scheduler": _scheduler()}

    # --- the protocol -------------------------------------------------------------------

    def image_seq_len(self) -> int:
        """Video tokens per sample after the transformer's ``(p_t, p, p)`` patching."""
        _, f, h, w = self.latent_shape()
        p, p_t = self.transformer.config.patch_size, self.transformer.config.patch_size_t
        return (f // p_t) * (h // p) * (w // p)

    def _text_length(self) -> int:
        if self.max_sequence_length is not None:
            return int(self.max_sequence_length)
        room = int(self.pipe.tokenizer.model_max_length) - self.prompt_template["crop_start"]
        return max(1, min(_PIPELINE_MAX_SEQUENCE_LENGTH, room))

    def _encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """``prompt_embeds [B, L, D_llama]``, ``prompt_attention_mask [B, L]`` (Llama, template
        cropped) and ``pooled_prompt_embeds [B, D_clip]`` (CLIP)."""
        embeds, pooled, mask = self.pipe.encode_prompt(
            prompt=list(prompts),
            prompt_template=self.prompt_template,
            num_videos_per_prompt=1,
            device=self.device,
            dtype=self.dtype,
            max_sequence_length=self._text_length(),
        )
        return PromptEmbeds(
            {
                "prompt_embeds": embeds.to(self.dtype),
                "pooled_prompt_embeds": pooled.to(self.dtype),
                "prompt_attention_mask": mask.to(self.dtype),  # 1 = token, 0 = padding
            }
        )

    def forward_velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds
    ) -> torch.Tensor:
        """``latents [B, C, F, H, W]``, ``sigma [B]`` -> velocity ``[B, C, F, H, W]``."""
        b = latents.shape[0]
        dtype, device = self.dtype, latents.device
        # The pipeline passes the scheduler's timestep, sigma * num_train_timesteps, in fp32.
        timestep = sigma.to(device, torch.float32) * self.scheduler.config.num_train_timesteps
        guidance = None
        if self.transformer.config.guidance_embeds:
            # [B]; the pipeline scales the distilled guidance by 1000 like a timestep
            guidance = torch.full((b,), self.embedded_guidance, device=device, dtype=dtype) * 1000.0
        return self.transformer(
            hidden_states=latents.to(dtype),
            timestep=timestep,
            encoder_hidden_states=cond.tensors["prompt_embeds"].to(device, dtype),  # [B, L, D]
            encoder_attention_mask=cond.tensors["prompt_attention_mask"].to(device, dtype),
            pooled_projections=cond.tensors["pooled_prompt_embeds"].to(device, dtype),
            guidance=guidance,
            return_dict=False,
        )[0]  # [B, C, F, H, W]

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents [B, C, F, H, W]`` -> ``uint8 [B, 4(F - 1) + 1, 8H, 8W, 3]``."""
        vae = self.pipe.vae
        z = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
        pixels = vae.decode(z, return_dict=False)[0]  # [B, 3, F_px, H_px, W_px] in [-1, 1]
        return self.to_uint8(pixels)
