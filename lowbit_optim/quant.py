"""Pure tensor functions for block quantization: codebooks, nearest-code encoding, nibble packing.

Nothing here knows about tensor subclasses; every function works on plain tensors and is traceable
by torch.compile.
"""

import math

import torch
from torch import Tensor

# A block's absmax is taken as at least this (avoids 0/0 in the normalization of a block of zeros),
# before a format divides it by its scale_max or calibrates it (4bit-calibrated's scales go lower).
# Low enough that a block of tiny values keeps its own scale (torchao's floor, 1e-12, read an Adam
# second moment of 1e-7 gradients 313x too large in 4bit); high enough that every format's smallest
# nonzero code times it stays a normal fp32 number (the least, the dynamic codebook's ~2**-22, gives
# 2**-97; not after a calibration, which may scale a block of nonnegative values further down).
MIN_BLOCK_SCALE = 2.0**-75


def dynamic_codebook(signed: bool, exponent_bits: int, total_bits: int) -> list[float]:
    """The dynamic-tree codebook of Dettmers' 8-bit optimizers (arXiv:1511.04561, 2110.02861).

    Exponent level ``i`` (decade 10**(i - exponent_bits + 1)) holds the midpoints of an even grid on
    [0.1, 1]; higher decades get more fraction bits. An unsigned codebook spends the sign bit on a
    finer fraction. Values are computed in fp32, exactly as bitsandbytes and torchao do, so codes
    mean the same numbers in all three libraries.
    """
    fraction_bits = total_bits - 1 - exponent_bits  # bits below the exponent indicator
    values: list[Tensor] = []
    for level in range(exponent_bits):
        grid_points = 2 ** (level + fraction_bits + (0 if signed else 1)) + 1
        grid = torch.linspace(0.1, 1, grid_points, dtype=torch.float32)
        midpoints = (grid[:-1] + grid[1:]) / 2.0
        decade = 10 ** (level - exponent_bits + 1)
        values.append(decade * midpoints)
        if signed:
            values.append(-decade * midpoints)
    extra = 2**fraction_bits - 1  # codes left over when every exponent level is full
    if extra > 0:
        grid = torch.linspace(0.1, 1, extra + 1, dtype=torch.float32)
        midpoints = (grid[:-1] + grid[1:]) / 2.0
        values.append(decade * midpoints)
        if signed:
            values.append(-decade * midpoints)
    codebook = sorted(torch.cat(values).tolist() + [0.0, 1.0])
    assert len(codebook) == 2**total_bits, (len(codebook), total_bits)
    return codebook


def linear_codebook(total_bits: int) -> list[float]:
    """-1, ..., -1/n, 0, 1/n, ..., 1 with n = 2**(bits - 1) - 1: evenly spaced, symmetric, an exact zero."""
    n = 2 ** (total_bits - 1) - 1
    return [k / n for k in range(-n, n + 1)]


def linear_codebook_without_zero(total_bits: int) -> list[float]:
    """1/n, 2/n, ..., 1: lpmm's second-moment codebook. Having no zero code means a small v never
    becomes 0, which would blow up the update m / (sqrt(v) + eps) (the "zero-point problem")."""
    n = 2**total_bits
    return torch.linspace(0, 1, n + 1, dtype=torch.float32)[1:].tolist()


def normal_float_codebook(total_bits: int) -> list[float]:
    """NormalFloat (NF4 for 4 bits, Dettmers et al. 2023, arXiv:2305.14314): codes at evenly spaced
    quantiles of a standard normal, normalized to [-1, 1], with an exact zero; 2**(bits-1) positive
    and 2**(bits-1) - 1 negative codes. Values near zero, where most of a block's entries lie, are
    dense; the tails are sparse. The outermost quantile ``offset`` is the mean of 1 - 1/(2(n-1))
    and 1 - 1/(2n) for n = 2**bits codes, as in the paper."""
    n = 2**total_bits
    offset = ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n))) / 2
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    values = torch.cat([positive, negative, torch.zeros(1, dtype=torch.float64)])
    return sorted((values / values.abs().max()).float().tolist())


