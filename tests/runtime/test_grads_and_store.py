"""Gradient sums in a fixed order, the workers' data store, and sample-grid thumbnails."""

from __future__ import annotations

import threading

import pytest
import torch

from digen.algos.rollout import Rollout
from digen.runtime.messages import thumbnails
from digen.runtime.worker.grads import GradAccumulator
from digen.runtime.worker.store import Store


def _model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(16, 8)


def _backward(model: torch.nn.Linear, mb: int) -> None:
    """A micro-batch's loss: different data and scale for each, so sums round visibly."""
    g = torch.Generator().manual_seed(100 + mb)
    x = torch.randn(4, 16, generator=g) * (10.0 ** (mb % 4 - 2))
    (model(x).sin().sum() * (1.0 + mb / 3)).backward()


def _ordered(order: list[int], owned: set[int] | None = None) -> GradAccumulator:
    model = _model()
    acc = GradAccumulator(list(model.parameters()), ordered=True)
    for mb in order:
        if owned is None or mb in owned:
            with acc.micro_batch(mb):
                _backward(model, mb)
    return acc


def _grads(acc: GradAccumulator) -> list[torch.Tensor]:
    return [p.grad.clone() for p in acc.params]


def test_ordered_sum_is_the_same_bits_in_any_arrival_order() -> None:
    a = _ordered([3, 0, 5, 1, 4, 2])
    b = _ordered([0, 1, 2, 3, 4, 5])
    a.reduce(6)
    b.reduce(6)
    # the reference: each micro-batch's gradient alone, added in micro-batch order
    model = _model()
    parts = []
    for mb in range(6):
        model.zero_grad(set_to_none=True)
        _backward(model, mb)
        parts.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    total = torch.zeros_like(parts[0])
    for part in parts:
        total += part
    flat = torch.cat([g.reshape(-1) for g in _grads(a)])
    assert torch.equal(flat, total)
    assert all(torch.equal(x, y) for x, y in zip(_grads(a), _grads(b)))
    assert a.held_bytes == 0  # the copies are gone after the step


class _TwoRanks:
    """An in-process two-member group: allreduce sums both members' buffers."""

    def __init__(self) -> None:
        self.barrier = threading.Barrier(2)
        self.buffers: dict[int, torch.Tensor] = {}

    def member(self, rank: int):
        group = self

        class _Work:
            def wait(self) -> None: ...

        class _Member:
            def allreduce(self, tensors: list[torch.Tensor]) -> _Work:
                group.buffers[rank] = tensors[0]
                group.barrier.wait()
                total = group.buffers[0] + group.buffers[1]
                group.barrier.wait()
                tensors[0].copy_(total)
                return _Work()

        return _Member()


def test_two_trainers_end_with_the_bits_of_one_whatever_the_split() -> None:
    one = _ordered(list(range(6)))
    one.reduce(6)
    for owned0 in ({0, 2, 5}, {1, 2, 3, 4}, {0}):
        group = _TwoRanks()
        accs = [
            _ordered([4, 1, 0, 3, 5, 2], owned0),
            _ordered([2, 5, 3, 0, 1, 4], set(range(6)) - owned0),
        ]
        threads = [
            threading.Thread(target=acc.reduce, args=(6, group.member(r)))
            for r, acc in enumerate(accs)
        ]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for acc in accs:
            assert all(torch.equal(x, y) for x, y in zip(_grads(acc), _grads(one)))


def test_arrival_order_sums_in_place_and_ordered_mode_checks_its_use() -> None:
    model = _model()
    acc = GradAccumulator(list(model.parameters()), ordered=False)
    for mb in (2, 0):
        with acc.micro_batch(mb):
            _backward(model, mb)
    acc.reduce(2)  # one worker: .grad already holds the sum
    ref = _model()
    _backward(ref, 2)
    _backward(ref, 0)
    assert all(torch.equal(p.grad, q.grad) for p, q in zip(model.parameters(), ref.parameters()))

    ordered = _ordered([0])
    with pytest.raises(ValueError, match="already trained"), ordered.micro_batch(0):
        pass
    model = _model()
    _backward(model, 1)  # a stray .grad: the micro-batch would absorb it
    stray = GradAccumulator(list(model.parameters()), ordered=True)
    with pytest.raises(RuntimeError, match="cleared"), stray.micro_batch(1):
        pass


def _rollout(b: int = 2) -> Rollout:
    x = torch.arange(b * 3 * 4, dtype=torch.float32).view(b, 3, 4)
    return Rollout.from_pairs(x, x + 1, torch.ones(b, 3), final=torch.zeros(b, 4))


