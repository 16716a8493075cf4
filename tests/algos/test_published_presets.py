"""The real-weights presets against the published configs, number by number.

Every value below is read off the official code (the file named beside it), not off digen's
presets, so a preset that drifts from its published recipe fails here. ``DIFFERENT`` pins
what digen does instead where it cannot (or by choice does not) do the same, each with the
published value beside it; ``docs/TRAINING.md`` gives the reasons. A derived key,
``optimizer_steps``, is the optimizer steps of a round (``data.train_batch_size`` over
``train.mini_batch_size``): the published scripts' samples a round over those an optimizer
step accumulates.
"""

from __future__ import annotations

from typing import Any

import pytest

from digen.config import DigenConfig, load_config
from digen.presets import preset
from digen.registry.algos import get_algorithm
from digen.registry.models import get_backbone

SD3_ATTENTION = [  # scripts/train_sd3.py, scripts/train_sd3_fast.py, scripts/train_nft_sd3.py
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
]
FLUX_ATTENTION_FF = [  # flow_grpo scripts/train_flux.py
    "attn.to_k",
    "attn.to_q",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]

# NVlabs/DiffusionNFT config/nft.py sd3_geneval (= sd3_pickscore, sd3_hpsv2) over
# config/base.py, run by scripts/train_nft_sd3.py
NFT_SD3 = {
    "data.train_batch_size": 48,  # num_groups
    "rollout.n": 24,  # num_image_per_prompt
    "optimizer_steps": 1,  # gradient_step_per_epoch
    "rollout.num_inference_steps": 10,  # sample.num_steps
    "rollout.solver": "dpm2",  # sample.solver, deterministic
    "rollout.guidance_scale": 1.0,
    "rollout.timestep_fraction": 0.99,  # train.timestep_fraction
    "trained_timesteps": 9,  # int(num_steps * timestep_fraction)
    "rollout.time_input": "int1000",  # pipeline_with_logprob: torch.full(sigma * 1000, long)
    "model.height": 512,  # resolution
    "model.width": 512,
    "eval.num_inference_steps": 40,  # sample.eval_num_steps
    "eval.solver": "euler",  # eval_fn: solver="flow", deterministic=True
    "eval.ema": 0.9,  # EMAModuleWrapper(decay=0.9), evaluated by eval_fn
    "algo.kl_coef": 1e-4,  # train.beta
    "algo.adv_clip_max": 5.0,
    "algo.adv_std": "global",  # sample.global_std
    "algo.adv_std_unbiased": False,  # stat_tracking.py: np.std
    "algo.adv_eps": 1e-4,
    "algo.params.beta": 1.0,  # config.beta
    "algo.params.decay_start": 0,  # decay_type 1 (return_decay)
    "algo.params.decay_rate": 0.001,
    "algo.params.decay_max": 0.5,
    "algo.params.adv_mode": "all",
    "train.lr": 3e-4,
    "train.weight_decay": 1e-4,
    "train.max_grad_norm": 1.0,
    "train.lora_rank": 32,
    "train.lora_alpha": 64.0,
    "train.lora_init": "gaussian",
    "train.lora_targets": SD3_ATTENTION,
}

# yifan123/flow_grpo config/grpo.py geneval_sd3 (and general_ocr_sd3) over config/base.py,
# run by scripts/train_sd3.py
FLOWGRPO_SD3 = {
    "data.train_batch_size": 48,  # int(48 / (gpu_number * train_batch_size / 24)) batches
    "rollout.n": 24,
    "optimizer_steps": 2,  # gradient_accumulation_steps = num_batches_per_epoch // 2
    "rollout.num_inference_steps": 10,
    "rollout.sde_type": "sde",
    "rollout.noise_level": 0.7,  # base.py sample.noise_level
    "rollout.sde_window_size": 0,
    "trained_timesteps": 9,  # int(10 * timestep_fraction 0.99): steps 0 .. 8
    "rollout.guidance_scale": 4.5,
    "rollout.time_input": "sigma",  # the pipeline's timesteps, 1000 sigma
    "model.height": 512,
    "model.width": 512,
    "eval.num_inference_steps": 40,  # eval_num_steps, noise_level=0
    "eval.solver": "euler",
    "algo.kl_coef": 0.04,  # train.beta
    "algo.kl_type": "flowgrpo",
    "algo.clip_ratio": 1e-4,  # base.py train.clip_range
    "algo.adv_clip_max": 5.0,
    "algo.adv_std": "global",
    "algo.adv_std_unbiased": False,
    "algo.adv_eps": 1e-4,
    "train.lr": 3e-4,
    "train.weight_decay": 1e-4,
    "train.max_grad_norm": 1.0,
    "train.lora_rank": 32,
    "train.lora_alpha": 64.0,
    "train.lora_init": "gaussian",
    "train.lora_targets": SD3_ATTENTION,
}

