"""Sequence parallelism (Ulysses) and CFG parallelism against one device, for every backbone.

Real processes on gloo (2 and 4), the real tiny architectures loaded through
``from_pretrained``: each member computes a guided velocity and the gradient of every
transformer weight with the model split over the group, and the result is measured, as one
device's fp32 result is, against the same computation in fp64 (``sequence_ranks.py``).

The bound: the split pass does one device's arithmetic in other orders (attention's keys
summed in the group's order, products over fewer rows, a weight's gradient summed over the
members), so its rounding is of the same kind and count as one device's. Its distance from
the fp64 result can differ from one device's by chance, not in scale: allowed 4x (16x the
variance), plus one fp32 rounding of the result's size. A mistake (a token's rotary position
or mask lost, a piece gathered out of place, a gradient counted twice) errs by a sizeable
part of the result: 1e5 times the rounding here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import SMOOTH_REWARD, assert_trained_alike, free_port, tiny_config

from digen.config import DigenConfig
from digen.registry.models import MODEL_NAMES

ROUNDING = 4.0
U32 = torch.finfo(torch.float32).eps / 2


def run_ranks(world: int, cfg: int, out: Path, flags: tuple[str, ...] = ()) -> dict:
    script = Path(__file__).with_name("sequence_ranks.py")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(r), str(world), str(port), str(out), str(cfg)]
            + list(flags)
            + list(MODEL_NAMES),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "cfg", "flags"),
    [
        (2, 1, ()),
        (4, 1, ()),
        (2, 2, ()),
        (4, 2, ()),
        (2, 1, ("--checkpointing",)),
        (4, 2, ("--bf16",)),
    ],
    ids=["sp2", "sp4", "cfg2", "cfg2xsp2", "sp2-checkpointed", "cfg2xsp2-bf16"],
)
def test_split_pass_equals_one_device(
    tmp_path: Path, world: int, cfg: int, flags: tuple[str, ...]
) -> None:
    """Velocity and gradients of every backbone split over ``world`` gloo processes (``cfg``
    guidance branches, each sequence-parallel over ``world / cfg``) equal one device's within
    the rounding bound; every member ends with the same velocity; each member held its share
    of every spanning attention's tokens and saved less for the backward pass than one
    device does. Checkpointed (every block recomputed in the backward, its all-to-alls
    again), the same; in bf16 (a GPU run's base) against one device's bf16 result."""
    report = run_ranks(world, cfg, tmp_path / "report.json", flags)
    assert sorted(report) == sorted(MODEL_NAMES)
    sequence = world // cfg
    for model, got in report.items():
        for part in ("velocity", "grads"):
            one, split, size = (got[part][k] for k in ("one", "split", "size"))
            bound = ROUNDING * one + U32 * size
            assert split <= bound, f"{model} {part}: {split:.3g} from fp64, one device {one:.3g}"
        assert got["spread"] == 0.0, model
        if sequence > 1:
            assert got["spanned"] > 0, model
            assert 1 / sequence <= got["share"] < 2 / sequence, model
        else:
            assert got["spanned"] == 0, model
        assert got["saved"]["split"] < got["saved"]["one"], model


def _trained(cfg: DigenConfig) -> tuple[dict, list[dict]]:
    """Train one step of ``cfg``: the trained weights, and every process of generator 0's
    statistics."""
    import asyncio

    from digen.prompts import PromptSet
    from digen.runtime.driver.loop import Driver
    from digen.sched.trace import Trace

    async def run() -> tuple[dict, list[dict]]:
        async with Driver(cfg, None, PromptSet.builtin(), Trace()) as driver:
            await driver.run(1)
            actor = driver.gens[0].actor
            members = getattr(actor, "handles", [actor])
            stats = await asyncio.gather(*(h.call("statistics") for h in members))
            state = await driver.trainers[0].trainable_state()
        return state, list(stats)

    return asyncio.run(run())


RUN = [
    "steps=1",
    "rollout.n=4",
    "train.micro_batch_size=2",
    "rollout.num_inference_steps=4",
    "runtime.schedule.tag=none",
    SMOOTH_REWARD,
]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "sequence", "cfg"),
    [("flux", 2, False), ("sd3", 1, True), ("wan", 2, True)],
    ids=["flux-sp2", "sd3-cfg2", "wan-cfg2xsp2"],
)
def test_a_generator_on_several_devices_trains_as_one(
    tmp_path: Path, model: str, sequence: int, cfg: bool
) -> None:
    """A generator of ``sequence`` (x 2 with CFG parallelism) processes, each computing its
    share of every sample, makes what one process makes: the step trains the same weights
    (within rounding: the samples may differ in their last bits, so the reward is a smooth
    one). Every process held its share of the tokens of every spanning attention, and with
    CFG parallelism the first half ran the prompt's branch, the second the negative's."""
    guided = ["rollout.guidance_scale=4.5"] if cfg else []
    one = tiny_config(model, "flowgrpo", [*RUN, *guided], mode="disaggregated")
    split = [f"runtime.placement.generator_sequence={sequence}"]
    split += [f"runtime.placement.generator_cfg={str(cfg).lower()}"]
    many = tiny_config(model, "flowgrpo", [*RUN, *guided, *split], mode="disaggregated")
    want, _ = _trained(one)
    got, stats = _trained(many)
    assert_trained_alike(got, want)
    assert len(stats) == sequence * (2 if cfg else 1)
    branches = [s["guidance_branch"] for s in stats]
    assert branches == ([0] * sequence + [1] * sequence if cfg else [None] * sequence)
    shares = [s["token_share"] for s in stats]
    if sequence == 1:
        assert shares == [1.0] * len(stats)
    else:  # each branch's members held their pieces of the tokens, the first the larger
        for branch in range(len(stats) // sequence):
            mine = shares[branch * sequence : (branch + 1) * sequence]
            assert all(0 < x < 1 for x in mine) and abs(sum(mine) - 1) < 1e-9, shares
            assert mine[0] >= 1 / sequence, shares


def test_pieces_cover_every_item_and_differ_by_at_most_one() -> None:
    from digen.runtime.worker.sequence import pieces

    assert pieces(5, 2) == [3, 2]
    assert pieces(2, 4) == [1, 1, 0, 0]  # fewer heads than devices: some hold none
    for n, k in [(7, 3), (24, 8), (38, 8), (1, 1)]:
        got = pieces(n, k)
        assert sum(got) == n and max(got) - min(got) <= 1 and got == sorted(got, reverse=True)


def test_module_patterns_match_name_by_name() -> None:
    from digen.runtime.worker.sequence import _module_matches

    assert _module_matches("transformer_blocks.*", "transformer_blocks.0")
    assert not _module_matches("transformer_blocks.*", "transformer_blocks.0.attn")
    assert _module_matches("*transformer_blocks.*", "single_transformer_blocks.3")
    assert _module_matches("", "") and not _module_matches("", "proj_out")


def test_a_generators_processes_are_named_after_it_and_in_no_pool() -> None:
    from digen.sched.names import index_of, member_name, member_of, pool_of

    assert member_name("generator-3", 0) == "generator-3"
    assert member_name("generator-3", 2) == "generator-3:2"
    assert member_of("generator-3:2") == ("generator-3", 2)
    assert member_of("generator-3") == ("generator-3", 0)
    assert member_of("trainer-1") == ("trainer-1", 0)
    assert index_of("generator-3:2") == -1 and pool_of("generator-3:2") == "generator-3:2"


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_every_backbones_plan_names_modules_its_transformer_has(model: str) -> None:
    """A plan whose patterns match nothing (a module diffusers renamed) would leave the
    model whole on every device: each pattern matches, the gather exactly one module, and
    each spanning module is an attention with a processor."""
    from digen.models import get_adapter_class
    from digen.runtime.worker.sequence import _matching

    adapter = get_adapter_class(model).tiny()
    plan = adapter.sequence_plan
    modules = dict(adapter.transformer.named_modules())
    for pattern in [*plan.inputs, *plan.outputs, *plan.attention]:
        assert _matching(pattern, modules), (model, pattern)
    assert len(_matching(plan.gather, modules)) == 1
    for pattern in plan.attention:
        for name in _matching(pattern, modules):
            assert hasattr(modules[name], "processor"), (model, name)