def mu_law(x: Tensor, mu: float) -> Tensor:
    """The mu-law compander sign(x) ln(1 + mu |x|) / ln(1 + mu): strictly increasing on [-1, 1], it
    stretches small values and squeezes large ones."""
    return torch.sign(x) * torch.log1p(mu * x.abs()) / math.log1p(mu)


def mu_law_codebook(total_bits: int, mu: float) -> list[float]:
    """The even grid of ``linear_codebook`` expanded by the inverse of ``mu_law``: levels dense near
    zero and sparse near +-1, an exact zero, symmetric. With 4 bits and mu = 15: 0, +-0.032, +-0.081,
    +-0.152, +-0.258, +-0.416, +-0.651, +-1. Encoded nearest in ``mu_law`` space, it is the uniform
    quantizer of the companded value (as in G.711 telephony)."""
    even = torch.tensor(linear_codebook(total_bits), dtype=torch.float64)
    return (torch.sign(even) * torch.expm1(even.abs() * math.log1p(mu)) / mu).tolist()


def squared_linear_codebook_without_zero(total_bits: int) -> list[float]:
    """(1/n)**2, (2/n)**2, ..., 1: a second-moment codebook that is linear in sqrt(v), the quantity
    the update divides by. Its smallest code is 1/n**2 of the block's absmax (1/256 for 4 bits,
    against 1/16 for the linear codebook), and like that one it has no zero."""
    n = 2**total_bits
    return [(k / n) ** 2 for k in range(1, n + 1)]


# --------------------------------------------------------------------------------------------
# Exact nearest-code encoding with a lookup table.
#
# The table is indexed by the top 16 bits of the fp32 value (its bf16 bit pattern). Every fp32 number
# with the same top 16 bits lies in one narrow interval ("bucket"); if at most one decision boundary
# (midpoint between neighbouring codes) falls inside each bucket, the exact nearest code is
#     base_code[bucket] + (x >= threshold[bucket]),
# one gather and one comparison instead of a binary search.
# --------------------------------------------------------------------------------------------

TABLE_BITS = 16


def decision_boundaries(values: Tensor, rounding_space=None) -> Tensor:
    """The points (float64) between neighbouring code values where rounding switches code.

    Without ``rounding_space`` they are the midpoints: nearest value. With a strictly increasing
    map f they are the t where f(t) is halfway between f(a) and f(b): nearest in that space
    (found by bisection, to float64 precision).
    """
    low, high = values[:-1], values[1:]
    if rounding_space is None:
        return (low + high) / 2  # exact: fp32 values added in fp64
    target = (rounding_space(low) + rounding_space(high)) / 2
    for _ in range(100):
        mid = (low + high) / 2
        below = rounding_space(mid) < target
        low, high = torch.where(below, mid, low), torch.where(below, high, mid)
    return high


def decision_thresholds(codebook: list[float], rounding_space=None) -> Tensor:
    """For each decision boundary, the smallest fp32 value at or above it: an fp32 x encodes to the
    number of thresholds <= x (ties go to the larger code)."""
    values = torch.tensor(codebook, dtype=torch.float64)
    if len(codebook) > 256 or not bool((values[1:] > values[:-1]).all()):
        raise ValueError("a codebook must hold at most 256 strictly increasing values")
    boundaries = decision_boundaries(values, rounding_space)
    # round the fp64 boundary to fp32, step up one ulp if it fell below
    rounded = boundaries.float()
    return torch.where(rounded.double() < boundaries, torch.nextafter(rounded, torch.tensor(math.inf, dtype=rounded.dtype)), rounded)


