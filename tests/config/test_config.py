"""Config: defaults, YAML + overrides, round trip, and one sentence per bad value."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from digen.config import (
    AlgoConfig,
    DigenConfig,
    RewardSpec,
    RolloutConfig,
    config_to_dict,
    dump_config,
    load_config,
    validate,
)
from digen.errors import ConfigError

# The worked example of nested batch sizes: 32 prompts x 16 samples, mini-batches of 16
# prompts (256 samples) over 4 devices (64 each) in micro-batches of 16.
WORKED = [
    "data.train_batch_size=32",
    "rollout.n=16",
    "train.mini_batch_size=16",
    "train.num_devices=4",
    "train.micro_batch_size=16",
]


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message
    assert message.endswith(".")
    assert ". " not in message, message


def test_defaults_load() -> None:
    cfg = load_config()
    assert cfg == DigenConfig()
    assert cfg.model.name == "flux"
    assert cfg.rollout.n == 4
    assert cfg.rewards == [RewardSpec(name="jpeg_incompressibility", weight=1.0)]


def test_worked_batch_example_is_valid() -> None:
    cfg = load_config(overrides=WORKED)
    assert (cfg.data.train_batch_size, cfg.rollout.n) == (32, 16)
    assert (cfg.train.mini_batch_size, cfg.train.num_devices, cfg.train.micro_batch_size) == (
        16,
        4,
        16,
    )


def test_yaml_then_base_then_overrides(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"name": "sd3", "height": 64, "width": 64},
                "rollout": {"n": 6, "noise_level": 0.5},
                "train": {"lr": "1e-5"},  # PyYAML reads 1e-5 as a string
                "rewards": [{"name": "jpeg_compressibility", "weight": 0.5}],
                "seed": 3,
            }
        )
    )
    cfg = load_config(
        path,
        overrides=[
            "rollout.n=8",
            "model.path=null",
            "rollout.sde_window_size=2",
            "rollout.sde_window_range=[0,5]",
            "train.lora_targets=[to_q,to_k]",
            "rewards.0.weight=2",
            "rewards.1.name=jpeg_incompressibility",
            "steps=3",
        ],
        base={"model": {"width": 128}, "seed": 5},
    )
    assert cfg.model.name == "sd3"
    assert (cfg.model.height, cfg.model.width) == (64, 128)  # base overrides the file
    assert cfg.model.path is None
    assert cfg.rollout.n == 8
    assert cfg.rollout.noise_level == 0.5
    assert cfg.rollout.sde_window_range == (0, 5)
    assert cfg.train.lr == pytest.approx(1e-5)
    assert cfg.train.lora_targets == ["to_q", "to_k"]
    assert cfg.rewards == [
        RewardSpec(name="jpeg_compressibility", weight=2.0),
        RewardSpec(name="jpeg_incompressibility", weight=1.0),
    ]
    assert (cfg.seed, cfg.steps) == (5, 3)


def test_preset_sits_under_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("rollout:\n  n: 16\nmodel:\n  name: sd3\n")
    cfg = load_config(path, base={"seed": 2}, algo="dancegrpo")
    # the file names the model, the flag the algorithm: the sd3 x dancegrpo preset, under both
    assert (cfg.model.name, cfg.algo.name, cfg.rollout.sde_type) == ("sd3", "dancegrpo", "dance")
    assert (cfg.rollout.n, cfg.rollout.noise_level, cfg.seed) == (16, 0.3, 2)
    assert cfg.steps == 30  # from the tiny preset, which nothing above changes
    # an override beats the file; a flag beats the file too, and one saying the same as an
    # override is fine
    cfg = load_config(path, ["algo.name=flowgrpo"], model="flux", preset=True)
    assert (cfg.model.name, cfg.algo.name, cfg.rollout.sde_type) == ("flux", "flowgrpo", "sde")
    cfg = load_config(path, ["model.name=flux"], model="flux", preset=True)
    assert cfg.model.name == "flux"
    # a flag and an override that disagree are refused, naming both
    for flag, override in (
        ({"model": "flux"}, "model.name=wan"),
        ({"algo": "nft"}, "algo.name=flowgrpo"),
        ({"mode": "colocated"}, "runtime.mode=disaggregated"),
    ):
        key = override.partition("=")[0]
        with pytest.raises(ConfigError, match=rf"--\w+ \w+ and the override {key}=\w+ disagree"):
            load_config(path, [override], **flag)
    # a model path picks the real-weight recipe
    cfg = load_config(overrides=["model.path=/models/x"], model="flux")
    # (Flow-GRPO's FLUX recipe: 6 sampling steps, a = 0.9)
    r = cfg.rollout
    assert (cfg.model.dtype, r.num_inference_steps, r.noise_level) == ("bfloat16", 6, 0.9)
    # no names, no preset flag: the plain defaults
    assert load_config(path).steps == 10


def test_whole_reward_list_override() -> None:
    cfg = load_config(overrides=["rewards=[{name: jpeg_compressibility, weight: 1.5}]"])
    assert cfg.rewards == [RewardSpec(name="jpeg_compressibility", weight=1.5)]
    cfg = load_config(overrides=["rewards.0.weight=2"])  # edits the default reward
    assert cfg.rewards == [RewardSpec(name="jpeg_incompressibility", weight=2.0)]


def test_dancegrpo_picks_dance_sde_unless_told() -> None:
    assert load_config(overrides=["algo.name=dancegrpo"]).rollout.sde_type == "dance"
    with pytest.raises(ConfigError, match="rollout.sde_type = 'sde'"):
        load_config(overrides=["algo.name=dancegrpo", "rollout.sde_type=sde"])


def test_round_trip(tmp_path: Path) -> None:
    cfg = load_config(
        overrides=[
            *WORKED,
            "model.name=wan",
            "model.num_frames=9",
            "rollout.sde_window_size=3",
            "rollout.sde_window_range=[1,8]",
            "train.lora_targets=[to_q]",
            "rewards=[{name: jpeg_compressibility, weight: -0.5}, {name: 'm:f', weight: 2}]",
        ]
    )
    plain = config_to_dict(cfg)
    assert plain["rollout"]["sde_window_range"] == [1, 8]
    assert yaml.safe_load(yaml.safe_dump(plain)) == plain
    path = dump_config(cfg, tmp_path / "out" / "config.yaml")
    assert load_config(path) == cfg


def test_a_choice_is_read_as_its_member_and_saved_as_its_plain_string(tmp_path: Path) -> None:
    import json
    from enum import StrEnum

    from digen.config import Dtype, Mode
    from digen.sched.tag import TagPolicyName

    cfg = load_config(overrides=["runtime.mode=disaggregated", "model.dtype=bfloat16"])
    assert cfg.runtime.mode is Mode.DISAGGREGATED and cfg.runtime.mode == "disaggregated"
    assert cfg.model.dtype is Dtype.BFLOAT16 and f"{cfg.model.dtype}" == "bfloat16"
    assert cfg.runtime.schedule.tag is TagPolicyName.BTS  # a default is its member too
    assert DigenConfig(model={"dtype": "float16"}).model.dtype is Dtype.FLOAT16
    allowed = "is not allowed: choose one of auto, fixed, arrival."
    with pytest.raises(ConfigError, match=rf"^train\.grad_order = 'first' {allowed}$"):
        load_config(overrides=["train.grad_order=first"])

    def members(value):
        if isinstance(value, dict):
            return [m for v in value.values() for m in members(v)]
        if isinstance(value, list):
            return [m for v in value for m in members(v)]
        return [value] if isinstance(value, StrEnum) else []

    plain = config_to_dict(cfg)
    assert members(plain) == []  # plain strings only: yaml.safe_dump refuses str subclasses
    assert json.loads(json.dumps(plain)) == plain
    path = dump_config(cfg, tmp_path / "config.yaml")
    assert "mode: disaggregated" in path.read_text()
    assert load_config(path) == cfg


# Settings in every runtime section, none of them the default.
SECTIONED = [
    "runtime.mode=disaggregated",
    "runtime.generators=2",
    "runtime.placement.threads_per_worker=2",
    "runtime.placement.trainer_dtype=bfloat16",
    "runtime.schedule.max_staleness=1",
    "runtime.schedule.tag=static",
    "runtime.schedule.tag_k=2",
    "runtime.transport.rpc_timeout_s=30",
    "runtime.transport.port=29400",
    "runtime.elastic.min_generators=2",
    "runtime.elastic.respawn_generators=true",
]


def test_the_saved_config_is_sectioned_and_an_older_flat_one_loads_the_same(
    tmp_path: Path,
) -> None:
    """config.yaml is written with ``runtime`` in sections and reads back equal; the flat
    layout every older run's config.yaml has (each key directly under ``runtime``) loads to
    the same config, as ``digen run --resume`` reads it too."""
    from helpers import flat_runtime

    from digen.config import FORMER_RUNTIME_KEYS

    cfg = load_config(overrides=SECTIONED)
    saved = dump_config(cfg, tmp_path / "new" / "config.yaml")
    plain = yaml.safe_load(saved.read_text())
    assert list(plain["runtime"]) == [
        "mode",
        "generators",
        "trainers",
        "placement",
        "schedule",
        "transport",
        "elastic",
    ]
    assert plain["runtime"]["schedule"]["max_staleness"] == 1
    assert load_config(saved) == cfg
    flat = flat_runtime(plain)
    assert set(flat["runtime"]) == {"mode", "generators", "trainers", *FORMER_RUNTIME_KEYS}
    old = tmp_path / "old" / "config.yaml"
    old.parent.mkdir()
    old.write_text(yaml.safe_dump(flat, sort_keys=False))
    assert load_config(old) == cfg
    # as --resume reads the run's own file: the command line's flags and overrides on top,
    # where an override by the new key wins over the file's former one
    again = {"overrides": ["runtime.schedule.max_staleness=2"], "base": {"steps": 20}}
    resumed = load_config(old, **again, preset=False)
    assert resumed == load_config(saved, **again, preset=False)
    assert (resumed.runtime.schedule.max_staleness, resumed.steps) == (2, 20)


def test_the_former_flat_runtime_keys_still_name_their_settings(tmp_path: Path) -> None:
    """A key of the flat layout (``runtime.max_staleness``) means its section's
    (``runtime.schedule.max_staleness``), in an override, a YAML file and a Python mapping."""
    from digen.config import FORMER_RUNTIME_KEYS, RuntimeConfig

    runtime = RuntimeConfig()
    top = {f.name for f in dataclasses.fields(RuntimeConfig)}
    for key, section in FORMER_RUNTIME_KEYS.items():
        assert key not in top
        assert key in {f.name for f in dataclasses.fields(getattr(runtime, section))}
    new = load_config(overrides=["runtime.schedule.max_staleness=1"])
    assert load_config(overrides=["runtime.max_staleness=1"]) == new
    assert DigenConfig(runtime={"max_staleness": 1}) == new
    old = tmp_path / "old.yaml"
    old.write_text("runtime:\n  mode: colocated\n  max_staleness: 1\n")
    assert load_config(old) == new
    # one setting said twice, the same
    assert DigenConfig(runtime={"max_staleness": 1, "schedule": {"max_staleness": 1}}) == new
    twice = ["runtime.max_staleness=1", "runtime.schedule.max_staleness=1"]
    assert load_config(overrides=twice) == new
    # a later layer wins, by either key
    newer = tmp_path / "new.yaml"
    newer.write_text("runtime:\n  schedule:\n    max_staleness: 1\n")
    for later, want in [
        (load_config(old, ["runtime.schedule.max_staleness=2"]), 2),
        (load_config(old, base={"runtime": {"schedule": {"max_staleness": 3}}}), 3),
        (load_config(newer, ["runtime.max_staleness=2"]), 2),
    ]:
        assert later.runtime.schedule.max_staleness == want
    # every former key, as an override
    for key, section in FORMER_RUNTIME_KEYS.items():
        value = getattr(getattr(runtime, section), key)
        said = "null" if value is None else str(value).lower() if isinstance(value, bool) else value
        assert load_config(overrides=[f"runtime.{key}={said}"]) == DigenConfig()


@pytest.mark.parametrize(
    "given",
    [
        "mapping",
        "yaml",
        ["runtime.max_staleness=1", "runtime.schedule.max_staleness=2"],
        ["runtime.schedule.max_staleness=2", "runtime.max_staleness=1"],
    ],
    ids=["mapping", "yaml", "overrides", "overrides, new first"],
)
def test_a_setting_given_by_its_former_and_its_new_key_differently_is_refused(
    tmp_path: Path, given: str | list[str]
) -> None:
    both = {"max_staleness": 1, "schedule": {"max_staleness": 2}}
    with pytest.raises(ConfigError) as info:
        if given == "mapping":
            DigenConfig(runtime=both)
        elif given == "yaml":
            path = tmp_path / "c.yaml"
            path.write_text(yaml.safe_dump({"runtime": both}))
            load_config(path)
        else:
            load_config(overrides=given)
    assert str(info.value) == (
        "runtime.max_staleness = 1 is not allowed: it is the former name of "
        "runtime.schedule.max_staleness, which is given as 2; give only "
        "runtime.schedule.max_staleness."
    )
    assert_one_sentence(str(info.value))


def test_sections_from_mappings_and_direct_checks() -> None:
    assert DigenConfig(rollout={"n": 8}).rollout == RolloutConfig(n=8, sde_type="sde")
    with pytest.raises(ConfigError, match=r"^rollout\.n = 1 is not allowed"):
        RolloutConfig(n=1)
    with pytest.raises(ConfigError, match=r"^algo\.clip_ratio = 0\.0 is not allowed"):
        DigenConfig(algo=AlgoConfig(clip_ratio=0))
    cfg = DigenConfig()
    cfg.rollout.n = 0  # changed in place: validate() finds it
    with pytest.raises(ConfigError, match=r"^rollout\.n = 0"):
        validate(cfg)
    from digen.config import ScheduleConfig

    with pytest.raises(ConfigError, match=r"^runtime\.schedule\.max_staleness = -1 is not"):
        ScheduleConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match=r"^runtime\.schedule\.tag = 'always' is not"):
        DigenConfig(runtime={"schedule": {"tag": "always"}})
    cfg = DigenConfig()
    cfg.runtime.elastic.min_generators = 2  # more than runtime.generators, in place
    with pytest.raises(ConfigError, match=r"^runtime\.elastic\.min_generators = 2 is not"):
        validate(cfg)


# (overrides, dotted key, value as printed)
BAD = [
    # types
    (["rollout.n=2.5"], "rollout.n", "2.5"),
    (["rollout.n=true"], "rollout.n", "True"),
    (["train.lr=fast"], "train.lr", "'fast'"),
    (["train.lr=.nan"], "train.lr", "nan"),
    (["model.name=[flux]"], "model.name", "['flux']"),
    (["rollout.sde_window_range=[1,2,3]"], "rollout.sde_window_range", "[1, 2, 3]"),
    (["train.lora_targets=to_q"], "train.lora_targets", "'to_q'"),
    (["seed=1.5"], "seed", "1.5"),
    # choices
    (["model.name=sdxl"], "model.name", "'sdxl'"),
    (["model.dtype=fp8"], "model.dtype", "'fp8'"),
    (["rollout.sde_type=ode"], "rollout.sde_type", "'ode'"),
    (["algo.name=ppo"], "algo.name", "'ppo'"),
    (["algo.adv_norm=batch"], "algo.adv_norm", "'batch'"),
    (["train.lora_dtype=int8"], "train.lora_dtype", "'int8'"),
    (["train.grad_order=[fixed]"], "train.grad_order", "['fixed']"),
    (["rewards.0.on_error=skip"], "rewards.0.on_error", "'skip'"),
    # ranges
    (["rollout.n=1"], "rollout.n", "1"),
    (["rollout.num_inference_steps=0"], "rollout.num_inference_steps", "0"),
    (["eval.num_inference_steps=0"], "eval.num_inference_steps", "0"),
    (["eval.solver=dpm2-post"], "eval.solver", "'dpm2-post'"),
    (["rollout.noise_level=-0.1"], "rollout.noise_level", "-0.1"),
    (["rollout.timestep_fraction=0"], "rollout.timestep_fraction", "0.0"),
    (["rollout.timestep_fraction=1.5"], "rollout.timestep_fraction", "1.5"),
    (["rollout.guidance_scale=0.5"], "rollout.guidance_scale", "0.5"),
    (["algo.clip_ratio=0"], "algo.clip_ratio", "0.0"),
    (["algo.adv_clip_max=-1"], "algo.adv_clip_max", "-1.0"),
    (["algo.kl_coef=-0.01"], "algo.kl_coef", "-0.01"),
    (["train.lr=0"], "train.lr", "0.0"),
    (["train.lora_rank=-1"], "train.lora_rank", "-1"),
    (["train.micro_batch_size=0"], "train.micro_batch_size", "0"),
    (["train.num_devices=0"], "train.num_devices", "0"),
    (["train.mini_batch_size=0"], "train.mini_batch_size", "0"),
    (["data.train_batch_size=0"], "data.train_batch_size", "0"),
    (["steps=0"], "steps", "0"),
    (["model.height=100"], "model.height", "100"),
    (["model.width=8"], "model.width", "8"),
    (["model.name=wan", "model.num_frames=8"], "model.num_frames", "8"),
    (["model.num_frames=5"], "model.num_frames", "5"),  # flux is an image backbone
    (["algo.best_of_n=3"], "algo.best_of_n", "3"),
    (["algo.best_of_n=1"], "algo.best_of_n", "1"),
    (["rollout.n=4", "algo.best_of_n=6"], "algo.best_of_n", "6"),
    (["rewards=[{name: jpeg_compressibility, weight: .inf}]"], "rewards.0.weight", "inf"),
    (["rewards.0.name=no_such_reward"], "rewards.0.name", "'no_such_reward'"),
    # SDE window
    (["rollout.sde_window_size=11"], "rollout.sde_window_size", "11"),
    (["rollout.sde_window_range=[-1,5]"], "rollout.sde_window_range", "[-1, 5]"),
    (["rollout.sde_window_range=[0,11]"], "rollout.sde_window_range", "[0, 11]"),
    (["rollout.sde_window_range=[6,5]"], "rollout.sde_window_range", "[6, 5]"),
    (
        ["rollout.sde_window_size=3", "rollout.sde_window_range=[2,4]"],
        "rollout.sde_window_range",
        "[2, 4]",
    ),
    # algorithm / SDE pairing
    (["algo.name=dancegrpo", "rollout.sde_type=cps"], "rollout.sde_type", "'cps'"),
    (["rollout.sde_type=dance"], "rollout.sde_type", "'dance'"),
    # rewards
    (["rewards=[]"], "rewards", "[]"),
    (
        ["rewards=[jpeg_compressibility, jpeg_compressibility]"],
        "rewards.1.name",
        "'jpeg_compressibility'",
    ),
    # nested batch sizes, each breaking one rule of the worked example
    ([*WORKED, "train.mini_batch_size=12"], "train.mini_batch_size", "12"),
    ([*WORKED, "train.mini_batch_size=64"], "train.mini_batch_size", "64"),
    ([*WORKED, "train.mini_batch_size=1", "rollout.n=6"], "train.num_devices", "4"),
    ([*WORKED, "train.num_devices=3"], "train.num_devices", "3"),
    ([*WORKED, "train.micro_batch_size=24"], "train.micro_batch_size", "24"),
    ([*WORKED, "train.micro_batch_size=128"], "train.micro_batch_size", "128"),
    # best-of-N: 16 prompts x 2 kept = 32 samples -> 8 per device, so micro 16 no longer fits
    (
        [*WORKED, "algo.name=dancegrpo", "algo.best_of_n=2"],
        "train.micro_batch_size",
        "16",
    ),
    # ... and 2 prompts x 2 kept = 4 samples cannot be split over 8 devices
    (
        [
            *WORKED,
            "algo.name=dancegrpo",
            "algo.best_of_n=2",
            "train.mini_batch_size=2",
            "train.num_devices=8",
            "train.micro_batch_size=1",
        ],
        "train.num_devices",
        "8",
    ),
    # colocated data parallelism shares out every sample of a step
    (
        [
            "data.train_batch_size=1",
            "rollout.n=6",
            "algo.name=dancegrpo",
            "algo.best_of_n=4",
            "train.num_devices=4",
            "train.micro_batch_size=1",
        ],
        "train.num_devices",
        "4",
    ),
    # runtime
    (["runtime.mode=async"], "runtime.mode", "'async'"),
    (["runtime.generators=0"], "runtime.generators", "0"),
    (["runtime.trainers=0"], "runtime.trainers", "0"),
    (["runtime.placement.threads_per_worker=0"], "runtime.placement.threads_per_worker", "0"),
    (["runtime.placement.trainer_dtype=fp8"], "runtime.placement.trainer_dtype", "'fp8'"),
    (["runtime.schedule.microbatch_axis=sample"], "runtime.schedule.microbatch_axis", "'sample'"),
    (["runtime.schedule.samples_per_microbatch=0"], "runtime.schedule.samples_per_microbatch", "0"),
    (["runtime.schedule.tsp_degree=0"], "runtime.schedule.tsp_degree", "0"),
    (["runtime.schedule.pipeline=maybe"], "runtime.schedule.pipeline", "'maybe'"),
    (["runtime.transport.weight_sync=nccl"], "runtime.transport.weight_sync", "'nccl'"),
    (["runtime.schedule.tag=always"], "runtime.schedule.tag", "'always'"),
    (["runtime.schedule.tag_k=-1"], "runtime.schedule.tag_k", "-1"),
    (["runtime.schedule.max_staleness=-1"], "runtime.schedule.max_staleness", "-1"),
    (["runtime.schedule.staleness_ratio=1.5"], "runtime.schedule.staleness_ratio", "1.5"),
    (["runtime.transport.rpc_timeout_s=0"], "runtime.transport.rpc_timeout_s", "0.0"),
    (["runtime.transport.port=70000"], "runtime.transport.port", "70000"),
    (
        ["runtime.elastic.accept_generators=true"],
        "runtime.elastic.accept_generators",
        "True",
    ),  # colocated
    (
        ["runtime.mode=disaggregated", "runtime.transport.weight_sync=broadcast"]
        + ["runtime.elastic.accept_generators=true"],
        "runtime.elastic.accept_generators",
        "True",
    ),
    # a join secret only for a run that takes joiners, and a file named
    (["runtime.elastic.join_secret_file=/s"], "runtime.elastic.join_secret_file", "'/s'"),
    # the rules that span sections, and the elastic section's own
    (["runtime.elastic.min_generators=2"], "runtime.elastic.min_generators", "2"),
    # grouped updates are for sharded trainers: not replicated ones, nor colocated workers
    (
        ["runtime.mode=disaggregated", "runtime.trainers=2"]
        + ["runtime.schedule.group_updates=true"],
        "runtime.schedule.group_updates",
        "True",
    ),
    (
        ["runtime.trainers=2", "runtime.placement.trainer_parallel=fsdp"]
        + ["runtime.schedule.group_updates=true"],
        "runtime.schedule.group_updates",
        "True",
    ),
    # tokens split over sharded trainers of a disaggregated run only
    (
        ["runtime.mode=disaggregated", "runtime.trainers=2"]
        + ["runtime.placement.shard_deal=sequence"],
        "runtime.placement.shard_deal",
        "'sequence'",
    ),
    # a generator of several devices: disaggregated, never restarted or joining, pulling
    (["runtime.placement.generator_sequence=2"], "runtime.placement.generator_sequence", "2"),
    (
        ["runtime.mode=disaggregated", "runtime.placement.generator_sequence=0"],
        "runtime.placement.generator_sequence",
        "0",
    ),
    (
        ["runtime.mode=disaggregated", "runtime.placement.generator_sequence=2"]
        + ["runtime.elastic.respawn_generators=true"],
        "runtime.placement.generator_sequence",
        "2",
    ),
    (
        ["runtime.mode=disaggregated", "runtime.placement.generator_sequence=2"]
        + ["runtime.transport.weight_sync=broadcast"],
        "runtime.placement.generator_sequence",
        "2",
    ),
    (
        ["runtime.mode=disaggregated", "runtime.placement.generator_cfg=true"],
        "runtime.placement.generator_cfg",
        "True",
    ),  # no guidance to split
    (
        ["runtime.elastic.on_generator_loss=fail", "runtime.elastic.respawn_generators=true"],
        "runtime.elastic.respawn_generators",
        "True",
    ),
    (
        ["runtime.mode=disaggregated", "runtime.elastic.accept_generators=true"]
        + ["runtime.elastic.join_secret_file=' '"],
        "runtime.elastic.join_secret_file",
        "' '",
    ),
    # C_gen below what must be generated before anything trains would deadlock the driver:
    # a GAP group (2 of 2 samples each), or the whole step with a batch-wide std
    (
        ["runtime.mode=disaggregated", "runtime.generators=2", "runtime.schedule.max_inflight=1"],
        "runtime.schedule.max_inflight",
        "1",
    ),
    (
        [
            "runtime.mode=disaggregated",
            "data.train_batch_size=2",
            "runtime.generators=2",
            "algo.adv_std=global",
            "runtime.schedule.max_inflight=3",
        ],
        "runtime.schedule.max_inflight",
        "3",
    ),
]


@pytest.mark.parametrize(
    ("overrides", "key", "value"), BAD, ids=[" ".join(row[0][-2:]) for row in BAD]
)
def test_bad_values(overrides: list[str], key: str, value: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    message = str(info.value)
    assert message.startswith(f"{key} = {value} is not allowed: "), message
    assert_one_sentence(message)


def test_best_of_n_counts_kept_samples() -> None:
    # 16 prompts x 2 kept = 32 samples over 4 devices = 8 each: micro-batches of 8 fit.
    cfg = load_config(
        overrides=[*WORKED, "algo.name=dancegrpo", "algo.best_of_n=2", "train.micro_batch_size=8"]
    )
    assert cfg.algo.best_of_n == 2


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["rollout.nn=3"], "unknown config key 'rollout.nn'; rollout has: n, num_inference_steps,"),
        (["foo=1"], "unknown config key 'foo'; the top level has: model, rollout,"),
        (
            ["rewards.0.wieght=2"],
            "unknown config key 'rewards.0.wieght'; a reward has: name, weight, timeout_s, "
            "retries, on_error, url, options.",
        ),
        (["rewards.x=2"], "unknown config key 'rewards.x'"),
        (["rewards.5.name=a:b"], "config key 'rewards.5.name' is out of range"),
        (["rollout.n.x=3"], "config key 'rollout.n.x' does not exist"),
        (["seed.x=3"], "config key 'seed.x' does not exist"),
        (["rollout.n"], "override 'rollout.n' is malformed: write key=value"),
        (["=3"], "override '=3' is malformed"),
        (
            ["rollout.negative_prompt=[oops"],
            "override 'rollout.negative_prompt=[oops' has a value that",
        ),
        (["rollout=5"], "rollout = 5 is not allowed: it must be a mapping of rollout settings."),
        (["rewards=[{weight: 2}]"], "rewards.0 = {'weight': 2} is not allowed"),
        (["rewards=jpeg"], "rewards = 'jpeg' is not allowed"),
        # runtime: its own keys, then its sections
        (
            ["runtime.max_stalenes=1"],
            "unknown config key 'runtime.max_stalenes'; runtime has: mode, generators, "
            "trainers, placement, schedule, transport, elastic.",
        ),
        (
            ["runtime.schedule.max_stalenes=1"],
            "unknown config key 'runtime.schedule.max_stalenes'; runtime.schedule has: "
            "microbatch_axis, samples_per_microbatch,",
        ),
        (
            ["runtime.schedule=5"],
            "runtime.schedule = 5 is not allowed: it must be a mapping of runtime.schedule "
            "settings.",
        ),
        (
            ["runtime.schedule.tag.k=1"],
            "config key 'runtime.schedule.tag.k' does not exist: runtime.schedule holds plain "
            "settings.",
        ),
    ],
)
def test_bad_keys_and_overrides(overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(overrides=overrides)
    assert str(info.value).startswith(expected), str(info.value)
    assert_one_sentence(str(info.value))


def test_unknown_key_in_yaml_section(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("algo:\n  clip_ratoi: 0.2\n")
    with pytest.raises(
        ConfigError, match=r"^unknown config key 'algo\.clip_ratoi'; algo has: name,"
    ):
        load_config(path)
    path.write_text("runtime:\n  elastic:\n    max_respawn: 2\n")
    with pytest.raises(
        ConfigError,
        match=r"^unknown config key 'runtime\.elastic\.max_respawn'; runtime\.elastic has: ",
    ):
        load_config(path)
    path.write_text("runtime:\n  respawn: true\n")
    with pytest.raises(ConfigError, match=r"'runtime\.respawn'; runtime has: mode, generators,"):
        load_config(path)
    path.write_text("rewards:\n  - {name: jpeg_compressibility, weigth: 2}\n")
    with pytest.raises(
        ConfigError, match=r"'rewards\.0\.weigth'; a reward has: name, weight, timeout_s,"
    ):
        load_config(path)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config file '.*missing\.yaml' does not exist\.$"):
        load_config(tmp_path / "missing.yaml")
    listed = tmp_path / "list.yaml"
    listed.write_text("- a\n- b\n")
    with pytest.raises(ConfigError) as info:
        load_config(listed)
    assert "must hold a mapping of sections" in str(info.value)
    assert str(info.value).endswith("not a list.")
    broken = tmp_path / "broken.yaml"
    broken.write_text("model: [flux\n")
    with pytest.raises(ConfigError) as info:
        load_config(broken)
    assert "is not valid YAML" in str(info.value)
    assert_one_sentence(str(info.value))
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == DigenConfig()


def test_each_pool_gets_its_own_device_and_dtype() -> None:
    from digen.runtime.worker.base import pool_config

    cfg = load_config(
        overrides=[
            "runtime.placement.generator_dtype=bfloat16",
            "runtime.placement.trainer_devices=meta",
        ]
    )
    gen, trainer = pool_config(cfg, "generator"), pool_config(cfg, "trainer")
    assert (gen.model.dtype, gen.model.device) == ("bfloat16", "cpu")
    assert (trainer.model.dtype, trainer.model.device) == ("float32", "meta")
    assert cfg.model.dtype == "float32"  # the run's own config is left alone


def test_the_shapes_flavour_presets_the_shapes_task_at_its_own_size() -> None:
    from digen.presets import SHAPES_TASK

    cfg = load_config(model="flux", overrides=["model.flavour=shapes"])
    assert cfg.model.height is None and cfg.model.width is None  # the flavour's 32 px
    assert cfg.data.prompts == "shapes" and [r.name for r in cfg.rewards] == ["shapes"]
    assert (cfg.eval.every, cfg.eval.samples, cfg.eval.per_category) == (10, 1, 32)
    assert tuple(SHAPES_TASK["eval"].values()) == (10, 1, 32)
    assert (cfg.data.train_batch_size, cfg.data.per_category) == (4, 192)
    assert cfg.train.lr < load_config(model="flux").train.lr  # a model that already draws
    tiny = load_config(model="flux")
    # guidance against the empty prompt, which the flavour was pretrained to give
    assert (cfg.rollout.guidance_scale, tiny.rollout.guidance_scale) == (3.0, 1.0)
    assert (tiny.model.height, tiny.data.prompts, tiny.eval.every) == (64, None, 0)


def test_the_knobs_table_in_the_docs_is_the_configs_own() -> None:
    """RUNTIME.md's tables of ``runtime.*`` keys (the top ones, then one per section) are
    generated from the config's fields and docstrings; after changing a key, paste
    ``knobs_table("runtime")`` between its markers."""
    from pathlib import Path

    from digen.config import RuntimeConfig, field_docs, knobs_table

    docs = (Path(__file__).resolve().parents[2] / "docs" / "RUNTIME.md").read_text()
    shown = docs.split("<!-- knobs: runtime -->\n", 1)[1].split("\n<!-- /knobs -->", 1)[0]
    assert shown == knobs_table("runtime")
    # every key has its sentence, and the tables have a row per key: the top ones, then
    # each section's
    top, sections = [], {}
    assert set(field_docs(RuntimeConfig)) == {f.name for f in dataclasses.fields(RuntimeConfig)}
    for f in dataclasses.fields(RuntimeConfig):
        inner = getattr(RuntimeConfig(), f.name)
        if not dataclasses.is_dataclass(inner):
            top.append(f"runtime.{f.name}")
            continue
        names = [g.name for g in dataclasses.fields(inner)]
        assert set(field_docs(type(inner))) == set(names)
        sections[f"runtime.{f.name}"] = [f"runtime.{f.name}.{n}" for n in names]
    assert list(sections) == [
        "runtime.placement",
        "runtime.schedule",
        "runtime.transport",
        "runtime.elastic",
    ]
    rows = [line.split("`")[1] for line in shown.splitlines() if line.startswith("| `")]
    assert rows == top + [key for keys in sections.values() for key in keys]
    leads = [line.split("`")[1] for line in shown.splitlines() if line.startswith("`")]
    assert leads == list(sections)
