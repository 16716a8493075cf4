"""``DigenRunner``: the one object a user drives, from the CLI or from Python.

    result = await DigenRunner(cfg, out_dir="runs/demo").run()

It resolves the config, loads prompts and rewards (failing early, in one sentence, on bad
input), runs the training loop, and writes everything a run leaves behind (see
:mod:`digen.run.outputs`). Ctrl-C stops at the next micro-batch boundary with every output
written so far intact.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from digen.checkpoint import Checkpoint, check_out_dir, previous_outputs
from digen.config import DigenConfig, config_to_dict, load_config
from digen.errors import DigenError
from digen.prompts import PromptSet
from digen.rewards.scoring import CompositeReward, build_reward
from digen.run.session import (
    RunResult,
    RunSession,
    SessionSetup,
    StopRequest,
    rank_trace_name,
    write_trace,
)
from digen.run.trackers import require
from digen.runtime.placement import check_devices_here
from digen.sched.trace import Trace
from digen.shapes import balanced_indices

if TYPE_CHECKING:
    from digen.runtime.backend import TrainingBackend

__all__ = ["DigenRunner", "RunResult"]


def _per_category(prompts: PromptSet, n: int, section: str) -> PromptSet:
    """``prompts`` with each shapes-world category's prompts taken ``n`` times
    (:func:`digen.shapes.balanced`), their metadata kept; ``section`` names the setting
    (``data`` or ``eval``) in the error a prompt outside the shapes world gets."""
    try:
        chosen = balanced_indices(prompts.prompts, n)
    except ValueError as exc:
        raise DigenError(
            f"{section}.per_category needs shapes-world prompts: {str(exc).rstrip('.')}; "
            f"set {section}.per_category=null to take every prompt once."
        ) from None
    return PromptSet([prompts.prompts[i] for i in chosen], [prompts.metadata[i] for i in chosen])


class DigenRunner:
    """Configure once, then ``await run()``."""

    def __init__(
        self,
        cfg: DigenConfig | dict[str, Any] | str | os.PathLike | None = None,
        *,
        rewards: Sequence[Any] | None = None,
        out_dir: str | os.PathLike | None = None,
        progress: bool = True,
        sample_every: int = 5,
        sample_grids: bool = True,
        save_weights: bool = True,
        resume: bool = False,
        overwrite: bool = False,
        plan: dict[str, Any] | None = None,
    ) -> None:
        """
        cfg: a :class:`DigenConfig`, a nested dict, a YAML path, or None for the defaults.
        rewards: reward hooks as objects (callables, ``(callable, weight)`` pairs or
            :class:`RewardFn`); they replace ``cfg.rewards`` when given.
        out_dir: where outputs go. None makes a new temporary directory (``digen-run-*``
            in :func:`tempfile.gettempdir`), says so once on stderr unless ``progress`` is
            False, and keeps it after the run: ``RunResult.out_dir`` names it; remove it when
            done (the CLI's default is a new folder under ``runs/`` instead, with
            ``runs/latest`` a link to it).
        progress: a progress bar and notes on stderr.
        sample_every: a sample grid every this many steps (and at the first and last).
        sample_grids: False writes no sample grid at all (``digen bench`` times steps, not
            grids).
        resume: continue the run in ``out_dir`` from its newest intact checkpoint, up to
            ``cfg.steps`` steps in all.
        overwrite: replace a previous run's outputs in ``out_dir`` (without it, and without
            ``resume``, a directory holding a run is refused).
        plan: how the layout was chosen (``--mode auto``, :mod:`digen.run.auto`): written
            to ``plan.json`` and its ``line`` to the log.
        """
        if isinstance(cfg, DigenConfig):
            self.cfg = cfg
        elif isinstance(cfg, dict):
            self.cfg = load_config(base=cfg)
        else:
            self.cfg = load_config(cfg)
        require(self.cfg.logger)  # a tracker's missing package fails before anything starts
        self.reward: CompositeReward = build_reward(
            list(rewards) if rewards is not None else self.cfg.rewards,
            self.cfg.train.on_nonfinite,
        )
        # hooks given as objects travel to the generator processes as they are; hooks named
        # in the config are loaded again there by name
        self._reward_objects = list(self.reward.fns) if rewards is not None else None
        self.prompts = PromptSet.load(self.cfg.data.prompts)
        if self.prompts.skipped:
            print(f"note: {self.prompts.skip_note}", file=sys.stderr)
        if self.cfg.data.per_category is not None:
            self.prompts = _per_category(self.prompts, self.cfg.data.per_category, "data")
        self.eval_prompts: PromptSet | None = None
        """The evaluation's prompts (``eval.every > 0``), loaded before anything starts."""
        if self.cfg.eval.every:
            self.eval_prompts = PromptSet.for_eval(self.cfg.eval.prompts, self.cfg.data.prompts)
            if self.cfg.eval.per_category is not None:
                self.eval_prompts = _per_category(
                    self.eval_prompts, self.cfg.eval.per_category, "eval"
                )
        self._join_secret: str | None = None
        """With ``runtime.elastic.accept_generators``: what a joining generator must prove it knows;
        read here from ``runtime.elastic.join_secret_file``, else made when the run starts."""
        if self.cfg.runtime.elastic.join_secret_file is not None:
            from digen.runtime.transport.join_secret import read_secret

            self._join_secret = read_secret(
                self.cfg.runtime.elastic.join_secret_file, "runtime.elastic.join_secret_file"
            )
        self._temporary = not out_dir
        self.out_dir = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="digen-run-"))
        self.progress = progress
        self.sample_every = max(1, int(sample_every))
        self.sample_grids = sample_grids
        self.save_weights = save_weights
        self.resume = resume
        self.overwrite = overwrite
        self._checkpoint: Checkpoint | None = None
        self._stop = StopRequest()
        self._plan = plan
        self._placement_notes: list[str] = []
        """What the placement of a data-parallel run's group says for the log."""

    def request_stop(self, reason: str = "stop") -> None:
        """Stop at the next micro-batch boundary (safe from a signal handler or another
        thread): the step under way is left unless it is past its last update, the outputs
        and a checkpoint of the steps completed are written, and :meth:`run` returns."""
        self._stop.ask(reason)

    async def run(self) -> RunResult:
        from digen.runtime.transport.actors import active_launch

        if active_launch() is None:  # under torchrun the devices are the workers' nodes'
            check_devices_here(self.cfg)
        self._claim_out_dir()
        if self._temporary and self.progress:
            print(
                f"writing to {self.out_dir} (a temporary directory, kept after the run; "
                "out_dir= chooses one)",
                file=sys.stderr,
            )
        world = self.cfg.train.num_devices
        restore = _catch_signals(self)  # signals reach the main thread only
        try:
            if world > 1:
                return await asyncio.to_thread(self._run_data_parallel, world)
            return await self._run_worker(rank=0, world=1)
        finally:
            if restore:
                restore()

    def _claim_out_dir(self) -> None:
        """Find the checkpoint to resume from, or make sure no earlier run is overwritten."""
        note = lambda text: print(f"note: {text}", file=sys.stderr)  # noqa: E731
        self._checkpoint = check_out_dir(
            self.out_dir, self.cfg, resume=self.resume, overwrite=self.overwrite, warn=note
        )
        if self.resume:
            return
        for name in previous_outputs(self.out_dir):  # --overwrite
            path = self.out_dir / name
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()

    # --- the loop -----------------------------------------------------------------------

    async def _run_worker(self, rank: int, world: int) -> RunResult:
        """Worker ``rank`` of ``world``'s run (:class:`~digen.run.session.RunSession`)."""
        setup = SessionSetup(
            cfg=self.cfg,
            out_dir=self.out_dir,
            make_backend=self._backend,
            stop=self._stop,
            checkpoint=self._checkpoint,
            eval_prompts=self.eval_prompts,
            samples_at=self.samples_at,
            progress=self.progress,
            save_weights=self.save_weights,
            join_secret=self._join_secret,
            plan=self._plan,
            placement_notes=self._placement_notes,
        )
        try:
            return await RunSession(setup, rank, world).run()
        finally:
            self._join_secret = setup.join_secret  # made by the session when it had to

    def _backend(
        self,
        rank: int,
        world: int,
        trace: Trace,
        ckpt: Checkpoint | None = None,
        join_secret: str | None = None,
    ) -> TrainingBackend:
        """The colocated trainer, or the disaggregated driver with its worker processes."""
        if self.cfg.runtime.mode == "disaggregated":
            from digen.runtime.driver.loop import Driver

            rewards = self._reward_objects if self._reward_objects is not None else None
            notes = self.out_dir / "trainer.log"  # the workers' notes join the driver's
            return Driver(
                self.cfg,
                rewards,
                self.prompts,
                trace,
                resume=ckpt,
                notes=notes,
                join_secret=join_secret,
            )
        from digen.runtime.colocated import ColocatedTrainer, worker_config

        return ColocatedTrainer(
            worker_config(self.cfg, rank),
            self.reward,
            self.prompts,
            rank=rank,
            world=world,
            trace=trace,
        )

    def samples_at(self, step: int) -> bool:
        """Whether ``step`` writes a sample grid: the first, the last, every ``sample_every``
        (none when ``sample_grids`` is False)."""
        if not self.sample_grids:
            return False
        return step == 0 or step == self.cfg.steps - 1 or (step + 1) % self.sample_every == 0

    # --- data-parallel colocated: W processes, rank 0 is this one ------------------------

    def _run_data_parallel(self, world: int) -> RunResult:
        from digen.runtime.colocated import worker_config
        from digen.runtime.placement import check_groups, colocated_groups
        from digen.runtime.transport.spawn import run_data_parallel

        devices = [worker_config(self.cfg, r).model.device for r in range(world)]
        self._placement_notes = check_groups(self.cfg, colocated_groups(self.cfg, devices))
        try:
            return run_data_parallel(
                devices,
                self.cfg.runtime.transport.rpc_timeout_s,
                lambda: asyncio.run(self._run_worker(0, world)),
                _dp_rank,
                self._spawn_state(),
            )
        finally:  # on a failure too: the other ranks' events join the lead's trace
            _merge_rank_traces(self.out_dir, world, self.cfg)

    def _spawn_state(self) -> dict[str, Any]:
        return {
            "cfg": config_to_dict(self.cfg),
            # hooks named in the config are loaded again by name (a hook loaded from a file
            # cannot be pickled by reference); hooks given as objects travel as they are
            "rewards": self._reward_objects,
            "out_dir": str(self.out_dir),
            "checkpoint": self._checkpoint,
        }


