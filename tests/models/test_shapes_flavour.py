"""The ``shapes`` flavour: FLUX.1 and SD3.5 components at the shapes world's size, shipped as a
diffusers directory and loaded through the same ``from_pretrained`` path as real weights; and
its pretraining (:mod:`digen.run.shapes_pretrain`), reproducible from a seed.

Random-init weights stand in for the shipped ones, at a width that builds in a second.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from digen.errors import DigenError
from digen.models import base as models_base
from digen.models import get_adapter_class, load_adapter
from digen.models.tiny import pixel_autoencoder_kl
from digen.run.shapes_pretrain import (
    CHECKPOINT,
    EXIT_STOPPED,
    Recipe,
    Stopped,
    TrainingPairs,
    _recipe_changes,
    category_mix,
    compare_to_shipped,
    order_sensitivity,
    pretrain,
    swapped_binding,
)
from digen.shapes import CATEGORIES, PALETTE, parse, split_prompts

SMALL = {"width": 32, "heads": 2, "double_layers": 1, "single_layers": 1, "text_width": 32}
SMALL_SD3 = {"width": 32, "heads": 2, "layers": 1, "text_width": 32}
SHAPES_MODELS = ("flux", "sd3")


def _small(model: str) -> dict:
    return SMALL if model == "flux" else SMALL_SD3


@pytest.mark.parametrize("downsample", [1, 2])
def test_the_pixel_vae_is_the_image_block_averaged_and_repeated(downsample: int) -> None:
    vae = pixel_autoencoder_kl(downsample)
    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    with torch.no_grad():
        z = vae.encode(x).latent_dist.sample()  # [2, 3, 32 / d, 32 / d]
        y = vae.decode(z).sample  # [2, 3, 32, 32]
    blocks = torch.nn.functional.avg_pool2d(x, downsample)
    repeated = blocks.repeat_interleave(downsample, 2).repeat_interleave(downsample, 3)
    torch.testing.assert_close(z, blocks, atol=1e-5, rtol=0)
    torch.testing.assert_close(y, repeated, atol=1e-5, rtol=0)


@pytest.mark.parametrize("model", SHAPES_MODELS)
def test_shapes_flavour_loads_the_shipped_directory_through_from_pretrained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    torch.manual_seed(0)
    cls = get_adapter_class(model)
    pipe = cls.pipeline_class(**cls.build_shapes_components(**_small(model)))
    pipe.save_pretrained(str(tmp_path / f"{model}-shapes"), safe_serialization=True)
    monkeypatch.setattr(models_base, "PRETRAINED_ROOT", tmp_path)

    ad = load_adapter(model, None, flavour="shapes", height=None, width=None)
    assert ad.path == tmp_path / f"{model}-shapes"
    assert (ad.height, ad.width, ad.latent_shape()) == (32, 32, (3, 16, 16))
    saved = load_file(
        str(tmp_path / f"{model}-shapes/transformer/diffusion_pytorch_model.safetensors")
    )
    for name, p in ad.transformer.named_parameters():
        torch.testing.assert_close(p, saved[name], atol=0, rtol=0)

    cond = ad.encode_prompts(["a red square to the left of a yellow triangle", ""])
    x = torch.randn(2, *ad.latent_shape())  # [2, 3, 16, 16]
    v = ad.predict_velocity(x, 0.5, cond)
    assert v.shape == x.shape and torch.isfinite(v).all()
    pixels = ad.decode(x.clamp(-1, 1))  # [2, 1, 32, 32, 3]: each latent pixel a 2x2 block
    assert pixels.shape == (2, 1, 32, 32, 3)
    expected = ad.to_uint8(x.clamp(-1, 1).repeat_interleave(2, 2).repeat_interleave(2, 3))
    assert (pixels.int() - expected.int()).abs().max() <= 1


def test_shapes_flavour_without_its_directory_says_how_to_make_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(models_base, "PRETRAINED_ROOT", tmp_path)
    with pytest.raises(DigenError, match=r"needs the pretrained flux weights .*shapes_pretrain"):
        load_adapter("flux", None, flavour="shapes")


def test_shapes_flavour_of_a_backbone_without_shapes_weights_is_refused() -> None:
    with pytest.raises(DigenError, match="'shapes' has pretrained weights for flux and sd3 only"):
        load_adapter("wan", None, flavour="shapes")


def test_training_pairs_use_training_captions_only_and_repeat_from_a_seed() -> None:
    _, held_out = split_prompts()
    a, b = TrainingPairs(3), TrainingPairs(3)
    xa, ca = a.batch(64)  # [64, 3, 32, 32]
    xb, cb = b.batch(64)
    assert ca == cb and torch.equal(xa, xb)
    assert not set(ca) & set(held_out)
    assert xa.shape == (64, 3, 32, 32) and xa.min() >= -1 and xa.max() <= 1


def test_a_category_mix_draws_categories_at_its_weights() -> None:
    pairs = TrainingPairs(5, mix="position=3,color_attr=2")
    n = 9000
    drawn = Counter(parse(pairs.caption()).category for _ in range(n))
    weights = {c: 1.0 for c in CATEGORIES} | {"position": 3.0, "color_attr": 2.0}
    for c in CATEGORIES:
        p = weights[c] / sum(weights.values())
        # 5 binomial standard deviations: a wrong weight (off by 1 in 9) is 15 away or more
        assert abs(drawn[c] - n * p) <= 5 * (n * p * (1 - p)) ** 0.5, (c, drawn)
    assert category_mix("") is None
    assert category_mix("position=0, colors=2") == [1 / 6, 1 / 6, 1 / 6, 2 / 6, 0.0, 1 / 6]
    # an empty mix keeps the plain balanced draw's stream, so older recipes repeat exactly
    plain, rng = TrainingPairs(5, mix=""), np.random.default_rng(5)
    for _ in range(50):
        pool = plain.by_category[CATEGORIES[int(rng.integers(len(CATEGORIES)))]]
        assert plain.caption() == pool[int(rng.integers(len(pool)))]


@pytest.mark.parametrize(
    ("mix", "why"),
    [
        ("posit=2", "write category=weight"),
        ("position", "write category=weight"),
        ("position=x", "is not a number"),
        ("position=-1", "0 or more"),
        (",".join(f"{c}=0" for c in CATEGORIES), "positive weight"),
    ],
)
def test_a_bad_category_mix_is_one_sentence(mix: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Recipe(steps=1, mix=mix)


@pytest.mark.parametrize(
    ("fields", "why"),
    [
        ({"mix": "position=2", "balanced": False}, "needs balanced drawing"),
        ({"layout": "tidy"}, "choose one of free, ordered"),
        ({"text_lr": -0.1}, "must be 0 \\(frozen\\) or more"),
        ({"t5_position_bias": 0.0}, "t5_position_bias 0.0 must be positive"),
    ],
)
def test_recipe_fields_that_do_not_go_together_are_one_sentence(
    fields: dict[str, object], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        Recipe(steps=1, **fields)  # type: ignore[arg-type]


def test_the_ordered_layout_reaches_the_training_pairs() -> None:
    """The recipe's layout is the one the drawn scenes follow: with ``ordered`` the first
    named object of a colour-attribution caption is always the left one; with ``free`` it is
    the left one about half the time."""
    only_attribution = ",".join(f"{c}={int(c == 'color_attr')}" for c in CATEGORIES)

    def first_on_the_left(layout: str) -> list[bool]:
        images, captions = TrainingPairs(3, mix=only_attribution, layout=layout).batch(64)
        out = []
        for image, text in zip(images, captions, strict=True):  # image: [3, 32, 32]
            rgb = torch.tensor(PALETTE[parse(text).objects[0].colour]) / 127.5 - 1.0  # [3]
            hit = ((image - rgb.view(3, 1, 1)).abs().amax(0) < 1e-6).nonzero()  # [K, 2] (y, x)
            assert len(hit), text
            out.append(bool(hit[:, 1].float().mean() < 16))
        return out

    assert all(first_on_the_left("ordered"))
    free = sum(first_on_the_left("free"))
    assert 16 <= free <= 48  # about half of 64 (8 binomial standard deviations wide)


def test_a_swapped_binding_exchanges_the_colours_of_the_two_objects() -> None:
    assert (
        swapped_binding("a red circle to the left of a green square")
        == "a green circle to the left of a red square"
    )
    assert swapped_binding("a blue triangle and a yellow circle") == (
        "a yellow triangle and a blue circle"
    )
    with pytest.raises(ValueError, match="does not name two coloured objects"):
        swapped_binding("a circle and a square")


class _WordEncoder:
    """Conditioning made of one fixed vector per word, optionally shifted by its place."""

    def __init__(self, with_place: bool) -> None:
        self.with_place = with_place
        self.table: dict[str, torch.Tensor] = {}
        self.rng = torch.Generator().manual_seed(0)

    def _vector(self, word: str) -> torch.Tensor:
        if word not in self.table:
            self.table[word] = torch.randn(8, generator=self.rng)
        return self.table[word]

    def __call__(self, captions: list[str]) -> models_base.PromptEmbeds:
        rows = []
        for text in captions:
            words = text.split()
            rows.append(
                torch.stack(
                    [
                        self._vector(w) + (0.5 * i if self.with_place else 0)
                        for i, w in enumerate(words)
                    ]
                )
            )
        seq = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)  # [N, L, 8]
        return models_base.PromptEmbeds(
            {"prompt_embeds": seq, "pooled_prompt_embeds": seq.sum(dim=1)}  # a bag: [N, 8]
        )


def test_order_sensitivity_is_zero_for_a_bag_of_words_and_not_for_word_order() -> None:
    """Conditioning that holds each word alone cannot tell a caption from its swapped
    binding (0 in both measures); with each vector shifted by its word's place the sequence
    can (the shift moves "red" by 0.5 x 7 places in every coordinate)."""
    captions = ["a red circle to the left of a green square", "a blue square and a red circle"]
    bag = order_sensitivity(_WordEncoder(with_place=False), captions)
    summed_in_another_order = 16 * torch.finfo(torch.float32).eps  # <= 10 words a sum
    assert bag["sequence"] == 0.0
    assert bag["pooled"] == pytest.approx(0.0, abs=summed_in_another_order)
    placed = order_sensitivity(_WordEncoder(with_place=True), captions)
    assert placed["sequence"] > 0.1
    assert placed["pooled"] == pytest.approx(0.0, abs=summed_in_another_order)


def test_frozen_text_encoders_stay_at_their_seeded_init(tmp_path: Path) -> None:
    """With ``text_lr=0`` the text encoders are saved as the seeded init made them, the T5
    encoder's relative-position bias multiplied by ``t5_position_bias``, while the
    transformer trains; with ``0.1`` they train too."""
    base = dataclasses.replace(Recipe(steps=2, batch=4, eval_steps=1, eval_per_category=1), **SMALL)

    def weights(run: str, recipe: Recipe) -> dict[str, dict[str, torch.Tensor]]:
        with open(tmp_path / f"{run}.log", "w") as log:
            pretrain(recipe, tmp_path / run, log=log)
        return {
            part: load_file(str(next((tmp_path / run / part).glob("*.safetensors"))))
            for part in ("transformer", "text_encoder", "text_encoder_2")
        }

    frozen = weights("frozen", dataclasses.replace(base, text_lr=0.0, t5_position_bias=4.0))
    slow = weights("slow", dataclasses.replace(base, text_lr=0.1))
    torch.manual_seed(base.seed)  # as pretrain() seeds before building the components
    made = get_adapter_class("flux").build_shapes_components(**base.model_kwargs())
    init = {part: made[part].state_dict() for part in frozen}
    for part in ("text_encoder", "text_encoder_2"):
        assert frozen[part].keys() <= init[part].keys()
        for name, value in frozen[part].items():
            scale = 4.0 if name.endswith("relative_attention_bias.weight") else 1.0
            torch.testing.assert_close(value, scale * init[part][name], atol=0, rtol=0)
        assert any(not torch.equal(v, init[part][k]) for k, v in slow[part].items())
    assert any("relative_attention_bias" in name for name in frozen["text_encoder_2"])
    assert any(not torch.equal(v, init["transformer"][k]) for k, v in frozen["transformer"].items())


@pytest.mark.parametrize("model", SHAPES_MODELS)
def test_pretraining_gives_the_same_weights_from_the_same_seed_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: str
) -> None:
    """Two runs of one recipe and seed give the same weights; with the first one shipped,
    the second reports that it reproduced them, and a shipped copy altered in one weight is
    reported with exactly that difference."""
    recipe = Recipe(model=model, steps=2, batch=4, eval_steps=1, eval_per_category=1)
    recipe = dataclasses.replace(recipe, **_small(model))
    shipped = tmp_path / "shipped" / f"{model}-shapes"
    monkeypatch.setattr(models_base, "PRETRAINED_ROOT", tmp_path / "shipped")
    weights, reports = [], []
    for run in ("a", "b"):
        with open(tmp_path / f"{run}.log", "w") as log:
            result = pretrain(recipe, tmp_path / run, log=log)
        assert set(result["heldout"]) >= {"single_object", "overall"}
        weights.append(
            load_file(str(tmp_path / run / "transformer/diffusion_pytorch_model.safetensors"))
        )
        reports.append(json.loads((tmp_path / run / "recipe.json").read_text())["shipped"])
        if run == "a":
            shutil.copytree(tmp_path / "a", shipped)
    assert weights[0].keys() == weights[1].keys()
    for name in weights[0]:
        torch.testing.assert_close(weights[0][name], weights[1][name], atol=0, rtol=0)
    assert reports[0] is None  # nothing shipped yet
    encoders = {"text_encoder", "text_encoder_2"} | (
        {"text_encoder_3"} if model == "sd3" else set()
    )
    assert set(reports[1]["components"]) == {"transformer", *encoders}
    assert reports[1]["identical"] is True
    assert all(c["max_abs_diff"] == 0.0 for c in reports[1]["components"].values())
    first_eval = json.loads((tmp_path / "a" / "recipe.json").read_text())["eval"]
    assert reports[1]["shipped_eval"] == first_eval

    file = shipped / "transformer" / "diffusion_pytorch_model.safetensors"
    altered = load_file(str(file))
    key = sorted(altered)[0]
    altered[key] = altered[key].clone()
    altered[key].view(-1)[0] += 0.25
    save_file(altered, str(file))
    report = compare_to_shipped(tmp_path / "b", model, ["transformer", *sorted(encoders)])
    assert report is not None and report["identical"] is False
    assert report["components"]["transformer"]["identical"] is False
    assert report["components"]["transformer"]["max_abs_diff"] == pytest.approx(0.25, abs=1e-6)
    assert all(report["components"][e]["identical"] for e in encoders)
    # weights of another recipe (the package's own, of other shapes) are not compared
    package = Path(models_base.__file__).parent / "pretrained"
    assert (package / f"{model}-shapes" / "model_index.json").is_file()
    assert compare_to_shipped(tmp_path / "b", model, ["transformer"], root=package) is None
    assert compare_to_shipped(tmp_path / "b", model, ["transformer"], root=tmp_path) is None


def test_pretraining_in_pieces_ends_with_the_weights_of_one_unbroken_run(tmp_path: Path) -> None:
    """A run stopped after every step and resumed from its checkpoint each time ends with
    the same weights, bit for bit, as the same recipe run straight through; its record
    lists the pieces and the checkpoint is gone once it is complete."""
    recipe = dataclasses.replace(
        Recipe(steps=4, batch=4, eval_steps=1, eval_per_category=1, tokens="words"), **SMALL
    )
    with open(tmp_path / "a.log", "w") as log:
        pretrain(recipe, tmp_path / "a", log=log)
    stops = 0
    while True:
        try:  # any training time exceeds the piece's 1e-9 minutes: a stop after each step
            with open(tmp_path / "b.log", "a") as log:
                pretrain(recipe, tmp_path / "b", log=log, resume=True, piece_minutes=1e-9)
            break
        except Stopped:
            stops += 1
            assert (tmp_path / "b" / CHECKPOINT).exists()
    assert stops == 3  # the fourth piece ends the run
    assert not (tmp_path / "b" / CHECKPOINT).exists()
    record = json.loads((tmp_path / "b" / "recipe.json").read_text())
    assert len(record["pieces"]) == 4
    for component in ("transformer", "text_encoder", "text_encoder_2"):
        name = "diffusion_pytorch_model" if component == "transformer" else "model"
        a = load_file(str(tmp_path / "a" / component / f"{name}.safetensors"))
        b = load_file(str(tmp_path / "b" / component / f"{name}.safetensors"))
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], atol=0, rtol=0)
    steps = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["event"] for r in steps if "event" in r] == ["started"] + ["stopped", "resumed"] * 3
    # a checkpoint is resumed only with the recipe that made it
    other = dataclasses.replace(recipe, lr=1e-3)
    with open(tmp_path / "c.log", "w") as log:
        with pytest.raises(Stopped):
            pretrain(recipe, tmp_path / "c", log=log, piece_minutes=1e-9)
        with pytest.raises(ValueError, match=r"another recipe \(lr differ"):
            pretrain(other, tmp_path / "c", log=log, resume=True)
        with pytest.raises(ValueError, match="pass --resume"):
            pretrain(recipe, tmp_path / "c", log=log)


def test_a_checkpoint_of_an_older_recipe_resumes_when_only_new_settings_keep_their_defaults() -> (
    None
):
    recipe = Recipe(steps=10, tokens="words")
    saved = dataclasses.asdict(recipe)
    assert _recipe_changes(saved, recipe) == []
    older = {k: v for k, v in saved.items() if k != "tokens"}  # made before tokens existed
    assert _recipe_changes(older, dataclasses.replace(recipe, tokens="bytes")) == []
    assert _recipe_changes(older, recipe) == ["tokens"]  # not the default: another recipe
    assert _recipe_changes({**saved, "lr": 1.0}, recipe) == ["lr"]
    assert _recipe_changes({**saved, "gone": 3}, recipe) == ["gone"]


def test_sigterm_ends_a_pretraining_piece_with_a_checkpoint(tmp_path: Path) -> None:
    """SIGTERM to the pretraining command (a closing session, a scheduler) saves a checkpoint
    after the step under way and exits with the resumable status, instead of losing the steps
    since the last checkpoint."""
    out = tmp_path / "pipe"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    flags += ["--steps=100000", "--batch=2", "--tokens=words", "--checkpoint-every=0"]
    command = [sys.executable, "-m", "digen.run.shapes_pretrain", f"--out={out}", "--threads=1"]
    run = subprocess.Popen([*command, *flags], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert run.stdout is not None
    for line in run.stdout:  # the handler is in place once the run says it has started
        if b'"event": "started"' in line:
            run.send_signal(signal.SIGTERM)
            break
    rest = run.stdout.read().decode()
    assert run.wait(timeout=600) == EXIT_STOPPED, rest[-2000:]
    assert "run the same command with --resume" in rest
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    stopped = rows[-1]
    assert stopped["event"] == "stopped" and stopped["why"] == "terminated"
    state = torch.load(out / CHECKPOINT, weights_only=False)
    assert (state["step"], state["total"]) == (stopped["step"], 100000)
    assert stopped["step"] >= 1


def test_the_word_tokenizers_read_every_caption_of_the_world_as_its_words(tmp_path: Path) -> None:
    """``tokens=words``: one token per word, every caption within the 16 tokens, and the
    tokenizers come back the same through the saved directory."""
    from transformers import PreTrainedTokenizerFast

    from digen.shapes import all_specs, caption, vocabulary

    cls = get_adapter_class("flux")
    kwargs = Recipe(tokens="words", **SMALL).model_kwargs()
    pipe = cls.pipeline_class(**cls.build_shapes_components(**kwargs))
    pipe.save_pretrained(str(tmp_path / "pipe"), safe_serialization=True)
    for name in ("tokenizer", "tokenizer_2"):
        built = getattr(pipe, name)
        loaded = PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "pipe" / name))
        for spec in all_specs():
            text = caption(spec)
            ids = built(text).input_ids
            specials = 2 if name == "tokenizer" else 1  # CLIP: start and end; T5: end
            assert len(ids) == len(text.split()) + specials <= 16
            assert built.unk_token_id not in ids
            assert loaded(text).input_ids == ids
        words = built.convert_ids_to_tokens(built("a blue triangle").input_ids)
        assert [w for w in words if w in vocabulary()] == ["a", "blue", "triangle"]
        assert built("a purple hexagon").input_ids.count(built.unk_token_id) == 2


@pytest.mark.slow
def test_the_pretraining_command_trains_and_evaluates_again_to_the_same_figures(
    tmp_path: Path,
) -> None:
    """``python -m digen.run.shapes_pretrain`` as a user runs it: train, then
    ``--evaluate-only`` the result with the same settings (same noise, same weights)."""
    out = tmp_path / "pipe"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    flags += ["--steps=2", "--batch=4", "--eval-steps=1", "--eval-per-category=2"]
    command = [sys.executable, "-m", "digen.run.shapes_pretrain", f"--out={out}", "--threads=1"]
    for extra in ([], ["--evaluate-only"]):
        done = subprocess.run(
            [*command, *flags, *extra], capture_output=True, text=True, timeout=600
        )
        assert done.returncode == 0, done.stderr[-2000:]
        # a log a person reads: JSON rows, with no saving bars between them
        assert all(json.loads(line) for line in done.stdout.splitlines())
        assert "shards" not in done.stderr, done.stderr[-2000:]
    trained = json.loads((out / "recipe.json").read_text())["eval"]
    again = json.loads(done.stdout.strip().splitlines()[-1])
    assert (again["eval_steps"], again["guidance"]) == (1, 3.0)
    for split in ("heldout", "train"):
        assert set(again[split]) == {*CATEGORIES, "overall"}
        assert again[split] == trained[split]
    assert set(again["text_order"]) == {"sequence", "pooled"}
    assert again["text_order"] == trained["text_order"]  # the same encoders, measured again


@pytest.mark.parametrize("model", SHAPES_MODELS)
def test_the_shipped_shapes_model_loads_and_draws_objects(model: str) -> None:
    """The weights in the package, as ``model.flavour=shapes`` loads them: every sample of a
    few training captions holds an object the judge can see (not noise, not blank)."""
    from digen.algos.rollout import SamplerSpec, sample_rollout
    from digen.rewards.shapes import find_objects

    ad = load_adapter(model, None, flavour="shapes")
    assert ad.path == models_base.PRETRAINED_ROOT / f"{model}-shapes"
    prompts = ["a red square", "a green circle", "two squares", "a circle and a square"]
    spec = SamplerSpec(sigmas=ad.sigmas(10), window=(), stochastic=())
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    with torch.no_grad():
        final = sample_rollout(ad, ad.encode_prompts(prompts), gens, spec).final
    pixels = ad.decode(final)  # [4, 1, 32, 32, 3]
    for frame in pixels[:, 0].numpy():
        assert find_objects(frame), "a sample of the shipped model holds no object"


def test_the_flavour_a_bare_run_trains_exists_for_every_backbone() -> None:
    from digen.registry.models import BACKBONES

    for name, backbone in BACKBONES.items():
        shipped = get_adapter_class(name).shipped_flavours
        assert backbone.run_flavour == "tiny" or backbone.run_flavour in shipped, name
    assert BACKBONES["flux"].run_flavour == "shapes"
