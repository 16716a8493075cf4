"""The adapter protocol on the tiny flavour of every registered backbone.

Every test runs once per name in ``MODEL_NAMES``, so a backbone added to the registry is
tested here with no edit. Tests that take ``flavour`` also need its row in ``FLAVOURS``: the
numbers of its tiny flavour and of its released scheduler, written down apart from the adapter
and checked against the diffusers components. What only one backbone does (its packing, its
text template, the call of its diffusers pipeline) is tested in ``test_<name>.py``.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from backbone_helpers import PROMPTS, generators, guidance_parts, private_copy
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.flux.pipeline_flux import calculate_shift
from peft import LoraConfig
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from digen.errors import DigenError
from digen.models import BACKBONES, MODEL_NAMES, get_adapter_class
from digen.models.base import DiffusionAdapter

#: black-forest-labs/FLUX.1-dev scheduler/scheduler_config.json
FLUX_DEV_SCHEDULER = {
    "shift": 3.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
    "base_shift": 0.5,
    "max_shift": 1.15,
    "base_image_seq_len": 256,
    "max_image_seq_len": 4096,
}
#: Qwen/Qwen-Image scheduler/scheduler_config.json
QWEN_IMAGE_SCHEDULER = {
    "shift": 1.0,
    "use_dynamic_shifting": True,
    "time_shift_type": "exponential",
    "base_shift": 0.5,
    "max_shift": 0.9,
    "base_image_seq_len": 256,
    "max_image_seq_len": 8192,
    "shift_terminal": 0.02,
}


def _static_shift(shift: float) -> dict[str, Any]:
    return {"shift": shift, "use_dynamic_shifting": False, "shift_terminal": None}


@dataclass(frozen=True)
class Flavour:
    """A backbone's tiny flavour and released scheduler, as the tests expect them."""

    latent_shape: tuple[int, ...]
    """Per-sample latents at the tiny geometry: ``(C, H, W)`` or ``(C, F, H, W)``."""
    seq_len: int
    """Transformer tokens per sample at the tiny geometry."""
    text: tuple[int | None, int]
    """``prompt_embeds`` ``(L, D)``; ``L`` None: padded to the batch's longest prompt."""
    scheduler: dict[str, Any]
    """Values of the released checkpoint's ``scheduler_config.json`` the flavour copies."""
    spacing: str = "linspace"
    """Sigmas before the shift: ``linspace`` (1 .. 1/N evenly, as the FLUX, Qwen-Image and
    HunyuanVideo pipelines pass them; digen's choice for Wan) or ``default`` (the scheduler's
    own spacing, which the SD3 pipeline uses)."""
    pooled: int | None = None
    """Width of ``pooled_prompt_embeds``, None when there is none."""
    mask: str | None = None
    """Name of the text attention mask, None when there is none."""
    text_prefix: int = 0
    """Tokens ahead of those ``max_sequence_length`` caps (SD3's CLIP states)."""
    lora_sites: tuple[str, ...] = ()
    """Module-name fragments the default LoRA targets must reach."""
    lora_idle: frozenset[str] = field(default_factory=frozenset)
    """LoRA-wrapped modules that cannot reach the output (their B gets no gradient)."""


