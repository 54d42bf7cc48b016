"""LowRankState: a matrix state as a low-rank part in fp32 plus 8- or 4-bit codes of what that part misses.

Made for Muon's momentum. Newton-Schulz orthogonalization brings every singular value of the
momentum near 1, so the quantization noise of a blockwise 8-bit state, white and spread over all
directions, is lifted to full strength in the directions where the momentum itself is weak; and the
momentum's average carries that noise from step to step. On the MLP task of
``benchmarks/convergence.py`` plain 8-bit momentum costs Muon +18 % training loss, and fresh
Gaussian noise of the same size costs the same, so it is the noise's size, not rounding bias.

A momentum matrix M (rows x cols) is mostly a few strong directions. This state keeps

    M = left @ right.T + residual

with ``left`` (rows x rank, orthonormal columns) and ``right`` (cols x rank) in fp32 and the residual
in 8-bit blockwise codes on an even grid (``4bit-lowrank``: 4-bit, rank 64; ``4bit-lowrank-mulaw``:
4-bit on a mu-law grid, Muon's 4-bit format). Each write (``copy_``) runs one step of subspace iteration,
warm-started from the previous ``right``: left = orth(M @ orth(right)), right = M.T @ left, so the
low-rank part follows M's strongest directions across steps at the cost of two small QRs and three
(rows x cols x rank) products per write, one per read. The residual holds the weak directions, so its codes' noise is a
fraction of theirs rather than of the strongest values (benchmarks/results/convergence_mlp_muon.md).

Slow averages. A codebook state rounded to nearest stalls where an average moves by less than half a
code a step, and stochastic rounding's noise is the size of that move: small either way. Here the
refit moves the low-rank part at every write, so the residual lands on its grid afresh and its
rounding noise is new each time, a share of the residual's own energy (on the benchmark's 256 x 256
average below: 8bit-lowrank 5e-5 a write, the 4-bit formats about 1e-2). An average that keeps beta
of itself per step lets about 2 (1 - beta) of its energy go per step: where it gathers more noise
than that, the residual grows without bound. benchmarks/slow_averages.py measures where (|state| /
|fp32 average| after 4,000 writes, benchmarks/results/slow_averages.md): 4bit-lowrank at 0.99
1.02-1.09 at 256 to 2048 square, at 0.993 1.32 at 768, at 0.995 4e13x there; 4bit-lowrank-mulaw at
0.95 1.01-1.06 at 256 to 3072 square, at 0.98 1e9x at 512; 8bit-lowrank at 0.99995 1.03 after 40,000 writes, at 0.99999
1.07 and growing. Larger matrices hold less (the rank's share of them is smaller). Each format's
``max_signed_decay`` is that limit, and an optimizer refuses the format for a signed average slower
than it (base.State.decay): AdEMAMix's slow momentum (beta3 = 0.9999) in 4bit-lowrank grew 19,000x
in a 3,000-step MLP run and training diverged; Lion's momentum (beta2 = 0.99) fits 4bit-lowrank,
Muon's (0.95) both 4-bit ones, and no built-in average reaches 8bit-lowrank's. The limits come from
square matrices: 4bit-lowrank's to 2048, 4bit-lowrank-mulaw's to 3072 wide, 8bit-lowrank's from
256 (at 1024 it held 0.9999, 1.02 after 20,000 writes); wider and rectangular ones are unmeasured.
A subclass inherits its parent's limit, and a direct subclass of LowRankState has none: one with
another rank or grid should measure and set its own with the benchmark.

Costs: (rows + cols) * rank * 4 bytes on top of the codes (1 byte per element for 8 bits); at rank 32 that is 0.06 bytes
per element of a 4096 x 4096 matrix, and a whole byte of a 256 x 256 one. (bf16 factors were as
accurate on the MLP task, but their rounding turns fp32 round-off between the compiled and the eager
step into different residual codes.) States of fewer than 2 dimensions and nonnegative states
(second moments: a low-rank part could read negative) keep no low-rank part, only the codes; a
nonnegative state's grid has no zero (as ``int8-linear``'s), so that a small v never reads as 0.
Under FSDP2 the rank applies to each rank's rows, so the factors' share grows with the world size
(4096 x 11008 at rank 32: 1.06 B/param on one rank, 2.03 on 32). The state's matrix is
(shape[0], numel // shape[0]); a view keeps its owner's factors. The fused CPU kernel steps it in
three moves (README, Design: the addend); the same products and QRs as the compiled step
(lowrank_products: on the CPU in one order for every build and thread count, which inductor cannot
change), so the same bits. It
cannot be cut into row slices (the low-rank part spans every row), so
torch.distributed.checkpoint loads it whole (distributed.py: bit-exact on the same world size,
rewritten from the saved values when resharded). Under FSDP2 each rank's state is its own rows, with
a low-rank part of its own.
"""

