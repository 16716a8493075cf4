"""DGPO against its published form, written out here from the paper's group objective and the
official training script's formulas (Luo-Yihong/DGPO ``scripts/train_sd3_dgpo.py``), not
through digen's code: the group weight, its gradient against ``-log sigma`` of the group
preference, the PPO-style clip, the loss of a chunk and its gradient, the old copy's
schedule, the shared timesteps, the direction a step moves, the settings refused, and a
short run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from helpers import accumulate_with_tsp_alike, old_policy_model, short_tiny_run, tiny_config

from digen.algos.dgpo import clipped_terms, group_weights
from digen.algos.rollout import Rollout
from digen.errors import DigenError
from digen.registry.algos import get_algorithm
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy
from digen.seeding import group_noise_generator


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_the_group_weight_is_sigmoid_of_the_groups_preference_sum() -> None:
    """``S = beta / n sum_i A_i (d_i - d_ref_i)`` over each group, ``n`` the group size
    (``compute_group_dgpo_loss_allreduce``); hand numbers."""
    adv = [1.0, -0.5, -0.5, 2.0, -2.0, 0.0]
    d = [0.30, 0.50, 0.40, 0.20, 0.90, 0.70]
    d_ref = [0.35, 0.45, 0.40, 0.25, 0.80, 0.10]
    groups = [0, 0, 0, 1, 1, 1]
    beta, n = 10.0, 3
    s0 = beta / n * (1.0 * (0.30 - 0.35) - 0.5 * (0.50 - 0.45) - 0.5 * (0.40 - 0.40))
    s1 = beta / n * (2.0 * (0.20 - 0.25) - 2.0 * (0.90 - 0.80) + 0.0 * (0.70 - 0.10))
    assert s0 == pytest.approx(-0.25) and s1 == pytest.approx(-1.0)
    want = [_sigmoid(s0)] * 3 + [_sigmoid(s1)] * 3
    t = lambda xs: torch.tensor(xs, dtype=torch.float64)  # noqa: E731
    got = group_weights(t(adv), t(d), t(d_ref), torch.tensor(groups), 2, n, beta)
    assert got.tolist() == pytest.approx(want, rel=1e-12)


def test_the_scripts_loss_has_the_gradient_of_the_group_preference() -> None:
    """The paper's objective per group and timestep, ``-log sigma(R(G+) - R(G-))`` with
    ``R(G+) - R(G-) = -S``, has the gradient ``sigma(S) beta / n sum_i A_i grad d_i``; the
    script's ``mean(sg(sigma(S)) A d)`` over the ``R`` terms has ``n / (beta R)`` times the
    gradient of the sum over the groups (``1 / beta`` times that of their mean)."""
    g = torch.Generator().manual_seed(0)
    n, beta = 4, 25.0
    adv = torch.randn(3 * n, generator=g, dtype=torch.float64)
    d = (torch.rand(3 * n, generator=g, dtype=torch.float64) + 0.1).requires_grad_(True)
    d_ref = torch.rand(3 * n, generator=g, dtype=torch.float64) + 0.1
    groups = torch.arange(3).repeat_interleave(n)  # [0]*n + [1]*n + [2]*n
    script = (group_weights(adv, d, d_ref, groups, 3, n, beta) * adv * d).mean()
    (g_script,) = torch.autograd.grad(script, d)
    paper = 0.0
    for k in range(3):
        rows = slice(k * n, (k + 1) * n)
        s = beta / n * (adv[rows] * (d[rows] - d_ref[rows])).sum()
        paper = paper - torch.log(torch.sigmoid(-s))  # -log sigma(R+ - R-), R+ - R- = -S
    (g_paper,) = torch.autograd.grad(paper, d)
    torch.testing.assert_close(g_script, n / (beta * 3 * n) * g_paper, rtol=1e-12, atol=0)


def test_the_clip_is_on_the_advantages_side() -> None:
    """``ratio = exp(d_old - d)``: clipped where ``A > 0`` and ``ratio > 1 + c``, or ``A <= 0``
    and ``ratio < 1 - c``."""
    c = 0.1
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0, 0.0])
    d_old = torch.zeros(6)
    # ratios e^0.2 = 1.22, e^-0.05 = 0.95, e^-0.2 = 0.82, e^0.05 = 1.05, e^-0.2, e^0.2
    d = torch.tensor([-0.2, 0.05, 0.2, -0.05, 0.2, -0.2])
    got = clipped_terms(adv, d, d_old, c).tolist()
    assert got == [True, False, True, False, True, False]


def _policy(overrides: list[str]) -> Policy:
    base = ["rollout.n=4", "train.micro_batch_size=4", "rollout.num_inference_steps=6"]
    return Policy(tiny_config("sd3", "dgpo", [*base, *overrides]), trainable=True)


def _move_lora(policy: Policy, seed: int = 3, scale: float = 0.05) -> None:
    """LoRA B starts at zero: move it, or the trained and reference velocities agree."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.synced_parameters():
            if "lora_B" in name:
                p.add_(scale * torch.randn(p.shape, generator=g))