def _merge_rank_traces(out_dir: Path, world: int, cfg: DigenConfig) -> None:
    """Data-parallel: add the events of workers 1..W-1 (each left its own file) to the lead's
    trace, so the run's trace, profile and timeline show every worker."""
    parts = [out_dir / rank_trace_name(r) for r in range(1, world)]
    parts = [p for p in parts if p.is_file()]
    lead = out_dir / "trace.jsonl"
    if parts and lead.is_file():
        trace = Trace.load_jsonl(lead)
        for p in parts:
            trace.extend(Trace.load_jsonl(p).events)
        write_trace(trace, out_dir, cfg)
    for p in parts:
        p.unlink()


def _dp_rank(state: dict[str, Any], rank: int, world: int) -> Callable[[], Any]:
    """A data-parallel rank ``1..W-1``: its runner, and its share of the run to do in the
    group the lead made (:func:`~digen.runtime.transport.spawn.run_data_parallel`)."""
    torch.set_num_threads(1)
    runner = DigenRunner(
        load_config(base=state["cfg"]),
        rewards=state["rewards"],
        out_dir=state["out_dir"],
        progress=False,
        save_weights=False,
    )
    runner._checkpoint = state["checkpoint"]  # rank 0 found it; every worker loads it
    return lambda: asyncio.run(runner._run_worker(rank, world))


