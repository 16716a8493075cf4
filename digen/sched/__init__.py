"""Scheduling core, torch-free: the schedule's rules, plan, micro-batches, trace, costs,
simulator, TAG/TCSS policies.

Nothing in this package imports torch, so the simulator and the search run (and are tested)
anywhere; ``tests/sched/test_torch_free.py`` guards that. Words: task kinds, pools and worker
names (:mod:`.names`); the admission rule (:mod:`.admission`); every number a run's rules use,
derived once (:mod:`.plan`).

The schedule's rules
--------------------
Written once, here: every other module points here. The numbers the rules use (micro-batches
per step ``B``, GAP groups, trainer slots, the stale cap, ``C_gen``) are derived once, in
:mod:`digen.sched.plan`. One :class:`~digen.sched.scheduler.Scheduler` applies them:
the driver (``digen/runtime/driver/loop.py``) runs it with real workers, the simulator
(:mod:`digen.sched.simulator`) with a clock; the TAG search runs a compiled copy of the
simulator (:mod:`digen.sched._engine`), tested to make the same schedule.

**Hand-out and versions.** A train step has ``B`` micro-batches, handed out in order (step
``s`` micro-batch ``0 .. B-1``, then step ``s + 1``), so a micro-batch's index ``m`` is also
how many of its step went out before it. Version ``s`` is the policy during step ``s``.

**Admission**: whether a worker holding version ``v`` may start micro-batch ``m`` of step
``k`` now:

- on-policy (``max_staleness = 0``): only ``v == k``;
- TCSS, fixed schedule (the default): the first ``stale_cap`` micro-batches of every step
  after the run's first are made with version ``k - 1`` and the rest with version ``k`` —
  exactly, so which trajectories are stale never depends on timing and a seeded run repeats
  bit for bit (a run's first step, also a resumed run's, is on-policy: no older weights
  exist);
- TCSS, eager schedule (the paper's opportunistic form): a worker with ``v < k`` may start
  one when ``k - v <= max_staleness`` and ``m < stale_cap``; a worker with ``v == k`` may
  start any. How many go out stale then depends on which worker is free first;
- back-pressure (the paper's ``C_gen``): nothing starts while ``max_inflight``
  micro-batches are handed out and not yet trained;
- nothing past the run's last step starts.

**Generators.** A free generator scores the head of SQ (micro-batches trainers made) if SQ
is non-empty — scoring first, so trainers get rewards early; else it generates the next
micro-batch if admitted, and scores it right after (its pixels are there); else it idles
until something changes. With scoring overlapped (``score_overlap``, the runtime's
default) scoring leaves the generator: generator ``i``'s micro-batches queue on its scoring
lane ``scorer-i`` (same process, own thread), which scores the head of SQ if any, else the
head of its own queue, and the generator is free as soon as a generation ends. Scoring
lanes hold no weights: they take no part in the optimizer step or the sync.

**Trainers.** A free trainer updates the head of UQ (the step's micro-batches ready for
update) if any; else it is at a *bubble*. With an admissible micro-batch left, the TAG
policy decides: insert (the trainer generates it, cost ``gen_tag``; it joins SQ and is
scored like any other) or skip (the trainer waits for UQ and is not asked again until it
has done an update). With nothing left to generate it just waits.

**Groups.** Advantages are group-relative, so micro-batches enter UQ a group at a time:
micro-batches ``g*k .. g*k+k-1`` form group ``g`` (``k``: the plan's ``update_group``, a GAP
group or, when updates wait for the whole step, all ``B``), entering UQ together when the
last of them is scored.

**Step end.** Once all ``B`` updates of step ``s`` are done the trainers finish their
current task, then all run the optimizer ``step``; then, once every generator has finished
its current task (and, under the fixed TCSS schedule, step ``s + 1``'s early micro-batches
are handed out), every worker runs ``sync``; then the version becomes ``s + 1``. Generators
keep working during the step but start nothing once the sync is due. Weights change only at
a sync, which waits for running tasks, so every generation has one version.

**Ties** (deterministic, so runs and the model repeat): tasks ending at the same instant
take effect in ``(step, mb)`` order; then free generators are served by index, then free
trainers — those already waiting first, then the ones just freed, each by index;
same-instant bubbles are decided one trainer at a time in that order.
"""

from digen.sched.admission import Admission, stale_cap
from digen.sched.costs import Costs, OnlineProfiler
from digen.sched.names import Pool, TaskKind, worker_name
from digen.sched.simulator import SimResult, ideal_bound, simulate
from digen.sched.state import SchedState, WorkerClock
from digen.sched.tag import (
    BTS,
    NoTAG,
    SearchResult,
    StaticTAG,
    TagPolicy,
    brute_force,
    search,
)

__all__ = [
    "BTS",
    "Admission",
    "Costs",
    "NoTAG",
    "OnlineProfiler",
    "Pool",
    "SchedState",
    "SearchResult",
    "SimResult",
    "StaticTAG",
    "TagPolicy",
    "TaskKind",
    "WorkerClock",
    "brute_force",
    "ideal_bound",
    "search",
    "simulate",
    "stale_cap",
    "worker_name",
]
