"""MixGRPO's published conventions, each a choice with the published value in its preset:
the window schedule (with the official ``GRPOTrainingStates`` written out here), the fixed
FLUX shift, the transformer's ``int(1000 sigma) / 1000`` time, normalised reward weights,
and the ``kl_coeff`` term."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import tiny_config

from digen.algos.rollout import SamplerSpec, model_time, sample_rollout
from digen.algos.train_step import score_groups
from digen.config import ConfigError, load_config
from digen.presets import preset
from digen.registry.algos import get_algorithm
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy


def _official_starts(n: int, group: int, iters: int, stride: int, roll_back: bool, steps: int):
    """The official progressive schedule (prog_overlap): the window each train step trains."""
    cur, it, out = 0, 0, []
    last = n - 2  # its max_timesteps
    for _ in range(steps):
        out.append(tuple(range(cur, min(cur + group, last))))
        it += 1
        if it >= iters:
            it = 0
            cur += stride
        if cur > last:
            cur, it = (0, 0) if roll_back else (last, it)
    return out


@pytest.mark.parametrize(("stride", "roll_back"), [(1, True), (2, True), (3, True), (2, False)])
def test_mixgrpo_windows_are_the_official_ones_until_its_empty_window(stride, roll_back) -> None:
    n, group, iters = 12, 4, 3
    over = [
        "model.path=/real",
        f"rollout.num_inference_steps={n}",
        f"rollout.sde_window_size={group}",
        f"algo.params.shift_every={iters}",
        f"algo.params.stride={stride}",
        f"algo.params.roll_back={str(roll_back).lower()}",
    ]
    cfg = load_config(algo="mixgrpo", overrides=over)
    algo = get_algorithm("mixgrpo")
    official = _official_starts(n, group, iters, stride, roll_back, 200)
    ours = [algo.noisy_steps(cfg, s).trainable for s in range(200)]
    empty = [i for i, w in enumerate(official) if not w]
    first = empty[0] if empty else len(official)
    assert ours[:first] == official[:first]  # the same windows up to the official empty one
    assert all(ours)  # digen never makes an empty window
    if roll_back:
        # back to 0 after the last start (never wrapping to stride - 1, 2 stride - 1, ...)
        assert {w[0] for w in ours} == set(range(0, n - 2, stride))
        if empty:  # where the official one is empty, digen has already rolled back
            assert ours[first] == (0, 1, 2, 3)
    else:
        assert ours[-1] == (n - 3,)  # stays at the last window with a step to train


def test_a_fixed_shift_is_mixgrpos_flux_schedule() -> None:
    cfg = load_config(base=preset("flux", "mixgrpo", real_weights=True))
    assert cfg.rollout.shift == 3.0 and cfg.rollout.time_input == "int1000"
    policy_sigmas = _adapter_sigmas("flux", 25, 3.0)
    t = torch.linspace(1, 0, 26)
    want = 3.0 * t / (1 + 2.0 * t)  # sd3_time_shift(3, linspace(1, 0, N + 1))
    torch.testing.assert_close(policy_sigmas, want, rtol=0, atol=1e-6)
    dynamic = _adapter_sigmas("flux", 25, None)
    assert float((dynamic - want).abs().max()) > 0.01  # FLUX's own shift is another schedule


def _adapter_sigmas(model: str, n: int, shift: float | None) -> torch.Tensor:
    cfg = tiny_config(model, "mixgrpo")
    return Policy(cfg, trainable=False).adapter.sigmas(n, shift)


class _Recorder:
    """A stand-in adapter: records the time it is told, velocity -x."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def initial_latents(self, generators):
        return torch.stack([torch.randn(2, 3, generator=g) for g in generators])

    def predict_velocity(self, x, t, cond, neg, guidance):
        self.times.append(float(torch.as_tensor(t).reshape(-1)[0]))
        return -x


