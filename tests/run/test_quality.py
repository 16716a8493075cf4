"""``digen bench --quality``'s arithmetic: curves from a run's rows, time to target, area,
and the report (pure functions, no runs)."""

from __future__ import annotations

import pytest

from digen.run.paired import mcnemar_p
from digen.run.quality import (
    Curve,
    QualitySettings,
    arm_config,
    arms,
    auc,
    curve_of,
    format_quality,
    summarise_quality,
    time_to_target,
)


def _curve(arm: str, seed: int, quality: list[float], step_s: float = 2.0) -> Curve:
    versions = [0, 2, 4]
    return Curve(arm, seed, versions, [v * step_s for v in versions], quality)


def test_a_curve_reads_training_time_up_to_each_evaluated_version() -> None:
    metrics = [{"step": s, "step_time_s": t} for s, t in enumerate([1.0, 2.0, 4.0])]
    evals = [
        {"eval/policy_version": 0, "eval/accuracy": 0.1, "eval/accuracy/counting": 0.0},
        {"eval/policy_version": 2, "eval/accuracy": 0.3, "eval/accuracy/counting": 0.5},
        {"eval/policy_version": 3, "eval/accuracy": 0.4, "eval/accuracy/counting": 1.0},
    ]
    c = curve_of("colocated", 7, metrics, evals)
    assert (c.versions, c.seconds, c.quality) == ([0, 2, 3], [0.0, 3.0, 7.0], [0.1, 0.3, 0.4])
    assert c.categories == {"counting": [0.0, 0.5, 1.0]}
    rewards = [{"eval/policy_version": 0, "eval/reward_mean": 2.5}]
    assert curve_of("x", 0, metrics, rewards).quality == [2.5]  # no accuracy: the reward


def test_time_to_target_is_the_first_evaluation_at_or_above_it() -> None:
    c = _curve("a", 0, [0.1, 0.5, 0.4])
    assert time_to_target(c, 0.5) == (2, 4.0)
    assert time_to_target(c, 0.1) == (0, 0.0)
    assert time_to_target(c, 0.6) is None


def test_auc_is_the_mean_of_the_trapezoids_over_the_versions() -> None:
    c = Curve("a", 0, [0, 2, 6], [0.0, 1.0, 2.0], [0.0, 1.0, 0.0])
    assert auc(c) == pytest.approx((2 * 0.5 + 4 * 0.5) / 6)
    assert auc(Curve("a", 0, [0], [0.0], [0.3])) == 0.3


def test_the_report_ranks_arms_by_time_to_target_and_checks_tcss_against_the_spread() -> None:
    s = QualitySettings(seeds=(0, 1), target=0.5, algos=("flowgrpo",))
    curves = [
        _curve("colocated", 0, [0.1, 0.3, 0.6], step_s=1.0),  # reaches 0.5 at 4 s
        _curve("colocated", 1, [0.1, 0.5, 0.7], step_s=1.0),  # at 2 s
        _curve("disaggregated", 0, [0.1, 0.6, 0.7], step_s=0.5),  # at 1 s
        _curve("disaggregated", 1, [0.1, 0.4, 0.6], step_s=0.5),  # at 2 s
        _curve("tcss", 0, [0.1, 0.45, 0.9], step_s=0.4),  # inside, inside, above
        _curve("tcss", 1, [0.1, 0.55, 0.9], step_s=0.4),
        _curve("colocated-mixgrpo", 0, [0.1, 0.6, 0.6], step_s=0.1),  # at 0.1 s, one seed
        _curve("colocated-mixgrpo", 1, [0.1, 0.2, 0.3], step_s=0.1),
    ]
    report = summarise_quality(s, curves, command="digen bench --quality")
    colo = report["arms"]["colocated"]
    assert colo["seconds_to_target"] == {"median": 3.0, "min": 2.0, "max": 4.0}
    assert colo["steps_to_target"]["median"] == 3 and colo["reached"] == "2/2"
    assert report["arms"]["tcss"]["reached"] == "2/2"
    last = report["arms"]["disaggregated"]["last"]
    assert last == {"median": pytest.approx(0.65), "min": 0.6, "max": 0.7}
    assert report["tcss_within_on_policy_spread"] == [True, True, False]
    assert report["arms"]["tcss"]["seconds_to_target"]["median"] == pytest.approx(1.2)
    assert report["arms"]["colocated-mixgrpo"]["reached"] == "1/2"
    # median 1.2 s, on-policy split 1.5 s; an arm one seed of two carried is not ranked
    assert report["first_to_target"] == "tcss"
    table = format_quality(report)
    assert "TCSS median within the on-policy seeds' range at 2 of 3 evaluations" in table
    assert "first to the target in training time: tcss" in table


def _judged(arm: str, seed: int, verdicts: list[dict[str, str]]) -> Curve:
    quality = [sum(v.count("1") for v in e.values()) / 8 for e in verdicts]
    return Curve(
        arm,
        seed,
        [0, 2, 4][: len(verdicts)],
        [0.0, 1.0, 2.0][: len(verdicts)],
        quality,
        verdicts=verdicts,
    )


