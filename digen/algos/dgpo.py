"""DGPO: Direct Group Preference Optimization, DPO between the better and worse halves of a group.

Published form (Luo, Hu and Tang 2025, "Reinforcing Diffusion Models by Direct Group
Preference Optimization", arXiv 2510.08425, and its official code, Luo-Yihong/DGPO:
``scripts/train_sd3_dgpo.py`` run with ``config/dgpo.py`` ``geneval_sd3_4gpu`` over
``config/base.py``). A group's samples split by their advantage into a positive set ``G+``
and a negative set ``G-``, and the model learns the group-level preference by maximum
likelihood, ``log sigma(R(G+) - R(G-))``, with each set's reward the advantage-weighted
DPO implicit reward ``beta log pi / pi_ref`` and the log-likelihoods read through the
denoising (flow-matching) loss at a random timestep: no SDE, no trajectory, only each
sample's clean latent ``x0``, sampled with a deterministic ODE solver (DPM-Solver++, 10 steps,
CFG 4.5). At a trained timestep ``t`` the group's samples share one noise ``eps``
(``x_t = (1 - t) x0 + t eps``), and with ``d = mean((v - (eps - x0))^2)`` under the trained
weights and ``d_ref`` under the reference (the base weights, LoRA off), the group's objective
is ``L = -log sigma(-S)`` with

    S = beta_dpo / n sum_i A_i (d_i - d_ref_i)

over the group's ``n`` samples (``A`` per-prompt mean over the group's population std
``+ 1e-4``, clipped at 5). Its gradient is ``sigma(S) beta_dpo / n sum_i A_i grad d_i``, so the
script trains the per-sample loss

    loss = mean(sg(sigma(S_group)) A_i d_i) + kl_coef mean((v - v_ref)^2)

(``sg``: no gradient), whose gradient is ``1 / beta_dpo`` times that of the mean of ``L``
over the groups and timesteps, and digen trains that one. PPO-style clipping
(``clip_dsm``): the ratio ``r = exp(d_old - d)`` to an "old" copy of the weights; a term with
``A > 0`` and ``r > 1 + c`` or ``A <= 0`` and ``r < 1 - c`` keeps its value but no
gradient (``c`` = ``clip_range``, 0.01; 0 turns it off). The old copy is a moving average,
``old <- d old + (1 - d) theta`` after the optimizer step ``g`` (1, 2, ...), ``d = min(0.001 (g
- 1), 0.3)``. ``kl_coef`` 0.02 (GenEval and OCR, 0.001 PickScore), ``beta_dpo`` 100 (10).
Each round trains ``M`` (4) timesteps drawn without replacement from the sampler's first
``trunc_steps + 1`` (GenEval: steps 0 .. 4 of 10, the noisiest), the same for every sample
of the round.

Because ``S`` sums over a whole group, every forward pass must hold whole groups at each of
its timesteps: the timesteps are shared by the round (as published) and :meth:`DGPO.check`
refuses the layouts that split a group over passes (``train.micro_batch_size`` not a
multiple of ``rollout.n``, data-parallel colocated devices, sharded trainers, generation
micro-batches of part of a group); a pass that still holds part of a group fails.

The real-weights preset is ``geneval_sd3_4gpu``: 8 prompts x 16 samples a round and one
optimizer step, LoRA rank 64 / alpha 128 on the joint attention at lr 3e-4, sampling and
evaluation (14 steps) with DPM-Solver++ 2M on shift-3 flow sigmas at CFG 4.5, training
without CFG, 512 px. ``ocr`` and ``pickscore`` are :meth:`DGPO.variants`. What digen does
differently: the old copy is DiffusionNFT's old policy, so it samples throughout, where the
script samples with the trained weights for its first ``switch_ema_ref`` (500) optimizer
steps and with the old copy after; with several optimizer steps a train step the copy moves
once, after the last; the round's timesteps and each (group, timestep)'s noise are seeded
per ``(seed, step[, prompt, timestep])`` instead of broadcast from one GPU's stream, so a run
is the same bit for bit in either mode; training noises ``x0`` at the schedule's own sigma
where the script uses ``int(1000 sigma) / 1000``. ``docs/TRAINING.md`` lists the rest.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from digen.algos.base import Algorithm, ChunkLoss, NoisySteps, Param, TrainChunk
from digen.algos.flowgrpo import SD3_LORA_TARGETS

if TYPE_CHECKING:
    from collections.abc import Sequence

    from torch import Tensor

    from digen.config import DigenConfig
    from digen.registry.models import Backbone

__all__ = ["DGPO", "clipped_terms", "group_weights"]


def _positive(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return None if ok else "it must be a number > 0"


def _non_negative(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value >= 0
    return None if ok else "it must be a number >= 0"


def _fraction(value: Any) -> str | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 <= value < 1
    return None if ok else "it must be a number in [0, 1)"


def _positive_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
    return None if ok else "it must be an integer >= 1"


def _non_negative_int(value: Any) -> str | None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return None if ok else "it must be an integer >= 0"


def _boolean(value: Any) -> str | None:
    return None if isinstance(value, bool) else "it must be true or false"


def group_weights(
    advantages: Tensor,
    d: Tensor,
    d_ref: Tensor,
    groups: Tensor,
    num_groups: int,
    group_size: int,
    beta: float,
) -> Tensor:
    """Each term's group weight ``sigma(S)``, ``S = beta / n sum_j A_j (d_j - d_ref_j)`` over
    the terms ``j`` of its group (detached).

    advantages, d, d_ref: ``[R]``; groups: ``[R]`` long, a term's group id (``0 ..
    num_groups - 1``); ``group_size``: ``n``, the divisor whatever the count -> ``[R]``."""
    import torch

    term = advantages * beta * (d.detach() - d_ref.detach()) / group_size  # [R]
    sums = term.new_zeros(num_groups).scatter_add_(0, groups, term)  # [G]
    return torch.sigmoid(sums)[groups].detach()


def clipped_terms(advantages: Tensor, d: Tensor, d_old: Tensor, clip_range: float) -> Tensor:
    """``[R]`` bool: the terms whose ratio ``exp(d_old - d)`` left the trust region on the
    side their advantage pushes (``A > 0``: above ``1 + c``; else below ``1 - c``)."""
    import torch

    ratio = torch.exp(d_old.detach() - d.detach())
    return torch.where(advantages > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


class DGPO(Algorithm):
    name = "dgpo"
    title = (
        "DGPO (Luo et al. 2025): DPO between a group's better and worse samples on the "
        "denoising loss, ODE sampling, no likelihoods"
    )
    sde_types = ("sde",)  # never used: it draws no noisy step
    stochastic_sampling = False
    kl_type = "exact"
    trains_on = "final"
    keeps_old_policy = True
    params = {
        "beta_dpo": Param(100.0, "DPO's beta on the group's preference (PickScore: 10)", _positive),
        "num_train_timesteps": Param(
            4, "timesteps each round trains, shared by every sample", _positive_int
        ),
        "trunc_steps": Param(
            4,
            "the trained timesteps are drawn from the sampler's steps 0 .. trunc_steps (the "
            "noisiest; OCR and PickScore: 6)",
            _non_negative_int,
        ),
        "clip_range": Param(
            0.01,
            "PPO-style clip of exp(d_old - d) on the advantage's side (0.05 PickScore); 0: none",
            _non_negative,
        ),
        "shared_noise": Param(True, "a group's samples share the noise of a timestep", _boolean),
        "ema_reference": Param(
            False,
            "the preference's reference is the old (moving-average) copy instead of the base "
            "weights (the script's use_ema_ref, after TDM-R1)",
            _boolean,
        ),
        "decay_start": Param(1, "optimizer steps before the old copy starts to lag", _non_negative),
        "decay_rate": Param(0.001, "the old copy's decay added per optimizer step", _non_negative),
        "decay_max": Param(0.3, "the old copy's largest decay", _fraction),
    }

    # --- config ----------------------------------------------------------------------------

    def check(self, cfg: DigenConfig) -> str | None:
        r, a, p = cfg.rollout, cfg.algo, cfg.algo.params
        if r.sde_window_size or r.sde_window_range is not None:
            return (
                f"rollout.sde_window_size = {r.sde_window_size} is not allowed: DGPO samples "
                "without noise and trains on the clean latent, leave the window unset"
            )
        if a.ratio_norm:
            return (
                "algo.ratio_norm = true is not allowed: DGPO has no likelihood ratio to "
                "normalise (GRPO-Guard is an option of the GRPO family)"
            )
        if a.best_of_n:
            return (
                f"algo.best_of_n = {a.best_of_n} is not allowed: DGPO's preference is between "
                "the positive and negative samples of a whole group"
            )
        if p["trunc_steps"] >= r.num_inference_steps:
            return (
                f"algo.params.trunc_steps = {p['trunc_steps']} is not allowed: it names the last "
                f"sampler step trained, so it must be below rollout.num_inference_steps "
                f"({r.num_inference_steps})"
            )
        if p["num_train_timesteps"] > p["trunc_steps"] + 1:
            return (
                f"algo.params.num_train_timesteps = {p['num_train_timesteps']} is not allowed: "
                f"they are drawn without replacement from the {p['trunc_steps'] + 1} steps "
                f"0 .. algo.params.trunc_steps"
            )
        return _splits_groups(cfg)

    def preset(self, backbone: Backbone, real_weights: bool) -> dict[str, dict[str, Any]]:
        rollout: dict[str, Any] = {
            "solver": "dpm2",  # DPMSolverMultistepScheduler: deterministic, second order
            "sde_window_size": 0,
            "same_initial_noise": False,  # sample.same_latent
        }
        algo = {
            "adv_std": "group",  # geneval_sd3_4gpu: global_std false (OCR, PickScore: true)
            "adv_std_unbiased": False,
            "adv_eps": 1e-4,
            "adv_clip_max": 5.0,
            "kl_coef": 0.02,  # train.beta
        }
        params: dict[str, Any] = {
            "beta_dpo": 100.0,
            "clip_range": 0.01,
            "shared_noise": True,  # use_shared_noise
            "ema_reference": False,  # use_ema_ref
            # ema_ref.step after optimizer step g (0, 1, ...): decay min(0.3, 0.001 g)
            "decay_start": 1,
            "decay_rate": 0.001,
            "decay_max": 0.3,
        }
        if not real_weights:
            # scaled down: 2 of steps 0 .. 3 of 6 a round (published 4 of 0 .. 4 of 10); a
            # micro-batch of the preset's 8 is one group
            return {
                "rollout": {**rollout, "n": 8, "num_inference_steps": 6},
                "algo": {
                    **algo,
                    "params": {**params, "num_train_timesteps": 2, "trunc_steps": 3},
                },
            }
        rollout |= {
            "n": 16,  # num_image_per_prompt
            "num_inference_steps": 10,
            "shift": 3.0,  # the scheduler's flow_shift
            "time_input": "int1000",  # the DPM scheduler's integer timesteps
        }
        if backbone.name == "sd3":
            rollout["guidance_scale"] = 4.5  # CFG in sampling, none in training
        train: dict[str, Any] = {
            "lora_rank": 64,
            "lora_alpha": 128.0,
            "lr": 3e-4,
            "weight_decay": 1e-4,
            "max_grad_norm": 1.0,
            "micro_batch_size": 16,  # a pass holds whole groups
        }
        if backbone.name == "sd3":
            train["lora_targets"] = list(SD3_LORA_TARGETS)
        # train.mini_batch_size stays null: one optimizer step a round ("update once per epoch")
        return {  # config/dgpo.py geneval_sd3_4gpu with scripts/train_sd3_dgpo.py
            # num_groups 8 of num_image_per_prompt 16 (4 GPUs x 16 images x 2 batches)
            "data": {"train_batch_size": 8},
            "model": {"height": 512, "width": 512},  # resolution 512
            "rollout": rollout,
            "algo": {**algo, "params": {**params, "num_train_timesteps": 4, "trunc_steps": 4}},
            # eval(): the same sampler in eval_num_steps 14, CFG 4.5, an EMA (0.9, stepped at
            # every 8th optimizer step's micro-batches) of the LoRA: eval.ema=0.9 is nearest
            "eval": {"num_inference_steps": 14, "solver": "dpm2", "ema": 0.0},
            "train": train,
        }

    def variants(self, backbone: Backbone) -> dict[str, tuple[str, ...]]:
        return {  # config/dgpo.py
            # general_ocr_sd3_4gpu: global std, trunc_steps 6 (compressibility's)
            "ocr": ("algo.adv_std=global", "algo.params.trunc_steps=6"),
            # pickscore_sd3_4gpu: 8 groups of 24, global std, beta 0.001, beta_dpo 10, clip 5e-2
            "pickscore": (
                "rollout.n=24",
                "train.micro_batch_size=24",
                "algo.adv_std=global",
                "algo.kl_coef=0.001",
                "algo.params.beta_dpo=10",
                "algo.params.clip_range=0.05",
                "algo.params.trunc_steps=6",
            ),
        }

    # --- sampling --------------------------------------------------------------------------

    def noisy_steps(self, cfg: DigenConfig, step: int) -> NoisySteps:
        return NoisySteps((), ())  # deterministic sampling; nothing kept but the clean latent

    def train_steps(self, cfg: DigenConfig, step: int) -> tuple[int, ...]:
        return tuple(range(int(cfg.algo.params["trunc_steps"]) + 1))

    def terms_per_sample(self, cfg: DigenConfig, step: int) -> int:
        return int(cfg.algo.params["num_train_timesteps"])

    def trained_positions(self, cfg: DigenConfig, step: int, prompt: int, sample: int) -> list[int]:
        """``num_train_timesteps`` of the train steps without replacement, ascending: one
        draw per train step (seeded by the step alone), the same for every sample."""
        import torch

        from digen.seeding import step_generator

        g = step_generator(cfg.seed, step, "dgpo-timesteps")
        drawn = torch.randperm(len(self.train_steps(cfg, step)), generator=g)
        return sorted(drawn[: self.terms_per_sample(cfg, step)].tolist())

    # --- training --------------------------------------------------------------------------

    def chunk_loss(self, cfg: DigenConfig, chunk: TrainChunk) -> ChunkLoss:
        import torch

        from digen.algos.forward import forward_terms, mean_square

        p, policy, n = cfg.algo.params, chunk.policy, cfg.rollout.n
        groups, num_groups = _group_ids(chunk, n)  # [R], G
        f = forward_terms(cfg.seed, chunk, shared_by_group=bool(p["shared_noise"]))
        x_t, sigma, target = f.x_t, f.sigma, f.target
        # trained without CFG (the script's predict_v(..., cfg=False)): no negative conditioning
        v = policy.velocity(x_t, sigma, chunk.cond, None).float()  # [R, *latent]
        v_ref = policy.reference_velocity(x_t, sigma, chunk.cond, None).float()
        d = mean_square(v, target)  # [R]
        d_ref = mean_square(v_ref, target)
        c = cfg.algo.adv_clip_max
        adv = chunk.advantages.float().clamp(-c, c)  # [R]
        clip = float(p["clip_range"])
        anchor, d_train = d_ref, d
        clipped = torch.zeros_like(d, dtype=torch.bool)
        moved: Tensor | float = 0.0
        if clip > 0 or p["ema_reference"]:
            # the old copy that sampled these terms (TCSS: the one of their version)
            v_old = policy.old_velocity(x_t, sigma, chunk.cond, None, chunk.version).float()
            d_old = mean_square(v_old, target)
            moved = ((v.detach() - v_old) ** 2).mean()
            if clip > 0:
                clipped = clipped_terms(adv, d, d_old, clip)
                d_train = torch.where(clipped, d.detach(), d)
            if p["ema_reference"]:
                anchor = d_old
        w = group_weights(adv, d, anchor, groups, num_groups, n, float(p["beta_dpo"]))  # [R]
        per_term = w * adv * d_train
        loss = per_term.mean()
        kl_val = 0.0
        if cfg.algo.kl_coef > 0:
            kl = mean_square(v, v_ref).mean()
            loss = loss + cfg.algo.kl_coef * kl
            kl_val = kl.detach()
        return ChunkLoss(
            loss,
            kl=kl_val,
            clip_fraction=clipped.float().mean(),
            approx_kl=moved,
            values=per_term.detach(),
        )

    def update_old(
        self, cfg: DigenConfig, old: Sequence[Tensor], live: Sequence[Tensor], version: int
    ) -> None:
        """``old <- d old + (1 - d) theta`` after train step ``version - 1``, ``d`` the
        decay of the optimizer steps taken so far (:func:`~digen.algos.nft.old_decay`)."""
        import torch

        from digen.algos.nft import old_decay
        from digen.algos.train_step import mini_batches

        p = cfg.algo.params
        steps = version * len(mini_batches(cfg))
        d = old_decay(steps, p["decay_start"], p["decay_rate"], p["decay_max"])
        with torch.no_grad():
            for o, theta in zip(old, live, strict=True):
                o.copy_(o * d + theta.clone() * (1.0 - d))


def _group_ids(chunk: TrainChunk, n: int) -> tuple[Tensor, int]:
    """``[R]`` long: each term's (prompt, timestep) group, numbered in order of first
    appearance, and how many there are; fails unless each holds all ``n`` samples of the
    prompt. From the keys and steps on the host: no wait on the device."""
    import torch

    keys = [(k.prompt, s) for k, s in zip(chunk.keys, chunk.steps.tolist(), strict=True)]
    counts = Counter(keys)
    short = {key: c for key, c in counts.items() if c != n}
    if short:
        (prompt, step), c = next(iter(short.items()))
        raise ValueError(
            f"DGPO's pass holds {c} of the {n} samples of prompt {prompt} at denoising step "
            f"{step}: its group weight needs the whole group in one pass (make "
            "train.micro_batch_size a multiple of rollout.n and keep groups whole)"
        )
    number = {key: i for i, key in enumerate(dict.fromkeys(keys))}
    ids = torch.tensor([number[key] for key in keys], device=chunk.advantages.device)
    return ids, len(number)


def _splits_groups(cfg: DigenConfig) -> str | None:
    """What about ``cfg``'s layout would put part of a group in a forward pass (one clause
    naming the key), or None."""
    from digen.sched.microbatch import samples_per_microbatch

    r, t, rt = cfg.rollout, cfg.train, cfg.runtime
    why = (
        "DGPO weighs a group's terms by the whole group's preference, so a pass holds whole groups"
    )
    if t.micro_batch_size % r.n:
        return (
            f"train.micro_batch_size = {t.micro_batch_size} is not allowed: {why}; make it a "
            f"multiple of rollout.n = {r.n}"
        )
    if rt.mode == "colocated" and t.num_devices > 1:
        return (
            f"train.num_devices = {t.num_devices} is not allowed: colocated devices take a "
            f"group's samples in turns, so each holds part of every group, and {why}; use 1, "
            "or runtime.mode=disaggregated with runtime.trainers"
        )
    if rt.mode == "disaggregated":
        if rt.trainers > 1 and rt.placement.sharded:
            return (
                f"runtime.placement.trainer_parallel = {rt.placement.trainer_parallel} is not "
                f"allowed: sharded trainers deal a group's samples over their members, and {why}"
            )
        s = rt.schedule
        size = samples_per_microbatch(
            r.n, rt.generators, s.microbatch_axis, s.samples_per_microbatch
        )
        if size != r.n:
            key, value = "runtime.schedule.microbatch_axis", s.microbatch_axis
            if s.samples_per_microbatch is not None:
                key, value = "runtime.schedule.samples_per_microbatch", s.samples_per_microbatch
            return (
                f"{key} = {value} is not allowed: it makes micro-batches of {size} of a "
                f"group's {r.n} samples, and {why}; use runtime.schedule.microbatch_axis=prompt"
            )
    return None
