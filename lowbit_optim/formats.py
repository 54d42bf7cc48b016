"""The concrete state formats, registered under their short names (registry.py).

A quantized format is a small OptimState subclass; a plain format (fp32, bf16) is an ordinary
tensor dtype behind the same interface, so the optimizer treats every format alike.
"""

import functools
import inspect

import torch
from torch import Tensor

from . import foreign, quant
from .registry import get_format, register_format, registered_formats
from .state import SCALED_AS_THE_KERNEL, CodebookState, KernelLayout, OptimState, StateTensor, check_block_size, computes_as, extend_fingerprint


def paired_state_format(name: str, exp_avg: str = "4bit", optimizer: type | None = None):
    """Format ``name`` as the ``state_format`` of ``optimizer`` (a class; None: Adam's states): the
    name itself, or for a format that holds only nonnegative states (``factored``) a per-state dict,
    ``name`` for the nonnegative states and ``exp_avg`` for the signed ones (Adam's
    ``{"exp_avg": exp_avg, "exp_avg_sq": name}``). Where all of the optimizer's states are signed
    (SGD, Lion, Muon), the name itself, which the optimizer refuses with its reason."""
    if get_format(name).holds_signed:
        return name
    if optimizer is None:
        return {"exp_avg": exp_avg, "exp_avg_sq": name}
    keys = [s for s in optimizer.states if s.follows is None]  # the keys a per-state dict names
    if all(s.signed for s in keys):
        return name
    return {s.name: exp_avg if s.signed else name for s in keys}


def paired_label(name: str) -> str:
    """A short name for ``paired_state_format(name)``: "factored" pairs as "4bit+factored"."""
    spec = paired_state_format(name)
    return spec if isinstance(spec, str) else f"{spec['exp_avg']}+{name}"


def is_quantized(fmt) -> bool:
    """Whether ``fmt`` is a compressed format (a state subclass), not a plain dtype."""
    return isinstance(fmt, type) and issubclass(fmt, StateTensor)


def is_blockwise(fmt) -> bool:
    """Whether ``fmt`` stores codes and a scale per block (and so takes a ``block_size``)."""
    return isinstance(fmt, type) and issubclass(fmt, OptimState)


class PlainFormat:
    """Unquantized state held as an ordinary tensor of ``dtype``."""

    bits: int
    default_block_size = None
    holds_signed = True
    holds_elements = True
    max_signed_decay = None

    def __init__(self, name: str, dtype: torch.dtype):
        self.name, self.dtype = name, dtype
        self.bits = torch.finfo(dtype).bits
        register_format(self)

    def zeros(self, shape, signed: bool = True, block_size=None, device=None, dtype=None) -> Tensor:
        return torch.zeros(shape, dtype=self.dtype, device=device)

    def from_float(self, x: Tensor, signed: bool = True, block_size=None) -> Tensor:
        return x.detach().to(self.dtype, copy=True)

    def __repr__(self):
        return f"PlainFormat({self.name!r}, {self.dtype})"


FP32 = PlainFormat("fp32", torch.float32)
BF16 = PlainFormat("bf16", torch.bfloat16)


def holds(fmt, state: Tensor, block_size: int | None, signed: bool) -> bool:
    """Whether ``state`` is already stored in ``fmt`` with this block size and signedness."""
    if isinstance(fmt, PlainFormat):
        return not isinstance(state, StateTensor) and state.dtype == fmt.dtype
    return type(state) is fmt and state.block_size == block_size and state.signed == signed


def convert(fmt, state: Tensor, signed: bool, block_size: int | None) -> Tensor:
    """``state`` in format ``fmt`` (unchanged if it already is): how checkpoints change format."""
    state = foreign.from_foreign(state, signed)  # another library's state (torchao's) as ours
    if holds(fmt, state, block_size, signed):
        return state
    if is_blockwise(fmt) and fmt.decodes_as(type(state), signed) and (state.block_size, state.signed) == (block_size, signed):
        return fmt(state.codes, state.scale, state.shape, block_size, signed, dtype=state.dtype)  # its numbers, as they are
    # in fp32 whatever the state's appearance dtype: on an fp16 parameter, fp16 would zero a small
    # second moment and overflow a large one
    values = state.dequantize(torch.float32) if isinstance(state, StateTensor) else state.float()
    return fmt.from_float(values, signed, block_size)


