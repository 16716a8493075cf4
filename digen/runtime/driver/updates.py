"""What each scored micro-batch's update is, from the moment its group is scored until a
trainer has trained it.

A group's advantages are computed once its last micro-batch is scored (with
``algo.adv_std = global``, once the whole step is): :meth:`Updates.group_scored` keeps each
micro-batch's kept rows and their advantages as an :class:`UpdateTask` and puts it on the
scheduler's UQ (all of a step at once when the step trains whole). A micro-batch whose
holder is lost keeps its task, but a copy of it stands in (:meth:`Updates.stand_in`) so that
what was held back of it is recognised as stale; once made again elsewhere it is rehomed to
its new holder (:meth:`Updates.rehome`) and goes on UQ again.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from digen.algos.train_step import score_groups
from digen.config import DigenConfig
from digen.sched.microbatch import MicroBatch
from digen.sched.scheduler import Scheduler

__all__ = ["RolloutRef", "UpdateTask", "Updates"]


@dataclass(frozen=True, slots=True)
class RolloutRef:
    """A generated micro-batch: where its rollout and pixels are, and which version made it."""

    mb: MicroBatch
    holder: str
    version: int


@dataclass(frozen=True, slots=True)
class UpdateTask:
    """An update: the kept samples of one micro-batch (``rows`` of it) and their advantages."""

    rollout: RolloutRef
    rows: tuple[int, ...]
    advantages: tuple[float, ...]


class Updates:
    """The updates of the scored micro-batches (module docstring)."""

    def __init__(
        self,
        cfg: DigenConfig,
        sched: Scheduler,
        reward_weights: Mapping[str, float],
        holder_lost: Callable[[str], bool],
    ) -> None:
        """``reward_weights``: each reward's weight by name (``algo.reward_weighting =
        advantage``); ``holder_lost``: whether a worker holding rollouts was lost."""
        self.cfg, self.sched = cfg, sched
        self.reward_weights = reward_weights
        self.holder_lost = holder_lost
        self.tasks: dict[tuple[int, int], UpdateTask] = {}
        """Each ``(step, mb)``'s update, once its group is scored, until it is trained."""
        self._held_back: dict[int, list[UpdateTask]] = defaultdict(list)
        """Per step, updates waiting for the rest of the step (a step trained whole)."""

    def __getitem__(self, key: tuple[int, int]) -> UpdateTask:
        return self.tasks[key]

    def group_scored(self, s: int, prompt: int) -> list[tuple[str, int]]:
        """The group of ``prompt`` in step ``s`` is scored: its advantages, its
        micro-batches' updates, and UQ. Returns ``(holder, mb)`` of the micro-batches with
        no kept sample (best-of-N), counted as trained, for the caller to release."""
        sched, algo, n = self.sched, self.cfg.algo, self.cfg.rollout.n
        rec = sched.record(s)
        whole_batch = algo.adv_std == "global"  # the std spans the batch: wait for it all
        if whole_batch and not rec.all_scored:
            return []
        prompts = sorted({m.prompt for m in rec.mbs}) if whole_batch else [prompt]
        rewards = torch.tensor([sched.group_rewards(s, p, n) for p in prompts])
        parts = []  # each reward's [G, n] scores, for advantage-level weighting
        if algo.reward_weighting == "advantage":
            for name, got in rec.components.items():
                scores = torch.tensor([[got[(p, j)] for j in range(n)] for p in prompts])
                parts.append((self.reward_weights[name], scores))
        adv, keep = score_groups(rewards, algo, parts)
        empty = []
        for row, p in enumerate(prompts):
            for mb in rec.group(p):
                if mb.mb in rec.dropped:
                    continue  # a lost generator's stale work, left out (Scheduler.orphaned)
                holder, version = rec.made[mb.mb]
                rows = tuple(r for r, sample in enumerate(mb.samples) if keep[row, sample])
                if not rows:  # best-of-N kept none of it
                    sched.dropped(s, mb.mb)
                    empty.append((holder, mb.mb))
                    continue
                advs = tuple(float(adv[row, mb.samples[r]]) for r in rows)
                task = UpdateTask(RolloutRef(mb, holder, version), rows, advs)
                self.tasks[s, mb.mb] = task
                if self.holder_lost(holder):
                    continue  # it is being made again: it goes on once it is (rehome)
                self._held_back[s].append(task)
        if not sched.plan.whole_step or rec.all_scored:  # e.g. naive: train once all is scored
            for task in self._held_back.pop(s, []):
                if self.tasks.get((s, task.rollout.mb.mb)) is task:  # else lost, made again
                    sched.queued(s, task.rollout.mb.mb)
        return empty

    def stand_in(self, s: int, mb: int) -> None:
        """``(s, mb)``'s holder was lost: what is held back of its update reads the lost
        store, so it is no longer its update (an equal copy stands in until it is made again,
        and rehomed)."""
        if (task := self.tasks.get((s, mb))) is not None:
            self.tasks[s, mb] = dataclasses.replace(task)

    def current(self, task: UpdateTask) -> bool:
        """Whether ``task`` is still its micro-batch's update (not lost and made again)."""
        return self.tasks.get((task.rollout.mb.step, task.rollout.mb.mb)) is task

    def rehome(self, s: int, mb: int, holder: str, version: int) -> None:
        """A scored micro-batch made again by ``holder``: its update (if its group has one
        yet) goes where it was going, now reading from ``holder``."""
        task = self.tasks.get((s, mb))
        if task is None:
            return  # its group is not scored yet: its update will read the new holder
        new = UpdateTask(RolloutRef(task.rollout.mb, holder, version), task.rows, task.advantages)
        self.tasks[s, mb] = new
        if self.sched.plan.whole_step and not self.sched.record(s).all_scored:
            self._held_back[s].append(new)  # goes on UQ with its step's others
        else:
            self.sched.queued(s, mb)

    def done(self, s: int, mb: int) -> None:
        """``(s, mb)`` was trained, or left out: it has no update any more."""
        self.tasks.pop((s, mb), None)

    def step_done(self, s: int) -> None:
        """Step ``s`` is over: forget its updates (and any earlier ones)."""
        for key in [k for k in self.tasks if k[0] <= s]:
            self.tasks.pop(key)
