"""Plain helpers the test files share (``from helpers import ...``; ``tests/`` is on the path
through its ``conftest.py``). Plain functions rather than fixtures, so module-scoped fixtures
and helper functions can call them too."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from digen import DigenConfig, DigenRunner, RunResult, load_config
from digen.presets import preset


def tiny_config(
    model: str, algo: str, overrides: Iterable[str] = (), *, mode: str = "colocated"
) -> DigenConfig:
    """The preset of ``model`` x ``algo`` (tiny flavour) in ``mode``, with ``key=value``
    overrides on top: the config most tests start from."""
    return load_config(base=preset(model, algo, mode=mode), overrides=list(overrides))


def run_config(cfg: DigenConfig, out_dir: Path | None, **kwargs: Any) -> RunResult:
    """Run ``cfg`` to its end with :class:`DigenRunner` in ``out_dir``, without progress bars;
    ``kwargs`` go to the runner (``save_weights=False``, ``resume=True``, ...)."""
    return asyncio.run(DigenRunner(cfg, out_dir=out_dir, progress=False, **kwargs).run())


def short_tiny_run(out: Path, algo: str, steps: int = 2) -> list[dict[str, Any]]:
    """``digen run`` of the tiny FLUX with ``algo`` for ``steps`` steps of 4 sampling steps
    into ``out``, as a user types it; checks that it exits cleanly and says it finished, and
    returns its metrics rows."""
    from click.testing import CliRunner

    from cli.main import main

    args = ["run", "--model", "flux", "--algo", algo, "--steps", str(steps), "--out", str(out)]
    args += ["--quiet", "model.flavour=tiny", "rollout.num_inference_steps=4"]
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    summary = json.loads(res.output.strip().splitlines()[-1])
    assert summary["steps"] == steps and summary["interrupted"] is False
    return read_jsonl(out / "metrics.jsonl")


def accumulate_with_tsp_alike(
    policy: Any, item: Any, scale: float
) -> tuple[Any, Any, list[torch.Tensor]]:
    """Accumulate ``item``'s gradient on ``policy`` timestep by timestep (TSP 1) and with
    TSP 2, check that both give the same gradient, clear it, and return both stats and the
    gradient (one tensor per parameter)."""
    stats = policy.accumulate(item, scale, tsp_degree=1)
    got = [p.grad.clone() for p in policy.params]
    policy.optimizer.zero_grad(set_to_none=True)
    stats_tsp = policy.accumulate(item, scale, tsp_degree=2)
    for a, b in zip(got, [p.grad.clone() for p in policy.params], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    policy.optimizer.zero_grad(set_to_none=True)
    return stats, stats_tsp, got


def old_policy_model(policy: Any) -> torch.nn.Module:
    """A copy of ``policy``'s transformer holding its old-policy weights, to evaluate as a
    model of its own (as the published scripts keep one)."""
    import copy

    old_model = copy.deepcopy(policy.adapter.transformer)
    with torch.no_grad():
        named = dict(old_model.named_parameters())
        for (name, _), o in zip(policy.synced_parameters(), policy.old, strict=True):
            named[name].copy_(o)
    return old_model


def flat_runtime(plain: Mapping[str, Any]) -> dict[str, Any]:
    """A config as plain data (``config_to_dict``) with its ``runtime`` laid out as runs
    before the runtime sections wrote it: every key of that layout directly under
    ``runtime`` (a key added since, such as ``placement.shard_deal``, is left out: those runs
    had its default)."""
    from digen.config import FORMER_RUNTIME_KEYS

    runtime: dict[str, Any] = {}
    for key, value in plain["runtime"].items():
        if isinstance(value, dict):
            runtime.update({k: v for k, v in value.items() if k in FORMER_RUNTIME_KEYS})
        else:
            runtime[key] = value
    return {**plain, "runtime": runtime}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The rows of a JSON-lines file (``metrics.jsonl``, ``trace.jsonl``, ``trainer.log``)."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def free_port() -> int:
    """A TCP port free on loopback now (the OS picks it; nothing holds it afterwards)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


SMOOTH_REWARD = f"rewards=[{{name: '{Path(__file__).with_name('smooth_reward.py')}:brightness'}}]"
"""The override that scores with :func:`smooth_reward.brightness`: for runs compared to a
tolerance, whose samples may differ in their last bits."""