class OptimState8bit(CodebookState):
    """8-bit blockwise state with the dynamic-tree codebook of bitsandbytes and torchao: their codes,
    read as they read them. A block whose most negative value outweighs its largest maps it to the
    lowest code, -0.99297, exactly (quant.block_scales), where they scale every block by its absmax
    and so shrink that value by 0.7 % at each write (``8bit-torchao``)."""

    name = "8bit"
    bits = 8
    default_block_size = 256

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return quant.dynamic_codebook(signed, exponent_bits=7, total_bits=8)


class AbsmaxScales:
    """torchao's and bitsandbytes' block scales: absmax / scale_max whatever the sign of a block's
    extreme, so that a negative one is rounded toward zero to the lowest code at each write (-0.99297
    of the 8-bit tree, -0.8875 of torchao's 4-bit one). Put it before the format in the bases."""

    floors_positive = False  # their nearest code, 0 included

    @classmethod
    def scale_min(cls, signed: bool) -> float:
        return -float(cls.scale_max)


class OptimState4bitTorchao(AbsmaxScales, CodebookState):
    """torchao's (and lpmm's) 4-bit blockwise state: signed dynamic codebook with 3 exponent bits
    for the first moment, linear codebook without zero for the second; codes and numerics
    identical to torchao's OptimState4bit (its block scales too: AbsmaxScales)."""

    name = "4bit-torchao"
    bits = 4
    default_block_size = 128
    whole_blocks_only = True  # as torchao: a tensor that is not whole blocks keeps fp32 state

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        if signed:
            return quant.dynamic_codebook(True, exponent_bits=3, total_bits=4)
        return quant.linear_codebook_without_zero(4)


class OptimStateNF4(OptimState4bitTorchao):
    """4-bit NormalFloat first moment (about half the error of the dynamic codebook on Adam's m,
    benchmarks/results/state_error.md); the second moment as in 4bit-torchao."""

    name = "nf4"
    whole_blocks_only = False  # lowbit_optim's recipes pad a tensor's last block

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return quant.normal_float_codebook(4) if signed else super().codebook(signed)


class OptimState4bitPrecond(OptimState4bitTorchao):
    """4-bit second moment on a codebook linear in sqrt(v) (smallest code 1/256 of the block's
    absmax instead of 1/16), rounded to the code nearest in 1/sqrt(v), the preconditioner the
    update multiplies by, rather than nearest in v; the first moment as in 4bit-torchao."""

    name = "4bit-precond"
    whole_blocks_only = False

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return super().codebook(signed) if signed else quant.squared_linear_codebook_without_zero(4)

    @classmethod
    def rounding_space(cls, values: Tensor, signed: bool) -> Tensor:
        return values if signed else -values.rsqrt()


class OptimState4bitUncalibrated(OptimStateNF4, OptimState4bitPrecond):
    """The NF4 first moment of ``nf4`` with the second moment of ``4bit-precond``, block scales at
    the absmax: ``4bit-calibrated`` without its calibrated second-moment scale."""

    name = "4bit-uncalibrated"


class OptimState4bitCalibrated(OptimState4bitUncalibrated):
    """The 4-bit recipe of releases before stochastic rounding (``4bit`` with format_version 2): NF4
    first moment; second moment on the sqrt-linear codebook, rounded to the nearest code in
    1/sqrt(v), with a calibrated block scale, absmax x <v, v> / <v, Q(v)> (quant.calibrated_scale),
    so rounding does not shift a block's v up or down on average. It tracks fp32 AdamW on the char
    GPT but, like every nearest-rounding recipe, stalls when training is driven to a low loss
    (benchmarks/results/convergence_mlp.md)."""

    name = "4bit-calibrated"

    @classmethod
    def calibrated(cls, signed: bool) -> bool:
        return not signed


