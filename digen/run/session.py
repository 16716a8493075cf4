"""One worker's run, from its first line of log to its :class:`~digen.run.runner.RunResult`.

:class:`RunSession` holds what a run writes (outputs, log, trackers, trace, checkpoints) and
drives a :class:`~digen.runtime.backend.TrainingBackend` (the colocated trainer, or the
disaggregated driver): it starts it, evaluates before the first step and every
``eval.every`` steps, writes each step's row, sample grid and checkpoint as the step ends
(:meth:`RunSession.on_step`), and at the end the last checkpoint, the weights and the
trace. In a data-parallel colocated run every rank has one; rank 0 (the lead) writes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
import torch

from digen.checkpoint import (
    JOIN_SECRET_FILE,
    CheckpointWriter,
    SavedWeights,
    checkpoint_identity,
)
from digen.config import DigenConfig, config_to_dict
from digen.run.outputs import RunOutputs
from digen.run.paired import PASSED_PREFIX
from digen.run.trackers import Trackers
from digen.runtime.metrics import eval_metrics, eval_verdicts
from digen.runtime.notes import NotesToRunLog
from digen.runtime.placement import peak_memory_gb
from digen.sched.trace import Trace

if TYPE_CHECKING:
    from digen.checkpoint import Checkpoint
    from digen.prompts import PromptSet
    from digen.runtime.backend import TrainingBackend
    from digen.runtime.messages import StepResult

__all__ = ["RunResult", "RunSession", "StopRequest"]

WORKERS_FILE = "workers.json"
"""Role -> host and pid of the run's processes, present while the run lives."""


@dataclass(slots=True)
class RunResult:
    """What :meth:`~digen.run.runner.DigenRunner.run` returns."""

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
    verdicts: list[dict[str, str]] = field(default_factory=list)
    """Beside each of ``evals``: each image's verdict per group (``0`` / ``1`` strings, as
    :func:`~digen.runtime.metrics.eval_verdicts`; empty where the prompts have no judge),
    which :mod:`digen.run.paired` compares."""
    peak_memory_gb: float = 0.0
    """The peak resident size of the process that ran the run (the driver), in GB, from its
    start to the final state (a full fine-tune's is read later, from the disk), before the
    run's plots are drawn."""


class StopRequest:
    """A stop asked for (a signal, a caller), and the backend it must reach while one runs."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self.backend: TrainingBackend | None = None
        """The lead's backend while it runs."""

    def ask(self, reason: str) -> None:
        """Stop at the next micro-batch boundary (safe from a signal handler or a thread)."""
        self.reason = reason
        backend = self.backend
        if backend is not None:
            backend.request_stop()


MakeBackend = Callable[[int, int, "Trace", "Checkpoint | None", "str | None"], "TrainingBackend"]
"""``make(rank, world, trace, checkpoint, join_secret)``: the run's training backend."""


@dataclass(slots=True)
class SessionSetup:
    """What every worker's session of one run shares (the runner resolved it)."""

    cfg: DigenConfig
    out_dir: Path
    make_backend: MakeBackend
    stop: StopRequest
    checkpoint: Checkpoint | None = None
    """The checkpoint the run continues from."""
    eval_prompts: PromptSet | None = None
    """The evaluation's prompts (``eval.every > 0``)."""
    samples_at: Callable[[int], bool] = lambda step: False
    """Whether a step writes a sample grid."""
    progress: bool = True
    save_weights: bool = True
    join_secret: str | None = None
    """What a joining generator must prove it knows (None: the lead makes one if it must)."""
    plan: dict[str, Any] | None = None
    """How ``--mode auto`` chose the layout (``plan.json``)."""
    placement_notes: list[str] = field(default_factory=list)


