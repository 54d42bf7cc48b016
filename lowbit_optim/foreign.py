"""State tensors of other libraries in checkpoints, read as lowbit_optim states so that their runs
resume here: torchao's OptimState8bit, OptimState4bit and OptimStateFp8.

They are recognized by duck typing (class module and name, attribute names), without importing
their library: the package depends on torch only. What they hold comes from a file, so it is
validated before use.
"""

import torch
from torch import Tensor

from . import quant
from .registry import get_format
from .state import check_block_size

# torchao class name -> (our format holding the same numbers, bits per code)
_TORCHAO = {"OptimState8bit": ("8bit", 8), "OptimState4bit": ("4bit-torchao", 4), "OptimStateFp8": ("fp8", 8)}


def from_foreign(state: Tensor, signed: bool) -> Tensor:
    """``state`` unchanged unless another library wrote it. A torchao state becomes the state of our
    equivalent format over the same codes and scales where the layouts coincide (training resumes
    bit-exactly), else a plain fp32 tensor of the values it stands for. ``signed`` is what the
    optimizer expects; a state recording its own signedness keeps it."""
    cls = type(state)
    if not cls.__module__.startswith("torchao.") or cls.__name__ not in _TORCHAO:
        return state
    name, bits = _TORCHAO[cls.__name__]
    fmt, fp8 = get_format(name), name == "fp8"
    codes, scale, signed = state.codes, state.scale, getattr(state, "signed", signed)
    what = f"torchao {cls.__name__} of shape {tuple(state.shape)} in this checkpoint"
    if fp8 and not (codes.dtype.is_floating_point and codes.dtype.itemsize == 1):
        raise ValueError(f"{what} has codes of dtype {codes.dtype}, not a float8 dtype")
    if not fp8 and codes.dtype != torch.uint8:
        raise ValueError(f"{what} has codes of dtype {codes.dtype}, not uint8")
    if scale.dtype != torch.float32 or scale.dim() != 1:
        raise ValueError(f"{what} has scales of dtype {scale.dtype} and shape {tuple(scale.shape)}, not a 1-D float32 tensor")
    blocks, numel = scale.numel(), state.numel()
    # torchao quantizes only whole blocks: every block full, no padding
    if blocks == 0 or numel % blocks or codes.numel() * 8 != numel * bits:
        raise ValueError(
            f"{what} has {codes.numel()} bytes of {bits}-bit codes and {blocks} block scales, which do not "
            f"cover {numel} elements in whole blocks"
        )
    block_size = numel // blocks
    codes = codes.reshape(-1)
    if fp8:
        exact = codes.dtype == fmt.fp8_dtype
    else:
        table = state.qmap
        if table.dtype != torch.float32 or table.shape != (2**bits,):
            raise ValueError(f"{what} has a code table of dtype {table.dtype} and shape {tuple(table.shape)}, not {2**bits} float32 values")
        ours = fmt.decode(torch.arange(2**bits, dtype=torch.uint8, device=table.device), signed)
        exact = torch.equal(table, ours)
    if exact and _valid_block_size(block_size, bits):
        codes = codes.view(torch.uint8)  # fp8: ours are the e4m3 bit patterns
        return fmt(codes, scale, state.shape, block_size, signed, dtype=state.dtype)
    # no format of ours holds these codes: the values they stand for, requantized by the caller
    if fp8:
        values = codes.float()
    else:
        values = quant.decode_codebook(quant.unpack_nibbles(codes) if bits == 4 else codes, table)
    return (values.view(blocks, block_size) * scale[:, None]).view(state.shape)


def _valid_block_size(block_size: int, bits: int) -> bool:
    try:
        check_block_size(block_size, bits)
    except ValueError:
        return False
    return True