FLAVOURS: dict[str, Flavour] = {
    "flux": Flavour(
        latent_shape=(4, 4, 4),
        seq_len=4,  # (4 / 2) * (4 / 2) packed tokens
        text=(32, 32),
        pooled=32,
        scheduler=FLUX_DEV_SCHEDULER,
        lora_sites=(".attn.to_q", ".attn.add_q_proj", "single_transformer_blocks."),
    ),
    "sd3": Flavour(
        latent_shape=(4, 4, 4),
        seq_len=4,
        text=(32 + 32, 48),  # CLIP tokens, then T5 tokens
        pooled=16 + 24,  # CLIP-L + CLIP-G
        text_prefix=32,
        scheduler=_static_shift(3.0),  # SD3 / SD3.5
        spacing="default",
        lora_sites=(".attn.to_q", ".attn.add_q_proj", ".attn2.to_q"),  # the dual attention
        # the last block keeps no text stream, so its text queries reach nothing
        lora_idle=frozenset({"transformer_blocks.1.attn.add_q_proj"}),
    ),
    "wan": Flavour(
        latent_shape=(16, 2, 4, 4),  # 5 frames -> (5 - 1) / 4 + 1 = 2; 32 px / 8 = 4
        seq_len=2 * 2 * 2,  # (1, 2, 2) patches
        text=(32, 16),
        scheduler=_static_shift(3.0),  # Wan2.1 480p's flow_shift
        # self- and cross-attention of every block
        lora_sites=tuple(
            f"{a}.{t}" for a in ("attn1", "attn2") for t in ("to_q", "to_k", "to_v", "to_out.0")
        ),
    ),
    "hunyuanvideo": Flavour(
        latent_shape=(16, 2, 4, 4),
        seq_len=2 * 2 * 2,
        text=(32, 16),
        pooled=8,
        mask="prompt_attention_mask",
        scheduler=_static_shift(7.0),  # HunyuanVideo's shift
        lora_sites=(
            "transformer_blocks.0.attn.add_q_proj",  # dual-stream
            "single_transformer_blocks.0.attn.to_q",
            "token_refiner.refiner_blocks.0.attn.to_q",
        ),
    ),
    "qwenimage": Flavour(
        latent_shape=(4, 8, 8),  # a 4x VAE
        seq_len=16,  # 4x4 packed tokens
        text=(None, 32),
        mask="prompt_embeds_mask",
        scheduler=QWEN_IMAGE_SCHEDULER,
        lora_sites=(".attn.to_q", ".attn.add_k_proj", ".img_mlp.net.2"),
        lora_idle=frozenset({"transformer_blocks.1.attn.add_q_proj"}),  # as SD3's
    ),
}


@pytest.fixture(scope="module", params=MODEL_NAMES, ids=MODEL_NAMES)
def adapter(request: pytest.FixtureRequest, tiny_adapter) -> DiffusionAdapter:
    return tiny_adapter(request.param)


@pytest.fixture
def flavour(adapter: DiffusionAdapter) -> Flavour:
    if adapter.name not in FLAVOURS:
        pytest.fail(f"add a FLAVOURS row for '{adapter.name}' in {__name__}")
    return FLAVOURS[adapter.name]


def _text_pairs(pipe: Any) -> list[tuple[Any, Any]]:
    """``(text_encoder, tokenizer)``, ``(text_encoder_2, tokenizer_2)``, ... of a pipeline."""
    pairs = [
        (getattr(pipe, f"text_encoder{s}", None), getattr(pipe, f"tokenizer{s}", None))
        for s in ("", "_2", "_3")
    ]
    return [(e, t) for e, t in pairs if e is not None]


# --- registry and loading ----------------------------------------------------------------


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_registry_names_the_adapter(name: str) -> None:
    cls = get_adapter_class(name)
    assert issubclass(cls, DiffusionAdapter) and cls.name == name
    assert cls.__module__ == f"digen.models.{name}"  # one backbone, one file
    assert cls.is_video is BACKBONES[name].video


def _files(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())


