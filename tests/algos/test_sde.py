"""The SDE steps and their log-probs against independent computations."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from digen.algos.sde import gaussian_log_prob, ode_step, sde_step


def _sigmas(n: int = 10, shift: float = 3.0) -> torch.Tensor:
    sched = FlowMatchEulerDiscreteScheduler(shift=shift)
    sched.set_timesteps(sigmas=torch.linspace(1.0, 1.0 / n, n).tolist())
    return sched.sigmas.float()


def _reference_mean_std(kind: str, v, x, sigmas, i, a):
    """The three steps written out again, in float64, from the formulas alone."""
    s, s1 = float(sigmas[i]), float(sigmas[i + 1])
    x, v = x.double(), v.double()
    dt = s1 - s
    if kind == "sde":
        denom = 1 - (float(sigmas[1]) if s == 1.0 else s)
        std_t = a * math.sqrt(s / denom)
        mean = x * (1 + std_t**2 / (2 * s) * dt) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
        return mean, std_t * math.sqrt(-dt)
    if kind == "cps":
        std = s1 * math.sin(a * math.pi / 2)
        x0, x1 = x - s * v, x + (1 - s) * v
        return x0 * (1 - s1) + x1 * math.sqrt(s1**2 - std**2), std
    x0 = x - s * v
    std = a * math.sqrt(s - s1)
    return x + dt * v + dt * (a**2 / 2) * (x - (1 - s) * x0) / s**2, std


@pytest.mark.parametrize("kind", ["sde", "cps", "dance"])
@pytest.mark.parametrize("i", [0, 3, 8])
def test_log_prob_matches_torch_normal(kind: str, i: int) -> None:
    g = torch.Generator().manual_seed(i)
    sigmas = _sigmas()
    x = torch.randn(3, 4, 5, 6, generator=g)
    v = torch.randn(3, 4, 5, 6, generator=g)
    noise = torch.randn(3, 4, 5, 6, generator=g)
    out = sde_step(kind, v, x, sigmas, i, 0.7, noise=noise)
    mean, std = _reference_mean_std(kind, v, x, sigmas, i, 0.7)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
    assert float(out.std.flatten()[0]) == pytest.approx(std, rel=1e-5)
    torch.testing.assert_close(
        out.prev_sample.double(), mean + std * noise.double(), atol=1e-5, rtol=1e-5
    )
    ref = (
        torch.distributions.Normal(mean, std).log_prob(out.prev_sample.double()).mean(dim=(1, 2, 3))
    )
    torch.testing.assert_close(out.log_prob.double(), ref, rtol=1e-5, atol=1e-5)
    # scoring the drawn sample again gives the same log-prob: ratio exactly 1
    again = sde_step(kind, v, x, sigmas, i, 0.7, prev_sample=out.prev_sample)
    assert torch.equal(again.log_prob, out.log_prob)
    assert torch.exp(again.log_prob - out.log_prob).eq(1.0).all()


def test_sigma_one_edge_uses_sigma_1_in_the_denominator() -> None:
    sigmas = _sigmas(shift=1.0)
    assert float(sigmas[0]) == 1.0
    x, v, noise = torch.ones(2, 3), torch.full((2, 3), 0.5), torch.zeros(2, 3)
    out = sde_step("sde", v, x, sigmas, 0, 0.5, noise=noise)
    s1 = float(sigmas[1])
    std_t = 0.5 * math.sqrt(1.0 / (1.0 - s1))
    assert torch.isfinite(out.mean).all() and torch.isfinite(out.log_prob).all()
    assert float(out.std.flatten()[0]) == pytest.approx(std_t * math.sqrt(1.0 - s1), rel=1e-6)
    mean, _ = _reference_mean_std("sde", v, x, sigmas, 0, 0.5)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["sde", "dance"])
def test_zero_noise_is_diffusers_euler(kind: str) -> None:
    g = torch.Generator().manual_seed(0)
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(6)
    sigmas = sched.sigmas.float()
    x = torch.randn(2, 4, 8, 8, generator=g)
    v = torch.randn(2, 4, 8, 8, generator=g)
    for i, t in enumerate(sched.timesteps):
        sched._step_index = i
        ref = sched.step(v, t, x, return_dict=False)[0]
        torch.testing.assert_close(ode_step(v, x, sigmas, i), ref, rtol=0, atol=1e-6)
        out = sde_step(kind, v, x, sigmas, i, 0.0, noise=torch.ones_like(x))
        assert out.log_prob is None
        torch.testing.assert_close(out.prev_sample, ref, rtol=0, atol=1e-5)


def test_per_sample_step_index_equals_separate_calls() -> None:
    g = torch.Generator().manual_seed(1)
    sigmas = _sigmas()
    x, v, nxt = (torch.randn(3, 2, 4, 4, generator=g) for _ in range(3))
    idx = torch.tensor([0, 4, 7])
    batched = sde_step("sde", v, x, sigmas, idx, 0.8, prev_sample=nxt)
    for row, i in enumerate(idx.tolist()):
        single = sde_step(
            "sde",
            v[row : row + 1],
            x[row : row + 1],
            sigmas,
            i,
            0.8,
            prev_sample=nxt[row : row + 1],
        )
        torch.testing.assert_close(batched.log_prob[row : row + 1], single.log_prob, rtol=0, atol=0)


def test_gradient_flows_to_velocity_only_through_the_mean() -> None:
    sigmas = _sigmas()
    x = torch.randn(2, 3)
    v = torch.randn(2, 3, requires_grad=True)
    nxt = torch.randn(2, 3)
    out = sde_step("dance", v, x, sigmas, 2, 0.3, prev_sample=nxt)
    out.log_prob.sum().backward()
    # d/dv of mean(-(y - m)^2 / (2 s^2)), with dm/dv = dt (1 + eta^2 (1 - sigma) / (2 sigma))
    s, s1 = float(sigmas[2]), float(sigmas[3])
    dt, eta = s1 - s, 0.3
    dm_dv = dt * (1 + (eta**2 / 2) * (1 - s) / s)
    std = float(out.std.flatten()[0])
    expected = (nxt - out.mean.detach()) / std**2 * dm_dv / 3
    torch.testing.assert_close(v.grad, expected, rtol=1e-4, atol=1e-6)


def test_gaussian_log_prob_constant() -> None:
    x = torch.zeros(1, 4)
    assert float(gaussian_log_prob(x, x, torch.tensor(1.0))) == pytest.approx(
        -0.5 * math.log(2 * math.pi)
    )


def test_bad_arguments() -> None:
    sigmas = _sigmas()
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="exactly one"):
        sde_step("sde", x, x, sigmas, 0, 0.7)
    with pytest.raises(ValueError, match="unknown sde_type"):
        sde_step("ode", x, x, sigmas, 0, 0.7, noise=x)
    with pytest.raises(IndexError):
        sde_step("sde", x, x, sigmas, 10, 0.7, noise=x)
    with pytest.raises(ValueError, match="no log-prob"):
        sde_step("cps", x, x, sigmas, 9, 0.7, prev_sample=x)


@pytest.mark.parametrize(
    ("kind", "form"), [("sde", "gaussian"), ("cps", "mse"), ("dance", "gaussian")]
)
def test_the_drift_bound_holds_rounding_and_catches_more(kind: str, form: str) -> None:
    """A velocity rounded differently in bf16 (each element off by up to one unit of
    roundoff, independently) moves the recomputed log-prob by less than
    :func:`logprob_drift_bound`; a systematic error of a few units (the sign that moves the
    log-prob, every element) moves it by more."""
    from digen.algos.rollout import SamplerSpec, logprob_drift_bound
    from digen.algos.transitions import LOG_PROBS

    sigmas = _sigmas(8)
    spec = SamplerSpec(sigmas=sigmas, window=(2,), sde_type=kind, noise_level=0.7, log_prob=form)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 8, 8, generator=g)
    v = torch.randn(4, 3, 8, 8, generator=g)
    noise = torch.randn(4, 3, 8, 8, generator=g)
    made = sde_step(kind, v, x, sigmas, 2, 0.7, noise=noise, log_prob=form)

    def rescored(velocity: torch.Tensor):
        return sde_step(
            kind, velocity, x, sigmas, 2, 0.7, prev_sample=made.prev_sample, log_prob=form
        )

    out = rescored(v)
    assert torch.equal(out.log_prob, made.log_prob)  # the same velocity: no drift at all
    bound = logprob_drift_bound(x, made.prev_sample, 2, spec, out, torch.bfloat16)
    u = torch.finfo(torch.bfloat16).eps / 2
    for trial in range(20):  # independent roundings of up to one unit, elementwise
        delta = (torch.rand(v.shape, generator=g) * 2 - 1) * u
        drift = (rescored(v * (1 + delta)).log_prob - made.log_prob).abs()
        assert bool((drift <= bound).all()), (trial, drift, bound)
    # the same few units with the sign that lowers the log-prob, in every element
    m = made.mean.detach().requires_grad_(True)
    (slope,) = torch.autograd.grad(LOG_PROBS[form](made.prev_sample, m, made.std).sum(), m)
    mu_0 = sde_step(kind, torch.zeros_like(v), x, sigmas, 2, 0.7, prev_sample=made.prev_sample).mean
    against = -torch.sign(slope * (made.mean - mu_0))
    drift = (rescored(v * (1 + 4 * u * against)).log_prob - made.log_prob).abs()
    assert bool((drift > bound).all()), (drift, bound)
