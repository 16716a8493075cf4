"""DiffusionNFT against its published form, written out here from the official training
script's formulas (not its code): the sampler, the advantages, the loss and its gradient, the
old policy's schedule, and what generators sample with."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import accumulate_with_tsp_alike, old_policy_model, tiny_config

from digen.algos.nft import old_decay
from digen.algos.rollout import Rollout
from digen.algos.sde import dpm2_step, ode_step
from digen.algos.train_step import mini_batches, score_groups
from digen.registry.algos import get_algorithm
from digen.runtime.messages import SampleKey, TrainItem
from digen.runtime.worker.policy import Policy
from digen.seeding import nft_noise_generator


def _official_dpm2(v_fn, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    """The official sampler's ``dpm2``: DDIM (eta 0) at the first and the last step, the
    multistep second-order DPM-Solver++ update between, on x0 = x - sigma v; sigmas fp64."""
    s64 = sigmas.double()
    outputs: list[torch.Tensor] = []
    n = sigmas.numel() - 1
    for i in range(n):
        x0 = x - sigmas[i] * v_fn(x, sigmas[i])
        outputs.append(x0)
        if i == 0 or i == n - 1:
            t, s = s64[i + 1], s64[i]
            noise_pred = (x - (1 - s) * x0) / s
            x = (1 - t) * x0 + torch.sqrt(t**2 - 0.0) * noise_pred
        else:
            t, s0, s1 = s64[i + 1], s64[i], s64[i - 1]
            lam = [torch.log(1 - z) - torch.log(z) for z in (t, s0, s1)]
            h, h0 = lam[0] - lam[1], lam[1] - lam[2]
            d0, d1 = outputs[-1], (1.0 / (h0 / h)) * (outputs[-1] - outputs[-2])
            x = (t / s0) * x - ((1 - t) * (torch.exp(-h) - 1.0)) * d0
            x = x - 0.5 * ((1 - t) * (torch.exp(-h) - 1.0)) * d1
    return x


def _toy_velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return 0.8 * x - 0.3 + 0.5 * sigma * torch.tanh(x)


def _solve(step, x: torch.Tensor, sigmas: torch.Tensor) -> torch.Tensor:
    prev = None
    for i in range(sigmas.numel() - 1):
        v = _toy_velocity(x, sigmas[i])
        if step == "dpm2":
            x, prev = dpm2_step(v, x, sigmas, i, prev)
        else:
            x = ode_step(v, x, sigmas, i)
    return x


def test_dpm2_is_the_official_sampler_and_more_accurate_than_euler() -> None:
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(3, 16, generator=g)
    shift = 3.0  # SD3's: the sigmas the official script samples on
    base = torch.linspace(1.0, 1 / 10, 10)
    sigmas = torch.cat([shift * base / (1 + (shift - 1) * base), torch.zeros(1)])
    got = _solve("dpm2", x1, sigmas)
    torch.testing.assert_close(got, _official_dpm2(_toy_velocity, x1, sigmas), rtol=0, atol=1e-6)
    fine = torch.linspace(1.0, 0.0, 2001)
    exact = _solve("euler", x1, fine)
    err_dpm2 = float((got - exact).abs().max())
    err_euler = float((_solve("euler", x1, sigmas) - exact).abs().max())
    assert err_dpm2 < 0.5 * err_euler, (err_dpm2, err_euler)


def _official_advantages(prompts: list[str], rewards: np.ndarray) -> np.ndarray:
    """PerPromptStatTracker(global_std=True): per-prompt mean, the whole batch's population
    std + 1e-4."""
    adv = np.empty_like(rewards)
    for p in set(prompts):
        rows = np.array([q == p for q in prompts])
        adv[rows] = (rewards[rows] - rewards[rows].mean()) / (rewards.std() + 1e-4)
    return adv


def test_advantages_are_per_prompt_over_the_batch_std_and_clipped() -> None:
    cfg = tiny_config("sd3", "nft")
    rewards = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.2, 0.2, 0.2, 0.9], [0.0, 0.0, 0.0, 0.0]])
    adv, keep = score_groups(rewards, cfg.algo)
    prompts = [f"p{g}" for g in range(3) for _ in range(4)]
    want = _official_advantages(prompts, rewards.double().numpy().reshape(-1)).reshape(3, 4)
    assert keep.all()
    np.testing.assert_allclose(adv.numpy(), np.clip(want, -5, 5), rtol=1e-5)
    assert float(adv[1, 3]) > 1.0 and float(adv[2].abs().max()) == 0.0


@pytest.mark.parametrize(
    ("kind", "start", "rate", "most"),
    [(0, 0, 0.0, 0.0), (1, 0, 0.001, 0.5), (2, 75, 0.0075, 0.999)],
)
def test_old_decay_follows_the_published_schedules(kind, start, rate, most) -> None:
    def official(step: int) -> float:  # return_decay(step, decay_type)
        flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[kind]
        return 0.0 if step < flat else min((step - flat) * uprate, uphold)

    for step in (0, 1, 10, 74, 75, 76, 200, 499, 500, 501, 10_000):
        assert old_decay(step, start, rate, most) == pytest.approx(official(step), abs=1e-15)


def _policy(overrides: list[str]) -> Policy:
    cfg = tiny_config("sd3", "nft", ["rollout.num_inference_steps=4", *overrides])
    return Policy(cfg, trainable=True)


def _perturb_old(policy: Policy, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for (_, p), o in zip(policy.synced_parameters(), policy.old, strict=True):
            o.copy_(p + scale * torch.randn(p.shape, generator=g))


def test_the_loss_and_its_gradient_are_the_published_ones() -> None:
    beta, kl_coef = 0.3, 0.05
    policy = _policy([f"algo.params.beta={beta}", f"algo.kl_coef={kl_coef}"])
    cfg, algorithm = policy.cfg, get_algorithm("nft")
    _perturb_old(policy)  # old != trained, or v+ = v- = v and beta would not show
    with torch.no_grad():  # LoRA B starts at zero: move it, or the reference equals the policy
        for name, p in policy.synced_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    prompt = "a red square"
    keys = [SampleKey(step=2, prompt=1, sample=j) for j in range(4)]
    shape = policy.adapter.initial_latents([torch.Generator().manual_seed(0)]).shape[1:]
    x0 = torch.randn((4, *shape), generator=torch.Generator().manual_seed(1))
    empty = x0.new_zeros((4, 0, *shape))
    rollout = Rollout.from_pairs(empty, empty, x0.new_zeros((4, 0)), final=x0)
    advantages = torch.tensor([2.0, -1.0, 7.5, -0.5])  # 7.5 is clipped at 5 (r = 1)
    item = TrainItem(keys=keys, prompts=[prompt] * 4, rollout=rollout, advantages=advantages)

    # what digen accumulates, timestep by timestep and with TSP 2: the same gradient
    positions = [algorithm.trained_positions(cfg, 2, k.prompt, k.sample) for k in keys]
    n_terms = sum(len(p) for p in positions)
    assert all(len(p) == 3 for p in positions)  # int(4 * 0.99) of the 4 sampler steps
    assert len({tuple(p) for p in positions}) > 1  # each sample its own subset
    stats, stats_tsp, got = accumulate_with_tsp_alike(policy, item, 1.0 / n_terms)

    # the published loss, written out: models evaluated as the official script does
    old_model = old_policy_model(policy)
    live = policy.adapter.transformer
    cond = policy.conditioning([prompt])
    sigmas = policy.sigmas
    total = 0.0
    for b, k in enumerate(keys):
        for i in positions[b]:
            t = sigmas[i]
            noise = torch.randn(shape, generator=nft_noise_generator(cfg.seed, 2, 1, k.sample, i))
            xt = ((1 - t) * x0[b] + t * noise)[None]
            sig = t.reshape(1)
            with torch.no_grad():
                policy.adapter.pipe.transformer = old_model
                v_old = policy.adapter.predict_velocity(xt, sig, cond, None, 1.0).float()
                policy.adapter.pipe.transformer = live
                with policy._reference():
                    v_ref = policy.adapter.predict_velocity(xt, sig, cond, None, 1.0).float()
            v = policy.adapter.predict_velocity(xt, sig, cond, None, 1.0).float()
            a = advantages[b : b + 1].clamp(-5, 5)
            r = torch.clamp((a / 5.0) / 2.0 + 0.5, 0, 1)
            pos_x0 = xt - t * (beta * v + (1 - beta) * v_old)
            neg_x0 = xt - t * ((1.0 + beta) * v_old - beta * v)
            dims = tuple(range(1, xt.ndim))
            with torch.no_grad():
                wp = (pos_x0.double() - x0[b : b + 1].double()).abs().mean(dims, keepdim=True)
                wn = (neg_x0.double() - x0[b : b + 1].double()).abs().mean(dims, keepdim=True)
            lp = ((pos_x0 - x0[b : b + 1]) ** 2 / wp.clip(min=1e-5)).mean(dims)
            ln = ((neg_x0 - x0[b : b + 1]) ** 2 / wn.clip(min=1e-5)).mean(dims)
            policy_loss = ((r * lp / beta + (1.0 - r) * ln / beta) * 5.0).mean()
            kl = ((v - v_ref) ** 2).mean(dims).mean()
            total = total + (policy_loss + kl_coef * kl) / n_terms
    total.backward()
    want = [p.grad.clone() for p in policy.params]
    assert stats.terms == n_terms and stats_tsp.terms == n_terms
    assert stats.loss / stats.terms == pytest.approx(float(total), rel=1e-5)
    assert stats.kl > 0 and stats.approx_kl > 0
    biggest = max(float(w.abs().max()) for w in want)
    assert biggest > 1e-3  # a gradient that could be wrong
    for a, w in zip(got, want, strict=True):
        torch.testing.assert_close(a, w, rtol=1e-4, atol=1e-6 * biggest)


def test_the_old_policy_moves_after_each_step_and_is_what_samples() -> None:
    decay = ["algo.params.decay_rate=0.3", "algo.params.decay_max=0.5"]
    # one optimizer step a step; evaluation samples with the old policy too, without eval.ema
    policy = _policy([*decay, "train.mini_batch_size=null", "eval.ema=0"])
    _perturb_old(policy)
    old0 = [o.clone() for o in policy.old]
    theta = [p.detach().clone() for _, p in policy.synced_parameters()]
    keys = [SampleKey(0, 0, j) for j in range(2)]
    made_old = policy.generate(keys, ["a blue circle"] * 2)
    assert made_old.rollout.latents.shape[1] == 0 and made_old.rollout.log_probs.shape[1] == 0
    kept = made_old.rollout.for_training(final=True)
    assert kept.final is not None and kept.nbytes == made_old.rollout.final.nbytes

    # a sampling-only copy holding the old weights as its own makes the same images
    sampler = Policy(policy.cfg, trainable=False)
    with torch.no_grad():
        for (_, p), o in zip(sampler.synced_parameters(), old0, strict=True):
            p.copy_(o)
    assert torch.equal(sampler.generate(keys, ["a blue circle"] * 2).pixels, made_old.pixels)
    assert [o for _, o in policy.sampling_parameters()] == policy.old
    ev = policy.evaluate([(0, 0)], ["a blue circle"])
    assert torch.equal(ev, sampler.evaluate([(0, 0)], ["a blue circle"]))
    for (_, p), t in zip(policy.synced_parameters(), theta, strict=True):
        assert torch.equal(p, t)  # the trained weights are back in place

    policy.finish_step()  # version 1 after 1 optimizer step: d = 0.3
    for o, o0, t in zip(policy.old, old0, theta, strict=True):
        torch.testing.assert_close(o, 0.3 * o0 + 0.7 * t, rtol=0, atol=1e-7)
    policy.version = 2
    before = [o.clone() for o in policy.old]
    policy.finish_step()  # version 3: d = min(0.9, 0.5)
    for o, b, t in zip(policy.old, before, theta, strict=True):
        torch.testing.assert_close(o, 0.5 * b + 0.5 * t, rtol=0, atol=1e-7)
    assert not math.isclose(float(policy.old[0].sum()), float(old0[0].sum()))


def test_a_checkpoint_keeps_the_old_policy(tmp_path: Path) -> None:
    policy = _policy([])
    _perturb_old(policy, 0.2)
    policy.write_checkpoint(tmp_path / "ckpt", lead=True)
    again = _policy([])
    assert not torch.equal(again.old[0], policy.old[0])
    again.load_checkpoint(tmp_path / "ckpt", version=1)
    for a, b in zip(again.old, policy.old, strict=True):
        assert torch.equal(a, b)
    other = Policy(tiny_config("sd3", "flowgrpo", ["rollout.num_inference_steps=4"]))
    other.write_checkpoint(tmp_path / "grpo", lead=True)
    with pytest.raises(ValueError, match="holds no old policy"):
        again.load_checkpoint(tmp_path / "grpo", version=1)


def test_evaluation_samples_with_the_published_moving_average(tmp_path: Path) -> None:
    """The official ``EMAModuleWrapper(decay=0.9)`` stepped after every optimizer step ``s``
    (1, 2, ...): ``ema += (1 - min((1 + s) / (10 + s), 0.9)) (theta - ema)``, from theta."""
    policy = _policy([])  # the preset's eval.ema = 0.9
    assert policy.cfg.eval.ema == 0.9
    theta0 = [p.detach().clone() for _, p in policy.synced_parameters()]
    want = [t.clone() for t in theta0]
    g = torch.Generator().manual_seed(3)
    for s in (1, 2, 3):
        for _, p in policy.synced_parameters():  # stand-in gradients: any update will do
            p.grad = torch.randn(p.shape, generator=g)
        policy.optimizer_step()
        d = min((1 + s) / (10 + s), 0.9)
        for w, (_, p) in zip(want, policy.synced_parameters(), strict=True):
            w.add_((1 - d) * (p.detach() - w))
    assert policy.optimizer_steps == 3
    for e, w in zip(policy.ema, want, strict=True):
        torch.testing.assert_close(e, w, rtol=0, atol=1e-7)
    theta = [p.detach().clone() for _, p in policy.synced_parameters()]
    assert max(float((e - t).abs().max()) for e, t in zip(policy.ema, theta)) > 1e-4

    # evaluation samples with the average; a sampling-only copy holding it agrees
    sampler = Policy(policy.cfg, trainable=False)
    sampler.set_eval_weights(policy.ema_state())
    ev = policy.evaluate([(0, 0)], ["a blue circle"])
    assert torch.equal(ev, sampler.evaluate([(0, 0)], ["a blue circle"]))
    sampler.set_eval_weights(None)  # let go: the copy evaluates its own weights again
    assert not torch.equal(ev, sampler.evaluate([(0, 0)], ["a blue circle"]))
    for (_, p), t in zip(policy.synced_parameters(), theta, strict=True):
        assert torch.equal(p, t)  # the trained weights are back in place

    # a checkpoint keeps it, and a resumed copy counts the optimizer steps on
    policy.write_checkpoint(tmp_path / "ckpt", lead=True)
    again = _policy([])
    again.load_checkpoint(tmp_path / "ckpt", version=3)
    assert again.optimizer_steps == 3 * len(mini_batches(again.cfg))
    for a, b in zip(again.ema, policy.ema, strict=True):
        assert torch.equal(a, b)
    plain = _policy(["eval.ema=0"])
    plain.write_checkpoint(tmp_path / "plain", lead=True)
    with pytest.raises(ValueError, match="holds no moving average"):
        again.load_checkpoint(tmp_path / "plain", version=1)


def test_a_stale_micro_batch_trains_against_the_old_policy_that_sampled_it() -> None:
    """TCSS: a micro-batch sampled at version v - 1 reaches a trainer at version v. Its loss
    reads the old policy of version v - 1, which sampled it (as on-policy NFT reads the one
    that sampled), kept by the trainer for ``runtime.schedule.max_staleness`` versions."""
    over = ["rollout.num_inference_steps=4", "algo.params.decay_rate=0.3", "eval.ema=0"]
    over += [
        "runtime.schedule.max_staleness=1",
        "runtime.schedule.staleness_ratio=0.5",
        "runtime.generators=2",
    ]
    cfg = tiny_config("sd3", "nft", over, mode="disaggregated")
    policy = Policy(cfg, trainable=True)
    _perturb_old(policy)
    keys = [SampleKey(0, 0, j) for j in range(2)]
    made = policy.generate(keys, ["a blue circle"] * 2)  # version 0, by the old policy of 0
    old0 = [o.clone() for o in policy.old]
    with torch.no_grad():  # a train step moved theta; the old policy follows a part of it
        for name, p in policy.synced_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    assert policy.finish_step() == 1
    assert max(float((o - o0).abs().max()) for o, o0 in zip(policy.old, old0)) > 1e-3

    def loss(version: int | None) -> float:
        item = TrainItem(
            keys,
            ["a blue circle"] * 2,
            made.rollout.for_training(final=True),
            torch.tensor([1.0, -1.0]),
            version=version,
        )
        return policy.accumulate(item, 1.0).loss

    stale, current = loss(0), loss(None)
    assert loss(1) == current  # sampled at the trainer's own version: the current old policy
    now = [o.clone() for o in policy.old]
    with torch.no_grad():  # the same loss with the old policy of version 0 put in place
        for o, o0 in zip(policy.old, old0, strict=True):
            o.copy_(o0)
    assert loss(None) == stale != current
    with torch.no_grad():
        for o, n in zip(policy.old, now, strict=True):
            o.copy_(n)
    policy.finish_step()  # version 2: with a staleness of 1, version 0's old policy goes
    assert policy.old_at(1) is not None
    with pytest.raises(RuntimeError, match="sampled at version 0"):
        policy.old_at(0)
