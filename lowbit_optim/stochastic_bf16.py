"""StochasticBF16State (``bf16-sr``): a state in bf16, each write rounded stochastically.

bf16 keeps 8 significant bits. A slow moving average (AdEMAMix's beta2 = 0.999 second moment, its
beta3 = 0.9999 slow momentum) moves by 0.1 % or 0.01 % of itself per step, below half of bf16's
spacing, so rounding to nearest stalls it: AdEMAMix's training loss +127 % with ``exp_avg_sq`` in
bf16 (README, "AdEMAMix state by state"). Rounded stochastically, up with probability equal to the
dropped fraction, a state is unbiased and follows the average; with 8 significant bits its noise
stays below the average's own: -0.35 % and -0.01 % there (benchmarks/state_precision.py).

The random numbers are ``quant.dither``'s hash of each value's bits and its place in its block of
``HASH_BLOCK`` elements, salted by the block's index and by ``writes``, a count of the state's
writes that it keeps (8 bytes per state): every step draws anew, and a run repeats bit for bit and
draws nothing from torch's random stream. The 8- and 4-bit stochastic formats salt with their block
scale instead, which moves every step in training; a slow average's absmax may not, and then its
draws repeat: with the absmax as salt, a beta 0.999 average of low-noise targets ended 13.7 % short,
with the count within 0.02 % (test_stochastic_bf16.py). Each element is stored alone (no scale): 2 bytes per value. The fused
CPU kernel steps it (csrc/stochastic.h), bit for bit as the compiled step.
"""

import functools
import inspect

import torch
from torch import Tensor

from . import quant
from .state import KernelLayout, StateTensor, computes_as, extend_fingerprint

HASH_BLOCK = 256  # elements per hash block (a value's place in it enters the hash)
# the salt of block b after w writes: (w * WRITES_MIX + b * BLOCK_MIX) mod 2**22 (the fused kernel's too).
# Odd multipliers of 22 bits, as only those bits count: on a GPU inductor multiplies a block index in
# the kernel's int32 index arithmetic, where Triton refuses a constant of 2**31 or more (seen on an
# H100). Wrapping there keeps the low bits, so the salt is the CPU's.
WRITES_MIX = 0x9E3779B1 & 0x3FFFFF
BLOCK_MIX = 0x85EBCA77 & 0x3FFFFF


def round_bf16_stochastically(x: Tensor, writes: Tensor) -> Tensor:
    """fp32 ``x`` (1-D) as bf16, rounded up (in magnitude) with probability equal to the fraction of
    a bf16 spacing it lies above the value below, the draws salted by ``writes`` (an int64 count);
    NaN and infinities as bf16 conversion gives them."""
    count = quant.num_blocks(x.numel(), HASH_BLOCK)
    blocks = quant.to_blocks(x, HASH_BLOCK, count * HASH_BLOCK)
    u = quant.dither(blocks, write_salt(writes, count)).view(-1)[: x.numel()]
    bits = x.view(torch.int32)
    # adding u * 2**16 to the 16 bits bf16 drops carries into the kept ones exactly when the dropped
    # fraction exceeds u (sign-magnitude: the same for negative values)
    rounded = ((bits + (u * 65536.0).to(torch.int32)) >> 16).to(torch.int16).view(torch.bfloat16)
    return torch.where(torch.isfinite(x), rounded, x.to(torch.bfloat16))


def write_salt(writes: Tensor, blocks: int) -> Tensor:
    """The salt ``quant.dither`` takes in place of a block's scale, for each of ``blocks`` blocks of a
    state written ``writes`` times (an int64 count, this write included): a value that comes back
    draws anew on every write, where a scale that did not move would draw the same again."""
    index = torch.arange(blocks, dtype=torch.int64, device=writes.device)
    # in the 22 bits above the 10 that dither drops, as fp32 bits (dither reads a scale's)
    return ((((writes * WRITES_MIX + index * BLOCK_MIX) & 0x3FFFFF) << 10) - (1 << 31)).to(torch.int32).view(torch.float32)