class RunSession:
    """Worker ``rank`` of ``world``'s run (module docstring)."""

    def __init__(self, setup: SessionSetup, rank: int, world: int) -> None:
        self.setup, self.cfg = setup, setup.cfg
        self.rank, self.world = rank, world
        self.lead = rank == 0
        self.out_dir = setup.out_dir
        self.outputs = RunOutputs(self.out_dir) if self.lead else None
        self.metrics: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.verdicts: list[dict[str, str]] = []
        self.ckpt = setup.checkpoint
        self.start = self.ckpt.step if self.ckpt is not None else 0
        """The step the run starts at (a resumed run's checkpoint step)."""
        self.saved: Path | None = self.ckpt.path if self.ckpt is not None else None
        """The newest checkpoint (the lead's)."""
        self.saved_step = self.start
        """The step count of the newest checkpoint, on every rank."""
        self.writer = CheckpointWriter(self.out_dir, self.cfg.keep_checkpoints)
        self.every = save_interval(self.cfg)
        self.backend: TrainingBackend | None = None
        self.bar: _Progress | None = None

    # --- the run ---------------------------------------------------------------------------

    async def run(self) -> RunResult:
        cfg, setup, outputs = self.cfg, self.setup, self.outputs
        self.log, closing = _open_log(outputs.log_path if outputs else None)
        self._say_at_start()
        # events go to trace.jsonl as they finish; memory holds only the steps under way
        trace = Trace(path=outputs.trace_path) if outputs else Trace()
        self.trackers = Trackers(
            cfg.logger if self.lead else (), self.out_dir, first_step=self.start
        )
        self.trackers.log_config(config_to_dict(cfg))
        made_secret = (
            cfg.runtime.elastic.accept_generators and self.lead and setup.join_secret is None
        )
        if made_secret:
            setup.join_secret = _new_join_secret(self.out_dir / JOIN_SECRET_FILE)
        interrupted, weights, final_state, peak_gb = False, None, {}, 0.0
        t0 = time.perf_counter()
        try:
            made = setup.make_backend(self.rank, self.world, trace, self.ckpt, setup.join_secret)
            async with made as backend:
                self.backend = backend
                self.log.info("workers_ready", seconds=round(time.perf_counter() - t0, 3))
                await self._started(backend, made_secret)
                self.bar = _Progress(
                    cfg.steps, enabled=setup.progress and self.lead, initial=self.start
                )
                if self.lead:
                    setup.stop.backend = backend
                    if setup.stop.reason:  # asked before the workers were up
                        backend.request_stop()
                if cfg.eval.every:
                    await self.evaluate()  # the weights the run starts from
                try:
                    steps = range(self.start, cfg.steps)
                    await backend.run(steps, self.on_step, samples_at=setup.samples_at)
                    interrupted = len(self.metrics) < len(steps)
                finally:
                    self.bar.close()
                    setup.stop.backend = None
                weights, final_state = await self._finish(backend)
                peak_gb = peak_memory_gb("cpu")  # before the trace's plots are drawn
        except Exception as exc:
            self.log.error(
                "run_failed",
                error=f"{type(exc).__name__}: {exc}",
                steps=self.start + len(self.metrics),
                checkpoint=str(self.saved) if self.saved else None,
                traceback="".join(traceback.format_exception(exc)),  # remote ones included
            )
            raise
        finally:
            self._close(trace)
            self.log.info("run_end", steps=len(self.metrics), interrupted=interrupted)
            closing.close()
        return RunResult(
            metrics=self.metrics,
            out_dir=self.out_dir,
            interrupted=interrupted,
            weights=weights,
            final_state=final_state,
            first_step=self.start,
            stop_signal=setup.stop.reason if setup.stop.reason in ("SIGINT", "SIGTERM") else None,
            checkpoint=self.saved,
            evals=self.evals,
            verdicts=self.verdicts,
            peak_memory_gb=peak_gb,
        )

    def _say_at_start(self) -> None:
        """The config, the plan and the notes into the outputs and the log."""
        cfg, setup, outputs, log = self.cfg, self.setup, self.outputs, self.log
        if outputs:
            outputs.write_config(config_to_dict(cfg))
            if setup.plan is not None:
                outputs.write_json("plan.json", setup.plan)
                log.info("note", text=f"mode auto chose {setup.plan['line']}")
        for note in setup.placement_notes if self.lead else ():
            log.info("note", text=note)
        if self.lead and cfg.runtime.mode == "disaggregated" and cfg.algo.adv_std == "global":
            note = (
                "algo.adv_std = global divides advantages by one std over the whole batch, so "
                "updates wait until every group of a step is scored (algo.adv_std = group lets "
                "training start after the first group)"
            )
            log.info("note", text=note)
            if setup.progress:
                print(f"note: {note}.", file=sys.stderr)
        log.info(
            "run_start",
            model=cfg.model.name,
            algo=cfg.algo.name,
            mode=cfg.runtime.mode,
            steps=cfg.steps,
            world=self.world,
        )

    async def _started(self, backend: TrainingBackend, made_secret: bool) -> None:
        """The workers are up: say where they are (and how to join), follow the generator
        pool, load the checkpoint."""
        cfg, log = self.cfg, self.log
        if self.outputs:
            await self._write_workers()
        if cfg.runtime.elastic.accept_generators and self.lead:
            secret_file = Path(
                cfg.runtime.elastic.join_secret_file or self.out_dir / JOIN_SECRET_FILE
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
                    f"note: the run's join secret is {self.setup.join_secret} (in "
                    f"{secret_file}, readable by you only); whoever holds it can join "
                    "the run and run code in it: keep it like a password",
                    file=sys.stderr,
                )
        if backend.pool is not None:
            backend.pool.on_change = self._pool_changed
        if self.ckpt is not None:
            await backend.restore(self.ckpt)
            log.info("resumed", checkpoint=str(self.ckpt.path), step=self.start)

    async def _pool_changed(self, event: dict[str, Any]) -> None:
        """A generator lost, back or new: into the log, one line on stderr, ``workers.json``."""
        self.log.warning(**event)  # generator_lost / generator_joined, and why
        name, left = event["worker"], event["generators"]
        what = event.get("cause") or (
            f"{name} is back." if event.get("restart") else f"{name} joined."
        )
        print(f"note: {what} The run goes on with {left} generator(s).", file=sys.stderr)
        if self.outputs:
            await self._write_workers()

    # --- what each step leaves ---------------------------------------------------------------

    async def on_step(self, res: StepResult) -> bool:
        """A step is done: its row, grid, tracker rows and checkpoint (and an evaluation
        when one is due); False stops the run (a stop was asked for)."""
        assert self.bar is not None
        self.bar.step(
            reward=f"{res.metrics['reward_mean']:.4f}",
            loss=f"{res.metrics['loss']:.2e}",
            s=f"{res.metrics['step_time_s']:.1f}",
        )
        if self._eval_due(res.metrics["step"] + 1):  # the weights the step ended with
            res.metrics.update(await self.evaluate())
        self.metrics.append(res.metrics)
        if self.outputs:
            self.outputs.append_metrics(res.metrics)
            if res.pixels is not None:
                step = res.metrics["step"]
                grid = self.outputs.save_samples(step, res.pixels, res.captions)
                self.trackers.log_image("sample_grid", grid, step, res.captions)
        self.trackers.log_step(  # evaluations were logged at their own version
            res.metrics["step"],
            {k: v for k, v in res.metrics.items() if not k.startswith("eval/")},
        )
        self.log.info("step", **res.metrics)
        done = res.metrics["step"] + 1
        if self.every and done % self.every == 0 and done < self.cfg.steps:
            await self.checkpoint(done)
        return not self.setup.stop.reason

    def _eval_due(self, done: int) -> bool:
        every = self.cfg.eval.every
        return bool(every) and (done % every == 0 or done == self.cfg.steps)

    async def evaluate(self) -> dict[str, Any]:
        """Evaluate the current weights; the row of ``eval/...`` columns (the lead's: other
        data-parallel workers take part and get none)."""
        backend, bar, cfg = self.backend, self.bar, self.cfg
        assert backend is not None and bar is not None and self.setup.eval_prompts is not None
        ep, t = self.setup.eval_prompts, time.perf_counter()
        bar.phase(
            f"eval v{backend.version}: {len(ep.prompts)} held-out prompts x {cfg.eval.samples}"
        )
        version, batches = await backend.evaluate(ep.prompts, ep.metadata, cfg.eval.samples)
        if not batches:
            return {}
        row = eval_metrics(batches, version, time.perf_counter() - t)
        verdicts = eval_verdicts(batches)
        self.evals.append(row)
        self.verdicts.append(verdicts)
        self.trackers.log_step(version, row)
        self.log.info("eval", **row)
        if self.outputs:  # the verdicts go to eval.jsonl only: they are no scalars
            self.outputs.append_eval({**row, **{PASSED_PREFIX + g: v for g, v in verdicts.items()}})
            thumbs = torch.cat([b.thumbnails for b in batches])
            n = cfg.eval.samples
            captions = [ep.prompts[i // n] for i in range(len(thumbs))]
            grid = self.outputs.save_eval_grid(version, thumbs, captions)
            self.trackers.log_image("eval_grid", grid, version, captions)
        return row

    async def checkpoint(self, done: int) -> None:
        """A checkpoint of the first ``done`` steps (every rank takes part; the lead writes
        it under a temporary name and renames it once complete)."""
        backend = self.backend
        assert backend is not None
        self.saved_step = done
        if not self.lead:  # its part, if any (sharded workers write their shards)
            await backend.write_checkpoint(self.writer.staging(done))
            return
        tmp = self.writer.begin(done)
        await backend.write_checkpoint(tmp)
        cfg = self.cfg
        identity = checkpoint_identity(cfg)
        self.saved = self.writer.finish(tmp, done, backend.version, identity, _config_yaml(cfg))
        self.log.info("checkpoint", path=str(self.saved), step=done)

    # --- the end -----------------------------------------------------------------------------

    async def _finish(self, backend: TrainingBackend) -> tuple[Path | None, Any]:
        """After the last step (or a stop): a checkpoint of the steps done (every clean stop
        leaves one), the weights, and the final state a caller gets."""
        done = self.start + len(self.metrics)
        if self.metrics and self.saved_step != done:
            await self.checkpoint(done)
        weights = None
        if self.outputs and self.setup.save_weights and self.metrics:
            weights = await backend.save_weights(self.out_dir)
            self.log.info("weights_saved", path=str(weights))
        if weights is not None and self.cfg.train.lora_rank == 0:
            # full weights: read from the files on demand, not through this process
            return weights, SavedWeights(weights, await backend.trained_names())
        return weights, await backend.final_state()

    def _close(self, trace: Trace) -> None:
        """The trace and timeline (an empty trace too: a run stopped before its first task
        has one), the trackers, and ``workers.json`` gone."""
        outputs = self.outputs
        if outputs:
            write_trace(trace, outputs.dir, self.cfg)
            last = self.start + max(len(self.metrics) - 1, 0)
            self.trackers.log_image("timeline", outputs.dir / "timeline.png", last)
        elif not self.lead and len(trace):  # the lead merges it once every worker has ended
            trace.save_jsonl(self.out_dir / rank_trace_name(self.rank))
        self.trackers.close()
        if outputs:
            (outputs.dir / WORKERS_FILE).unlink(missing_ok=True)

    async def _write_workers(self) -> None:
        """``workers.json``: role -> host and pid of every process of the run, while it
        lives (an operator, or a test, can find and stop exactly one worker)."""
        backend = self.backend
        assert backend is not None
        here: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
        if backend.rendezvous is not None:
            here["rendezvous"] = backend.rendezvous  # where workers (and joiners) find it
        where = {"driver": here, **await backend.whereabouts()}
        (self.out_dir / WORKERS_FILE).write_text(json.dumps(where, indent=1) + "\n")


# --- helpers ---------------------------------------------------------------------------------


def save_interval(cfg: DigenConfig) -> int:
    """Steps between checkpoints: ``save_every``, or about ten a run (at least every 100
    steps); 0 means only at the end."""
    if cfg.save_every is not None:
        return cfg.save_every
    return max(1, min(100, cfg.steps // 10))


def write_trace(trace: Trace, out_dir: Path, cfg: DigenConfig) -> None:
    """The trace outputs of a run: Chrome trace, raw events, measured costs, timeline."""
    trace.write_chrome(out_dir / "trace.json")
    trace.save_jsonl(out_dir / "trace.jsonl")
    _write_profile(trace, out_dir / "profile.json")
    trace.plot_timeline(
        out_dir / "timeline.png",
        title=f"{cfg.model.name} / {cfg.algo.name} / {cfg.runtime.mode}",
    )


def rank_trace_name(rank: int) -> str:
    """The file a data-parallel rank other than the lead leaves its trace events in."""
    return f"trace-rank-{rank}.jsonl"


def _write_profile(trace: Trace, path: Path) -> None:
    """The run's measured costs per micro-batch, for ``digen simulate --profile``."""
    from digen.sched.costs import OnlineProfiler

    profiler = OnlineProfiler()
    profiler.observe_all(e for e in trace.events if e.worker != "driver")
    if profiler.ready():
        profiler.save(path)


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
