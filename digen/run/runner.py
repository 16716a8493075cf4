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
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from digen.checkpoint import (
    JOIN_SECRET_FILE,
    Checkpoint,
    CheckpointWriter,
    SavedWeights,
    check_out_dir,
    checkpoint_identity,
    previous_outputs,
)
from digen.config import DigenConfig, config_to_dict, load_config
from digen.errors import DigenError
from digen.prompts import PromptSet
from digen.rewards.scoring import CompositeReward, build_reward
from digen.run.outputs import RunOutputs
from digen.run.trackers import Trackers, require
from digen.runtime.metrics import eval_metrics
from digen.runtime.notes import NotesToRunLog
from digen.runtime.placement import check_devices_here, peak_memory_gb
from digen.sched.trace import Trace
from digen.shapes import balanced

if TYPE_CHECKING:
    from digen.runtime.messages import StepResult

__all__ = ["DigenRunner", "RunResult"]

_WORKERS_FILE = "workers.json"
"""Role -> host and pid of the run's processes, present while the run lives."""


@dataclass(slots=True)
class RunResult:
    """What :meth:`DigenRunner.run` returns."""

    metrics: list[dict[str, Any]]
    """One dict per completed step (the rows of ``metrics.jsonl``)."""
    out_dir: Path
    """Where the run wrote its outputs (a new temporary directory when ``out_dir`` was None)."""
    interrupted: bool = False
    weights: Path | None = None
    """The saved LoRA adapter (``lora/``) or full transformer (``transformer/``)."""
    final_state: Mapping[str, torch.Tensor] = field(default_factory=dict, repr=False)
    """The trained parameters at the end (name -> tensor), for checks and chaining; of a
    full fine-tune that saved its weights, read from ``weights`` when first used."""
    first_step: int = 0
    """The step this run started at (a resumed run's checkpoint step); ``metrics`` holds
    the steps from there on, ``metrics.jsonl`` every step of the run."""
    stop_signal: str | None = None
    """``SIGINT`` or ``SIGTERM`` when a signal stopped the run early."""
    checkpoint: Path | None = None
    """The newest checkpoint written (``--resume`` continues from it)."""
    evals: list[dict[str, Any]] = field(default_factory=list)
    """One row per evaluation (``eval.every``; the rows of ``eval.jsonl``), the first of the
    weights the run started from."""
    peak_memory_gb: float = 0.0
    """The peak resident size of the process that ran :meth:`DigenRunner.run` (the
    driver), in GB, from its start to the final state (a full fine-tune's is read later,
    from the disk), before the run's plots are drawn."""


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
        self.eval_prompts: PromptSet | None = None
        """The evaluation's prompts (``eval.every > 0``), loaded before anything starts."""
        if self.cfg.eval.every:
            self.eval_prompts = PromptSet.for_eval(self.cfg.eval.prompts, self.cfg.data.prompts)
            if self.cfg.eval.per_category is not None:
                try:
                    chosen = balanced(self.eval_prompts.prompts, self.cfg.eval.per_category)
                except ValueError as exc:
                    raise DigenError(
                        f"eval.per_category needs shapes-world prompts: {exc}"
                    ) from None
                self.eval_prompts = PromptSet(chosen)
        self._join_secret: str | None = None
        """With ``runtime.accept_generators``: what a joining generator must prove it knows;
        read here from ``runtime.join_secret_file``, else made when the run starts."""
        if self.cfg.runtime.join_secret_file is not None:
            from digen.runtime.transport.join_secret import read_secret

            try:
                self._join_secret = read_secret(
                    self.cfg.runtime.join_secret_file, "runtime.join_secret_file"
                )
            except ValueError as exc:
                raise DigenError(str(exc)) from None
        self._temporary = not out_dir
        self.out_dir = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="digen-run-"))
        self.progress = progress
        self.sample_every = max(1, int(sample_every))
        self.sample_grids = sample_grids
        self.save_weights = save_weights
        self.resume = resume
        self.overwrite = overwrite
        self._checkpoint: Checkpoint | None = None
        self._stop: str | None = None
        self._backend_now: Any = None
        """The lead worker's backend while it runs (what a stop request reaches)."""
        self._plan = plan
        self._placement_notes: list[str] = []
        """What the placement of a data-parallel run's group says for the log."""

    def request_stop(self, reason: str = "stop") -> None:
        """Stop at the next micro-batch boundary (safe from a signal handler or another
        thread): the step under way is left unless it is past its last update, the outputs
        and a checkpoint of the steps completed are written, and :meth:`run` returns."""
        self._stop = reason
        backend = self._backend_now
        if backend is not None:
            backend.request_stop()

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
        cfg = self.cfg
        lead = rank == 0
        outputs = RunOutputs(self.out_dir) if lead else None
        log, log_fh = _open_log(outputs.log_path if outputs else None)
        if outputs:
            outputs.write_config(config_to_dict(cfg))
            if self._plan is not None:
                outputs.write_json("plan.json", self._plan)
                log.info("note", text=f"mode auto chose {self._plan['line']}")
        for note in self._placement_notes if lead else ():
            log.info("note", text=note)
        if lead and cfg.runtime.mode == "disaggregated" and cfg.algo.adv_std == "global":
            note = (
                "algo.adv_std = global divides advantages by one std over the whole batch, so "
                "updates wait until every group of a step is scored (algo.adv_std = group lets "
                "training start after the first group)"
            )
            log.info("note", text=note)
            if self.progress:
                print(f"note: {note}.", file=sys.stderr)
        log.info(
            "run_start",
            model=cfg.model.name,
            algo=cfg.algo.name,
            mode=cfg.runtime.mode,
            steps=cfg.steps,
            world=world,
        )
        # events go to trace.jsonl as they finish; memory holds only the steps under way
        trace = Trace(path=outputs.trace_path) if outputs else Trace()
        metrics: list[dict[str, Any]] = []
        evals: list[dict[str, Any]] = []
        interrupted = False
        weights = None
        peak_gb = 0.0
        ckpt = self._checkpoint
        start = ckpt.step if ckpt is not None else 0
        saved: Path | None = ckpt.path if ckpt is not None else None
        trackers = Trackers(cfg.logger if lead else (), self.out_dir, first_step=start)
        trackers.log_config(config_to_dict(cfg))
        made_secret = cfg.runtime.accept_generators and lead and self._join_secret is None
        if made_secret:
            self._join_secret = _new_join_secret(self.out_dir / JOIN_SECRET_FILE)
        t0 = time.perf_counter()
        try:
            async with self._backend(rank, world, trace, ckpt) as backend:
                log.info("workers_ready", seconds=round(time.perf_counter() - t0, 3))
                if outputs:
                    await self._write_workers(backend)
                if cfg.runtime.accept_generators and lead:
                    secret_file = Path(
                        cfg.runtime.join_secret_file or self.out_dir / JOIN_SECRET_FILE
                    )
                    log.info(
                        "accepting_generators",
                        rendezvous=backend.rendezvous,
                        secret_file=str(secret_file),
                    )
                    print(
                        "note: generators may join this run: digen join "
                        f"{backend.rendezvous} --secret-file {secret_file}",
                        file=sys.stderr,
                    )
                    if made_secret:  # shown once, here only: the log does not hold it
                        print(
                            f"note: the run's join secret is {self._join_secret} (in "
                            f"{secret_file}, readable by you only); whoever holds it can join "
                            "the run and run code in it: keep it like a password",
                            file=sys.stderr,
                        )
                if hasattr(backend, "pool"):  # the driver: its generator pool may change

                    async def pool_changed(event: dict, backend: Any = backend) -> None:
                        log.warning(**event)  # generator_lost / generator_joined, and why
                        name, left = event["worker"], event["generators"]
                        what = event.get("cause") or (
                            f"{name} is back." if event.get("restart") else f"{name} joined."
                        )
                        print(
                            f"note: {what} The run goes on with {left} generator(s).",
                            file=sys.stderr,
                        )
                        if outputs:
                            await self._write_workers(backend)

                    backend.pool.on_change = pool_changed
                if ckpt is not None:
                    if cfg.runtime.mode != "disaggregated":  # the driver's trainers load it
                        await backend.restore(ckpt)
                    log.info("resumed", checkpoint=str(ckpt.path), step=start)
                writer = CheckpointWriter(self.out_dir, cfg.keep_checkpoints)
                every = save_interval(cfg)
                bar = _Progress(cfg.steps, enabled=self.progress and lead, initial=start)
                if lead:
                    self._backend_now = backend
                    if self._stop:  # asked before the workers were up
                        backend.request_stop()

                saved_step = start  # the step count of the newest checkpoint, on every rank

                async def checkpoint(done: int) -> None:
                    nonlocal saved, saved_step
                    saved_step = done
                    if not lead:  # its part, if any (sharded workers write their shards)
                        await backend.write_checkpoint(writer.staging(done))
                        return
                    tmp = writer.begin(done)
                    await backend.write_checkpoint(tmp)
                    saved = writer.finish(
                        tmp, done, backend.version, checkpoint_identity(cfg), _config_yaml(cfg)
                    )
                    log.info("checkpoint", path=str(saved), step=done)

                async def evaluate() -> dict[str, Any]:
                    """Evaluate the current weights; the row of ``eval/...`` columns (the
                    lead's: other data-parallel workers take part and get none)."""
                    assert self.eval_prompts is not None
                    ep, t = self.eval_prompts, time.perf_counter()
                    bar.phase(
                        f"eval v{backend.version}: {len(ep.prompts)} held-out prompts x "
                        f"{cfg.eval.samples}"
                    )
                    version, batches = await backend.evaluate(
                        ep.prompts, ep.metadata, cfg.eval.samples
                    )
                    if not batches:
                        return {}
                    row = eval_metrics(batches, version, time.perf_counter() - t)
                    evals.append(row)
                    trackers.log_step(version, row)
                    log.info("eval", **row)
                    if outputs:
                        outputs.append_eval(row)
                        thumbs = torch.cat([b.thumbnails for b in batches])
                        n = cfg.eval.samples
                        captions = [ep.prompts[i // n] for i in range(len(thumbs))]
                        grid = outputs.save_eval_grid(version, thumbs, captions)
                        trackers.log_image("eval_grid", grid, version, captions)
                    return row

                def eval_due(done: int) -> bool:
                    every = cfg.eval.every
                    return bool(every) and (done % every == 0 or done == cfg.steps)

                if cfg.eval.every:
                    await evaluate()  # the weights the run starts from

                async def on_step(res: StepResult) -> bool:
                    bar.step(
                        reward=f"{res.metrics['reward_mean']:.4f}",
                        loss=f"{res.metrics['loss']:.2e}",
                        s=f"{res.metrics['step_time_s']:.1f}",
                    )
                    if eval_due(res.metrics["step"] + 1):  # the weights the step ended with
                        res.metrics.update(await evaluate())
                    metrics.append(res.metrics)
                    if outputs:
                        outputs.append_metrics(res.metrics)
                        if res.pixels is not None:
                            step = res.metrics["step"]
                            grid = outputs.save_samples(step, res.pixels, res.captions)
                            trackers.log_image("sample_grid", grid, step, res.captions)
                    trackers.log_step(  # evaluations were logged at their own version
                        res.metrics["step"],
                        {k: v for k, v in res.metrics.items() if not k.startswith("eval/")},
                    )
                    log.info("step", **res.metrics)
                    done = res.metrics["step"] + 1
                    if every and done % every == 0 and done < cfg.steps:
                        await checkpoint(done)
                    return not self._stop

                try:
                    steps = range(start, cfg.steps)
                    await backend.run(steps, on_step, samples_at=self.samples_at)
                    interrupted = len(metrics) < len(steps)
                finally:
                    bar.close()
                    self._backend_now = None
                if metrics and saved_step != start + len(metrics):
                    await checkpoint(start + len(metrics))  # every clean stop leaves one
                if outputs and self.save_weights and metrics:
                    weights = await backend.save_weights(self.out_dir)
                    log.info("weights_saved", path=str(weights))
                if weights is not None and cfg.train.lora_rank == 0:
                    # full weights: read from the files on demand, not through this process
                    final_state = SavedWeights(weights, await backend.trained_names())
                else:
                    final_state = await backend.final_state()
                peak_gb = peak_memory_gb("cpu")  # before the trace's plots are drawn
        except Exception as exc:
            log.error(
                "run_failed",
                error=f"{type(exc).__name__}: {exc}",
                steps=start + len(metrics),
                checkpoint=str(saved) if saved else None,
                traceback="".join(traceback.format_exception(exc)),  # remote ones included
            )
            raise
        finally:
            if outputs:  # an empty trace too: a run stopped before its first task has one
                _write_trace(trace, outputs.dir, cfg)
                last = start + max(len(metrics) - 1, 0)
                trackers.log_image("timeline", outputs.dir / "timeline.png", last)
            elif not lead and len(trace):  # the lead merges it once every worker has ended
                trace.save_jsonl(self.out_dir / _rank_trace_name(rank))
            trackers.close()
            if outputs:
                (outputs.dir / _WORKERS_FILE).unlink(missing_ok=True)
            log.info("run_end", steps=len(metrics), interrupted=interrupted)
            log_fh.close()
        return RunResult(
            metrics=metrics,
            out_dir=self.out_dir,
            interrupted=interrupted,
            weights=weights,
            final_state=final_state,
            first_step=start,
            stop_signal=self._stop if self._stop in ("SIGINT", "SIGTERM") else None,
            checkpoint=saved,
            evals=evals,
            peak_memory_gb=peak_gb,
        )

    async def _write_workers(self, backend: Any) -> None:
        """``workers.json``: role -> host and pid of every process of the run, while it
        lives (an operator, or a test, can find and stop exactly one worker)."""
        here: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
        if getattr(backend, "rendezvous", None) is not None:
            here["rendezvous"] = backend.rendezvous  # where workers (and joiners) find it
        where = {"driver": here}
        if hasattr(backend, "whereabouts"):
            where.update(await backend.whereabouts())
        path = self.out_dir / _WORKERS_FILE
        path.write_text(json.dumps(where, indent=1) + "\n")

    def _backend(self, rank: int, world: int, trace: Trace, ckpt: Checkpoint | None = None):
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
                join_secret=self._join_secret,
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
                self.cfg.runtime.rpc_timeout_s,
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


def _write_trace(trace: Trace, out_dir: Path, cfg: DigenConfig) -> None:
    """The trace outputs of a run: Chrome trace, raw events, measured costs, timeline."""
    trace.write_chrome(out_dir / "trace.json")
    trace.save_jsonl(out_dir / "trace.jsonl")
    _write_profile(trace, out_dir / "profile.json")
    trace.plot_timeline(
        out_dir / "timeline.png",
        title=f"{cfg.model.name} / {cfg.algo.name} / {cfg.runtime.mode}",
    )


def _rank_trace_name(rank: int) -> str:
    return f"trace-rank-{rank}.jsonl"


def _merge_rank_traces(out_dir: Path, world: int, cfg: DigenConfig) -> None:
    """Data-parallel: add the events of workers 1..W-1 (each left its own file) to the lead's
    trace, so the run's trace, profile and timeline show every worker."""
    parts = [out_dir / _rank_trace_name(r) for r in range(1, world)]
    parts = [p for p in parts if p.is_file()]
    lead = out_dir / "trace.jsonl"
    if parts and lead.is_file():
        trace = Trace.load_jsonl(lead)
        for p in parts:
            trace.extend(Trace.load_jsonl(p).events)
        _write_trace(trace, out_dir, cfg)
    for p in parts:
        p.unlink()


def _write_profile(trace: Trace, path: Path) -> None:
    """The run's measured costs per micro-batch, for ``digen simulate --profile``."""
    from digen.sched.costs import OnlineProfiler

    profiler = OnlineProfiler()
    profiler.observe_all(e for e in trace.events if e.worker != "driver")
    if profiler.ready():
        profiler.save(path)


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


def save_interval(cfg: DigenConfig) -> int:
    """Steps between checkpoints: ``save_every``, or about ten a run (at least every 100
    steps); 0 means only at the end."""
    if cfg.save_every is not None:
        return cfg.save_every
    return max(1, min(100, cfg.steps // 10))


def _config_yaml(cfg: DigenConfig) -> str:
    import yaml

    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


class _Progress:
    """The run's progress on stderr: a bar on a terminal; elsewhere (a log file, a pipe) one
    plain line per step, with no carriage returns. ``phase`` says what runs between steps
    (an evaluation); ``enabled`` False says nothing."""

    def __init__(self, total: int, enabled: bool, initial: int = 0) -> None:
        self.total, self.done, self.enabled = total, initial, enabled
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True
            )

    def phase(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_description_str(text)
        elif self.enabled:
            print(f"{text} ...", file=sys.stderr, flush=True)

    def step(self, **figures: str) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_description_str("train", refresh=False)
            self.bar.update(1)
            self.bar.set_postfix(**figures)
        elif self.enabled:
            shown = " ".join(f"{k}={v}" for k, v in figures.items())
            print(f"train {self.done}/{self.total} {shown}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _new_join_secret(path: Path) -> str:
    """A new join secret, written to ``path`` (replacing any) readable by its owner only."""
    from digen.runtime.transport.join_secret import new_secret

    secret = new_secret()
    staged = path.with_name(f".{path.name}.{os.getpid()}")
    staged.unlink(missing_ok=True)
    fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(secret + "\n")
    os.replace(staged, path)
    return secret


def _open_log(path: Path | None):
    """The run's structured log, and what closes it. While it is open, digen's own notes
    (``logging.getLogger("digen")``: a prompt a text encoder truncates, ...) go into it
    rather than to the terminal."""
    fh = path.open("a", encoding="utf-8") if path else open(os.devnull, "w")  # noqa: SIM115
    logger = structlog.wrap_logger(
        structlog.WriteLogger(fh),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ],
    )
    notes = NotesToRunLog(logger)
    logging.getLogger("digen").addHandler(notes)
    closing = contextlib.ExitStack()
    closing.callback(fh.close)
    closing.callback(logging.getLogger("digen").removeHandler, notes)
    return logger, closing
