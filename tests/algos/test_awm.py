"""AWM against its published form, written out here from the official training script's
formulas (scxue/advantage_weighted_matching ``scripts/train_sd3_awm.py``), not through
digen's code: the timestep strata, the weighted matching loss, the loss of a chunk and its
gradient, the direction a step moves, the settings refused, and a short run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import accumulate_with_tsp_alike, short_tiny_run, tiny_config

from digen.algos.awm import matching_loss, timestep_strata
from digen.algos.rollout import Rollout
from digen.errors import DigenError
from digen.registry.algos import get_algorithm
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy
from digen.seeding import nft_noise_generator


@pytest.mark.parametrize(
    ("time_type", "want"),
    [
        # boundaries = linspace(1, int(14 * 0.9) = 12, 7).long() = [1, 2, 4, 6, 8, 10, 12]
        ("discrete_wo_init", [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]),
        # linspace(0, 12, 7) = [0, 2, 4, ..., 12]
        ("discrete", [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]),
        # index 0, then linspace(1, 12, 6).long() = [1, 3, 5, 7, 9, 12]
        ("discrete_with_init", [(0, 1), (1, 3), (3, 5), (5, 7), (7, 9), (9, 12)]),
    ],
)
def test_the_strata_are_the_scripts(time_type: str, want: list[tuple[int, int]]) -> None:
    assert timestep_strata(14, 0.9, 6, time_type) == want


def test_the_strata_bounds_are_torchs_fp32_linspace() -> None:
    """The script's bounds are ``torch.linspace(...).long()``: fp32 rounding decides a bound
    that falls on an integer (``linspace(0, 16, 15)[7]`` is 7.9999995, so 7)."""
    for lo, time_type in [(0, "discrete"), (1, "discrete_wo_init")]:
        for top in range(lo + 1, 80):
            for count in range(1, top - lo + 1):
                want = torch.linspace(lo, top, steps=count + 1).long().tolist()
                got = timestep_strata(top, 1.0, count, time_type)
                assert [a for a, _ in got] + [got[-1][1]] == want, (lo, top, count)
    assert timestep_strata(16, 1.0, 14, "discrete")[6:8] == [(6, 7), (7, 9)]


def test_each_sample_draws_one_timestep_per_stratum_seeded() -> None:
    cfg = tiny_config(
        "sd3", "awm", ["rollout.num_inference_steps=14", "algo.params.train_timesteps=6"]
    )
    awm = get_algorithm("awm")
    strata = [(1, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12)]
    assert awm.terms_per_sample(cfg, 3) == 6
    assert awm.train_steps(cfg, 3) == tuple(range(14))  # positions are the sampler's steps
    drawn = [awm.trained_positions(cfg, 3, p, s) for p in range(3) for s in range(4)]
    for positions in drawn:
        assert all(lo <= i < hi for i, (lo, hi) in zip(positions, strata, strict=True))
    assert len({tuple(x) for x in drawn}) > 1  # each sample its own draw
    assert drawn[5] == awm.trained_positions(cfg, 3, 1, 1)  # the same wherever it is asked


def test_the_weightings_are_the_scripts() -> None:
    """``compute_log_prob_awm``: ``log_prob = -m`` then its ``weighting``; the loss is
    ``-log_prob``. Hand numbers, standard library only."""
    ms, ts = [0.25, 1.0, 4e-12], [0.5, 0.9, 0.3]
    want = {
        "uniform": list(ms),
        "t": [t * m for m, t in zip(ms, ts)],
        "t2": [t * t * m for m, t in zip(ms, ts)],
        "huber": [(math.sqrt(m + 1e-10) - 1e-5) * t for m, t in zip(ms, ts)],
        "ghuber": [((m + 1e-10) ** 0.25 - 1e-10**0.25) * t / 0.25 for m, t in zip(ms, ts)],
    }
    m, t = torch.tensor(ms, dtype=torch.float64), torch.tensor(ts, dtype=torch.float64)
    for weighting, values in want.items():
        got = matching_loss(m, t, weighting, 0.25).tolist()
        assert got == pytest.approx(values, rel=1e-12, abs=1e-18), weighting
    # 0.25^(1/4) = sqrt(0.5) and (1e-10)^(1/4) = 10^-2.5: 0.5 (sqrt(0.5) - 10^-2.5) / 0.25
    assert want["ghuber"][0] == pytest.approx(2 * (math.sqrt(0.5) - 10**-2.5), rel=1e-9)


def test_the_scripts_ratio_loss_has_the_gradient_of_the_weighted_loss() -> None:
    """The script's ``-A' exp(logp - sg(logp))`` with ``logp = -l(m)`` (on-policy: its old
    log-prob is the current one detached) has the gradient of digen's ``A' l(m)``."""
    m = torch.tensor([0.3, 0.02, 1.7], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0.8, 0.4, 0.95], dtype=torch.float64)
    a = torch.tensor([0.6, -1.0, 0.2], dtype=torch.float64)
    logp = -matching_loss(m, t, "ghuber", 0.25)
    script = (-a * torch.exp(logp - logp.detach()).clamp(0.0, 2.0)).mean()
    (g_script,) = torch.autograd.grad(script, m)
    ours = (a * matching_loss(m, t, "ghuber", 0.25)).mean()
    (g_ours,) = torch.autograd.grad(ours, m)
    torch.testing.assert_close(g_script, g_ours, rtol=1e-14, atol=0)
    # by hand: d/dm of A t ((m + e)^p - e^p) / p is A t (m + e)^(p - 1), over the 3 terms
    hand = [
        a_ * t_ * (m_ + 1e-10) ** -0.75 / 3
        for a_, t_, m_ in zip([0.6, -1.0, 0.2], [0.8, 0.4, 0.95], [0.3, 0.02, 1.7])
    ]
    assert g_ours.tolist() == pytest.approx(hand, rel=1e-12)


def _policy(overrides: list[str]) -> Policy:
    cfg = tiny_config("sd3", "awm", ["rollout.num_inference_steps=6", *overrides])
    return Policy(cfg, trainable=True)


def _move_lora(policy: Policy, seed: int = 3, scale: float = 0.05) -> None:
    """LoRA B starts at zero: move it, or the trained and reference velocities agree."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.synced_parameters():
            if "lora_B" in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def _item(policy: Policy, advantages: list[float], step: int = 2, prompt: int = 1):
    n = len(advantages)
    keys = [SampleKey(step=step, prompt=prompt, sample=j) for j in range(n)]
    shape = policy.adapter.initial_latents([torch.Generator().manual_seed(0)]).shape[1:]
    x0 = torch.randn((n, *shape), generator=torch.Generator().manual_seed(1))
    empty = x0.new_zeros((n, 0, *shape))
    rollout = Rollout.from_pairs(empty, empty, x0.new_zeros((n, 0)), final=x0)
    item = TrainItem(keys, ["a red square"] * n, rollout, torch.tensor(advantages))
    return item, keys, x0


