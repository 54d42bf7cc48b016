"""FSDP2 / DTensor support: sharded states and distributed checkpoints that reshard.

Sharded parameters. The state of a DTensor parameter is a DTensor with the parameter's mesh and
placements whose local tensor is the state of the LOCAL shard (an OptimState, or a plain tensor for
fp32/bf16), padded to whole blocks on its own. Whether and how a parameter is quantized depends on its
global shape only. The compiled step runs on local tensors, so it is the same graph as without FSDP.

Checkpoints (``torch.distributed.checkpoint``). DCP saves every state as the chunk of the global tensor
that each rank holds and, on load, copies the overlaps between saved and wanted chunks (resharding).
A quantized state cannot be cut at arbitrary rows: its blocks start where its shard starts, so after a
change of world size the saved blocks and the wanted blocks need not line up. DCP therefore reads and
writes a quantized state through a ``ShardView`` (``OptimState.__get_tensor_shard__``): the state plus
a window of rows, which can be cut anywhere. The checkpoint holds each rank's codes and scales exactly
as they are (no size overhead). Copying a saved window into a wanted one:

- blocks that line up (same format and block size, same position within a block) copy their codes and
  scale: bit-exact. That is every block when the world size is unchanged, and every block for any
  world size when shard boundaries fall on block boundaries (e.g. a row's numel is a multiple of the
  block size, as for transformer weights);
- other elements are staged with their code and scale until their block is complete; a block whose
  elements all share one scale takes their codes and that scale (exact values again), a block that
  mixes saved blocks is requantized from the exact saved values (at most half a code step of error;
  no single-scale block can hold values from two scales exactly);
- a state's inner tensors that describe it whole (``whole_state_names``: 10bit-sr's count of writes)
  are copied as saved, so that its stochastic rounding draws on as it would have.

A state whose blocks are not independent (``8bit-lowrank``: a low-rank part spans every row) is
loaded whole instead: from the same state saved whole (an unchanged world size) it copies every inner
tensor, bit-exact; otherwise its saved values are staged until every element has come, then written
``WHOLE_STATE_WRITES`` times (each write one more step of the low-rank part's subspace iteration on
those values, so the part settles on their strongest directions, as the saved states' had).
"""

import sys

import torch
from torch import Tensor
from torch.utils._python_dispatch import return_and_correct_aliasing

from . import quant
from .state import COPY_SOURCES, PLAIN_TENSOR_TYPES, OptimState, StateTensor, describe_tensor, from_file, slice_bounds

aten = torch.ops.aten

# writes of a resharded low-rank state's values: subspace-iteration steps from a fixed start
WHOLE_STATE_WRITES = 8


def _dtensor_class():
    # no import: until torch.distributed.tensor is loaded (by FSDP2 or the user) no DTensor can exist,
    # and importing it costs seconds
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(t) -> bool:
    if type(t) in PLAIN_TENSOR_TYPES:  # the common case, answered without looking the module up (the step asks per tensor)
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def laid_out_like(grad, param):
    """``grad`` with ``param``'s placements: a gradient that sequence parallelism leaves Partial (a
    Replicate parameter's, summed over the ranks' shards of the sequence) reduced, as torch.optim's
    DTensor arithmetic reduces it; its local tensor alone was each rank's part of the sum."""
    if is_dtensor(grad) and is_dtensor(param) and tuple(grad.placements) != tuple(param.placements):
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def is_sharded(t) -> bool:
    """Whether ``t`` is a DTensor that each rank holds a part of (not replicated on every rank)."""
    return is_dtensor(t) and any(placement.is_shard() for placement in t.placements)


def local(t):
    """The local shard of a DTensor; anything else unchanged."""
    return t.to_local() if is_dtensor(t) else t


