"""What only Qwen-Image does: the chat-template crop and batch padding of its prompts, its
packed token layout, renormalised true CFG, its pipeline's sampling, and which LoRA targets
stay out of the defaults.

The adapter protocol (loading, shapes, schedule, CFG, decode, LoRA) is in ``test_protocol.py``.
"""

from __future__ import annotations

import peft
import pytest
import torch
from backbone_helpers import (
    PROMPTS,
    euler_sample,
    generators,
    guidance_parts,
    private_copy,
    run_pipeline,
)
from diffusers import QwenImagePipeline

from digen.models.qwenimage import QwenImageAdapter


@pytest.fixture(scope="module")
def adapter(tiny_adapter) -> QwenImageAdapter:
    return tiny_adapter("qwenimage")


def _template_parts(pipe: QwenImagePipeline) -> tuple[str, str]:
    prefix, suffix = pipe.prompt_template_encode.split("{}")
    return prefix, suffix


def test_template_prefix_is_cropped(adapter: QwenImageAdapter) -> None:
    pipe, tok = adapter.pipe, adapter.pipe.tokenizer
    prefix, suffix = _template_parts(pipe)
    prefix_ids = tok(prefix).input_ids
    assert pipe.prompt_template_encode_start_idx != 34  # the pipeline's, for the real tokenizer
    assert pipe.prompt_template_encode_start_idx == len(prefix_ids) == 149
    assert tok.convert_ids_to_tokens(prefix_ids[:1]) == ["<|im_start|>"]  # one id, not 12 bytes

    emb = adapter.encode_prompts(["a red cube"])
    n_kept = len(tok("a red cube" + suffix).input_ids)
    assert emb.tensors["prompt_embeds"].shape == (1, n_kept, 32)
    # the kept rows are the encoder's last hidden states right after the prefix
    ids = tok([pipe.prompt_template_encode.format("a red cube")], return_tensors="pt")
    with torch.no_grad():
        hidden = pipe.text_encoder(**ids, output_hidden_states=True).hidden_states[-1]
    torch.testing.assert_close(emb.tensors["prompt_embeds"][0], hidden[0, len(prefix_ids) :])


def test_prompts_are_padded_to_the_longest_of_the_batch(adapter: QwenImageAdapter) -> None:
    tok = adapter.pipe.tokenizer
    _, suffix = _template_parts(adapter.pipe)
    emb = adapter.encode_prompts(PROMPTS)
    lengths = [len(tok(p + suffix).input_ids) for p in PROMPTS]
    embeds, mask = emb.tensors["prompt_embeds"], emb.tensors["prompt_embeds_mask"]
    assert lengths[0] < lengths[1]
    assert embeds.shape == (2, max(lengths), 32) and mask.shape == (2, max(lengths))
    assert mask.sum(dim=1).tolist() == lengths
    assert bool((embeds[0, lengths[0] :] == 0).all())
    # alone or among its equals a prompt is not padded, and encodes to the same numbers
    alone = adapter.encode_prompts(PROMPTS[:1]).tensors["prompt_embeds"][0]
    same = adapter.encode_prompts([PROMPTS[0]] * 2).tensors["prompt_embeds"]
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], alone)
    assert not torch.allclose(embeds[1, : lengths[0]], alone)


def test_forward_matches_the_pipeline_token_layout(adapter: QwenImageAdapter) -> None:
    """One transformer call exactly as QwenImagePipeline makes it, on packed latents."""
    pipe = adapter.pipe
    cond = adapter.encode_prompts(PROMPTS[:1])
    x = adapter.initial_latents(generators(3))  # [1, 4, 8, 8]
    packed = pipe._pack_latents(x.unsqueeze(2), 1, 4, 8, 8)  # the pipeline's [1, 16, 16]
    t = torch.tensor([700.0])
    with torch.no_grad():
        ref = pipe.transformer(
            hidden_states=packed,
            timestep=t / 1000,
            encoder_hidden_states=cond.tensors["prompt_embeds"],
            encoder_hidden_states_mask=None,
            img_shapes=[[(1, 4, 4)]],
            return_dict=False,
        )[0]
        v = adapter.predict_velocity(x, 0.7, cond)
    assert torch.equal(v, pipe._unpack_latents(ref, 32, 32, 4)[:, :, 0])


