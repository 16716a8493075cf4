"""The CLIP-score reward: a model-based hook loading a transformers CLIP from a local directory.

The test saves a tiny random CLIP (model, tokenizer, image processor) and the hook loads it
back through ``from_pretrained``; its scores are checked against the model's own forward
pass (``logits_per_image`` over its logit scale is the cosine the hook computes).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from digen import DigenRunner, load_config
from digen.errors import RewardError
from digen.models.tiny import tiny_clip_tokenizer
from digen.rewards.clip import ClipScore
from digen.rewards.hooks import load_hook


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    path = tmp_path_factory.mktemp("clip")
    tok = tiny_clip_tokenizer(max_length=64)
    text = {"vocab_size": len(tok), "hidden_size": 32, "intermediate_size": 64}
    text |= {"num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 64}
    text |= {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    text |= {"pad_token_id": tok.pad_token_id}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2}
    vision |= {"num_attention_heads": 2, "image_size": 32, "patch_size": 8}
    torch.manual_seed(0)
    CLIPModel(
        CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    ).save_pretrained(path)
    tok.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(path)
    return path


def _samples(b: int, frames: int = 1, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (b, frames, 48, 40, 3), generator=g, dtype=torch.uint8)


PROMPTS = ["a red bicycle by a lamp post", "a lighthouse at dusk", "two cats"]


def test_scores_are_the_models_own_cosine(clip_dir: Path) -> None:
    from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

    hook = ClipScore(str(clip_dir))
    asyncio.run(hook.setup())
    samples = _samples(3)
    got = hook(samples, PROMPTS, [{}] * 3)
    # the reference: one forward of the whole CLIP on the same inputs
    model = CLIPModel.from_pretrained(clip_dir).eval()
    pixels = AutoImageProcessor.from_pretrained(clip_dir)(
        images=list(samples[:, 0].numpy()), return_tensors="pt"
    )["pixel_values"]
    text = AutoTokenizer.from_pretrained(clip_dir)(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        out = model(pixel_values=pixels, **text)
    want = (out.logits_per_image.diagonal() / model.logit_scale.exp()).tolist()
    assert got == pytest.approx(want, abs=1e-5)
    assert len(set(round(v, 6) for v in got)) == 3 and all(-1 <= v <= 1 for v in got)


def test_a_video_scores_its_mean_frame_and_scale_and_clipping_apply(clip_dir: Path) -> None:
    hook = ClipScore(str(clip_dir), batch_size=2)  # 6 frames: three forward passes
    video = _samples(2, frames=3, seed=1)
    got = hook(video, PROMPTS[:2], [{}] * 2)
    for i in range(2):
        frames = [hook(video[i, f][None, None], [PROMPTS[i]], [{}])[0] for f in range(3)]
        assert got[i] == pytest.approx(sum(frames) / 3, abs=1e-5)
    scaled = ClipScore(str(clip_dir), scale=100.0, clip_negative=True)
    one = _samples(3, seed=2)
    plain = hook(one, PROMPTS, [{}] * 3)
    assert scaled(one, PROMPTS, [{}] * 3) == pytest.approx(
        [100 * max(0.0, v) for v in plain], abs=1e-3
    )


def test_loaded_by_name_with_options_and_a_bad_directory_is_one_sentence(
    clip_dir: Path, tmp_path: Path
) -> None:
    hook = load_hook("clip", {"model_dir": str(clip_dir), "scale": 2.0})
    assert isinstance(hook, ClipScore) and hook.scale == 2.0
    with pytest.raises(RewardError, match="is not a CLIP checkpoint directory"):
        load_hook("clip", {"model_dir": str(tmp_path)})


def test_a_run_scored_by_clip_completes(clip_dir: Path, tmp_path: Path) -> None:
    over = ["steps=1", "rollout.n=2", "train.micro_batch_size=2", "rollout.num_inference_steps=3"]
    over += [f"rewards=[{{name: clip, options: {{model_dir: '{clip_dir}'}}}}]", "save_every=0"]
    result = asyncio.run(
        DigenRunner(load_config(overrides=over), out_dir=tmp_path / "run", progress=False).run()
    )
    row = result.metrics[0]
    assert -1.0 <= row["reward_mean"] <= 1.0 and row["reward_std"] > 0


def test_rewards_score_on_the_device_of_their_worker(clip_dir: Path) -> None:
    """Every thread a worker's rewards run on (the loop's, and the executor's where plain
    hooks run) is on the worker's device; ``device: worker`` (CLIP's default) means it."""
    import asyncio
    import threading

    from digen.rewards.clip import ClipScore
    from digen.rewards.loop import RewardLoop, scoring_on, worker_device
    from digen.rewards.scoring import build_reward

    seen = []

    class Where:
        async def setup(self) -> None:
            seen.append(("setup", worker_device()))

        def __call__(self, samples, prompts, metadata):  # plain: runs on the executor
            seen.append(("call", worker_device(), threading.current_thread().name))
            return [0.0] * len(prompts)

    loop = RewardLoop(build_reward([Where()]), device="cuda:1")  # no GPU needed to say so
    try:
        loop.score(_samples(1), ["a red cube"])
    finally:
        loop.close()
    assert seen[0] == ("setup", "cuda:1")
    assert seen[1][:2] == ("call", "cuda:1") and seen[1][2].startswith("digen-reward")
    assert worker_device() == "cpu"  # this thread scores for no worker

    # a colocated worker scores on its own loop, its plain hooks on that loop's executor
    async def colocated() -> list[str]:
        with scoring_on("cuda:3"):
            return [worker_device(), await asyncio.to_thread(worker_device)]

    assert asyncio.run(colocated()) == ["cuda:3", "cuda:3"]
    assert worker_device() == "cpu"

    clip = ClipScore(str(clip_dir))
    assert clip.device == "worker"
    loop = RewardLoop(build_reward([clip]), device="cpu")
    try:
        loop.score(_samples(1), ["a red cube"])
    finally:
        loop.close()
    assert clip.device == "cpu"
