"""GAP micro-batch formation on both axes."""

from __future__ import annotations

from digen.sched.microbatch import form_microbatches, samples_per_microbatch


def test_generation_axis_spreads_a_group_over_generators() -> None:
    mbs = form_microbatches(3, prompts=2, n=8, generators=4)
    assert [(m.prompt, m.samples) for m in mbs] == [
        (0, (0, 1)), (0, (2, 3)), (0, (4, 5)), (0, (6, 7)),
        (1, (0, 1)), (1, (2, 3)), (1, (4, 5)), (1, (6, 7)),
    ]  # fmt: skip
    assert [m.mb for m in mbs] == list(range(8)) and {m.step for m in mbs} == {3}


def test_prompt_axis_makes_whole_groups() -> None:
    mbs = form_microbatches(0, prompts=3, n=4, generators=2, axis="prompt")
    assert [(m.prompt, m.samples) for m in mbs] == [(p, (0, 1, 2, 3)) for p in range(3)]


def test_uneven_split_covers_every_sample_once() -> None:
    mbs = form_microbatches(0, prompts=2, n=5, generators=2)
    assert samples_per_microbatch(5, 2, "generation", None) == 3
    seen = sorted((m.prompt, s) for m in mbs for s in m.samples)
    assert seen == [(p, s) for p in range(2) for s in range(5)]
    assert [len(m.samples) for m in mbs] == [3, 2, 3, 2]
    assert samples_per_microbatch(5, 2, "generation", 99) == 5
