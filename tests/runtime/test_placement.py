"""Which device each worker uses, how tensors cross between workers, which group backend."""

from __future__ import annotations

import pytest

from digen.config import load_config
from digen.runtime.placement import (
    all_devices,
    device_maps,
    group_backend,
    pool_devices,
    wire_device,
    worker_device,
)


def _cfg(*over: str):
    return load_config(overrides=["runtime.mode=disaggregated", *over])


def test_explicit_pool_devices_and_round_robin() -> None:
    cfg = _cfg(
        "runtime.generators=3",
        "runtime.trainers=2",
        "runtime.generator_devices=cuda:0,cuda:1",
        "runtime.trainer_devices=[cuda:2]",
    )
    assert pool_devices(cfg, "generator") == ["cuda:0", "cuda:1"]
    assert [worker_device(cfg, "generator", i, env={}) for i in range(3)] == [
        "cuda:0",
        "cuda:1",
        "cuda:0",
    ]
    assert all_devices(cfg) == {
        "generator-0": "cuda:0",
        "generator-1": "cuda:1",
        "generator-2": "cuda:0",
        "trainer-0": "cuda:2",
        "trainer-1": "cuda:2",
    }


@pytest.mark.parametrize(
    ("gpus", "gens", "trainers", "want_g", "want_t"),
    [
        (8, 6, 2, [f"cuda:{i}" for i in range(6)], ["cuda:6", "cuda:7"]),
        (4, 2, 2, ["cuda:0", "cuda:1"], ["cuda:2", "cuda:3"]),
        (2, 3, 1, ["cuda:0"], ["cuda:1"]),  # at least one GPU each
        (1, 2, 1, ["cuda:0"], ["cuda:0"]),  # one GPU: everyone shares it
    ],
)
def test_bare_cuda_splits_the_visible_gpus(gpus, gens, trainers, want_g, want_t) -> None:
    cfg = _cfg("model.device=cuda", f"runtime.generators={gens}", f"runtime.trainers={trainers}")
    assert pool_devices(cfg, "generator", gpus) == want_g
    assert pool_devices(cfg, "trainer", gpus) == want_t
    with pytest.raises(RuntimeError, match="no GPU"):
        pool_devices(cfg, "trainer", 0)


def test_cpu_pools_and_torchrun_local_rank() -> None:
    assert pool_devices(_cfg(), "trainer") == ["cpu"]
    cfg = _cfg("model.device=cuda")
    torchrun = {"LOCAL_RANK": "3", "TORCHELASTIC_RUN_ID": "x"}
    assert worker_device(cfg, "trainer", 0, visible_gpus=8, env=torchrun) == "cuda:3"
    assert worker_device(_cfg(), "trainer", 0, env=torchrun) == "cpu"  # a CPU pool stays


def test_device_maps_join_gpu_workers_only_and_staging_elsewhere() -> None:
    devices = {"generator-0": "cuda:0", "generator-1": "cpu", "trainer-0": "cuda"}
    maps = device_maps(devices)
    assert maps == {
        "generator-0": {"trainer-0": {"cuda:0": "cuda:0"}},
        "trainer-0": {"generator-0": {"cuda:0": "cuda:0"}},
    }
    assert wire_device("cuda:0", "cuda:1") is None  # GPU to GPU, as they are
    assert wire_device("cuda:0", "cpu") == "cpu"  # staged
    assert wire_device("cpu", "cuda:0") is None  # already on the CPU
    assert group_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend(["cuda:0", "cpu"]) == "gloo"  # a mixed group stages through the CPU
    assert group_backend(["cpu"]) == "gloo"


def test_bad_device_is_one_sentence() -> None:
    from digen.errors import ConfigError

    with pytest.raises(ConfigError, match="runtime.trainer_devices = .* is not allowed: name"):
        _cfg("runtime.trainer_devices=gpu0")
