"""A reward hook's life: setup once per scoring process for the whole run, every call on
one event loop, close at the end; per-call timeout, retries with back-off, and what a call
that still fails does (stop the run, or leave its groups out: never a zero reward)."""

from __future__ import annotations

import asyncio
import math
import os
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import read_jsonl, run_config

from digen import load_config
from digen.config import RewardSpec, schedule_plan
from digen.errors import DigenError, RewardError
from digen.presets import preset
from digen.rewards.hooks import load_hook
from digen.rewards.loop import RewardLoop
from digen.rewards.scoring import RewardFn, build_reward
from digen.sched.trace import Trace


def _batch(b: int = 2) -> tuple[torch.Tensor, list[str], list[dict]]:
    samples = torch.arange(b, dtype=torch.uint8).view(b, 1, 1, 1, 1).expand(b, 1, 4, 4, 3)
    return samples.contiguous(), ["a prompt"] * b, [{}] * b


class Flaky:
    """Fails its first ``fails`` calls (raising or hanging), then scores the mean pixel."""

    def __init__(self, fails: int, hang: bool = False) -> None:
        self.fails, self.hang, self.calls = fails, hang, 0

    async def __call__(self, samples, prompts, metadata):
        self.calls += 1
        if self.calls <= self.fails:
            if self.hang:
                await asyncio.sleep(30)
            raise ConnectionError("server unreachable")
        return [float(s.float().mean()) for s in samples]