def _matching_errors(policy: Policy, keys, x0, positions) -> list[torch.Tensor]:
    """``m = mean((v - (eps - x0))^2)`` of each trained term, by hand (with grad)."""
    cond = policy.conditioning(["a red square"])
    out = []
    for b, k in enumerate(keys):
        for i in positions[b]:
            t = policy.sigmas[i]
            eps = torch.randn(
                x0.shape[1:],
                generator=nft_noise_generator(policy.cfg.seed, k.step, k.prompt, k.sample, i),
            )
            xt = ((1 - t) * x0[b] + t * eps)[None]
            v = policy.adapter.predict_velocity(xt, t.reshape(1), cond, None, 1.0).double()
            out.append(((v - (eps - x0[b]).double()) ** 2).mean())
    return out


@pytest.mark.parametrize("kl_weight", ["uniform", "elbo"])
def test_the_loss_and_its_gradient_are_the_published_ones(kl_weight: str) -> None:
    kl_coef = 0.05
    policy = _policy([f"algo.kl_coef={kl_coef}", f"algo.params.kl_weight={kl_weight}"])
    cfg, awm = policy.cfg, get_algorithm("awm")
    _move_lora(policy)
    advantages = [2.0, -1.0, 7.5, -0.5]  # 7.5 is clipped at 5, then all rescaled by 1 / 5
    item, keys, x0 = _item(policy, advantages)
    positions = [awm.trained_positions(cfg, 2, k.prompt, k.sample) for k in keys]
    n_terms = sum(len(p) for p in positions)
    assert all(len(p) == 2 for p in positions) and len({tuple(p) for p in positions}) > 1

    # what digen accumulates, timestep by timestep and with TSP 2: the same gradient
    stats, _, got = accumulate_with_tsp_alike(policy, item, 1.0 / n_terms)

    # the published loss, written out with the models evaluated as the script does
    cond = policy.conditioning(["a red square"])
    total = torch.zeros((), dtype=torch.float64)
    for b, k in enumerate(keys):
        a = min(max(advantages[b], -5.0), 5.0) / 5.0 * 1.0  # advantage_max 1
        for i in positions[b]:
            t = policy.sigmas[i]
            eps = torch.randn(
                x0.shape[1:], generator=nft_noise_generator(cfg.seed, 2, 1, k.sample, i)
            )
            xt = ((1 - t) * x0[b] + t * eps)[None]
            v = policy.adapter.predict_velocity(xt, t.reshape(1), cond, None, 1.0).double()
            with torch.no_grad(), policy._reference():
                v_ref = policy.adapter.predict_velocity(xt, t.reshape(1), cond, None, 1.0).double()
            m = ((v - (eps - x0[b]).double()) ** 2).mean()
            tt = float(t)
            ghuber = ((m + 1e-10) ** 0.25 - 1e-10**0.25) * tt / 0.25
            kl = ((v - v_ref) ** 2).mean()
            if kl_weight == "elbo":
                std = 0.7 * math.sqrt(tt / (1 - min(tt, 0.99)))
                kl = kl / (2 * std**2)
            total = total + (a * ghuber + kl_coef * kl) / n_terms
    total.backward()
    want = [p.grad.clone() for p in policy.params]
    assert stats.terms == n_terms
    assert stats.loss / stats.terms == pytest.approx(float(total), rel=1e-5)
    assert stats.kl > 0
    biggest = max(float(w.abs().max()) for w in want)
    assert biggest > 1e-3  # a gradient that could be wrong
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6 * biggest)