def _perturb_old(policy: Policy, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for (_, p), o in zip(policy.synced_parameters(), policy.old, strict=True):
            o.copy_(p + scale * torch.randn(p.shape, generator=g))


def _group(policy: Policy, advantages: list[float], step: int = 2, prompt: int = 1):
    n = len(advantages)
    keys = [SampleKey(step=step, prompt=prompt, sample=j) for j in range(n)]
    shape = policy.adapter.initial_latents([torch.Generator().manual_seed(0)]).shape[1:]
    x0 = torch.randn((n, *shape), generator=torch.Generator().manual_seed(1))
    empty = x0.new_zeros((n, 0, *shape))
    rollout = Rollout.from_pairs(empty, empty, x0.new_zeros((n, 0)), final=x0)
    item = TrainItem(keys, ["a red square"] * n, rollout, torch.tensor(advantages))
    return item, keys, x0


@pytest.mark.parametrize("clip_range", ["0.0", "1.0e-6"])
def test_the_loss_and_its_gradient_are_the_published_ones(clip_range: str) -> None:
    clip = float(clip_range)
    beta, kl_coef = 20.0, 0.05
    over = [f"algo.params.beta_dpo={beta}", f"algo.kl_coef={kl_coef}"]
    policy = _policy([*over, f"algo.params.clip_range={clip_range}"])
    cfg, dgpo = policy.cfg, get_algorithm("dgpo")
    _move_lora(policy)
    _perturb_old(policy)
    advantages = [1.5, -0.5, 6.0, -1.0]  # 6 is clipped at 5
    item, keys, x0 = _group(policy, advantages)
    positions = dgpo.trained_positions(cfg, 2, 1, 0)
    assert all(dgpo.trained_positions(cfg, 2, 1, j) == positions for j in range(4))
    assert len(positions) == 2 and max(positions) <= 3  # 2 of steps 0 .. trunc_steps 3
    n_terms = 4 * len(positions)

    # what digen accumulates, timestep by timestep and with TSP 2: the same gradient
    stats, _, got = accumulate_with_tsp_alike(policy, item, 1.0 / n_terms)

    # the published loss written out, the old copy evaluated as a model of its own
    old_model = old_policy_model(policy)
    live = policy.adapter.transformer
    cond = policy.conditioning(["a red square"] * 4)
    a = [min(max(x, -5.0), 5.0) for x in advantages]
    total, clipped = 0.0, 0
    for i in positions:
        t = policy.sigmas[i]
        eps = torch.randn(x0.shape[1:], generator=group_noise_generator(cfg.seed, 2, 1, i))
        target = eps - x0  # [4, ...]: the group shares eps
        xt = (1 - t) * x0 + t * eps
        sig = t.reshape(1).expand(4)
        v = policy.adapter.predict_velocity(xt, sig, cond, None, 1.0).float()
        with torch.no_grad():
            policy.adapter.pipe.transformer = old_model
            v_old = policy.adapter.predict_velocity(xt, sig, cond, None, 1.0).float()
            policy.adapter.pipe.transformer = live
            with policy._reference():
                v_ref = policy.adapter.predict_velocity(xt, sig, cond, None, 1.0)
        d = ((v - target) ** 2).mean(dim=(1, 2, 3))  # [4]
        d_ref = ((v_ref.float() - target) ** 2).mean(dim=(1, 2, 3))
        d_old = ((v_old - target) ** 2).mean(dim=(1, 2, 3))
        s = sum(beta / 4 * a[j] * (float(d[j]) - float(d_ref[j])) for j in range(4))
        w = _sigmoid(s)
        for j in range(4):
            ratio = math.exp(float(d_old[j]) - float(d[j]))
            cut = clip > 0 and (ratio > 1 + clip if a[j] > 0 else ratio < 1 - clip)
            clipped += cut
            dj = d[j].detach() if cut else d[j]
            kl = ((v[j] - v_ref[j].float()) ** 2).mean()
            total = total + (w * a[j] * dj + kl_coef * kl) / n_terms
    total.backward()
    want = [p.grad.clone() for p in policy.params]
    assert stats.terms == n_terms
    assert stats.loss / stats.terms == pytest.approx(float(total), rel=1e-5)
    assert stats.clip_fraction / stats.terms == pytest.approx(clipped / n_terms)
    if clip:
        assert 0 < clipped < n_terms  # both kinds of term are checked
    biggest = max(float(x.abs().max()) for x in want)
    assert biggest > 1e-3
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-6 * biggest)


