"""Which device each worker uses, how tensors cross between workers, which group backend."""

from __future__ import annotations

import pytest

from digen.config import load_config
from digen.errors import DigenError
from digen.runtime.placement import (
    all_devices,
    check_groups,
    colocated_groups,
    default_group_backend,
    device_maps,
    group_backend,
    pool_devices,
    pool_index,
    run_groups,
    wire_device,
    worker_device,
)


def _cfg(*over: str):
    return load_config(overrides=["runtime.mode=disaggregated", *over])


def test_explicit_pool_devices_and_round_robin() -> None:
    cfg = _cfg(
        "runtime.generators=3",
        "runtime.trainers=2",
        "runtime.placement.generator_devices=cuda:0,cuda:1",
        "runtime.placement.trainer_devices=[cuda:2]",
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


def test_a_generator_of_several_devices_takes_one_per_process() -> None:
    """Generators of 2 x 2 devices (sequence x CFG): each generator's processes take the
    pool's devices in turn, named after it; the bare-cuda split counts processes, and each
    generator's processes form a group of their own."""
    cfg = _cfg(
        "model.device=cuda",
        "runtime.generators=2",
        "runtime.placement.generator_sequence=2",
        "runtime.placement.generator_cfg=true",
        "rollout.guidance_scale=4.5",
    )
    devices = all_devices(cfg, visible_gpus=9)
    assert devices == {
        **{f"generator-0{s}": f"cuda:{i}" for i, s in enumerate(["", ":1", ":2", ":3"])},
        **{f"generator-1{s}": f"cuda:{4 + i}" for i, s in enumerate(["", ":1", ":2", ":3"])},
        "trainer-0": "cuda:8",
    }
    assert pool_index(cfg, "generator-1:2") == ("generator", 6)
    assert pool_index(cfg, "trainer-0") == ("trainer", 0)
    groups = {g.name: g.members for g in run_groups(cfg, devices)}
    assert list(groups["generator-1's sequence/CFG group"]) == [
        "generator-1",
        "generator-1:1",
        "generator-1:2",
        "generator-1:3",
    ]


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
    assert wire_device("cuda:0", "cpu") == "cpu"  # to a GPU from the CPU: staged
    assert wire_device("cpu", "cuda:0") == "cpu"  # to the CPU: there before it leaves
    assert wire_device("cuda:0", "cuda:1", direct=False) == "cpu"  # no device maps
    assert group_backend(["cuda:0", "cuda:1"]) == "nccl"
    assert group_backend(["cuda:0", "cpu"]) == "gloo"  # a mixed group stages through the CPU
    assert group_backend(["cpu"]) == "gloo"


def test_bad_device_is_one_sentence() -> None:
    from digen.errors import ConfigError

    with pytest.raises(
        ConfigError, match="runtime.placement.trainer_devices = .* is not allowed: name"
    ):
        _cfg("runtime.placement.trainer_devices=gpu0")


def test_a_bare_cuda_in_a_device_list_is_the_first_gpu() -> None:
    cfg = _cfg(
        "runtime.placement.generator_devices=cuda",
        "runtime.placement.trainer_devices=[cuda, cuda:1]",
    )
    assert cfg.runtime.placement.generator_devices == [
        "cuda:0"
    ]  # torch.cuda.set_device needs an index
    assert cfg.runtime.placement.trainer_devices == ["cuda:0", "cuda:1"]
    assert all_devices(cfg) == {"generator-0": "cuda:0", "trainer-0": "cuda:0"}


def test_default_groups_on_gpus_carry_cpu_tensors_too() -> None:
    """The colocated workers' and the sharded trainers' default group: NCCL for the GPU
    tensors, gloo for the CPU ones their control values travel in (an NCCL-only group fails
    at its first CPU tensor)."""
    assert default_group_backend(["cuda:0", "cuda:1"]) == "cpu:gloo,cuda:nccl"
    assert default_group_backend(["cpu", "cpu"]) == "gloo"
    assert default_group_backend(["cuda:0", "cuda:0"]) == "gloo"  # one GPU: gloo through the host


@pytest.mark.parametrize(
    ("gpus", "over", "notes"),
    [
        # 8 GPUs, 6 + 4: the trainers get 3 GPUs, so trainer-3 shares cuda:5 with trainer-0
        (8, ["runtime.generators=6", "runtime.trainers=4"], ["trainers' replicate group"]),
        # one GPU: trainer 0 and the generator share it in the weight-broadcast group
        (1, ["runtime.transport.weight_sync=broadcast"], ["weight-broadcast group"]),
        (2, ["runtime.transport.weight_sync=broadcast", "runtime.trainers=1"], []),  # one GPU each
    ],
)
def test_groups_with_members_sharing_a_gpu_fall_back_to_gloo_and_say_so(gpus, over, notes) -> None:
    cfg = _cfg("model.device=cuda", *over)
    devices = all_devices(cfg, visible_gpus=gpus)
    groups = run_groups(cfg, devices)
    said = check_groups(cfg, groups)
    assert len(said) == len(notes)
    for note, name in zip(said, notes, strict=True):
        assert name in note and "uses gloo" in note
    for group in groups:
        want = "gloo" if any(name in group.name for name in notes) else "nccl"
        assert group.backend == want


def test_sharded_trainers_sharing_a_gpu_are_refused_in_one_sentence() -> None:
    cfg = _cfg("model.device=cuda", "runtime.trainers=2", "runtime.placement.trainer_parallel=fsdp")
    groups = run_groups(cfg, all_devices(cfg, visible_gpus=1))
    with pytest.raises(
        DigenError,
        match=r"cannot shard over members that share a GPU \(trainer-0 on cuda:0, trainer-1 on cuda:0\)",
    ):
        check_groups(cfg, groups)
    cfg = load_config(overrides=["runtime.placement.trainer_parallel=fsdp"])
    with pytest.raises(DigenError, match="rank 0 on cuda:0, rank 1 on cuda:0"):
        check_groups(cfg, colocated_groups(cfg, ["cuda:0", "cuda:0"]))
    assert check_groups(cfg, colocated_groups(cfg, ["cuda:0", "cuda:1"])) == []


def _torchrun_env(rank: int, per_node: int) -> dict[str, str]:
    """What torchrun sets for ``rank`` with ``per_node`` processes on each node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank % per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "TORCHELASTIC_RUN_ID": "run",
    }


def test_a_two_node_torchrun_launch_is_placed_by_each_rank_on_its_own_node(monkeypatch) -> None:
    """2 nodes x 5 ranks, HSDP over 8 trainers: each rank finds its GPU (its
    ``LOCAL_RANK``) on its own node, so ``cuda:2`` of node A and ``cuda:2`` of node B are
    two GPUs and every group runs on NCCL. Placed by the driver in its own environment, as
    a launch once was, every worker got the driver's ``cuda:0`` and the sharded group was
    refused; and without the nodes, the GPUs of two nodes look shared."""
    from digen.config import config_to_dict
    from digen.runtime.placement import placed_here
    from digen.runtime.transport.torchrun import role_for_rank

    over = ["model.device=cuda", "runtime.generators=1", "runtime.trainers=8"]
    over += ["runtime.placement.trainer_parallel=hsdp", "runtime.placement.shard_size=4"]
    cfg = _cfg(*over, "runtime.transport.weight_sync=broadcast")
    per_node = 5
    devices, hosts = {}, {}
    for rank in range(1, 2 * per_node):  # rank 0 is the driver
        name = role_for_rank(rank, 1, 8)
        node = f"node-{rank // per_node}"
        monkeypatch.setattr("socket.gethostname", lambda node=node: node)
        hosts[name], devices[name] = placed_here(
            config_to_dict(cfg), name, env=_torchrun_env(rank, per_node)
        )
    assert devices["trainer-0"] == "cuda:2" and hosts["trainer-0"] == "node-0"
    assert devices["trainer-3"] == "cuda:0" and hosts["trainer-3"] == "node-1"
    groups = run_groups(cfg, devices, hosts)
    assert check_groups(cfg, groups) == []
    assert [g.backend for g in groups] == ["nccl", "nccl"]
    with pytest.raises(DigenError, match="cannot shard over members that share a GPU"):
        check_groups(cfg, run_groups(cfg, devices))  # the nodes forgotten
    driver_env = _torchrun_env(0, per_node)  # what the driver's own environment says
    monkeypatch.setattr("os.environ", driver_env)
    with pytest.raises(DigenError, match="cannot shard over members that share a GPU"):
        check_groups(cfg, run_groups(cfg, all_devices(cfg, visible_gpus=per_node)))


def test_a_joiner_computes_on_the_device_it_was_given(monkeypatch) -> None:
    """``digen join --device`` (``DIGEN_DEVICE`` in the joiner's environment) wins over the
    placement rule, which knows only the driver's machine: two joiners of one machine take
    the GPUs they are given, not their join numbers'."""
    from digen.config import config_to_dict
    from digen.runtime.placement import DEVICE_ENV, placed_here
    from digen.runtime.worker.base import pool_config

    cfg = _cfg("model.device=cuda", "runtime.placement.generator_devices=[cuda:0,cuda:1]")
    assert pool_config(cfg, "generator", 3).model.device == "cuda:1"  # join number 3
    monkeypatch.setenv(DEVICE_ENV, "cuda:0")
    assert pool_config(cfg, "generator", 3).model.device == "cuda:0"
    assert placed_here(config_to_dict(cfg), "generator-3")[1] == "cuda:0"


@pytest.mark.parametrize("elastic", [False, True])
def test_gpu_workers_of_a_dynamic_world_stage_their_tensors_through_the_cpu(elastic) -> None:
    """Device maps (GPU to GPU) for a fixed world, keyed by the names it knows its workers
    by; none in a dynamic one (a lost generator comes back, a new one joins), where torch
    rewrites the agents' device tables as members come and go, and names members otherwise:
    maps keyed by digen's names failed at the first reply from a GPU."""
    from digen.runtime.driver.cluster import Cluster

    over = ["model.device=cuda", "runtime.placement.generator_devices=[cuda:0]"]
    over += ["runtime.placement.trainer_devices=[cuda:1]", "runtime.trainers=1"]
    if elastic:
        over += [
            "runtime.elastic.respawn_generators=true",
            "runtime.elastic.on_generator_loss=continue",
        ]
    cluster = Cluster(_cfg(*over))
    maps = {w.name: w.device_maps for w in cluster.system.workers}
    assert cluster.direct is not elastic
    if elastic:
        assert maps == {"generator-0": {}, "trainer-0": {}}
    else:
        assert maps == {
            "generator-0": {"trainer-0": {"cuda:0": "cuda:1"}},
            "trainer-0": {"generator-0": {"cuda:1": "cuda:0"}},
        }
