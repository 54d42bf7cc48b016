"""Shared test tables: FormatInfo, built from the format registry, so a new format inherits every test.

The example format of ``examples/custom_format.py`` is imported here, which registers it: the whole
suite runs over it too, proving that a format written outside the package is a first-class citizen.
"""

import contextlib
import importlib.util
import os
import pathlib
import sys
from dataclasses import dataclass

import pytest
import torch

import lowbit_optim
from lowbit_optim import quant
from lowbit_optim.formats import get_format, is_blockwise, is_quantized, registered_formats

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Under pytest-xdist the workers share the CPUs: with as many torch threads each as there are CPUs,
# their OpenMP regions wait on one another (2 workers on 2 CPUs: test_lowrank.py and the bf16 training
# tests took 57-62 s, against 18 s with a thread each). So each worker gets its share; the tests of
# several threads set them themselves (test_fused_cpu.py: the kernel on 1, 2 and 3 threads, the
# compiled step on 2).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(max(1, _CPUS // _WORKERS))


@contextlib.contextmanager
def torch_setting(get, set_, value):
    """A torch-wide setting (the thread count, the default dtype) at ``value`` for a with block, then
    back at what ``get()`` gave."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


def torch_threads(count: int):
    return torch_setting(torch.get_num_threads, torch.set_num_threads, count)


def import_script(path: str):
    """``<path>.py`` (e.g. "examples/custom_format") as module ``examples.custom_format``, imported once:
    examples/ and benchmarks/ are no packages. Registered in sys.modules so torch.save can pickle the
    classes such a module defines by reference."""
    module_name = path.replace("/", ".")
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / f"{path}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


CUSTOM_FORMAT_EXAMPLE = import_script("examples/custom_format") if (ROOT / "examples" / "custom_format.py").exists() else None
# the example optimizer: test/optimizer_info.py finds it among LowBitOptimizer's subclasses
CUSTOM_OPTIMIZER_EXAMPLE = import_script("examples/custom_optimizer") if (ROOT / "examples" / "custom_optimizer.py").exists() else None


def stored_format(name: str, numel: int, min_quantize_numel: int = 4096, dtype: torch.dtype = torch.float32) -> str:
    """The format a state is kept in when its optimizer's spec names format ``name``, for a
    ``numel``-element parameter of ``dtype``: fp32 below min_quantize_numel (quantized formats), and
    where a whole-blocks-only format (4bit-torchao, as torchao) would pad a last block; such a
    format, as torchao, keeps them in the parameter's dtype (bf16)."""
    fmt = get_format(name)
    if not is_quantized(fmt):
        return name
    whole_blocks_only = getattr(fmt, "whole_blocks_only", False)
    if numel < min_quantize_numel or whole_blocks_only and numel % fmt.default_block_size:
        return "bf16" if whole_blocks_only and dtype == torch.bfloat16 else "fp32"
    return name