def test_the_report_gives_each_categorys_rise_with_its_paired_test_and_compares_arms() -> None:
    """Per category, the rise from the first evaluation to the last (median over seeds) with
    the images gained and lost pooled over the seeds and McNemar's p; TCSS against on-policy
    image by image at each evaluation."""
    s = QualitySettings(seeds=(0, 1), target=0.9, algos=("flowgrpo",))
    curves = [
        _judged(
            "disaggregated",
            0,
            [
                {"position": "0000", "colors": "0101"},
                {"position": "0110", "colors": "0101"},
                {"position": "1110", "colors": "1101"},
            ],
        ),
        _judged(
            "disaggregated",
            1,
            [
                {"position": "0001", "colors": "0000"},
                {"position": "0001", "colors": "0000"},
                {"position": "1111", "colors": "0001"},
            ],
        ),
        _judged(
            "tcss",
            0,
            [
                {"position": "0000", "colors": "0101"},
                {"position": "0100", "colors": "0101"},
                {"position": "1100", "colors": "0100"},
            ],
        ),
        _judged(
            "tcss",
            1,
            [
                {"position": "0001", "colors": "0000"},
                {"position": "0001", "colors": "0000"},
                {"position": "0011", "colors": "0001"},
            ],
        ),
    ]
    report = summarise_quality(s, curves)
    on = report["arms"]["disaggregated"]["rises"]
    # position: seed 0 gains 3 (0000 -> 1110), seed 1 gains 3 (0001 -> 1111): none lost
    assert (on["position"]["gained"], on["position"]["lost"]) == (6, 0)
    assert on["position"]["p"] == mcnemar_p(6, 0) == 2 / 64
    assert on["position"]["rise"] == {"median": 0.75, "min": 0.75, "max": 0.75}
    assert (on["colors"]["gained"], on["colors"]["lost"]) == (2, 0)
    assert (on["all"]["gained"], on["all"]["lost"]) == (8, 0)
    stale = report["arms"]["tcss"]["rises"]
    # seed 0: position 0000 -> 1100 (+2), colors 0101 -> 0100 (-1); seed 1: position +1, colors +1
    assert (stale["position"]["gained"], stale["position"]["lost"]) == (3, 0)
    assert (stale["colors"]["gained"], stale["colors"]["lost"]) == (1, 1)
    assert stale["colors"]["p"] == 1.0
    compared = report["compared"]["tcss vs disaggregated"]
    assert len(compared) == 3
    assert (compared[0]["all"]["gained"], compared[0]["all"]["lost"]) == (0, 0)  # same start
    # last evaluation, tcss against on-policy: position 1100 vs 1110 (1 only on-policy),
    # 0011 vs 1111 (2); colors 0100 vs 1101 (2), 0001 vs 0001
    last = compared[-1]
    assert (last["position"]["gained"], last["position"]["lost"]) == (0, 3)
    assert (last["all"]["gained"], last["all"]["lost"]) == (0, 5)
    assert last["all"]["p"] == mcnemar_p(0, 5)
    table = format_quality(report)
    assert "position" in table and f"p={mcnemar_p(6, 0):.2g}" in table
    assert "tcss vs disaggregated, last evaluation" in table


def test_every_arm_is_a_valid_config_on_the_same_task_and_seed() -> None:
    s = QualitySettings(flavour="tiny", steps=4, eval_every=2)
    got = {a.key: arm_config(s, a, seed=3) for a in arms(s)}
    assert list(got) == [
        "colocated",
        "disaggregated",
        "tcss",
        "colocated-dancegrpo",
        "colocated-mixgrpo",
    ]
    for cfg in got.values():
        assert (cfg.seed, cfg.steps, cfg.eval.every, cfg.data.prompts) == (3, 4, 2, "shapes")
        assert [r.name for r in cfg.rewards] == ["shapes"]
    assert (
        got["tcss"].runtime.schedule.max_staleness == 1
        and got["disaggregated"].runtime.schedule.max_staleness == 0
    )
    assert got["colocated"].train.mini_batch_size == got["disaggregated"].train.mini_batch_size


@pytest.mark.parametrize(("signal", "code"), [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_run_stopped_by_a_signal_stops_the_bench(
    tmp_path, monkeypatch: pytest.MonkeyPatch, signal: str, code: int
) -> None:
    """The run under way takes the signal (a graceful stop); the bench must not go on to
    its next run, and exits as a stopped command does."""
    from digen.errors import RunStopped
    from digen.run import quality as q
    from digen.run.runner import DigenRunner, RunResult

    async def stopped(self: DigenRunner) -> RunResult:
        return RunResult(metrics=[], out_dir=tmp_path, interrupted=True, stop_signal=signal)

    monkeypatch.setattr(DigenRunner, "run", stopped)
    s = QualitySettings(steps=2, seeds=(0,))
    arm = arms(s)[0]
    with pytest.raises(RunStopped) as stop:
        q.measure_arm(arm, arm_config(s, arm, 0), tmp_path / "run")
    assert stop.value.signal == signal

    from cli.bench import _measuring

    def measure() -> None:
        q.measure_arm(arm, arm_config(s, arm, 0), tmp_path / "again")

    with pytest.raises(SystemExit) as exited:
        _measuring(measure, debug=False)
    assert exited.value.code == code