# flow_grpo config/grpo.py pickscore_flux, run by scripts/train_flux.py
FLOWGRPO_FLUX = {
    "data.train_batch_size": 48,
    "rollout.n": 24,
    "optimizer_steps": 2,
    "rollout.num_inference_steps": 6,
    "trained_timesteps": 5,  # int(6 * 0.99)
    "rollout.noise_level": 0.9,
    "rollout.guidance_scale": 1.0,  # FLUX.1-dev: 3.5 enters as the guidance embedding
    "model.height": 512,
    "model.width": 512,
    "model.dtype": "bfloat16",  # mixed_precision
    "eval.num_inference_steps": 28,
    "eval.solver": "euler",
    "algo.kl_coef": 0.0,
    "algo.clip_ratio": 1e-4,
    "algo.adv_std": "global",
    "train.lr": 3e-4,
    "train.lora_rank": 64,
    "train.lora_alpha": 128.0,
    "train.lora_init": "gaussian",
    "train.lora_targets": FLUX_ATTENTION_FF,
}

# flow_grpo config/grpo.py general_ocr_wan2_1 (per GPU: its GPU count is not given), run by
# scripts/train_wan2_1.py
FLOWGRPO_WAN = {
    "data.train_batch_size": 4,  # train_batch_size 8 / 4 a prompt x num_batches_per_epoch 2
    "rollout.n": 4,
    "optimizer_steps": 2,  # gradient_accumulation_steps 1: a step a batch
    "rollout.num_inference_steps": 20,
    "rollout.guidance_scale": 4.5,
    "model.height": 240,
    "model.width": 416,
    "model.num_frames": 33,
    "model.dtype": "bfloat16",
    "eval.num_inference_steps": 50,
    "algo.kl_coef": 0.004,
    "algo.clip_ratio": 1e-3,
    "algo.adv_std": "group",  # global_std False
    "train.lr": 1e-4,
    "train.lora_rank": 32,
    "train.lora_alpha": 64.0,
}

# flow_grpo config/grpo.py pickscore_qwenimage
FLOWGRPO_QWEN = {
    "data.train_batch_size": 32,  # int(32 / (gpu_number * 4 / 16)) batches of 4 a GPU
    "rollout.n": 16,
    "optimizer_steps": 2,
    "rollout.num_inference_steps": 10,
    "rollout.noise_level": 1.2,
    "rollout.sde_window_size": 2,
    "rollout.sde_window_range": (0, 5),  # (0, num_steps // 2)
    "rollout.guidance_scale": 4.0,
    "model.dtype": "bfloat16",
    "eval.num_inference_steps": 50,
    "eval.ema": 0.0,  # train.ema False
    "algo.kl_coef": 0.0,
    "algo.adv_std": "global",
}

# flow_grpo config/grpo.py geneval_sd3_fast_nocfg, run by scripts/train_sd3_fast.py
FAST_SD3 = {
    "data.train_batch_size": 48,
    "rollout.n": 24,
    "optimizer_steps": 2,
    "rollout.num_inference_steps": 10,
    "rollout.sde_type": "cps",
    "rollout.noise_level": 0.8,
    "rollout.sde_window_size": 3,
    "rollout.sde_window_range": (0, 5),  # (0, num_steps // 2)
    "rollout.guidance_scale": 1.0,  # guidance_scale 1, train.cfg False
    "eval.num_inference_steps": 40,
    "algo.clip_ratio": 1e-5,
    "algo.kl_coef": 0.0,
    "algo.adv_std": "global",
    "train.lora_rank": 32,
    "train.lora_alpha": 64.0,
    "train.lora_targets": SD3_ATTENTION,
}

