"""Advantages, best-of-N, the clipped loss and its gradient, the KL, and timestep choices."""

from __future__ import annotations

import pytest
import torch

from digen.algos.advantages import best_of_n, group_advantages
from digen.algos.loss import clipped_policy_loss, kl_to_reference
from digen.algos.timesteps import sde_window, train_timesteps


def test_group_advantages_by_hand() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0, 6.0], [5.0, 5.0, 5.0, 5.0]])
    adv = group_advantages(rewards, eps=0.0 + 1e-12)
    # group 0: mean 3, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5)
    std = 3.5**0.5
    torch.testing.assert_close(adv[0], torch.tensor([-2 / std, -1 / std, 0.0, 3 / std]))
    # a group whose samples all tie carries no signal
    torch.testing.assert_close(adv[1], torch.zeros(4))


def test_dr_grpo_and_clipping() -> None:
    rewards = torch.tensor([[0.0, 0.0, 0.0, 10.0]])
    torch.testing.assert_close(
        group_advantages(rewards, norm="none"), torch.tensor([[-2.5, -2.5, -2.5, 7.5]])
    )
    clipped = group_advantages(rewards, norm="none", clip_max=3.0)
    torch.testing.assert_close(clipped, torch.tensor([[-2.5, -2.5, -2.5, 3.0]]))
    with pytest.raises(ValueError, match="n >= 2"):
        group_advantages(torch.ones(3, 1))


def test_best_of_n_picks_top_and_bottom() -> None:
    adv = torch.tensor([[0.1, 0.9, -0.5, 0.3, -0.8, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    picks = best_of_n(adv, 4)
    assert picks[0].tolist() == [1, 3, 2, 4]
    # ties: distinct indices, never the same sample twice
    assert picks[1].tolist() == [0, 1, 4, 5]
    with pytest.raises(ValueError, match="even"):
        best_of_n(adv, 3)


def test_clipped_loss_values_and_gradient() -> None:
    # ratios exp(diff): 1.5 (A>0, clipped), 0.5 (A>0, not clipped), 1.5 (A<0, not clipped),
    # 0.5 (A<0, clipped)
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.5, 0.5])).requires_grad_(True)
    adv = torch.tensor([2.0, 2.0, -1.0, -1.0])
    loss, stats = clipped_policy_loss(logp, old, adv, clip_ratio=0.2)
    expected = (-2.0 * 1.2 + -2.0 * 0.5 + 1.0 * 1.5 + 1.0 * 0.8) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    loss.backward()
    # d/dlogp of -A * ratio is -A * ratio where unclipped, 0 where the clipped branch wins
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -2.0 * 0.5, 1.0 * 1.5, 0.0]) / 4)
    assert stats.clip_fraction == 1.0
    assert stats.approx_kl == pytest.approx(
        0.5 * (2 * 0.4054651**2 + 2 * 0.6931472**2) / 4, rel=1e-5
    )


def test_loss_is_minus_advantage_when_on_policy() -> None:
    logp = torch.randn(3, 2, requires_grad=True)
    adv = torch.tensor([1.0, -2.0, 0.5])
    loss, stats = clipped_policy_loss(logp, logp.detach(), adv, clip_ratio=1e-4, adv_clip_max=1.0)
    # advantages clip to [1, -1, 0.5]; every ratio is 1
    assert float(loss) == pytest.approx(-(1.0 - 1.0 + 0.5) / 3, rel=1e-6)
    assert stats.clip_fraction == 0.0 and stats.ratio_mean == 1.0
    loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1.0] * 2, [-1.0] * 2, [0.5] * 2]) / 6)


def test_kl_to_reference() -> None:
    mean = torch.zeros(2, 3, 4)
    ref = torch.ones(2, 3, 4)
    ref[1] = 0.0
    std = torch.tensor([0.5, 2.0]).view(2, 1, 1)
    torch.testing.assert_close(kl_to_reference(mean, ref, std), torch.tensor([1 / (2 * 0.25), 0.0]))


def test_sde_window_is_seeded_and_in_range() -> None:
    kw = dict(num_inference_steps=10, window_size=3, window_range=(0, 6))
    wins = [sde_window(seed=0, step=s, **kw) for s in range(40)]
    assert wins[5] == sde_window(seed=0, step=5, **kw)
    starts = {w[0] for w in wins}
    assert starts == {0, 1, 2, 3}  # every legal start [0, 6 - 3] is drawn over 40 steps
    assert all(w == list(range(w[0], w[0] + 3)) for w in wins)
    assert sde_window(seed=0, step=0, num_inference_steps=4, window_size=0) == [0, 1, 2, 3]
    # cps has no noise at the last step: the full window stops before it
    assert sde_window(seed=0, step=0, num_inference_steps=4, window_size=0, sde_type="cps") == [
        0,
        1,
        2,
    ]


def test_train_timesteps_fraction() -> None:
    window = list(range(2, 10))
    kw = dict(seed=3, step=1, prompt_index=0)
    a = train_timesteps(window, 0.5, sample_index=0, **kw)
    assert len(a) == 4 and a == sorted(set(a)) and all(0 <= p < 8 for p in a)
    assert a == train_timesteps(window, 0.5, sample_index=0, **kw)
    picks = {tuple(train_timesteps(window, 0.5, sample_index=i, **kw)) for i in range(10)}
    assert len(picks) > 1  # samples draw their own subsets
    assert train_timesteps(window, 1.0, sample_index=0, **kw) == list(range(8))
    assert len(train_timesteps(window, 0.01, sample_index=0, **kw)) == 1


def test_advantage_level_weighting_of_several_rewards() -> None:
    """``algo.reward_weighting = advantage``: each reward's own group advantages, weighted
    and summed, clipped after the sum; ``sum`` (the default) ignores the components; a group
    with a non-finite score is dropped in either form."""
    from digen import load_config
    from digen.algos.train_step import score_groups

    a = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 1.0, 1.0]])  # [G=2, n=4]
    b = torch.tensor([[100.0, 0.0, 50.0, 25.0], [5.0, 1.0, 3.0, 3.0]])
    total = 2.0 * a + 0.01 * b
    parts = [(2.0, a), (0.01, b)]

    def by_hand(r: torch.Tensor) -> torch.Tensor:  # population std, eps 1e-4
        centred = r - r.mean(dim=1, keepdim=True)
        return centred / (centred.pow(2).mean(dim=1, keepdim=True).sqrt() + 1e-4)

    adv_cfg = load_config(overrides=["algo.reward_weighting=advantage"]).algo
    got, keep = score_groups(total, adv_cfg, parts)
    want = 2.0 * by_hand(a) + 0.01 * by_hand(b)
    torch.testing.assert_close(got, want.clamp(-5, 5))
    assert keep.all()
    summed, _ = score_groups(total, load_config().algo, parts)
    torch.testing.assert_close(summed, by_hand(total))
    assert (summed - got).abs().max() > 0.1  # the two forms differ
    # a weight large enough to pass the clip bound is clipped after the sum
    clipped, _ = score_groups(total, adv_cfg, [(10.0, a), (0.01, b)])
    assert float(clipped.abs().max()) == pytest.approx(5.0)
    # a NaN in one reward drops its group, and only it
    nan_b = b.clone()
    nan_b[1, 2] = float("nan")
    dropped, kept = score_groups(2.0 * a + 0.01 * nan_b, adv_cfg, [(2.0, a), (0.01, nan_b)])
    assert dropped[1].tolist() == [0.0] * 4 and not kept[1].any()
    torch.testing.assert_close(dropped[0], got[0])
