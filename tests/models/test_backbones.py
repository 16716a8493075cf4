"""Every tiny backbone end to end: sample with log-probs, re-score, train one LoRA step.

The adapter protocol of each backbone alone is tested in ``tests/models/test_protocol.py``.
"""

from __future__ import annotations

import pytest
import torch

from digen.algos.advantages import group_advantages
from digen.algos.loss import clipped_policy_loss, kl_to_reference
from digen.algos.rollout import SamplerSpec, sample_rollout, score_step
from digen.algos.timesteps import sde_window
from digen.models import MODEL_NAMES, get_adapter_class
from digen.models.lora import adapters_disabled, apply_lora, trainable_parameters
from digen.seeding import sample_generator

SDE_FOR = {"hunyuanvideo": "dance", "wan": "sde", "flux": "sde", "qwenimage": "cps", "sd3": "sde"}


@pytest.fixture(scope="module", params=MODEL_NAMES)
def adapter(request: pytest.FixtureRequest):
    # loading, shapes, decoding and LoRA of each adapter alone: tests/models/test_protocol.py
    return get_adapter_class(request.param).tiny()


def test_sample_train_and_determinism(adapter) -> None:
    torch.manual_seed(1234)  # only LoRA init draws from the global RNG
    sde_type = SDE_FOR[adapter.name]
    steps = 4
    window = sde_window(seed=0, step=0, num_inference_steps=steps, window_size=2, sde_type=sde_type)
    spec = SamplerSpec(
        sigmas=adapter.sigmas(steps), window=tuple(window), sde_type=sde_type, noise_level=0.7
    )
    prompts = ["a red cube on a table", "two cats"]
    n = 2
    cond = adapter.encode_prompts(prompts).repeat_interleave(n)
    gens = [sample_generator(0, 0, p, s) for p in range(len(prompts)) for s in range(n)]
    ro = sample_rollout(adapter, cond, gens, spec)
    b = len(prompts) * n
    assert ro.latents.shape == (b, 2, *adapter.latent_shape())
    assert ro.log_probs.shape == (b, 2) and torch.isfinite(ro.log_probs).all()

    # a sample does not depend on the batch it is made in: re-make sample (1, 1) alone
    alone = sample_rollout(adapter, cond.select([3]), [sample_generator(0, 0, 1, 1)], spec)
    torch.testing.assert_close(alone.final, ro.final[3:4], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(alone.log_probs, ro.log_probs[3:4], rtol=1e-4, atol=1e-4)
    again = sample_rollout(
        adapter, cond, [sample_generator(0, 0, p, s) for p in range(2) for s in range(n)], spec
    )
    assert torch.equal(again.final, ro.final)

    params = apply_lora(adapter.transformer, rank=4, alpha=4, targets=adapter.lora_targets)
    try:
        rewards = ro.final.flatten(1).mean(1).view(len(prompts), n)
        adv = group_advantages(rewards).flatten()
        total = torch.zeros(())
        for k, i in enumerate(window):
            out = score_step(adapter, ro.latents[:, k], ro.next_latents[:, k], i, cond, spec)
            # before any update the policy is the sampling policy: ratio == 1
            torch.testing.assert_close(out.log_prob, ro.log_probs[:, k], rtol=1e-4, atol=1e-4)
            loss, stats = clipped_policy_loss(out.log_prob, ro.log_probs[:, k], adv, 1e-4)
            with torch.no_grad(), adapters_disabled(adapter.transformer):
                ref = score_step(adapter, ro.latents[:, k], ro.next_latents[:, k], i, cond, spec)
            kl = kl_to_reference(out.mean, ref.mean, out.std).mean()
            assert float(kl) == pytest.approx(0.0, abs=1e-8)  # LoRA B starts at zero
            (loss + 0.01 * kl).backward()
            total = total + loss.detach()
        grads = [p.grad for p in params]
        assert all(g is not None and torch.isfinite(g).all() for g in grads)
        assert sum(float(g.abs().sum()) for g in grads) > 0
        assert {n for n, _ in trainable_parameters(adapter.transformer)} == {
            n for n, p in adapter.transformer.named_parameters() if "lora_" in n
        }
    finally:
        adapter.transformer.delete_adapters("default")


def test_cfg_in_sampling_and_in_log_prob_recomputation() -> None:
    """With CFG on, re-scoring a sampled step under the same weights gives ratio 1, and the
    guided velocity is what both the sampler and the trainer use."""
    adapter = get_adapter_class("sd3").tiny()
    spec = SamplerSpec(sigmas=adapter.sigmas(3), window=(0, 1), sde_type="sde", guidance_scale=4.0)
    cond = adapter.encode_prompts(["a red cube", "a blue ball"])
    neg = adapter.encode_prompts(["", ""])
    gens = [sample_generator(0, 0, p, 0) for p in range(2)]
    ro = sample_rollout(adapter, cond, gens, spec, neg)
    plain = sample_rollout(
        adapter,
        cond,
        [sample_generator(0, 0, p, 0) for p in range(2)],
        SamplerSpec(sigmas=spec.sigmas, window=(0, 1), guidance_scale=1.0),
    )
    assert not torch.allclose(ro.final, plain.final)  # guidance changed the samples
    for k, i in enumerate(spec.window):
        out = score_step(adapter, ro.latents[:, k], ro.next_latents[:, k], i, cond, spec, neg)
        torch.testing.assert_close(out.log_prob, ro.log_probs[:, k], rtol=1e-5, atol=1e-5)
        unguided = score_step(
            adapter,
            ro.latents[:, k],
            ro.next_latents[:, k],
            i,
            cond,
            SamplerSpec(sigmas=spec.sigmas, window=(0, 1)),
        )
        assert (unguided.log_prob - ro.log_probs[:, k]).abs().max() > 1e-4
