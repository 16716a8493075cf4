"""The GPU cost terms against hand arithmetic, and the hardware description's checks."""

from __future__ import annotations

import dataclasses
import math

import pytest

from digen.planning.hardware import (
    DEVICE_DEFAULTS,
    GB,
    SAMPLING_BYTES,
    Device,
    ModelSize,
    activation_bytes,
    allgather_s,
    allreduce_s,
    describe,
    fsdp_update_s,
    load_hardware,
    offload_reload_s,
    overlapped,
    sample_tokens,
    sampling_activation_bytes,
    sampling_copy_bytes,
    sharded_sampling_s,
    train_state_bytes,
    ulysses_s,
    weakest,
    weight_sync_s,
)

# a 10B-parameter model of 50 blocks, fully trained, with a 1B reward model
FULL = ModelSize(params=10e9, blocks=50, trained=10e9, reward_params=1e9)
LORA = ModelSize(params=10e9, blocks=50, trained=50e6)


def test_allgather_moves_the_missing_shards_over_the_link() -> None:
    # 8 devices, 16 GB gathered: each receives 7/8 of it = 14 GB, at 100 GB/s: 0.14 s
    assert allgather_s(16 * GB, 8, 100) == pytest.approx(0.14)
    assert allgather_s(16 * GB, 1, 100) == 0.0  # nothing to gather from nobody
    assert allreduce_s(16 * GB, 8, 100) == pytest.approx(0.28)


def test_sharded_sampling_gathers_every_block_at_every_pass() -> None:
    # 20 GB of bf16 weights in 50 blocks of 0.4 GB; 4 devices gather 3/4 of each block:
    # 0.3 GB a block, 15 GB a pass; 10 passes at 150 GB/s: 1.0 s
    assert sharded_sampling_s(FULL, 4, 150, passes=10) == pytest.approx(1.0)
    assert overlapped(2.0, 1.0) == 2.0 and overlapped(0.5, 1.0) == 1.0


def test_a_sharded_update_gathers_twice_and_reduce_scatters_the_gradients() -> None:
    # weights 20 GB gathered twice, fp32 gradients 40 GB reduce-scattered; 4 devices: 3/4 each
    want = (2 * 20 + 40) * 0.75 / 100
    assert fsdp_update_s(FULL, 4, 100) == pytest.approx(want)
    # LoRA: only the adapter's gradients (50M x 4 bytes)
    assert fsdp_update_s(LORA, 4, 100) == pytest.approx((2 * 20 + 0.2) * 0.75 / 100)


def test_memory_of_training_and_sampling() -> None:
    assert train_state_bytes(FULL) == 160 * GB  # 16 bytes a trained parameter
    assert train_state_bytes(FULL, 8) == 20 * GB
    # LoRA: 2 bytes a frozen parameter, 16 a trained one
    assert train_state_bytes(LORA) == pytest.approx(9.95e9 * 2 + 50e6 * 16)
    assert sampling_copy_bytes(FULL) == 20 * GB
    assert sampling_copy_bytes(LORA) == pytest.approx(20 * GB + 0.1 * GB)


def test_activations_of_a_training_pass_with_and_without_checkpointing() -> None:
    video = dataclasses.replace(FULL, hidden=4096, tokens=1000)
    # 2 rows x 1000 tokens x 4096 wide: 34 bytes a unit in each of the 50 blocks, or each
    # block's bf16 input (2 bytes) and one block's 34 while it is recomputed
    assert activation_bytes(video, 2, checkpointing=False) == 2 * 1000 * 4096 * 50 * 34
    assert activation_bytes(video, 2, checkpointing=True) == 2 * 1000 * 4096 * (50 * 2 + 34)
    assert activation_bytes(FULL, 2, checkpointing=False) == 0  # tokens not known
    assert ModelSize.of("hunyuanvideo", tokens=3644).hidden == 3072


def test_offload_and_weight_sync() -> None:
    assert offload_reload_s(32 * GB, 64) == pytest.approx(1.0)  # out and back at 64 GB/s
    # 1 GB in 256 MB buckets: 4 buckets of 1 ms, plus 1 GB at 10 GB/s
    assert weight_sync_s(1 * GB, 10, bucket_mb=256, latency_s=1e-3) == pytest.approx(0.104)
    assert weight_sync_s(0, 10) == 0.0


def test_lora_size_follows_the_published_width() -> None:
    m = ModelSize.of("flux", lora_rank=32)
    # 57 blocks x 4 projections x (3072 x 32 in + 32 x 3072 out)
    assert m.trained == 57 * 4 * 2 * 3072 * 32
    assert m.params == 12e9 and m.lora
    assert not ModelSize.of("flux").lora


def test_device_fits_beside_its_reserve() -> None:
    h100 = DEVICE_DEFAULTS["h100"]
    assert h100.fits(70 * GB) and not h100.fits(70.1 * GB)  # 80 GB less 10 reserved