def assert_trained_alike(
    got: Mapping[str, torch.Tensor],
    want: Mapping[str, torch.Tensor],
    start: Mapping[str, torch.Tensor] | None = None,
    rel: float = 1e-2,
    scale: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Two runs that train alike but for rounding (sums in another order, samples that differ
    in their last bits) end with the same weights, as far as AdamW lets that be said.

    AdamW moves an element by about ``lr x sign(gradient)`` wherever the gradient stands well
    above its ``eps``, and where a gradient is within rounding of zero its sign, so that
    element's step, can differ: an elementwise tolerance only fits the machine it was tried
    on. What rounding cannot do is move the weights as a whole: the two runs' difference
    (an L2 norm over every weight) stays below ``rel`` of how far ``want`` moved from
    ``start`` (the saved weights; None: LoRA's B matrices, which start at 0), where a real
    mismatch (a micro-batch trained twice or not at all, another old policy) is a sizeable
    part of it. Seen: 5e-4 of the move under ``ATEN_CPU_CAPABILITY=avx2`` on 2 FSDP trainers
    against one. ``scale``: weights whose move from ``start`` sets the scale in place of
    ``want``'s (an average of trained weights, which moves less than they do but carries
    their rounding, is measured against the trained weights' move)."""
    assert got.keys() == want.keys()
    diff = sum(float((got[n].double() - w.double()).square().sum()) for n, w in want.items())
    ref = want if scale is None else scale
    if start is None:
        moved = sum(float(w.double().square().sum()) for n, w in ref.items() if "lora_B" in n)
    else:
        moved = sum(float((w.double() - start[n].double()).square().sum()) for n, w in ref.items())
    assert moved > 0, "the runs did not train: their equality would say nothing"
    assert diff**0.5 <= rel * moved**0.5, (
        f"the weights differ by {diff**0.5:.3g} (L2), more than {rel} of the "
        f"{moved**0.5:.3g} they moved"
    )


JOIN_SECRET = "a-join-secret-for-the-tests-only"
"""The join secret of the tests' runs and worlds that take joining generators."""


def digen_join(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``digen join ARGS`` run to its end, with ``env``'s join secret (``DIGEN_JOIN_SECRET``)
    in place of this environment's (none when ``env`` has none)."""
    base = {k: v for k, v in os.environ.items() if k != "DIGEN_JOIN_SECRET"}
    cmd = [sys.executable, "-m", "cli.main", "join", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, env={**base, **(env or {})}
    )


def said_one_line(done: subprocess.CompletedProcess, code: int, said: str) -> None:
    """``digen join`` (``done``) exited with ``code`` after one line on stderr, which starts
    with ``said``; past bad input (code 2) it says first, in a line of its own, that it is
    joining (so it is not silent while it waits)."""
    assert done.returncode == code, done.stderr[-3000:]
    lines = done.stderr.splitlines(keepends=True)
    if code != 2:
        assert lines and lines[0].startswith("joining the run at "), done.stderr
        lines = lines[1:]
    text = "".join(lines)
    assert text.startswith(said) and text.count("\n") == 1, done.stderr


def wider_sd3(directory: Path, *, heads: int, head_dim: int, layers: int) -> int:
    """The tiny SD3 pipeline, saved in ``directory`` with a wider transformer (``heads x
    head_dim`` wide, ``layers`` blocks, random init with seed 0): one large beside a
    process's own memory, so a copy of it shows in a measurement. Its size in bytes."""
    import shutil

    from diffusers import SD3Transformer2DModel

    from digen.models import get_adapter_class

    shutil.copytree(get_adapter_class("sd3").flavour_path("tiny"), directory)
    config = json.loads((directory / "transformer" / "config.json").read_text())
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(num_attention_heads=heads, attention_head_dim=head_dim, num_layers=layers)
    config.update(caption_projection_dim=heads * head_dim)
    shutil.rmtree(directory / "transformer")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = SD3Transformer2DModel(**config)
        model.save_pretrained(str(directory / "transformer"))
    return sum(p.numel() * p.element_size() for p in model.parameters())


def torchrun_nodes(
    run: list[str], *, nodes: int, per_node: int, env: Mapping[str, str], cwd: Path
) -> list[subprocess.Popen]:
    """Start ``nodes`` torchrun agents on this machine as the nodes of one launch, each
    starting ``per_node`` ranks of ``python <run>`` (stdout and stderr piped)."""
    port = free_port()
    env = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    agents = []
    for node in range(nodes):
        agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes)]
        agent += ["--node-rank", str(node), "--nproc-per-node", str(per_node)]
        agent += ["--max-restarts", "0", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        agents.append(
            subprocess.Popen(
                [*agent, *run],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=cwd,
            )
        )
    return agents