def nearest_code_tables(thresholds: Tensor) -> tuple[Tensor, Tensor]:
    """Build (base_code uint8[65536], threshold fp32[65536]) for ``encode_nearest`` from a codebook's
    ``decision_thresholds``: the nearest code, in value or in the rounding space they were made in.

    Ties (x exactly on a boundary) go to the larger code. NaN encodes as the code nearest to zero
    (a block holding NaN has a NaN scale, so it decodes to NaN anyway).
    """
    midpoints = thresholds.double()  # counting thresholds <= v is counting boundaries <= v, for fp32 v

    prefix = torch.arange(2**TABLE_BITS, dtype=torch.int64)
    first = (prefix << 16).to(torch.int32).view(torch.float32).double()
    last = ((prefix << 16) | 0xFFFF).to(torch.int32).view(torch.float32).double()
    low, high = torch.minimum(first, last), torch.maximum(first, last)
    is_nan = torch.isnan(low) | torch.isnan(high)
    zero = torch.zeros(1, dtype=torch.float64)
    low = torch.where(is_nan, zero, low)
    high = torch.where(is_nan, zero, high)

    def code_of(v: Tensor) -> Tensor:  # ties up: count midpoints <= v
        return torch.searchsorted(midpoints, v, right=True)

    base, top = code_of(low), code_of(high)
    if bool((top - base > 1).any()):
        raise ValueError(
            "codebook too fine for a 16-bit lookup table: two decision boundaries fall in one bucket "
            "of fp32 values sharing their top 16 bits"
        )
    split = top > base
    threshold = torch.where(split, thresholds[base.clamp(max=len(thresholds) - 1)], torch.tensor(math.nan, dtype=thresholds.dtype))  # NaN: never >=
    return base.to(torch.uint8), threshold


def encode_nearest(x: Tensor, base_code: Tensor, threshold: Tensor) -> Tensor:
    """Exact nearest-code index (uint8) of fp32 ``x`` using the tables of ``nearest_code_tables``."""
    bucket = (x.view(torch.int32) >> 16) & 0xFFFF
    code = base_code[bucket].to(torch.int32) + (x >= threshold[bucket]).to(torch.int32)
    return code.to(torch.uint8)


def decode_codebook(codes: Tensor, codebook: Tensor) -> Tensor:
    """Codebook values (fp32) of uint8 code indices."""
    return codebook[codes.to(torch.int32)]