def test_cfg_is_the_pipelines_renormalised_formula(adapter: QwenImageAdapter) -> None:
    pipe = adapter.pipe
    cond, neg = adapter.encode_prompts(PROMPTS), adapter.encode_prompts(["", " "])
    x = adapter.initial_latents(generators(4, 5))
    sigma, scale = torch.tensor([0.8, 0.3]), 4.0
    guided, v_pos, v_neg = guidance_parts(adapter, x, sigma, cond, neg, scale)
    pos, negp = (pipe._pack_latents(v.unsqueeze(2), 2, 4, 8, 8) for v in (v_pos, v_neg))
    comb = negp + scale * (pos - negp)
    comb = comb * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    expected = pipe._unpack_latents(comb, 32, 32, 4)[:, :, 0]
    torch.testing.assert_close(guided, expected, rtol=1e-5, atol=1e-5)
    plain = v_neg + scale * (v_pos - v_neg)
    assert not torch.allclose(guided, plain, atol=1e-3)  # the rescale changes the result


def test_sampling_reproduces_the_pipeline(adapter: QwenImageAdapter) -> None:
    """Two steps of true-CFG Euler sampling + decode equal ``QwenImagePipeline.__call__``."""
    pipe, n, scale = adapter.pipe, 2, 4.0
    x = adapter.initial_latents(generators(10, 11))
    ref = run_pipeline(
        adapter,
        n,
        prompt=list(PROMPTS),
        negative_prompt=["", ""],
        true_cfg_scale=scale,
        latents=pipe._pack_latents(x.unsqueeze(2), 2, 4, 8, 8),
        output_type="pt",
    )  # [2, 3, 32, 32] in [0, 1]
    cond, neg = adapter.encode_prompts(PROMPTS), adapter.encode_prompts(["", ""])
    x = euler_sample(adapter, x, adapter.sigmas(n), cond, neg, guidance_scale=scale)
    ours = adapter.decode(x)[:, 0].permute(0, 3, 1, 2).float() / 255  # [2, 3, 32, 32]
    # only uint8 rounding apart (plain CFG without the rescale is ~1.6 levels off, a wrong
    # template crop ~7)
    assert (ours - ref).abs().max() <= 0.51 / 255


def _add_lora(model: QwenImageAdapter, targets: list[str]) -> dict[str, torch.nn.Parameter]:
    model.transformer.add_adapter(
        peft.LoraConfig(r=4, lora_alpha=4, target_modules=targets, init_lora_weights="gaussian")
    )
    return {n: p for n, p in model.transformer.named_parameters() if "lora_" in n}


def test_lora_targets_every_block_but_not_the_last_text_outputs(adapter: QwenImageAdapter) -> None:
    model = private_copy(adapter)
    cond = model.encode_prompts(PROMPTS)
    x = model.initial_latents(generators(12, 13))
    sigma = torch.tensor([0.9, 0.5])
    lora = _add_lora(model, list(QwenImageAdapter.lora_targets))
    n_layers = model.transformer.config.num_layers
    assert len(lora) == 2 * len(QwenImageAdapter.lora_targets) * n_layers  # A and B everywhere

    # why the text-stream outputs are not default targets: the last block's get no gradient
    model.transformer.delete_adapters("default")
    lora = _add_lora(model, ["attn.to_add_out", "txt_mlp.net.2"])
    model.predict_velocity(x, sigma, cond).pow(2).mean().backward()
    dead = {n.split(".")[1] for n, p in lora.items() if p.grad is None}
    assert dead == {str(n_layers - 1)}
