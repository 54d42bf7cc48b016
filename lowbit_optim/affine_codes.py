"""The fused kernel's gather-free nearest code: a codebook's code counting as a piecewise affine map.

An 8-bit codebook's exact nearest code is the number of its decision thresholds <= v
(quant.decision_thresholds). The kernel finds it in a 64k-entry table by v's top 16 bits
(quant.nearest_code_tables): one 16-lane gather per 16 values, which costs more than the rest of
storing a state on AMD's cores (csrc/lookup.h). Where the thresholds lie on a few even grids, as the
dynamic-tree codebook's do (one grid per decade), counting them is arithmetic instead, with tables
small enough to live in vector registers:

    a = |v|;  level = level_low[octave of a] + (a >= split[octave of a])
    n = floor(clamp(a * slope[level] + offset[level], low[level], high[level]))
    code = zero_code + n for v >= 0, max(zero_code - n, 0) for v < 0

where n counts the thresholds above zero that are <= a. Each level is a run of thresholds on one
grid; a level starts at a threshold (its ``split``), and each binary octave of a holds at most one.
The fp32 affine map puts every threshold inside a level within ``band / 2`` of the integer it starts,
less a margin for the inexact quotient below, so a value whose map lands within ``band`` of an
integer is the only kind that can be miscounted: the kernel counts those (and values within 3 ulps
of a split, above 1, NaN) with the table, so that the codes are the table's, bit for bit.
``affine_codes`` checks all of this when it builds the map and returns None for a codebook it does
not fit (the kernel then gathers from the table).

The map is evaluated on x * RN(1 / scale), not on the exact quotient x / scale (which costs an FMA
correction and a range check per vector: csrc/divide.h): that product is within QUOTIENT_ERROR of
it, relatively, so it moves a value's map by at most QUOTIENT_ERROR * a * slope, which each level's
margin covers, and a value by at most 2 ulps, which the split test covers. The table's lanes take
the exact quotient.
"""

import math
from dataclasses import dataclass

import torch
from torch import Tensor

# Octave k holds a in [2**(k-31), 2**(k-30)): k is the low 5 bits of a's biased exponent (2**-31's is
# 96), and 32 octaves fill two 16-lane registers. Smaller a are raised to 2**-31.
OCTAVES = 32
SMALLEST = 2.0 ** (1 - OCTAVES)
LEVELS = 16  # at most, so that each per-level table fits one 16-lane register
BAND = 2.0**-11  # where the map's fraction lies this close to an integer, the table decides
# The kernel maps x * RN(1 / scale), not the exact quotient x / scale: two roundings, a relative error
# below this. It moves a * slope by at most that much of itself, which each level's fit leaves room for.
QUOTIENT_ERROR = 2.0**-22


@dataclass(frozen=True)
class AffineCodes:
    zero_code: int  # the code of +0.0: the number of thresholds <= 0
    split: list[float]  # per octave: where its level changes (+inf: nowhere)
    level_low: list[int]  # per octave: the level at its lowest value
    slope: list[float]  # per level
    offset: list[float]
    low: list[float]  # clamps of the map: n's range in the level, +-1/2
    high: list[float]
    band: float = BAND


def _fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float64).float())


def _map(a: Tensor, slope: float, offset: float) -> Tensor:
    """The kernel's fma(a, slope, offset) in fp32 (the float64 product of two fp32 numbers is exact;
    the sum's float64 rounding is far below the margin it is checked with)."""
    return (a.double() * slope + offset).float().double()


def affine_codes(thresholds: Tensor) -> AffineCodes | None:
    """The affine map of a codebook's sorted fp32 ``thresholds`` (quant.decision_thresholds), checked
    as the module says; None where it does not fit."""
    t = thresholds.double()
    zero_code = int((t <= 0).sum())
    positive = t[zero_code:]
    if positive.numel() < zero_code or positive.numel() == 0 or float(positive[0]) <= SMALLEST or float(positive[-1]) > 1.0:
        return None
    # the negative thresholds mirror the positive ones: rounded up from -b and b, each pair is one
    # fp32 number or two neighbours, and a magnitude counts the same thresholds either way except on
    # one (the band or the split test sends that to the table)
    mirrored = -t[:zero_code].flip(0)
    nudged = torch.nextafter(mirrored.float(), torch.tensor(math.inf)).double()
    if not bool(((mirrored == positive[:zero_code]) | (nudged == positive[:zero_code])).all()):
        return None
    levels = _levels(positive)
    if len(levels) > LEVELS:
        return None
    starts = [positive[s] for s, _ in levels[1:]]  # level j > 0 begins at the threshold it is split at
    split, level_low = [], []
    for k in range(OCTAVES):
        lo, hi = SMALLEST * 2.0**k, SMALLEST * 2.0 ** (k + 1)
        inside = [float(s) for s in starts if lo < float(s) < hi]
        if len(inside) > 1:
            return None
        split.append(inside[0] if inside else math.inf)
        level_low.append(sum(float(s) <= lo for s in starts))
    return AffineCodes(
        zero_code=zero_code,
        split=split,
        level_low=level_low,
        slope=[m for _, (m, _, _, _) in levels],
        offset=[b for _, (_, b, _, _) in levels],
        low=[low for _, (_, _, low, _) in levels],
        high=[high for _, (_, _, _, high) in levels],
    )


def _levels(positive: Tensor):
    """Greedy runs of thresholds on one fp32 affine map: [(start index, (slope, offset, low, high))].
    Level j holds the values from its split threshold (index start; the first level: from 0) up to
    the next level's, where n runs from start + 1 to the next start."""
    count = positive.numel()
    levels, start = [], -1
    while True:
        end, best = start + 1, _fit(positive, start, start + 1)  # no inner threshold: always fits
        while end < count and (wider := _fit(positive, start, end + 1)) is not None:
            end, best = end + 1, wider
        levels.append((start, best))
        if end == count:
            return levels
        start = end  # the first threshold that did not fit starts the next level


def _fit(positive: Tensor, start: int, end: int):
    """(slope, offset, low, high) of a level from threshold ``start`` whose inner thresholds are
    start+1 .. end-1 (the count after threshold i is i + 1), or None if one of them lands farther
    than band / 2, less its fp32 rounding and the quotient's error, from its integer."""
    low, high = start + 1.5, end + 0.5
    inner = torch.arange(start + 1, end)
    if inner.numel() == 0:
        return 0.0, low, low, high
    x, target = positive[inner], (inner + 1).double()
    if inner.numel() == 1:  # any slope fits one point: its spacing to the threshold below
        below = positive[start] if start >= 0 else 0.0
        slope = _fp32(1.0 / float(x[0] - below))
    else:
        slope = _fp32(float((target[-1] - target[0]) / (x[-1] - x[0])))
    if not slope > 0 or not math.isfinite(slope):
        return None
    offset = _fp32(float((target - x * slope).mean()))
    mapped = _map(x, slope, offset)
    ulp = 2.0 ** (math.floor(math.log2(end + 1)) - 23)
    if float((mapped - target).abs().max()) >= BAND / 2 - 2 * ulp - QUOTIENT_ERROR * float(x.max()) * slope:
        return None
    return slope, offset, low, high