def _catch_signals(runner: DigenRunner):
    """First SIGINT (Ctrl-C) or SIGTERM (what schedulers send before preemption): stop at
    the next micro-batch boundary, with a checkpoint. A second one: :func:`_hard_exit`."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    caught = (signal.SIGINT, signal.SIGTERM)
    previous = {sig: signal.getsignal(sig) for sig in caught}
    signalled: list[int] = []

    def handler(signum, frame):
        if signalled:
            _hard_exit(signum)
        signalled.append(signum)
        runner.request_stop(signal.Signals(signum).name)
        print(
            f"\n{signal.Signals(signum).name}: stopping at the next micro-batch with a checkpoint "
            "(again to abort)",
            file=sys.stderr,
        )

    for sig in caught:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig in caught:
            signal.signal(sig, previous[sig])

    return restore


def _hard_exit(signum: int) -> None:
    """The second signal: kill every worker process of the run by pid, stop the fork server
    and exit the process (128 + the signal's number), from the handler itself. Nothing it
    could wait on runs first: not the event loop's cancellation (``asyncio.run`` turns a
    SIGINT into a cancelled task, whose clean-up may wait for the very call that hangs), not a
    ``finally`` or a worker's reply. Checkpoints already written stay whole: each is written
    under a temporary name and renamed once complete."""
    from digen.runtime.transport import forkserver

    with contextlib.suppress(Exception):
        print(f"{signal.Signals(signum).name} again: aborting now.", file=sys.stderr)
    forkserver.kill_started()
    with contextlib.suppress(Exception):
        forkserver.stop_fork_server()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(128 + signum)