def _descend(policy: Policy, length: float = 0.05) -> None:
    """A plain gradient-descent step of ``length`` in parameter space (Adam's first step
    would move every weight alike, whatever its gradient)."""
    with torch.no_grad():
        norm = torch.sqrt(sum((p.grad**2).sum() for p in policy.params))
        for p in policy.params:
            p.sub_(length * p.grad / norm)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_positive_advantage_lowers_the_matching_error(sign: float) -> None:
    """One sample at one trained timestep, one plain gradient step: its matching error
    falls when its advantage is positive and rises when it is negative (to first order
    ``-lr A' l'(m) |grad m|^2``, ``l' > 0``)."""
    policy = _policy(["algo.kl_coef=0", "algo.params.train_timesteps=1"])
    cfg, awm = policy.cfg, get_algorithm("awm")
    _move_lora(policy)
    item, keys, x0 = _item(policy, [sign])
    positions = [awm.trained_positions(cfg, 2, keys[0].prompt, keys[0].sample)]
    with torch.no_grad():
        before = sum(_matching_errors(policy, keys, x0, positions))
    policy.accumulate(item, 1.0 / len(positions[0]))
    _descend(policy)
    with torch.no_grad():
        after = sum(_matching_errors(policy, keys, x0, positions))
    change = float(after - before)
    assert sign * change < 0, (sign, float(before), float(after))
    assert abs(change) > 1e-4 * float(before)  # a move, not rounding


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["algo.params.train_timesteps=5"], "algo.params.train_timesteps = 5 is not allowed"),
        (["algo.params.weighting=l1"], "algo.params.weighting = 'l1' is not allowed"),
        (["algo.params.time_type=logit_normal"], "algo.params.time_type"),
        (["algo.params.ghuber_power=0"], "algo.params.ghuber_power = 0 is not allowed"),
        (["algo.params.kl_weight=exact"], "algo.params.kl_weight"),
        (["rollout.sde_window_size=2"], "rollout.sde_window_size = 2 is not allowed: AWM samples"),
        (["algo.best_of_n=4"], "algo.best_of_n = 4 is not allowed: AWM trains every sample"),
        (["algo.ratio_norm=true"], "algo.ratio_norm = true is not allowed"),
    ],
)
def test_bad_settings_are_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(DigenError, match=match):
        tiny_config("flux", "awm", overrides)


@pytest.mark.slow
def test_a_short_colocated_run(tmp_path: Path) -> None:
    rows = short_tiny_run(tmp_path / "out", "awm")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["kl"] > 0 for r in rows)
    assert rows[0]["samples"] == 16 and rows[0]["optimizer_steps"] == 2