# flow_grpo config/grpo.py geneval_flux_fast, run by scripts/train_flux.py
FAST_FLUX = {
    "data.train_batch_size": 48,
    "rollout.n": 24,
    "optimizer_steps": 2,
    "rollout.num_inference_steps": 6,
    "rollout.sde_type": "cps",
    "rollout.noise_level": 0.8,
    "rollout.sde_window_size": 3,
    "rollout.sde_window_range": (0, 3),
    "eval.num_inference_steps": 28,
    "algo.clip_ratio": 1e-5,
    "algo.kl_coef": 0.0,
    "train.lora_rank": 64,
    "train.lora_alpha": 128.0,
    "train.lora_targets": FLUX_ATTENTION_FF,
}

# XueZeyue/DanceGRPO scripts/finetune/finetune_flux_grpo_8gpus_lora.sh, run by
# fastvideo/train_grpo_flux_lora.py
DANCE_FLUX = {
    "data.train_batch_size": 16,  # 8 GPUs x train_batch_size 2
    "rollout.n": 12,  # num_generations
    "optimizer_steps": 2,  # gradient_accumulation_steps 12 of a GPU's 24 samples
    "rollout.num_inference_steps": 12,  # sampling_steps
    "rollout.sde_type": "dance",
    "rollout.noise_level": 0.3,  # eta
    "rollout.shift": 3.0,  # sd3_time_shift(shift, linspace(1, 0, N + 1))
    "rollout.timestep_fraction": 0.6,
    "trained_timesteps": 6,  # int(len(timesteps[:, :-1]) * timestep_fraction) = int(11 * 0.6)
    "rollout.same_initial_noise": True,  # init_same_noise
    "rollout.time_input": "int1000",  # timestep_value = int(sigma * 1000)
    "rollout.guidance_scale": 1.0,  # cfg 0.0; guidance embedding 3.5
    "model.height": 720,
    "model.width": 720,
    "model.dtype": "bfloat16",
    "algo.clip_ratio": 1e-4,
    "algo.adv_clip_max": 5.0,
    "algo.adv_std": "group",  # use_group
    "algo.adv_std_unbiased": True,  # torch.std
    "algo.adv_eps": 1e-8,
    "algo.kl_coef": 0.0,
    "train.lr": 3e-4,
    "train.weight_decay": 1e-4,
    "train.max_grad_norm": 1.0,
    "train.lora_rank": 128,
    "train.lora_alpha": 256.0,
    "train.lora_init": "true",  # init_lora_weights=True
    "train.lora_targets": ["to_k", "to_q", "to_v", "to_out.0"],
}

# DanceGRPO scripts/finetune/finetune_hunyuan_grpo.sh, run by fastvideo/train_grpo_hunyuan.py
DANCE_HUNYUAN = {
    "data.train_batch_size": 32,  # 32 GPUs x 1
    "rollout.n": 24,
    "algo.best_of_n": 8,  # bestofn
    "optimizer_steps": 2,  # gradient_accumulation_steps 4 of 8 kept samples
    "rollout.num_inference_steps": 16,
    "rollout.noise_level": 0.25,
    "rollout.shift": 5.0,
    "rollout.timestep_fraction": 0.6,
    "trained_timesteps": 9,  # int(15 * 0.6)
    "rollout.same_initial_noise": True,  # use_same_noise
    "rollout.time_input": "int1000",
    "model.height": 480,
    "model.width": 480,
    "model.num_frames": 53,
    "algo.clip_ratio": 1e-4,
    "algo.adv_eps": 1e-8,
}

# DanceGRPO scripts/finetune/finetune_wan_2_1_grpo.sh, run by fastvideo/train_grpo_wan_2_1.py
DANCE_WAN = {
    "data.train_batch_size": 16,  # 8 GPUs x 2
    "rollout.n": 12,
    "optimizer_steps": 1,  # gradient_accumulation_steps 24 of a GPU's 24 samples
    "rollout.num_inference_steps": 20,
    "rollout.noise_level": 0.3,
    "rollout.shift": 3.0,
    "rollout.timestep_fraction": 0.6,
    "trained_timesteps": 11,  # int(19 * 0.6)
    "rollout.guidance_scale": 5.0,  # cfg_infer
    "model.height": 512,
    "model.width": 512,
    "model.num_frames": 1,  # t 1
}