@pytest.mark.asyncio
async def test_retries_with_back_off_then_a_score(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("digen.rewards.scoring.RETRY_BACKOFF_S", 0.01)
    hook = Flaky(fails=2)
    reward = build_reward([RewardFn("flaky", hook, retries=2)])
    t0 = time.perf_counter()
    got = await reward(*_batch())
    assert hook.calls == 3 and got.total.tolist() == [0.0, 1.0]
    assert time.perf_counter() - t0 >= 0.03  # waited 0.01 s, then 0.02 s
    assert got.latency_s["flaky"] >= 0.03


@pytest.mark.asyncio
async def test_a_timeout_counts_as_a_failure_and_the_last_one_fails_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("digen.rewards.scoring.RETRY_BACKOFF_S", 0.01)
    hook = Flaky(fails=5, hang=True)
    reward = build_reward([RewardFn("slow", hook, timeout_s=0.05, retries=1)])
    with pytest.raises(RewardError, match=r"'slow' took longer than its timeout_s of 0.05 s"):
        await asyncio.wait_for(reward(*_batch()), 60.0)  # the hook itself never returns
    assert hook.calls == 2


class Stuck:
    """A plain hook that blocks its thread until released, counting calls at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()
        self.lock = threading.Lock()
        self.calls = self.running = self.most = self.finished = 0

    def __call__(self, samples, prompts, metadata):
        with self.lock:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
        self.entered.set()
        try:
            assert self.release.wait(120), "the test never released the hook"
            return [float(s.float().mean()) for s in samples]
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1


async def _until(condition, what: str, within_s: float = 60.0) -> None:
    """Wait (generously: the suite runs on loaded machines) until ``condition()`` holds."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, f"waited {within_s:g} s for {what}"
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_a_plain_hook_that_outlives_its_timeout_is_not_retried_beside_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("digen.rewards.scoring.RETRY_BACKOFF_S", 0.01)
    hook = Stuck()
    reward = build_reward([RewardFn("stuck", hook, timeout_s=0.5, retries=3)])
    try:
        # The first call blocks until released, so it times out whatever the machine's load.
        with pytest.raises(RewardError) as err:
            await reward(*_batch())
        assert str(err.value) == (
            "the previous call of reward hook 'stuck' is still running after its timeout_s "
            "of 0.5 s, so it is not retried."
        )
        assert (hook.calls, hook.most, hook.finished) == (1, 1, 0)
        # The next batch does not start a second copy either.
        with pytest.raises(RewardError, match=r"not called for this batch\.$"):
            await reward(*_batch())
        assert hook.calls == 1
    finally:
        hook.release.set()
    await _until(lambda: hook.finished == 1, "the stuck call to return")
    got = await reward(*_batch())  # its thread returned: the hook is called again
    assert got.total.tolist() == [0.0, 1.0]
    assert (hook.calls, hook.most, hook.finished) == (2, 1, 2)


@pytest.mark.asyncio
async def test_a_stuck_plain_hook_with_on_error_drop_scores_nan_without_a_second_copy(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("digen.rewards.scoring.RETRY_BACKOFF_S", 0.01)
    hook = Stuck()
    reward = build_reward([RewardFn("stuck", hook, timeout_s=0.5, retries=2, on_error="drop")])
    try:
        for _ in range(3):  # three batches while the first call is stuck: all left out
            got = await reward(*_batch())
            assert all(math.isnan(v) for v in got.total.tolist())
        assert (hook.calls, hook.most) == (1, 1)
    finally:
        hook.release.set()
    await _until(lambda: hook.finished == 1, "the stuck call to return")


@pytest.mark.asyncio
async def test_concurrent_calls_of_a_plain_hook_wait_their_turn() -> None:
    hook = Stuck()
    reward = build_reward([RewardFn("stuck", hook)])
    batches = [asyncio.create_task(reward(*_batch())) for _ in range(3)]
    await _until(hook.entered.is_set, "the first call to start")
    hook.release.set()
    got = await asyncio.gather(*batches)
    assert [g.total.tolist() for g in got] == [[0.0, 1.0]] * 3
    assert (hook.calls, hook.most) == (3, 1)


@pytest.mark.asyncio
async def test_on_error_drop_scores_nan_never_zero() -> None:
    reward = build_reward(
        [RewardFn("down", Flaky(fails=9), on_error="drop"), RewardFn("ok", Flaky(fails=0))]
    )
    got = await reward(*_batch())
    assert all(math.isnan(v) for v in got.components["down"].tolist())
    assert all(math.isnan(v) for v in got.total.tolist())  # its groups are left out
    assert got.components["ok"].tolist() == [0.0, 1.0]
    failing = build_reward([RewardFn("down", Flaky(fails=9))])
    with pytest.raises(RewardError, match="'down' raised ConnectionError: server unreachable"):
        await failing(*_batch())


def test_config_options_build_a_hook_class_and_functions_refuse_them(tmp_path: Path) -> None:
    hook = tmp_path / "scaled.py"
    hook.write_text(
        textwrap.dedent(
            """
            class Scaled:
                def __init__(self, factor=1.0):
                    self.factor = factor
                def __call__(self, samples, prompts, metadata):
                    return [self.factor] * len(prompts)

            def plain(samples, prompts, metadata):
                return [1.0] * len(prompts)
            """
        )
    )
    spec = RewardSpec(name=f"{hook}:Scaled", options={"factor": 2.5}, weight=2.0)
    reward = build_reward([spec])
    assert reward.score_sync(*_batch()).total.tolist() == [5.0, 5.0]
    with pytest.raises(RewardError, match="is a function, so it takes no options"):
        load_hook(f"{hook}:plain", {"factor": 2})
    with pytest.raises(RewardError, match="unexpected keyword argument 'size'"):
        load_hook(f"{hook}:Scaled", {"size": 2})


def test_config_checks_the_new_reward_keys() -> None:
    for over, key in [
        ("rewards=[{name: jpeg_compressibility, timeout_s: 0}]", "rewards.0.timeout_s"),
        ("rewards=[{name: jpeg_compressibility, retries: -1}]", "rewards.0.retries"),
        ("rewards=[{name: jpeg_compressibility, on_error: zero}]", "rewards.0.on_error"),
        ("rewards=[{name: http}]", "rewards.0.url"),
    ]:
        with pytest.raises(DigenError, match=key.replace(".", r"\.")):
            load_config(overrides=[over])


class Lived:
    """Counts its setup, calls and close, and which loop each ran on."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    async def setup(self) -> None:
        self.events.append(("setup", id(asyncio.get_running_loop())))

    async def __call__(self, samples, prompts, metadata):
        self.events.append(("call", id(asyncio.get_running_loop())))
        return [0.0] * len(prompts)

    async def close(self) -> None:
        self.events.append(("close", id(asyncio.get_running_loop())))


def test_a_reward_loop_sets_up_once_runs_every_call_on_one_loop_and_closes() -> None:
    hook = Lived()
    loop = RewardLoop(build_reward([RewardFn("lived", hook)]))
    for _ in range(3):
        loop.score(*_batch())
    loop.close()
    loop.close()  # once only
    assert [e for e, _ in hook.events] == ["setup", "call", "call", "call", "close"]
    assert len({lp for _, lp in hook.events}) == 1
    with pytest.raises(RewardError, match="closed"):
        loop.score(*_batch())


_LOGGED_HOOK = '''
import asyncio, json, os

class Logged:
    """Appends one line per setup, call and close (with this process and loop) to LOG."""

    def _log(self, what):
        with open(os.environ["REWARD_LOG"], "a") as f:
            loop = id(asyncio.get_running_loop())
            f.write(json.dumps([what, os.getpid(), loop]) + "\\n")

    async def setup(self):
        self._log("setup")

    async def __call__(self, samples, prompts, metadata):
        self._log("call")
        await asyncio.sleep(0)
        return [float(s.float().mean()) for s in samples]

    async def close(self):
        self._log("close")
'''


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_setup_runs_once_per_scoring_process_and_close_at_the_end(
    tmp_path: Path, mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = tmp_path / "logged.py"
    hook.write_text(_LOGGED_HOOK)
    log = tmp_path / "reward.log"
    monkeypatch.setenv("REWARD_LOG", str(log))
    over = ["steps=2", "rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=3"]
    over += [f"rewards=[{{name: '{hook}:Logged'}}]", "save_every=0"]
    if mode == "disaggregated":
        over += ["runtime.generators=2", "runtime.schedule.tag=none"]
    cfg = load_config(base=preset("flux", "flowgrpo", mode=mode), overrides=over)
    result = run_config(cfg, tmp_path / "out")
    events = read_jsonl(log)
    by_pid: dict[int, list] = {}
    for what, pid, loop in events:
        by_pid.setdefault(pid, []).append((what, loop))
    if mode == "disaggregated":
        assert os.getpid() not in by_pid  # the driver scores nothing: the generators do
        assert len(by_pid) == 2
    calls = 0
    for seen in by_pid.values():
        kinds = [w for w, _ in seen]
        assert kinds[0] == "setup" and kinds[-1] == "close", kinds
        assert Counter(kinds)["setup"] == Counter(kinds)["close"] == 1
        assert len({lp for _, lp in seen}) == 1  # one loop for the whole run
        calls += Counter(kinds)["call"]
    # one call per micro-batch on the generators, one per step colocated
    per_step = [schedule_plan(cfg).microbatches for s in range(2)]
    assert calls == (sum(per_step) if mode == "disaggregated" else 2)
    assert mode == "colocated" or calls > 2
    for row in result.metrics:
        assert row["reward_latency_ms/" + f"{hook}:Logged"] > 0


_SLOW_HOOK = """
import asyncio

async def slow(samples, prompts, metadata):
    await asyncio.sleep(1.0)  # a remote judge taking its time
    return [float(s.float().mean()) for s in samples]
"""


@pytest.mark.parametrize("overlap", [True, False])
def test_a_slow_async_hook_does_not_stall_generation(tmp_path: Path, overlap: bool) -> None:
    """One generator, four micro-batches, a reward that takes 1 s a call. Overlapped (the
    default), the generator goes on generating while its scoring lane waits on the hook:
    the trace shows generations starting inside scores. Scored by the generator itself, none
    can (the same measure, so it can tell the two apart)."""
    hook = tmp_path / "slow.py"
    hook.write_text(_SLOW_HOOK)
    over = ["steps=1", "data.train_batch_size=1", "rollout.n=4", "rollout.num_inference_steps=3"]
    over += [
        "train.micro_batch_size=1",
        "runtime.schedule.samples_per_microbatch=1",
        "runtime.schedule.tag=none",
    ]
    over += ["save_every=0"]
    over += [
        f"rewards=[{{name: '{hook}:slow'}}]",
        f"runtime.schedule.score_overlap={str(overlap).lower()}",
    ]
    cfg = load_config(base=preset("flux", "flowgrpo", mode="disaggregated"), overrides=over)
    assert schedule_plan(cfg).microbatches == 4
    result = run_config(cfg, tmp_path / "out")
    events = Trace.load_jsonl(tmp_path / "out" / "trace.jsonl").events
    gens = [e for e in events if e.kind == "generate"]
    scores = [e for e in events if e.kind == "score"]
    assert len(gens) == len(scores) == 4
    lanes = {e.worker for e in scores}
    assert lanes == ({"scorer-0"} if overlap else {"generator-0"})
    assert all(e.duration >= 1.0 for e in scores)
    inside = sum(1 for g in gens for s in scores if s.t0 < g.t0 < s.t1)
    if overlap:
        assert inside >= 1, (gens, scores)
        # the generator was busy once (its lane merged in): utilisation counts it once
        assert 0 < result.metrics[0]["utilisation"] <= 1
    else:
        assert inside == 0