def like_param(state: Tensor, param: Tensor) -> Tensor:
    """Wrap a state built for ``param``'s local shard as a DTensor laid out like ``param``."""
    if not is_dtensor(param):
        return state
    # shape and stride explicitly: with uneven shards the local shapes differ between ranks
    return _dtensor_class().from_local(
        state, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def map_local(fn, t: Tensor) -> Tensor:
    """``fn`` applied to the local shard of a DTensor (re-wrapped with the same layout), or to ``t``."""
    if not is_dtensor(t):
        return fn(t)
    shard = t.to_local()
    out = fn(shard)
    return t if out is shard else like_param(out, t)


# ------------------------------------------------------------------------------------------------
# ShardView: what torch.distributed.checkpoint reads and writes for a quantized state
# ------------------------------------------------------------------------------------------------


class ShardView(Tensor):
    """Rows ``[start, stop)`` of a quantized state, as DCP sees it: cut anywhere along dim 0 (a new
    window, no data moves); ``copy_`` between views transfers codes and scales (see the module doc)."""

    state: OptimState
    start: int
    stop: int

    @staticmethod
    def __new__(cls, state: OptimState, start: int = 0, stop: int | None = None):
        stop = _rows(state) if stop is None else stop
        shape = (stop - start, *state.shape[1:]) if state.dim() else ()
        return Tensor._make_wrapper_subclass(cls, shape, dtype=state.dtype, device=state.device)

    def __init__(self, state: OptimState, start: int = 0, stop: int | None = None):
        self.state = state
        self.start = start
        self.stop = _rows(state) if stop is None else stop

    def __repr__(self):
        return f"ShardView({self.state!r}, rows=[{self.start}:{self.stop}])"

    @property
    def elements(self) -> tuple[int, int]:
        """The window as a range of the state's flat elements."""
        row = _row_numel(self.state)
        return self.start * row, self.stop * row

    def values(self) -> Tensor:
        """The window's dequantized fp32 values, flat."""
        first, last = self.elements
        if not self.state.independent_blocks:
            return self.state.dequantize(torch.float32).reshape(-1)[first:last]
        return _element_values(self.state, first, last)

    @property
    def whole(self) -> bool:
        return self.start == 0 and self.stop == _rows(self.state)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        view = args[0]
        if func in (aten.detach.default, aten.alias.default):
            # the same state object: DCP detaches the target before copying into it
            return return_and_correct_aliasing(func, args, kwargs, ShardView(view.state, view.start, view.stop))
        if func is aten.slice.Tensor:
            return return_and_correct_aliasing(func, args, kwargs, _slice_view(*args, **kwargs))
        if func is aten.copy_.default:
            _copy_into(args[0], args[1])
            return args[0]
        if func is aten.clone.default:
            return ShardView(view.state.clone(), view.start, view.stop)
        if func is aten._to_copy.default:
            return ShardView(func(view.state, **kwargs), view.start, view.stop)  # e.g. .cpu() before writing
        if func is aten.is_pinned.default:
            return view.state.is_pinned()
        raise NotImplementedError(f"ShardView (a quantized state as torch.distributed.checkpoint sees it) does not support {func}")


torch.serialization.add_safe_globals([ShardView])  # DCP loads checkpoints with weights_only=True


def _shard_view(state: OptimState, index) -> ShardView:
    # needed by dcp.save / dcp.load (also through DTensor, which asks its local tensor): they read and
    # write the state through a view that can be cut at any row, so checkpoints reshard
    return ShardView(state)


OptimState.__get_tensor_shard__ = _shard_view  # registered here: state.py knows nothing of DCP
COPY_SOURCES[ShardView] = lambda view, dst: _checked(view, getattr(dst, "signed", None)).values().view(view.shape)


def _checked(view: ShardView, signed: bool | None) -> ShardView:
    """``view``, a copy's source: as read from a checkpoint file, its state checked as a loaded one
    (StateTensor.check_loaded, and of the destination's signedness where it has one) before anything
    reads its codes, once (a resharded state is copied into several windows), and its window inside it."""
    state = view.state
    try:
        if not isinstance(state, StateTensor):
            raise ValueError(f"it holds {describe_tensor(state)}, not a state")
        if from_file(state):  # (a live state is this process's own, as every state it steps)
            state.check_loaded(signed)
        if not all(type(i) is int for i in (view.start, view.stop)) or not 0 <= view.start <= view.stop <= _rows(state):
            raise ValueError(f"its window, rows {view.start!r} to {view.stop!r}, is not inside its {_rows(state)} rows")
    except ValueError as error:
        raise ValueError(f"a quantized state in the checkpoint is corrupt: {error}") from None
    return view


def _rows(state: Tensor) -> int:
    return state.shape[0] if state.dim() else 1


def _row_numel(state: Tensor) -> int:
    rows = _rows(state)
    return state.numel() // rows if rows else 0


def _slice_view(view: ShardView, dim: int = 0, start=None, end=None, step: int = 1) -> ShardView:
    rows = view.stop - view.start
    if dim != 0 or step != 1:
        raise NotImplementedError(
            f"a quantized optimizer state can only be resharded along dim 0 (FSDP2's default Shard(0)); got dim={dim}, step={step}"
        )
    start, end = slice_bounds(start, end, rows)
    return ShardView(view.state, view.start + start, view.start + end)


def _codes_unpacked(state: OptimState, first_block: int, end_block: int) -> Tensor:
    per_block = state.block_size * state.bits // 8
    codes = state.codes[first_block * per_block : end_block * per_block]
    return quant.unpack_codes(codes, state.bits, state.block_size)


def _element_codes_and_scales(state: OptimState, first: int, last: int) -> tuple[Tensor, Tensor]:
    """Per-element codes (unpacked) and block scales of flat elements [first, last)."""
    bs = state.block_size
    first_block, end_block = first // bs, quant.num_blocks(last, bs)
    offset = first - first_block * bs
    codes = _codes_unpacked(state, first_block, end_block)[offset : offset + last - first]
    scales = state.scale[first_block:end_block].repeat_interleave(bs)[offset : offset + last - first]
    return codes, scales


def _element_values(state: OptimState, first: int, last: int) -> Tensor:
    codes, scales = _element_codes_and_scales(state, first, last)
    return state.decode(codes, state.signed) * scales


def _copy_into(dst, src) -> None:
    """DCP's ``target.copy_(saved)``, where either side may be a ShardView."""
    if isinstance(src, ShardView):
        _checked(src, dst.state.signed if isinstance(dst, ShardView) else None)
    if not isinstance(dst, ShardView):  # a quantized checkpoint into a plain (fp32 / bf16) state
        dst.copy_(src.values().view(dst.shape))
        return
    if dst.shape != src.shape:
        raise RuntimeError(f"copy_ into {dst!r} from shape {tuple(src.shape)}: shapes must match")
    state = dst.state
    if isinstance(src, ShardView):  # a count of writes: the saved state's, so that its draws go on as they would have
        for name in set(state.whole_state_names) & set(src.state.whole_state_names):
            getattr(state, name).copy_(getattr(src.state, name))
    t0, t1 = dst.elements
    if t1 == t0:
        return
    if not state.independent_blocks:
        _copy_into_whole(dst, src)
        return
    if not isinstance(src, ShardView):  # a plain checkpoint (e.g. torch.optim.AdamW's fp32 state)
        _stage(state, t0, t1, src.detach().reshape(-1).float(), None, None)
        return
    if not src.state.independent_blocks:  # a low-rank checkpoint: its values, not its codes alone
        _stage(state, t0, t1, src.values(), None, None)
        return
    source = src.state
    s0, _ = src.elements
    bs = state.block_size
    n = state.numel()
    begin, end = t0, t1  # what is left to stage
    if type(source) is type(state) and source.block_size == bs and source.signed == state.signed and (t0 - s0) % bs == 0:
        # blocks at the same position within a block: copy their codes and scales as they are
        first_block = quant.num_blocks(t0, bs)
        end_block = t1 // bs + (1 if t1 == n and t1 % bs else 0)  # the last, partial block lines up too
        if end_block > first_block:
            src_block = (first_block * bs - t0 + s0) // bs
            count = end_block - first_block
            per_block = bs * state.bits // 8
            state.codes[first_block * per_block : end_block * per_block] = source.codes[src_block * per_block : (src_block + count) * per_block]
            state.scale[first_block:end_block] = source.scale[src_block : src_block + count]
            _stage_source(state, t0, first_block * bs, source, s0)
            begin = min(end_block * bs, t1)
            s0 += begin - t0
    _stage_source(state, begin, end, source, s0)


def _copy_into_whole(dst: ShardView, src) -> None:
    """``_copy_into`` for a state whose blocks are not independent (module doc): its inner tensors from
    the same state saved whole, else its values written whole once they have all come."""
    state = dst.state
    if isinstance(src, ShardView) and dst.whole and src.whole and type(src.state) is type(state):
        source = src.state
        if source.shape == state.shape and source._meta() == state._meta():
            for name in state.inner_names:
                getattr(state, name).copy_(getattr(source, name))
            return
    first, last = dst.elements
    values = src.values() if isinstance(src, ShardView) else src.detach().reshape(-1).float()
    staging = getattr(state, "_dcp_staging", None)
    if staging is None:
        n = state.numel()
        staging = state._dcp_staging = {
            "values": torch.zeros(n, dtype=torch.float32, device=state.device),
            "covered": torch.zeros(n, dtype=torch.bool, device=state.device),
        }
    staging["values"][first:last] = values
    staging["covered"][first:last] = True
    if bool(staging["covered"].all()):
        del state._dcp_staging
        counts = {name: getattr(state, name).clone() for name in state.whole_state_names}  # as saved: these writes are not steps
        for _ in range(WHOLE_STATE_WRITES):
            state.quantize_(staging["values"].view(state.shape))
        for name, saved in counts.items():
            getattr(state, name).copy_(saved)


def _stage_source(state: OptimState, first: int, last: int, source: OptimState, source_first: int) -> None:
    if last <= first:
        return
    codes, scales = _element_codes_and_scales(source, source_first, source_first + last - first)
    values = source.decode(codes, source.signed) * scales
    same_codebook = type(source) is type(state) and source.signed == state.signed
    _stage(state, first, last, values, codes if same_codebook else None, scales if same_codebook else None)


def _stage(state: OptimState, first: int, last: int, values: Tensor, codes: Tensor | None, scales: Tensor | None) -> None:
    """Hold elements [first, last) of ``state`` until their blocks are complete, then write those blocks."""
    bs, device = state.block_size, state.codes.device
    staging = getattr(state, "_dcp_staging", None)
    if staging is None:
        n = state.numel()
        staging = state._dcp_staging = {
            "values": torch.zeros(n, dtype=torch.float32, device=device),
            "codes": torch.zeros(n, dtype=quant.code_dtype(state.bits), device=device),
            "scales": torch.zeros(n, dtype=torch.float32, device=device),
            "exact": torch.zeros(n, dtype=torch.bool, device=device),  # code and scale known, in this state's codebook
            "covered": torch.zeros(n, dtype=torch.bool, device=device),
            "waiting": torch.zeros(state.scale.numel(), dtype=torch.bool, device=device),  # blocks with staged elements
        }
    staging["values"][first:last] = values
    staging["covered"][first:last] = True
    staging["exact"][first:last] = codes is not None
    if codes is not None:
        staging["codes"][first:last] = codes
        staging["scales"][first:last] = scales
    first_block, end_block = first // bs, quant.num_blocks(last, bs)
    staging["waiting"][first_block:end_block] = True
    _finish_blocks(state, staging, torch.arange(first_block, end_block, device=device))
    if not bool(staging["waiting"].any()):
        del state._dcp_staging


def _finish_blocks(state: OptimState, staging: dict, blocks: Tensor) -> None:
    """Write those of ``blocks`` whose elements have all been staged."""
    bs, n, device = state.block_size, state.numel(), state.codes.device
    index = blocks[:, None] * bs + torch.arange(bs, device=device)
    real = index < n  # the last block is partial
    index = index.clamp(max=n - 1)
    complete = (staging["covered"][index] | ~real).all(dim=1)
    if not bool(complete.any()):
        return
    blocks, index, real = blocks[complete], index[complete], real[complete]
    # requantized, as quantize_ would do it (padding elements are zeros)
    fresh = type(state).zeros(index.numel(), state.signed, bs, device=device)
    fresh.quantize_(torch.where(real, staging["values"][index], 0.0).view(-1))
    codes = fresh.unpacked_codes().view(-1, bs)
    scale = fresh.scale
    # exact instead where every element carries a code of this codebook and all share one scale
    scales = staging["scales"][index]
    same_scale = ((scales.view(torch.int32) == scales[:, :1].view(torch.int32)) | ~real).all(dim=1)
    exact = same_scale & (staging["exact"][index] | ~real).all(dim=1)
    codes = torch.where(exact[:, None] & real, staging["codes"][index], codes)
    scale = torch.where(exact, scales[:, 0], scale)
    per_block = bs * state.bits // 8
    packed = quant.pack_codes(codes.reshape(-1), state.bits, bs)
    state.codes[(blocks[:, None] * per_block + torch.arange(per_block, device=device)).view(-1)] = packed
    state.scale[blocks] = scale
    staging["waiting"][blocks] = False


def shard_like(value: Tensor, param: Tensor) -> Tensor:
    """A full checkpoint value for a DTensor parameter, sharded like it (each rank keeps its part)."""
    if not is_dtensor(param) or is_dtensor(value):
        return value
    from torch.distributed.tensor import distribute_tensor

    if isinstance(value, StateTensor):  # a quantized full state: cut its exact values, requantized per shard
        value = value.dequantize(torch.float32)
    return distribute_tensor(value, param.device_mesh, param.placements, src_data_rank=None)
