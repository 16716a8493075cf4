"""The random-init flavours and the loading options, on every registered backbone.

The medium flavour is about 1B transformer parameters a backbone, so it is only ever built on
the meta device here: its sizes and one forward at its default geometry are checked without
memory. Its numbers sit in ``MEDIUM``, written down apart from the adapters. VAE tiling and
text-encoder offloading are checked on the tiny flavour, loaded as ``load_adapter`` loads it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from backbone_helpers import PROMPTS, generators
from helpers import free_port

from digen.errors import DigenError
from digen.models import MODEL_NAMES, get_adapter_class, load_adapter
from digen.models.base import TEXT_ENCODERS, DiffusionAdapter, PromptEmbeds


@dataclass(frozen=True)
class Medium:
    """A backbone's medium flavour, as the tests expect it."""

    params: tuple[float, float]
    """Bounds on the transformer's parameter count."""
    vae_params: int
    """Parameters of the VAE: the released architecture's."""
    latent_shape: tuple[int, ...]
    """Per-sample latents at the medium geometry: ``(C, H, W)`` or ``(C, F, H, W)``."""
    text: dict[str, tuple[int, ...]]
    """Per-sample shape of every conditioning tensor."""
    encodes_on_meta: bool = False
    """The text path has no data-dependent lengths, so ``encode_prompts`` runs on meta."""


MEDIUM: dict[str, Medium] = {
    "flux": Medium(
        params=(0.8e9, 1.5e9),
        vae_params=83_819_683,  # FLUX.1's VAE
        latent_shape=(16, 64, 64),  # 512 px / 8
        text={"prompt_embeds": (512, 256), "pooled_prompt_embeds": (256,)},
        encodes_on_meta=True,
    ),
    "sd3": Medium(
        params=(0.8e9, 1.5e9),
        vae_params=83_819_683,  # SD3's VAE, the same architecture as FLUX.1's
        latent_shape=(16, 64, 64),
        text={"prompt_embeds": (77 + 256, 256), "pooled_prompt_embeds": (64 + 128,)},
        encodes_on_meta=True,
    ),
    "qwenimage": Medium(
        params=(0.8e9, 1.5e9),
        vae_params=126_892_531,  # Qwen-Image's VAE
        latent_shape=(16, 64, 64),
        # padded to the batch's longest prompt
        text={"prompt_embeds": (16, 256), "prompt_embeds_mask": (16,)},
    ),
    "wan": Medium(
        params=(1.2e9, 1.6e9),  # Wan2.1-1.3B's transformer
        vae_params=126_892_531,  # Wan2.1's VAE
        latent_shape=(16, 9, 40, 64),  # 33 frames -> 9, 320x512 px / 8
        text={"prompt_embeds": (226, 256)},
    ),
    "hunyuanvideo": Medium(
        params=(0.8e9, 1.5e9),
        vae_params=246_478_803,  # HunyuanVideo's VAE
        latent_shape=(16, 9, 40, 64),
        text={
            "prompt_embeds": (256, 256),
            "prompt_attention_mask": (256,),
            "pooled_prompt_embeds": (256,),
        },
    ),
}


@pytest.fixture(params=MODEL_NAMES, ids=MODEL_NAMES)
def name(request: pytest.FixtureRequest) -> str:
    if request.param not in MEDIUM:
        pytest.fail(f"add a MEDIUM row for '{request.param}' in {__name__}")
    return request.param


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _meta_medium(name: str) -> DiffusionAdapter:
    """The medium flavour on the meta device (no memory), at its default geometry."""
    cls = get_adapter_class(name)
    with torch.device("meta"):
        pipe = cls.pipeline_class(**cls.build_medium_components())
    return cls(
        pipe,
        height=cls.medium_height,
        width=cls.medium_width,
        num_frames=cls.medium_num_frames,
    )


# --- the medium flavour -------------------------------------------------------------------


def test_medium_is_about_a_billion_parameters_of_the_real_architecture(name: str) -> None:
    want, ad = MEDIUM[name], _meta_medium(name)
    low, high = want.params
    assert low <= _numel(ad.transformer) <= high
    assert _numel(ad.pipe.vae) == want.vae_params
    assert ad.latent_shape() == want.latent_shape
    # the text encoders are small stand-ins: not what the medium flavour measures
    assert all(_numel(e) < 20e6 for e in ad.text_encoders())
    # the transformer takes the stand-ins' widths, as its diffusers config names them
    cfg = ad.transformer.config
    text_keys = ("joint_attention_dim", "text_dim", "text_embed_dim")
    assert [cfg[k] for k in text_keys if k in cfg] == [want.text["prompt_embeds"][-1]]
    if "pooled_prompt_embeds" in want.text:
        assert cfg.pooled_projection_dim == want.text["pooled_prompt_embeds"][0]