def fp8_encode(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round fp32 to the nearest float8 value (ties to even) and return its bit pattern as uint8."""
    return x.to(dtype).view(torch.uint8)


def fp8_decode(codes: Tensor, dtype: torch.dtype) -> Tensor:
    return codes.view(dtype).to(torch.float32)


# --------------------------------------------------------------------------------------------
# Blocks and packing
# --------------------------------------------------------------------------------------------


def num_blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def to_blocks(x: Tensor, block_size: int, padded_numel: int) -> Tensor:
    """Flatten ``x``, zero-pad it to ``padded_numel`` and view it as (blocks, block_size)."""
    flat = x.reshape(-1)
    flat = torch.nn.functional.pad(flat, (0, padded_numel - flat.numel()))
    return flat.view(-1, block_size)


def block_scales(blocks: Tensor, scale_max: float, scale_min: float) -> Tensor:
    """Each block's scale (the rows of ``blocks``): the smallest that maps its values into the codes'
    range [scale_min, scale_max] (scale_min < 0 < scale_max), so that its largest value lands on
    scale_max or its most negative one on scale_min. Where scale_min = -scale_max this is absmax /
    scale_max. The dynamic tree's codes reach less far below zero (-0.99297): absmax / scale_max
    would round such a block's most negative value toward zero by 0.7 % at every write, so a moving
    average's largest negative values would decay (AdEMAMix's slow one 70 times faster). The largest
    value counts as at least MIN_BLOCK_SCALE; NaN propagates."""
    if scale_min == -scale_max:  # symmetric codes: the same scale from one reduction (the kernel's block_absmax_scale)
        return blocks.abs().amax(dim=-1).clamp(min=MIN_BLOCK_SCALE) / scale_max
    highest = blocks.amax(dim=-1).clamp(min=MIN_BLOCK_SCALE) / scale_max
    lowest = blocks.amin(dim=-1) / scale_min
    return torch.maximum(highest, lowest)


def pairwise_sum(x: Tensor) -> Tensor:
    """Sum over the last dimension (a power of two) by halves, in an order fixed by the code (a
    reduction's order is the compiler's choice): the fused CPU kernel adds in the same order."""
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


def calibrated_scale(scale: Tensor, normalized: Tensor, decoded: Tensor) -> Tensor:
    """``scale`` times c = <x, x> / <x, Q(x)> per block (x the normalized values, Q(x) their codes'
    values), in float64: nearest rounding shrinks a block toward its codes, c undoes that on average
    (the decoded block's projection onto x is x). c is 1 where it is undefined (an all-zero block);
    NaN scales stay NaN."""
    x, q = normalized.double(), decoded.double()
    c = pairwise_sum(x * x) / pairwise_sum(x * q)
    c = torch.where(torch.isfinite(c) & (c > 0), c, torch.ones_like(c))
    return (scale.double() * c).float()


def code_dtype(bits: int) -> torch.dtype:
    """The dtype of ``bits``-bit codes one per element (unpacked): uint8 up to 8 bits, else int16."""
    return torch.uint8 if bits <= 8 else torch.int16


def pack_codes(codes: Tensor, bits: int, block_size: int) -> Tensor:
    """Flat unpacked codes (whole blocks) as the bytes a state stores, ``block_size * bits / 8`` per
    block: 8-bit codes as they are, 4-bit two per byte (pack_nibbles), 10-bit per block as the block's
    top 8 bits of every code, then its low 2 bits four per byte (the first code in the lowest two)."""
    if bits == 8:
        return codes
    if bits == 4:
        return pack_nibbles(codes)
    blocks = codes.view(-1, block_size).to(torch.int32)
    low = (blocks & 3).view(blocks.shape[0], block_size // 4, 4)
    low = low[..., 0] | (low[..., 1] << 2) | (low[..., 2] << 4) | (low[..., 3] << 6)
    return torch.cat([blocks >> 2, low], dim=1).to(torch.uint8).view(-1)


def unpack_codes(packed: Tensor, bits: int, block_size: int) -> Tensor:
    """The codes, one per element (``code_dtype(bits)``), of bytes ``pack_codes`` made."""
    if bits == 8:
        return packed
    if bits == 4:
        return unpack_nibbles(packed)
    rows = packed.view(-1, block_size * bits // 8).to(torch.int32)
    high, low = rows[:, :block_size], rows[:, block_size:]
    low = torch.stack([low & 3, (low >> 2) & 3, (low >> 4) & 3, low >> 6], dim=-1).view(-1, block_size)
    return ((high << 2) | low).to(torch.int16).view(-1)


def pack_nibbles(codes: Tensor) -> Tensor:
    """Two 4-bit codes per byte: element 2i in the high nibble, 2i+1 in the low one (torchao's order)."""
    pairs = codes.view(-1, 2)
    return (pairs[:, 0] << 4) | pairs[:, 1]


def unpack_nibbles(packed: Tensor) -> Tensor:
    return torch.stack([packed >> 4, packed & 0xF], dim=-1).view(-1)


# --------------------------------------------------------------------------------------------
# Stochastic rounding
# --------------------------------------------------------------------------------------------


def bf16_round_nearest(x: Tensor) -> Tensor:
    """fp32 -> the nearest bf16 value (ties to even), still as fp32. Done on the bits because
    torch.compile keeps bf16 intermediates of a fused kernel in fp32, so x.bfloat16().float() may
    compile to no rounding at all, silently breaking Kahan summation."""
    bits = x.view(torch.int32)
    lsb = (bits >> 16) & 1
    rounded = (bits + 0x7FFF + lsb) & -65536  # 0xFFFF0000 as a signed int32
    return torch.where(torch.isfinite(x), rounded, bits).view(torch.float32)


def bf16_stochastic_round(x: Tensor) -> Tensor:
    """Round fp32 to bf16, up (away from zero) with probability equal to the dropped fraction, so
    that E[round(x)] == x. Adds 16 random bits below the bf16 mantissa and truncates."""
    bits = x.view(torch.int32)
    noise = torch.randint(0, 1 << 16, x.shape, device=x.device, dtype=torch.int32)
    rounded = (bits + noise) & -65536  # 0xFFFF0000 as a signed int32
    # inf / NaN must not be perturbed into another class of value
    rounded = torch.where(torch.isfinite(x), rounded, bits)
    return rounded.view(torch.float32).to(torch.bfloat16)


# --------------------------------------------------------------------------------------------
# Stochastic rounding of codes (dithered by a hash, so deterministic)
# --------------------------------------------------------------------------------------------

_MASK32 = 0xFFFFFFFF
# The lowest 10 mantissa bits of a value and of its block's scale do not enter the hash: a value
# that differs by an ulp (the compiled step may contract a multiply-add into an FMA where the eager
# one does not, and a block scale an ulp off moves every value of its block) draws the same number
# unless the difference carries into bit 10 (about 1 time in 1024), yet a value that moves by 2**-13
# of itself or more draws anew. Dropping 12 bits was too coarse: on the MLP task second moments whose
# gradients had faded kept their draw (and code) for many steps, +4.6 % training loss against about
# -0.7 % with 0, 8 or 10 bits dropped (2 seeds each).
DITHER_DROPPED_BITS = 10
DITHER_PLACE = 0x61C88647  # multiplies a value's place in its block
DITHER_SALT = 0x9E3779B1  # multiplies its block's scale


def dither(x: Tensor, scale: Tensor) -> Tensor:
    """A pseudo-random number in [0, 1) for each element of fp32 ``x``: a hash of the element's bits
    (all but the lowest DITHER_DROPPED_BITS), of its index along the last dimension (its place in a
    block) and of its block's fp32 ``scale`` (x's shape less the last dimension; the same bits
    dropped), so equal values in one block draw different numbers. The same input gives the same
    numbers, eager or compiled, on any device: no generator state, nothing drawn from torch's random
    stream, so a run repeats bit for bit and a resumed checkpoint continues as the run would have.

    The scale is what makes successive steps draw independently. A slow moving average moves each
    value by a few units of its kept bits per step, so without it a value's draws come again and
    again from the same few hash inputs: quantized moving averages of random gradients then stray
    from the exact ones (a 4bit second moment with beta2 = 0.999: 9 % too high, 0.32 against 0.25
    relative rms error with independent draws). A block's scale moves every step in training (its
    largest value takes a new gradient), and its hash moves every place's draw at once.

    Integer mixing in the style of lowbias32, in int64 where no operation overflows: the place and
    scale terms stay below 2**55, and the mixing multiplies values below 2**32 by constants below 2**31 (on
    a GPU inductor may compute an index's multiple in int32, where it wraps: only low 32 bits are read). A value
    that comes back bit for bit in a block whose scale did not move (a zero gradient) draws the same
    number again: it keeps its code, as under nearest rounding."""
    salt = ((scale.view(torch.int32).to(torch.int64) & _MASK32) >> DITHER_DROPPED_BITS) * DITHER_SALT
    place = torch.arange(x.shape[-1], dtype=torch.int64, device=x.device) * DITHER_PLACE + salt[..., None]
    value = (x.view(torch.int32).to(torch.int64) & _MASK32) >> DITHER_DROPPED_BITS
    h = value ^ (place & _MASK32)
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _MASK32
    h = h ^ (h >> 15)
    h = (h * 0x5BD1E995) & _MASK32
    h = h ^ (h >> 16)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))  # the top 24 bits: exact in fp32


