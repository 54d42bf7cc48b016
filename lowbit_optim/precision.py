"""How the fp32 result of a step lands in a low-precision (bf16) parameter.

A bf16 weight keeps 8 significant bits: an update smaller than half its ulp rounds away, and training
with small learning rates stalls. Each mode here reads the parameter as an fp32 "master" value and
writes the step's new fp32 value back:

- ``nearest``: round to nearest (the default; exact for fp32 parameters).
- ``stochastic``: round up or down at random, unbiased on average (torchao's bf16_stochastic_round).
- ``kahan``: Kahan summation; a compensation buffer (bf16, fp32 or any state format) carries the
  part of each update that rounding dropped into the next step (torchdistx's AnyPrecisionAdamW).
- ``int8-correction``: "24-bit master weights": an int8 holds the rounding error of the bf16 weight
  in units of 1/254 of its ulp, so bf16 + int8 reconstructs the fp32 weight to ~16 significant bits
  for 3 bytes per parameter.

Modes other than ``nearest`` apply to bf16 parameters; parameters of other dtypes use ``nearest``.
These are plain tensor functions traced by torch.compile inside the step.
"""

import torch
from torch import Tensor

from . import quant

PARAM_UPDATES = ("nearest", "stochastic", "kahan", "int8-correction")

# int8-correction: round-to-nearest leaves an error in [-ulp/2, ulp/2]; 254 units per ulp map it onto
# [-127, 127], so it never needs clamping
CORRECTION_UNITS_PER_ULP = 254.0


def check_param_update(mode: str) -> str:
    if mode not in PARAM_UPDATES:
        raise ValueError(f"unknown param_update {mode!r}; use one of {list(PARAM_UPDATES)}")
    return mode


_EXTRA_STATE_NAMES = {"kahan": "compensation", "int8-correction": "param_correction"}
EXTRA_STATE_MODES = {name: mode for mode, name in _EXTRA_STATE_NAMES.items()}  # a buffer's name -> the mode that keeps it


def extra_state_name(mode: str) -> str | None:
    """The optimizer-state key of the buffer a mode keeps beside the parameter, if any."""
    return _EXTRA_STATE_NAMES.get(mode)


def bf16_ulp(x: Tensor) -> Tensor:
    """The spacing of bf16 numbers at ``x`` (bf16 values given as fp32): 2**(exponent - 7).
    Zero and subnormals get 0, so their correction is dropped (they are below 1e-38)."""
    exponent_only = x.view(torch.int32) & 0x7F800000
    return exponent_only.view(torch.float32) * (2.0**-7)


def mode_for(param: Tensor, mode: str) -> str:
    """The mode ``param`` is written with: ``mode`` for a bf16 parameter, ``nearest`` for others
    (an fp32 weight takes the fp32 result as it is)."""
    check_param_update(mode)
    return mode if param.dtype == torch.bfloat16 else "nearest"


def checked_mode(param: Tensor, extra: Tensor | None, mode: str) -> str:
    # the step functions are public: a mode they are given is checked as the optimizers check theirs
    mode = mode_for(param, mode)
    if extra is None and extra_state_name(mode) is not None:
        raise ValueError(f"param_update={mode!r} keeps a buffer beside the parameter ({extra_state_name(mode)}): pass it as param_extra")
    return mode


def read_param(param: Tensor, extra: Tensor | None, mode: str) -> Tensor:
    """The fp32 value the step starts from."""
    mode = checked_mode(param, extra, mode)
    p = param.float()
    if mode == "int8-correction":
        p = p + converted_extra(p, extra.float(), "kahan")
    return p


def converted_extra(param: Tensor, held: Tensor, mode: str) -> Tensor:
    """The buffer ``mode`` keeps beside bf16 ``param`` that holds what ``held`` holds, the other
    mode's buffer as fp32 values: Kahan's compensation from int8-correction's units, or those units
    from a compensation (to 1/254 of an ulp; none beside a zero, subnormal or non-finite weight)."""
    unit = bf16_ulp(param.float()) / CORRECTION_UNITS_PER_ULP
    if mode == "kahan":
        return held * unit
    return _correction_codes((held / unit).round().clamp(-127, 127), unit)


def _correction_codes(units: Tensor, unit: Tensor) -> Tensor:
    """Whole ``units`` (of size ``unit``) as int8-correction stores them: none beside a zero,
    subnormal or non-finite weight (no unit; NaN units: an int8 of NaN is undefined), as the kernel's store."""
    return torch.where((unit > 0) & (units == units), units, torch.zeros_like(units)).to(torch.int8)


def fold_extra(param: Tensor, held: Tensor, mode: str) -> None:
    """Add to ``param``, a bf16 weight made fp32 since ``mode`` kept its buffer (``held``: the
    buffer's values as fp32; model.float() after bf16 steps), what the buffer held: the fp32 weight
    that run stood for. A weight set since (no bf16 value now) is not the buffer's: left as it is."""
    if mode == "int8-correction":
        held = converted_extra(param, held, "kahan")
    param.add_(torch.where(param == param.bfloat16().float(), held, torch.zeros_like(held)))


def write_param(param: Tensor, extra: Tensor | None, start: Tensor, new: Tensor, mode: str) -> None:
    """Store fp32 ``new`` (computed from ``start`` = read_param(...)) into ``param`` (and ``extra``)."""
    mode = checked_mode(param, extra, mode)
    if mode == "stochastic":
        param.copy_(quant.bf16_stochastic_round(new))
    elif mode == "kahan":
        # what the step wants to add, plus what earlier roundings dropped
        wanted = (new - start) + extra.float()
        rounded = quant.bf16_round_nearest(start + wanted)
        extra.copy_(wanted - (rounded - start))
        param.copy_(rounded)
    elif mode == "int8-correction":
        rounded = quant.bf16_round_nearest(new)
        ulp = bf16_ulp(rounded)
        extra.copy_(_correction_codes(((new - rounded) / ulp * CORRECTION_UNITS_PER_ULP).round(), ulp))
        param.copy_(rounded)
    else:
        param.copy_(new)