@dataclass(frozen=True)
class FormatInfo:
    """What the tests need to know about a registered format."""

    name: str
    fmt: object

    @property
    def quantized(self) -> bool:
        """A state subclass (blockwise or factored), not a plain dtype."""
        return is_quantized(self.fmt)

    @property
    def blockwise(self) -> bool:
        """Codes and a scale per block of the values themselves (an OptimState whose blocks are
        independent; not 8bit-lowrank, whose codes hold a residual: test_lowrank.py)."""
        return is_blockwise(self.fmt) and self.fmt.independent_blocks

    @property
    def block_size(self):
        return self.fmt.default_block_size

    @property
    def signedness(self) -> tuple[bool, ...]:
        """The signedness the format can hold: both, or unsigned only (second moments)."""
        return (True, False) if self.fmt.holds_signed else (False,)

    @property
    def spec(self):
        """The optimizer's ``state_format`` that uses this format wherever it can: a format holding
        only nonnegative states takes exp_avg_sq (and amsgrad's max), with an fp32 exp_avg."""
        return self.name if True in self.signedness else {"exp_avg": "fp32", "exp_avg_sq": self.name}

    def moment_format(self, state_name: str) -> str:
        """The format name the optimizer stores ``state_name`` in under ``spec`` (before the
        min_quantize_numel rule)."""
        return self.spec if isinstance(self.spec, str) else self.spec["exp_avg" if state_name == "exp_avg" else "exp_avg_sq"]

    def code_values(self, signed: bool) -> torch.Tensor:
        """Every value a normalized code can stand for (sorted, finite, unique), in float64."""
        codes = torch.arange(2**self.fmt.bits, dtype=quant.code_dtype(self.fmt.bits))
        values = self.fmt.decode(codes, signed).double()
        return torch.unique(values[torch.isfinite(values)]) / self.fmt.scale_max

    @property
    def derived(self) -> bool:
        """Whether the format's class subclasses another registered format's (nf4 4bit-torchao's,
        8bit-sr 8bit's): its parent's structure with another codebook or rounding."""
        others = [f for f in registered_formats().values() if isinstance(f, type) and f is not self.fmt]
        return isinstance(self.fmt, type) and any(issubclass(self.fmt, f) for f in others)

    @property
    def stochastic(self) -> bool:
        """Whether ``encode`` rounds stochastically between the two code values around a value
        (unbiased, e.g. 4bit) instead of to the nearest one."""
        return bool(getattr(self.fmt, "stochastic", False))

    @property
    def positive_stays_positive(self) -> bool:
        """Whether an unsigned state's nonzero values never encode to 0 (10bit-sr: a second moment's 0
        would leave the update dividing by eps): between 0 and the smallest code rounding goes up."""
        return bool(getattr(self.fmt, "positive_stays_positive", False))

    def lowest_normalized(self, signed: bool) -> float:
        """Where a block's most negative value may land, normalized (codes / scale_max): the end of
        the codes' range, scale_min / scale_max (-1 for symmetric codes); 0 for a nonnegative state."""
        return self.fmt.scale_min(signed) / self.fmt.scale_max if signed else 0.0

    def block_reach(self, blocks: torch.Tensor, signed: bool) -> torch.Tensor:
        """Per block (rows, float64), the value its scale maps scale_max to: the least r, at least
        MIN_BLOCK_SCALE, with every value in [lowest * r, r] (lowest: scale_min / scale_max; -1 for
        a nonnegative state, whose scales are absmax)."""
        lowest = self.fmt.scale_min(signed) / self.fmt.scale_max
        return torch.where(blocks > 0, blocks, blocks / lowest).amax(dim=1).clamp(min=quant.MIN_BLOCK_SCALE)

    def reference_scales(self, blocks: torch.Tensor, signed: bool) -> torch.Tensor:
        """Brute force of the block scales (float64) of ``blocks`` (rows, float64): block_reach /
        scale_max, which maps each block's largest value to the largest code value, or its most
        negative to the lowest, or for a format of power-of-two scales (8bit-log) the power of two
        at or above it, found by log2."""
        scale = self.block_reach(blocks, signed) / self.fmt.scale_max
        if getattr(self.fmt, "power_of_two_scale", False):
            scale = 2.0 ** torch.ceil(torch.log2(scale.float().double()))  # of the fp32 ratio, which the format rounds up
        return scale

    def unbiased_in(self, signed: bool):
        """The function of a value that stochastic rounding keeps unbiased: the value itself, or its
        log (8bit-log's unsigned states)."""
        return torch.log if not signed and getattr(self.fmt, "log_unbiased", False) else (lambda x: x)

    def rounding_space(self, values: torch.Tensor, signed: bool) -> torch.Tensor:
        """The space (float64, normalized values) in which ``encode`` picks the nearest code."""
        return self.fmt.rounding_space(values * self.fmt.scale_max, signed)

    def boundaries(self, signed: bool) -> torch.Tensor:
        """Normalized values where rounding switches between neighbouring codes: the points halfway
        between them in the rounding space, found here by plain bisection (float64)."""
        values = self.code_values(signed)
        low, high = values[:-1].clone(), values[1:].clone()
        target = (self.rounding_space(low, signed) + self.rounding_space(high, signed)) / 2
        for _ in range(200):
            mid = (low + high) / 2
            below = self.rounding_space(mid, signed) < target
            low, high = torch.where(below, mid, low), torch.where(below, high, mid)
        return high

    def max_rounding_error(self, signed: bool) -> float:
        """Largest distance from a normalized value in [-1, 1] ([0, 1] unsigned) to the code it
        rounds to (half the largest gap when rounding is nearest in value, the largest gap when it
        is stochastic); twice that for power-of-two scales (8bit-log), which map a block's absmax to
        between half the largest code value and that value."""
        values = self.code_values(signed)
        low = self.lowest_normalized(signed)
        inside = values[(values >= low) & (values <= 1.0)]
        if self.stochastic:  # either code around a value: up to a whole gap between neighbours
            error = max(float((inside[1:] - inside[:-1]).max()), float(inside.min() - low), float(1.0 - inside.max()))
        else:
            boundaries = self.boundaries(signed)
            up, down = boundaries - values[:-1], values[1:] - boundaries  # worst case on either side of each boundary
            error = max(float(up.max()), float(down.max()), float(inside.min() - low), float(1.0 - inside.max()))
        return 2 * error if getattr(self.fmt, "power_of_two_scale", False) else error

    def __repr__(self):
        return self.name