def power_of_two_at_least(x: Tensor) -> Tensor:
    """The smallest power of two >= each finite positive fp32 ``x`` (at most 2**127; 2**-126 for a
    subnormal x), from its bits: the exponent, plus one unless the mantissa is 0. Infinities and NaN
    stay as they are."""
    finite = torch.isfinite(x)
    bits = torch.where(finite, x, 1.0).view(torch.int32)  # a NaN's bits plus 0x7FFFFF could overflow; a finite x's cannot
    rounded = ((bits + 0x7FFFFF) & -0x800000).view(torch.float32)
    return torch.where(finite, rounded.clamp(max=2.0**127), x)


def power_of_two(exponent: Tensor) -> Tensor:
    """2**exponent (an int32 tensor, within fp32's normal exponents) as fp32, built from its bits."""
    return ((exponent + 127) << 23).view(torch.float32)


def small_float_codes(x: Tensor, exponent_bits: int, mantissa_bits: int, signed: bool, u: Tensor, log_unbiased: bool = False) -> Tensor:
    """Codes (int32) of fp32 ``x`` in a small float with ``exponent_bits`` and ``mantissa_bits``
    (and a sign bit above them if ``signed``), rounded up with probability ``u`` < the fraction of a
    spacing it lies above the value below (``u`` uniform in [0, 1): unbiased; 0.5: nearest, ties
    down). Its top binade is [1, 2), the binades below it down to 2**(2 - 2**exponent_bits), and
    subnormals below those with the lowest binade's spacing, as IEEE floats: a code's magnitude bits
    count its value's steps of that spacing up through the binades, so the next code up is the next
    value. |x| above the largest value (2 - 2**-mantissa_bits) and NaN take the largest code. Unsigned
    codes hold a nonzero x above 0 (the smallest subnormal at least): a nonnegative state is a second
    moment, and a zero there leaves its update dividing by eps alone (as the 4-bit formats' second
    moments have no zero code). With ``log_unbiased`` (unsigned) the log of the result is unbiased
    instead of the result (log_unbiased_threshold). Exponent bits,
    not frexp / ldexp: the fused kernel computes the same without a library call per value."""
    lowest, largest = 2 - 2**exponent_bits, 2 ** (exponent_bits + mantissa_bits) - 1
    magnitude = x.abs()
    # |x|'s binade from its fp32 exponent field (zero and fp32 subnormals: below the lowest)
    binade = ((magnitude.view(torch.int32) >> 23) - 127).clamp(min=lowest)
    steps = magnitude * power_of_two(mantissa_bits - binade)  # exact; < 2**(mantissa_bits + 1) for |x| <= 2
    below = torch.floor(steps)
    if log_unbiased:
        u = log_unbiased_threshold(u, torch.where(magnitude <= 2.0, below, 0.0))  # below < 2**(mantissa_bits + 1)
    up = (steps - below) > u  # steps - below is exact
    code = (binade - lowest) * 2**mantissa_bits + below.to(torch.int32) + up.to(torch.int32)
    code = torch.where(magnitude <= 2.0, code.clamp(max=largest), largest)  # NaN, +-inf: largest
    if signed:
        return code | ((x.view(torch.int32) < 0).to(torch.int32) << (exponent_bits + mantissa_bits))
    return torch.maximum(code, (magnitude.view(torch.int32) != 0).to(torch.int32))  # bits: fp32 subnormals too, as the kernel, when denormals flush


