"""A policy's text conditioning: cached per prompt, each prompt in an encoder pass of its own,
and offloaded text encoders moved to the device once a call."""

from __future__ import annotations

import pytest
import torch

from digen.config import load_config
from digen.presets import preset
from digen.runtime.worker.policy import Policy


def test_offloaded_text_encoders_visit_the_device_once_a_call_and_embed_as_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call's uncached prompts are encoded in one visit of the offloaded text encoders to
    the device (not one visit a prompt: about 10 GB each way for FLUX), each prompt still in
    a pass of its own, so its bits are those of a call with it alone."""
    cfg = load_config(
        base=preset("sd3", "flowgrpo"), overrides=["model.offload_text_encoders=true"]
    )
    policy = Policy(cfg)
    moves: list[str] = []
    for encoder in policy.adapter.text_encoders():
        move = encoder.to

        def spy(*args, _move=move, **kwargs):
            moves.append(str(args[0] if args else kwargs["device"]))
            return _move(*args, **kwargs)

        monkeypatch.setattr(encoder, "to", spy)
    prompts = ["a red cube", "a blue ball", "a green cone", "a red cube"]
    cond = policy.conditioning(prompts)
    encoders = len(policy.adapter.text_encoders())
    assert encoders > 0
    assert sorted(moves) == sorted([str(policy.adapter.device), "cpu"] * encoders)
    assert policy.encoded == 3
    alone = Policy(cfg)
    for row, prompt in enumerate(prompts):
        want = alone.adapter.encode_prompts([prompt])
        for key, value in want.tensors.items():
            assert torch.equal(cond.tensors[key][row : row + 1], value), (prompt, key)
    moves.clear()
    policy.conditioning(prompts[:2])  # all cached: no visit at all
    assert moves == []


@pytest.mark.asyncio
async def test_offloaded_text_encoders_visit_a_generator_once_a_step() -> None:
    """A generate call carries one prompt; with offloaded text encoders it also carries its
    step's prompts, so a generator's encoders come to its device once a step (for the
    prompts it has not met), not once a micro-batch of a new prompt."""
    from helpers import tiny_config

    from digen.prompts import PromptSet
    from digen.runtime.driver.loop import Driver
    from digen.sched.trace import Trace

    over = ["steps=2", "data.train_batch_size=3", "rollout.n=2", "train.micro_batch_size=2"]
    over += ["runtime.schedule.tag=none", "train.mini_batch_size=null"]
    over += ["model.offload_text_encoders=true"]
    cfg = tiny_config("sd3", "flowgrpo", over, mode="disaggregated")
    prompts = PromptSet.builtin()
    async with Driver(cfg, None, prompts, Trace()) as driver:
        await driver.run(2)
        stats = await driver.gens[0].actor.call("statistics")
    seen: set[str] = set()
    visits = 0  # steps that bring a prompt not met before
    for step in range(2):
        texts = set(prompts.for_step(cfg.seed, step, 3)[0])
        visits += not texts <= seen
        seen |= texts
    negative = int(cfg.rollout.guidance_scale > 1.0)
    assert stats["encoded_prompts"] == len(seen) + negative
    assert stats["text_encoder_visits"] == visits
