"""BlockFloatState (``10bit-sr``): 10 bits per value, a small float under a scale per block, each
write rounded stochastically.

AdEMAMix's slow averages (its beta3 = 0.9999 momentum, its beta2 = 0.999 second moment) need about
bf16's 8 significant bits and stochastic rounding: no 8-bit state holds them (README, "AdEMAMix
state by state"). Within a block of 256 values the exponents span a few binades only, so bf16's 8
exponent bits are mostly wasted: a block float keeps bf16's 7 mantissa bits and 2 exponent bits
below its block's largest value (a signed state; 3 for a nonnegative one), 10 bits in all. The
experiment that sized it (benchmarks/state_precision.py ``--rounding 7bf2`` / ``7bf3``) ended
within 0.4 % of fp32 state for either slow average, as ``bf16-sr`` does in 16 bits. As a format it
holds the slow momentum so. A second moment's value far below its block's absmax lies among the
subnormals, whose spacing is 2**-13 of the block's largest value: rounded to 0 it would leave the
update dividing by eps alone (a second moment in the first version of this format ended +28 % from
fp32 on one seed of ten, README, "AdEMAMix state by state"), so a nonnegative state rounds a
nonzero value no lower than the smallest subnormal, as the 4-bit formats' second moments have no
zero code.

Codes are ``quant.small_float_codes``: subnormals below the lowest binade, the block's absmax maps
to the largest value. The random numbers are ``quant.dither``'s hash salted, as ``bf16-sr``'s, by
the block's index and a count of the state's writes (stochastic_bf16.write_salt): a slow average
whose block scale does not move still draws anew on every write. Stored per block: 256 bytes of
the codes' top 8 bits, 64 of their low 2 bits (quant.pack_codes) and an fp32 scale, 1.27 bytes per
value. The fused CPU kernel steps it (csrc/block_float.h), bit for bit as the compiled step.

LogBlockFloatState (``8bit-log``) is the 8-bit member of the family, for a second moment: 5
mantissa and 3 exponent bits (a signed state: a sign and 2), one byte per value, and its writes
round a nonnegative state so that the log of the stored value is unbiased rather than the value
(quant.log_unbiased_threshold). Adam's and AdEMAMix's updates divide by sqrt(v): with v itself
unbiased, the noise of 5-bit rounding makes 1/sqrt(v) too large on average (Jensen) and steps too
long; with log v unbiased v drifts slightly up instead, which the update barely feels. Its block
scales are powers of two (the one at or above absmax / scale_max): a block's grid then stays put
while its absmax stays within a binade, and a value that a slow average moves by 0.1 % a step stays
near its code, rounding with little noise. Scaled as 10bit-sr is, every step's new absmax moves the
grid and each write rounds with a spacing's full noise, which the average keeps for 1/(1 - beta)
steps (test_block_float.py: 18 % rms against 4.5 %); AdEMAMix's second moment in this format ended
+0.69 +- 0.37 % from fp32 state that way, +0.07 +- 0.24 % with power-of-two scales (MLP task, 10
seeds, lr 1e-3; README, "AdEMAMix state by state"). Their draws are salted by a count of writes,
not by the block scale as a codebook format's are: with scales that seldom move those would repeat.
"""

import functools
import inspect

import torch
from torch import Tensor

from . import quant
from .state import SCALED_AS_THE_KERNEL, KernelLayout, OptimState, computes_as, extend_fingerprint
from .stochastic_bf16 import write_salt, write_salt_fingerprint, writes_from_block


