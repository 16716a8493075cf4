"""Non-finite rewards, losses and gradients: fail in one sentence, or (``train.on_nonfinite =
drop``) leave them out of the update and count them -- never train on them silently."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from helpers import run_config, tiny_config

from digen import load_config
from digen.algos.train_step import score_groups
from digen.errors import NonFiniteError, RewardError
from digen.presets import preset
from digen.prompts import PromptSet
from digen.rewards.scoring import RewardFn, _to_scores

_HOOK = """
import math

def marked(prompt):
    return len(prompt) % 3 == 0

def nan_for_marked(samples, prompts, metadata):
    return [math.nan if marked(p) else float(s.float().mean()) for s, p in zip(samples, prompts)]

def constant_for_marked(samples, prompts, metadata):
    return [1.0 if marked(p) else float(s.float().mean()) for s, p in zip(samples, prompts)]
"""


def test_a_group_with_a_nan_is_dropped_and_the_others_keep_their_advantages() -> None:
    algo = load_config(base=preset("sd3", "flowgrpo")).algo
    rewards = torch.tensor([[1.0, 2.0, 4.0], [1.0, math.nan, 3.0], [0.5, 0.25, 2.0]])
    adv, keep = score_groups(rewards, algo)
    finite = rewards.nan_to_num(7.0)  # any finite stand-in: per-group advantages ignore it
    alone, kept = score_groups(finite, algo)
    assert torch.equal(adv[[0, 2]], alone[[0, 2]]) and torch.equal(keep[[0, 2]], kept[[0, 2]])
    assert adv[1].tolist() == [0.0, 0.0, 0.0] and not keep[1].any()
    assert float(adv[0].abs().max()) > 0.5
    algo.adv_std = "global"  # a batch-wide std spans the finite groups alone
    adv, keep = score_groups(rewards, algo)
    alone, _ = score_groups(rewards[[0, 2]], algo)
    assert torch.equal(adv[[0, 2]], alone) and adv[1].abs().sum() == 0


def test_scores_fail_or_come_back_nan() -> None:
    with pytest.raises(RewardError, match=r"non-finite value \(inf\) for sample 1 .*on_nonfinite"):
        _to_scores("r", [1.0, math.inf], 2)
    assert _to_scores("r", [1.0, math.inf], 2, drop=True).isnan().tolist() == [False, True]
    with pytest.raises(RewardError, match="returned 1 values for 2 samples"):
        _to_scores("r", [1.0], 2)
    assert _to_scores("r", [1.0], 2, drop=True).isnan().all()
    hook = RewardFn("r", lambda s, p, m: [3.0e38 * 10, 1.0])
    scores = asyncio.run(
        hook.score(torch.zeros(2, 1, 2, 2, 3, dtype=torch.uint8), ["a", "b"], [{}, {}], True)
    )
    assert scores.isnan().tolist() == [True, False]  # finite in float64, inf in float32


def _cfg(mode: str, hook: str, extra: list[str] = ()):
    over = ["steps=2", "rollout.num_inference_steps=4", "algo.kl_coef=0", "train.lr=1e-3"]
    over += ["save_every=0", f"rewards=[{{name: '{hook}', weight: 1.0}}]", *extra]
    return tiny_config("sd3", "flowgrpo", over, mode=mode)


@pytest.fixture(scope="module")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hooks") / "hooks.py"
    path.write_text(_HOOK)
    return path


@pytest.mark.slow
def test_dropped_groups_are_counted_and_add_nothing_to_the_update(
    tmp_path: Path, hooks: Path
) -> None:
    drop = ["train.on_nonfinite=drop"]
    dropped = run_config(
        _cfg("colocated", f"{hooks}:nan_for_marked", drop), tmp_path / "drop", save_weights=False
    )
    # a group of equal rewards has advantage 0: it moves nothing, as a dropped group must
    flat = run_config(
        _cfg("colocated", f"{hooks}:constant_for_marked"), tmp_path / "flat", save_weights=False
    )
    cfg = _cfg("colocated", f"{hooks}:nan_for_marked")
    prompts = PromptSet.builtin()
    want = [
        sum(len(p) % 3 == 0 for p in prompts.for_step(cfg.seed, s, cfg.data.train_batch_size)[0])
        for s in range(2)
    ]
    assert sum(want) > 0 and min(want) < cfg.data.train_batch_size  # something to drop and keep
    assert [m["dropped_groups"] for m in dropped.metrics] == want
    assert [m["dropped_groups"] for m in flat.metrics] == [0, 0]
    assert all(math.isfinite(m["reward_mean"]) for m in dropped.metrics)
    n = cfg.rollout.n
    assert [m["trained_samples"] for m in dropped.metrics] == [
        (cfg.data.train_batch_size - w) * n for w in want
    ]
    moved = 0.0
    for name, p in flat.final_state.items():
        # close, not equal: the reference reduces a strided view of its rewards, the drop
        # path a copy, and float sums depend on the order (1e-5 relative in advantages)
        torch.testing.assert_close(dropped.final_state[name], p, rtol=1e-2, atol=1e-5)
        moved = max(moved, float(p.abs().max()) if "lora_B" in name else 0.0)
    assert moved > 1e-4
    disagg = run_config(
        _cfg("disaggregated", f"{hooks}:nan_for_marked", drop),
        tmp_path / "disagg",
        save_weights=False,
    )
    assert [m["dropped_groups"] for m in disagg.metrics] == want
    with pytest.raises(RewardError, match="nan_for_marked.*non-finite value \\(nan\\)"):
        run_config(
            _cfg("colocated", f"{hooks}:nan_for_marked"), tmp_path / "fail", save_weights=False
        )


def test_a_non_finite_loss_fails_or_is_left_out(tmp_path: Path) -> None:
    # a huge learning rate makes the weights overflow after the first optimizer update
    boom = ["train.lr=1e30", "rewards=[{name: jpeg_incompressibility}]"]
    with pytest.raises(NonFiniteError, match=r"the loss of train step 0 .* is nan"):
        run_config(
            _cfg("colocated", "jpeg_incompressibility", boom), tmp_path / "fail", save_weights=False
        )
    res = run_config(
        _cfg("colocated", "jpeg_incompressibility", [*boom, "train.on_nonfinite=drop"]),
        tmp_path / "drop",
        save_weights=False,
    )
    assert len(res.metrics) == 2
    assert res.metrics[0]["dropped_microbatches"] > 0 and res.metrics[1]["loss"] == 0.0
