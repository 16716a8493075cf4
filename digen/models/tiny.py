"""Building blocks of the random-init flavours: small text encoders and the image VAEs.

The real architectures, shared by the backbones whose pipelines use them, so a tiny FLUX and a
tiny SD3 build their T5 (or a tiny Wan its UMT5) the same way. The text encoders are toy-sized
in both flavours (the medium flavour measures the transformer and VAE, not the text encoders);
the image VAE comes at toy size and at the real FLUX.1 / SD3 size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from digen.models.base import make_byte_tokenizer

__all__ = [
    "medium_autoencoder_kl",
    "pixel_autoencoder_kl",
    "tiny_autoencoder_kl",
    "tiny_clip_text",
    "tiny_clip_tokenizer",
    "tiny_t5_encoder",
]


def tiny_clip_tokenizer(max_length: int = 32, words: Sequence[str] | None = None) -> Any:
    """A byte tokenizer (a word-level one over ``words`` when given) with CLIP's start /
    end-of-text tokens around every prompt."""
    return make_byte_tokenizer(
        model_max_length=max_length,
        bos_token="<|startoftext|>",
        eos_token="<|endoftext|>",
        add_bos=True,
        words=words,
    )


def tiny_t5_encoder(tokenizer: Any, d_model: int, *, umt5: bool = False) -> Any:
    """A 2-layer, 4-head (U)T5 encoder ``d_model`` wide (gated GELU, as T5 v1.1 / UMT5)."""
    if umt5:
        from transformers import UMT5Config as Config
        from transformers import UMT5EncoderModel as Model
    else:
        from transformers import T5Config as Config
        from transformers import T5EncoderModel as Model
    return Model(
        Config(
            vocab_size=len(tokenizer),
            d_model=d_model,
            d_kv=d_model // 4,
            d_ff=2 * d_model,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
            feed_forward_proj="gated-gelu",
            is_encoder_decoder=False,
            use_cache=False,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )


def tiny_clip_text(
    tokenizer: Any,
    hidden: int,
    *,
    layers: int = 2,
    max_positions: int | None = None,
    with_projection: bool = False,
    act: str = "quick_gelu",
) -> Any:
    """A CLIP text encoder ``hidden`` wide, pooled at the tokenizer's end-of-text token."""
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    model = CLIPTextModelWithProjection if with_projection else CLIPTextModel
    return model(
        CLIPTextConfig(
            vocab_size=len(tokenizer),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=2,
            max_position_embeddings=max_positions or tokenizer.model_max_length,
            projection_dim=hidden,
            hidden_act=act,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,  # CLIP pools at the first end-of-text
            pad_token_id=tokenizer.pad_token_id,
        )
    )


def tiny_autoencoder_kl(*, scaling_factor: float, shift_factor: float) -> Any:
    """An 8x-downsampling ``AutoencoderKL`` with 4 latent channels and the given statistics."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8, 8, 16, 16),
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )


#: the constant channel that pins the single GroupNorm's statistics (see pixel_autoencoder_kl)
_PIXEL_ANCHOR = 1000.0


def pixel_autoencoder_kl(downsample: int = 1) -> Any:
    """An ``AutoencoderKL`` whose latent is the image itself, averaged over ``downsample`` x
    ``downsample`` blocks (a power of two): 3 channels; decoding repeats each latent pixel
    over its block. At ``downsample=1`` encode and decode are the identity (to about 1e-6),
    so a diffusion model over it works in pixel space with no VAE to train and exact colours;
    at 2 it works on a quarter of the pixels (a quarter of the tokens) and draws in 2 px
    steps.

    The real class with set weights, so it saves, loads and runs as any pipeline's VAE. Every
    ResNet's second convolution is zero (each block passes its input through) and there is no
    attention, so each half reduces to ``conv_out(silu(norm(resample(conv_in(x)))))``:
    ``conv_in`` writes ``[r, -r, g, -g, b, -b, K, -K]``; each down-sampler (a stride-2 conv)
    averages 2 x 2 blocks and each up-sampler (nearest, then a conv) keeps what it repeats;
    the one-group norm then has mean exactly 0 and variance ``K^2 / 4`` up to
    ``mean(x^2) / 4``, so with ``K = 1000`` it only scales by ``2 / K``, which its affine weight
    undoes; and ``silu(a) - silu(-a) == a`` exactly, which ``conv_out`` takes. The encoder's
    log-variance is -30: its samples are its means.
    """
    from diffusers import AutoencoderKL

    levels = downsample.bit_length() - 1
    if downsample < 1 or 1 << levels != downsample:
        raise ValueError(f"downsample {downsample} must be a power of two.")
    vae = AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * (levels + 1),
        up_block_types=("UpDecoderBlock2D",) * (levels + 1),
        block_out_channels=(8,) * (levels + 1),
        layers_per_block=1,
        latent_channels=3,
        norm_num_groups=1,
        mid_block_add_attention=False,
        sample_size=32,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=1.0,
        shift_factor=0.0,
    )
    k = _PIXEL_ANCHOR
    eye = torch.eye(8)  # [8, 8]: channel to itself
    with torch.no_grad():
        for p in vae.parameters():
            p.zero_()
        for half in (vae.encoder, vae.decoder):
            for name, p in half.named_parameters():
                if ".norm" in name and name.endswith("weight"):
                    p.fill_(1.0)  # unused (their branch ends in a zero conv), but sane
            w_in = half.conv_in.weight  # [8, 3, 3, 3]; only the centre tap
            for c in range(3):
                w_in[2 * c, c, 1, 1] = 1.0
                w_in[2 * c + 1, c, 1, 1] = -1.0
            half.conv_in.bias[6], half.conv_in.bias[7] = k, -k
            half.conv_norm_out.weight.fill_(k / 2)
            w_out = half.conv_out.weight  # [3 or 6, 8, 3, 3]
            for c in range(3):
                w_out[c, 2 * c, 1, 1] = 1.0
                w_out[c, 2 * c + 1, 1, 1] = -1.0
        for block in vae.encoder.down_blocks:
            for down in block.downsamplers or ():
                # stride 2 over the input padded right and below: taps 0..1 are the block
                down.conv.weight[:, :, :2, :2] = eye[:, :, None, None] / 4  # [8, 8, 2, 2]
        for block in vae.decoder.up_blocks:
            for up in block.upsamplers or ():
                up.conv.weight[:, :, 1, 1] = eye  # after nearest up-sampling: keep it
        vae.encoder.conv_out.bias[3:] = -30.0  # log-variance
    return vae


def medium_autoencoder_kl(*, scaling_factor: float, shift_factor: float) -> Any:
    """FLUX.1's and SD3's ``AutoencoderKL``: 8x down-sampling to 16 latent channels, 84M
    parameters, tiles of 1024 px when tiling is on."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(128, 256, 512, 512),
        layers_per_block=2,
        latent_channels=16,
        norm_num_groups=32,
        sample_size=1024,
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling_factor,
        shift_factor=shift_factor,
    )