class StochasticRounding:
    """A codebook format whose codes are rounded stochastically, so that a state stays unbiased: each
    value becomes one of the two codes around it, the upper one with probability (x - a) / (b - a),
    so that its expected value is x (quant.encode_stochastic). Nearest rounding cannot follow a
    moving average whose step is smaller than half the distance between two codes: with beta2 = 0.999
    a second moment only moves by 0.1 % of itself per step, and a first moment sticks at a code, 0
    included, while gradients are small against its block's absmax.

    The random numbers are a hash of each value's bits, its place in its block and its block's scale
    (quant.dither): a state rounds the same way on every run and after a checkpoint resume, and
    draws nothing from torch's random stream. The eager and compiled steps agree but where an FMA moved a value by an
    ulp and that changed its draw (about 1 in 1024 such values); the fused CPU kernel computes the
    compiled step's codes bit for bit. Put it before the codebook format in the bases."""

    stochastic = True  # codes are not the nearest: tests check unbiased rounding between neighbours instead

    def __init_subclass__(cls, **kwargs):
        mro = cls.__mro__
        if OptimState in mro and CodebookState not in mro:  # its neighbouring codes are a sorted codebook's
            raise TypeError(
                f"{cls.__name__}: StochasticRounding rounds between neighbouring codes of a codebook format (a CodebookState, "
                f"whose codes are sorted by value); {cls.__name__} is none (fp8's codes, for one, are not in value order). "
                "Derive it from a codebook format, e.g. class X(StochasticRounding, OptimState8bit)"
            )
        if CodebookState in mro and mro.index(StochasticRounding) > mro.index(CodebookState):
            # after the codebook format, its nearest-code encode would win: stochastic in name only
            raise TypeError(f"{cls.__name__}: put StochasticRounding before the codebook format in the bases, e.g. class {cls.__name__}(StochasticRounding, OptimState8bit)")
        super().__init_subclass__(**kwargs)

    @classmethod
    def encode(cls, normalized: Tensor, signed: bool) -> Tensor:
        return cls.encode_blocks(normalized, normalized.new_ones(normalized.shape[:-1]), signed)  # rows of scale 1

    @classmethod
    def encode_blocks(cls, normalized: Tensor, scale: Tensor, signed: bool) -> Tensor:
        nearest = super().encode(normalized, signed)
        codebook = cls.decode(torch.arange(2**cls.bits, dtype=torch.uint8, device=normalized.device), signed)
        return quant.encode_stochastic(normalized, nearest, codebook, quant.dither(normalized, scale))

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        # the kernel rounds the nearest codes of the codebook format below this class, as encode does
        nearest = super(StochasticRounding, cls)
        same = computes_as(cls, StochasticRounding, "encode", "encode_blocks") and all(
            getattr(nearest, m).__func__ is getattr(CodebookState, m).__func__ for m in ("encode", "decode")
        ) and computes_as(cls, CodebookState, *SCALED_AS_THE_KERNEL)  # fmt: skip
        return cls._codebook_layout(signed, stochastic=True) if same else None

    @classmethod
    @functools.cache
    def _numerics_fingerprint(cls, signed: bool) -> str:
        # the rounding (quant.encode_stochastic, whose source and constants the base hashes) sets it apart from nearest rounding
        text = inspect.getsource(quant.encode_stochastic)
        return extend_fingerprint(super()._numerics_fingerprint(signed), text)


class OptimState4bit(StochasticRounding, OptimStateNF4):
    """The 4-bit recipe lowbit_optim recommends (``state_format="4bit"``, ``AdamW4bit``): NF4 first
    moment, linear second moment (1/16, 2/16, ..., 1, no zero), as ``nf4``, rounded stochastically
    (StochasticRounding). Between codes 5-20 % apart nearest rounding sticks; that loses little in a
    short run (the char GPT), but much when training is driven to a low loss
    (benchmarks/convergence.py --task mlp: +22 % training loss for ``4bit-calibrated``, about 0
    here). Not calibrated (unbiased already)."""

    name = "4bit"
    format_version = 3  # 1: torchao's codebooks ("4bit-torchao"); 2: nearest rounding ("4bit-calibrated")

    @classmethod
    def legacy_format(cls, version: int):
        # checkpoints written before the 4-bit recipe changed load as the states they are
        return {1: OptimState4bitTorchao, 2: OptimState4bitCalibrated}.get(version)


