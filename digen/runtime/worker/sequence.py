"""Sequence parallelism (Ulysses) and CFG parallelism: one sample's work on several devices.

:func:`apply_sequence_parallel` changes a built model, as FSDP's ``fully_shard`` does, so
that the ``k`` members of a process group compute one forward pass together, each holding
``1 / k`` of the tokens. It reads the backbone's :class:`~digen.models.parallel.SequencePlan`:

- the inputs the plan names are cut as they reach their modules (each member keeps its
  contiguous piece of every stream: image tokens, prompt tokens, their rotary tables and
  masks), so every token-wise layer runs on the member's own tokens only;
- each attention module the plan names attends over the whole sequence: an all-to-all turns
  ``q, k, v [B, S/k, H, D]`` into ``[B, S, H/k, D]`` (all tokens, a share of the heads), the
  model's own attention kernel runs on that, and a second all-to-all turns the result back;
- the output of the plan's last token-wise module is gathered: every member ends the pass
  with the whole output, as one device would.

Heads and tokens need not divide by ``k``: pieces differ by one (a member may even hold no
head when there are fewer heads than members). Gradients flow through all of it: the
all-to-alls' backward passes are the opposite all-to-alls, and the gather's backward keeps a
member's own piece, so a weight's gradient is split over the members by the tokens each
computed: the group *sums* its members' gradients to get one device's.

The tokens of the prompt and of the image are interleaved by member in the gathered
sequence (member 0's text and image tokens, then member 1's ...): attention does not depend
on the order of its keys, only on each token's own rotary position and mask, which travel
with it. The result equals one device's up to rounding (keys summed in another order,
matrix products over fewer rows).

:func:`apply_cfg_parallel` puts the two branches of classifier-free guidance on two devices:
each runs its branch over the whole batch and the two swap velocities.

Tensors travel as bytes, so any dtype goes over any backend (gloo has no bf16 all-to-all).
"""

from __future__ import annotations

import contextvars
import fnmatch
import functools
import inspect
import math
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from digen.errors import DigenError
from digen.models.base import DiffusionAdapter
from digen.models.parallel import Cut, SequencePlan

__all__ = [
    "CfgBranch",
    "process_group",
    "SequenceParallel",
    "apply_cfg_parallel",
    "apply_sequence_parallel",
    "pieces",
    "split_generation_group",
]


