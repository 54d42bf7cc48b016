"""10bit-sr (block_float.py): its grid and its byte layout against brute force, and the reason the
format salts its draws with a write count: a slow moving average in a block whose scale does not
move follows its exact value. The registry runs it through every other format test."""

import itertools
import math

import pytest
import torch

from lowbit_optim import BlockFloatState, LogBlockFloatState, quant
from lowbit_optim.stochastic_bf16 import write_salt, writes_from_block


def brute_force_grid(exponent_bits: int, mantissa_bits: int) -> list[float]:
    """Every magnitude of a float with these bits, top binade [1, 2), subnormals below the lowest
    binade at its spacing, listed by counting: field 0 (subnormal) and fields 1.. (normal)."""
    lowest = 2 - 2**exponent_bits
    values = []
    for field, mantissa in itertools.product(range(2**exponent_bits), range(2**mantissa_bits)):
        if field == 0:
            values.append(mantissa / 2**mantissa_bits * 2.0**lowest)
        else:
            values.append((1 + mantissa / 2**mantissa_bits) * 2.0 ** (lowest + field - 1))
    return values


BLOCK_FLOATS = pytest.mark.parametrize("fmt", [BlockFloatState, LogBlockFloatState], ids=lambda f: f.name)


@BLOCK_FLOATS
def test_codes_count_up_the_grid(fmt):
    """Code k decodes to the k-th value of the brute-force grid (its negative with the sign bit), the
    largest is scale_max, and every value encodes back to its own code."""
    for signed in (True, False):
        exponent_bits = fmt.exponent_bits(signed)
        assert exponent_bits + fmt.mantissa_bits + signed == fmt.bits
        grid = torch.tensor(brute_force_grid(exponent_bits, fmt.mantissa_bits), dtype=torch.float64)
        expected = torch.cat([grid, -grid]) if signed else grid
        codes = torch.arange(2**fmt.bits, dtype=quant.code_dtype(fmt.bits))
        values = fmt.decode(codes, signed)
        assert torch.equal(values.double(), expected)
        assert float(values.max()) == fmt.scale_max
        assert torch.equal(fmt.encode(values, signed), codes)


def test_log_unbiased_rounding_against_brute_force():
    """8bit-log's rule (quant.log_unbiased_threshold, a fixed-point fit of the threshold): a value
    k + t spacings above 0 rounds up for a share of all 2**16 draws that is the exact log-unbiased
    probability log(1 + t/k) / log(1 + 1/k) within 4e-4 (the fit's error at k = 1; 3e-5 from k = 8
    on), for every k of the 5-bit grid (subnormal k < 32 included) and t across [0, 1); k = 0
    (between 0 and the smallest code) always rounds up."""
    u = torch.arange(2**16, dtype=torch.float32) / 2**16
    t = torch.linspace(1e-6, 1 - 1e-6, 101)
    for k in range(2 ** (LogBlockFloatState.mantissa_bits + 1)):
        threshold = quant.log_unbiased_threshold(u, torch.full_like(u, float(k)))
        share = (t[:, None] > threshold[None, :]).double().mean(dim=1)
        exact = torch.log1p(t.double() / k) / math.log1p(1 / k) if k else torch.ones(t.numel(), dtype=torch.float64)
        bound = 4e-4 if k < 8 else 3e-5
        assert float((share - exact).abs().max()) < bound, (k, float((share - exact).abs().max()))


def test_rounds_to_a_neighbour_and_saturates():
    """Stochastic codes are one of the two grid values around x (the grid's spacing at x at most):
    checked on values across every binade and the subnormals; beyond the largest value and NaN
    take the largest code."""
    g = torch.Generator().manual_seed(0)
    x = (torch.rand(20000, generator=g) * 2 - 1) * 2.0 ** torch.randint(-12, 1, (20000,), generator=g).float()
    grid = torch.tensor(brute_force_grid(2, 7), dtype=torch.float64)
    decoded = BlockFloatState.decode(BlockFloatState.encode(x, True), True).double()
    above = torch.searchsorted(grid, x.double().abs(), right=False).clamp(max=grid.numel() - 1)
    low, high = grid[(above - (grid[above] > x.double().abs()).long()).clamp(min=0)], grid[above]
    magnitude = decoded.abs()
    assert bool(((magnitude == low) | (magnitude == high)).all())
    assert bool(((decoded == 0) | (decoded.sign() == x.sign())).all())
    assert bool((magnitude == low).any() and (magnitude == high).any() and (low != high).any())
    big = torch.tensor([2.5, -7.0, float("nan"), float("inf")])
    assert BlockFloatState.decode(BlockFloatState.encode(big, True), True).abs().eq(BlockFloatState.scale_max).all()


