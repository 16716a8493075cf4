"""The schedule plan of a disaggregated run: every value the schedule needs, derived once.

A :class:`SchedulePlan` is frozen and torch-free. It is built once per run from the run's
settings (``digen.config.schedule_plan(cfg)`` hands them over) and then passed, never
re-derived: the driver and its :class:`~digen.sched.scheduler.Scheduler`, the TAG search's
:class:`~digen.sched.state.SchedState`, the simulator, ``digen simulate``,
``digen bench`` and a resumed run all read the same object.

The rules (the only place they are written; other modules point here):

- **micro-batches** (GAP, :mod:`digen.sched.microbatch`): a step's ``prompts x group_size``
  samples are cut into micro-batches of ``samples_per_microbatch`` samples of one prompt
  (generation axis) or of one whole group (prompt axis); ``per_group`` micro-batches make one
  prompt's group, ``microbatches = prompts x per_group`` make a step;
- **whole step**: updates wait for the whole step to be scored when the run does not
  pipeline (``runtime.schedule.pipeline = false``) or its advantages use the whole batch's
  statistics (``algo.adv_std = global``); the schedule then treats the step as one group
  (:attr:`SchedulePlan.update_group`);
- **trainer slots**: trainers the driver schedules: every replicated trainer, or one when
  they shard the model (fsdp / hsdp trainers move in lockstep, as one trainer);
- **stale cap** (TCSS): ``floor(staleness_ratio x microbatches)`` micro-batches of a step may
  (eager) or must (fixed) be made one version early (:func:`~digen.sched.admission.stale_cap`);
- **C_gen** (``max_inflight``): at most this many micro-batches are handed out and not yet
  trained; by default one step's micro-batches plus what TCSS may start early for each of
  ``max_staleness`` versions, so generators are never held back within a step. A bound
  below what one update needs whole would deadlock, and is refused
  (:func:`plan_schedule`);
- **admission** (:class:`~digen.sched.admission.Admission`): which micro-batch a worker
  holding a version may start, with the run's first step (a resumed run's first step is
  on-policy) and last step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from digen.errors import ConfigError
from digen.sched.admission import Admission, stale_cap
from digen.sched.microbatch import MicroBatch, form_microbatches
from digen.sched.microbatch import samples_per_microbatch as microbatch_size

__all__ = ["SchedulePlan", "StepLayout", "plan_schedule"]


@dataclass(frozen=True, slots=True)
class StepLayout:
    """How a train step's samples are cut into micro-batches (:mod:`digen.sched.microbatch`)."""

    prompts: int
    """Prompts per train step (``data.train_batch_size``)."""
    group_size: int
    """Samples per prompt (``rollout.n``)."""
    samples_per_microbatch: int
    """Samples in one micro-batch: a slice of one prompt's group (GAP) or all of it."""

    @property
    def per_group(self) -> int:
        """Micro-batches one prompt's group is cut into."""
        return -(-self.group_size // self.samples_per_microbatch)

    def microbatches_of(self, step: int) -> list[MicroBatch]:
        """The micro-batches of train step ``step``, in hand-out order."""
        return form_microbatches(
            step, self.prompts, self.group_size, samples=self.samples_per_microbatch
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class SchedulePlan:
    """What the schedule of one run is (rules in the module docstring)."""

    microbatches: int
    """Micro-batches per train step (``B``)."""
    update_group: int
    """Micro-batches that enter the update queue together: a GAP group, or the whole step."""
    generators: int
    """Generator workers."""
    trainers: int
    """Trainer slots the driver schedules (one for a sharded trainer group)."""
    admission: Admission
    """Which micro-batch may start when (TCSS, ``C_gen``, first and last step)."""
    score_overlap: bool = False
    """Each generator's micro-batches are scored on its scoring lane, beside generation."""
    tag: str = "none"
    """The TAG policy's name (``runtime.schedule.tag``)."""
    tag_k: int = 0
    """The static TAG policy's ``k`` (``runtime.schedule.tag_k``)."""
    layout: StepLayout | None = None
    """Which samples each micro-batch holds; None in a simulation that counts only."""
    group_updates: bool = False
    """A trainer slot takes the queued micro-batches of a prompt group made by one version in
    one update (``runtime.schedule.group_updates``)."""

    def __post_init__(self) -> None:
        for name in ("microbatches", "update_group", "generators", "trainers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @property
    def whole_step(self) -> bool:
        """Updates wait for every micro-batch of the step to be scored."""
        return self.update_group == self.microbatches

    def microbatches_of(self, step: int) -> list[MicroBatch]:
        """The micro-batches of train step ``step``, in hand-out order."""
        if self.layout is None:
            raise ValueError("this plan counts micro-batches only (no layout)")
        return self.layout.microbatches_of(step)

    def ids_of(self, prompts: range) -> range:
        """The ids of the micro-batches of ``prompts`` in every step (consecutive: they go
        out prompt by prompt), as in one mini-batch."""
        ids = [m.mb for m in self.microbatches_of(0) if m.prompt in prompts]
        if ids != list(range(ids[0], ids[-1] + 1)):
            raise AssertionError(f"the micro-batches of prompts {prompts} are apart: {ids}")
        return range(ids[0], ids[-1] + 1)

    def running(self, first_step: int, last_step: int | None) -> SchedulePlan:
        """This plan for a run of steps ``first_step .. last_step`` (None: no end)."""
        rule = dataclasses.replace(self.admission, first_step=first_step, last_step=last_step)
        return dataclasses.replace(self, admission=rule)


def plan_schedule(
    *,
    prompts: int,
    group_size: int,
    generators: int,
    trainers: int,
    sharded_trainers: bool = False,
    axis: str = "generation",
    samples_per_microbatch: int | None = None,
    pipeline: bool = True,
    batch_advantages: bool = False,
    max_staleness: int = 0,
    staleness_ratio: float = 0.0,
    staleness_schedule: str = "fixed",
    max_inflight: int | None = None,
    score_overlap: bool = False,
    tag: str = "none",
    tag_k: int = 0,
    group_updates: bool = False,
    first_step: int = 0,
    last_step: int | None = None,
) -> SchedulePlan:
    """The :class:`SchedulePlan` of a run with these settings (rules in the module docstring).

    ``sharded_trainers``: the ``trainers`` shard one model (one slot); ``batch_advantages``:
    advantages use the whole batch's statistics; ``max_inflight`` None: the default ``C_gen``.
    Raises :class:`~digen.errors.ConfigError` naming ``runtime.schedule.max_inflight`` when it
    is too small for an update ever to start.
    """
    size = microbatch_size(group_size, generators, axis, samples_per_microbatch)
    per_group = -(-group_size // size)
    per_step = prompts * per_group
    cap = stale_cap(per_step, staleness_ratio)
    if max_inflight is None:
        max_inflight = per_step + max_staleness * cap
    else:
        # an update needs its whole group (or step) made: a smaller bound would deadlock
        need, why = per_group, "one GAP group, which trains only once whole"
        if not pipeline:
            need, why = (
                per_step,
                "a whole step, which runtime.schedule.pipeline = false generates before training",
            )
        elif batch_advantages:
            need, why = per_step, "a whole step, which algo.adv_std = global scores before training"
        if max_staleness and staleness_schedule == "fixed" and cap > need:
            need, why = cap, "the share of a step made early under the fixed TCSS schedule"
        if max_inflight < need:
            raise ConfigError(
                f"runtime.schedule.max_inflight = {max_inflight!r} is not allowed: "
                f"it must be at least {need} micro-batches ({why})."
            )
    return SchedulePlan(
        microbatches=per_step,
        update_group=per_step if not pipeline or batch_advantages else per_group,
        generators=generators,
        trainers=1 if sharded_trainers else trainers,
        admission=Admission(
            max_staleness=max_staleness,
            stale_cap=cap,
            schedule=staleness_schedule,
            max_inflight=max_inflight,
            first_step=first_step,
            last_step=last_step,
        ),
        score_overlap=score_overlap,
        tag=tag,
        tag_k=tag_k,
        layout=StepLayout(prompts, group_size, size),
        group_updates=group_updates,
    )