import functools
import inspect
from typing import ClassVar

import torch
from torch import Tensor

from . import lowrank_products, quant
from .state import DEQUANTIZE_FIRST, SCALED_AS_THE_KERNEL, CodebookState, KernelLayout, _format_name, computes_as, extend_fingerprint


def start_basis(cols: int, rank: int, device) -> Tensor:
    """A fixed (cols x rank) matrix to start the subspace iteration from when there is no previous
    one: quant.dither's hash of each row's number (as its block salt, repeating after 2**20 rows) and
    each column's place, uniform in [-0.5, 0.5). It draws nothing from the random stream and is the
    same number eager and compiled, on any device; and, like a random matrix, it is well conditioned.
    (An integer pattern mod a prime was not: at 96 x 32 its condition number was 1.7e8, so rounding
    chose the directions of the first low-rank part, and a GPU's differed from the CPU's by whole codes.)"""
    rows = (torch.arange(cols, dtype=torch.int32, device=device) & 0xFFFFF) << quant.DITHER_DROPPED_BITS
    return quant.dither(torch.zeros(cols, rank, dtype=torch.float32, device=device), rows.view(torch.float32)) - 0.5


class LowRankState(CodebookState):
    """A state as ``left @ right.T`` plus blockwise codes of the residual (module docstring).
    Subclasses set ``name``, ``bits``, ``default_block_size`` and ``rank``; the residual's codebook is
    the even grid of ``bits`` (without zero for nonnegative states), or their own ``codebook``."""

    inner_names = ("codes", "scale", "left", "right")
    inner_dtypes = (torch.uint8, torch.float32, torch.float32, torch.float32)
    independent_blocks = False  # the low-rank part spans the whole matrix
    rank: ClassVar[int] = 32  # the most directions the low-rank part keeps

    left: Tensor
    right: Tensor

    @staticmethod
    def __new__(cls, codes, scale, left, right, shape, block_size: int, signed: bool, rank: int, dtype=torch.float32):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, scale, left, right, shape, block_size: int, signed: bool, rank: int, dtype=torch.float32):
        super().__init__(codes, scale, shape, block_size, signed, dtype)
        self.left, self.right = left, right
        self.rank = rank

    @classmethod
    def zeros(cls, shape, signed: bool | None = None, block_size: int | None = None, device=None, dtype=None):
        signed = cls.signedness(signed)
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        codes, scale, block_size = cls._zero_blocks(shape.numel(), signed, block_size, device)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = shape.numel() // rows if rows else 0
        rank = min(cls.rank, rows, cols) if signed else 0
        left = torch.zeros(rows * rank, dtype=torch.float32, device=device)
        right = torch.zeros(cols * rank, dtype=torch.float32, device=device)
        return cls(codes, scale, left, right, shape, block_size, signed, rank, dtype or torch.float32)

    def _meta(self) -> tuple:
        return (self.block_size, self.signed, self.rank)

    def _matrix_shape(self) -> tuple[int, int]:
        return self.left.numel() // self.rank, self.right.numel() // self.rank

    def _check_sizes(self) -> None:
        super()._check_sizes()
        rank = self.rank
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank is {rank!r}, not an int >= 0")
        if rank and not self.signed:
            raise ValueError(f"a nonnegative state keeps no low-rank part, but this one has rank {rank}")
        if rank == 0 and self.left.numel() + self.right.numel():
            raise ValueError(f"rank 0 keeps no factors, but left has {self.left.numel()} and right {self.right.numel()} elements")
        if rank:
            rows, cols = self._matrix_shape()
            if rows * rank != self.left.numel() or cols * rank != self.right.numel() or rows * cols != self.numel() or rank > min(rows, cols):
                raise ValueError(
                    f"left has {self.left.numel()} and right {self.right.numel()} elements: not the rank-{rank} factors of a "
                    f"matrix of {self.numel()} elements"
                )

    def check_values(self) -> None:
        super().check_values()
        # a loaded state is a parameter's, whole: its matrix is (shape[0], the rest) (a view's need not be)
        if self.rank and self._matrix_shape() != (self.shape[0], self.numel() // self.shape[0]):
            rows, cols = self._matrix_shape()
            raise ValueError(
                f"its factors are those of a {rows} x {cols} matrix, where a state of shape {tuple(self.shape)} keeps "
                f"the {self.shape[0]} x {self.numel() // self.shape[0]} one (left and right swapped?)"
            )
        if self.rank > type(self).rank:
            raise ValueError(f"its factors have rank {self.rank}, above the {type(self).rank} its format keeps")

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return quant.linear_codebook(cls.bits) if signed else quant.linear_codebook_without_zero(cls.bits)

    def _describe(self) -> dict:
        return super()._describe() | {"rank": self.rank}

    @classmethod
    @functools.cache
    def _numerics_fingerprint(cls, signed: bool) -> str:
        # the subspace iteration's start and products live outside the methods the base hashes (and quant.py, whose dither draws the start)
        methods = (LowRankState._fit_low_rank, LowRankState._subspace_start, LowRankState._low_rank)
        text = inspect.getsource(start_basis) + lowrank_products.fingerprint() + "".join(map(inspect.getsource, methods))
        return extend_fingerprint(super()._numerics_fingerprint(signed), text)

    def quantize_(self, x: Tensor) -> None:
        values = x.float()
        super().quantize_(self._fit_low_rank(values) if self.rank else values)

    def _fit_low_rank(self, values: Tensor, in_place: bool = False) -> Tensor:
        """One step of subspace iteration: the low-rank part follows ``values``; returns the flat
        residual its codes must hold (quantize_), written over ``values`` where ``in_place`` (the
        kernel's writes, kernel_residual)."""
        left, right = self._factors()
        matrix = values.reshape(left.shape[0], right.shape[0])
        start = self._subspace_start(right)
        fitted = lowrank_products.orthonormal(lowrank_products.times(matrix, lowrank_products.orthonormal(start)))
        left.copy_(fitted)
        right.copy_(lowrank_products.transposed_times(matrix, fitted))
        # the residual of the product exactly as dequantize computes it, its rounding included
        return lowrank_products.residual(matrix, left, right, out=matrix if in_place else None).view(-1)

    def _subspace_start(self, right: Tensor) -> Tensor:
        """The subspace iteration's start: the previous ``right``, or ``start_basis`` where there is
        none yet (all zeros). A graph (compiled, traced with fake tensors, or on a GPU, where a
        branch would wait for the device) takes torch.where's choice; an eager CPU write branches,
        so that it builds the basis only when it takes it: otherwise its hashes cost 15 ms of a
        280 ms fused SGD step on the GPT-2-small set (AMD EPYC of family 26, 2 threads). Either way
        the same numbers."""
        if torch.compiler.is_compiling() or right.device.type != "cpu" or torch._guards.detect_fake_mode() is not None:
            return torch.where(right.abs().sum() > 0, right, start_basis(right.shape[0], self.rank, right.device))
        return right if bool(right.abs().sum() > 0) else start_basis(right.shape[0], self.rank, right.device)

    # ---- the fused CPU kernel: codes as the codebook's, the low-rank part through the addend ----

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        # the residual's codes are a codebook state's; the low-rank part passes through the addend
        low_rank = ("_fit_low_rank", "_subspace_start", "_low_rank", "_factors", "has_addend", "kernel_addend", "kernel_residual")
        if not computes_as(cls, LowRankState, "encode", "encode_blocks", "decode", *SCALED_AS_THE_KERNEL, *low_rank):
            return None
        return cls._codebook_layout(signed)

    @property
    def has_addend(self) -> bool:
        return self.rank > 0

    def kernel_addend(self, out: Tensor) -> Tensor:
        return self._low_rank(out)

    def kernel_residual(self, values: Tensor) -> tuple["LowRankState", Tensor]:
        residual = self._fit_low_rank(values, in_place=True)
        no_factors = self.left.new_empty(0)
        return type(self)(self.codes, self.scale, no_factors, no_factors, self.shape, self.block_size, self.signed, 0, self.dtype), residual

    def _low_rank(self, out: Tensor | None = None) -> Tensor:
        """``left @ right.T``, flattened (into the flat fp32 ``out``, the same product: the kernel's
        buffers, which a step reuses from parameter to parameter, as fresh memory costs a page fault
        per 4 KiB). Flat, because under torch.compile's dynamic shapes the
        factors' sizes and the state's shape are different symbols: a view of the product to the
        state's shape made inductor index it with an integer division per element (4x slower steps)."""
        left, right = self._factors()
        if out is not None:
            return lowrank_products.outer(left, right, out=out.view(left.shape[0], right.shape[0])).view(-1)
        return lowrank_products.outer(left, right).view(-1)

    def _factors(self) -> tuple[Tensor, Tensor]:
        """left (rows x rank) and right (cols x rank): views of the flat inner tensors."""
        rows, cols = self._matrix_shape()
        return self.left.view(rows, self.rank), self.right.view(cols, self.rank)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        values = super().dequantize(torch.float32)
        if self.rank:
            values = (values.reshape(-1) + self._low_rank()).view(self.shape)
        return values.to(dtype or self.dtype)

    def _rows(self, start: int, end: int) -> "LowRankState":
        if self.rank and (start, end) == (0, self.shape[0]):  # every row (state[:]): the state itself
            return self._like()
        if self.rank:
            raise NotImplementedError(
                f"{_format_name(self)} of shape {tuple(self.shape)} cannot be cut into rows [{start}:{end}]: its rank-{self.rank} "
                f"part spans every row: {DEQUANTIZE_FIRST}, or use a blockwise format where states are resharded"
            )
        return super()._rows(start, end)


class OptimState8bitLowRank(LowRankState):
    """``8bit-lowrank``: a rank-32 fp32 part plus 8-bit codes on an even grid (255 signed values with
    an exact zero; nonnegative states 1/256, ..., 1), blocks of 256. For Muon's momentum (module
    docstring); a subclass with another ``rank`` and ``name`` is another format."""

    name = "8bit-lowrank"
    bits = 8
    default_block_size = 256
    rank = 32
    max_signed_decay = 0.99995  # module docstring: 1.03x of fp32 after 40,000 writes at 256 x 256; 0.99999 1.07x and growing


class OptimState4bitLowRank(LowRankState):
    """``4bit-lowrank``: a rank-64 fp32 part plus 4-bit codes on an even grid (15 signed values k / 7;
    nonnegative states 1/16, ..., 1), blocks of 128. 4-bit codes are 16 times coarser, so the low-rank
    part must hold more: Lion's momentum on the MLP task is within 0.6 % of fp32 at rank 64 (3 % at
    rank 32), where the NF4 ``4bit`` state is +241 %. The factors cost (rows + cols) * 64 * 4 bytes."""

    name = "4bit-lowrank"
    bits = 4
    default_block_size = 128
    rank = 64
    max_signed_decay = 0.99  # module docstring: 1.02-1.09x of fp32 (to 2048 x 2048); 0.993 1.32x at 768 x 768


class OptimState4bitLowRankMuLaw(OptimState4bitLowRank):
    """``4bit-lowrank-mulaw``, **Muon's 4-bit format**: ``4bit-lowrank``'s rank-64 part, with the
    signed residual on a mu-law grid (mu = 15: 0, +-0.032, +-0.081, +-0.152, +-0.258, +-0.416,
    +-0.651, +-1 of the block's absmax), rounded to the nearest code in mu-law space
    (``quant.mu_law``), in blocks of 64. Once the low-rank part holds the strong directions, the
    residual is mostly small values beside a few large ones; the even grid rounds the small ones to 0
    or +-1/7 of the block's largest, and Newton-Schulz lifts what they lose to full strength. Fine
    codes near zero and small blocks keep them (MLP task, 3 seeds: even grid +11.2 %, mu-law in blocks
    of 128 +0.9 %, of 64 -0.8 %). Lion's momentum wants the opposite: with the mu-law grid it was
    +318 % from fp32 against the even grid's +0.6 % (one 3-seed run), so Lion and SGD stay on
    ``4bit-lowrank``. Blocks of 64 cost 0.03 B/param more scale than 128."""

    name = "4bit-lowrank-mulaw"
    default_block_size = 64
    mu = 15.0
    max_signed_decay = 0.95  # module docstring: 1.01-1.06x of fp32 (to 3072 x 3072); 0.98 grew 1e9x at 512 x 512

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return quant.mu_law_codebook(cls.bits, cls.mu) if signed else super().codebook(signed)

    @classmethod
    def rounding_space(cls, values: Tensor, signed: bool) -> Tensor:
        return quant.mu_law(values, cls.mu) if signed else values
