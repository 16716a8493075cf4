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