FORMATS = [FormatInfo(name, fmt) for name, fmt in registered_formats().items()]
QUANTIZED_FORMATS = [f for f in FORMATS if f.quantized]  # every state subclass
BLOCKWISE_FORMATS = [f for f in FORMATS if f.blockwise]  # codes + block scales
BUILTIN_FORMAT_NAMES = ["fp32", "bf16", "8bit", "4bit-torchao", "nf4", "4bit-precond", "4bit-uncalibrated", "4bit-calibrated", "4bit", "8bit-sr", "8bit-torchao", "8bit-linear", "fp8", "fp8-torchao", "factored", "8bit-lowrank", "4bit-lowrank", "4bit-lowrank-mulaw", "bf16-sr", "10bit-sr", "8bit-log"]

all_formats = pytest.mark.parametrize("info", FORMATS, ids=[f.name for f in FORMATS])
quantized_formats = pytest.mark.parametrize("info", QUANTIZED_FORMATS, ids=[f.name for f in QUANTIZED_FORMATS])
blockwise_formats = pytest.mark.parametrize("info", BLOCKWISE_FORMATS, ids=[f.name for f in BLOCKWISE_FORMATS])


def reshard(fmt, one, two, cut: int):
    """DCP's copies between shards, as dcp.load makes them (distributed.ShardView): the 2-rank states
    ``two`` (rows [:cut] and [cut:]) into a new 1-rank state, and the 1-rank state ``one`` into two
    new ones. Returns (joined, split)."""
    from lowbit_optim.distributed import ShardView

    joined = fmt.zeros(one.shape)
    ShardView(joined)[:cut].copy_(ShardView(two[0]))
    ShardView(joined)[cut:].copy_(ShardView(two[1]))
    split = [fmt.zeros(t.shape) for t in two]
    ShardView(split[0]).copy_(ShardView(one)[:cut])
    ShardView(split[1]).copy_(ShardView(one)[cut:])
    return joined, split


def signedness_id(signed: bool) -> str:
    return "signed" if signed else "unsigned"


def by_signedness(infos: list) -> pytest.MarkDecorator:
    """Parametrize ``info, signed`` over each format and the signedness it can hold."""
    return pytest.mark.parametrize(
        "info, signed", [pytest.param(i, s, id=f"{signedness_id(s)}-{i.name}") for i in infos for s in i.signedness]
    )


def format_info(name: str) -> FormatInfo:
    return FormatInfo(name, get_format(name))


__all__ = [
    "BLOCKWISE_FORMATS",
    "CUSTOM_FORMAT_EXAMPLE",
    "CUSTOM_OPTIMIZER_EXAMPLE",
    "FORMATS",
    "QUANTIZED_FORMATS",
    "FormatInfo",
    "all_formats",
    "blockwise_formats",
    "by_signedness",
    "signedness_id",
    "format_info",
    "import_script",
    "torch_setting",
    "torch_threads",
    "lowbit_optim",
    "quantized_formats",
]