def test_byte_layout():
    """Per block: the codes' top 8 bits in element order, then their low 2 bits four to a byte,
    the first element in the lowest two (brute force over bits)."""
    block = 8
    codes = torch.randint(0, 1024, (3 * block,), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = quant.pack_codes(codes, 10, block)
    expected = []
    for b in range(3):
        chunk = codes[b * block : (b + 1) * block].tolist()
        expected += [c >> 2 for c in chunk]
        expected += [sum((c & 3) << (2 * i) for i, c in enumerate(chunk[j : j + 4])) for j in range(0, block, 4)]
    assert packed.dtype == torch.uint8 and packed.tolist() == expected
    assert torch.equal(quant.unpack_codes(packed, 10, block), codes.to(torch.int16))
    state = BlockFloatState.zeros(1000)
    assert state.codes.numel() == 4 * 320 and state.scale.numel() == 4  # 1.25 bytes a value, a scale a block


def test_slow_average_follows_where_nearest_and_scale_salted_stall():
    """A beta 0.999 average of low-noise targets moving from 1 towards 1.5 (0.05 % of itself per
    step, under half of the grid's 0.8 % spacing there) for 1000 steps, in blocks whose largest
    value (4) and so whose scale stays put: rounded to nearest it never moves; 10bit-sr ends within
    0.5 % of the exact value on average; salted by the block scale (as 8bit-sr) instead of the write
    count, the draws repeat and it ends short."""
    blocks, beta = 16, 0.999
    start = torch.ones(blocks, 256)
    start[:, 0] = 4.0
    exact = start.double()
    nearest, scale_salted = start.clone(), start.clone()
    state = BlockFloatState.from_float(start)
    g = torch.Generator().manual_seed(2)
    for _ in range(1000):
        target = 1.5 + 0.05 * torch.randn(blocks, 256, generator=g)
        target[:, 0] = 4.0
        exact = beta * exact + (1 - beta) * target.double()
        for rounded in (nearest, scale_salted):
            x = beta * rounded + (1 - beta) * target
            scale = x.abs().amax(dim=1) / BlockFloatState.scale_max
            salt = scale if rounded is scale_salted else torch.ones_like(scale)
            u = quant.dither(x / scale[:, None], salt) if rounded is scale_salted else torch.full_like(x, 0.5)
            codes = quant.small_float_codes(x / scale[:, None], 2, 7, True, u)
            rounded.copy_(BlockFloatState.decode(codes, True) * scale[:, None])
        state.copy_(beta * state.dequantize() + (1 - beta) * target)
    moving = (slice(None), slice(1, None))
    assert bool((nearest[moving] == 1).all())
    assert abs(float(state.dequantize()[moving].double().mean() / exact[moving].mean()) - 1) < 0.005
    assert float(scale_salted[moving].double().mean() / exact[moving].mean()) < 0.9
    assert int(state.writes) == 1001 and torch.equal(write_salt(state.writes, 2), write_salt(state.writes.clone(), 2))


@pytest.mark.parametrize("change", [{"mantissa_bits": 9}, {"mantissa_bits": 3}, {"bits": 8}, {"bits": 9, "mantissa_bits": 5}, {"bits": 8, "mantissa_bits": 7}], ids=str)
def test_subclass_keeps_a_layout_the_kernel_reads(change):
    """A subclass may split its 10 bits (or 8, as 8bit-log) otherwise (test_fused_cpu: BlockFloat5),
    within what the packing and fp32's exponents hold: a sign and exponent bit at least, at most 6
    exponent bits."""
    with pytest.raises(TypeError, match="bits = 8 or 10 and bits - 6 to bits - 2 mantissa bits"):
        type("Odd", (BlockFloatState,), {"name": None, **change})


def test_subclass_maps_each_block_absmax_to_its_largest_value():
    """scale_max follows mantissa_bits, so that a block's largest magnitude is stored exactly; a
    subclass that sets another is refused."""
    fmt = type("BlockFloat5", (BlockFloatState,), {"name": None, "mantissa_bits": 5})
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(3))
    for signed in (True, False):
        values = x if signed else x.abs()
        stored = fmt.from_float(values, signed).dequantize()
        largest = 2 ** (fmt.exponent_bits(signed) + fmt.mantissa_bits) - 1
        assert float(fmt.decode(torch.tensor([largest]), signed)) == fmt.scale_max == 2 - 2**-5
        assert torch.equal(stored.abs().amax(dim=1), values.abs().amax(dim=1))
    with pytest.raises(TypeError, match=r"Wider: a BlockFloatState's scale_max is its largest mantissa, .* = 1.96875: drop scale_max = 4.0"):
        type("Wider", (BlockFloatState,), {"name": None, "mantissa_bits": 5, "scale_max": 4.0})  # was replaced silently


