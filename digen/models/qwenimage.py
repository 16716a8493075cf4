"""Qwen-Image: an MMDiT over 2x2-packed latents, Qwen2.5-VL text conditioning, a causal 3-D VAE.

What is particular to this backbone:

- The VAE (``AutoencoderKLQwenImage``) works on 5-D ``[B, C, F, H, W]`` tensors; the adapter keeps
  image latents as ``[B, C, H, W]`` and adds the frame axis only around ``vae.decode``.
- The transformer sees ``[B, (H/2)(W/2), 4C]`` tokens (one per 2x2 latent patch); packing and
  unpacking happen inside :meth:`QwenImageAdapter.forward_velocity`.
- Prompts are wrapped in a chat template and the text encoder's hidden states of the template
  prefix are dropped. The pipeline hard-codes that prefix as 34 tokens (right for the real Qwen
  tokenizer only); the adapter recomputes it from whatever tokenizer was loaded.
- True CFG renormalises the guided prediction of every token to the norm of the conditional one
  (:meth:`QwenImageAdapter.predict_velocity`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLQwenImage,
    FlowMatchEulerDiscreteScheduler,
    QwenImagePipeline,
    QwenImageTransformer2DModel,
)

from digen.errors import DigenError
from digen.models.base import DiffusionAdapter, PromptEmbeds, make_byte_tokenizer
from digen.models.parallel import Cut, SequencePlan

__all__ = ["QwenImageAdapter"]

#: the pipeline's own default for ``max_sequence_length`` (prompt tokens kept after the crop)
_DEFAULT_MAX_SEQUENCE_LENGTH = 512

#: special tokens of the Qwen2.5-VL vocabulary the tiny tokenizer needs as single ids
_CHAT_TOKENS = (
    "<|im_start|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: the scheduler config Qwen-Image ships with (exponential dynamic shift, terminal sigma 0.02)
_SCHEDULER_CONFIG: dict[str, Any] = {
    "num_train_timesteps": 1000,
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
    "time_shift_type": "exponential",
}


def _text_components(*, width: int, mrope_section: list[int]) -> dict[str, Any]:
    """A 2-layer Qwen2.5-VL ``width`` wide with two query heads (a one-block vision tower it
    never uses), and a byte tokenizer with the chat-template tokens."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer = make_byte_tokenizer(
        model_max_length=2048,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=_CHAT_TOKENS,
        add_eos=False,  # the Qwen tokenizer appends nothing; the template closes the turn
    )
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in _CHAT_TOKENS}
    config = Qwen2_5_VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "max_position_embeddings": 2048,
            "rope_parameters": {
                "rope_type": "default",
                "mrope_section": mrope_section,
                "rope_theta": 1e6,
            },
            "bos_token_id": None,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "depth": 1,
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_heads": 2,
            "out_hidden_size": width,
            "fullatt_block_indexes": [0],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text_encoder = Qwen2_5_VLForConditionalGeneration(config).eval()
    return {"tokenizer": tokenizer, "text_encoder": text_encoder}


