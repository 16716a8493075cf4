"""Evaluation during a run (``eval.every``): when it runs, what it writes, and that training
is the same bit for bit with or without it, in both modes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import read_jsonl, run_config, tiny_config

from digen.runtime.messages import EvalScores
from digen.runtime.metrics import eval_metrics

SMALL = ["steps=3", "rollout.n=4", "train.micro_batch_size=4", "rollout.num_inference_steps=3"]
SMALL.append("save_every=0")


def _prompts(tmp_path: Path) -> Path:
    path = tmp_path / "eval_prompts.txt"
    path.write_text("a red apple\na blue car on a road\na cat asleep on a mat\n")
    return path


def _run(tmp_path: Path, name: str, mode: str, extra: list[str]):
    cfg = tiny_config("flux", "flowgrpo", [*SMALL, *extra], mode=mode)
    return run_config(cfg, tmp_path / name)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and len(a) > 0
    for name, p in a.items():
        assert torch.equal(p, b[name]), name


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "extra"),
    [("colocated", []), ("disaggregated", ["runtime.generators=2", "runtime.schedule.tag=static"])],
)
def test_evaluation_runs_when_due_and_leaves_training_unchanged(
    tmp_path: Path, mode: str, extra: list[str]
) -> None:
    plain = _run(tmp_path, "plain", mode, extra)
    evals = [f"eval.prompts={_prompts(tmp_path)}", "eval.every=2", "eval.samples=2"]
    got = _run(tmp_path, "eval", mode, [*extra, *evals])
    _same_weights(plain.final_state, got.final_state)  # evaluating moves no training stream
    for a, b in zip(plain.metrics, got.metrics, strict=True):
        assert (a["reward_mean"], a["loss"]) == (b["reward_mean"], b["loss"])

    # before training, after step 1 (every 2nd) and after the last step
    rows = read_jsonl(tmp_path / "eval" / "eval.jsonl")
    assert [r["eval/policy_version"] for r in rows] == [0, 2, 3]
    assert all(r["eval/samples"] == 6 for r in rows)  # 3 prompts x 2 images
    assert rows == got.evals
    metrics = read_jsonl(tmp_path / "eval" / "metrics.jsonl")
    assert [m.get("eval/policy_version") for m in metrics] == [None, 2, 3]  # its weights' row
    assert metrics[2]["eval/reward_mean"] == rows[2]["eval/reward_mean"]
    assert rows[0]["eval/reward_mean"] != rows[2]["eval/reward_mean"]  # training moved it
    for v in (0, 2, 3):
        assert (tmp_path / "eval" / "samples" / f"eval_v{v:04d}.png").stat().st_size > 1000


@pytest.mark.slow
def test_the_same_weights_evaluate_the_same_in_both_modes(tmp_path: Path) -> None:
    """Fixed noise, deterministic sampling: the base model's evaluation is one set of numbers
    whichever mode and worker made its images."""
    evals = [f"eval.prompts={_prompts(tmp_path)}", "eval.every=5", "steps=1"]
    colocated = _run(tmp_path, "colocated", "colocated", evals)
    disaggregated = _run(
        tmp_path, "disaggregated", "disaggregated", [*evals, "runtime.generators=2"]
    )
    assert colocated.evals[0]["eval/policy_version"] == 0
    first = [r.evals[0]["eval/reward/jpeg_incompressibility"] for r in (colocated, disaggregated)]
    assert first[0] == pytest.approx(first[1], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nfts_moving_average_evaluates_the_same_in_both_modes(tmp_path: Path, dtype: str) -> None:
    """DiffusionNFT evaluates the trainers' moving average (eval.ema): disaggregated, trainer 0
    lends it to the generators for the evaluation (kept in fp32, lent in the model's dtype);
    the numbers are the colocated run's."""
    over = [*SMALL, "steps=2", f"eval.prompts={_prompts(tmp_path)}", "eval.every=1"]
    over.append(f"model.dtype={dtype}")
    # the micro-batches of two generators and one optimizer step a step: the same bits
    over += ["train.micro_batch_size=2", "train.mini_batch_size=null"]
    key = "eval/reward/jpeg_incompressibility"
    got = {}
    for name, mode, extra in (
        ("colocated", "colocated", []),
        # small buckets: the average is lent in several, one at a time
        (
            "disaggregated",
            "disaggregated",
            [
                "runtime.generators=2",
                "runtime.schedule.tag=static",
                "runtime.transport.sync_bucket_mb=0.05",
            ],
        ),
        ("sampling", "colocated", ["eval.ema=0"]),
    ):
        cfg = tiny_config("flux", "nft", [*over, *extra], mode=mode)
        assert cfg.eval.ema == (0.0 if name == "sampling" else 0.9)
        threads = torch.get_num_threads()
        if (
            mode == "colocated"
        ):  # as each worker (runtime.placement.threads_per_worker): the same kernels
            torch.set_num_threads(1)
        try:
            run = run_config(cfg, tmp_path / name)
        finally:
            torch.set_num_threads(threads)
        got[name] = [(r["eval/policy_version"], r[key]) for r in run.evals]
    assert [v for v, _ in got["colocated"]] == [0, 1, 2]
    assert got["disaggregated"] == got["colocated"]  # the same training, the same average
    # before training all three are the base model; after it the average is not the old policy
    assert got["sampling"][0][1] == pytest.approx(got["colocated"][0][1], rel=1e-6)
    assert got["sampling"][2][1] != pytest.approx(got["colocated"][2][1], rel=1e-6)


def test_evaluation_samples_its_own_steps_with_its_own_solver() -> None:
    """``eval.num_inference_steps`` and ``eval.solver`` (the published evaluations sample 40
    Euler steps where training samples 10): the evaluation of a run sampling 6 dpm2 steps
    with 4 Euler ones is that of a run sampling 4 Euler steps; unset, it is training's."""
    from digen.runtime.worker.policy import Policy

    keys, prompts = [(0, 0), (1, 0)], ["a red apple", "a blue car on a road"]
    plain = ["eval.ema=0"]  # the weights that sample, as every copy here holds them

    def images(overrides: list[str]) -> torch.Tensor:
        policy = Policy(tiny_config("sd3", "nft", [*plain, *overrides]), trainable=False)
        return policy.evaluate(keys, prompts)

    own = images(["eval.num_inference_steps=4", "eval.solver=euler"])
    assert torch.equal(own, images(["rollout.num_inference_steps=4", "rollout.solver=euler"]))
    default = images([])
    assert not torch.equal(own, default)
    assert torch.equal(default, images(["eval.num_inference_steps=6", "eval.solver=dpm2"]))


def _scores(categories: list[str], strict: list[float], total: list[float]) -> EvalScores:
    return EvalScores(
        total=total,
        components={"shapes": total},
        passed=strict,
        groups=categories,
        thumbnails=torch.zeros(len(total), 1, 2, 2, 3, dtype=torch.uint8),
    )


def test_eval_metrics_are_genevals_category_means_and_their_mean() -> None:
    batches = [
        _scores(["single_object", "single_object", "counting"], [1.0, 0.0, 1.0], [1.0, 0.5, 1.0]),
        _scores(["counting", "position"], [0.0, 0.0], [0.25, 0.75]),
    ]
    row = eval_metrics(batches, version=4, seconds=1.5)
    assert row["eval/accuracy/single_object"] == 0.5
    assert row["eval/accuracy/counting"] == 0.5
    assert row["eval/accuracy/position"] == 0.0
    assert "eval/accuracy/colors" not in row  # no prompt of that category
    assert row["eval/accuracy"] == pytest.approx((0.5 + 0.5 + 0.0) / 3)  # not per image (0.4)
    assert row["eval/reward_mean"] == pytest.approx(3.5 / 5)
    assert row["eval/reward/shapes"] == row["eval/reward_mean"]
    assert (row["eval/policy_version"], row["eval/samples"], row["eval/time_s"]) == (4, 5, 1.5)


def test_prompts_that_are_not_shapes_captions_have_no_accuracy() -> None:
    batch = EvalScores([0.5], {"jpeg": [0.5]}, None, None, torch.zeros(1, 1, 2, 2, 3))
    row = eval_metrics([batch], version=0, seconds=0.1)
    assert not any(k.startswith("eval/accuracy") for k in row)


def test_shapes_captions_are_judged_by_genevals_rule_on_the_images() -> None:
    """judge reads the images: scenes drawn for their captions pass, swapped ones fail."""
    import numpy as np

    from digen.prompts import PromptSet
    from digen.rewards.judge import judge
    from digen.shapes import parse, render, scene_for

    held_out = PromptSet.for_eval(None, "shapes")  # the training set's held-out companion
    assert held_out.prompts == PromptSet.builtin("shapes-heldout").prompts
    prompts = held_out.prompts[::10]
    rng = np.random.default_rng(0)
    images = np.stack([render(scene_for(parse(p), rng)) for p in prompts])  # [B, 32, 32, 3]
    pixels = torch.from_numpy(images)[:, None]  # [B, 1, H, W, 3]
    judged = judge(pixels, prompts)
    assert judged.passed == [1.0] * len(prompts)
    assert judged.groups == [parse(p).category for p in prompts]
    wrong = judge(pixels, prompts[1:] + prompts[:1]).passed  # each image under another caption
    assert sum(wrong) < len(prompts) / 2
    assert judge(pixels[:1], ["a photo of a dog"]) is None  # not the shapes world: no judging


def test_per_category_takes_each_held_out_category_alike_and_needs_shapes_prompts(
    tmp_path: Path,
) -> None:
    from digen.errors import DigenError
    from digen.run.runner import DigenRunner
    from digen.shapes import CATEGORIES, parse

    shapes = ["data.prompts=shapes", "rewards=[shapes]", "eval.every=1", "eval.per_category=3"]
    runner = DigenRunner(tiny_config("flux", "flowgrpo", shapes), out_dir=tmp_path / "a")
    assert runner.eval_prompts is not None  # the held-out set, 3 of each category
    got = [parse(p).category for p in runner.eval_prompts.prompts]
    assert got == [c for c in CATEGORIES for _ in range(3)]
    assert runner.eval_prompts.prompts[:3] == ["a triangle"] * 3

    other = ["eval.every=1", "eval.per_category=3", f"eval.prompts={_prompts(tmp_path)}"]
    with pytest.raises(DigenError, match="eval.per_category needs shapes-world prompts: "):
        DigenRunner(tiny_config("flux", "flowgrpo", other), out_dir=tmp_path / "b")


def test_data_per_category_trains_each_category_alike_and_needs_shapes_prompts(
    tmp_path: Path,
) -> None:
    from collections import Counter

    from digen.errors import DigenError
    from digen.run.runner import DigenRunner
    from digen.shapes import CATEGORIES, parse

    base = ["data.prompts=shapes", "rewards=[shapes]"]
    plain = DigenRunner(tiny_config("flux", "flowgrpo", base), out_dir=tmp_path / "a").prompts
    counts = Counter(parse(p).category for p in plain.prompts)
    assert counts["position"] > 50 * counts["single_object"]  # the shipped set, once each
    even = ["data.per_category=192", *base]
    runner = DigenRunner(tiny_config("flux", "flowgrpo", even), out_dir=tmp_path / "b")
    got = [parse(p).category for p in runner.prompts.prompts]
    assert got == [c for c in CATEGORIES for _ in range(192)]
    assert set(runner.prompts.prompts) == set(plain.prompts)  # 192: every caption kept
    # an epoch's train steps draw the categories alike: 1152 prompts, 4 a step
    steps = [runner.prompts.for_step(0, s, 4)[0] for s in range(288)]
    drawn = Counter(parse(p).category for step in steps for p in step)
    assert drawn == Counter({c: 192 for c in CATEGORIES})

    other = ["data.per_category=3", f"data.prompts={_prompts(tmp_path)}"]
    with pytest.raises(DigenError, match="data.per_category needs shapes-world prompts: ") as e:
        DigenRunner(tiny_config("flux", "flowgrpo", other), out_dir=tmp_path / "c")
    assert str(e.value).endswith("set data.per_category=null to take every prompt once.")