def test_store_hands_out_each_part_once_and_is_bounded() -> None:
    store = Store(capacity=2)
    pixels = torch.zeros(2, 1, 8, 8, 3, dtype=torch.uint8)
    store.put((0, 0), _rollout().for_training(), pixels)  # what a generator keeps
    store.put((0, 1), _rollout(), pixels)
    with pytest.raises(RuntimeError, match="runtime.schedule.max_inflight"):
        store.put((0, 2), _rollout(), pixels)
    assert store.statistics()["held"] == 2
    assert torch.equal(store.take_pixels((0, 0)), pixels)
    with pytest.raises(KeyError, match="already taken"):
        store.take_pixels((0, 0))
    part = store.take_rollout((0, 0), [1])
    assert part.final is None and torch.equal(part.latents, _rollout().latents[1:])
    assert store.statistics()["held"] == 1  # both parts taken: forgotten
    store.release((0, 1))
    assert store.statistics() == {"held": 0, "bytes": 0}
    with pytest.raises(RuntimeError, match="serves no weights"):
        store.weights(0)
    asked: list[tuple] = []
    store.serve_weights(lambda v, b, wire: asked.append((v, b, wire)) or {"w": torch.ones(2)})
    assert torch.equal(store.weights(3, 1, "cpu")["w"], torch.ones(2))
    assert asked == [(3, 1, "cpu")]


def test_sharded_trainers_each_take_their_rows_of_one_rollout() -> None:
    """Two sharded trainers take rows 0 and 1 of one micro-batch: the rollout stays until
    both have taken theirs, then it is gone."""
    store = Store()
    store.put((0, 0), _rollout(), None)  # a sharded trainer's own copy keeps no pixels
    first = store.take_training((0, 0), [0], takers=2)[0]
    assert store.statistics()["held"] == 1
    second = store.take_training((0, 0), [1], takers=2)[0]
    assert torch.equal(first.latents, _rollout().latents[:1])
    assert torch.equal(second.latents, _rollout().latents[1:])
    assert store.statistics() == {"held": 0, "bytes": 0}


def test_weights_travel_in_bounded_buckets() -> None:
    from digen.runtime.worker.base import weight_buckets

    params = [torch.zeros(n) for n in (3, 4, 10, 2, 2)]
    assert weight_buckets(params, 7) == [[0, 1], [2], [3, 4]]  # 10 > 7 gets its own
    assert weight_buckets(params, 100) == [[0, 1, 2, 3, 4]]
    assert weight_buckets(params, 1) == [[0], [1], [2], [3], [4]]


def test_thumbnails_are_small_whatever_the_image_size() -> None:
    video = torch.randint(0, 256, (2, 9, 256, 192, 3), dtype=torch.uint8)
    small = thumbnails(video)
    assert small.shape == (2, 3, 64, 48, 3) and small.dtype == torch.uint8
    # area downscaling: each thumbnail pixel is the mean of a 4 x 4 block of its frame
    block = video[1, 4, 8:12, 4:8, 0].float().mean()
    assert abs(int(small[1, 1, 2, 1, 0]) - float(block)) <= 0.5
    tiny = torch.randint(0, 256, (1, 1, 32, 32, 3), dtype=torch.uint8)
    assert torch.equal(thumbnails(tiny), tiny)  # already small: unchanged


def test_trainer_0_serves_a_copy_of_its_weights_not_the_live_parameters() -> None:
    """What a generator pulls cannot change while in flight: the served bucket shares no
    memory with the parameters an optimizer step writes (on a GPU the reply is also
    synchronised before it leaves: ``_finished``)."""
    from digen.config import config_to_dict, load_config
    from digen.runtime.worker.store import fetch_weights
    from digen.runtime.worker.trainer import TrainerActor

    cfg = load_config(overrides=["model.name=sd3", "runtime.mode=disaggregated"])
    trainer = TrainerActor(config_to_dict(cfg), 0, 1, 0)
    try:
        served = fetch_weights(0, 0, None)
        live = dict(trainer._synced())
        assert served and served.keys() <= live.keys()
        for name, tensor in served.items():
            assert torch.equal(tensor, live[name])
            assert tensor.untyped_storage().data_ptr() != live[name].untyped_storage().data_ptr()
    finally:
        trainer.store.clear()


def test_a_bf16_full_fine_tune_keeps_its_old_policy_and_average_in_fp32() -> None:
    """The old policy (DiffusionNFT) and the moving average move by ``(1 - d)`` of each
    small step: kept in bf16 beside bf16 weights, a step below half a unit of the copy's
    last place would round away and the copy would never move. They are kept in fp32 and do
    move, by exactly ``(1 - d)`` of what the weights moved."""
    from helpers import tiny_config

    from digen.runtime.worker.policy import Policy

    over = ["model.dtype=bfloat16", "train.lora_rank=0", "eval.ema=0.9", "train.lr=1e-5"]
    over += ["algo.kl_coef=0.0", "train.weight_decay=0.0", "train.max_grad_norm=0"]
    policy = Policy(tiny_config("flux", "nft", over), trainable=True)
    assert policy.old is not None and policy.ema is not None
    assert {t.dtype for t in policy.old + policy.ema} == {torch.float32}
    before = [p.detach().float().clone() for _, p in policy.synced_parameters()]
    assert {p.dtype for _, p in policy.synced_parameters()} == {torch.bfloat16}
    for p in policy.params:
        p.grad = torch.full_like(p, 1e-3)
    policy.optimizer_step()  # Adam's first step: every weight moves by lr = 1e-5
    d = min(2 / 11, 0.9)  # the average's decay after one optimizer step
    after = [p.detach().float() for _, p in policy.synced_parameters()]
    moved = [a - b for a, b in zip(after, before, strict=True)]
    assert max(float(m.abs().max()) for m in moved) > 0  # bf16 weights of small magnitude
    for e, b, m in zip(policy.ema, before, moved, strict=True):
        # e = b + (1 - d) (after - b) in fp32, what a bf16 copy would round away: off by
        # the rounding of that sum (half a unit of |b|'s last place) and of the subtraction
        atol = torch.finfo(torch.float32).eps * float(b.abs().max())
        torch.testing.assert_close(e - b, (1 - d) * m, rtol=1e-6, atol=atol)
    policy.finish_step()  # the old policy moves with its own decay (0 at the first steps)
    assert any(float((o - b).abs().max()) > 0 for o, b in zip(policy.old, before, strict=True))
    # it stands in for the bf16 weights rounded as they are, in one buffer every swap reuses
    stood = []
    for _ in range(2):
        with policy.sampling_weights():
            named = policy.synced_parameters()
            assert all(torch.equal(p, o.to(p.dtype)) for (_, p), o in zip(named, policy.old))
            stood.append([p.data_ptr() for _, p in named])
    assert stood[0] == stood[1]
    named = policy.synced_parameters()  # and the trained weights are back
    assert all(torch.equal(p.detach().float(), a) for (_, p), a in zip(named, after, strict=True))