# Tencent-Hunyuan/MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO.sh, run by
# fastvideo/train_grpo_flux.py
MIX_FLUX = {
    "data.train_batch_size": 32,  # 4 nodes x 8 GPUs x 1
    "rollout.n": 12,
    "optimizer_steps": 4,  # gradient_accumulation_steps 3 of a GPU's 12 samples
    "rollout.num_inference_steps": 25,
    "rollout.sde_type": "sde",  # flow_grpo_sampling
    "rollout.noise_level": 0.7,
    "rollout.sde_window_size": 4,  # group_size
    "trained_timesteps": 4,  # training_strategy part: the window's steps
    "rollout.shift": 3.0,
    "rollout.same_initial_noise": True,
    "rollout.time_input": "int1000",
    "rollout.guidance_scale": 1.0,
    "rollout.solver": "euler",  # dpm_algorithm_type null
    "model.height": 720,
    "model.width": 720,
    "model.dtype": "bfloat16",
    "algo.params.shift_every": 25,  # iters_per_group
    "algo.params.stride": 1,  # prog_overlap_step
    "algo.params.roll_back": True,
    "algo.clip_ratio": 1e-4,
    "algo.adv_clip_max": 5.0,
    "algo.adv_std": "group",
    "algo.adv_std_unbiased": True,
    "algo.adv_eps": 1e-8,
    "algo.kl_coef": 0.0,
    "algo.old_kl_coef": 0.0,  # kl_coeff
    "algo.reward_weighting": "advantage",  # multi_reward_mix advantage_aggr
    "algo.normalize_reward_weights": True,  # weights / their sum
}

# MixGRPO scripts/finetune/finetune_flux_grpo_MixGRPO_Flash.sh
MIX_FLASH_FLUX = {
    **MIX_FLUX,
    "algo.params.shift_every": 20,
    "rollout.solver": "dpm2-post",  # dpm-solver++, dpm_apply_strategy post
    "rollout.post_compress": 0.4,
}

# scxue/advantage_weighted_matching config/dgx_awm.py geneval_sd3_no_cfg_1node over
# config/base_awm.py, run by scripts/train_sd3_awm.py
AWM_SD3 = {
    "data.train_batch_size": 72,  # 8 GPUs x train_batch_size 6 x 24 * 24 // 8 // 2 batches / 24
    "rollout.n": 24,  # num_image_per_prompt
    "optimizer_steps": 1,  # gradient_accumulation_steps spans the round ("on policy")
    "rollout.num_inference_steps": 14,  # sample.num_steps
    "rollout.guidance_scale": 1.0,  # no CFG; train.cfg false
    "rollout.timestep_fraction": 0.9,  # train.timestep_fraction
    "rollout.time_input": "sigma",  # timestep * 1000
    "trained_timesteps": 6,  # train.train_timesteps
    "model.height": 512,  # resolution
    "model.width": 512,
    "eval.num_inference_steps": 40,  # eval_num_steps, determistic
    "eval.solver": "euler",
    "algo.kl_coef": 0.001,  # train.beta (0.003 before the repository's last update)
    "algo.adv_clip_max": 5.0,  # base_awm.py train.adv_clip_max
    "algo.adv_std": "global",  # sample.global_std
    "algo.adv_std_unbiased": False,  # stat_tracking.py: np.std
    "algo.adv_eps": 1e-4,
    "algo.params.weighting": "ghuber",  # train.weighting
    "algo.params.ghuber_power": 0.25,
    "algo.params.advantage_max": 1.0,  # train.advantage_max
    "algo.params.time_type": "discrete_wo_init",  # time_type
    "algo.params.kl_weight": "uniform",  # train.kl_weight
    "train.lr": 3e-4,  # learning_rate (cosine over decay_steps 1e10: constant)
    "train.weight_decay": 1e-4,
    "train.max_grad_norm": 1.0,
    "train.lora_rank": 32,
    "train.lora_alpha": 64.0,
    "train.lora_init": "gaussian",
    "train.lora_targets": SD3_ATTENTION,  # lora_type "attn"
}