def _errors(policy: Policy, keys, x0, i: int) -> torch.Tensor:
    """``d`` of each sample of the group at step ``i``, by hand."""
    t = policy.sigmas[i]
    eps = torch.randn(x0.shape[1:], generator=group_noise_generator(policy.cfg.seed, 2, 1, i))
    xt = (1 - t) * x0 + t * eps
    cond = policy.conditioning(["a red square"] * len(keys))
    v = policy.adapter.predict_velocity(xt, t.reshape(1).expand(len(keys)), cond, None, 1.0)
    return ((v.double() - (eps - x0).double()) ** 2).mean(dim=(1, 2, 3))


def _descend(policy: Policy, length: float = 0.05) -> None:
    """A plain gradient-descent step of ``length`` in parameter space."""
    with torch.no_grad():
        norm = torch.sqrt(sum((p.grad**2).sum() for p in policy.params))
        for p in policy.params:
            p.sub_(length * p.grad / norm)


@pytest.mark.parametrize("advantages", [[1.0, -1.0], [1.0, 0.0]])
def test_a_step_favours_the_positive_sample(advantages: list[float]) -> None:
    """One timestep, one plain gradient step: the positive sample's matching error falls
    against the negative one's (to first order ``-lr w A |grad d+ - grad d-|^2``), and on its
    own where the other has no advantage (``-lr w A |grad d+|^2``)."""
    over = ["rollout.n=2", "train.micro_batch_size=2", "algo.kl_coef=0"]
    over += ["algo.params.clip_range=0", "algo.params.num_train_timesteps=1"]
    policy = _policy(over)
    _move_lora(policy)
    item, keys, x0 = _group(policy, advantages)
    (i,) = get_algorithm("dgpo").trained_positions(policy.cfg, 2, 1, 0)
    with torch.no_grad():
        before = _errors(policy, keys, x0, i)
    policy.accumulate(item, 0.5)
    _descend(policy)
    with torch.no_grad():
        after = _errors(policy, keys, x0, i)
    margin = float((after[0] - after[1]) - (before[0] - before[1]))
    assert margin < -1e-4 * float(before.sum()), (before.tolist(), after.tolist())
    if advantages[1] == 0.0:
        assert float(after[0] - before[0]) < -1e-4 * float(before[0])


def test_the_rounds_timesteps_are_shared_and_drawn_from_the_noisiest() -> None:
    cfg = tiny_config(
        "flux",
        "dgpo",
        [
            "rollout.num_inference_steps=10",
            "algo.params.trunc_steps=4",
            "algo.params.num_train_timesteps=3",
        ],
    )
    dgpo = get_algorithm("dgpo")
    assert dgpo.train_steps(cfg, 0) == (0, 1, 2, 3, 4) and dgpo.terms_per_sample(cfg, 0) == 3
    seen: set[int] = set()
    rounds = set()
    for step in range(12):
        first = dgpo.trained_positions(cfg, step, 0, 0)
        assert len(set(first)) == 3 and first == sorted(first) and max(first) <= 4
        for prompt, sample in [(0, 5), (1, 0), (3, 7)]:  # every sample of the round alike
            assert dgpo.trained_positions(cfg, step, prompt, sample) == first
        seen |= set(first)
        rounds.add(tuple(first))
    assert seen == {0, 1, 2, 3, 4} and len(rounds) > 1


