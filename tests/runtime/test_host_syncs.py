"""The hot loops never wait on the device but where they must.

A GPU runs ahead of the host only while the host does not ask it for a value: each
``.item()``, ``float()``, ``bool()``, ``int()``, ``.tolist()`` or ``.cpu()`` of a tensor on
the device waits for every kernel queued before it. Here the policy's weights, latents and
conditioning are moved to the ``meta`` device, which stands for a GPU: what is computed on
it has shapes but no values, and a mode counts every such conversion of a meta tensor (and
answers it with ones, so the code goes on). The host's own data (sigmas, step indices, the
seeded CPU noise) stays on the CPU and is not counted: reading it costs the device nothing.
"""

from __future__ import annotations

import collections
import traceback
from collections.abc import Iterator

import pytest
import torch
from helpers import tiny_config
from torch.overrides import TorchFunctionMode

from digen.models.base import PromptEmbeds
from digen.runtime.messages import SampleKey, TrainItem

_READS = {"item", "__float__", "__bool__", "__int__", "__index__", "tolist", "cpu", "numpy"}


class DeviceReads(TorchFunctionMode):
    """Counts the conversions of meta tensors to host values, and the copies of host tensors
    to meta (a copy from the host waits for the device too), by the line that asked."""

    def __init__(self) -> None:
        super().__init__()
        self.where: collections.Counter[str] = collections.Counter()
        self.copies: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        t = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if t is not None and name in _READS and t.device.type == "meta":
            self.where[_caller(name)] += 1
            return getattr(torch.ones(t.shape, dtype=t.dtype), name)()
        out = func(*args, **(kwargs or {}))
        waits = name == "to" and not (kwargs or {}).get("non_blocking", False)
        copied = isinstance(out, torch.Tensor) and out.device.type == "meta"
        if t is not None and waits and t.device.type == "cpu" and copied:
            self.copies[_caller(name)] += 1
        return out

    def total(self) -> int:
        return sum(self.where.values())


def _caller(name: str) -> str:
    frame = traceback.extract_stack()[-3]
    return f"{name} at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"


def _on_meta(policy) -> None:
    """The policy's device data on ``meta`` (its trained weights, the old policy and the
    average where kept, the prompts' conditioning)."""
    policy.adapter.transformer.to("meta")
    for kept in (policy.old, policy.ema):
        if kept is not None:
            kept[:] = [t.to("meta") for t in kept]
    for prompt, e in list(policy._cond_cache.items()):
        policy._cond_cache[prompt] = PromptEmbeds({k: v.to("meta") for k, v in e.tensors.items()})


CASES = {
    "flowgrpo": [],
    "flowgrpo-kl-guard": ["algo.kl_coef=0.01", "algo.ratio_norm=true"],
    "dancegrpo": [],
    "mixgrpo": [],
    "nft": [],
    "awm": [],
    "dgpo": ["rollout.n=2", "train.micro_batch_size=2"],  # the two samples are a whole group
}


@pytest.fixture(params=list(CASES))
def case(request) -> Iterator[tuple[str, list[str]]]:
    yield request.param.split("-")[0], CASES[request.param]


def _reads(algo: str, over: list[str], steps: int) -> tuple[DeviceReads, DeviceReads, int]:
    """The reads of one ``generate`` of ``steps`` denoising steps and of one ``accumulate``
    of its samples, and the loss chunks that made."""
    from digen.runtime.worker.policy import Policy

    over = [f"rollout.num_inference_steps={steps}", *over]
    policy = Policy(tiny_config("flux", algo, over), trainable=True)
    keys = [SampleKey(0, 0, j) for j in range(2)]
    prompts = ["a red cube"] * len(keys)
    policy.conditioning(prompts[:1])  # encoded on the host: the text encoders stay there
    _on_meta(policy)
    spec = policy.sampler_spec(0)
    from digen.algos.rollout import sample_rollout
    from digen.seeding import sample_generator

    gens = [sample_generator(0, 0, 0, j) for j in range(2)]
    with DeviceReads() as sampling:
        rollout = sample_rollout(policy.adapter, policy.conditioning(prompts), gens, spec)
    final = policy.algorithm.trains_on == "final"
    advantages = torch.tensor([1.0, -1.0], device="meta")
    item = TrainItem(keys, prompts, rollout.for_training(final=final), advantages)
    chunks = len(policy.algorithm.trained_positions(policy.cfg, 0, 0, 0))
    with DeviceReads() as training:
        policy.accumulate(item, loss_scale=1.0)
    return sampling, training, chunks


def test_a_denoising_step_never_waits_and_a_loss_chunk_waits_once(case) -> None:
    """Sampling: no read at all, whatever the steps (which steps have no noise is the
    host's sigmas' to say), and what the host sends goes without waiting (the initial
    latents, every noisy step's noise, drawn before the first step, each step's sigmas) but
    for the model's position table, made once. Training: one read per loss chunk (its
    loss, statistics and finiteness in one transfer)."""
    algo, over = case
    sampling, training, chunks = _reads(algo, over, steps=4)
    longer, _, _ = _reads(algo, over, steps=6)
    assert chunks > 0
    assert sampling.total() == 0 and longer.total() == 0, sampling.where
    assert sum(longer.copies.values()) == sum(sampling.copies.values()) <= 1, longer.copies
    assert training.total() <= chunks, training.where


class _OnGpu(torch.Tensor):
    """A CPU tensor that says it is on ``cuda:<index>`` (what a reply's walk reads)."""

    index = 0

    @property
    def is_cuda(self) -> bool:
        return True

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)


def _on_gpu(index: int) -> torch.Tensor:
    t = torch.Tensor._make_subclass(_OnGpu, torch.zeros(2))
    t.index = index
    return t


def test_a_reply_waits_for_its_own_stream_not_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reply holding GPU tensors waits for an event recorded on the current stream of each
    device it holds tensors of (the stream that made them), never for a whole device; a
    reply without any waits for nothing."""
    from digen.runtime.transport.actors import _remote

    waits: list[str] = []

    class Event:
        def record(self, stream: str) -> None:
            self.stream = stream

        def synchronize(self) -> None:
            waits.append(self.stream)

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append("device-wide"))
    reply = {"a": _on_gpu(0), "b": [_on_gpu(0), (_on_gpu(1), torch.ones(1))], "c": 3}
    assert _remote._finished(reply) is reply
    assert sorted(waits) == ["stream of cuda:0", "stream of cuda:1"]
    waits.clear()
    _remote._finished({"a": torch.ones(2), "b": [1, 2]})  # host tensors only
    assert waits == []