# Luo-Yihong/DGPO config/dgpo.py geneval_sd3_4gpu over config/base.py, run by
# scripts/train_sd3_dgpo.py
DGPO_SD3 = {
    "data.train_batch_size": 8,  # num_groups
    "rollout.n": 16,  # num_image_per_prompt
    "optimizer_steps": 1,  # gradient_accumulation_steps: "update once per epoch"
    "rollout.num_inference_steps": 10,  # sample.num_steps
    "rollout.solver": "dpm2",  # DPMSolverMultistepScheduler, noise_level 0
    "rollout.shift": 3.0,  # flow_shift
    "rollout.guidance_scale": 4.5,  # sample.guidance_scale; training predict_v(cfg=False)
    "rollout.time_input": "int1000",  # the scheduler's integer timesteps
    "rollout.same_initial_noise": False,  # sample.same_latent
    "trained_timesteps": 4,  # num_train_timesteps
    "model.height": 512,
    "model.width": 512,
    "eval.num_inference_steps": 14,  # eval_num_steps
    "eval.solver": "dpm2",
    "algo.kl_coef": 0.02,  # train.beta
    "algo.adv_clip_max": 5.0,
    "algo.adv_std": "group",  # sample.global_std false
    "algo.adv_std_unbiased": False,
    "algo.adv_eps": 1e-4,
    "algo.params.beta_dpo": 100.0,  # train.beta_dpo
    "algo.params.trunc_steps": 4,
    "algo.params.clip_range": 0.01,  # clip_range, clip_dsm
    "algo.params.shared_noise": True,  # use_shared_noise
    "algo.params.ema_reference": False,  # use_ema_ref
    "algo.params.decay_start": 1,  # ema_ref decay min(0.3, 0.001 global_step)
    "algo.params.decay_rate": 0.001,
    "algo.params.decay_max": 0.3,
    "train.lr": 3e-4,
    "train.weight_decay": 1e-4,
    "train.max_grad_norm": 1.0,
    "train.lora_rank": 64,
    "train.lora_alpha": 128.0,
    "train.lora_init": "gaussian",
    "train.lora_targets": SD3_ATTENTION,
}

PUBLISHED: dict[tuple[str, str], dict[str, Any]] = {
    ("sd3", "nft"): NFT_SD3,
    ("sd3", "flowgrpo"): FLOWGRPO_SD3,
    ("flux", "flowgrpo"): FLOWGRPO_FLUX,
    ("wan", "flowgrpo"): FLOWGRPO_WAN,
    ("qwenimage", "flowgrpo"): FLOWGRPO_QWEN,
    ("sd3", "flowgrpo-fast"): FAST_SD3,
    ("flux", "flowgrpo-fast"): FAST_FLUX,
    ("flux", "dancegrpo"): DANCE_FLUX,
    ("hunyuanvideo", "dancegrpo"): DANCE_HUNYUAN,
    ("wan", "dancegrpo"): DANCE_WAN,
    ("flux", "mixgrpo"): MIX_FLUX,
    ("flux", "mixgrpo-flash"): MIX_FLASH_FLUX,
    ("sd3", "awm"): AWM_SD3,
    ("sd3", "dgpo"): DGPO_SD3,
}

# (published, digen's): what the presets do instead, for the reasons docs/TRAINING.md gives
DIFFERENT: dict[tuple[str, str], dict[str, tuple[Any, Any]]] = {
    ("sd3", "nft"): {"model.dtype": ("fp16 autocast", "bfloat16")},  # base.py mixed_precision
    ("sd3", "flowgrpo"): {
        "model.dtype": ("fp16 autocast", "bfloat16"),  # base.py mixed_precision
        "eval.ema": ("0.9, stepped every 8th step", 0.0),  # train_sd3.py EMAModuleWrapper
    },
    ("flux", "flowgrpo"): {"eval.ema": ("0.9, stepped every 8th step", 0.0)},
    ("hunyuanvideo", "dancegrpo"): {  # full fine-tuning at learning_rate 1e-5
        "train.lora_rank": (0, 128),
        "train.lr": (1e-5, 3e-4),
    },
    ("wan", "dancegrpo"): {"train.lora_rank": (0, 128), "train.lr": (1e-5, 3e-4)},
    ("flux", "mixgrpo"): {"train.lora_rank": (0, 32), "train.lr": (1e-5, 3e-4)},
    ("flux", "mixgrpo-flash"): {"train.lora_rank": (0, 32), "train.lr": (1e-5, 3e-4)},
    ("sd3", "awm"): {
        "model.dtype": ("fp16 autocast", "bfloat16"),  # base_awm.py mixed_precision
        "rollout.solver": ("SA-Solver, stochasticity 0.4 in [0.3, 0.9]", "dpm2"),
    },
    ("sd3", "dgpo"): {
        "eval.ema": ("0.9, stepped every 8th step", 0.0),  # EMAModuleWrapper(0.9, 8)
    },
}


