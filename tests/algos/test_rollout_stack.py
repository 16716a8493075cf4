"""A rollout keeps each latent of its window once: the ``x_{i+1}`` a step draws is the ``x_i``
the next step starts from, so K consecutive kept steps hold K + 1 latents a sample, not 2K,
and training reads the same values, to the bit."""

from __future__ import annotations

import dataclasses
import math

import torch
from helpers import tiny_config

from digen.algos.rollout import Rollout, sample_rollout
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy
from digen.seeding import sample_generator

_OVER = ["rollout.num_inference_steps=5", "algo.kl_coef=0.0", "train.lr=1e-2"]


def _latents_kept(rollout: Rollout, latent: tuple[int, ...]) -> int:
    """How many latent-sized tensors a sample of ``rollout`` keeps (whatever its fields)."""
    b, size = rollout.log_probs.shape[0], math.prod(latent)
    kept = 0
    for f in dataclasses.fields(rollout):
        t = getattr(rollout, f.name)
        if isinstance(t, torch.Tensor) and tuple(t.shape[-len(latent) :]) == latent:
            kept += t.numel() // (b * size)
    return kept


def _sample(policy: Policy, window: tuple[int, ...], noisy: tuple[int, ...]) -> Rollout:
    spec = dataclasses.replace(policy.sampler_spec(0), window=window, stochastic=noisy)
    gens = [sample_generator(0, 0, 0, j) for j in range(2)]
    return sample_rollout(policy.adapter, policy.conditioning(["a red cube"] * 2), gens, spec)


def test_a_window_keeps_each_latent_once() -> None:
    """A window of 4 consecutive steps: 5 latents a sample (the final latent beside them),
    where one stack of ``x_i`` and one of ``x_{i+1}`` kept 8; a window with a gap keeps one
    run of latents per stretch. Every transition reads the latents a full record of the
    trajectory holds."""
    policy = Policy(tiny_config("flux", "flowgrpo", _OVER), trainable=False)
    latent = tuple(policy.adapter.latent_shape())
    every = tuple(range(5))
    whole = _sample(policy, every[:4], every)
    assert _latents_kept(whole, latent) == 4 + 1 + 1  # x_0 .. x_4, and the final latent
    pairs = Rollout.from_pairs(whole.latents, whole.next_latents, whole.log_probs, whole.final)
    assert _latents_kept(pairs, latent) == 2 * 4 + 1
    assert pairs.nbytes - whole.nbytes == 3 * 2 * math.prod(latent) * 4  # 3 fp32 latents x 2
    assert torch.equal(whole.latents[:, 1:], whole.next_latents[:, :-1])  # the one chain

    trajectory = _sample(policy, every, every)  # every x_i of the same samples, x_0 .. x_5
    gap = _sample(policy, (0, 1, 3), every)  # the same noise at every step: the same path
    assert _latents_kept(gap, latent) == 5 + 1  # x_0, x_1, x_2 and x_3, x_4
    assert torch.equal(gap.latents, trajectory.states[:, [0, 1, 3]])
    assert torch.equal(gap.next_latents, trajectory.states[:, [1, 2, 4]])
    rows, positions = torch.tensor([0, 1, 1]), torch.tensor([2, 0, 1])
    x_t, x_next = gap.transition(rows, positions)
    assert torch.equal(x_t, gap.latents[rows, positions])
    assert torch.equal(x_next, gap.next_latents[rows, positions])


def test_training_on_the_one_stack_equals_training_on_two() -> None:
    """The same samples trained from the one stack and from two stacks (``x_i`` and
    ``x_{i+1}`` kept apart, as before) end an optimizer step with the same bits."""
    cfg = tiny_config("flux", "flowgrpo", _OVER)
    keys = [SampleKey(0, 0, j) for j in range(2)]
    prompts = ["a red cube"] * 2
    made = Policy(cfg, trainable=False).generate(keys, prompts).rollout.for_training()
    apart = Rollout.from_pairs(made.latents, made.next_latents, made.log_probs)
    assert made.states.shape[1] < apart.states.shape[1]
    trained = []
    for rollout in (made, apart):
        policy = Policy(cfg, trainable=True)
        item = TrainItem(keys, prompts, rollout, torch.tensor([1.0, -1.0]))
        policy.accumulate(item, loss_scale=0.25)
        policy.optimizer_step()
        trained.append(policy.trainable_state("cpu"))
    one, two = trained
    assert any(float(v.abs().max()) > 0 for n, v in one.items() if "lora_B" in n)
    assert one.keys() == two.keys()
    for name, value in one.items():
        assert torch.equal(value, two[name]), name