def test_tiny_flavour_round_trips_through_from_pretrained(
    adapter: DiffusionAdapter, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = type(adapter)
    path = cls.tiny_path(tmp_path)  # built and saved afresh
    with monkeypatch.context() as m:  # a second call finds it instead of building again
        m.setattr(cls, "build_tiny_components", classmethod(lambda _: pytest.fail("rebuilt")))
        assert cls.tiny_path(tmp_path) == path
    # the same bytes as the cache the shared adapter was loaded from by ``from_pretrained``
    cache = cls.tiny_path()
    assert _files(path) == _files(cache)
    assert all((path / f).read_bytes() == (cache / f).read_bytes() for f in _files(path))
    assert isinstance(adapter.pipe, cls.pipeline_class)
    index = json.loads((path / "model_index.json").read_text())
    assert index["_class_name"] == cls.pipeline_class.__name__
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = cls.build_tiny_components()
    # every component is saved, and what was loaded is what a seeded build makes
    for key, part in built.items():
        if isinstance(part, PreTrainedTokenizerBase):
            assert (path / key / "tokenizer.json").is_file(), key
            assert isinstance(getattr(adapter.pipe, key), PreTrainedTokenizerFast), key
            continue
        assert index[key] == [type(part).__module__.split(".")[0], type(part).__name__], key
        if isinstance(part, torch.nn.Module):
            weights = "diffusion_pytorch_model" if index[key][0] == "diffusers" else "model"
            assert (path / key / f"{weights}.safetensors").is_file(), key
            want, got = part.state_dict(), getattr(adapter.pipe, key).state_dict()
            assert got.keys() == want.keys() and len(want) > 0, key
            assert all(torch.equal(got[k], want[k]) for k in want), key


def test_only_the_transformer_can_train_and_it_starts_frozen(adapter: DiffusionAdapter) -> None:
    frozen = adapter.frozen_modules()
    others = [m for k, m in adapter.pipe.components.items() if k != "transformer"]
    assert {id(m) for m in frozen} == {id(m) for m in others if isinstance(m, torch.nn.Module)}
    for m in (adapter.transformer, *frozen):
        assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert sum(p.numel() for p in adapter.transformer.parameters()) < 200_000  # tiny


def test_tiny_text_encoders_fit_their_tokenizers(adapter: DiffusionAdapter) -> None:
    pairs = _text_pairs(adapter.pipe)
    assert pairs
    for encoder, tokenizer in pairs:
        cfg = getattr(encoder.config, "text_config", encoder.config)
        # sized to the tokenizer: a default-sized vocabulary would hide a mis-built config
        assert cfg.vocab_size == len(tokenizer)
        assert cfg.eos_token_id == tokenizer.eos_token_id


# --- geometry and schedule ---------------------------------------------------------------


def test_latent_geometry(adapter: DiffusionAdapter, flavour: Flavour) -> None:
    pipe, video = adapter.pipe, adapter.is_video
    shape = adapter.latent_shape()
    assert shape == flavour.latent_shape and len(shape) == (4 if video else 3)
    assert adapter.image_seq_len() == flavour.seq_len
    # the table agrees with the diffusers components: VAE channels and down-sampling
    vae = pipe.vae.config
    assert shape[0] == (vae.get("latent_channels") or vae.get("z_dim"))
    f = pipe.vae_scale_factor_spatial if video else pipe.vae_scale_factor
    assert shape[-2:] == (adapter.height // f, adapter.width // f)
    if video:
        assert shape[1] == (adapter.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
    other = type(adapter)(pipe, height=64, width=48, **({"num_frames": 9} if video else {}))
    wide = other.latent_shape()
    assert wide == (shape[0], *([3] if video else []), 64 // f, 48 // f)
    # tokens grow with the latent volume
    assert other.image_seq_len() * math.prod(shape[1:]) == flavour.seq_len * math.prod(wide[1:])


def test_geometry_the_transformer_cannot_patch_is_refused(adapter: DiffusionAdapter) -> None:
    cls, pipe = type(adapter), adapter.pipe
    f = pipe.vae_scale_factor_spatial if adapter.is_video else pipe.vae_scale_factor
    for bad in ({"height": adapter.height + f}, {"width": adapter.width + f}):
        with pytest.raises(DigenError, match=f"divisible by {2 * f}"):  # 2x2 latent patches
            cls(pipe, **bad)
    if adapter.is_video:
        for frames in (adapter.num_frames - 1, adapter.num_frames + 1):  # not 4k + 1
            with pytest.raises(DigenError, match="num_frames"):
                cls(pipe, num_frames=frames)


def _mu(cfg: Any, seq_len: int) -> float:
    """The dynamic shift for ``seq_len`` tokens, by diffusers' own function."""
    return calculate_shift(
        seq_len, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift
    )


def _closed_form_sigmas(cfg: Any, n: int, flavour: Flavour) -> np.ndarray:
    """The ``n`` sigmas before the final 0, from the schedule's formulas."""

    def shift(u, k):
        return k * u / (1.0 + (k - 1.0) * u)

    if flavour.spacing == "linspace":
        u = np.linspace(1.0, 1.0 / n, n)
    else:  # timesteps evenly between the shifted ends of the training schedule
        u = np.linspace(1.0, shift(1.0 / cfg.num_train_timesteps, cfg.shift), n)
    if cfg.use_dynamic_shifting:  # exponential shift by mu, linear in the token count
        assert cfg.time_shift_type == "exponential" and flavour.spacing == "linspace"
        mu = _mu(cfg, flavour.seq_len)
        s = math.exp(mu) / (math.exp(mu) + (1.0 / u - 1.0))
    else:
        s = shift(u, cfg.shift)
    if cfg.shift_terminal:  # stretched so the last step starts at shift_terminal
        s = 1.0 - (1.0 - s) * (1.0 - cfg.shift_terminal) / (1.0 - s[-1])
    return s


def _scheduler_as_sampled(adapter: DiffusionAdapter, n: int, flavour: Flavour):
    """A fresh diffusers scheduler set to ``n`` steps with the flavour's spacing."""
    sched = FlowMatchEulerDiscreteScheduler.from_config(adapter.scheduler.config)
    cfg = sched.config
    kwargs: dict[str, Any] = (
        {"sigmas": np.linspace(1.0, 1.0 / n, n)}
        if flavour.spacing == "linspace"
        else {"num_inference_steps": n}
    )
    if cfg.use_dynamic_shifting:
        kwargs["mu"] = _mu(cfg, flavour.seq_len)
    sched.set_timesteps(**kwargs)
    return sched


def test_sigmas_follow_the_released_schedule(adapter: DiffusionAdapter, flavour: Flavour) -> None:
    assert isinstance(adapter.scheduler, FlowMatchEulerDiscreteScheduler)
    cfg = adapter.scheduler.config
    assert {k: cfg[k] for k in flavour.scheduler} == flavour.scheduler
    n = 6
    s = adapter.sigmas(n)
    assert s.shape == (n + 1,) and s.dtype == torch.float32
    assert s[0].item() == 1.0 and s[-1].item() == 0.0
    assert torch.all(s[1:] < s[:-1])
    want = torch.tensor(_closed_form_sigmas(cfg, n, flavour), dtype=torch.float32)
    torch.testing.assert_close(s[:-1], want, atol=1e-6, rtol=0)


def test_euler_step_is_the_scheduler_step(adapter: DiffusionAdapter, flavour: Flavour) -> None:
    n = 4
    sched = _scheduler_as_sampled(adapter, n, flavour)
    sigmas = adapter.sigmas(n)
    torch.testing.assert_close(sched.sigmas, sigmas, atol=1e-7, rtol=0)
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(generators(9, 10))
    with torch.no_grad():
        for i, t in enumerate(sched.timesteps):
            v = adapter.predict_velocity(x, sigmas[i], cond)
            ours = x + (sigmas[i + 1] - sigmas[i]) * v
            theirs = sched.step(v, t, x, return_dict=False)[0]
            torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
            x = ours


# --- conditioning ------------------------------------------------------------------------


def test_a_truncated_prompt_is_noted_once_not_per_prompt(
    adapter: DiffusionAdapter,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    fresh = type(adapter)(adapter.pipe)  # has noted nothing yet
    capfd.readouterr()
    with caplog.at_level(logging.INFO, logger="digen.models"):
        for i in range(3):
            fresh.encode_prompts([f"{i} " + "a long prompt " * 80])
    err = capfd.readouterr().err
    assert "truncated" not in err and "Token indices" not in err, err
    notes = [r.getMessage() for r in caplog.records if r.name == "digen.models"]
    # the pipelines that warn as they cut (Wan's cuts silently, Qwen-Image takes any length)
    assert len(notes) == (adapter.name in {"flux", "sd3", "hunyuanvideo"}), notes
    assert all(f"the {adapter.name} text encoders" in n and "truncated (" in n for n in notes)


def test_encode_prompts(adapter: DiffusionAdapter, flavour: Flavour) -> None:
    c = adapter.encode_prompts(PROMPTS)
    keys = {"prompt_embeds"} | ({"pooled_prompt_embeds"} if flavour.pooled else set())
    keys |= {flavour.mask} if flavour.mask else set()
    assert set(c.tensors) == keys
    call = inspect.signature(adapter.pipeline_class.__call__).parameters
    assert all(k in call and f"negative_{k}" in call for k in keys)  # the pipeline's names
    (length, width), emb = flavour.text, c.tensors["prompt_embeds"]
    assert emb.dtype == torch.float32 and emb.shape[::2] == (2, width)
    if length is not None:
        assert emb.shape[1] == length
    # the widths the transformer takes, as its diffusers config names them
    cfg = adapter.transformer.config
    text_keys = ("joint_attention_dim", "text_dim", "text_embed_dim")
    assert [cfg[k] for k in text_keys if k in cfg] == [width]
    if flavour.pooled is not None:
        assert c.tensors["pooled_prompt_embeds"].shape == (2, flavour.pooled)
        assert cfg.pooled_projection_dim == flavour.pooled
    if flavour.mask is not None:
        assert c.tensors[flavour.mask].shape == emb.shape[:2]
    for k, v in c.tensors.items():
        assert not torch.allclose(v[0].float(), v[1].float()), k

    # deterministic, and a prompt's conditioning does not depend on its batch
    again = adapter.encode_prompts(PROMPTS)
    same = adapter.encode_prompts([PROMPTS[1]] * 2)
    for k, v in c.tensors.items():
        assert torch.equal(again.tensors[k], v), k
        assert torch.equal(same.tensors[k][0], same.tensors[k][1]), k
        assert torch.equal(same.tensors[k][1], v[1]), k
    for i, prompt in enumerate(PROMPTS):
        for k, v in adapter.encode_prompts([prompt]).tensors.items():
            row = c.tensors[k][i]
            if v.ndim > 1 and v.shape[1] < row.shape[0]:  # the batch padded it
                row = row[: v.shape[1]]
            torch.testing.assert_close(v[0], row, atol=1e-5, rtol=1e-5)

    long = adapter.encode_prompts(["x" * 100]).tensors["prompt_embeds"]
    if length is not None:
        assert long.shape == (1, length, width)  # truncated
    else:
        assert long.shape[1] > emb.shape[1]
    capped = type(adapter)(adapter.pipe, max_sequence_length=8).encode_prompts(PROMPTS)
    assert capped.tensors["prompt_embeds"].shape == (2, flavour.text_prefix + 8, width)


# --- the denoiser ------------------------------------------------------------------------


def test_predict_velocity_and_seeded_noise(adapter: DiffusionAdapter) -> None:
    cond = adapter.encode_prompts(PROMPTS)
    x = adapter.initial_latents(generators(0, 1))
    assert x.shape == (2, *adapter.latent_shape()) and x.dtype == torch.float32
    # noise is fixed by each sample's own generator
    assert torch.equal(x, adapter.initial_latents(generators(0, 1)))
    assert torch.equal(x[1:], adapter.initial_latents(generators(1)))
    assert not torch.equal(x[0], x[1])
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        v = adapter.predict_velocity(x, sigma, cond)
        again = adapter.predict_velocity(x.clone(), sigma, cond)
        other_t = adapter.predict_velocity(x, torch.tensor([0.5, 0.4]), cond)
        alone = adapter.predict_velocity(x[1:], 0.4, cond.select([1]))
        scalar = adapter.predict_velocity(x, 0.4, cond)
        vector = adapter.predict_velocity(x, torch.tensor([0.4, 0.4]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32
    assert torch.isfinite(v).all() and v.abs().sum() > 0
    assert torch.equal(v, again)
    # one sigma per sample, and a sample does not depend on its batch
    assert not torch.allclose(v[0], other_t[0]) and torch.allclose(v[1], other_t[1], atol=1e-6)
    torch.testing.assert_close(alone[0], v[1], atol=1e-5, rtol=1e-5)
    assert torch.equal(scalar, vector)
    if adapter.transformer.config.get("guidance_embeds", False):
        # guidance-distilled: the embedded guidance value reaches the transformer
        low = type(adapter)(adapter.pipe, embedded_guidance=1.0)
        with torch.no_grad():
            assert not torch.allclose(low.predict_velocity(x, sigma, cond), v)


def test_classifier_free_guidance(adapter: DiffusionAdapter) -> None:
    cond, neg = adapter.encode_prompts(PROMPTS), adapter.encode_prompts(["", "blurry"])
    x = adapter.initial_latents(generators(7, 8))
    sigma, scale = torch.tensor([0.8, 0.3]), 4.5
    guided, v_pos, v_neg = guidance_parts(adapter, x, sigma, cond, neg, scale)
    with torch.no_grad():
        assert torch.equal(adapter.predict_velocity(x, sigma, cond, neg, guidance_scale=1.0), v_pos)
        assert torch.equal(adapter.predict_velocity(x, sigma, cond, guidance_scale=scale), v_pos)
    assert guided.shape == x.shape and guided.dtype == torch.float32
    assert not torch.allclose(guided, v_pos)
    if type(adapter).combine_guidance is DiffusionAdapter.combine_guidance:
        # the protocol's CFG: two branches combined (an adapter with its own tests it)
        torch.testing.assert_close(guided, v_neg + scale * (v_pos - v_neg), atol=1e-5, rtol=1e-5)


def _reference_decode(pipe: Any, latents: torch.Tensor) -> torch.Tensor:
    """Latents to VAE pixels in ``[-1, 1]`` as the diffusers pipelines write it."""
    vae, cfg = pipe.vae, pipe.vae.config
    z = latents
    if cfg.get("latents_mean") is not None:  # per-channel statistics, a 5-D VAE
        z = z.unsqueeze(2) if z.ndim == 4 else z  # [B, C, F, H, W]
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        z = z / inv_std + mean
    else:
        z = z / cfg.scaling_factor + (cfg.get("shift_factor") or 0.0)
    with torch.no_grad():
        pixels = vae.decode(z, return_dict=False)[0]  # [B, 3, (F,) H, W]
    return pixels[:, :, 0] if latents.ndim == 4 and pixels.ndim == 5 else pixels


def test_decode(adapter: DiffusionAdapter) -> None:
    x = adapter.initial_latents(generators(11, 12))
    frames = adapter.decode(x)
    shape = (2, adapter.num_frames, adapter.height, adapter.width, 3)
    assert frames.shape == shape and frames.dtype == torch.uint8
    assert frames.float().std() > 0 and not torch.equal(frames[0], frames[1])
    assert torch.equal(frames, adapter.decode(x))
    raw = _reference_decode(adapter.pipe, x)
    assert torch.equal(frames, adapter.to_uint8(raw))
    # diffusers' post-processing of the same pixels, [B, F, 3, H, W] in [0, 1]
    pipe = adapter.pipe
    if adapter.is_video:
        ref = pipe.video_processor.postprocess_video(raw, output_type="pt")
    else:
        ref = pipe.image_processor.postprocess(raw, output_type="pt").unsqueeze(1)
    diff = (frames.permute(0, 1, 4, 2, 3).float() / 255.0 - ref).abs().max().item()
    assert diff <= 0.5 / 255.0 + 1e-6  # uint8 rounding only


# --- LoRA --------------------------------------------------------------------------------


def test_lora_attaches_trains_and_starts_at_the_base(
    adapter: DiffusionAdapter, flavour: Flavour
) -> None:
    ad = private_copy(adapter)  # LoRA changes the modules
    cond = ad.encode_prompts(PROMPTS)
    x = ad.initial_latents(generators(13, 14))
    sigma = torch.tensor([0.7, 0.2])
    with torch.no_grad():
        base = ad.predict_velocity(x, sigma, cond)
    ad.transformer.add_adapter(
        LoraConfig(
            r=4, lora_alpha=4, target_modules=list(ad.lora_targets), init_lora_weights="gaussian"
        )
    )
    wrapped = {n for n, m in ad.transformer.named_modules() if hasattr(m, "lora_A")}
    for target in ad.lora_targets:  # every target names modules of this transformer
        assert any(n == target or n.endswith("." + target) for n in wrapped), target
    for site in flavour.lora_sites:
        assert any(site in n for n in wrapped), site
    lora = {n: p for n, p in ad.transformer.named_parameters() if "lora_" in n}
    assert all(p.requires_grad for p in lora.values())
    assert not any(p.requires_grad for n, p in ad.transformer.named_parameters() if n not in lora)

    v = ad.predict_velocity(x, sigma, cond)
    assert torch.equal(v.detach(), base)  # B starts at zero
    v.square().mean().backward()
    grads = {n: p.grad for n, p in lora.items()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    # with B = 0 the B matrices get the gradient: all of them that can reach the output
    idle = {n.split(".lora_B")[0] for n, g in grads.items() if "lora_B" in n and not g.any()}
    assert idle == flavour.lora_idle
    with torch.no_grad():
        for n, p in lora.items():
            p -= 0.1 * grads[n]
        assert not torch.allclose(ad.predict_velocity(x, sigma, cond), base)
        ad.transformer.disable_adapters()
        torch.testing.assert_close(ad.predict_velocity(x, sigma, cond), base, atol=1e-6, rtol=0)
        ad.transformer.enable_adapters()