LOG_THRESHOLD_BITS = 16  # the bits of a draw that log_unbiased_threshold reads, and its fixed point's fraction bits


def log_unbiased_threshold(u: Tensor, below: Tensor) -> Tensor:
    """For rounding a value k + t spacings above 0 (k = ``below``, whole spacings, as float; 0 <= t
    < 1) so that the log of the result is unbiased: up to k + 1 with probability p = log(1 + t/k) /
    log(1 + 1/k) (1 for k = 0, the limit of that rule), so that on average log(result) = log(k + t).
    Draw ``u`` (fp32 in [0, 1)) rounds up where u < p, that is where t exceeds g(u) = k ((1 + 1/k)**u
    - 1); this returns g (0 for k = 0) as fp32, exactly. g(u) = u - c(u) with c(u) = u (1 - u) (1 /
    (2k + 1.3) + u / (6k**2 + 6k + 0.6)), a fit whose rounding probabilities are within 4e-4 of the
    exact ones for every k (3e-5 from k = 8 on), computed in 16-bit fixed point: u's top
    LOG_THRESHOLD_BITS bits, the two coefficients as quotients of exact fp32 integers, truncated, and
    then only int32 arithmetic. So the compiled step and the fused kernel agree bit for bit, without
    a logarithm or a table lookup per value."""
    one = 2**LOG_THRESHOLD_BITS
    drawn = (u * one).to(torch.int32)  # exact, then truncated: u's top bits
    k = below.clamp(min=1)  # k = 0 is masked below; as 1 its b * drawn stays within int32
    # tensor / tensor: a true division (number / tensor is a reciprocal times the number)
    a = (torch.full_like(k, 10.0 * one) / (20 * k + 13)).to(torch.int32)  # one / (2k + 1.3)
    b = (torch.full_like(k, 5.0 * one) / ((30 * k + 30) * k + 3)).to(torch.int32)  # one / (6k**2 + 6k + 0.6)
    w = (drawn * (one - drawn)) >> LOG_THRESHOLD_BITS  # u (1 - u)
    c = (w * (a + ((b * drawn) >> LOG_THRESHOLD_BITS))) >> LOG_THRESHOLD_BITS
    return torch.where(below > 0, drawn - c, 0).to(torch.float32) * (1.0 / one)