def test_hardware_from_a_file(tmp_path) -> None:
    path = tmp_path / "hw.yaml"
    path.write_text(
        "generator: {kind: l40s, count: 6, price_h: 0.9}\n"
        "trainer: {kind: h100, count: 2, price_h: 2.5, memory_gb: 94}\n"
        "cross_gb_s: 25\n"
    )
    hw = load_hardware(path)
    assert (hw.generators, hw.trainers) == (6, 2)
    assert hw.generator.default and not hw.trainer.default  # a stated figure: not a default
    assert hw.trainer.memory_gb == 94 and hw.trainer.price_h == 2.5
    assert hw.cross_link_gb_s == 25
    # speeds relative to the trainer's kind (the profile's, unless stated)
    assert hw.speed(hw.generator) == pytest.approx(362 / 989)
    assert describe(hw) == "generators on l40s, trainers on h100 (l40s: spec-sheet defaults)"
    one = load_hardware({"device": "a100", "profiled": {"kind": "h100"}})
    assert one.homogeneous and one.speed(one.trainer) == pytest.approx(312 / 989)
    assert one.cross_link_gb_s == 300


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ({"device": "tpu"}, "'tpu' is not a known kind"),
        ({"generator": "h100"}, "needs device, or generator and trainer"),
        ({"device": "h100", "trainer": "h100"}, "either device"),
        ({"device": {"kind": "h100", "memroy_gb": 1}}, "unknown key(s) memroy_gb"),
        ({"device": {"kind": "h100", "memory_gb": -1}}, "memory_gb must be a number > 0"),
        ({"generator": {"kind": "h100", "count": 2}, "trainer": "h100"}, "both pools a count"),
        ({"device": "h100", "bogus": 1}, "unknown key(s) bogus"),
    ],
)
def test_bad_hardware_is_one_sentence(spec, says) -> None:
    with pytest.raises(ValueError, match=".*") as got:
        load_hardware(spec)
    assert says in str(got.value)


def test_speed_ratios_from_a_profile_of_each_kind(tmp_path) -> None:
    (tmp_path / "l40s.json").write_text('{"gen": 3.0, "update": 1.0}')
    (tmp_path / "h100.json").write_text('{"gen": 1.2, "update": 0.4}')
    hw = load_hardware(
        {
            "generator": {"kind": "l40s", "profile": str(tmp_path / "l40s.json")},
            "trainer": {"kind": "h100", "profile": str(tmp_path / "h100.json")},
        }
    )
    # measured: the l40s generates at 1.2 / 3.0 of the h100's speed (not the spec sheets')
    assert hw.speed(hw.generator) == pytest.approx(0.4)
    assert hw.speed(hw.trainer) == 1.0
    assert not hw.generator.default and hw.generator.gen_s == 3.0
    stated = load_hardware({"generator": {"kind": "l4", "speed": 0.25}, "trainer": "h100"})
    assert stated.speed(stated.generator) == 0.25  # a stated ratio wins


def test_the_weakest_of_two_kinds() -> None:
    w = weakest(DEVICE_DEFAULTS["l40s"], DEVICE_DEFAULTS["h100"])
    assert (w.memory_gb, w.link_gb_s, w.host_gb_s, w.tflops) == (48, 32, 32, 362)
    assert w.kind == "l40s+h100" and weakest(w, w) is w


def test_a_stated_device_needs_its_figures() -> None:
    d = load_hardware(
        {
            "device": {
                "kind": "mi300x",
                "memory_gb": 192,
                "link_gb_s": 64,
                "host_gb_s": 64,
                "tflops": 1307,
            }
        }
    )
    assert isinstance(d.trainer, Device) and not d.trainer.default
    assert math.isclose(d.speed(d.generator), 1.0)


def test_sequence_parallelism_shares_tokens_and_trades_them_at_attention() -> None:
    video = ModelSize(params=13e9, blocks=60, trained=13e9, hidden=3072, tokens=3644)
    # the paper's 352x352x25 video: 22 x 22 patches of 7 latent frames, and 256 text tokens
    assert sample_tokens(352, 352, 25, 256) == 22 * 22 * 7 + 256 == 3644
    assert sample_tokens(512, 512) == 1024  # an image: no frames
    # a device of 4 keeps a quarter of each row's tokens (rounded up)
    assert activation_bytes(video, 2, checkpointing=False, degree=4) == 2 * 911 * 3072 * 60 * 34
    assert sampling_activation_bytes(video, 2, 4) == 2 * 911 * 3072 * SAMPLING_BYTES
    # 4 all-to-alls a block, each sending 3/4 of the device's q (or k, v, out) in bf16
    local = 2 * 911 * 3072 * 2
    assert ulysses_s(video, 2, 4, 100) == pytest.approx(60 * 4 * local * 3 / 4 / (100 * GB))
    assert ulysses_s(video, 2, 4, 100, backward=True) == 2 * ulysses_s(video, 2, 4, 100)
    assert ulysses_s(video, 2, 1, 100) == 0.0  # one device trades nothing