class QwenImageAdapter(DiffusionAdapter):
    """Qwen-Image over ``diffusers.QwenImagePipeline``."""

    name: ClassVar[str] = "qwenimage"
    pipeline_class: ClassVar[type[QwenImagePipeline]] = QwenImagePipeline
    is_video: ClassVar[bool] = False
    #: attention projections of both streams and the image MLP. The text stream's outputs
    #: (``attn.to_add_out``, ``txt_mlp``) are left out: in the last block they never reach the
    #: image tokens, so their LoRA weights would get no gradient at all (a failure under DDP
    #: without ``find_unused_parameters``); the text stream still adapts through
    #: ``add_{q,k,v}_proj``. Pass them explicitly to reproduce a recipe that trains them.
    #: image and prompt tokens are cut as they enter the first block, the rotary tables of
    #: both as the model makes them and the prompt's padding mask at every block; joint
    #: attention spans the cut
    sequence_plan: ClassVar[SequencePlan] = SequencePlan(
        inputs={
            "transformer_blocks.0": {
                "hidden_states": Cut(("image",), 1),  # [B, N, D]
                "encoder_hidden_states": Cut(("text",), 1),  # [B, L, D]
            },
            "transformer_blocks.*": {"encoder_hidden_states_mask": Cut(("text",), 1)},  # [B, L]
        },
        outputs={"pos_embed": {0: Cut(("image",), 0), 1: Cut(("text",), 0)}},  # [N|L, d]
        attention=("transformer_blocks.*.attn",),
    )
    lora_targets: ClassVar[tuple[str, ...]] = (
        "attn.to_q",
        "attn.to_k",
        "attn.to_v",
        "attn.to_out.0",
        "attn.add_q_proj",
        "attn.add_k_proj",
        "attn.add_v_proj",
        "img_mlp.net.0.proj",
        "img_mlp.net.2",
    )
    tiny_version: ClassVar[int] = 1

    def __init__(self, pipe: QwenImagePipeline, **geometry: Any) -> None:
        super().__init__(pipe, **geometry)
        multiple = self.pipe.vae_scale_factor * 2
        if self.height % multiple or self.width % multiple:
            raise DigenError(
                f"qwenimage needs height and width divisible by {multiple}; "
                f"got {self.height}x{self.width}."
            )
        pipe.prompt_template_encode_start_idx = _template_start_index(pipe)

    # --- random-init flavours -----------------------------------------------------------

    @classmethod
    def build_tiny_components(cls) -> dict[str, Any]:
        """Real classes at toy size: 2-block MMDiT (width 32), 2-layer Qwen2.5-VL, 3-level VAE."""
        # head_dim 16: the M-RoPE sections split its 8 frequencies over (t, h, w)
        text = _text_components(width=32, mrope_section=[2, 3, 3])
        z_dim = 4
        vae = AutoencoderKLQwenImage(
            base_dim=16,
            z_dim=z_dim,
            dim_mult=[1, 2, 4],  # two downsamples: 32 px -> 8 latent, vae_scale_factor 4
            num_res_blocks=1,
            temperal_downsample=[False, True],
            # not the identity, so tests see the de-normalisation in decode
            latents_mean=[-0.1, 0.0, 0.1, 0.2],
            latents_std=[0.8, 0.9, 1.1, 1.2],
        )
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,
            out_channels=z_dim,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,  # Qwen2.5-VL hidden size
            axes_dims_rope=(8, 4, 4),  # sums to attention_head_dim
        )
        scheduler = FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG)
        return {**text, "vae": vae, "transformer": transformer, "scheduler": scheduler}

    @classmethod
    def build_medium_components(cls) -> dict[str, Any]:
        """Random-init Qwen-Image at 1.03B transformer parameters, for measuring on one GPU.

        The transformer keeps Qwen-Image's blocks, head dim (128) and RoPE axes with 12 heads
        (1536 wide; released: 24) and 12 blocks (released: 60); the VAE is the released
        architecture (8x down-sampling to 16 channels, 127M parameters). The text encoder is a
        2-layer Qwen2.5-VL stand-in 256 wide (released: 7B, 3584 wide), since it is not what is
        measured. About 4.6 GB on disk (fp32).
        """
        # head_dim 128: Qwen2.5-VL's M-RoPE sections split its 64 frequencies over (t, h, w)
        text = _text_components(width=256, mrope_section=[16, 24, 24])
        z_dim = 16
        vae = AutoencoderKLQwenImage(z_dim=z_dim)  # the defaults are the released VAE
        transformer = QwenImageTransformer2DModel(
            patch_size=2,
            in_channels=4 * z_dim,
            out_channels=z_dim,
            num_layers=12,
            attention_head_dim=128,
            num_attention_heads=12,
            joint_attention_dim=256,  # Qwen2.5-VL hidden size
            axes_dims_rope=(16, 56, 56),  # the released model's, sums to attention_head_dim
        )
        scheduler = FlowMatchEulerDiscreteScheduler(**_SCHEDULER_CONFIG)
        return {**text, "vae": vae, "transformer": transformer, "scheduler": scheduler}

    # --- geometry -----------------------------------------------------------------------

    def latent_shape(self) -> tuple[int, int, int]:
        """``(C, H / s, W / s)``, ``s`` the VAE's spatial factor, as the pipeline computes it."""
        channels = self.transformer.config.in_channels // 4
        multiple = self.pipe.vae_scale_factor * 2
        return channels, 2 * (self.height // multiple), 2 * (self.width // multiple)

    def image_seq_len(self) -> int:
        """Packed tokens per sample, ``(H_lat / 2) (W_lat / 2)``, as the pipeline feeds ``mu``."""
        _, h, w = self.latent_shape()
        return (h // 2) * (w // 2)

    # --- conditioning -------------------------------------------------------------------

    def _encode_prompts(self, prompts: Sequence[str]) -> PromptEmbeds:
        """``prompt_embeds [B, L, D]`` and ``prompt_embeds_mask [B, L]`` (0 marks padding).

        ``L`` is the longest templated prompt of the batch after the template prefix is cropped,
        capped at ``max_sequence_length``.
        """
        max_len = self.max_sequence_length or _DEFAULT_MAX_SEQUENCE_LENGTH
        embeds, mask = self.pipe.encode_prompt(
            list(prompts), device=self.device, max_sequence_length=max_len
        )
        if mask is None:  # the pipeline drops an all-ones mask; keep one so batches concatenate
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
        return PromptEmbeds({"prompt_embeds": embeds, "prompt_embeds_mask": mask})

    # --- denoiser -----------------------------------------------------------------------

    def forward_velocity(
        self, latents: torch.Tensor, sigma: torch.Tensor, cond: PromptEmbeds
    ) -> torch.Tensor:
        """``latents [B, C, H, W]``, ``sigma [B]`` -> velocity ``[B, C, H, W]`` (model dtype)."""
        b, _, h, w = latents.shape
        tokens = self._pack(latents.to(self.dtype))  # [B, (H/2)(W/2), 4C]
        embeds = cond.tensors["prompt_embeds"].to(self.device, self.dtype)  # [B, L, D]
        mask = cond.tensors["prompt_embeds_mask"].to(self.device)  # [B, L]
        if bool(mask.all()):
            mask = None  # as the pipeline does: no padding, no attention mask
        out = self.transformer(
            hidden_states=tokens,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=sigma.to(self.device, torch.float32),  # the pipeline's t / 1000
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]  # [B, (H/2)(W/2), 4C]
        return self._unpack(out, h, w)

    def combine_guidance(
        self, v_pos: torch.Tensor, v_neg: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Qwen-Image's true CFG, as ``QwenImagePipeline`` does it with ``true_cfg_scale``:
        ``comb = neg + s (pos - neg)``, then each packed token (a 2x2 patch over all channels)
        of ``comb`` rescaled to the norm of the same token of ``pos``; ``[B, C, H, W]``."""
        h, w = v_pos.shape[-2:]
        pos, neg = self._pack(v_pos), self._pack(v_neg)  # [B, S, 4C]
        comb = neg + scale * (pos - neg)
        cond_norm = torch.norm(pos, dim=-1, keepdim=True)  # [B, S, 1]
        comb_norm = torch.norm(comb, dim=-1, keepdim=True)
        return self._unpack(comb * (cond_norm / comb_norm), h, w)

    # --- pixels -------------------------------------------------------------------------

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """``latents [B, C, H, W]`` -> ``uint8 [B, 1, H_px, W_px, 3]``."""
        vae = self.pipe.vae
        z = latents.unsqueeze(2).to(vae.device, vae.dtype)  # [B, C, 1, H, W]
        shape = (1, vae.config.z_dim, 1, 1, 1)
        mean = torch.tensor(vae.config.latents_mean).view(shape).to(z.device, z.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(shape).to(z.device, z.dtype)
        z = z / inv_std + mean  # written as the pipeline writes it, for identical rounding
        pixels = vae.decode(z, return_dict=False)[0][:, :, 0]  # [B, 3, H_px, W_px]
        return self.to_uint8(pixels)

    # --- packing ------------------------------------------------------------------------

    def _pack(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, C, H, W]`` -> ``[B, (H/2)(W/2), 4C]``, the transformer's token layout."""
        b, c, h, w = x.shape
        return self.pipe._pack_latents(x.contiguous(), b, c, h, w)

    def _unpack(self, tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """``[B, (H/2)(W/2), 4C]`` -> ``[B, C, H, W]`` for latent height ``h`` and width ``w``."""
        s = self.pipe.vae_scale_factor
        return self.pipe._unpack_latents(tokens, h * s, w * s, s)[:, :, 0]


def _template_start_index(pipe: QwenImagePipeline) -> int:
    """Tokens of the chat-template prefix that ``encode_prompt`` crops from the hidden states.

    Counted as the leading tokens two templated prompts share, so it includes whatever the
    loaded tokenizer prepends and equals the tokenized prefix (34 for the real Qwen2.5-VL
    tokenizer, one per byte and special token for the tiny byte tokenizer).
    """
    tok, template = pipe.tokenizer, pipe.prompt_template_encode
    a, b = (tok(template.format(p)).input_ids for p in ("a", "b"))
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