def test_the_transformer_is_told_int_1000_sigma_and_the_step_math_uses_sigma() -> None:
    sigmas = torch.tensor([1.0, 0.70710677, 0.33337, 0.0])
    made = {}
    for mode in ("sigma", "int1000"):
        rec = _Recorder()
        spec = SamplerSpec(sigmas=sigmas, window=(), stochastic=(), time_input=mode)
        made[mode] = sample_rollout(rec, None, [torch.Generator().manual_seed(0)], spec).final
        made[mode + "_times"] = rec.times
    assert made["sigma_times"] == pytest.approx([1.0, 0.70710677, 0.33337])
    assert made["int1000_times"] == pytest.approx([1.0, 0.707, 0.333], abs=1e-7)
    # velocity -x does not read the time: the same Euler steps on sigma either way
    assert torch.equal(made["sigma"], made["int1000"])
    assert float(model_time(torch.tensor(0.9999), "int1000")) == pytest.approx(0.999)


def test_normalised_reward_weights_mix_each_rewards_advantages_as_a_weighted_mean() -> None:
    algo = load_config(base=preset("sd3", "mixgrpo")).algo
    assert algo.reward_weighting == "advantage" and algo.normalize_reward_weights
    g = torch.Generator().manual_seed(0)
    a, b = torch.rand(3, 6, generator=g), torch.rand(3, 6, generator=g)
    total = 2.0 * a + 6.0 * b
    got, _ = score_groups(total, algo, [(2.0, a), (6.0, b)])
    want, _ = score_groups(total, algo, [(0.25, a), (0.75, b)])
    algo.normalize_reward_weights = False
    raw, _ = score_groups(total, algo, [(0.25, a), (0.75, b)])
    assert torch.equal(got, want) and torch.equal(raw, want)
    summed, _ = score_groups(total, algo, [(2.0, a), (6.0, b)])
    assert float((summed - got).abs().max()) > 0.5  # without it the weights scale them