@pytest.mark.parametrize("writes", [0, 7, 2**40 + 5, 2**62 + 3])
def test_a_later_slice_draws_as_its_blocks_in_the_whole_state(writes):
    """A step's later slice from block b (base._pieces: StateTensor.later_slice) counts from
    writes_from_block: its salts for blocks 0, 1, ... are the whole state's for blocks b, b + 1, ...
    at this write and the next, so the slices of a large parameter draw as one call on it."""
    count = torch.tensor([writes])
    for first in (0, 1, 3, 1000, 2**21 + 17):
        shifted = writes_from_block(count, first)
        for step in (0, 1):
            whole = write_salt(count + step, first + 64)[first:]
            assert torch.equal(write_salt(shifted + step, 64).view(torch.int32), whole.view(torch.int32)), (first, step)


class LogBlockFloatFollowingScale(LogBlockFloatState):
    """8bit-log with its scales at absmax / scale_max, as 10bit-sr's: the grid moves with every step's absmax."""

    name = None
    power_of_two_scale = False


def test_power_of_two_scales_keep_a_slow_average_close():
    """A beta 0.999 average of 1.5 (an 8bit-log second moment) in blocks whose largest value jitters
    by up to 2 % every step, for 1000 steps. With power-of-two scales the grid stays put, a value that
    moves by 0.1 % a step stays near its code and rounds with little noise: within 8 % rms and 1 % on
    average of the exact average (4.5 % and +0.2 % here). Scaled by absmax / scale_max, every step's new
    scale moves the grid and each write rounds with a spacing's full noise, which the average keeps
    for about 1000 steps (18 % rms, and +2.4 %: log-unbiased rounding raises the value on average)."""
    blocks, beta = 8, 0.999
    g = torch.Generator().manual_seed(2)
    start = torch.ones(blocks, 256)
    start[:, 0] = 4.0
    exact = start.double()
    still, following = LogBlockFloatState.from_float(start, False), LogBlockFloatFollowingScale.from_float(start, False)
    for _ in range(1000):
        exact = beta * exact + (1 - beta) * 1.5
        for state in (still, following):
            x = beta * state.dequantize() + (1 - beta) * 1.5
            x[:, 0] = 4.0 * (1 + 0.02 * torch.rand(blocks, generator=g))
            state.copy_(x)
    assert bool((still.scale == 4.0).all())

    def errors(state):
        moving = state.dequantize()[:, 1:].double() / exact[:, 1:]
        return float((moving - 1).pow(2).mean().sqrt()), float(moving.mean() - 1)

    (rms, bias), (rms_following, bias_following) = errors(still), errors(following)
    assert rms < 0.08 and abs(bias) < 0.01, (rms, bias)
    assert rms_following > 0.12 and bias_following > 0.01, (rms_following, bias_following)


def test_power_of_two_at_least_against_brute_force():
    """quant.power_of_two_at_least (8bit-log's block scales, from fp32 bits) is the smallest power
    of two >= x by frexp, on exact powers, their fp32 neighbours, subnormals and values near the
    largest fp32; above 2**127 it stays 2**127 (the next power is not an fp32), a subnormal x gives
    2**-126 (scales never are: block absmaxes are at least MIN_BLOCK_SCALE), and infinities and NaN
    stay as they are."""
    powers = [2.0**e for e in range(-149, 128)]
    near = torch.tensor(powers, dtype=torch.float32)
    x = torch.cat([near, torch.nextafter(near, torch.tensor(math.inf)), torch.nextafter(near, torch.tensor(0.0)), torch.rand(1000) * 1e3, torch.tensor([3.4e38, 1e-40])])
    x = x[x > 0]  # the neighbour below 2**-149 is 0
    got = quant.power_of_two_at_least(x)
    for value, result in zip(x.tolist(), got.tolist()):
        mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= mantissa < 1
        expected = min(max(2.0 ** (exponent - 1) if mantissa == 0.5 else 2.0**exponent, 2.0**-126), 2.0**127)
        assert result == expected, (value, result, expected)
    special = quant.power_of_two_at_least(torch.tensor([math.inf, math.nan]))
    assert math.isinf(special[0]) and math.isnan(special[1])