class BlockFloatState(OptimState):
    """A state of block floating-point values (10 bits; 8 in a subclass such as LogBlockFloatState)
    written with stochastic rounding (module docstring)."""

    name = "10bit-sr"
    bits = 10
    mantissa_bits = 7
    default_block_size = 256
    scale_max = 2.0 - 2.0**-mantissa_bits  # the largest value: a block's absmax (a subclass's from its mantissa_bits)
    inner_names = ("codes", "scale", "writes")
    inner_dtypes = (torch.uint8, torch.float32, torch.int64)
    whole_state_names = ("writes",)
    stochastic = True
    positive_stays_positive = True  # says (for the tests) that unsigned, quant.small_float_codes rounds no nonzero value to 0
    floors_positive = False  # (so its quantize_ needs no OptimState.positive_floor)
    log_unbiased = False  # a nonnegative state's writes keep log(value) unbiased, not the value (LogBlockFloatState)
    power_of_two_scale = False  # block scales rounded up to a power of two: the grid moves only when a block's absmax changes binade

    writes: Tensor  # (1,): how many times the state was written

    def __init_subclass__(cls, **kwargs):
        # the kernel and quant.pack_codes lay out 8- and 10-bit codes; quant.power_of_two needs
        # fp32's normal exponents for every binade: 1 to 6 exponent bits
        if cls.bits not in (8, 10) or not cls.bits - 6 <= cls.mantissa_bits <= cls.bits - 2:
            raise TypeError(
                f"{cls.__name__}: a BlockFloatState has bits = 8 or 10 and bits - 6 to bits - 2 mantissa bits (1 to 6 exponent bits), "
                f"got bits={cls.bits}, mantissa_bits={cls.mantissa_bits}"
            )
        largest = 2.0 - 2.0**-cls.mantissa_bits
        if vars(cls).get("scale_max", largest) != largest:  # it was silently replaced
            raise TypeError(f"{cls.__name__}: a BlockFloatState's scale_max is its largest mantissa, 2 - 2**-mantissa_bits = {largest}: drop scale_max = {cls.scale_max!r}")
        cls.scale_max = largest
        super().__init_subclass__(**kwargs)

    @classmethod
    def exponent_bits(cls, signed: bool) -> int:
        """The bits left to the exponent: a nonnegative state's sign bit is one more."""
        return cls.bits - cls.mantissa_bits - int(signed)

    @staticmethod
    def __new__(cls, codes: Tensor, scale: Tensor, writes: Tensor, shape, block_size: int, signed: bool, dtype=torch.float32):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: Tensor, scale: Tensor, writes: Tensor, shape, block_size: int, signed: bool, dtype=torch.float32):
        super().__init__(codes, scale, shape, block_size, signed, dtype)
        self.writes = writes

    @classmethod
    def zeros(cls, shape, signed: bool | None = None, block_size: int | None = None, device=None, dtype=None):
        signed = cls.signedness(signed)
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        codes, scale, block_size = cls._zero_blocks(shape.numel(), signed, block_size, device)
        writes = torch.zeros(1, dtype=torch.int64, device=device)
        return cls(codes, scale, writes, shape, block_size, signed, dtype=dtype or torch.float32)

    def _check_sizes(self) -> None:
        super()._check_sizes()
        if self.writes.numel() != 1:
            raise ValueError(f"writes has {self.writes.numel()} elements, not 1")

    @classmethod
    def encode(cls, normalized: Tensor, signed: bool) -> Tensor:
        return cls.encode_blocks(normalized, normalized.new_ones(normalized.shape[:-1]), signed)  # rows of salt 1.0

    @classmethod
    def encode_blocks(cls, normalized: Tensor, salt: Tensor, signed: bool) -> Tensor:
        # salt: a number per row that enters the hash of its draws (quantize_ passes write_salt's)
        u = quant.dither(normalized, salt)
        codes = quant.small_float_codes(normalized, cls.exponent_bits(signed), cls.mantissa_bits, signed, u, cls.rounds_log_unbiased(signed))
        return codes.to(quant.code_dtype(cls.bits))

    def _block_scales(self, blocks: Tensor) -> Tensor:
        scale = super()._block_scales(blocks)
        return quant.power_of_two_at_least(scale) if self.power_of_two_scale else scale

    @classmethod
    def rounds_log_unbiased(cls, signed: bool) -> bool:
        """Whether a state's writes keep its log unbiased (quant.log_unbiased_threshold), not its value."""
        return cls.log_unbiased and not signed

    @classmethod
    def decode(cls, codes: Tensor, signed: bool) -> Tensor:
        return quant.small_float_values(codes, cls.exponent_bits(signed), cls.mantissa_bits, signed)

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        same = computes_as(cls, BlockFloatState, "encode_blocks", "decode", "exponent_bits", "rounds_log_unbiased", *SCALED_AS_THE_KERNEL)
        return KernelLayout("block-float") if same else None

    def later_slice(self, first_block: int) -> "BlockFloatState":
        return self._like(writes=writes_from_block(self.writes, first_block))

    def quantize_(self, x: Tensor) -> None:
        self.writes.add_(1)
        normalized, scale = self._normalized_blocks(x)
        self._store(self.encode_blocks(normalized, write_salt(self.writes, scale.numel()), self.signed), scale)

    @classmethod
    @functools.cache
    def _numerics_fingerprint(cls, signed: bool) -> str:
        # the rounding lives in module functions: a change there must not reuse graphs compiled before it
        functions = (quant.small_float_codes, quant.small_float_values, quant.power_of_two, quant.log_unbiased_threshold)
        functions += (quant.power_of_two_at_least,) if cls.power_of_two_scale else ()
        text = "".join(inspect.getsource(f) for f in functions) + write_salt_fingerprint() + str((cls.mantissa_bits, cls.log_unbiased, cls.power_of_two_scale))
        return extend_fingerprint(super()._numerics_fingerprint(signed), text)


class LogBlockFloatState(BlockFloatState):
    """``8bit-log``: one byte per value, 5 mantissa bits, power-of-two block scales, a nonnegative
    state's writes rounded so that the log of the value is unbiased (module docstring); a signed
    state has a sign and 2 exponent bits and rounds unbiased in value. Meant for a second moment
    (Adam's, AdEMAMix's exp_avg_sq): AdEMAMix's slow momentum needs more mantissa bits (+4.3 % in
    this format, MLP task)."""

    name = "8bit-log"
    bits = 8
    mantissa_bits = 5
    log_unbiased = True
    power_of_two_scale = True