def write_salt_fingerprint() -> str:
    """write_salt's source and constants (the dither's, in quant.py, every format's fingerprint
    hashes): for the numerics fingerprint of a format that salts its draws with write_salt."""
    return inspect.getsource(write_salt) + str((WRITES_MIX, BLOCK_MIX))


# write_salt is linear in the count and the block index mod 2**22, and WRITES_MIX is odd (invertible):
# a count larger by this much salts block b as the original count salts block b + 1
WRITES_PER_BLOCK = BLOCK_MIX * pow(WRITES_MIX, -1, 1 << 22) % (1 << 22)


def writes_from_block(writes: Tensor, first_block: int) -> Tensor:
    """A count whose salts for blocks 0, 1, ... are those of ``writes`` for blocks ``first_block``,
    ``first_block`` + 1, ... (a new tensor): a slice of a state that starts at that block and counts
    it draws as the whole state does there (base._pieces)."""
    return (writes + first_block * WRITES_PER_BLOCK) & 0x3FFFFF


class StochasticBF16State(StateTensor):
    """A state stored as bf16 values written with stochastic rounding (module docstring)."""

    name = "bf16-sr"
    bits = 16
    inner_names = ("values", "writes")
    whole_state_names = ("writes",)
    inner_dtypes = (torch.bfloat16, torch.int64)
    default_block_size = None  # no blocks: block_size is accepted and ignored
    stochastic = True

    values: Tensor
    writes: Tensor  # (1,): how many times the state was written

    @staticmethod
    def __new__(cls, values: Tensor, writes: Tensor, shape, signed: bool = True, dtype=torch.float32):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=values.device)

    def __init__(self, values: Tensor, writes: Tensor, shape, signed: bool = True, dtype=torch.float32):
        super().__init__()
        self.values, self.writes = values, writes
        self.signed = signed
        self.block_size = None

    @classmethod
    def zeros(cls, shape, signed: bool | None = None, block_size: int | None = None, device=None, dtype=None):
        signed = cls.signedness(signed)
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        values, writes = torch.zeros(shape.numel(), dtype=torch.bfloat16, device=device), torch.zeros(1, dtype=torch.int64, device=device)
        return cls(values, writes, shape, signed, dtype or torch.float32)

    def _meta(self) -> tuple:
        return (self.signed,)

    def _check_sizes(self) -> None:
        if self.values.numel() != self.numel() or self.writes.numel() != 1:
            raise ValueError(f"values has {self.values.numel()} elements and writes {self.writes.numel()}, not {self.numel()} and 1")

    @classmethod
    @functools.cache
    def _numerics_fingerprint(cls, signed: bool) -> str:
        # the rounding lives in module functions: a change there must not reuse graphs compiled before it
        text = inspect.getsource(round_bf16_stochastically) + str(HASH_BLOCK) + write_salt_fingerprint()
        return extend_fingerprint(super()._numerics_fingerprint(signed), text)

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        return KernelLayout("bf16-sr") if computes_as(cls, StochasticBF16State, "quantize_", "dequantize") else None

    @property
    def slice_unit(self) -> int | None:
        # its draws' blocks: a slice from one, with later_slice's count, rounds as the whole
        return HASH_BLOCK if self._later_slices_fit() else None

    def later_slice(self, first_block: int) -> "StochasticBF16State":
        return self._like(writes=writes_from_block(self.writes, first_block))

    def quantize_(self, x: Tensor) -> None:
        self.writes.add_(1)
        self.values.copy_(round_bf16_stochastically(x.float().reshape(-1), self.writes))

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        # a copy, also in bf16: an in-place op on it must not write round-to-nearest values into the state
        return self.values.view(self.shape).to(dtype or self.dtype, copy=True)

    def _rows(self, start: int, end: int) -> "StochasticBF16State":
        row_numel = self.numel() // self.shape[0] if self.dim() and self.shape[0] else 0
        values = self.values[start * row_numel : end * row_numel]
        return type(self)(values, self.writes, (end - start, *self.shape[1:]), self.signed, self.dtype)  # one count per state