class OptimState8bitSR(StochasticRounding, OptimState8bit):
    """``8bit``'s codebook (and bytes) rounded stochastically (StochasticRounding). Where a run is
    driven to a low loss, nearest 8-bit rounding sticks too (MLP task: AdamW +6.1 %, AdEMAMix +254 %
    against fp32 state, stalled by its slow momentum); this one does not (README, "Optimizers x formats").
    ``8bit`` itself keeps nearest rounding, as torchao's and bitsandbytes' codes do."""

    name = "8bit-sr"


class OptimState8bitTorchao(AbsmaxScales, OptimState8bit):
    """``8bit`` with torchao's and bitsandbytes' block scales (AbsmaxScales): codes and numerics
    identical to torchao's OptimState8bit, bit for bit, for runs that must continue theirs exactly;
    bitsandbytes' codebook and scales (its CPU quantizer rounds some codes otherwise). It quantizes
    a tensor that is not whole blocks, as bitsandbytes does and torchao does not."""

    name = "8bit-torchao"


class OptimState8bitLinear(OptimState8bit):
    """Signed states on an even 8-bit grid (255 codes, k/127 of the block's absmax); nonnegative
    states as ``8bit``. The momentum of SGD, Lion and Muon enters their update in proportion (or by
    sign), so its large values matter most: over the top decade of a block (0.1-1 of its absmax)
    ``8bit``'s dynamic tree has codes 1/71 apart, this grid 1/127, and a moving average stalls where
    its step is below half a code gap. MLP task, gap of the training loss to fp32 state: SGD +1.7 %
    -> +0.2 %, Lion +5.5 % -> +0.5 %, Muon +18 % -> +8 % (README, "Optimizers x formats"). Adam's
    momentum is not helped: its update divides by sqrt(v), so small values matter as much."""

    name = "8bit-linear"

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return quant.linear_codebook(8) if signed else super().codebook(signed)


class OptimStateFp8(OptimState):
    """float8 e4m3 codes (stored as their uint8 bit patterns) with a scale per block that maps the
    block's absmax to 448, the largest e4m3 value."""

    name = "fp8"
    bits = 8
    default_block_size = 256
    fp8_dtype = torch.float8_e4m3fn
    scale_max = torch.finfo(torch.float8_e4m3fn).max

    @classmethod
    def encode(cls, normalized: Tensor, signed: bool) -> Tensor:
        return quant.fp8_encode(normalized, cls.fp8_dtype)

    @classmethod
    def decode(cls, codes: Tensor, signed: bool) -> Tensor:
        return quant.fp8_decode(codes, cls.fp8_dtype)

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        same = computes_as(cls, OptimStateFp8, "encode", "decode", *SCALED_AS_THE_KERNEL)
        return KernelLayout("e4m3") if same and cls.fp8_dtype == torch.float8_e4m3fn else None


class OptimStateFp8Torchao(OptimStateFp8):
    """``fp8`` with torchao's rounding of a second moment (AdamWFp8's, to give torchao's numbers): a
    positive value below half the smallest subnormal code is stored as 0."""

    name = "fp8-torchao"
    floors_positive = False


from .factored import FactoredState  # noqa: E402  (registered after the block formats)
from .lowrank import LowRankState, OptimState4bitLowRank, OptimState4bitLowRankMuLaw, OptimState8bitLowRank  # noqa: E402
from .stochastic_bf16 import StochasticBF16State  # noqa: E402
from .block_float import BlockFloatState, LogBlockFloatState  # noqa: E402


__all__ = [
    "BF16",
    "BlockFloatState",
    "FactoredState",
    "FP32",
    "LogBlockFloatState",
    "LowRankState",
    "OptimState4bitLowRank",
    "OptimState4bitLowRankMuLaw",
    "OptimState8bitLowRank",
    "OptimState8bit",
    "OptimState8bitLinear",
    "OptimState8bitSR",
    "OptimState8bitTorchao",
    "OptimState4bit",
    "OptimState4bitUncalibrated",
    "OptimState4bitPrecond",
    "OptimState4bitTorchao",
    "OptimState4bitCalibrated",
    "OptimStateNF4",
    "OptimStateFp8",
    "OptimStateFp8Torchao",
    "PlainFormat",
    "StochasticBF16State",
    "check_block_size",
    "convert",
    "is_blockwise",
    "paired_label",
    "paired_state_format",
    "get_format",
    "holds",
    "is_quantized",
    "register_format",
    "registered_formats",
]