def test_the_kl_coeff_term_is_half_the_mean_squared_log_ratio() -> None:
    losses = {}
    for coef in (0.0, 3.0):
        cfg = tiny_config(
            "flux", "mixgrpo", ["rollout.num_inference_steps=4", f"algo.old_kl_coef={coef}"]
        )
        policy = Policy(cfg)
        keys = [SampleKey(0, 0, j) for j in range(2)]
        made = policy.generate(keys, ["a red circle"] * 2)
        with torch.no_grad():  # off-policy, so the log-ratio is not 0
            for name, p in policy.synced_parameters():
                if "lora_B" in name:
                    p.add_(0.5 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        item = TrainItem(
            keys, ["a red circle"] * 2, made.rollout.for_training(), torch.tensor([1.0, -1.0])
        )
        stats = policy.accumulate(item, 1.0)
        losses[coef] = (stats.loss / stats.terms, stats.approx_kl / stats.terms)
    (plain, akl), (with_kl, akl2) = losses[0.0], losses[3.0]
    assert akl == pytest.approx(akl2) and akl > 1e-6  # approx_kl is 0.5 mean((logp - old)^2)
    assert with_kl - plain == pytest.approx(3.0 * akl, rel=1e-4)


def _official_flash(f, z, noises, sigmas, window, ratio, shift, eta=0.7):
    """MixGRPO-Flash's sampling loop as published (``dpm_apply_strategy=post``, DPM-Solver++
    midpoint, order 2, its Flow-GRPO sampling path), written out in fp32: Euler before the
    window, the ``sde`` step in it, every step's ``x0 = x - sigma v`` kept, and after the
    window a compressed schedule of ``int((N - L) * ratio)`` points solved by DPM-Solver++."""
    n, last = sigmas.numel() - 1, max(window)
    points = int(max((n - last) * ratio, 1))
    post_t = torch.linspace(1, 0, n + 1)[last + 1].item()
    grid = torch.linspace(post_t, 0, points)
    sched = torch.cat([sigmas[: last + 1], shift * grid / (1 + (shift - 1) * grid)])
    x0s, noises = [], list(noises)
    for i in range(sched.numel() - 1):
        s, t = sched[i], sched[i + 1]
        v = f(z, torch.trunc(s * 1000) / 1000)
        x0 = z - s * v
        x0s.append(x0)
        if i <= last:
            dt = t - s
            if i in window:
                std = torch.sqrt(s / (1 - torch.where(s == 1, sched[1], s))) * eta
                mean = z * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
                z = mean + std * torch.sqrt(-dt) * noises.pop(0)
            else:
                z = z + dt * v
            continue
        lam = lambda u: torch.log(1 - u) - torch.log(u)  # noqa: E731
        if i == sched.numel() - 2:  # lower_order_final: first order, x' = x0 at sigma 0
            z = (t / s) * z - ((1 - t) * (torch.exp(-(lam(t) - lam(s))) - 1.0)) * x0
            continue
        h, h0 = lam(t) - lam(s), lam(s) - lam(sched[i - 1])
        d1 = (1.0 / (h0 / h)) * (x0s[-1] - x0s[-2])
        a = (1 - t) * (torch.exp(-h) - 1.0)
        z = (t / s) * z - a * x0s[-1] - 0.5 * a * d1
    return z, sched


class _Toy:
    """A stand-in adapter with a velocity that depends on x and the time it is told."""

    def initial_latents(self, generators):
        return torch.stack([torch.randn(2, 3, generator=g) for g in generators])

    def predict_velocity(self, x, t, cond, neg, guidance):
        return 0.8 * x - 0.3 + 0.5 * torch.as_tensor(t) * torch.tanh(x)


@pytest.mark.parametrize("step", [0, 40, 160])
def test_flash_samples_as_its_published_post_strategy(step) -> None:
    over = ["rollout.shift=3.0", "rollout.num_inference_steps=25", "rollout.sde_window_size=4"]
    cfg = tiny_config("flux", "mixgrpo-flash", over)
    assert cfg.rollout.solver == "dpm2-post" and cfg.rollout.post_compress == 0.4
    cfg.algo.params["shift_every"] = 20  # the published Flash recipe's
    policy = Policy(cfg, trainable=False)
    spec = policy.sampler_spec(step)
    window = get_algorithm("mixgrpo-flash").noisy_steps(cfg, step).trainable
    assert spec.window == window and window[0] == step // 20
    g = torch.Generator().manual_seed(step)
    z = torch.randn(2, 3, generator=g)
    noises = [torch.randn(2, 3, generator=g) for _ in window]
    want, sched = _official_flash(
        lambda x, t: _Toy().predict_velocity(x, t, None, None, 1.0),
        z,
        noises,
        policy.sigmas,
        window,
        0.4,
        3.0,
    )
    torch.testing.assert_close(spec.sigmas, sched, rtol=0, atol=1e-6)
    # 25 steps become the window's end + int((25 - L) * 0.4) - 1: fewer transformer passes
    last = window[-1]
    assert spec.num_steps == last + int((25 - last) * 0.4) < 25
    got = sample_rollout(_Toy(), None, [torch.Generator().manual_seed(step)], spec)
    torch.testing.assert_close(got.final[0], want, rtol=0, atol=2e-5)
    # the window's transitions are MixGRPO's on the schedule's own sigmas
    assert spec.sigmas[: last + 2].tolist() == policy.sigmas[: last + 2].tolist()
    euler = dataclasses.replace(spec, solver="euler")
    plain = sample_rollout(_Toy(), None, [torch.Generator().manual_seed(step)], euler)
    assert torch.equal(plain.latents, got.latents)
    assert float((plain.final - got.final).abs().max()) > 1e-3  # the tail is not Euler's


def test_flash_always_finishes_the_sample_and_post_compress_needs_dpm2_post() -> None:
    # window end 21 of 25: int(4 * 0.4) = 1 point, no step in the published code; digen 1
    cfg = tiny_config(
        "flux",
        "mixgrpo-flash",
        ["rollout.shift=3.0", "rollout.num_inference_steps=25", "rollout.sde_window_size=4"],
    )
    policy = Policy(cfg, trainable=False)
    sig = policy._post_sigmas((18, 19, 20, 21))
    assert sig.numel() == 24 and float(sig[-1]) == 0.0 and float(sig[-2]) > 0.05
    with pytest.raises(ConfigError, match="rollout.post_compress = 0.4 is not allowed"):
        load_config(algo="mixgrpo", overrides=["rollout.post_compress=0.4"])
    with pytest.raises(ConfigError, match="MixGRPO-Flash samples"):
        load_config(
            algo="mixgrpo-flash", overrides=["rollout.solver=euler", "rollout.post_compress=1.0"]
        )
