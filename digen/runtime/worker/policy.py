"""One copy of the policy on one device: sampling, log-prob recomputation and updates.

The same class serves the colocated trainer, and (later) the generator and trainer actors: a
generator only calls :meth:`Policy.generate`; a trainer also calls :meth:`Policy.accumulate`
and :meth:`Policy.optimizer_step`. Which samples a call makes or trains is given by explicit
:class:`SampleKey` s, so the work can be split any way without changing any sample.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from digen.algos.base import TrainChunk
from digen.algos.rollout import Rollout, SamplerSpec, sample_rollout, score_step
from digen.algos.train_step import mini_batches
from digen.checkpoint import publish, staging_for
from digen.config import DigenConfig, ShardDeal, TrainerSampling
from digen.errors import NonFiniteError
from digen.models import DiffusionAdapter, PromptEmbeds, load_adapter
from digen.models.lora import adapters_disabled, apply_lora, enable_full_finetune
from digen.models.weights import torch_dtype
from digen.registry.algos import get_algorithm
from digen.runtime.messages import LossStats, SampleKey, TrainItem
from digen.seeding import eval_generator, group_generator, sample_generator

__all__ = ["Generated", "Policy"]

_COND_CACHE_SIZE = 1024
"""Prompts whose text conditioning a policy copy keeps."""


@dataclass(slots=True)
class Generated:
    """What :meth:`Policy.generate` returns for a list of keys (rows in key order)."""

    keys: list[SampleKey]
    rollout: Rollout
    pixels: torch.Tensor
    """``uint8 [B, F, H, W, 3]`` decoded samples, for scoring and sample grids."""
    version: int
    seconds: float


class Policy:
    """The policy on one device. ``trainable=False`` makes a sampling-only copy."""

    def __init__(
        self,
        cfg: DigenConfig,
        *,
        trainable: bool = True,
        adapter: DiffusionAdapter | None = None,
        mesh: Any = None,
    ) -> None:
        """``mesh``: a ``DeviceMesh`` to shard the transformer over (FSDP2, every member of
        the mesh building its policy at once: :mod:`digen.runtime.worker.fsdp`); None keeps it whole."""
        if mesh is not None and not trainable:
            raise ValueError("a sharded policy is a trainer's (trainable=True)")
        self.cfg = cfg
        m = cfg.model
        self.adapter = adapter or load_adapter(
            m.name,
            m.path,
            device=m.device,
            # sharded: built without weights, sharded, then each member reads its own rows
            # of every weight (the KL reference too): no whole copy on the GPU or the host
            transformer_device="meta" if mesh is not None else None,
            dtype=torch_dtype(m.dtype),
            height=m.height,
            width=m.width,
            num_frames=m.num_frames,
            max_sequence_length=m.max_sequence_length,
            flavour=m.flavour,
            vae_tiling=m.vae_tiling,
            offload_text_encoders=m.offload_text_encoders,
        )
        self.version = 0
        self.algorithm = get_algorithm(cfg.algo.name)
        self.sigmas = self.adapter.sigmas(cfg.rollout.num_inference_steps, cfg.rollout.shift)
        eval_steps = cfg.eval.num_inference_steps or cfg.rollout.num_inference_steps
        self.eval_sigmas = (
            self.sigmas
            if eval_steps == cfg.rollout.num_inference_steps
            else self.adapter.sigmas(eval_steps, cfg.rollout.shift)
        )
        """The evaluation's schedule: ``eval.num_inference_steps`` steps, shifted as training's."""
        self._post_cache: dict[int, torch.Tensor] = {}
        self._cond_cache: OrderedDict[str, PromptEmbeds] = OrderedDict()
        self.encoded = 0
        """Prompts this copy ran through the text encoders (the rest came cached or shipped)."""
        self.sampled = 0
        """Training samples this copy sampled (rows of :meth:`generate`; a sharded member's
        padding row included)."""
        self.reference: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.params: list[torch.nn.Parameter] = []
        t = cfg.train
        if t.lora_rank > 0:
            targets = t.lora_targets or list(self.adapter.lora_targets)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(cfg.seed)  # LoRA A init: same on every worker
                self.params = apply_lora(
                    self.adapter.transformer,
                    rank=t.lora_rank,
                    alpha=t.lora_alpha,
                    targets=targets,
                    init=t.lora_init,
                    dtype=t.lora_dtype,
                )
        self.sharded = mesh is not None
        self.sequence: Any = None
        """Sharded with ``shard_deal`` or ``trainer_sampling`` ``sequence``: the
        transformer's sequence parallelism
        (:class:`~digen.runtime.worker.sequence.SequenceParallel`), None otherwise."""
        if trainable:
            transformer = self.adapter.transformer
            if t.lora_rank == 0:
                if cfg.algo.kl_coef > 0:
                    self.reference = copy.deepcopy(transformer).requires_grad_(False)
                self.params = enable_full_finetune(transformer)
            if t.gradient_checkpointing:
                transformer.enable_gradient_checkpointing()
            if mesh is not None:
                from digen.runtime.worker.fsdp import map_params, shard_and_load

                names = [n for n, p in transformer.named_parameters() if p.requires_grad]
                saved = Path(self.adapter.path or "") / "transformer"
                for module in (transformer, self.reference):
                    if module is not None:
                        shard_and_load(module, mesh, self.adapter.dtype, m.device, saved)
                self.params = map_params(transformer, names)()
                placement = cfg.runtime.placement
                by_sequence = placement.shard_deal == ShardDeal.SEQUENCE
                if by_sequence or placement.trainer_sampling == TrainerSampling.SEQUENCE:
                    from digen.runtime.worker.sequence import apply_sequence_parallel

                    # every member runs every row with its share of the tokens: in every
                    # pass, or (switched on around it) when sampling
                    self.sequence = apply_sequence_parallel(self.adapter, None, transformer)
                    self.sequence.active = by_sequence
                    if self.reference is not None and by_sequence:
                        apply_sequence_parallel(self.adapter, None, self.reference)
            self.optimizer = torch.optim.AdamW(
                self.params, lr=t.lr, weight_decay=t.weight_decay, betas=(0.9, 0.999), eps=1e-8
            )
        self.old: list[torch.Tensor] | None = None
        """The old policy's weights (:attr:`~digen.algos.base.Algorithm.keeps_old_policy`),
        in :meth:`synced_parameters` order: a trainer's own; a generator receives them as
        its weights."""
        if trainable and self.algorithm.keeps_old_policy:
            self.old = [_kept_copy(p) for _, p in self.synced_parameters()]
        self._old_before: dict[int, list[torch.Tensor]] = {}
        """Version -> the old policy that sampled at it, for the last
        ``runtime.schedule.max_staleness`` versions (stale micro-batches read it)."""
        self.ema: list[torch.Tensor] | None = None
        """A moving average of the trained weights that evaluation samples with
        (``eval.ema``), in :meth:`synced_parameters` order, on a trainer."""
        if trainable and cfg.eval.ema > 0:
            self.ema = [_kept_copy(p) for _, p in self.synced_parameters()]
        self._spare: list[torch.Tensor] | None = None
        """Sharded: where :meth:`_weights_in_place` keeps the trained shards while others
        stand in (allocated once, not per swap)."""
        self._rounded: list[torch.Tensor] | None = None
        """Unsharded, low-precision weights: the fp32 kept copies rounded to stand in for
        them (allocated once, not per swap)."""
        self._swapped = False
        self.eval_weights: list[torch.Tensor] | None = None
        """What evaluation samples with where the trainers keep it (a generator's copy of
        trainer 0's :attr:`ema`, while an evaluation runs); None: :meth:`sampling_weights`."""
        self.optimizer_steps = 0
        """Optimizer steps taken (the moving average's warm-up reads it)."""

    # --- sampling -----------------------------------------------------------------------

    def sampler_spec(self, step: int) -> SamplerSpec:
        """How train step ``step`` samples: the algorithm's noisy steps, its step kind and log-prob."""
        r = self.cfg.rollout
        steps = self.algorithm.noisy_steps(self.cfg, step)
        return SamplerSpec(
            sigmas=self._post_sigmas(steps.stochastic),
            window=steps.trainable,
            sde_type=r.sde_type,
            noise_level=r.noise_level,
            guidance_scale=r.guidance_scale,
            stochastic=steps.stochastic,
            log_prob=self.algorithm.log_prob_form(r.sde_type, self.cfg),
            algorithm=self.algorithm.name,
            keep_means=self.cfg.algo.ratio_norm,
            time_input=r.time_input,
            solver=r.solver,
        )

    def _post_sigmas(self, noisy: tuple[int, ...]) -> torch.Tensor:
        """The sigmas noisy steps sample on: the schedule, with the steps after its last noisy
        one redrawn as fewer steps where ``rollout.post_compress`` < 1 (MixGRPO-Flash).

        With ``L`` the last noisy step, ``int((N - L) * post_compress) - 1`` steps (at least
        1) run from sigma ``L + 1`` to 0, uniform in the grid's time. MixGRPO-Flash's code
        draws the same count and makes no step where it is 0, leaving the sample at sigma
        ``L + 1``; digen always finishes it. The steps up to ``L + 1`` are unchanged, so
        the kept transitions train on the schedule's own sigmas."""
        r = self.cfg.rollout
        last = max(noisy, default=-1)
        if r.solver != "dpm2-post" or r.post_compress >= 1 or last + 1 >= r.num_inference_steps:
            return self.sigmas
        if last not in self._post_cache:
            n = r.num_inference_steps
            count = max(int((n - last) * r.post_compress) - 1, 1)
            tail = self.adapter.tail_sigmas(n, last + 1, count, r.shift)
            self._post_cache[last] = torch.cat([self.sigmas[: last + 2], tail[1:]])
        return self._post_cache[last]

    def conditioning(self, prompts: Sequence[str]) -> PromptEmbeds:
        """Text conditioning per prompt (cached: text encoders are frozen).

        Each prompt is encoded alone, so its embedding is the same bits whichever prompts a
        worker happened to meet first (a batched encoder pass can round differently); the
        prompts not cached are encoded in one call (offloaded text encoders visit the device
        once). The cache keeps the most recent :data:`_COND_CACHE_SIZE` prompts.
        """
        cache = self._cond_cache
        self._encode(prompts)
        held = {p: cache[p] for p in prompts}  # a long call may outgrow the cache
        while len(cache) > _COND_CACHE_SIZE:
            cache.popitem(last=False)
        return _cat_rows([held[p] for p in prompts])

    def _encode(self, prompts: Sequence[str]) -> None:
        """Cache the embeddings of ``prompts`` not cached yet, encoded in one visit of
        offloaded text encoders to the device, and mark the others as just used."""
        cache = self._cond_cache
        missing = [p for p in dict.fromkeys(prompts) if p not in cache]
        for p in dict.fromkeys(prompts):
            if p in cache:
                cache.move_to_end(p)
        embeds = self.adapter.encode_each([[p] for p in missing]) if missing else []
        for p, e in zip(missing, embeds, strict=True):
            cache[p] = e
            self.encoded += 1

    def encode_ahead(self, prompt: str, ahead: Sequence[str]) -> None:
        """Before sampling ``prompt``: with offloaded text encoders, when it is not cached,
        encode it with the prompts ``ahead`` (those this copy may sample next: its train
        step's) and the negative prompt, in one visit of the encoders to the device, not one
        visit a prompt. Without offloading each prompt is encoded when first sampled (no
        round trip to save, no encoding of prompts another worker samples)."""
        if not self.adapter.offload_text_encoders or prompt in self._cond_cache:
            return
        negative = [self.cfg.rollout.negative_prompt] if self.cfg.rollout.guidance_scale > 1 else []
        wanted = [prompt, *negative, *ahead]
        self._encode(wanted[: max(_COND_CACHE_SIZE // 2, 1)])  # the cache keeps them all

    def cached_conditioning(self, prompt: str) -> PromptEmbeds | None:
        """The cached embedding of ``prompt``, if this copy has it (no encoding)."""
        return self._cond_cache.get(prompt)

    def add_conditioning(self, prompt: str, embeds: PromptEmbeds) -> None:
        """Cache an embedding another worker computed (on this copy's device and dtype)."""
        dtype = self.adapter.dtype
        tensors = {
            k: v.to(self.adapter.device, dtype if v.is_floating_point() else v.dtype)
            for k, v in embeds.tensors.items()
        }
        self._cond_cache[prompt] = PromptEmbeds(tensors)
        if len(self._cond_cache) > _COND_CACHE_SIZE:
            self._cond_cache.popitem(last=False)

    def negative_conditioning(self, batch: int) -> PromptEmbeds | None:
        r = self.cfg.rollout
        if r.guidance_scale <= 1.0:
            return None
        return self.conditioning([r.negative_prompt] * batch)

    def generate(self, keys: Sequence[SampleKey], prompts: Sequence[str]) -> Generated:
        """Sample and decode one trajectory per key (``prompts[i]`` is key i's prompt)."""
        t0 = time.perf_counter()
        keys = list(keys)
        spec = self.sampler_spec(keys[0].step)
        if any(k.step != keys[0].step for k in keys):
            raise ValueError("one generate call makes samples of one train step")
        seed = self.cfg.seed
        gens = [sample_generator(seed, k.step, k.prompt, k.sample) for k in keys]
        initial = None
        if self.cfg.rollout.same_initial_noise:  # a group starts from one noise
            initial = [group_generator(seed, k.step, k.prompt) for k in keys]
        cond = self.conditioning(prompts)
        with self.sampling_weights():
            rollout = sample_rollout(
                self.adapter, cond, gens, spec, self.negative_conditioning(len(keys)), initial
            )
        with torch.no_grad():
            pixels = self.adapter.decode(rollout.final.to(self.adapter.dtype)).cpu()
        self.sampled += len(keys)
        return Generated(keys, rollout, pixels, self.version, time.perf_counter() - t0)

    def evaluate(self, keys: Sequence[tuple[int, int]], prompts: Sequence[str]) -> torch.Tensor:
        """Evaluation images: deterministic (ODE) sampling from fixed noise, one image per
        ``(prompt index, sample index)`` key (``prompts[i]`` is key i's prompt).

        The weights evaluation samples with (:meth:`evaluation_weights`), the guidance of
        training, ``eval.num_inference_steps`` steps of ``eval.solver`` (training's by
        default) on training's schedule shifted alike, no noise after the initial latent,
        and a noise stream of its own (:func:`~digen.seeding.eval_generator`): the same key
        gives the same start at every evaluation, and no training sample changes. Returns
        ``uint8 [B, F, H, W, 3]`` on the CPU.
        """
        spec = self.sampler_spec(0)
        solver = self.cfg.eval.solver or spec.solver
        if solver == "dpm2-post":  # no window: Euler on the whole schedule
            solver = "euler"
        spec = dataclasses.replace(
            spec, sigmas=self.eval_sigmas, window=(), stochastic=(), solver=solver
        )
        gens = [eval_generator(self.cfg.seed, p, j) for p, j in keys]
        with torch.no_grad(), self.evaluation_weights():
            rollout = sample_rollout(
                self.adapter,
                self.conditioning(prompts),
                gens,
                spec,
                self.negative_conditioning(len(keys)),
            )
            return self.adapter.decode(rollout.final.to(self.adapter.dtype)).cpu()

    # --- training -----------------------------------------------------------------------

    def accumulate(
        self,
        item: TrainItem,
        loss_scale: float,
        tsp_degree: int = 1,
        terms: Sequence[tuple[int, int]] | None = None,
    ) -> LossStats:
        """Forward/backward over the trained timesteps of ``item``; gradients accumulate.

        ``tsp_degree`` timesteps go through the transformer together, as one batch of
        ``tsp_degree x B`` rows each at its own sigma (timestep parallelism, TSP); 1 is the
        timestep-by-timestep loop of the colocated tools. The gradient is the same either
        way. Each chunk's loss is the algorithm's (:meth:`~digen.algos.base.Algorithm.chunk_loss`);
        each backward is scaled by ``loss_scale`` (``1 / total terms`` of the optimizer
        step), so the accumulated gradient is that of the mean loss however the terms are
        split over calls, chunks and workers. No optimizer step here.

        ``terms``: only these ``(row of item, j)`` pairs (``j`` indexes the row's trained
        timesteps), in one forward pass: a sharded trainer's share of a call dealt by terms
        (:func:`~digen.runtime.worker.fsdp.lockstep_terms`).
        """
        if self.optimizer is None:
            raise RuntimeError("this policy copy is not trainable")
        cfg, algorithm = self.cfg, self.algorithm
        step = item.keys[0].step
        spec = self.sampler_spec(step)
        positions = torch.tensor(
            [algorithm.trained_positions(cfg, step, k.prompt, k.sample) for k in item.keys]
        )  # [B, K']: positions into the algorithm's train steps, per sample
        steps_of = torch.tensor(algorithm.train_steps(cfg, step), dtype=torch.long)
        device = self.adapter.device
        ro = item.rollout.to(device)  # what came from elsewhere goes where the model is
        advantages = item.advantages.to(device)
        stats = LossStats()
        # the weights that sampled these terms, untouched since (drift is then rounding)
        same = self.old is None and item.version in (None, self.version)
        same = same and self.optimizer_steps == self.version * len(mini_batches(cfg))
        self.adapter.transformer.train()
        for r, pos, cond, neg in self._passes(item, positions, tsp_degree, terms):
            chunk = TrainChunk(
                policy=self,
                spec=spec,
                step=step,
                keys=[item.keys[i] for i in r.tolist()],
                rollout=ro,
                rows=r,
                positions=pos,
                steps=steps_of[pos],
                cond=cond,
                neg=neg,
                advantages=advantages[r.to(device)],
                version=item.version,
                same_weights=same,
            )
            out = algorithm.chunk_loss(cfg, chunk)
            loss = out.loss
            n = r.numel()
            read = _ChunkRead.of(out)  # the chunk's one wait on the device
            if not read.finite:
                if cfg.train.on_nonfinite == "fail":
                    bad = n if out.values is None else int((~out.values.isfinite()).sum())
                    raise NonFiniteError(
                        f"the loss of train step {step} (prompt {item.keys[0].prompt}, samples "
                        f"{[k.sample for k in item.keys]}) is {read.loss} with "
                        f"{bad} of {n} terms non-finite; lower train.lr, "
                        "or set train.on_nonfinite=drop to leave such micro-batches out."
                    )
                if not self.sharded:  # sharded members must all run the backward, and the
                    stats.add(LossStats(dropped=1))  # step's non-finite gradient skips it
                    continue
            (loss * (n * loss_scale)).backward()
            stats.add(read.stats(n))
        self.adapter.transformer.eval()
        return stats

    def _passes(
        self,
        item: TrainItem,
        positions: torch.Tensor,
        tsp_degree: int,
        terms: Sequence[tuple[int, int]] | None,
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, PromptEmbeds, PromptEmbeds | None]]:
        """The forward passes of :meth:`accumulate`: each pass's rows of ``item``, their
        positions into the train steps, and their conditioning. ``tsp_degree`` timesteps of
        every row a pass (timestep-major), or the one pass of ``terms``."""
        if terms is not None:
            r = torch.tensor([i for i, _ in terms], dtype=torch.long)
            pos = positions[r, torch.tensor([j for _, j in terms], dtype=torch.long)]
            cond = self.conditioning([item.prompts[i] for i in r.tolist()])
            yield r, pos, cond, self.negative_conditioning(len(terms))
            return
        b = len(item.keys)
        cond = self.conditioning(item.prompts)
        neg = self.negative_conditioning(b)
        rows = torch.arange(b)
        for j0 in range(0, positions.shape[1], tsp_degree):
            pos = positions[:, j0 : j0 + tsp_degree].T.reshape(-1)  # [d*B], timestep-major
            d = pos.numel() // b
            yield (
                rows.repeat(d),  # [d*B]
                pos,
                cond if d == 1 else PromptEmbeds.cat([cond] * d),
                neg if neg is None or d == 1 else PromptEmbeds.cat([neg] * d),
            )

    def velocity(self, x_t, sigma, cond, neg) -> torch.Tensor:
        """The trained weights' velocity at ``x_t`` (with grad): ``sigma`` one per row."""
        return self.adapter.predict_velocity(x_t, sigma, cond, neg, self.cfg.rollout.guidance_scale)

    @torch.no_grad()
    def reference_velocity(self, x_t, sigma, cond, neg) -> torch.Tensor:
        """The reference (base) weights' velocity: LoRA off, or the frozen full copy."""
        with self._reference():
            return self.velocity(x_t, sigma, cond, neg)

    @torch.no_grad()
    def old_velocity(self, x_t, sigma, cond, neg, version: int | None = None) -> torch.Tensor:
        """The old policy's velocity (:attr:`~digen.algos.base.Algorithm.keeps_old_policy`):
        the one that sampled at policy ``version`` (None: the current one)."""
        with self._weights_in_place(self.old_at(version)):
            return self.velocity(x_t, sigma, cond, neg)

    def old_at(self, version: int | None) -> list[torch.Tensor] | None:
        """The old policy that sampled at policy ``version``: the current one, or for a
        stale micro-batch (TCSS) the one kept from that version."""
        if version is None or version >= self.version:
            return self.old
        if version not in self._old_before:
            raise RuntimeError(
                f"a micro-batch sampled at version {version} reached a trainer at version "
                f"{self.version}, which keeps the old policy of versions "
                f"{sorted(self._old_before)} only (runtime.schedule.max_staleness)"
            )
        return self._old_before[version]

    @torch.no_grad()
    def reference_mean(self, x_t, step_index, cond, spec, neg) -> torch.Tensor:
        """The reference policy's step mean at ``x_t`` (the KL of the GRPO family)."""
        with self._reference():
            return score_step(self.adapter, x_t, x_t, step_index, cond, spec, neg).mean

    @contextlib.contextmanager
    def _reference(self) -> Iterator[None]:
        if self.reference is None:
            with adapters_disabled(self.adapter.transformer):
                yield
            return
        live = self.adapter.pipe.transformer
        self.adapter.pipe.transformer = self.reference
        try:
            yield
        finally:
            self.adapter.pipe.transformer = live

    @contextlib.contextmanager
    def sampling_weights(self) -> Iterator[None]:
        """The weights that sample, in place for the block: the old policy where this copy
        keeps one (the trained tensors step aside, no copy), else the trained weights."""
        with self._weights_in_place(self.old):
            yield

    @contextlib.contextmanager
    def evaluation_weights(self) -> Iterator[None]:
        """The weights evaluation samples with, in place for the block: the moving average
        (``eval.ema``: this trainer's, or trainer 0's as a generator received it), else
        :meth:`sampling_weights`."""
        if self.ema is None and self.eval_weights is not None:
            with self._host_weights_in_place(self.eval_weights):
                yield
            return
        if self.ema is None:
            with self.sampling_weights():
                yield
            return
        with self._weights_in_place(self.ema):
            yield

    @contextlib.contextmanager
    def _host_weights_in_place(self, host: list[torch.Tensor]) -> Iterator[None]:
        """``host`` (host tensors, in :meth:`synced_parameters` order) copied into the
        weights for the block, the weights aside on the host meanwhile: the device holds
        one copy of the model, not two."""
        if self._swapped:
            raise RuntimeError("weights already stand in for the trained ones")
        self._swapped = True
        params = [p for _, p in self.synced_parameters()]
        try:
            with torch.no_grad():
                aside = [p.detach().to("cpu", copy=True) for p in params]
                for p, h in zip(params, host, strict=True):
                    p.copy_(h)
            try:
                yield
            finally:
                with torch.no_grad():
                    for p, a in zip(params, aside, strict=True):
                        p.copy_(a)
        finally:
            self._swapped = False

    @contextlib.contextmanager
    def _weights_in_place(self, tensors: list[torch.Tensor] | None) -> Iterator[None]:
        """``tensors`` (in :meth:`synced_parameters` order) stand in for the trained ones
        for the block, no copy; None: the trained ones."""
        if tensors is None:
            yield
            return
        if self._swapped:
            raise RuntimeError("weights already stand in for the trained ones")
        self._swapped = True
        try:
            if self.sharded:
                with self._shards_in_place(tensors):
                    yield
                return
            params = [p for _, p in self.synced_parameters()]
            live = [p.data for p in params]
            if self._rounded is None and any(o.dtype != p.dtype for p, o in zip(params, tensors)):
                self._rounded = [torch.empty_like(p) for p in params]
            try:
                with torch.no_grad():
                    for i, (p, o) in enumerate(zip(params, tensors, strict=True)):
                        # the kept copies are fp32: a bf16 base's are rounded as its own
                        # weights are, into a buffer kept for it (no allocation per swap)
                        p.data = o if o.dtype == p.dtype else self._rounded[i].copy_(o)
                yield
            finally:
                for p, t in zip(params, live, strict=True):
                    p.data = t
        finally:
            self._swapped = False

    @contextlib.contextmanager
    def _shards_in_place(self, tensors: list[torch.Tensor]) -> Iterator[None]:
        """Sharded :meth:`_weights_in_place`: FSDP gathers from its own shard storage, so the
        values move (this member's shards of ``tensors`` in, the trained ones aside into a
        buffer kept for it), not the tensors."""
        from digen.runtime.worker.fsdp import local

        self.reshard()
        params = [local(p) for _, p in self.synced_parameters()]
        if self._spare is None:
            self._spare = [torch.empty_like(p) for p in params]
        with torch.no_grad():
            for p, spare, o in zip(params, self._spare, tensors, strict=True):
                spare.copy_(p)
                p.copy_(local(o))
        try:
            yield
        finally:
            self.reshard()  # what was gathered of the stand-ins goes before the values return
            with torch.no_grad():
                for p, spare in zip(params, self._spare, strict=True):
                    p.copy_(spare)

    def reshard(self) -> None:
        """Sharded: every FSDP module back to its shards. FSDP keeps the root's weights
        gathered after a forward, for the backward it expects; a forward without one
        (sampling, the old policy's velocity) leaves them so, and the module's parameters
        are then those gathered tensors, not the shards the optimizer, the old policy and
        the average are kept against."""
        if not self.sharded:
            return
        from torch.distributed.fsdp import FSDPModule

        for module in (self.adapter.transformer, self.reference):
            for m in module.modules() if module is not None else ():
                if isinstance(m, FSDPModule):
                    m.reshard()

    def set_eval_weights(self, state: dict[str, torch.Tensor] | None) -> None:
        """Hold ``state`` (name -> tensor: trainer 0's moving average) as what evaluation
        samples with, on the host in this copy's dtype (copied in for each evaluation
        batch: a generator's device holds one copy of the model); None lets it go."""
        if state is None:
            self.eval_weights = None
            return
        self._check_fits(state)
        self.eval_weights = [state[n].to("cpu", p.dtype) for n, p in self.synced_parameters()]

    def ema_state(self) -> dict[str, torch.Tensor] | None:
        """Name -> the moving average evaluation samples with (``eval.ema``), or None."""
        return self._kept().get("ema")

    def sampling_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of the weights generators sample with, in the order of
        :meth:`synced_parameters`: the old policy where this copy keeps one."""
        named = self.synced_parameters()
        if self.old is None:
            return named
        return [(n, o) for (n, _), o in zip(named, self.old, strict=True)]

    def grads(self) -> list[torch.Tensor]:
        """The accumulated gradients of the trainable parameters (zeros where none)."""
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def set_step_lr(self, step: int) -> float:
        """Use train step ``step``'s learning rate (``train.lr_schedule``); returns it."""
        assert self.optimizer is not None
        lr = self.cfg.train.lr_at(step, self.cfg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def optimizer_state(self) -> dict[str, Any]:
        """The optimizer's state keyed by parameter name, whole (gathered from every member
        when sharded: all of them must call; the first one gets it): one format whatever
        the trainer count or sharding, so any of them can load it."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )

        assert self.optimizer is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=self.sharded)
        return get_optimizer_state_dict(self.adapter.transformer, self.optimizer, options=options)

    def write_checkpoint(self, directory: str | os.PathLike, lead: bool) -> None:
        """This policy's part of a checkpoint in ``directory``: sharded members all call at
        once and each writes its shards (:func:`~digen.checkpoint.write_sharded_state`);
        otherwise the ``lead`` copy writes the whole weights and optimizer state (replicas
        hold the same)."""
        from digen.checkpoint import write_sharded_state, write_trainer_state

        if self.sharded:
            names = [n for n, _ in self.synced_parameters()]
            write_sharded_state(
                directory, self.adapter.transformer, self.optimizer, names, self._kept()
            )
        elif lead:
            write_trainer_state(
                directory, self.trainable_state("cpu"), self.optimizer_state(), self._kept()
            )

    def load_checkpoint(self, directory: str | os.PathLike, version: int) -> None:
        """Continue from the checkpoint in ``directory``, whichever layout wrote it and
        however many trainers (sharded members all call at once)."""
        from digen.checkpoint import (
            is_sharded_checkpoint,
            load_kept,
            load_sharded_state,
            load_trainer_state,
        )

        if is_sharded_checkpoint(directory):
            names = [n for n, _ in self.synced_parameters()]
            transformer = self.adapter.transformer
            load_sharded_state(
                directory,
                transformer,
                self.optimizer,
                names,
                sharded=self.sharded,
                kept=self._kept(),
            )
            self.version = version
            self.optimizer_steps = version * len(mini_batches(self.cfg))
            return
        weights, optimizer = load_trainer_state(directory)
        self.restore(weights, optimizer, version)
        for prefix, kept in self._kept().items():
            self._load_kept(list(kept.values()), load_kept(directory, prefix))

    def _load_kept(self, kept: list[torch.Tensor], saved: dict[str, torch.Tensor]) -> None:
        """Fill ``kept`` from whole tensors by name (sharded members keep their shards)."""
        self._check_fits(saved)
        with torch.no_grad():
            for (name, _), t in zip(self.synced_parameters(), kept, strict=True):
                whole = saved[name].to(t.device, t.dtype)
                if hasattr(t, "device_mesh"):  # a shard: this member's piece of the whole
                    from torch.distributed.tensor import distribute_tensor

                    whole = distribute_tensor(whole, t.device_mesh, t.placements)
                t.copy_(whole)

    def _kept(self) -> dict[str, dict[str, torch.Tensor]]:
        """What this copy keeps beside the trained weights, by checkpoint prefix
        (:data:`digen.checkpoint.KEPT`): the old policy, the moving average (shards where
        sharded)."""
        names = [n for n, _ in self.synced_parameters()]
        kept = {"old": self.old, "ema": self.ema}
        return {k: dict(zip(names, v, strict=True)) for k, v in kept.items() if v is not None}

    def restore(
        self, weights: dict[str, torch.Tensor], optimizer: dict[str, Any] | None, version: int
    ) -> None:
        """Continue from a checkpoint: its trained tensors (by name, as
        :meth:`trainable_state` gives them), optimizer state (:meth:`optimizer_state`) and
        version. Sharded members each load the whole of both and keep their shards."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        self._check_fits(weights)
        transformer = self.adapter.transformer
        options = StateDictOptions(full_state_dict=True, strict=False)
        if self.sharded:
            set_model_state_dict(transformer, weights, options=options)
        else:
            named = dict(self.synced_parameters())
            with torch.no_grad():
                for name, value in weights.items():
                    named[name].copy_(value.to(named[name].device, named[name].dtype))
        if optimizer is not None and self.optimizer is not None:
            set_optimizer_state_dict(transformer, self.optimizer, optimizer, options=options)
        self.version = version
        self.optimizer_steps = version * len(mini_batches(self.cfg))

    def _check_fits(self, weights: dict[str, torch.Tensor]) -> None:
        """Refuse checkpoint weights of another shape or set of parameters, naming one."""
        named = dict(self.synced_parameters())
        if weights.keys() != named.keys():
            missing = sorted(set(named) - set(weights))[:3]
            extra = sorted(set(weights) - set(named))[:3]
            raise ValueError(
                f"the checkpoint's weights do not fit this model (missing {missing}, "
                f"unknown {extra})"
            )
        for name, value in weights.items():
            p = named[name]
            if tuple(p.shape) != tuple(value.shape):
                raise ValueError(
                    f"the checkpoint's {name} has shape {tuple(value.shape)}, the model's "
                    f"{tuple(p.shape)}"
                )

    def optimizer_step(self) -> float:
        """Clip, step, zero the gradients. Returns the grad norm.

        The policy version counts train steps, not optimizer steps: a train step of several
        mini-batches bumps it once, after its last (:meth:`finish_step`)."""
        assert self.optimizer is not None
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        max_norm = self.cfg.train.max_grad_norm
        norm = torch.nn.utils.clip_grad_norm_(
            self.params, max_norm if max_norm > 0 else float("inf")
        )
        if hasattr(norm, "full_tensor"):  # sharded gradients: the norm over every member
            norm = norm.full_tensor()
        if torch.isfinite(norm):
            self.optimizer.step()
        elif self.cfg.train.on_nonfinite == "fail":
            raise NonFiniteError(
                f"the gradient of an update of version {self.version} is {float(norm)}; "
                "lower train.lr, or set train.on_nonfinite=drop to skip such updates."
            )
        # else: the update is skipped (the weights stay; grad_norm reports the NaN)
        self.optimizer.zero_grad(set_to_none=True)
        self.optimizer_steps += 1
        if self.ema is not None:  # DiffusionNFT's EMAModuleWrapper, stepped per update
            s = self.optimizer_steps
            d = min((1 + s) / (10 + s), self.cfg.eval.ema)
            with torch.no_grad():
                for e, (_, p) in zip(self.ema, self.synced_parameters(), strict=True):
                    e.add_((1 - d) * (p.detach() - e))
        return float(norm)

    def finish_step(self) -> int:
        """The train step's last optimizer step is taken: bump the policy version (the
        weights generators sample the next step with) and move the old policy where one is
        kept; returns the version."""
        self.version += 1
        if self.old is not None:
            behind = self.cfg.runtime.schedule.max_staleness
            if behind > 0:  # stale micro-batches were sampled by it: their loss reads it
                self._old_before[self.version - 1] = [o.detach().clone() for o in self.old]
                for v in [v for v in self._old_before if v < self.version - behind]:
                    del self._old_before[v]
            live = [p.detach() for _, p in self.synced_parameters()]
            self.algorithm.update_old(self.cfg, self.old, live, self.version)
        return self.version

    def save_weights(
        self, out_dir: str | os.PathLike, state: dict[str, torch.Tensor] | None = None
    ) -> Path:
        """Save the trained weights; returns the directory.

        LoRA: ``out_dir/lora`` via the pipeline's ``save_lora_weights`` (load it back with
        ``pipe.load_lora_weights``). Full fine-tuning: ``out_dir/transformer`` in the layout
        of ``save_pretrained`` (load with the transformer class's ``from_pretrained``).
        ``state``: the full trained tensors by parameter name, where the transformer holds
        only shards of them (sharded trainers); None reads the transformer.
        """
        transformer = self.adapter.transformer
        if self.cfg.train.lora_rank > 0:
            from peft.utils import get_peft_model_state_dict

            final = Path(out_dir) / "lora"
            tmp = staging_for(final)
            self.adapter.pipeline_class.save_lora_weights(
                str(tmp),
                transformer_lora_layers=get_peft_model_state_dict(transformer, state_dict=state),
                transformer_lora_adapter_metadata=transformer.peft_config["default"].to_dict(),
            )
        else:  # the layout of save_pretrained, written a tensor at a time
            from digen.checkpoint import write_safetensors

            final = Path(out_dir) / "transformer"
            tmp = staging_for(final)
            tmp.mkdir(parents=True, exist_ok=True)
            transformer.save_config(str(tmp))
            saved = transformer.state_dict()  # the weights and persistent buffers, by name
            if state is not None:  # sharded: the gathered weights in place of the shards
                saved = {**state, **{n: b for n, b in saved.items() if n not in state}}
            write_safetensors(tmp / "diffusion_pytorch_model.safetensors", saved, {"format": "pt"})
        return publish(tmp, final)  # the old one is deleted only once the new one is in

    def synced_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """``(name, parameter)`` of what training changes: the LoRA weights, or every weight.

        The same list on every copy of the policy (trainer or generator), in the same order,
        so weights can travel as one flat tensor.
        """
        lora = self.cfg.train.lora_rank > 0
        self.reshard()  # the shards, never the root's gathered weights
        named = self.adapter.transformer.named_parameters()
        return [(n, p) for n, p in named if "lora_" in n or not lora]

    def trainable_state(self, device: str | torch.device | None = None) -> dict[str, torch.Tensor]:
        """Name -> copy of :meth:`synced_parameters`, on ``device`` (None: where they are):
        copied there directly, never cloned where they are first."""
        return {
            n: p.detach().to(device or p.device, copy=True) for n, p in self.synced_parameters()
        }


def _kept_copy(p: torch.Tensor) -> torch.Tensor:
    """A copy of a trained weight that moves by small steps (the old policy, the moving
    average): in fp32 where the weight is lower precision, whose rounding would swallow a
    0.9-decay average's steps (a shard where the weight is sharded)."""
    low = p.dtype in (torch.bfloat16, torch.float16)
    return p.detach().to(torch.float32 if low else p.dtype, copy=True)


@dataclass(frozen=True, slots=True)
class _ChunkRead:
    """What the host needs of a loss chunk (:class:`~digen.algos.base.ChunkLoss`), read
    back from the device in one transfer rather than one wait per value."""

    finite: bool
    loss: float
    kl: float
    clip_fraction: float
    approx_kl: float
    drift: tuple[int, float, float, int] | None
    """``(terms, sum, max, over the bound)`` of the log-prob drift, where measured."""

    @classmethod
    def of(cls, out: Any) -> _ChunkRead:
        loss = out.loss.detach()

        def value(v: torch.Tensor | float) -> torch.Tensor:
            if isinstance(v, torch.Tensor):
                return v.detach().to(torch.float32).reshape(())
            return loss.new_full((), float(v), dtype=torch.float32)

        parts = [torch.isfinite(loss).to(torch.float32), value(loss)]
        parts += [value(out.kl), value(out.clip_fraction), value(out.approx_kl)]
        measured = out.drift is not None and out.drift_bound is not None
        if measured:
            over = (out.drift > out.drift_bound).sum().to(torch.float32)
            parts += [out.drift.sum(), out.drift.max(), over]
        got = torch.stack(parts).tolist()
        drift = (out.drift.numel(), got[5], got[6], int(got[7])) if measured else None
        return cls(bool(got[0]), *got[1:5], drift)

    def stats(self, terms: int) -> LossStats:
        """The chunk's sums over its ``terms``."""
        stats = LossStats(
            terms=terms,
            loss=self.loss * terms,
            kl=self.kl * terms,
            clip_fraction=self.clip_fraction * terms,
            approx_kl=self.approx_kl * terms,
        )
        if self.drift is not None:
            n, total, top, over = self.drift
            stats.add(LossStats(drift_terms=n, drift=total, drift_max=top, drift_over=over))
        return stats


def _cat_rows(rows: Sequence[PromptEmbeds]) -> PromptEmbeds:
    from digen.models.base import _cat_padded

    return _cat_padded(rows)