def _value(cfg: DigenConfig, key: str) -> Any:
    if key == "optimizer_steps":
        return cfg.data.train_batch_size // (cfg.train.mini_batch_size or cfg.data.train_batch_size)
    if key == "trained_timesteps":
        return get_algorithm(cfg.algo.name).terms_per_sample(cfg, 0)
    section, _, rest = key.partition(".")
    value: Any = getattr(cfg, section)
    if rest.startswith("params."):
        return value.params[rest.removeprefix("params.")]
    for part in rest.split("."):
        value = getattr(value, part)
    if isinstance(value, str):  # a choice's member is its plain string
        return str(value)
    return list(value) if isinstance(value, list) else value


def _real(model: str, algo: str, overrides: tuple[str, ...] = ()) -> DigenConfig:
    return load_config(base=preset(model, algo, real_weights=True), overrides=list(overrides))


@pytest.mark.parametrize(("model", "algo"), list(PUBLISHED), ids="-".join)
def test_the_real_weights_preset_is_the_published_config(model: str, algo: str) -> None:
    cfg = _real(model, algo)
    got = {key: _value(cfg, key) for key in PUBLISHED[model, algo]}
    assert got == PUBLISHED[model, algo]
    for key, (published, ours) in DIFFERENT.get((model, algo), {}).items():
        assert _value(cfg, key) == ours != published, key


def test_the_published_per_task_configs_are_the_preset_with_their_variant() -> None:
    nft = get_algorithm("nft").variants(get_backbone("sd3"))
    # DiffusionNFT config/nft.py sd3_ocr: beta 0.1, decay_type 2 (75, 0.0075, 0.999),
    # gradient_step_per_epoch 2
    ocr = _real("sd3", "nft", nft["ocr"])
    assert [_value(ocr, f"algo.params.{k}") for k in ("beta", "decay_start")] == [0.1, 75]
    assert [_value(ocr, f"algo.params.{k}") for k in ("decay_rate", "decay_max")] == [
        0.0075,
        0.999,
    ]
    assert _value(ocr, "optimizer_steps") == 2
    # sd3_multi_reward: num_steps 25, beta 0.1; evaluation keeps eval_num_steps 40
    multi = _real("sd3", "nft", nft["multi_reward"])
    assert (multi.rollout.num_inference_steps, multi.algo.params["beta"]) == (25, 0.1)
    assert (multi.eval.num_inference_steps, _value(multi, "optimizer_steps")) == (40, 1)
    assert _value(multi, "trained_timesteps") == 24  # int(num_steps * timestep_fraction)

    grpo = get_algorithm("flowgrpo").variants(get_backbone("sd3"))
    # flow_grpo config/grpo.py pickscore_sd3 (train.beta 0.01), clipscore_sd3 (0.02, same_latent)
    assert _real("sd3", "flowgrpo", grpo["pickscore"]).algo.kl_coef == 0.01
    clip = _real("sd3", "flowgrpo", grpo["clipscore"])
    assert (clip.algo.kl_coef, clip.rollout.same_initial_noise) == (0.02, True)
    assert get_algorithm("flowgrpo").variants(get_backbone("flux")) == {}

    awm = get_algorithm("awm").variants(get_backbone("sd3"))
    # advantage_weighted_matching config/dgx_awm.py ocr_sd3_no_cfg_1node: train.beta 0.003;
    # pickscore_sd3_no_cfg_1node: 8 * 24 // 8 // 2 batches (24 prompts), beta 1e-4, discrete
    assert _real("sd3", "awm", awm["ocr"]).algo.kl_coef == 0.003
    pick = _real("sd3", "awm", awm["pickscore"])
    assert (pick.data.train_batch_size, pick.algo.kl_coef) == (24, 1e-4)
    assert (pick.algo.params["time_type"], _value(pick, "optimizer_steps")) == ("discrete", 1)

    dgpo = get_algorithm("dgpo").variants(get_backbone("sd3"))
    # DGPO config/dgpo.py general_ocr_sd3_4gpu: global std, compressibility's trunc_steps 6
    ocr = _real("sd3", "dgpo", dgpo["ocr"])
    assert (ocr.algo.adv_std, ocr.algo.params["trunc_steps"], ocr.algo.kl_coef) == (
        "global",
        6,
        0.02,
    )
    # pickscore_sd3_4gpu: 8 groups of 24, beta 0.001, beta_dpo 10, clip_range 5e-2
    pick = _real("sd3", "dgpo", dgpo["pickscore"])
    assert (pick.data.train_batch_size, pick.rollout.n, pick.algo.kl_coef) == (8, 24, 0.001)
    p = pick.algo.params
    assert (p["beta_dpo"], p["clip_range"], p["trunc_steps"]) == (10.0, 0.05, 6)