def small_float_values(codes: Tensor, exponent_bits: int, mantissa_bits: int, signed: bool) -> Tensor:
    """The fp32 values of ``small_float_codes``' codes (exact)."""
    codes = codes.to(torch.int32)
    magnitude = codes & (2 ** (exponent_bits + mantissa_bits) - 1)
    field, mantissa = magnitude >> mantissa_bits, magnitude & (2**mantissa_bits - 1)
    significand = (mantissa + torch.where(field > 0, 2**mantissa_bits, 0)).to(torch.float32)
    values = significand * power_of_two(torch.clamp(field, min=1) + 1 - 2**exponent_bits - mantissa_bits)
    if signed:
        values = torch.where(codes >> (exponent_bits + mantissa_bits) > 0, -values, values)
    return values


def encode_stochastic(x: Tensor, nearest: Tensor, codebook: Tensor, u: Tensor) -> Tensor:
    """Codes (uint8) for fp32 ``x`` rounded stochastically between the two codebook values around
    it: up to ``b`` with probability (x - a) / (b - a), down to ``a`` otherwise, so that the
    expected decoded value is x itself (unbiased). ``nearest`` is x's nearest code (it locates the
    pair), ``codebook`` the decoded value of every code (NaN for unused codes at the end), ``u`` a
    uniform [0, 1) number per element (``dither``). Outside the codebook's range (above its largest
    value, below its smallest) and for NaN, x keeps its nearest code."""
    k = nearest.to(torch.int32)
    low = k - (codebook[k] > x).to(torch.int32)  # the code at or below x
    top = codebook.numel() - 2
    pair = low.clamp(0, top)
    a, b = codebook[pair], codebook[pair + 1]
    inside = (low >= 0) & (low <= top) & (b == b)  # b == b: not an unused (NaN) code
    up = (x - a) > u * (b - a)  # P(up) = (x - a) / (b - a); x == a never moves
    return torch.where(inside, pair + up.to(torch.int32), k).to(torch.uint8)