def test_the_old_copy_follows_the_scripts_schedule() -> None:
    """``ema_ref.step(decay=min(0.3, 0.001 global_step))`` after the optimizer step that
    ``global_step`` (0, 1, ...) counts: ``old <- d old + (1 - d) theta``."""
    cfg = tiny_config("flux", "dgpo", ["train.mini_batch_size=null"])  # one step a round
    dgpo = get_algorithm("dgpo")
    theta = [torch.tensor([1.0, -2.0])]
    for version, decay in [(1, 0.0), (2, 0.001), (5, 0.004), (301, 0.3), (400, 0.3)]:
        old = [torch.tensor([3.0, 4.0])]
        dgpo.update_old(cfg, old, theta, version)
        want = [decay * 3.0 + (1 - decay) * 1.0, decay * 4.0 + (1 - decay) * -2.0]
        assert old[0].tolist() == pytest.approx(want, abs=1e-6), version


def test_a_pass_with_part_of_a_group_fails() -> None:
    policy = _policy([])
    item, keys, x0 = _group(policy, [1.0, -1.0, 0.5, -0.5])
    half = TrainItem(
        keys[:2], item.prompts[:2], item.rollout.select(slice(0, 2)), item.advantages[:2]
    )
    with pytest.raises(ValueError, match="holds 2 of the 4 samples of prompt 1"):
        policy.accumulate(half, 1.0)


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["train.micro_batch_size=4"], "train.micro_batch_size = 4 is not allowed: DGPO"),
        (["train.num_devices=2"], "train.num_devices = 2 is not allowed: colocated devices"),
        (
            ["runtime.mode=disaggregated", "runtime.generators=2"],
            "runtime.schedule.microbatch_axis = generation is not allowed",
        ),
        (
            ["runtime.mode=disaggregated", "runtime.schedule.samples_per_microbatch=4"],
            "runtime.schedule.samples_per_microbatch = 4 is not allowed",
        ),
        (
            [
                "runtime.mode=disaggregated",
                "runtime.trainers=2",
                "runtime.placement.trainer_parallel=fsdp",
            ],
            "runtime.placement.trainer_parallel = fsdp is not allowed",
        ),
        (["algo.params.trunc_steps=6"], "algo.params.trunc_steps = 6 is not allowed"),
        (["algo.params.num_train_timesteps=5"], "num_train_timesteps = 5 is not allowed"),
        (["algo.params.beta_dpo=0"], "algo.params.beta_dpo = 0 is not allowed"),
        (["algo.params.clip_range=-0.1"], "algo.params.clip_range = -0.1 is not allowed"),
        (["algo.params.decay_max=1"], "algo.params.decay_max = 1 is not allowed"),
        (["rollout.sde_window_size=2"], "rollout.sde_window_size = 2 is not allowed: DGPO"),
        (["algo.best_of_n=4"], "algo.best_of_n = 4 is not allowed: DGPO"),
        (["algo.ratio_norm=true"], "algo.ratio_norm = true is not allowed"),
    ],
)
def test_bad_settings_are_refused(overrides: list[str], match: str) -> None:
    with pytest.raises(DigenError, match=match):
        tiny_config("flux", "dgpo", overrides)


def test_whole_group_layouts_are_accepted() -> None:
    for over in (
        ["train.mini_batch_size=null", "train.micro_batch_size=16"],
        [
            "runtime.mode=disaggregated",
            "runtime.generators=2",
            "runtime.schedule.microbatch_axis=prompt",
        ],
        ["runtime.mode=disaggregated", "runtime.trainers=2"],
    ):
        tiny_config("flux", "dgpo", over)


@pytest.mark.slow
def test_a_short_colocated_run(tmp_path: Path) -> None:
    rows = short_tiny_run(tmp_path / "out", "dgpo")
    assert [r["step"] for r in rows] == [0, 1]
    assert all(math.isfinite(r["loss"]) and r["kl"] > 0 for r in rows)
    assert rows[0]["samples"] == 16 and rows[0]["optimizer_steps"] == 2