def pieces(n: int, k: int) -> list[int]:
    """``n`` items in ``k`` contiguous pieces, the first ``n % k`` one longer."""
    return [n // k + (r < n % k) for r in range(k)]


def _module_matches(pattern: str, name: str) -> bool:
    """``pattern`` matches the module ``name`` name by name (``*``: any one name)."""
    if pattern == "" or name == "":
        return pattern == name
    want, have = pattern.split("."), name.split(".")
    return len(want) == len(have) and all(_name_matches(w, h) for w, h in zip(want, have))


def _name_matches(want: str, have: str) -> bool:
    return fnmatch.fnmatchcase(have, want)


# --- moving tensors between the members ---------------------------------------------------


def process_group(group: Any = None) -> dist.ProcessGroup:
    """``group``, or the default group for None. Groups are used through their own methods,
    so one made outside the default group's world (:func:`~digen.runtime.transport.groups.make_group`)
    serves as well as one made by ``torch.distributed.new_group``."""
    return dist.distributed_c10d._get_default_group() if group is None else group


def _all_to_all(
    sends: list[torch.Tensor], shapes: list[tuple[int, ...]], group: dist.ProcessGroup
) -> list[torch.Tensor]:
    """Member ``j`` gets ``sends[j]``; returns what each member sent here, shaped ``shapes``."""
    dtype, device = sends[0].dtype, sends[0].device
    size = torch.empty((), dtype=dtype).element_size()
    flat = torch.cat([s.reshape(-1) for s in sends]).view(torch.uint8)  # bytes: any dtype
    out_bytes = [math.prod(shape) * size for shape in shapes]
    out = torch.empty(sum(out_bytes), dtype=torch.uint8, device=device)
    in_bytes = [s.numel() * size for s in sends]
    group.alltoall_base(out, flat, out_bytes, in_bytes).wait()
    parts = out.split(out_bytes)
    return [p.view(dtype).view(shape) for p, shape in zip(parts, shapes)]


@dataclass(frozen=True)
class _Layout:
    """One attention call's split: tokens per member (``seq``), heads per member."""

    group: dist.ProcessGroup
    rank: int
    seq: tuple[int, ...]
    heads: tuple[int, ...]


def _seq_to_heads(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """``[B, S_r, H, D]`` (this member's tokens, every head) -> ``[B, S, H_r, D]``."""
    b, _, _, d = x.shape
    bounds = [0, *torch.tensor(lay.heads).cumsum(0).tolist()]
    sends = [x[:, :, bounds[j] : bounds[j + 1]] for j in range(len(lay.heads))]
    shapes = [(b, s, lay.heads[lay.rank], d) for s in lay.seq]
    return torch.cat(_all_to_all(sends, shapes, lay.group), dim=1)


def _heads_to_seq(y: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """``[B, S, H_r, D]`` -> ``[B, S_r, H, D]``: the inverse of :func:`_seq_to_heads`."""
    b, _, _, d = y.shape
    sends = list(y.split(list(lay.seq), dim=1))
    shapes = [(b, lay.seq[lay.rank], h, d) for h in lay.heads]
    return torch.cat(_all_to_all(sends, shapes, lay.group), dim=2)


def _gather(x: torch.Tensor, dim: int, lay: _Layout) -> torch.Tensor:
    """Every member's piece of ``dim`` (``lay.seq`` long each), concatenated, on every member."""
    shapes = []
    for s in lay.seq:
        shape = list(x.shape)
        shape[dim] = s
        shapes.append(tuple(shape))
    sends = [x.contiguous()] * len(lay.seq)
    return torch.cat(_all_to_all(sends, shapes, lay.group), dim=dim)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, lay: _Layout) -> torch.Tensor:
        ctx.lay = lay
        return _seq_to_heads(x, lay)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _heads_to_seq(grad.contiguous(), ctx.lay), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, lay: _Layout) -> torch.Tensor:
        ctx.lay = lay
        return _heads_to_seq(y, lay)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _seq_to_heads(grad.contiguous(), ctx.lay), None


class _Gather(torch.autograd.Function):
    """Forward: the whole sequence from the members' pieces. Backward: this member's piece
    of the gradient (each member's loss is the same function of the same gathered output,
    so the pieces, summed over the members, are one device's gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, lay: _Layout) -> torch.Tensor:
        ctx.dim, ctx.start, ctx.size = dim, sum(lay.seq[: lay.rank]), lay.seq[lay.rank]
        return _gather(x, dim, lay)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.narrow(ctx.dim, ctx.start, ctx.size), None, None


# --- the model changed ----------------------------------------------------------------------

#: the sequence-parallel model whose attention runs in this context (set only while one of
#: its spanning attention modules runs)
_SPANNING: contextvars.ContextVar[SequenceParallel | None] = contextvars.ContextVar(
    "digen_spanning_attention", default=None
)


class SequenceParallel:
    """A transformer changed by :func:`apply_sequence_parallel`; :meth:`remove` restores it.

    ``lengths``: each stream's whole length in the current forward pass, read from the first
    whole tensor of it that is cut.
    """

    def __init__(self, transformer: torch.nn.Module, plan: SequencePlan, group: Any) -> None:
        self.transformer = transformer
        self.plan = plan
        self.group = process_group(group)
        self.rank = self.group.rank()
        self.size = self.group.size()
        self.lengths: dict[str, int] = {}
        self.active = True
        """Off: the hooks let every pass through whole, as one device computes it (sharded
        trainers that split only their sampling switch it around each use)."""
        #: attention calls that spanned the group, and the tokens this member's share of them
        #: held (against the whole sequence's)
        self.spanned = self.tokens_here = self.tokens = 0
        self.trading_s = 0.0
        """Seconds the forward passes spent in their all-to-alls (waits for the others
        included)."""
        self._undo: list[Callable[[], None]] = []

    # the pieces of this pass

    def piece(self, stream: str, n: int) -> tuple[int, int]:
        """(start, length) of this member's piece of a stream ``n`` tokens long."""
        if n < self.size:
            raise DigenError(
                f"sequence parallelism over {self.size} devices needs at least {self.size} "
                f"{stream} tokens, and this model's {stream} has {n}; use a smaller degree."
            )
        sizes = pieces(n, self.size)
        return sum(sizes[: self.rank]), sizes[self.rank]

    def cut(self, x: Any, cut: Cut) -> Any:
        """This member's piece of ``x`` (a tensor the cut does not apply to, unchanged)."""
        if not torch.is_tensor(x) or (cut.ndim is not None and x.ndim != cut.ndim):
            return x
        dim = cut.dim % x.ndim
        if len(cut.streams) == 1:
            n = self.lengths.setdefault(cut.streams[0], x.shape[dim])
            if n != x.shape[dim]:
                raise DigenError(
                    f"sequence parallelism met {x.shape[dim]} {cut.streams[0]} tokens where "
                    f"the pass had {n}: the model's sequence plan is wrong."
                )
        missing = [s for s in cut.streams if s not in self.lengths]
        if missing or sum(self.lengths[s] for s in cut.streams) != x.shape[dim]:
            raise DigenError(
                f"sequence parallelism cannot cut a tensor of shape {tuple(x.shape)} along "
                f"{'+'.join(cut.streams)}: the model's sequence plan is wrong."
            )
        parts, offset = [], 0
        for stream in cut.streams:
            start, size = self.piece(stream, self.lengths[stream])
            parts.append(x.narrow(dim, offset + start, size))
            offset += self.lengths[stream]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)

    def layout(self, local: int, heads: int) -> _Layout:
        """The split of an attention call over ``local`` tokens here: the image tokens alone
        or the image and text tokens together, whichever this member's share makes."""
        sizes = {s: pieces(n, self.size) for s, n in self.lengths.items()}
        options = [sizes["image"]] if "image" in sizes else []
        if "image" in sizes and "text" in sizes:
            options.append([i + t for i, t in zip(sizes["image"], sizes["text"])])
        for seq in options:
            if seq[self.rank] == local:
                return _Layout(self.group, self.rank, tuple(seq), tuple(pieces(heads, self.size)))
        raise DigenError(
            f"sequence parallelism met an attention over {local} tokens, which is no "
            f"member's share of the image or image + text tokens: the model's sequence plan "
            f"is wrong."
        )

    def attend(
        self,
        attention: Callable[..., torch.Tensor],
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
        heads_first: bool,
    ) -> torch.Tensor:
        """``attention`` over the whole sequence from this member's ``query/key/value``:
        ``[B, S_r, H, D]`` (``[B, H, S_r, D]`` when ``heads_first``) in and out.

        ``mask``: None or a mask over the keys only (its query axis of length 1), as the
        backbones make them; it is gathered like the keys."""
        if heads_first:
            query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        if key.shape[1] != query.shape[1]:
            raise DigenError(
                "sequence parallelism spans self- and joint attention only; a cross-attention "
                "is in the model's sequence plan."
            )
        lay = self.layout(query.shape[1], query.shape[2])
        self.spanned += 1
        self.tokens_here += lay.seq[lay.rank]
        self.tokens += sum(lay.seq)
        t0 = time.perf_counter()
        q, k, v = (_SeqToHeads.apply(t.contiguous(), lay) for t in (query, key, value))
        self.trading_s += time.perf_counter() - t0
        if mask is not None:
            if mask.ndim >= 2 and mask.shape[-2] != 1:
                raise DigenError("sequence parallelism takes attention masks over keys only.")
            mask = _gather(mask.detach(), mask.ndim - 1, lay)
        if heads_first:
            out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
            out = out.transpose(1, 2)
        else:
            out = attention(q, k, v, mask)
        t0 = time.perf_counter()
        out = _HeadsToSeq.apply(out.contiguous(), lay)
        self.trading_s += time.perf_counter() - t0
        return out.transpose(1, 2) if heads_first else out

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """The image tokens of every member (``x [B, S_r, C]`` -> ``[B, S, C]``)."""
        seq = tuple(pieces(self.lengths["image"], self.size))
        return _Gather.apply(x, 1, _Layout(self.group, self.rank, seq, ()))

    # changing the model

    def install(self) -> None:
        modules = dict(self.transformer.named_modules())
        cuts: dict[str, dict[str, Cut]] = {}
        for pattern, named in self.plan.inputs.items():
            for name in _matching(pattern, modules):
                cuts.setdefault(name, {}).update(named)
        cuts.setdefault("", {})  # the whole model's hook starts each pass
        for name, named in cuts.items():
            self._on_inputs(modules[name], name == "", named)
        for pattern, indexed in self.plan.outputs.items():
            for name in _matching(pattern, modules):
                self._on_outputs(modules[name], indexed)
        gathered = _matching(self.plan.gather, modules)
        if len(gathered) != 1:
            raise DigenError(f"the sequence plan gathers at '{self.plan.gather}', not one module.")
        handle = modules[gathered[0]].register_forward_hook(
            lambda m, a, out: self.gather(out) if self.active else None
        )
        self._undo.append(handle.remove)
        for pattern in self.plan.attention:
            for name in _matching(pattern, modules):
                self._span(modules[name])

    def remove(self) -> None:
        """Undo :func:`apply_sequence_parallel`: the model computes on one device again."""
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()

    def _on_inputs(self, module: torch.nn.Module, starts: bool, named: Mapping[str, Cut]) -> None:
        signature = inspect.signature(module.forward)
        # a stream is measured by its one-stream cuts, so those come first
        order = sorted(named.items(), key=lambda item: len(item[1].streams))

        def hook(mod: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if not self.active:
                return None
            if starts:
                self.lengths = {}
            bound = signature.bind(*args, **kwargs)
            for arg, cut in order:
                if arg in bound.arguments:
                    bound.arguments[arg] = self.cut(bound.arguments[arg], cut)
            return bound.args, bound.kwargs

        handle = module.register_forward_pre_hook(hook, with_kwargs=True, prepend=starts)
        self._undo.append(handle.remove)

    def _on_outputs(self, module: torch.nn.Module, indexed: Mapping[int, Cut]) -> None:
        def hook(mod: torch.nn.Module, args: tuple, out: Any) -> Any:
            if not self.active:
                return None
            items = list(out)
            for i, cut in indexed.items():
                items[i] = self.cut(items[i], cut)
            return type(out)(items)

        handle = module.register_forward_hook(hook)
        self._undo.append(handle.remove)

    def _span(self, attn: torch.nn.Module) -> None:
        inner = attn.processor
        _route_attention(sys.modules[type(inner).__module__])
        attn.processor = _SpanningProcessor(inner, self)
        self._undo.append(lambda: setattr(attn, "processor", inner))


def _matching(pattern: str, modules: Mapping[str, torch.nn.Module]) -> list[str]:
    return [name for name in modules if _module_matches(pattern, name)]


class _SpanningProcessor:
    """An attention processor whose attention spans the sequence-parallel group: the
    backbone's own processor, run with :data:`_SPANNING` set."""

    def __init__(self, inner: Any, owner: SequenceParallel) -> None:
        self.inner = inner
        self.owner = owner
        # diffusers reads the processor's signature to choose which arguments to pass
        self.__call__ = functools.wraps(inner.__call__)(lambda *a, **k: self._call(*a, **k))

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if not self.owner.active:
            return self.inner(*args, **kwargs)
        token = _SPANNING.set(self.owner)
        try:
            return self.inner(*args, **kwargs)
        finally:
            _SPANNING.reset(token)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


#: modules whose attention calls go through :func:`_route_attention`'s routing
_ROUTED: set[str] = set()


def _route_attention(module: Any) -> None:
    """Make the attention calls of a processor's module (diffusers' ``dispatch_attention_fn``
    or ``F.scaled_dot_product_attention``) span the group while :data:`_SPANNING` is set;
    outside a spanning processor they are the module's own, untouched."""
    if module.__name__ in _ROUTED:
        return
    if hasattr(module, "dispatch_attention_fn"):
        own = module.dispatch_attention_fn

        def dispatch(query, key, value, attn_mask=None, *args, **kwargs):  # [B, S, H, D]
            owner = _SPANNING.get()
            if owner is None:
                return own(query, key, value, attn_mask, *args, **kwargs)
            run = lambda q, k, v, m: own(q, k, v, m, *args, **kwargs)  # noqa: E731
            return owner.attend(run, query, key, value, attn_mask, heads_first=False)

        module.dispatch_attention_fn = dispatch
    elif getattr(module, "F", None) is torch.nn.functional:
        module.F = _SpanningFunctional()
    else:
        raise DigenError(
            f"sequence parallelism does not know how {module.__name__}'s attention is called."
        )
    _ROUTED.add(module.__name__)


class _SpanningFunctional:
    """``torch.nn.functional`` with its ``scaled_dot_product_attention`` [B, H, S, D]
    spanning the group while :data:`_SPANNING` is set."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)

    @staticmethod
    def scaled_dot_product_attention(query, key, value, attn_mask=None, *args, **kwargs):
        own = torch.nn.functional.scaled_dot_product_attention
        owner = _SPANNING.get()
        if owner is None:
            return own(query, key, value, attn_mask, *args, **kwargs)
        run = lambda q, k, v, m: own(q, k, v, m, *args, **kwargs)  # noqa: E731
        return owner.attend(run, query, key, value, attn_mask, heads_first=True)


def apply_sequence_parallel(
    adapter: DiffusionAdapter, group: Any = None, module: torch.nn.Module | None = None
) -> SequenceParallel:
    """Split ``adapter``'s transformer (or ``module``, another copy of it, such as a frozen
    reference) over the members of ``group`` (None: the default group) along its tokens;
    every member must call this, then run the same passes."""
    plan = adapter.sequence_plan
    if plan is None:
        raise DigenError(f"{adapter.name} has no sequence plan: it cannot run sequence-parallel.")
    sp = SequenceParallel(module if module is not None else adapter.transformer, plan, group)
    if sp.size > 1:
        sp.install()
    return sp


# --- CFG parallelism --------------------------------------------------------------------


@dataclass(frozen=True)
class CfgBranch:
    """This device's branch of classifier-free guidance (member 0 of ``group``: the prompt's,
    member 1: the negative prompt's), a :class:`~digen.models.parallel.GuidanceBranch`."""

    group: Any
    index: int

    def exchange(self, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        both = _Exchange.apply(mine, self.group, self.index)  # [2, B, ...]
        return both[0], both[1]


class _Exchange(torch.autograd.Function):
    """Forward: both branches' velocities, stacked, on both devices. Backward: the gradient
    of this device's own branch (both devices' losses are the same function of the pair, so
    their gradients, summed, are one device's)."""

    @staticmethod
    def forward(ctx: Any, mine: torch.Tensor, group: Any, index: int) -> torch.Tensor:
        ctx.index = index
        shape = tuple(mine.shape)
        return torch.stack(_all_to_all([mine.contiguous()] * 2, [shape, shape], group))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad[ctx.index], None, None


def apply_cfg_parallel(adapter: DiffusionAdapter, group: Any) -> CfgBranch:
    """Run ``adapter``'s guidance with its two branches on the two members of ``group``."""
    group = process_group(group)
    if group.size() != 2:
        raise DigenError("CFG parallelism needs a group of exactly 2 devices.")
    branch = CfgBranch(group, group.rank())
    adapter.guidance_branch = branch
    return branch


def split_generation_group(cfg: int, sequence: int, ranks: list[int] | None = None) -> tuple:
    """The groups of a generator group of ``cfg x sequence`` devices (``ranks`` of the
    default group, None: all of them): ``(sequence_group, cfg_group)`` of the calling rank,
    None where the degree is 1. Members ``c * sequence .. (c + 1) * sequence - 1`` run
    guidance branch ``c`` sequence-parallel. Every rank of the default group must call it
    (making a group is collective)."""
    ranks = list(range(dist.get_world_size())) if ranks is None else list(ranks)
    if cfg not in (1, 2) or sequence < 1 or cfg * sequence != len(ranks):
        raise DigenError(
            f"a generator group of {len(ranks)} devices cannot run {cfg}-way CFG parallelism "
            f"times {sequence}-way sequence parallelism."
        )
    me = dist.get_rank()
    seq_group = cfg_group = None
    for c in range(cfg):
        members = ranks[c * sequence : (c + 1) * sequence]
        group = dist.new_group(members) if sequence > 1 else None
        if me in members:
            seq_group = group
    for s in range(sequence):
        members = [ranks[c * sequence + s] for c in range(cfg)]
        group = dist.new_group(members) if cfg > 1 else None
        if me in members:
            cfg_group = group
    return seq_group, cfg_group