def test_medium_forward_on_meta_at_the_default_geometry(name: str) -> None:
    want, ad = MEDIUM[name], _meta_medium(name)
    if want.encodes_on_meta:
        cond = ad.encode_prompts(PROMPTS)
        assert {k: v.shape[1:] for k, v in cond.tensors.items()} == want.text
    else:  # the pipeline's encode reads token counts off the mask, which meta tensors lack
        cond = PromptEmbeds({k: torch.empty(2, *s, device="meta") for k, s in want.text.items()})
    x = torch.empty(2, *ad.latent_shape(), device="meta")
    sigma = torch.empty(2, device="meta")
    with torch.no_grad():
        if name == "qwenimage":
            # Its adapter drops an all-ones text mask (as the pipeline does), which needs the
            # mask's values: call the transformer as forward_velocity does without one.
            h, w = x.shape[-2:]
            tokens = ad._pack(x)  # [B, (H/2)(W/2), 4C]
            out = ad.transformer(
                hidden_states=tokens,
                encoder_hidden_states=cond.tensors["prompt_embeds"],
                encoder_hidden_states_mask=None,
                timestep=sigma,
                img_shapes=[[(1, h // 2, w // 2)]] * 2,
                return_dict=False,
            )[0]
            assert out.shape == tokens.shape
            v = ad._unpack(out, h, w)
        else:
            v = ad.forward_velocity(x, sigma, cond)
    assert v.shape == (2, *want.latent_shape)


def test_medium_geometry_is_the_default_when_none_is_given(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = get_adapter_class(name)
    tiny, asked = cls.tiny_path(), []

    def tiny_weights(_cls: type[DiffusionAdapter], flavour: str, cache_dir: Any = None) -> Path:
        asked.append(flavour)  # the tiny weights stand in: only the geometry is looked at
        return tiny

    monkeypatch.setattr(cls, "flavour_path", classmethod(tiny_weights))
    ad = load_adapter(name, None, flavour="medium", height=None, width=None, num_frames=None)
    assert asked == ["medium"]
    assert (ad.height, ad.width) == (cls.medium_height, cls.medium_width)
    assert ad.num_frames == (cls.medium_num_frames if cls.is_video else 1)
    if cls.is_video:
        assert (cls.medium_height, cls.medium_width, cls.medium_num_frames) == (320, 512, 33)
    else:
        assert (cls.medium_height, cls.medium_width) == (512, 512)
    given = load_adapter(name, None, flavour="medium", height=64, width=64)
    assert (given.height, given.width) == (64, 64)


def test_each_flavour_has_its_own_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cls = get_adapter_class("flux")
    tiny = cls.tiny_path(tmp_path)
    # the tiny components stand in for the medium ones: the layout is what is checked
    monkeypatch.setattr(cls, "build_medium_components", cls.build_tiny_components)
    medium = cls.flavour_path("medium", tmp_path)
    assert tiny.parent == tmp_path / "tiny" and medium.parent == tmp_path / "medium"
    assert tiny.name.startswith("flux-") and medium.name.startswith("flux-")
    assert json.loads((medium / "digen_medium.json").read_text())["tag"].startswith("flux-v")
    assert sorted(p.name for p in (tmp_path / "medium").iterdir()) == [medium.name]  # no temp
    monkeypatch.setenv("DIGEN_CACHE", str(tmp_path))
    monkeypatch.setattr(cls, "build_medium_components", lambda: pytest.fail("rebuilt"))
    assert cls.flavour_path("medium") == medium  # found under $DIGEN_CACHE
    loaded = cls.random_init("medium", height=64, width=64)  # loads from there too
    assert isinstance(loaded.pipe, cls.pipeline_class) and loaded.height == 64
    with pytest.raises(DigenError, match="model.flavour 'huge'"):
        cls.flavour_path("huge")


# --- loading options ----------------------------------------------------------------------


def test_fp32_weights_load_and_run_in_bfloat16(name: str) -> None:
    ad = load_adapter(name, None, dtype=torch.bfloat16)
    # the compute dtype, not that of a module diffusers keeps in fp32 (Wan's first parameter)
    assert ad.dtype == torch.bfloat16
    cond = ad.encode_prompts(PROMPTS)
    x = ad.initial_latents(generators(5, 6))
    with torch.no_grad():
        v = ad.predict_velocity(x, torch.tensor([0.9, 0.4]), cond)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()


def _tile_side(vae: Any) -> int:
    """Latent side of one VAE tile: larger latents decode in blended tiles."""
    if hasattr(vae, "tile_latent_min_size"):  # AutoencoderKL
        return vae.tile_latent_min_size
    return vae.tile_sample_min_height // vae.spatial_compression_ratio


#: mean |tiled - whole| decode, in uint8 levels, measured on the tiny VAEs (flux 3.7, sd3 8.0,
#: wan 0.32, qwenimage 0.52, hunyuanvideo 4.6) with a margin: random weights make tiles
#: differ more than trained ones do (each tile has its own group-norm statistics and
#: mid-block attention, and is blended with its neighbours only over the overlap)
TILED_MEAN_DIFF = {"flux": 5.0, "sd3": 11.0, "wan": 0.5, "qwenimage": 0.75, "hunyuanvideo": 6.0}


@pytest.mark.slow
def test_vae_tiling_decodes_in_slices_and_tiles(
    name: str, tiny_adapter: Callable[[str], DiffusionAdapter], monkeypatch: pytest.MonkeyPatch
) -> None:
    whole = tiny_adapter(name)
    assert not whole.pipe.vae.use_tiling and not whole.pipe.vae.use_slicing
    tiled = load_adapter(name, None, vae_tiling=True)
    vae = tiled.pipe.vae
    assert vae.use_tiling and vae.use_slicing
    if hasattr(vae, "tile_latent_min_size"):
        # The tiny AutoencoderKL's tile is its sample size, 4 latents, inside its decoder's
        # receptive field; widen it to 16 (the real VAE's is 128) for a like-for-like check.
        vae.tile_sample_min_size, vae.tile_latent_min_size = 128, 16
    side = _tile_side(vae) * 5 // 4  # two overlapping tiles a side
    frames = [1] if whole.is_video else []  # one latent frame: tiles are spatial
    c = whole.latent_shape()[0]
    noise = [torch.randn(c, *frames, side, side, generator=g) for g in generators(3, 4)]
    x = torch.stack(noise)  # [B, C, (1,) side, side]
    decoded: list[int] = []
    tiled_decode = vae.tiled_decode

    def spy(z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        decoded.append(z.shape[0])
        return tiled_decode(z, *args, **kwargs)

    monkeypatch.setattr(vae, "tiled_decode", spy)
    a, b = tiled.decode(x).float(), whole.decode(x).float()  # [B, F, H, W, 3]
    assert decoded == [1, 1]  # one sample at a time, in tiles
    assert a.shape == b.shape and not torch.equal(a, b)
    assert (a - b).abs().mean() <= TILED_MEAN_DIFF[name]


def test_offloaded_text_encoders_visit_the_device_only_to_encode(
    name: str,
    tiny_adapter: Callable[[str], DiffusionAdapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ad = load_adapter(name, None, offload_text_encoders=True)
    encoders = ad.text_encoders()
    # TEXT_ENCODERS names every text encoder the pipeline has
    names = {k for k, v in ad.pipe.components.items() if k.startswith("text_encoder") and v}
    assert names <= set(TEXT_ENCODERS) and len(encoders) == len(names) > 0
    moves: list[tuple[int, str]] = []
    for i, encoder in enumerate(encoders):
        move = encoder.to

        def spy(*args: Any, _i: int = i, _move: Any = move, **kwargs: Any) -> Any:
            moves.append((_i, str(args[0] if args else kwargs["device"])))
            return _move(*args, **kwargs)

        monkeypatch.setattr(encoder, "to", spy)
    cond = ad.encode_prompts(PROMPTS)
    # each encoder went to the model's device and back, once
    assert sorted(moves) == sorted(
        (i, d) for i in range(len(encoders)) for d in (str(ad.device), "cpu")
    )
    assert all(p.device.type == "cpu" for e in encoders for p in e.parameters())
    want = tiny_adapter(name).encode_prompts(PROMPTS)
    assert cond.tensors.keys() == want.tensors.keys()
    assert all(torch.equal(v, want.tensors[k]) for k, v in cond.tensors.items())


def test_offloaded_text_encoders_are_never_placed_on_the_device(name: str) -> None:
    # "meta" stands in for an accelerator: a module moved there keeps no data
    ad = load_adapter(name, None, device="meta", offload_text_encoders=True)
    assert ad.device.type == "meta"
    assert all(p.device.type == "meta" for p in ad.pipe.vae.parameters())
    assert all(p.device.type == "cpu" for e in ad.text_encoders() for p in e.parameters())
    placed = load_adapter(name, None, device="meta")
    assert all(p.device.type == "meta" for e in placed.text_encoders() for p in e.parameters())


_BUILD_AS_RANK = """
import os
import sys
from datetime import timedelta

import torch.distributed as dist

from digen.models import get_adapter_class

rank, port, cache = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=120))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
if rank == 1:  # only rank 1 builds: transformers writes weights on rank 0 alone
    print(get_adapter_class("sd3").flavour_path("tiny", cache))
dist.barrier()
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)  # as digen's workers exit: the interpreter's teardown can abort on gloo's threads
"""


@pytest.mark.slow
def test_a_flavour_built_by_rank_1_of_a_process_group_has_every_weight(tmp_path: Path) -> None:
    """A trainer of rank 1 can be the first to need a flavour: what it saves must hold the
    text encoders' weights too (transformers saves them on rank 0 only, unless told)."""
    import os
    import subprocess
    import sys

    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    cmd = [sys.executable, "-c", _BUILD_AS_RANK]
    procs = [
        subprocess.Popen([*cmd, str(r), str(port), str(tmp_path)], stdout=subprocess.PIPE, env=env)
        for r in (0, 1)
    ]
    out = [p.communicate(timeout=300)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    path = Path(out[1].strip().splitlines()[-1])
    for key in ("text_encoder", "text_encoder_2", "text_encoder_3", "transformer", "vae"):
        assert list((path / key).glob("*.safetensors")), key
    adapter = get_adapter_class("sd3").from_pretrained(path)
    assert sum(p.numel() for p in adapter.pipe.text_encoder_3.parameters()) > 1000
