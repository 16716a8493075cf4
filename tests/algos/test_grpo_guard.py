"""GRPO-Guard (``algo.ratio_norm``) against its published form, written out here: the
normalised ratio ``rho = exp((logp - logp_old + b) s)`` with ``b = mean((mu - mu_old)^2) /
(2 s^2)`` and ``s = std_dev_t sqrt(-dt)`` (the step's std), and each step's clipped loss
divided by ``(sqrt(-dt))^2 = |dt|``."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from digen.algos.loss import guard_log_ratio
from digen.algos.sde import gaussian_log_prob
from digen.config import ConfigError
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy


def test_the_normalised_log_ratio_has_no_mean_shift() -> None:
    g = torch.Generator().manual_seed(0)
    mu_old = torch.randn(3, 4, 8, generator=g)
    mu = mu_old + 0.3 * torch.randn(3, 4, 8, generator=g)
    s = torch.tensor([0.05, 0.2, 0.7]).view(3, 1, 1)
    eps = torch.randn(3, 4, 8, generator=g)
    x = mu_old + s * eps
    logp, logp_old = gaussian_log_prob(x, mu, s), gaussian_log_prob(x, mu_old, s)
    got = guard_log_ratio(logp, logp_old, mu, mu_old, s)
    # the same number derived by hand: mean((mu - mu_old) * eps), free of s
    torch.testing.assert_close(got, ((mu - mu_old) * eps).mean(dim=(1, 2)), rtol=1e-4, atol=1e-5)
    # the plain log-ratio carries -mean((mu - mu_old)^2) / (2 s^2): at eps = 0 it is negative
    at_mean = gaussian_log_prob(mu_old, mu, s) - gaussian_log_prob(mu_old, mu_old, s)
    assert (at_mean < -0.01).all()
    zero = guard_log_ratio(
        gaussian_log_prob(mu_old, mu, s), gaussian_log_prob(mu_old, mu_old, s), mu, mu_old, s
    )
    torch.testing.assert_close(zero, torch.zeros(3), rtol=0, atol=1e-5)


def test_the_guarded_loss_and_its_gradient_are_the_published_ones() -> None:
    cfg = tiny_config(
        "sd3",
        "flowgrpo",
        ["rollout.num_inference_steps=4", "algo.ratio_norm=true", "algo.clip_ratio=0.05"],
    )
    policy = Policy(cfg)
    keys = [SampleKey(0, 0, j) for j in range(3)]
    made = policy.generate(keys, ["a red circle"] * 3)
    ro = made.rollout
    assert ro.means is not None and ro.means.shape == ro.latents.shape
    with torch.no_grad():  # off-policy: the trained weights move after sampling
        for name, p in policy.synced_parameters():
            if "lora_B" in name:
                p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    adv = torch.tensor([1.5, -0.7, 0.4])
    item = TrainItem(
        keys=keys, prompts=["a red circle"] * 3, rollout=ro.for_training(), advantages=adv
    )
    spec = policy.sampler_spec(0)
    window = list(spec.window)
    n_terms = 3 * len(window)
    stats = policy.accumulate(item, 1.0 / n_terms)
    got = [p.grad.clone() for p in policy.params]
    policy.optimizer.zero_grad(set_to_none=True)

    from digen.algos.rollout import score_step

    cond = policy.conditioning(["a red circle"])
    total = 0.0
    for k, i in enumerate(window):
        out = score_step(
            policy.adapter,
            ro.latents[:, k],
            ro.next_latents[:, k],
            i,
            cond.__class__.cat([cond] * 3),
            spec,
        )
        s = float(spec.sigmas[i]) - float(spec.sigmas[i + 1])  # -dt
        step_std = out.std.reshape(3, -1)[:, 0]  # std_dev_t sqrt(-dt)
        b = ((out.mean - ro.means[:, k]) ** 2).mean(dim=tuple(range(1, out.mean.ndim)))
        b = b / (2 * step_std**2)
        rho = torch.exp((out.log_prob - ro.log_probs[:, k] + b) * step_std)
        loss_t = torch.maximum(-adv * rho, -adv * rho.clamp(1 - 0.05, 1 + 0.05)) / s
        total = total + loss_t.sum() / n_terms
    total.backward()
    want = [p.grad.clone() for p in policy.params]
    assert stats.loss / stats.terms == pytest.approx(float(total), rel=1e-4)
    biggest = max(float(w.abs().max()) for w in want)
    assert biggest > 1e-4
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-3, atol=1e-5 * biggest)


def test_ratio_norm_is_refused_where_there_is_no_sde_ratio() -> None:
    with pytest.raises(ConfigError, match="algo.ratio_norm"):
        tiny_config("sd3", "flowgrpo", ["algo.ratio_norm=true", "rollout.sde_type=cps"])
    with pytest.raises(ConfigError, match="ratio_norm"):
        tiny_config("sd3", "nft", ["algo.ratio_norm=true"])
