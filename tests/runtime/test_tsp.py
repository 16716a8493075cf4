"""Timestep parallelism: one batched forward/backward over several timesteps gives the same
gradient as the timestep-by-timestep loop."""

from __future__ import annotations

import pytest
import torch

from digen.config import load_config
from digen.presets import preset
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy


def _grads_for(policy: Policy, item: TrainItem, tsp: int) -> tuple[list[torch.Tensor], float]:
    policy.optimizer.zero_grad(set_to_none=True)
    stats = policy.accumulate(item, loss_scale=1.0 / 24, tsp_degree=tsp)
    return [g.clone() for g in policy.grads()], stats.means()["loss"]


@pytest.mark.parametrize(
    ("model", "algo", "extra"),
    [
        ("flux", "flowgrpo", ["rollout.sde_window_size=3", "algo.kl_coef=0.1"]),
        ("wan", "dancegrpo", ["rollout.timestep_fraction=0.6", "rollout.guidance_scale=3.0"]),
    ],
)
def test_batched_timesteps_equal_sequential_gradient(
    model: str, algo: str, extra: list[str]
) -> None:
    over = ["rollout.n=4", "rollout.num_inference_steps=5", "train.micro_batch_size=4"]
    cfg = load_config(base=preset(model, algo), overrides=[*over, *extra])
    policy = Policy(cfg)
    keys = [SampleKey(0, p, s) for p in range(2) for s in range(2)]
    prompts = ["a red cube", "a red cube", "two cats", "two cats"]
    gen = policy.generate(keys, prompts)
    k_trained = len(policy.sampler_spec(0).window)
    assert k_trained >= 3
    # move the LoRA off zero so the gradient depends on every layer
    with torch.no_grad():
        for p in policy.params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    item = TrainItem(keys, prompts, gen.rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    g1, loss1 = _grads_for(policy, item, 1)
    norm = sum(float(g.norm()) for g in g1)
    assert norm > 0
    for tsp in (2, 5):  # an uneven chunking (2 + 2 + 1 or 2 + 1) and everything in one batch
        g, loss = _grads_for(policy, item, tsp)
        assert loss == pytest.approx(loss1, rel=1e-4, abs=1e-8)
        for a, b in zip(g1, g):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)


def test_activation_checkpointing_keeps_the_gradient() -> None:
    """``train.gradient_checkpointing`` recomputes activations in the backward pass: the
    same gradient, less memory."""
    over = ["rollout.n=2", "rollout.num_inference_steps=4", "algo.kl_coef=0.0"]
    over += ["data.train_batch_size=1", "train.micro_batch_size=2"]
    plain = Policy(load_config(base=preset("sd3", "flowgrpo"), overrides=over))
    ckpt_cfg = load_config(
        base=preset("sd3", "flowgrpo"), overrides=[*over, "train.gradient_checkpointing=true"]
    )
    checkpointed = Policy(ckpt_cfg)
    assert checkpointed.adapter.transformer.is_gradient_checkpointing
    assert not plain.adapter.transformer.is_gradient_checkpointing
    keys = [SampleKey(0, 0, s) for s in range(2)]
    gen = plain.generate(keys, ["a red cube"] * 2)
    item = TrainItem(keys, ["a red cube"] * 2, gen.rollout, torch.tensor([1.0, -1.0]))
    for policy in (plain, checkpointed):  # LoRA B off zero: every layer's gradient counts
        with torch.no_grad():
            for p in policy.params:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(7)))
    want, _ = _grads_for(plain, item, 2)
    got, _ = _grads_for(checkpointed, item, 2)
    assert sum(float(g.norm()) for g in want) > 0
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
