"""bf16-sr (stochastic_bf16.py): the rounding against a brute-force reference, unbiased and repeatable,
and the reason the format exists: a slow moving average that bf16 to nearest stalls follows its exact
value. The registry runs it through every other format test."""

import math

import torch

from conftest import reshard
from lowbit_optim import StochasticBF16State, quant
from lowbit_optim import stochastic_bf16
from lowbit_optim.stochastic_bf16 import round_bf16_stochastically

WRITES = torch.tensor([3])  # the state's write count, which salts the draws


def bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values at or below and at or above each fp32 x, in float64, by brute force: bf16
    numbers are fp32 numbers with 16 zero low bits, so truncating the bits gives the one toward zero
    and the next bf16 number away from zero the other."""
    truncated = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).double()
    exact = truncated == x.double()
    away = torch.nextafter(truncated.float().bfloat16(), torch.where(x > 0, math.inf, -math.inf).bfloat16()).double()
    away = torch.where(exact, truncated, away)
    low, high = torch.minimum(truncated, away), torch.maximum(truncated, away)
    return low, high


def test_rounds_to_a_neighbour_and_keeps_exact_and_special_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-30, 30, (20000,), generator=g).float()
    rounded = round_bf16_stochastically(x, WRITES).double()
    low, high = bf16_neighbours(x)
    assert bool(((rounded == low) | (rounded == high)).all())
    assert bool((rounded == high).any() and (rounded == low).any() and (low != high).any())
    exact = x.bfloat16().float()
    assert torch.equal(round_bf16_stochastically(exact, WRITES).float(), exact)  # bf16 values stay
    special = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan])
    out = round_bf16_stochastically(special, WRITES).float()
    assert torch.equal(out[:4].view(torch.int32), special[:4].view(torch.int32)) and bool(out[4].isnan())


def test_hash_multipliers_fit_int32():
    """Inductor multiplies an index (a value's place, a block's number) in the int32 index arithmetic
    of a GPU kernel, where Triton refuses a constant of 2**31 or more: on an H100, BLOCK_MIX's
    0x85EBCA77 failed every compile of bf16-sr, 10bit-sr and 8bit-log. CI has no GPU; this holds the
    bound here."""
    for name, multiplier in [("DITHER_PLACE", quant.DITHER_PLACE), ("WRITES_MIX", stochastic_bf16.WRITES_MIX), ("BLOCK_MIX", stochastic_bf16.BLOCK_MIX)]:
        assert 0 < multiplier < 2**31 and multiplier % 2 == 1, name


def test_unbiased_and_repeatable():
    """Values a fraction f of a bf16 spacing above a bf16 number round up with probability f (many
    blocks of different values, so the draws are independent), and the same input rounds the same."""
    g = torch.Generator().manual_seed(1)
    base = (1 + torch.randint(0, 128, (65536,), generator=g).float() / 128) * 2.0 ** torch.randint(-20, 20, (65536,), generator=g).float()
    for fraction in (0.03, 0.25, 0.5, 0.9):
        x = base * (1 + fraction * 2**-7 / (base / 2.0 ** base.log2().floor()))  # f of the spacing at base
        low, high = bf16_neighbours(x)
        position = (x.double() - low) / (high - low)
        up = (round_bf16_stochastically(x, WRITES).double() == high).double()
        assert abs(float(up.mean()) - float(position.mean())) < 4 * math.sqrt(0.25 / x.numel())
    # halfway values: the same count draws the same, the next count anew (about half of them move)
    x = base * (1 + 0.5 * 2**-7 / (base / 2.0 ** base.log2().floor()))
    assert torch.equal(round_bf16_stochastically(x, WRITES), round_bf16_stochastically(x, WRITES.clone()))
    moved = (round_bf16_stochastically(x, WRITES) != round_bf16_stochastically(x, WRITES + 1)).double().mean()
    assert 0.45 < float(moved) < 0.55


def test_reading_copies():
    """dequantize() is a copy in every dtype, bf16 included: an in-place op on what a step reads
    must not write round-to-nearest values into the state (they would never round stochastically)."""
    for dtype in (torch.float32, torch.bfloat16):
        state = StochasticBF16State.from_float(torch.ones(300).to(dtype))
        read = state.dequantize()
        read.add_(1)
        assert read.untyped_storage().data_ptr() != state.values.untyped_storage().data_ptr()
        assert bool((state.dequantize() == 1).all())


def rounded_with_absmax_salt(x: torch.Tensor) -> torch.Tensor:
    """bf16-sr's rounding with the salt of the 8- and 4-bit stochastic formats, each block's absmax,
    in place of its write count: what the write count is there for."""
    blocks = x.view(-1, 256)
    u = quant.dither(blocks, blocks.abs().amax(dim=1)).view(-1)
    return ((x.view(torch.int32) + (u * 65536.0).to(torch.int32)) >> 16).to(torch.int16).view(torch.bfloat16)


def test_slow_average_follows_where_nearest_stalls():
    """An average with beta 0.999 moving from 1 towards 2 (0.1 % of itself per step, under half of
    bf16's spacing) for 1000 steps: bf16 to nearest never leaves 1; bf16-sr ends within 1 % of
    the exact value on average. Salted by the block absmax instead, which barely moves here, the
    draws repeat and it ends more than 5 % short."""
    n, beta = 4096, 0.999
    exact = torch.ones(n, dtype=torch.float64)
    nearest = absmax_salted = torch.ones(n).bfloat16()
    state = StochasticBF16State.from_float(torch.ones(n))
    g = torch.Generator().manual_seed(2)
    for _ in range(1000):
        target = 2 + 0.1 * torch.randn(n, generator=g)
        exact = beta * exact + (1 - beta) * target.double()
        nearest = (beta * nearest.float() + (1 - beta) * target).bfloat16()
        absmax_salted = rounded_with_absmax_salt(beta * absmax_salted.float() + (1 - beta) * target)
        state.copy_(beta * state.dequantize() + (1 - beta) * target)
    assert bool((nearest.float() == 1).all())
    assert abs(float(state.dequantize().double().mean() / exact.mean()) - 1) < 0.01
    assert float(absmax_salted.double().mean() / exact.mean()) < 0.95


def test_checkpoint_reshards_exactly():
    """DCP's copies between shards (distributed.ShardView, 2 -> 1 and 1 -> 2 ranks): bf16 values
    written again round to themselves, so a resharded state holds the saved values exactly."""
    x = torch.randn(300, 7, generator=torch.Generator().manual_seed(3))
    one = StochasticBF16State.from_float(x)
    two = [StochasticBF16State.from_float(one.dequantize()[:100]), StochasticBF16State.from_float(one.dequantize()[100:])]
    joined, split = reshard(StochasticBF16State, one, two, 100)
    assert torch.equal(joined.dequantize(), one.dequantize())
    assert torch.equal(torch.cat([t.dequantize() for t in split]), one.dequantize())
    assert torch.equal(one[100:].dequantize(), one.dequantize()[100:])  # a row slice reads its rows