def test_a_pull_never_reads_an_old_policy_half_moved() -> None:
    """Trainer 0 serves pulls on RPC threads beside its own step: a pull of the new version
    that arrives while the step moves the old policy (DiffusionNFT) waits for the step, and
    gets the old policy whole. The step is held half-way (its first tensor moved, not the
    second) while the pull is asked for; it is then let go."""
    from helpers import tiny_config

    from digen.config import config_to_dict
    from digen.runtime.messages import StepRequest
    from digen.runtime.worker.store import fetch_weights
    from digen.runtime.worker.trainer import TrainerActor

    cfg = tiny_config(
        "flux", "nft", ["runtime.transport.sync_bucket_mb=1000"], mode="disaggregated"
    )
    trainer = TrainerActor(config_to_dict(cfg), 0, 1, 0)
    halfway, go_on = threading.Event(), threading.Event()
    names = [n for n, _ in trainer._synced()][:2]

    def held_update(cfg, old, live, version) -> None:
        with torch.no_grad():
            old[0].add_(1.0)
            halfway.set()
            assert go_on.wait(timeout=300)
            old[1].add_(1.0)

    trainer.policy.algorithm = _Patched(trainer.policy.algorithm, held_update)
    before = {n: t.clone() for n, t in fetch_weights(0, 0, None).items()}
    pulled: dict = {}
    try:
        step = threading.Thread(target=trainer.step, args=(StepRequest(range(0)),))
        step.start()
        assert halfway.wait(timeout=300)
        pull = threading.Thread(target=lambda: pulled.update(fetch_weights(1, 0, None)))
        pull.start()
        pull.join(timeout=1.0)  # a pull that did not wait would be done by now, half-moved
        go_on.set()
        step.join(timeout=300)
        pull.join(timeout=300)
        assert not step.is_alive() and not pull.is_alive()
    finally:
        go_on.set()
        trainer.store.clear()
    for name in names:  # both moved: the whole old policy of version 1
        torch.testing.assert_close(pulled[name], before[name] + 1.0, rtol=0, atol=1e-6)


class _Patched:
    """An algorithm with its ``update_old`` replaced (the rest as it is)."""

    def __init__(self, algorithm, update_old) -> None:
        self._algorithm, self.update_old = algorithm, update_old

    def __getattr__(self, name: str):
        return getattr(self._algorithm, name)


@pytest.mark.parametrize("algo", ["flowgrpo", "nft"])
def test_weights_travel_in_the_dtype_of_the_parameters_they_land_in(algo: str) -> None:
    """One dtype for both pools, whether set for one pool or for the model: a bf16 full
    fine-tune's weights travel in bf16 (NFT's old policy, kept in fp32 beside them,
    included: rounded as the generators would round it); fp32 LoRA weights on a bf16 base
    travel in fp32; pools of two dtypes get fp32, which each side casts to its own."""
    from helpers import tiny_config

    from digen.config import config_to_dict
    from digen.runtime.worker.store import fetch_weights
    from digen.runtime.worker.trainer import TrainerActor

    def served(*over: str) -> set[torch.dtype]:
        cfg = tiny_config("flux", algo, ["model.dtype=bfloat16", *over], mode="disaggregated")
        trainer = TrainerActor(config_to_dict(cfg), 0, 1, 0)
        try:
            return {t.dtype for t in fetch_weights(0, 0, None).values()}
        finally:
            trainer.store.clear()

    full = ["train.lora_rank=0", "runtime.transport.sync_bucket_mb=1000"]
    assert served(*full, "runtime.placement.trainer_dtype=bfloat16") == {torch.bfloat16}
    assert served(*full) == {torch.bfloat16}
    assert served("train.lora_dtype=float32") == {torch.float32}
    assert served(*full, "runtime.placement.generator_dtype=float32") == {torch.float32}
