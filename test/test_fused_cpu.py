"""The fused CPU kernel (lowbit_optim/fused_cpu.py) against the compiled step it stands in for.

The kernel promises the compiled step's numbers, bit for bit: every test here compares the two with
torch.equal (params, codes, scales, plain states) after a few steps with awkward shapes (padded last
blocks, fp32-state small tensors), for every registered format and every optimizer flag the
kernel takes. The one exception is a factored state's row and column sums, which the kernel adds in
double and in its own order: those, and so the params, agree to a few ulp, and the sums are tested
against float64 sums instead. What the kernel does not take must fall back to the compiled step, or
raise with fused=True.
"""

import contextlib
import ctypes
import functools
import gc
import math
import os
import pathlib
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
import weakref

import expecttest
import pytest
import torch
from torch._dynamo.utils import counters

import emulated_aarch64
import lowbit_optim
from conftest import FORMATS, all_formats, torch_threads
from lowbit_optim import BlockFloatState, FactoredState, OptimState, StateTensor, affine_codes, fused_cpu, kernel_abi, kernel_build, kernel_op, quant
from lowbit_optim.formats import OptimState4bit, OptimState8bit, OptimState8bitSR, OptimStateFp8, OptimStateNF4
from lowbit_optim.stochastic_bf16 import StochasticBF16State, round_bf16_stochastically
from optimizer_info import OPTIMIZERS
from test_formats import blockwise_formats_by_signedness, encode_inputs, sample

# 4544 and 300 elements pad their last block; 200 stays below min_quantize_numel (fp32 state)
SHAPES = [(71, 64), (64, 96), (300,), (200,)]
STEPS = 3


def run(fused, *, shapes=SHAPES, dtype=torch.float32, cls=lowbit_optim.AdamW, **kwargs):
    """Params and optimizer after STEPS steps on fixed random gradients; ``dtype`` may be a list
    (one per shape)."""
    torch.manual_seed(0)
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shapes)
    params = [torch.nn.Parameter(torch.randn(s, dtype=d)) for s, d in zip(shapes, dtypes)]
    kwargs = dict(lr=1e-2, weight_decay=0.1, min_quantize_numel=256) | kwargs
    opt = cls(params, fused=fused, **kwargs)
    for _ in range(STEPS):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    return params, opt


FACTORED = {"exp_avg": "4bit", "exp_avg_sq": "factored"}

# how far a factored state's sums (fp32 sums in the compiled step, double in the kernel) and the
# params they move may part after STEPS steps: a few ulp; a misread state moves params by ~lr
FACTORED_SUMS = dict(rtol=2e-6, atol=0)
FACTORED_PARAMS = dict(rtol=0, atol=1e-6)


def assert_identical(a, b, *, exact_sums: bool = False) -> None:
    """The same bits everywhere, except that factored sums and the params may part by a few ulp
    (unless ``exact_sums``: two runs of the kernel)."""
    (params_a, opt_a), (params_b, opt_b) = a, b
    for i, (x, y) in enumerate(zip(params_a, params_b)):
        factored = not exact_sums and any(isinstance(s, FactoredState) for s in opt_a.state[x].values())
        torch.testing.assert_close(x, y, **(FACTORED_PARAMS if factored else dict(rtol=0, atol=0)), msg=f"param {i}")
        assert opt_a.state[x].keys() == opt_b.state[y].keys()
        for key, s in opt_a.state[x].items():
            t = opt_b.state[y][key]
            assert type(s) is type(t), (i, key)
            if isinstance(s, FactoredState) and not exact_sums:
                for name, inner in s._inner().items():
                    torch.testing.assert_close(inner, getattr(t, name), **FACTORED_SUMS, msg=f"{i} {key} {name}")
            elif isinstance(s, StateTensor):
                for name, inner in s._inner().items():
                    assert torch.equal(inner, getattr(t, name)), (i, key, name)
            else:
                assert torch.equal(s, t), (i, key)


def kernel_takes(info) -> bool:
    states = {name: info.fmt.zeros(4096, signed=name == "exp_avg") for name in ("exp_avg", "exp_avg_sq") if info.moment_format(name) == info.name}
    return fused_cpu.unsupported_reason(torch.zeros(1), torch.zeros(1), torch.zeros(()), states, "nearest") is None


def declares_a_layout(info) -> bool:
    """Whether the format declares a kernel layout (StateTensor.kernel_layout) for a moment it holds."""
    layout = getattr(info.fmt, "kernel_layout", None)
    return layout is not None and any(layout(signed) is not None for signed in info.signedness)


@all_formats
def test_fused_matches_compiled_bitwise(info):
    """Every registered format the kernel takes gives the compiled step's exact bits (factored sums:
    a few ulp); one it does not take (its own encoding) is refused by fused=True and stepped by the
    compiled step. A format that declares a kernel layout (stochastic rounding included) is taken."""
    assert kernel_takes(info) or not declares_a_layout(info), f"{info.name} declares a kernel layout, yet the kernel refuses it"
    if not kernel_takes(info):
        with pytest.raises(RuntimeError, match="own encoding"):
            run(True, state_format=info.spec)
        assert_identical(run(None, state_format=info.spec), run(False, state_format=info.spec))
        return
    assert_identical(run(True, state_format=info.spec), run(False, state_format=info.spec))


FLAG_CASES = {
    "amsgrad": dict(state_format="8bit", amsgrad=True),
    "Adam L2 + maximize": dict(cls=lowbit_optim.Adam, state_format="4bit", maximize=True),
    "bf16 params": dict(state_format="8bit", dtype=torch.bfloat16),
    "per-moment formats": dict(state_format={"exp_avg": "4bit", "exp_avg_sq": "fp8"}, amsgrad=True),
    "betas <= 0.5": dict(state_format="8bit", betas=(0.3, 0.5)),  # lerp's other branch
    "bf16 states, Adam L2, amsgrad": dict(cls=lowbit_optim.Adam, state_format="bf16", amsgrad=True, maximize=True),
    "4bit, block_size 32, amsgrad": dict(state_format="4bit", block_size=32, amsgrad=True),  # dither positions in short blocks, each moment
    "block_size 2048": dict(state_format="8bit", block_size=2048),  # blocks longer than a chunk
    "8bit, block_size 32": dict(state_format="8bit", block_size=32),  # decoded 64 codes at a time, across blocks
    "fp8, block_size 4": dict(state_format="fp8", block_size=4),
    "lr tensor, no decay": dict(state_format="fp8", lr=torch.tensor(3e-3), weight_decay=0.0),
    "factored": dict(state_format={"exp_avg": "8bit", "exp_avg_sq": "factored"}),  # (amsgrad: refused for it)
    "8bit-log amsgrad": dict(state_format={"exp_avg": "8bit", "exp_avg_sq": "8bit-log"}, amsgrad=True),
    "factored, Adam L2": dict(cls=lowbit_optim.Adam, state_format={"exp_avg": "fp8", "exp_avg_sq": "factored"}),
    "bf16 params, int8-correction": dict(state_format="8bit", dtype=torch.bfloat16, param_update="int8-correction"),
    "mixed params, int8-correction": dict(state_format="4bit", dtype=[torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16], param_update="int8-correction"),
}


@pytest.mark.parametrize("case", FLAG_CASES, ids=list(FLAG_CASES))
def test_fused_matches_compiled_flags(case):
    kwargs = FLAG_CASES[case]
    assert_identical(run(True, **kwargs), run(False, **kwargs))


def test_float64_tensor_options_step_as_their_values_do_on_every_path():
    """An lr or betas given as float64 tensors (torch.as_tensor of a NumPy float) step as the same
    numbers given as Python floats, on each path: the kernel, the compiled and the eager step (the
    compiled step had kept them in float64, where the kernel rounds them to fp32 as it does a
    float's: 1.2e-7 and 2.4e-7 apart)."""
    kwargs = dict(state_format="fp32", weight_decay=0.01)  # (an ulp apart in a few elements: some numbers and data only)
    as_float64 = functools.partial(torch.tensor, dtype=torch.float64)
    for given, floats in ((dict(lr=as_float64(1e-3)), dict(lr=1e-3)), (dict(betas=(as_float64(0.9), as_float64(0.999))), dict(betas=(0.9, 0.999)))):
        for options in (dict(fused=True), dict(fused=False), dict(fused=False, compile=False)):
            assert_identical(run(**options, **kwargs, **given), run(**options, **kwargs, **floats))


def test_a_factored_state_of_subnormal_values_reads_them_on_every_path():
    """A 1-D factored second moment of subnormal values (gradients of 1e-20, squares 1e-40) reads
    them back exactly in the kernel, the compiled and the eager step, so its rows (the values) are
    the eager reference's bits after steps that read it (a total clamped to float32's smallest
    normal read them up to 12x small; the compiled step kept doing so after the fix, from a graph
    torch.compile's cache had kept: the numerics fingerprint now hashes the package's source)."""
    runs = []
    for options in (dict(fused=True), dict(fused=False), dict(fused=False, compile=False)):
        p = torch.nn.Parameter(torch.zeros(300))
        opt = lowbit_optim.AdamW([p], lr=1e-2, eps=0.0, state_format=FACTORED, min_quantize_numel=256, **options)
        for step in range(3):
            p.grad = torch.linspace(0.5, 2.0, 300) * 1e-20 * (step + 1)
            opt.step()
        runs.append(opt.state[p]["exp_avg_sq"])
    expected = torch.zeros(300)
    for step in range(3):
        expected = expected.lerp((torch.linspace(0.5, 2.0, 300) * 1e-20 * (step + 1)).square(), 1 - 0.999)
    assert bool((expected < torch.finfo(torch.float32).tiny).all()) and bool((expected > 0).all())
    for state in runs:
        assert torch.equal(state.row, expected) and torch.equal(state.dequantize(), expected)


SGD, LION, ADEMAMIX, MUON = lowbit_optim.SGD, lowbit_optim.Lion, lowbit_optim.AdEMAMix, lowbit_optim.Muon
BF16 = torch.bfloat16
MATRICES = [(71, 64), (64, 96), (20, 10)]  # Muon's: matrices only, the last one below min_quantize_numel
# one tall matrix for Muon's other options: tall, wide and small ones compile graphs of their own
# (~3 s each, cold), and their iterations are the compiled step's alike on both paths
MATRIX = [(71, 64)]

# SGD, Lion and AdEMAMix, each an update of its own in the kernel (csrc/update_*.h): every option,
# the formats' kinds (codebook 8/4-bit stochastic, fp8, bf16 in place; the 200-element shape keeps
# fp32 states) and bf16 params, few enough graphs to stay cheap (each case compiles its own)
OTHER_OPTIMIZER_CASES = {
    "SGD 8bit": dict(cls=SGD, momentum=0.9, state_format="8bit"),
    "SGD 4bit, nesterov, maximize": dict(cls=SGD, momentum=0.9, nesterov=True, maximize=True, state_format="4bit"),
    "SGD fp8, dampening, bf16 params": dict(cls=SGD, momentum=0.9, dampening=0.3, state_format="fp8", dtype=BF16),
    "SGD bf16 states, no decay": dict(cls=SGD, momentum=0.5, state_format="bf16", weight_decay=0.0),
    "SGD bf16 states, nesterov, maximize, bf16 params": dict(cls=SGD, momentum=0.9, nesterov=True, maximize=True, state_format="bf16", dtype=BF16),
    "SGD bf16 states, dampening": dict(cls=SGD, momentum=0.9, dampening=0.3, state_format="bf16"),
    "SGD without momentum (no state), bf16 params": dict(cls=SGD, dtype=[BF16, torch.float32, BF16, torch.float32]),
    "Lion 4bit, maximize, bf16 params": dict(cls=LION, state_format="4bit", maximize=True, dtype=BF16),
    "Lion fp8, betas <= 0.5": dict(cls=LION, state_format="fp8", betas=(0.3, 0.5)),  # lerp's other branch
    "Lion bf16 states, lr tensor": dict(cls=LION, state_format="bf16", lr=torch.tensor(3e-3)),
    "AdEMAMix 4bit, warm-ups, maximize": dict(cls=ADEMAMIX, state_format="4bit", t_alpha=5, t_beta3=7, maximize=True),
    "AdEMAMix fp8, bf16 params, betas <= 0.5": dict(cls=ADEMAMIX, state_format="fp8", dtype=BF16, betas=(0.3, 0.5, 0.9)),
    "AdEMAMix bf16 states, warm-up of beta3": dict(cls=ADEMAMIX, state_format="bf16", t_beta3=4),
    "AdEMAMix 8bit-linear / bf16-sr / bf16-sr, bf16 params": dict(
        cls=ADEMAMIX, state_format={"exp_avg": "8bit-linear", "exp_avg_slow": "bf16-sr", "exp_avg_sq": "bf16-sr"}, dtype=BF16
    ),
    "SGD 4bit, int8-correction": dict(cls=SGD, momentum=0.9, state_format="4bit", dtype=BF16, param_update="int8-correction"),
    "Lion 8bit, int8-correction": dict(cls=LION, state_format="8bit", dtype=BF16, param_update="int8-correction"),
    "AdEMAMix 8bit, int8-correction": dict(cls=ADEMAMIX, state_format="8bit", dtype=BF16, param_update="int8-correction"),
    # Muon: the kernel's momentum, then the compiled iterations and apply
    "Muon 8bit": dict(cls=MUON, state_format="8bit", shapes=MATRICES),
    "Muon 4bit, no nesterov, bf16 params": dict(cls=MUON, state_format="4bit", nesterov=False, dtype=BF16, shapes=MATRIX),
    "Muon fp8, momentum <= 0.5, adjusted lr": dict(cls=MUON, state_format="fp8", momentum=0.3, adjust_lr_fn="match_rms_adamw", shapes=MATRIX),
    "Muon bf16 states, int8-correction": dict(cls=MUON, state_format="bf16", dtype=BF16, param_update="int8-correction", shapes=MATRIX),
}


@pytest.mark.parametrize("case", OTHER_OPTIMIZER_CASES, ids=list(OTHER_OPTIMIZER_CASES))
def test_other_optimizers_match_compiled(case):
    """SGD, Lion, AdEMAMix and Muon's momentum in the kernel (fused=True) give their compiled step's
    bits (AdEMAMix's warm-ups of alpha and beta3 computed in float64 in the kernel's prepare, as in
    the graph; Muon's iterations start from the kernel's bf16 output as from the graph's)."""
    kwargs = OTHER_OPTIMIZER_CASES[case]
    assert_identical(run(True, **kwargs), run(False, **kwargs))


@pytest.mark.parametrize("state_format, by_default", [("fp32", False), ("bf16", False), ("8bit", True), ("bf16-sr", True)])
def test_muon_takes_the_kernel_by_default_for_states_in_codes(monkeypatch, state_format, by_default):
    """Muon.fused_default_needs_codes: with plain fp32 or bf16 momentum the compiled step is as fast
    (its graph fuses the momentum into the iterations'), so fused=None leaves those matrices to it;
    a momentum in codes takes the kernel, and fused=True takes it for any. (The iterations run
    eagerly: which path takes the momentum is the question, and their graphs compile elsewhere.)"""
    calls = []
    monkeypatch.setattr(lowbit_optim.base, "compiled_step", lambda step_function: step_function)
    momentum = fused_cpu.muon_momentum
    monkeypatch.setattr(fused_cpu, "muon_momentum", lambda items, group: (calls.append(len(items)), momentum(items, group)))
    run(None, cls=MUON, state_format=state_format, shapes=MATRICES)
    assert bool(calls) == by_default, calls
    calls.clear()
    run(True, cls=MUON, state_format=state_format, shapes=MATRICES)
    assert sum(calls) == len(MATRICES) * STEPS


def test_fused_muon_steps_its_matrices_in_runs_of_bounded_size(monkeypatch):
    """Muon's bf16 momenta in flight, between the kernel's momentum and each matrix's iterations, are
    at most SCRATCH_ELEMENTS elements (a larger matrix alone): the whole group's were, 2 bytes a
    parameter (more than its 8-bit momentum). The same bits as in one run."""
    sizes = [shape[0] * shape[1] for shape in MATRICES]
    expected = run(True, cls=MUON, state_format="8bit", shapes=MATRICES)
    calls = []
    momentum = fused_cpu.muon_momentum
    monkeypatch.setattr(fused_cpu, "muon_momentum", lambda items, group: (calls.append(sum(i[0].numel() for i in items)), momentum(items, group)))
    monkeypatch.setattr(lowbit_optim.optim, "SCRATCH_ELEMENTS", max(sizes))
    assert_identical(run(True, cls=MUON, state_format="8bit", shapes=MATRICES), expected)
    assert max(calls) == max(sizes) and len(calls) > STEPS  # (test setup: matrices in several runs)


def test_fused_muon_makes_one_compiled_call_per_matrix(monkeypatch):
    """After the kernel's momentum, each matrix's iterations and apply are one compiled call
    (functional.muon_finish): two calls had made a small matrix's default step slower than its
    compiled step (benchmarks/default_vs_compiled.py)."""
    calls = []

    def counted(fn):
        def call(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(lowbit_optim.base, "compiled_step", counted)
    run(True, cls=MUON, state_format="8bit", shapes=MATRICES)
    assert calls == ["muon_finish"] * len(MATRICES) * STEPS


@pytest.mark.parametrize(
    "cls, kwargs", [(SGD, dict(momentum=0.9, nesterov=True)), (LION, {}), (ADEMAMIX, dict(t_alpha=3, t_beta3=3)), (MUON, {})], ids=["SGD", "Lion", "AdEMAMix", "Muon"]
)
def test_other_optimizers_non_finite_gradients(cls, kwargs):
    """A NaN and an inf in the gradient (Lion: the sign of NaN and of inf; Muon: a whole matrix
    turns NaN) give the compiled step's values, with fp32 states."""

    def poisoned(fused):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn((20, 15) if cls is MUON else 300))
        opt = cls([param], lr=1e-2, fused=fused, state_format="fp32", **kwargs)
        for _ in range(2):
            param.grad = torch.randn_like(param)
            flat = param.grad.view(-1)
            flat[3], flat[40] = float("nan"), float("inf")
            opt.step()
        return [param.detach(), *(v for k, v in opt.state[param].items())]

    for a, b in zip(poisoned(True), poisoned(False)):
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


# The kernel's code paths, each a build with one more flag: AVX-512 intrinsics (native here), AVX2
# intrinsics for the table lookups and compiler-vectorized loops for the rest, and the portable
# loops alone (x86-64: SSE2, as on a CPU the file has no intrinsics for); and those loops as an ARM
# server runs them (NEON), built for aarch64 and emulated (emulated_aarch64.py).
BUILDS = {"native": None, "AVX2": "-mno-avx512f", "portable": "-march=x86-64", "aarch64": emulated_aarch64.CPU("generic")}
build_flags = pytest.mark.parametrize("flag", BUILDS.values(), ids=BUILDS.keys())
# The AVX2 build with either kind of table lookup, whichever the compiler's tuning chose: gathers,
# or scalar loads as on AMD's cores (lookup.h, stochastic.h)
AVX2_LOOKUPS = {"AVX2 gathers": ("-mno-avx512f", "-DSLOW_GATHERS=0"), "AVX2 no gathers": ("-mno-avx512f", "-DSLOW_GATHERS=1")}
# Both vector builds with the update's sqrt(v) / sqrt(bias correction), bf16 states' first moment and
# (AVX-512 only: the AVX2 encoders always divide) the encoders' quotients the other way than this CPU's
# tuning chose (divide.h, kernel_build.tuning): the builds above take the chosen way
OTHER_DIVIDER = 0 if "-DFAST_DIVIDER=1" in kernel_build.tuning() else 1
DIVIDER_BUILDS = {
    f"{isa}{'divided' if OTHER_DIVIDER else 'corrected'} roots": (*flags, f"-DFAST_DIVIDER={OTHER_DIVIDER}")
    for isa, flags in (("", ()), ("AVX2 ", ("-mno-avx512f",)))
}
# The codecs with both lookups in both vector builds (AVX-512 without gathers: the 8-bit affine map,
# affine.h), and with the AVX-512 encoders' other way to divide by a block's scale
CODEC_BUILDS = {**BUILDS, "gathers": "-DSLOW_GATHERS=0", "no gathers": "-DSLOW_GATHERS=1", **AVX2_LOOKUPS, "other divider": f"-DFAST_DIVIDER={OTHER_DIVIDER}"}
codec_build_flags = pytest.mark.parametrize("flag", CODEC_BUILDS.values(), ids=CODEC_BUILDS.keys())


@contextlib.contextmanager
def kernel_built_with(flag):
    """fused_cpu's kernel built with one more compiler flag, or a tuple of them (None: as it is; an
    emulated_aarch64.CPU: built for that CPU and emulated), while in the block."""
    if flag is None:
        yield
        return
    if isinstance(flag, emulated_aarch64.CPU):
        why = emulated_aarch64.unavailable()
        if why:
            pytest.skip(f"the aarch64 kernel is emulated here, but {why}")
        emulated = emulated_aarch64.kernel(flag)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernel_abi, "load", lambda: (emulated, None))
            yield
        return
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"{flag} is an x86 flag")
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(kernel_build, "FLAGS", [*kernel_build.FLAGS, *((flag,) if isinstance(flag, str) else flag)])
            kernel_abi.load.cache_clear()
            yield
    finally:
        kernel_abi.load.cache_clear()


def state_t(state):
    """``state`` as the C's state_t, for the test hooks (lowbit_decode, lowbit_encode, ...)."""
    return ctypes.byref(kernel_op.describe(kernel_op.kernel(), state))


def quantize_with_kernel(state, x: torch.Tensor, size: int | None = None) -> None:
    """Stores into ``state`` what a step stores for the values ``x`` (lowbit_quantize: block scales,
    then codes), a chunk of ``size`` elements (whole blocks; default: the kernel's) at a time."""
    size = size or kernel_op.kernel().limits["max_chunk"]
    if hasattr(state, "writes"):  # a step counts the write before it stores (scheduler.h), as quantize_ does
        state.writes.add_(1)
    for start in range(0, x.numel(), size):
        piece = x[start : start + size]
        values = torch.cat([piece, piece.new_zeros(-piece.numel() % state.block_size)])  # room to the block boundary
        fused_cpu.library().lowbit_quantize(state_t(state), values.data_ptr(), start, piece.numel())


# what each build must step like the native one: both code widths in both moments, fp8, calibrated
# scales, factored sums (their order does not depend on the vector width), the update's flags, each
# optimizer's update, and a state with a part outside its codes
OTHER_BUILD_CASES = [
    dict(state_format={"exp_avg": "4bit", "exp_avg_sq": "8bit"}),
    dict(state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"}),
    dict(state_format="fp8"),
    dict(state_format={"exp_avg": "fp8", "exp_avg_sq": "factored"}),
    dict(state_format="bf16", amsgrad=True),
    dict(cls=lowbit_optim.Adam, state_format="bf16", maximize=True, betas=(0.3, 0.5)),  # L2, lerp's other branch
    dict(cls=lowbit_optim.Adam, state_format="4bit", amsgrad=True),
    dict(state_format="4bit", amsgrad=True),  # stochastic rounding: each build's own vector loop
    dict(state_format="8bit", dtype=torch.bfloat16),
    dict(cls=lowbit_optim.SGD, momentum=0.9, nesterov=True, state_format={"momentum_buffer": "4bit"}),
    dict(cls=lowbit_optim.SGD, momentum=0.9, nesterov=True, state_format="bf16"),  # each build's bf16 vector loop
    dict(cls=lowbit_optim.Lion, state_format="8bit", dtype=torch.bfloat16),
    dict(cls=lowbit_optim.AdEMAMix, state_format={"exp_avg": "fp8", "exp_avg_slow": "bf16", "exp_avg_sq": "8bit"}, t_alpha=5, t_beta3=7),
    dict(cls=lowbit_optim.AdEMAMix, state_format="bf16", maximize=True),
    dict(state_format="bf16-sr"),  # the hash and carry, as each build compiles them
    dict(cls=lowbit_optim.AdEMAMix, state_format={"exp_avg": "8bit-linear", "exp_avg_slow": "10bit-sr", "exp_avg_sq": "10bit-sr"}),
    dict(cls=MUON, state_format="8bit", dtype=BF16, param_update="int8-correction", shapes=MATRICES),  # Muon's momentum, 24-bit weights
    dict(cls=SGD, momentum=0.9, state_format="8bit-lowrank", shapes=MATRICES),  # a part outside the codes, its products (products.h)
]


# (AVX2 without FMA, which no CPU has, takes the portable loops: fused_step.c's AVX2_ONLY)
OTHER_BUILDS = {
    **AVX2_LOOKUPS,
    **DIVIDER_BUILDS,
    "no VBMI": "-mno-avx512vbmi",
    "AVX2 without FMA": ("-mno-avx512f", "-mno-fma"),
    "portable": "-march=x86-64",
    "aarch64": emulated_aarch64.CPU("generic"),
    "aarch64 Neoverse N1": emulated_aarch64.CPU("neoverse_n1"),
    "aarch64 Neoverse V1 (SVE)": emulated_aarch64.CPU("neoverse_v1"),
    "aarch64 Neoverse V1, 128-bit SVE": emulated_aarch64.CPU("neoverse_v1", sve_bits=128),
}


@pytest.mark.parametrize("flag", OTHER_BUILDS.values(), ids=OTHER_BUILDS.keys())
def test_builds_for_other_cpus_match(flag):
    """Built without AVX-512 the kernel runs AVX2 lookups (gathers, or scalar loads where gathers
    are slow) and compiler-vectorized loops, without VBMI it decodes 8-bit codes with gathers, for
    x86-64 it runs its portable loops alone, for aarch64 the same loops as clang vectorizes them with
    NEON or SVE (emulated), and either x86 vector build may divide the update's square root (and bf16
    states' first moment) by a real division or a corrected product: the same bits again."""
    expected = [run(True, **kwargs) for kwargs in OTHER_BUILD_CASES]
    with kernel_built_with(flag):
        for kwargs, reference in zip(OTHER_BUILD_CASES, expected):
            assert_identical(run(True, **kwargs), reference, exact_sums=True)


@build_flags
@pytest.mark.parametrize("name", ["8bit", "8bit-torchao", "4bit-torchao", "fp8"])
def test_kernel_scales_blocks_like_the_format(name, flag):
    """Each block's scale (block_scale: quant.block_scales) and codes are quantize_'s in every build,
    for codes that reach less far below zero than above (8bit's, with the scale that keeps a negative
    extreme; 8bit-torchao's and 4bit-torchao's at the absmax) and symmetric ones (fp8): blocks whose
    extreme is positive, negative, both at once, -inf, a NaN of either sign, only zeros, only negative
    values, only subnormals."""
    fmt, bs = lowbit_optim.get_format(name), 128
    g = torch.Generator().manual_seed(3)
    x = torch.randn(12, bs, generator=g)
    x[0, 5], x[1, 7] = 9.0, -9.0  # a positive, a negative extreme
    x[2, 1], x[2, 2] = 9.0, -9.0
    x[3, 0], x[4, 9] = -math.inf, torch.tensor(0xFFC00001 - 2**32, dtype=torch.int32).view(torch.float32)  # a negative NaN
    x[5, 3] = math.nan
    x[6] = 0.0
    x[7] = -x[7].abs()
    x[8] = x[8] * 2.0**-140
    with kernel_built_with(flag):
        state, expected = fmt.zeros(x.numel(), True, bs), fmt.from_float(x.flatten(), True, bs)
        quantize_with_kernel(state, x.flatten())
    torch.testing.assert_close(state.scale, expected.scale, rtol=0, atol=0, equal_nan=True)
    number = ~expected.dequantize().isnan()  # (fp8's NaN of -inf / inf: positive on aarch64, negative on x86)
    assert torch.equal(state.unpacked_codes()[number], expected.unpacked_codes()[number])
    assert bool(state.dequantize()[~number].isnan().all())
    lowest = float(fmt.scale_min(True))
    assert bool(expected.scale[1] == 9.0 / -lowest) and bool(expected.scale[0] == 9.0 / fmt.scale_max)


@build_flags
def test_kernel_rounds_bf16_like_the_format(flag):
    """bf16-sr's store (store_bf16_stochastic) gives round_bf16_stochastically's bits from any element
    on (chunks may start mid-block: a factored state's rows set their length) and at any count of
    writes (its products wrap in 64 bits as torch's do). A NaN of any sign and payload, in the vector
    loop or the tail, becomes the quiet NaN 0x7FC0, as a bf16 state's store gives it (torch's vector
    conversion, which the reference takes for NaN, gives 0xFFFF: a NaN too)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3000, generator=g) * 10.0 ** torch.randint(-20, 20, (3000,), generator=g).float()
    x[:5] = torch.tensor([0.0, -0.0, math.inf, -math.inf, 3.4e38])  # 3.4e38 may carry into infinity
    nans = torch.tensor([0x7FC00000, 0xFFC00001 - 2**32, 0x7F800001, -1], dtype=torch.int32).view(torch.float32)
    x[[7, 356, 511, 2999]] = nans  # 356 and 511: in a loop's tail (the last of runs of 101 and 155 values); 2999: the last
    with kernel_built_with(flag):
        for writes in (1, 12345, 2**40 + 5, 2**62 + 3):
            state = StochasticBF16State.zeros(x.numel())
            state.writes.fill_(writes)
            for start, end in ((0, 100), (100, 357), (357, 1400), (1400, 3000)):
                piece = x[start:end].clone()
                fused_cpu.library().lowbit_quantize(state_t(state), piece.data_ptr(), start, end - start)
            expected = round_bf16_stochastically(x, torch.tensor([writes]))
            stored, number = state.values.view(torch.int16), ~x.isnan()
            assert torch.equal(stored[number], expected.view(torch.int16)[number]), writes
            assert bool((stored[~number] == 0x7FC0).all()) and bool(expected[~number].isnan().all())


@build_flags
def test_kernel_converts_bf16_like_torch(flag):
    """A bf16 state's store (store_values: its vector loop, vec_store_bf16, and the scalar tail) rounds
    every kind of fp32 number as torch does: to nearest even (ties either way), the largest ones to
    infinity, subnormals, zeros and infinities kept; a NaN of any sign and payload becomes the quiet
    NaN 0x7FC0. Its load gives the bf16 values exactly."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(2**31), 2**31, (4000,), generator=g, dtype=torch.int64)
    ties = (bits & ~0xFFFF) | 0x8000  # halfway between two bf16 numbers
    special = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7F7FFFFF, 0x7F7F8000, 0xFF7F8000, 0x7F7F7FFF, 1, 0x8000, 0x18000, 0x807FFFFF]
    nans = [0x7FC00000, 0xFFC00001, 0x7F800001, 0xFFFFFFFF, 0x7FFF8000]
    x = torch.cat([bits, ties, torch.tensor(special + nans)]).to(torch.int32).view(torch.float32)  # int64 -> int32 wraps
    with kernel_built_with(flag):
        state = torch.zeros(x.numel(), dtype=torch.bfloat16)
        for start, end in ((0, 5), (5, 100), (100, 357), (357, 4500), (4500, x.numel())):
            piece = x[start:end].clone()
            fused_cpu.library().lowbit_quantize(state_t(state), piece.data_ptr(), start, end - start)
        stored = state.view(torch.int16)
        expected = x.to(torch.bfloat16).view(torch.int16)
        finite = ~x.isnan()
        assert torch.equal(stored[finite], expected[finite])
        assert bool((stored[~finite] == 0x7FC0).all()) and int((~finite).sum()) >= len(nans)
        out = torch.empty(x.numel())
        fused_cpu.library().lowbit_decode(state_t(state), x.numel(), out.data_ptr())
        assert torch.equal(out.view(torch.int32), state.float().view(torch.int32))


class BlockFloat5(BlockFloatState):
    """A user's block float with 5 mantissa bits (4 or 5 exponent bits): the kernel reads the split."""

    name = None
    mantissa_bits = 5


BLOCK_FLOATS = {i.name: i.fmt for i in FORMATS if isinstance(i.fmt, type) and issubclass(i.fmt, BlockFloatState)} | {"mantissa5": BlockFloat5}


@build_flags
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
@pytest.mark.parametrize("fmt", list(BLOCK_FLOATS.values()), ids=list(BLOCK_FLOATS))
def test_kernel_stores_block_floats_like_the_format(fmt, signed, flag):
    """Each block float's store (csrc/block_float.h: 10bit-sr, 8bit-log and its log-unbiased
    rounding) gives quantize_'s codes and scales, chunk by chunk (chunks of two blocks; the last block
    is partial), at any count of writes, on values across every binade and subnormal of its small
    float, zeros and exact codes, a block's absmax and a NaN block (NaN scale, largest codes); so does
    a subclass with another split of its bits."""
    g = torch.Generator().manual_seed(0)
    n, bs = 5 * 256 + 77, 256
    x = torch.randn(n, generator=g) * 2.0 ** torch.randint(-14, 3, (n,), generator=g).float()
    x = x if signed else x.abs()
    x[:4] = torch.tensor([0.0, -0.0 if signed else 0.0, 4.0, 1e-30])
    x[300] = math.nan
    with kernel_built_with(flag):
        for writes in (0, 12345, 2**62 + 3):
            state, expected = fmt.zeros(n, signed), fmt.zeros(n, signed)
            for counted in (state, expected):
                counted.writes.fill_(writes)
            expected.copy_(x)
            quantize_with_kernel(state, x, 2 * bs)
            assert torch.equal(state.codes, expected.codes), writes
            torch.testing.assert_close(state.scale, expected.scale, rtol=0, atol=0, equal_nan=True)
            out = torch.empty(n)
            fused_cpu.library().lowbit_decode(state_t(state), n, out.data_ptr())
            torch.testing.assert_close(out, expected.dequantize(), rtol=0, atol=0, equal_nan=True)


def test_fused_step_compiles_nothing():
    """On the CPU the default step of fp32 parameters with a kernel format is one C call: no graph."""
    graphs = counters["stats"]["unique_graphs"]
    run(None, state_format="8bit")
    assert counters["stats"]["unique_graphs"] == graphs


def test_mixed_group_falls_back_per_parameter():
    """A bf16 parameter under Kahan summation takes the compiled step, its fp32 neighbour the
    kernel; together they give what the compiled step gives for both."""

    mixed = dict(shapes=[(64, 96), (71, 64)], dtype=[torch.float32, torch.bfloat16], state_format="8bit", param_update="kahan")
    assert_identical(run(None, **mixed), run(False, **mixed))


def test_stepper_is_chosen_once_per_parameter(monkeypatch):
    """Whether the kernel can step a parameter is decided when its states are new (the formats'
    layouts do not change between steps), not on every step; loaded states decide anew. Each step
    still checks the gradient."""
    calls = []
    decide = fused_cpu.param_unsupported_reason
    monkeypatch.setattr(fused_cpu, "param_unsupported_reason", lambda *a: calls.append(a) or decide(*a))
    params = [torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(71, 64))]
    opt = lowbit_optim.AdamW(params, state_format="8bit")
    for _ in range(3):
        for q in params:
            q.grad = torch.randn_like(q)
        opt.step()
    assert len(calls) == 2, "one verdict per parameter"
    opt.load_state_dict(opt.state_dict())  # new state tensors
    opt.step()
    assert len(calls) == 4
    params[0].grad = torch.randn(96, 64).t()  # a non-contiguous gradient: the kernel reads a contiguous copy of it
    opt.step()
    assert len(calls) == 4 and torch.isfinite(params[0]).all()


@pytest.mark.parametrize("info", [info for info in OPTIMIZERS if lowbit_optim.base._no_kernel_reason(info.cls) is None], ids=str)
def test_strided_parameters_and_gradients_take_the_kernel(info, monkeypatch):
    """As torch.optim's fused=True, the kernel steps a transposed or channels_last parameter and a
    non-contiguous gradient (it steps a contiguous copy, written back): the compiled step's bits,
    and the parameter keeps its strides. A bf16 one keeps its int8-correction. The copies go
    through buffers the optimizer keeps, one per dtype for parameters and one for gradients (not
    fresh ones each step, whose page faults took most of the step), all in one call (a call per
    parameter cost many small ones 60 %)."""

    def strided_run(fused):
        torch.manual_seed(0)
        values = [torch.randn(96, 64).t(), torch.randn(96, 72, dtype=torch.bfloat16).t()]
        if not info.matrices_only:
            values.append(torch.randn(4, 8, 3, 3).to(memory_format=torch.channels_last))
        params = [torch.nn.Parameter(v) for v in values]
        strides = [p.stride() for p in params]
        opt = info.make(params, state_format="8bit", min_quantize_numel=256, param_update="int8-correction", fused=fused)
        for _ in range(STEPS):
            for p in params:
                p.grad = torch.randn(p.shape[::-1], dtype=p.dtype).t() if p.dim() == 2 else torch.randn_like(p)  # as strided as p
            opt.step()
        assert [p.stride() for p in params] == strides
        return params, opt

    calls = []
    monkeypatch.setattr(fused_cpu, "_call", lambda *args, _call=fused_cpu._call: calls.append(len(args[1])) or _call(*args))
    params, opt = strided_run(True)
    assert calls == [len(params)] * STEPS  # one call a step
    assert_identical((params, opt), strided_run(False))
    buffers = {key: (b.numel(), b.data_ptr()) for key, b in opt._scratch_buffers.items()}
    fp32 = sum(p.numel() for p in params if p.dtype == torch.float32)
    assert {key: size for key, (size, _) in buffers.items()} == {(0, torch.float32): fp32, (1, torch.float32): fp32, (0, torch.bfloat16): 96 * 72, (1, torch.bfloat16): 96 * 72}
    opt.step()
    assert {key: (b.numel(), b.data_ptr()) for key, b in opt._scratch_buffers.items()} == buffers  # kept


class _E5M2(OptimStateFp8):  # unregistered (no name): a format whose encoding the kernel lacks
    name = None
    fp8_dtype = torch.float8_e5m2
    scale_max = torch.finfo(torch.float8_e5m2).max


class _HalfScales(lowbit_optim.OptimState8bit):  # unregistered: 8bit's codes under float16 block scales
    name = None
    inner_dtypes = (torch.uint8, torch.float16)

    @classmethod
    def _zero_blocks(cls, numel, signed, block_size, device):
        codes, scale, block_size = super()._zero_blocks(numel, signed, block_size, device)
        return codes, scale.half(), block_size


class TestRefusals(expecttest.TestCase):
    def reason(self, param=None, grad=None, states=None, param_update="nearest") -> str | None:
        param = torch.zeros(8) if param is None else param
        grad = torch.zeros_like(param) if grad is None else grad
        states = {"exp_avg": torch.zeros(8)} if states is None else states
        return fused_cpu.unsupported_reason(param, grad, torch.zeros(()), states, param_update)

    def test_reasons(self):
        self.assertIsNone(self.reason())
        self.assertExpectedInline(self.reason(param=torch.zeros(8, device="meta")), """the parameter is on meta, not the CPU""")
        self.assertExpectedInline(
            self.reason(param=torch.zeros(8, dtype=torch.float16)),
            """gradient dtype torch.float16 (it takes float32 and bfloat16)""",
        )
        self.assertExpectedInline(
            self.reason(param_update="kahan"), """param_update='kahan' (it rounds bf16 parameters to nearest, or keeps an int8-correction)"""
        )
        self.assertExpectedInline(
            self.reason(states={"exp_avg_sq": _E5M2.zeros(256, signed=False)}),
            """the exp_avg_sq state _E5M2 (a format with its own encoding or block scales)""",
        )
        big = lowbit_optim.OptimState8bit.zeros(16384, block_size=16384)
        self.assertExpectedInline(self.reason(states={"exp_avg": big}), """block_size 16384 of the exp_avg state (at most 8192)""")
        wide = {"exp_avg": lowbit_optim.OptimState4bit.zeros((3, 8191)), "exp_avg_sq": FactoredState.zeros((3, 8191))}
        self.assertExpectedInline(self.reason(states=wide), """a factored state's rows of 8191 elements and the other states' blocks meet only every 1048448 elements (the kernel's chunks hold at most 8192)""")
        fp16 = {"exp_avg": torch.zeros(8, dtype=torch.float16)}
        self.assertExpectedInline(self.reason(states=fp16), """the exp_avg state is a torch.float16 tensor of shape (8,) on cpu (the kernel's plain states are contiguous float32 or bfloat16)""")
        part = {"exp_avg_sq": FactoredState.zeros((4, 8))[:2]}
        self.assertExpectedInline(self.reason(states=part), """the exp_avg_sq state is a row slice of a larger factored state (it reads the larger one's columns)""")

    def test_a_subclass_with_its_own_block_scales_is_not_taken(self):
        """A format that scales its blocks otherwise (here 8bit with power-of-two scales) would be
        encoded by the kernel at its own scales (quant.block_scales): it takes the compiled step."""

        class PowerOfTwoScales(lowbit_optim.OptimState8bit):
            name = None

            def _block_scales(self, blocks):
                return quant.power_of_two_at_least(super()._block_scales(blocks))

        self.assertExpectedInline(
            self.reason(states={"exp_avg": PowerOfTwoScales.zeros(256)}), """the exp_avg state PowerOfTwoScales (a format with its own encoding or block scales)"""
        )

    def test_inner_tensors_stored_otherwise_take_the_compiled_step(self):
        """A subclass that keeps its format's codecs but stores an inner tensor in another dtype
        (float16 scales) is not the kernel's: it read and wrote them as float32, past their end (the
        process aborted). The class that declares the kernel layout vouches for its inner tensors."""
        self.assertIsNone(kernel_op.format_kind(_HalfScales, True))
        self.assertEqual(kernel_op.format_kind(lowbit_optim.OptimState8bit, True), "codebook")
        self.assertExpectedInline(
            self.reason(states={"exp_avg": _HalfScales.zeros(256)}), """the exp_avg state _HalfScales (a format with its own encoding or block scales)"""
        )

    def test_fused_true_names_the_parameter_and_the_way_out(self):
        """What the kernel refuses of a parameter itself is refused by the constructor, as torch.optim's
        fused=True refuses a parameter: not in a step (or a backward, step_in_backward=True) that
        would have stepped others first."""
        param = torch.nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
        with self.assertRaises(RuntimeError) as caught:
            lowbit_optim.AdamW([param], state_format="8bit", param_update="stochastic", fused=True)
        self.assertExpectedInline(
            str(caught.exception),
            """fused=True, but the fused CPU kernel cannot step a parameter of shape (64, 96): param_update='stochastic' (it rounds bf16 parameters to nearest, or keeps an int8-correction). Pass fused=None to step such parameters with the compiled step.""",
        )

    def test_fused_true_refuses_before_any_group_steps(self):
        """A refusal in a later group (here its states: factored rows the kernel's chunks cannot
        hold) leaves the groups before it unstepped: their parameters and step counters as they
        were. (Decided with the states, at the first step; a parameter with a verdict is not checked
        again.)"""
        first, later = torch.nn.Parameter(torch.randn(64, 96)), torch.nn.Parameter(torch.randn(16, 1000))
        factored = {"exp_avg": "8bit", "exp_avg_sq": "factored"}
        opt = lowbit_optim.AdamW([{"params": [first]}, {"params": [later], "state_format": factored}], state_format="8bit", fused=True, min_quantize_numel=0)
        before = first.detach().clone()
        for p in (first, later):
            p.grad = torch.randn_like(p)
        with self.assertRaisesRegex(RuntimeError, r"fused=True, but the fused CPU kernel cannot step a parameter of shape \(16, 1000\): a factored state's rows"):
            opt.step()
        self.assertTrue(torch.equal(first, before))
        self.assertEqual(float(opt.state[first].get("step", 0)), 0.0)

    def test_fused_true_refuses_a_dtype_changed_after_a_step_before_any_group_steps(self):
        """A parameter made fp16 through .data after its first step (model.half() on part of a model)
        has its verdict for float32: it is decided anew before the groups before it step (they were
        stepped, then the refusal came)."""
        first, later = (torch.nn.Parameter(torch.randn(64, 96)) for _ in range(2))
        opt = lowbit_optim.AdamW([{"params": [first]}, {"params": [later]}], state_format="8bit", fused=True)
        for p in (first, later):
            p.grad = torch.randn_like(p)
        opt.step()
        later.data, later.grad = later.data.half(), later.grad.half()
        before = first.detach().clone()
        with self.assertRaisesRegex(RuntimeError, r"fused=True, but the fused CPU kernel cannot step a parameter of shape \(64, 96\): parameter dtype torch.float16"):
            opt.step()
        self.assertTrue(torch.equal(first, before))
        self.assertEqual(float(opt.state[first]["step"]), 1.0)

    def test_a_parameter_dropped_from_the_optimizer_is_freed(self):
        """A layer dropped from the model and from the optimizer (its entry in param_groups and its
        states removed) is freed, as under torch.optim: the kernel's verdict for it kept the
        parameter, and the states it had checked, for the optimizer's life."""
        params = [torch.nn.Parameter(torch.randn(64, 96)) for _ in range(2)]
        opt = lowbit_optim.AdamW(params, state_format="8bit", fused=True)
        for param in params:
            param.grad = torch.randn_like(param)
        opt.step()
        del param
        dropped = weakref.ref(params.pop())
        opt.param_groups[0]["params"] = params
        del opt.state[dropped()]
        opt.step()
        gc.collect()
        self.assertIsNone(dropped())

    def test_a_stepped_parameter_can_be_swapped(self):
        """torch.utils.swap_tensors, which FSDP2's model.to() and swap-on-conversion's use, refuses a
        tensor something holds a weak reference to: the optimizer holds none to its parameters."""
        model = torch.nn.Linear(96, 64)
        opt = lowbit_optim.AdamW(model.parameters(), state_format="8bit", fused=True)
        model(torch.randn(4, 96)).sum().backward()
        opt.step()
        torch.utils.swap_tensors(model.weight, torch.nn.Parameter(model.weight.detach().clone()))

    def test_bad_fused_arguments(self):
        with self.assertRaises(ValueError) as caught:
            lowbit_optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused=True, compile=False)
        self.assertExpectedInline(
            str(caught.exception), """fused=True contradicts compile=False (the eager reference step); pass one of them"""
        )
        with self.assertRaises(ValueError) as caught:
            lowbit_optim.AdamW([torch.nn.Parameter(torch.zeros(2))], fused="yes")
        self.assertExpectedInline(str(caught.exception), """fused must be None, True or False, got 'yes'""")


def test_without_a_compiler(monkeypatch):
    """No C compiler: fused=None takes the compiled step; fused=True says what is missing."""
    monkeypatch.setattr(kernel_build, "compiler", lambda: None)
    kernel_abi.load.cache_clear()
    try:
        assert_identical(run(None, state_format="8bit", shapes=[(64, 96)]), run(False, state_format="8bit", shapes=[(64, 96)]))
        with pytest.raises(RuntimeError, match="no C compiler was found to build it"):
            run(True, state_format="8bit", shapes=[(64, 96)])
    finally:
        kernel_abi.load.cache_clear()


NO_CXX = """
import warnings, torch, torch._inductor.config as config
config.cpp.cxx = (None, "/no/such/g++")  # as on a machine without a C++ compiler
import lowbit_optim
results = []
for compile_ in (True, False):
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300))
    opt = lowbit_optim.AdamW([p], fused=False, compile=compile_, state_format="8bit", min_quantize_numel=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            p.grad = torch.linspace(-1, 1, 300)
            opt.step()
    results.append(p.detach().clone())
    print(sum("torch.compile found no C++ compiler" in str(w.message) and w.filename == "<string>" for w in caught))  # at opt.step()
print(torch.equal(*results))
"""


def test_without_a_cxx_compiler_steps_run_eagerly_with_one_warning(tmp_path):
    """Where torch.compile has no C++ compiler (a laptop without one), the first step failed inside
    inductor; now one warning says so, at the user's opt.step(), and steps run eagerly: compile=False's bits. (A child process
    with an empty compile cache, so that inductor must compile.)"""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", NO_CXX], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "0", "True"]


def test_threads_that_first_need_the_kernel_at_once_build_it_once(monkeypatch, tmp_path):
    """Threads whose first steps come at once: every one gets the kernel, built once (each had
    compiled into the same partial file and some loaded it half-written, or failed renaming it, and
    the failure stayed for the whole process)."""
    import threading

    monkeypatch.setattr(kernel_build, "cache_dir", lambda: tmp_path)
    builds, run = [], kernel_build._run
    monkeypatch.setattr(kernel_build, "_run", lambda argv: (builds.append(argv) if str(kernel_build.MAIN_SOURCE) in argv else None) or run(argv))
    kernel_abi.load.cache_clear()
    barrier, loaded = threading.Barrier(4), []

    def first_use():
        barrier.wait()
        loaded.append(kernel_abi.load())

    try:
        threads = [threading.Thread(target=first_use) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert [why for _, why in loaded] == [None] * 4 and len(builds) == 1
    finally:
        kernel_abi.load.cache_clear()


def test_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    """A compiler that cannot build the kernel: a warning with the compiler's message, at the user's
    opt.step(), then the compiled step (fused=None), or an error naming the failure (fused=True)."""
    monkeypatch.setattr(kernel_build, "FLAGS", [*kernel_build.FLAGS, "-fno-such-flag"])
    monkeypatch.setattr(kernel_build, "cache_dir", lambda: tmp_path)
    kernel_abi.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="fused CPU kernel is unavailable.*no-such-flag") as caught:
            assert_identical(run(None, state_format="8bit", shapes=[(64, 96)]), run(False, state_format="8bit", shapes=[(64, 96)]))
        assert {w.filename for w in caught if "kernel is unavailable" in str(w.message)} == {__file__}  # run()'s opt.step()
        with pytest.raises(RuntimeError, match="building it failed"):
            run(True, state_format="8bit", shapes=[(64, 96)])
    finally:
        kernel_abi.load.cache_clear()


def test_a_cache_that_cannot_be_written_is_named_with_the_fix(monkeypatch):
    """A read-only inductor cache failed the kernel's build and then torch.compile: the warning and
    the error's note name the cache and TORCHINDUCTOR_CACHE_DIR (the note had blamed a format of
    the user's own, for a built-in one)."""
    import errno

    def read_only(*args, **kwargs):
        raise OSError(errno.EROFS, "Read-only file system", "/cache/lowbit_optim")

    monkeypatch.setattr(kernel_build, "build", read_only)
    kernel_abi.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match="kernel is unavailable.*Read-only file system.*set TORCHINDUCTOR_CACHE_DIR to a writable"):
            assert kernel_abi.load()[0] is None
    finally:
        kernel_abi.load.cache_clear()
    param = torch.nn.Parameter(torch.ones(300))
    opt = lowbit_optim.AdamW([param], state_format="8bit", min_quantize_numel=0, fused=False)
    param.grad = torch.ones(300)

    def compile_fails(*args, **kwargs):  # inductor's error, caused by the cache's
        raise RuntimeError("InductorError") from OSError(errno.EROFS, "Read-only file system", "/cache/73")

    monkeypatch.setattr(opt, "_step_compiled", compile_fails)
    with pytest.raises(RuntimeError) as failed:
        opt.step()
    notes = "\n".join(failed.value.__notes__)
    assert "could not write its cache" in notes and "TORCHINDUCTOR_CACHE_DIR" in notes and "format of your own" not in notes


def test_a_cached_library_cut_short_is_built_again(tmp_path):
    """A cached library that is not the bytes its build wrote (cut short by a crash or a copy) is
    built again, in a process of its own: mapping it killed every later process with SIGBUS."""
    script = "from lowbit_optim import kernel_abi, kernel_build; kernel, why = kernel_abi.load(); print(kernel_build.build(), why)"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}

    def load() -> tuple[str, str]:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout.split()

    library, why = load()
    assert why == "None"
    data = pathlib.Path(library).read_bytes()
    pathlib.Path(library).write_bytes(data[:1000])
    assert load() == [library, "None"] and pathlib.Path(library).read_bytes() == data


def running_sleep(pid: str) -> bool:
    """Whether process ``pid`` is a live (not zombie) ``sleep``."""
    try:
        comm, stat = (pathlib.Path(f"/proc/{pid}") / name for name in ("comm", "stat"))
        return comm.read_text().strip() == "sleep" and stat.read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # gone
        return False


def test_a_compiler_that_hangs_or_a_cc_that_names_none_fails_the_build(monkeypatch, tmp_path):
    """A compiler that never finishes is stopped once, with what it started (the first step hung
    for ever); a CC naming no executable is refused by name (another compiler was used in silence),
    one with an unclosed quote as such; one that exits 0 writing nothing is named (the error named a
    missing temporary file). Each warns and falls back."""
    hanging, started = tmp_path / "hanging-cc", tmp_path / "started"
    hanging.write_text(f"#!/bin/sh\nsleep 60 &\necho $! >> {started}\nwait\n")
    hanging.chmod(0o755)
    monkeypatch.setattr(kernel_build, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(kernel_build, "BUILD_TIMEOUT_S", 1)
    cases = [(str(hanging), f"{hanging} did not finish in 1 s"), ("/no/such/gcc", "CC='/no/such/gcc' names no executable compiler")]
    cases.append(("gcc -DNAME='x", "cannot be split as a shell splits it (No closing quotation)"))  # (not: names no compiler)
    cases.append((shutil.which("true"), "exited 0 but wrote no library"))
    for cc, message in cases:
        monkeypatch.setenv("CC", cc)
        kernel_abi.load.cache_clear()
        kernel_build.native_macros.cache_clear()
        try:
            with pytest.warns(UserWarning, match=re.escape(message)):
                assert kernel_abi.load()[0] is None
        finally:
            kernel_abi.load.cache_clear()
    children = started.read_text().split()
    assert len(children) == 1  # stopped once: the build did not wait for it again
    for _ in range(100):  # what it started was killed with it (a SIGKILL lands in a moment)
        if not running_sleep(children[0]):
            break
        time.sleep(0.05)
    assert not running_sleep(children[0])
    assert not list((tmp_path / "cache").glob("*.tmp"))


def test_cc_may_name_a_launcher_and_arguments(monkeypatch, tmp_path):
    """$CC as make reads it, "ccache gcc -m64": the build runs that command (it was refused as naming
    no executable), a path with a space in it still names one program, and each command has a
    build key of its own."""
    monkeypatch.delenv("CC", raising=False)
    plain = kernel_build.compiler()
    if plain is None:
        pytest.skip("no C compiler")
    calls = tmp_path / "calls"
    launcher = tmp_path / "a launcher"
    launcher.write_text(f'#!/bin/sh\necho "$@" >> "{calls}"\nexec "$@"\n')
    launcher.chmod(0o755)
    monkeypatch.setenv("CC", f"{shlex.quote(str(launcher))} {shlex.join(plain)} -DCC_ARGUMENT=7")
    cc = kernel_build.compiler()
    assert cc == (str(launcher), *plain, "-DCC_ARGUMENT=7")
    source, library = tmp_path / "answer.c", tmp_path / "answer.so"
    source.write_text("int answer(void) { return CC_ARGUMENT; }\n")
    subprocess.run(kernel_build.command(cc, source, library), check=True)
    assert ctypes.CDLL(str(library)).answer() == 7
    kernel_build.native_macros(cc)
    assert [line.split()[0] for line in calls.read_text().splitlines()] == [plain[0]] * 2
    assert kernel_build.library_path(cc) != kernel_build.library_path(plain)
    monkeypatch.setenv("CC", str(launcher))  # unquoted, the whole of it a program
    assert kernel_build.compiler() == (str(launcher),)


def test_the_build_key_covers_what_march_native_turns_on(monkeypatch):
    """Where /proc/cpuinfo lists no flags (aarch64's say Features; none readable), the macros the
    compiler predefines for this CPU still tell two CPUs sharing a cache apart."""
    monkeypatch.setattr(kernel_build, "cpuinfo_field", {}.get)
    monkeypatch.setattr(kernel_build, "native_macros", lambda cc: "neoverse-n1")
    key = kernel_build.library_path(("cc",))
    monkeypatch.setattr(kernel_build, "native_macros", lambda cc: "neoverse-v1")
    assert kernel_build.library_path(("cc",)) != key


def test_fused_step_bumps_version_counters():
    """Like an in-place aten op, the kernel's write makes autograd refuse a backward through a graph
    that saved the parameter before the step."""
    param = torch.nn.Parameter(torch.randn(64, 96))
    loss = (param * param).sum()  # saves param for backward
    loss.backward(retain_graph=True)
    lowbit_optim.AdamW([param], state_format="8bit", fused=True).step()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


NON_FINITE_CASES = {name: dict(state_format=name) for name in ["8bit", "4bit", "4bit-calibrated", "fp8", "bf16"]} | {
    "factored": dict(state_format=FACTORED),
    "fp8 amsgrad": dict(state_format="fp8", amsgrad=True),  # torch.maximum propagates NaN
}


@pytest.mark.parametrize("march", ["native", "x86-64"], ids=["native", "portable"])
def test_gcc_vectorizes_every_update_loop(march, tmp_path):
    """Each update's portable loop (update_*.h, under #pragma omp simd) is written for compilers to
    vectorize: a branch around arithmetic (GCC will not speculate a division that may trap) kept
    Lion's scalar in every build, 3.5-6x slower. GCC's report names a vectorized loop in each."""
    cc = kernel_build.compiler()
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True).stdout if cc else ""
    if "gcc" not in version.lower() and "free software foundation" not in version.lower():
        pytest.skip(f"the check reads GCC's vectorization report; the compiler here is {' '.join(cc or ['none'])}")
    if march == "x86-64" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 build")
    argv = kernel_build.command(cc, kernel_build.MAIN_SOURCE, tmp_path / "kernel.so")
    report = subprocess.run([*argv, f"-march={march}", "-fopt-info-vec-optimized"], capture_output=True, text=True, check=True).stderr
    loops = [h.name for h in kernel_build.sources() if h.name.startswith("update_") and "#pragma omp simd" in h.read_text()]
    assert loops, "no update loops found"
    scalar = [name for name in loops if not re.search(rf"{re.escape(name)}:\d+:\d+: optimized: loop vectorized", report)]
    assert not scalar, f"GCC left these update loops scalar ({march}): {scalar}"


def gradient(values: dict | None = None) -> torch.Tensor:
    """linspace(1, 2, 300) but ``values`` ({indices: value}); element 298 lies in the scalar tail of
    16- and 8-lane loops."""
    grad = torch.linspace(1, 2, 300)
    for indices, value in (values or {}).items():
        grad[list(indices)] = value
    return grad


def params_after(opt_cls, grads: list[torch.Tensor], **kwargs) -> list[torch.Tensor]:
    """A 300-element parameter after each step of ``opt_cls`` (lr 1e-2) with each of ``grads``."""
    param = torch.nn.Parameter(torch.linspace(-1, 1, 300))
    opt = opt_cls([param], lr=1e-2, **kwargs)
    steps = []
    for grad in grads:
        param.grad = grad.clone()
        opt.step()
        steps.append(param.detach().clone())
    return steps


@build_flags
@pytest.mark.parametrize("cls", [lowbit_optim.AdamW, lowbit_optim.AdEMAMix], ids=["AdamW", "AdEMAMix"])
def test_no_update_where_the_second_moment_is_zero(cls, flag):
    """Where v is exactly 0 (rounded to 0 by torchao's rounding, 8bit-torchao's; then a zero gradient)
    the update is 0, in the vector loop and its scalar tail of every build, as in the compiled step:
    the same bits."""
    grads = [gradient({(7, 298): 1e-5}), gradient({(7, 298): 0.0})]
    options = dict(weight_decay=0.0, state_format="8bit-torchao", min_quantize_numel=0)
    with kernel_built_with(flag):
        kernel = params_after(cls, grads, fused=True, **options)
    compiled = params_after(cls, grads, fused=False, **options)
    assert all(torch.equal(a, b) for a, b in zip(kernel, compiled))
    first, second = kernel
    assert torch.equal(second[[7, 298]], first[[7, 298]]) and not torch.equal(second, first)


@build_flags
@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
@pytest.mark.parametrize("cls", [lowbit_optim.AdamW, lowbit_optim.AdEMAMix], ids=["AdamW", "AdEMAMix"])
def test_a_gradient_whose_square_overflows_steps_as_torch_optim_does(cls, state_format, flag):
    """A finite gradient element whose square overflows fp32 (here 1e20 and -5e20) leaves a finite
    second moment, as torch.optim's, which multiplies by 1 - beta2 before it squares: an inf one had
    NaN'd the next step. The same bits in the vector loop and its scalar tail (298) of every build as
    in the compiled step; AdamW's fp32 state as torch.optim.AdamW's."""
    grads = [gradient({(7, 298): 1e20, (40,): -5e20}), gradient()]
    options = dict(state_format=state_format, min_quantize_numel=0)
    with kernel_built_with(flag):
        kernel = params_after(cls, grads, fused=True, **options)[-1]
    compiled = params_after(cls, grads, fused=False, **options)[-1]
    assert torch.equal(kernel, compiled) and bool(kernel.isfinite().all())
    if cls is lowbit_optim.AdamW and state_format == "fp32":
        torch.testing.assert_close(compiled, params_after(torch.optim.AdamW, grads)[-1], rtol=1e-5, atol=1e-6)


@build_flags
@pytest.mark.parametrize("case", NON_FINITE_CASES, ids=list(NON_FINITE_CASES))
def test_non_finite_gradients_match_the_compiled_step(case, flag):
    """A NaN and an inf in the gradient poison the same blocks as in the compiled step: same
    scales, same values, same codes outside NaN-scaled blocks (inside them any code decodes to NaN,
    and the sign of a NaN, which fp8 codes keep, depends on how each compiler and machine makes
    it); in every build of the kernel."""

    def poisoned(fused):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(71, 64))
        opt = lowbit_optim.AdamW([param], lr=1e-2, fused=fused, **NON_FINITE_CASES[case])
        param.grad = torch.randn_like(param)
        param.grad[3, 5], param.grad[40, 1] = float("nan"), float("inf")
        opt.step()
        return param, opt.state[param]

    with kernel_built_with(flag):
        a, state_a = poisoned(True)
    b, state_b = poisoned(False)
    exact = dict(rtol=0, atol=0, equal_nan=True)
    factored = isinstance(state_b["exp_avg_sq"], FactoredState)
    torch.testing.assert_close(a, b, **(FACTORED_PARAMS if factored else exact) | dict(equal_nan=True))
    for key in [k for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if k in state_b]:
        s, t = state_a[key], state_b[key]
        if isinstance(s, OptimState):
            torch.testing.assert_close(s.scale, t.scale, **exact)
            torch.testing.assert_close(s.dequantize(), t.dequantize(), **exact)
            finite_blocks = ~s.scale.isnan()
            ours, theirs = (x.codes.view(x.scale.numel(), -1)[finite_blocks] for x in (s, t))
            if isinstance(s, OptimStateFp8) and isinstance(flag, emulated_aarch64.CPU):  # a NaN's sign: inf / inf is -NaN on x86, +NaN on ARM
                ours, theirs = (torch.where(c & 0x7F == 0x7F, 0x7F, c) for c in (ours, theirs))
            assert torch.equal(ours, theirs), key
            assert bool(s.scale.isnan().any()), "test setup: the NaN should poison a block"
        elif isinstance(s, FactoredState):  # the poisoned row and column sums, the others a few ulp apart
            for name in s.inner_names:
                torch.testing.assert_close(getattr(s, name), getattr(t, name), **FACTORED_SUMS, equal_nan=True)
            assert bool(s.row.isnan().any() and s.col.isnan().any()), "test setup: the NaN should poison a row and a column"
        else:
            torch.testing.assert_close(s, t, **exact)


@build_flags
def test_int8_correction_of_every_magnitude_and_non_finite_weights(flag):
    """24-bit weights (bf16 + int8-correction) in the kernel: the compiled step's bits for weights of
    every bf16 exponent, zeros and subnormals (which keep no correction); a NaN and an inf in the
    gradient make the same weights NaN, with no correction beside them (the compiled step's int8 of
    a NaN was -128), and every finite weight keeps the same bits and correction. Row 9's
    gradient is zero, so its tiny weights stay tiny: their chunk (rows 8-15) takes the store's
    division; the others, whose weights the step moves by about lr, its multiplication (row 0's
    special values and a NaN among them). Two more parameters, their
    gradients zero too, have their weights just below the multiplication's bound (2**-114 to
    2**-113: a chunk that divides) and just above it (2**-113 to 2**-112, the largest rounding up
    into the next binade: a chunk that multiplies at its edge)."""

    def stepped(fused):
        g = torch.Generator().manual_seed(0)
        exponents = torch.randint(-133, 127, (71, 64), generator=g).float()
        values = torch.randn(71, 64, generator=g) * torch.exp2(exponents)
        values[0, :8] = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 2.0**-126, 3e38, -3e38, 1.0])
        edge = (1 + torch.arange(8, 520) / 520) * (1 - 2 * (torch.arange(512) % 2))  # 1.015 .. 1.998 (which rounds to 2)
        params = [torch.nn.Parameter(values.bfloat16())] + [torch.nn.Parameter((edge * 2.0**e).bfloat16().view(8, 64)) for e in (-114, -113)]
        opt = lowbit_optim.AdamW(params, lr=1e-2, fused=fused, state_format="8bit", param_update="int8-correction")
        for step in range(2):
            params[0].grad = torch.randn(params[0].shape, generator=g).bfloat16()
            params[0].grad[9] = 0.0
            params[1].grad, params[2].grad = torch.zeros_like(params[1]), torch.zeros_like(params[2])
            if step == 1:
                params[0].grad[3, 5], params[0].grad[40, 1] = float("nan"), float("inf")
            opt.step()
        return [p.detach() for p in params], [opt.state[p]["param_correction"] for p in params]

    with kernel_built_with(flag):
        a, correction_a = stepped(True)
    b, correction_b = stepped(False)
    for got, expected, got_correction, expected_correction in zip(a, b, correction_a, correction_b):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got_correction, expected_correction)
    assert bool((correction_b[0] != 0).any()) and not bool(b[0].isfinite().all()), "test setup: corrections and NaN weights expected"
    tiny = (b[0][9].abs() < 2.0**-113) & (b[0][9] != 0) & (correction_b[0][9] != 0)
    assert bool(tiny.any()), "test setup: a tiny weight with a correction expected"
    assert bool(b[1].abs().min() >= 2.0**-114) and bool(b[2].abs().min() >= 2.0**-113), "test setup: the edges"
    assert bool((b[2].abs() == 2.0**-112).any() & (correction_b[2] != 0).all()), "test setup: the edges"


def dividends() -> torch.Tensor:
    """Every exponent, both signs, random mantissas; zeros, infinities, NaN, denormals, and the
    edges of the range where the kernel's FMA division must hand over to a real one."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.arange(256, dtype=torch.int32).repeat_interleave(64)
    mantissas = torch.randint(0, 2**23, exponents.shape, generator=g, dtype=torch.int32)
    signs = torch.randint(0, 2, exponents.shape, generator=g, dtype=torch.int32) << 31
    every_exponent = ((exponents << 23) | mantissas | signs).view(torch.float32)
    edges = torch.tensor([2.0**-96, 2.0**-99, 2.0**99, 2.0**-126, 2.0**-149, 1.0, 0.0, -0.0, 3.4e38])
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor(0.0)), torch.nextafter(edges, torch.tensor(math.inf))])
    normal = torch.randn(4096, generator=g) * 10 ** torch.randint(-30, 30, (4096,), generator=g)
    return torch.cat([every_exponent, edges, -edges, normal])


def assert_same_floats(out: torch.Tensor, expected: torch.Tensor, inputs: torch.Tensor, what: str) -> None:
    """fp32 values equal bit for bit (-0.0 is not 0.0), any NaN matching any NaN; the message shows
    the first differing ``inputs``."""
    same = (out.view(torch.int32) == expected.view(torch.int32)) | (out.isnan() & expected.isnan())
    assert bool(same.all()), f"{int((~same).sum())} {what} differ, e.g. at {inputs[~same][:4].tolist()}: {out[~same][:4].tolist()} != {expected[~same][:4].tolist()}"


def assert_divides_exactly(a: torch.Tensor, divisor: float, *, root: bool = False) -> None:
    out = torch.empty_like(a)
    fused_cpu.library().lowbit_divide(a.data_ptr(), a.numel(), divisor, root, out.data_ptr())
    assert_same_floats(out, a / divisor, a, f"quotients by {divisor}")


@build_flags
@pytest.mark.parametrize("divisor", [1.0, 3.0, 0.1, 7e-13, 2.0**-126, 2.0**-130, 1.7e38, 2.0**126, 0.0, math.inf, math.nan])
def test_division_by_a_shared_divisor_is_exact(divisor, flag):
    """The kernel divides a block by its scale (and moments by bias corrections) as a
    multiplication plus an FMA correction, handing the lanes it cannot serve to a real division:
    the result must be the correctly rounded quotient, torch's a / b, bit for bit, in each build
    (16 lanes with AVX-512, 8 with AVX2)."""
    with kernel_built_with(flag):
        assert_divides_exactly(dividends(), divisor)


@pytest.mark.parametrize("flag", [*BUILDS.values(), *DIVIDER_BUILDS.values()], ids=[*BUILDS, *DIVIDER_BUILDS])
@pytest.mark.parametrize("divisor", [1.0, 0.0316, 0.5, 2.0**-34, 2.0**-40, 2.0**30, math.nan])
def test_division_of_square_roots_is_exact(divisor, flag):
    """sqrt(v) / sqrt(1 - beta2**t) checks its lanes for special values only (a square root of a
    float cannot be tiny or huge): every square root, zeros of both signs, infinities and NaN must
    still give torch's quotient, also for divisors where the kernel must check every lane."""
    special = torch.tensor([0.0, -0.0, math.inf, math.nan, 2.0**-74.5, 2.0**63.9]).repeat(3)  # vector lanes, not the tail
    roots = torch.cat([special, dividends().abs().sqrt()])
    with kernel_built_with(flag):
        assert_divides_exactly(roots, divisor, root=True)


@codec_build_flags
@blockwise_formats_by_signedness
def test_kernel_encodes_like_the_format(info, signed, flag):
    """The kernel's encoding (its packed tables, binary searches, buckets and fp8 rounding) gives the
    format's own codes on the format suite's adversarial inputs: every code, midpoints and their
    neighbours, zeros, denormals, range ends, the 4-bit buckets' edges; for a codebook also values beyond its range (no step gives them, a
    block's scale being its absmax, but its tables give every fp32 value a code); NaN and infinities
    as the format's tables give them. In every build, in its vector loops
    (a multiple of 16 values) and in its tails (7 values at a time; 23 in the emulated aarch64
    build, whose calls cost ~1 ms each: still a tail, 3 values past NEON's 4-wide vectors, 7 past 8 or 16)."""
    state = info.fmt.zeros(256, signed=signed)
    if kernel_op.kernel_kind(state) not in ("codebook", "e4m3"):
        pytest.skip(f"the kernel's block encoder does not take {info.name} (block floats: test_kernel_stores_block_floats_like_the_format)")
    top = float(info.fmt.scale_max)
    beyond = torch.tensor([1.0000001, 1.5, 1.9999999, 2.0, 3.0, 1e6, 3e38]) * top
    beyond = (torch.cat([beyond, -beyond]) if signed else beyond)[: None if kernel_op.kernel_kind(state) == "codebook" else 0]
    edges = torch.arange(-16 if signed else 0, 17) / 16  # where a 4-bit codebook's buckets meet (bucket_count16), and next to them
    edges = torch.cat([edges, torch.nextafter(edges, torch.tensor(math.inf)), torch.nextafter(edges, torch.tensor(-math.inf))])
    edges = edges[(edges >= 0) | signed]
    v = torch.cat([encode_inputs(info, signed), beyond, edges, torch.tensor([math.nan, math.inf, -math.inf])])
    v = torch.cat([v, v.new_zeros(-v.numel() % 16)])
    codes, tail_codes = torch.empty(v.numel(), dtype=torch.uint8), torch.empty(v.numel(), dtype=torch.uint8)
    tail = 23 if isinstance(flag, emulated_aarch64.CPU) else 7
    with kernel_built_with(flag):
        encode = fused_cpu.library().lowbit_encode
        described = state_t(state)
        encode(described, v.data_ptr(), v.numel(), codes.data_ptr())
        for start in range(0, v.numel(), tail):
            encode(described, v[start:].data_ptr(), min(tail, v.numel() - start), tail_codes[start:].data_ptr())
    # each call encodes one block: a stochastic format's dither counts positions from its start
    expected = {"vector loops": info.fmt.encode(v, signed), "tails": torch.cat([info.fmt.encode(piece, signed) for piece in v.split(tail)])}
    for where, got in [("vector loops", codes), ("tails", tail_codes)]:
        wrong = got != expected[where]
        if kernel_op.kernel_kind(state) == "e4m3":
            # the sign of a NaN code is the compiler's (any NaN code decodes to NaN); an infinity never
            # reaches the encoder in a step (an infinite absmax makes the block's values NaN)
            wrong &= v.isfinite()
            assert bool((got[~v.isfinite()] & 0x7F == 0x7F).all()), f"{where}: NaN and infinities must give a NaN code"
        assert not wrong.any(), f"{where}: {int(wrong.sum())} codes differ, e.g. at {v[wrong][:4].tolist()}: {got[wrong][:4].tolist()} vs {expected[where][wrong][:4].tolist()}"


def test_4bit_numbers_are_counted_by_bucket():
    """The AVX-512 encoders count a 4-bit codebook's values (stochastic rounding) and thresholds
    (nearest) by bucket where each bucket holds at most one of them (bucket_count16): 4bit's do, and
    each bucket's count (below, plus one from its inside) is the brute-force count for every v in
    [-1, 1]. Where a bucket holds two, as in 4bit-calibrated's second moment (dense near zero), there
    are no buckets, and the kernel searches."""
    k = kernel_op.kernel()
    n = len(kernel_op._buckets(k, OptimState4bit, True, "codebook").below)
    v = torch.cat([torch.linspace(-1, 1, 20001), torch.arange(-n // 2, n // 2 + 1) / (n // 2)])
    v = torch.cat([v, torch.nextafter(v, torch.tensor(-2.0))]).clamp(-1, 1)
    bucket = (torch.floor(v * (n // 2)) + n // 2).clamp(max=n - 1).long()  # as bucket_count16
    for signed in (True, False):
        for table in ("codebook", "decision_thresholds"):
            buckets = kernel_op._buckets(k, OptimState4bit, signed, table)
            assert buckets is not None, (signed, table)
            numbers = OptimState4bit.kernel_layout(signed).tables[table]
            counted = torch.tensor(list(buckets.below))[bucket] + (v >= torch.tensor(list(buckets.inside))[bucket]).long()
            assert torch.equal(counted, (numbers[None, :] <= v[:, None]).sum(1)), (signed, table)
    assert kernel_op._buckets(k, lowbit_optim.get_format("4bit-calibrated"), False, "codebook") is None


def floor_edges(fmt) -> torch.Tensor:
    """Blocks of 256 whose small positive values a nonnegative state's floor (positive_floor) raises
    where their quotient by the block's scale is above 0, as quantize_ divides: the kernel compares
    them with scale * 2**-150 instead, so at that edge (a quotient of exactly 2**-150 rounds to 0)
    and away from it; 3.75 * 2**-150 is no float (it rounds up to 2**-148, which must be floored)."""
    rows = []
    for scale in (2.0**100, 3 * 2.0**100, 1.0, 3.75, 5e-20):
        edge = torch.tensor(scale * 2.0**-150, dtype=torch.float64).float()  # exact where representable
        near = torch.stack([edge, torch.nextafter(edge, torch.tensor(math.inf)), torch.nextafter(edge, torch.tensor(0.0))])
        small = torch.tensor([1e-45, 1e-30, 1e-12, 1e-8, 1e-6, 0.0]) * scale
        row = torch.cat([torch.tensor([scale * fmt.scale_max]), near, small])
        rows.append(torch.cat([row, row.new_zeros(256 - row.numel())]))
    return torch.cat(rows)


@codec_build_flags
@blockwise_formats_by_signedness
def test_kernel_quantizes_like_the_format_at_any_scale(info, signed, flag):
    """What a step stores (lowbit_quantize: block scales, then codes) is what quantize_ stores, for
    the encode test's adversarial values (every code, midpoints and their neighbours) times block
    scales that are no powers of two: the kernel may map x times the scale's reciprocal (the 8-bit
    affine map) where a division would be exact, and must still give the exact quotient's codes.
    Unsigned, also floor_edges' values (a positive value whose code is 0 takes the smallest)."""
    v = encode_inputs(info, signed)
    v = v[v.abs() < info.fmt.scale_max]  # each block's absmax comes from its first element
    block = 255
    v = torch.cat([v, v.new_zeros(-v.numel() % block)]).view(-1, block)
    scales = torch.tensor([0.37, 3.3e-5, 1234.5, 7.1e-21, 2.9e30, 1.0])[torch.arange(v.shape[0]) % 6, None]
    x = torch.cat([scales * float(info.fmt.scale_max), v * scales], dim=1).flatten()  # blocks of 256
    edges = floor_edges(info.fmt) if not signed else x[:0]
    x = torch.cat([x, edges])
    reference = info.fmt.zeros(x.numel(), signed=signed, block_size=256)
    reference.quantize_(x)
    state = info.fmt.zeros(x.numel(), signed=signed, block_size=256)
    if kernel_op.kernel_kind(state) is None:
        pytest.skip(f"the kernel does not take {info.name}")
    with kernel_built_with(flag):
        quantize_with_kernel(state, x)
    wrong = state.codes != reference.codes
    assert not wrong.any(), f"{int(wrong.sum())} code bytes differ"
    torch.testing.assert_close(state.scale, reference.scale, rtol=0, atol=0)
    if edges.numel() and info.fmt.positive_floor(False) is not None:
        floored = ((reference.dequantize() > 0) & (x > 0))[-edges.numel():]
        assert 0 < int(floored.sum()) < int((edges > 0).sum()), "test setup: some values floored, the edge's not"


@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_8bit_codes_are_an_affine_map(signed):
    """The dynamic-tree codebook's thresholds fit affine_codes' map, so that the AVX-512 kernel
    counts them without a gather (test_kernel_encodes_like_the_format checks its codes): a few
    levels, one per decade, each split alone in its octave. A codebook whose thresholds lie on no
    few grids, one reaching above 1, or a signed one that is not mirrored gets no map (the kernel
    gathers from the table)."""
    found = affine_codes.affine_codes(kernel_op.layout(lowbit_optim.get_format("8bit"), signed).tables["decision_thresholds"])
    assert found is not None and len(found.slope) == 8, "one level per decade (7), and the zero level or 1.0's"
    splits = [s for s in found.split if s != math.inf]
    assert len(splits) == 7 and found.zero_code == (127 if signed else 0)
    uneven = torch.linspace(-1, 1, 256, dtype=torch.float64) ** 3 if signed else torch.linspace(0, 1, 256, dtype=torch.float64) ** 3
    assert affine_codes.affine_codes(quant.decision_thresholds(uneven.tolist())) is None, "cubic spacing: a level every two thresholds"
    linear = quant.linear_codebook(8)
    assert affine_codes.affine_codes(quant.decision_thresholds(linear)) is not None, "an even grid is one level"
    assert affine_codes.affine_codes(quant.decision_thresholds([x * 1.5 for x in linear])) is None, "thresholds above 1"
    assert affine_codes.affine_codes(quant.decision_thresholds([x + 0.5 / 254 for x in linear[:-1]])) is None, "not mirrored"


@build_flags
@blockwise_formats_by_signedness
def test_kernel_decodes_like_the_format(info, signed, flag):
    """Every code, in every position of a block (the kernel decodes 64, 16, 8 or 1 at a time), reads
    back as the state's own dequantize gives it, in every build."""
    g = torch.Generator().manual_seed(1)
    n = 4 * info.block_size + 17  # whole blocks and a partial one
    state = info.fmt.from_float(sample((n,), signed, seed=1), signed)
    if kernel_op.kernel_kind(state) is None:
        pytest.skip(f"the kernel does not take {info.name}")
    every = torch.arange(2**info.fmt.bits, dtype=quant.code_dtype(info.fmt.bits)).repeat(n // 2**info.fmt.bits + 1)[:n]
    codes = every[torch.randperm(n, generator=g)]
    padded = torch.cat([codes, codes.new_zeros(state.padded_numel - n)])
    state.codes.copy_(quant.pack_codes(padded, info.fmt.bits, state.block_size))
    out = torch.empty(n)
    with kernel_built_with(flag):
        fused_cpu.library().lowbit_decode(state_t(state), n, out.data_ptr())
    assert_same_floats(out, state.dequantize(), codes, "decoded values (codes)")


@build_flags
@pytest.mark.parametrize("block_size", [2, 4, 16, 32, 64])
@pytest.mark.parametrize("fmt", [lowbit_optim.OptimState8bit, OptimStateFp8], ids=["8bit", "fp8"])
def test_kernel_decodes_short_blocks(fmt, block_size, flag):
    """8-bit codes in blocks shorter than the 64 codes the VBMI decoder reads at once (it then decodes
    64 at a time across blocks) read back as dequantize gives them, each block with its own scale."""
    g = torch.Generator().manual_seed(2)
    n = 6 * 64 + 3 * block_size + 1  # whole groups of 64, whole blocks after them, a partial block
    state = fmt.zeros(n, signed=True, block_size=block_size)
    state.codes.copy_(torch.randint(0, 256, state.codes.shape, dtype=torch.uint8, generator=g))
    state.scale.copy_(torch.rand(state.scale.shape, generator=g) + 0.5)
    out = torch.empty(n)
    with kernel_built_with(flag):
        fused_cpu.library().lowbit_decode(state_t(state), n, out.data_ptr())
    assert_same_floats(out, state.dequantize(), torch.arange(n), "decoded values (elements)")


# ---- stochastic rounding (4bit, 8bit-sr) --------------------------------------------------------


class _CalibratedSR(OptimState4bit):  # unregistered: stochastic codes under a calibrated scale (no built-in format has both)
    name = None

    @classmethod
    def calibrated(cls, signed: bool) -> bool:
        return True


class _ShortSR(OptimState4bit):  # unregistered: 9 of the 16 codes used, the rest NaN (stochastic pairs end early)
    name = None

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        return [k / 4 - 1 for k in range(9)] if signed else [(k + 1) / 9 for k in range(9)]


def used_codebook(fmt, signed: bool) -> torch.Tensor:
    """``fmt``'s code values without its unused codes (NaN, at the end)."""
    codebook = fmt.decode(torch.arange(2**fmt.bits, dtype=torch.uint8), signed)
    return codebook[~codebook.isnan()]


def stochastic_inputs(signed: bool, fmt=OptimState4bit) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized values for the encoding of ``fmt``, shuffled so that each sits at many places of a
    block, and for each the lower code of the pair it lies strictly between (-1 for the others): 31
    points inside every pair of neighbouring codes, 4 times over; every code and its fp32
    neighbours; values beyond the codebook (above 1, below -1 or 4bit's smallest unsigned code,
    negative unsigned ones), signed zeros, denormals, NaN and infinities."""
    codebook = used_codebook(fmt, signed)
    fractions = torch.linspace(0, 1, 33)[1:-1]
    between = codebook[:-1, None] + fractions * (codebook[1:] - codebook[:-1])[:, None]
    on = torch.cat([codebook, torch.nextafter(codebook, torch.tensor(math.inf)), torch.nextafter(codebook, torch.tensor(-math.inf))])
    outside = torch.tensor([1.5, -1.5, 1e30, -1e30, 0.03, -0.03, -0.5, 0.0, -0.0, 1e-40, -1e-40, math.nan, math.inf, -math.inf])
    v = torch.cat([between.flatten().repeat(4), on, outside.repeat(3)])
    pair = torch.cat([torch.arange(codebook.numel() - 1).repeat_interleave(fractions.numel()).repeat(4), torch.full((on.numel() + 3 * outside.numel(),), -1)])
    order = torch.randperm(v.numel(), generator=torch.Generator().manual_seed(0))
    return v[order], pair[order]


@codec_build_flags
@pytest.mark.parametrize("fmt", [OptimState4bit, _ShortSR, OptimState8bitSR], ids=["4bit", "4bit-9-codes", "8bit-sr"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_kernel_rounds_stochastically_like_the_format(fmt, signed, flag):
    """The kernel's stochastic rounding (lowbit_encode of the format's layout: 4bit's one pass,
    8bit-sr's second pass over the nearest codes) gives the format's own codes block by block (the
    dither hashes a value's place in its block): between every pair of codes, on codes, beyond the
    codebook (also where it ends before the last code), for NaN and infinities; in blocks of 128 and
    64 (vector loops) and of 1, 7, 9, 23 (tails); in every build."""
    state = fmt.zeros(256, signed=signed)
    assert kernel_op.kernel_kind(state) == "codebook", f"the kernel should take {fmt.name}"
    v, pair = stochastic_inputs(signed, fmt)
    lengths = [128, 7, 23, 64, 1, 9]
    sizes = [lengths[i % len(lengths)] for i in range(v.numel())]
    while sum(sizes) > v.numel():
        sizes.pop()
    pieces = v.split([*sizes, v.numel() - sum(sizes)])
    with kernel_built_with(flag):
        encode = fused_cpu.library().lowbit_encode
        described = state_t(state)
        got = [torch.empty(piece.numel(), dtype=torch.uint8) for piece in pieces]
        for piece, codes in zip(pieces, got):
            encode(described, piece.data_ptr(), piece.numel(), codes.data_ptr())
    got, expected = torch.cat(got), torch.cat([fmt.encode(piece, signed) for piece in pieces])
    wrong = got != expected
    assert not wrong.any(), f"{int(wrong.sum())} codes differ, e.g. at {v[wrong][:4].tolist()}: {got[wrong][:4].tolist()} vs {expected[wrong][:4].tolist()}"
    # the premise: values between two codes round to either, every pair both ways
    for low in range(used_codebook(fmt, signed).numel() - 1):
        assert set(expected[pair == low].tolist()) == {low, low + 1}, f"test setup: pair {low} should round both ways"


@build_flags
@pytest.mark.parametrize("fmt", [OptimState4bit, _CalibratedSR], ids=["4bit", "calibrated"])
@pytest.mark.parametrize("signed", [True, False], ids=["signed", "unsigned"])
def test_kernel_quantizes_stochastically_like_the_format(fmt, signed, flag):
    """What a step stores (block scales, then stochastic codes; lowbit_quantize) is what quantize_
    stores, in whole blocks, a padded last one, blocks with a NaN, an infinity, only zeros; in every
    build. A calibrated stochastic format takes its scales from its final codes, not the nearest ones."""
    n = 37 * 128 + 45
    x = sample((n,), signed, seed=2)
    x[5 * 128 + 3], x[9 * 128 + 100] = math.nan, math.inf
    x[12 * 128 : 13 * 128] = 0.0
    reference = fmt.zeros(n, signed=signed)
    reference.quantize_(x)
    state = fmt.zeros(n, signed=signed)
    assert kernel_op.kernel_kind(state) == "codebook", "the kernel should take it"
    with kernel_built_with(flag):
        quantize_with_kernel(state, x)
    assert torch.equal(state.codes, reference.codes)
    torch.testing.assert_close(state.scale, reference.scale, rtol=0, atol=0, equal_nan=True)
    if fmt.calibrated(signed):  # the premise: the nearest codes would give other scales
        blocks = quant.to_blocks(x, 128, state.padded_numel)
        scale = quant.block_scales(blocks, fmt.scale_max, fmt.scale_min(signed))
        normalized = blocks / scale[:, None]
        nearest = OptimStateNF4.encode(normalized, signed)  # 4bit's nearest codes
        finite = reference.scale.isfinite()
        assert not torch.equal(quant.calibrated_scale(scale, normalized, fmt.decode(nearest, signed))[finite], reference.scale[finite])


def test_dither_constant_comes_from_quant(monkeypatch):
    """The C hash drops quant.DITHER_DROPPED_BITS bits, passed in at build time: another value
    builds another library, whose codes follow the Python's again."""
    monkeypatch.setattr(quant, "DITHER_DROPPED_BITS", 4)
    kernel_abi.load.cache_clear()
    try:
        state = OptimState4bit.zeros(256)
        v, _ = stochastic_inputs(True)
        v = v[:512]
        codes = torch.empty(v.numel(), dtype=torch.uint8)
        fused_cpu.library().lowbit_encode(state_t(state), v.data_ptr(), v.numel(), codes.data_ptr())
        assert torch.equal(codes, OptimState4bit.encode(v, True))
        monkeypatch.undo()
        assert not torch.equal(codes, OptimState4bit.encode(v, True)), "test setup: 4 dropped bits should round otherwise"
    finally:
        kernel_abi.load.cache_clear()


# ---- the C/Python interface ----------------------------------------------------------------------


def test_structures_come_from_the_c_table():
    """Python's ctypes structures are built from the table the library exports (csrc/abi.h): every
    C field is there, at the C's offset and size, and a name the C lacks cannot be set."""
    kernel = kernel_op.kernel()
    state, param = kernel.structs["state_t"], kernel.structs["param_t"]
    assert {"kind", "block_size", "codebook", "near_code", "stochastic", "col", "col_sums"} <= dict(state._fields_).keys()
    assert dict(param._fields_)["state"]._length_ == kernel.limits["max_states"]
    assert kernel.kinds.keys() == {"none", "f32", "bf16", "codebook", "e4m3", "factored", "bf16-sr", "block-float"} and kernel.kinds["none"] == 0
    assert kernel.optimizers["adam"].states == ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
    with pytest.raises(AttributeError, match="'state_t' object has no attribute 'blocksize'"):
        state(blocksize=256)


@pytest.mark.parametrize("block_size", [32, 256, 1024])
def test_the_schedulers_chunks_hold_whole_blocks_of_every_state(block_size):
    """The C's chunks (scheduler.h, chunk_size) are whole blocks of every blockwise state the kernel
    takes and whole rows of a factored one, as kernel_op.chunk_unit says: 10bit-sr's blocks had been
    left out, so at block_size 1024, or beside a factored state's 384-element rows, chunks cut its
    blocks and decoded and stored the wrong ones, with no error."""
    k = kernel_op.kernel()
    lib = fused_cpu.library()
    lib.lowbit_chunk_size.restype = ctypes.c_int64
    taken = [f for f in FORMATS if kernel_takes(f) and isinstance(f.fmt, type) and issubclass(f.fmt, OptimState)]
    assert {"8bit", "4bit", "fp8", "10bit-sr", "8bit-log"} <= {f.name for f in taken}
    for info in taken:
        for other in (None, FactoredState.zeros((16, 384)), OptimState8bit.zeros(8192, block_size=256)):
            states = [info.fmt.zeros(8192, block_size=block_size, signed=True), other]
            param = k.structs["param_t"](numel=8192)
            for i, state in enumerate(states):
                if state is not None:
                    param.state[i] = kernel_op.describe(k, state)
            size = lib.lowbit_chunk_size(ctypes.byref(param))
            assert size % kernel_op.chunk_unit([s for s in states if s is not None]) == 0, (info.name, other, size)


def test_a_chunk_past_the_buffers_is_refused_by_the_c(monkeypatch):
    """The C refuses chunks longer than its stack buffers (MAX_CHUNK) itself, stepping nothing, where
    Python's check (chunks_unsupported) was misled by a limit edited in place: it had overflowed them."""
    monkeypatch.setitem(kernel_op.kernel().limits, "max_chunk", 1 << 30)
    p = torch.nn.Parameter(torch.randn(4, 10000))
    opt = lowbit_optim.AdamW([p], state_format={"exp_avg": "8bit", "exp_avg_sq": "factored"}, fused=True, min_quantize_numel=0)
    p.grad = torch.randn_like(p)
    before = p.detach().clone()
    with pytest.raises(ValueError, match="would exceed its buffers of MAX_CHUNK elements"):
        opt.step()
    assert torch.equal(p, before)


def test_packers_write_what_ctypes_writes():
    """The op fills param_t arrays with struct packers (kernel_abi.packer): the same bytes as ctypes'
    own setters, at the C's offsets; fields that are not adjacent, in order, are refused (the pad
    bytes a packer writes would overwrite the fields between)."""
    kernel = kernel_op.kernel()
    param_t, state_t = kernel.structs["param_t"], kernel.structs["state_t"]
    values = dict(numel=123456789012, param_kind=1, grad_kind=2, param=0x1000, grad=0x2008, step=0, correction=0x3010)
    expected = param_t(**values)
    written = param_t()
    kernel_abi.packer(param_t, *values).write(memoryview(written).cast("B"), 0, *values.values())
    assert bytes(written) == bytes(expected)
    expected, written = state_t(kind=3, scale_max=127.0), state_t(kind=3, scale_max=127.0)
    expected.scale, expected.block_size = 0x4000, 256
    with memoryview(written).cast("B") as buffer:
        kernel_abi.packer(state_t, "scale").write(buffer, 0, 0x4000)
        kernel_abi.packer(state_t, "block_size").write(buffer, 0, 256)
    assert bytes(written) == bytes(expected)
    with pytest.raises(kernel_abi.LayoutMismatch, match=r"between them: \['scale_max', 'scale_min'\]"):
        kernel_abi.packer(state_t, "block_size", "data")
    with pytest.raises(kernel_abi.LayoutMismatch, match="in this order"):
        kernel_abi.packer(state_t, "scale", "data")


def test_layout_mismatch_refuses_the_kernel(monkeypatch):
    """Where ctypes would lay a field out otherwise than the C (here: a type code read as another
    size), the library is refused at load with a message naming the field."""
    monkeypatch.setitem(kernel_abi._SCALARS, "f32", ctypes.c_double)
    kernel_abi.load.cache_clear()
    try:
        with pytest.warns(UserWarning, match=r"structures do not match \(field state_t.scale_max \(f32\) lies at offset 16 with 4 bytes in C, at 16 with 8"):
            assert fused_cpu.library() is None
        with pytest.raises(RuntimeError, match="do not match"):
            run(True, state_format="8bit", shapes=[(64, 96)])
    finally:
        kernel_abi.load.cache_clear()


def test_build_key_covers_every_source_and_constant(monkeypatch, tmp_path):
    """The cached library's name hashes every file of csrc/ (an edited header builds anew) and the
    constants the C takes from quant.py."""
    assert {p.name for p in kernel_build.sources()} == {p.name for p in kernel_build.SOURCE_DIR.iterdir() if p.suffix in (".c", ".h")}
    assert {"fused_step.c", "abi.h", "codecs.h", "update_adam.h", "scheduler.h"} <= {p.name for p in kernel_build.sources()}
    copy = tmp_path / "csrc"
    copy.mkdir()
    for source in kernel_build.sources():
        (copy / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", copy)
    before = kernel_build.library_path(("cc",))
    (copy / "convert.h").write_text((copy / "convert.h").read_text() + "\n/* edited */\n")
    assert kernel_build.library_path(("cc",)) != before
    edited = kernel_build.library_path(("cc",))
    monkeypatch.setattr(quant, "MIN_BLOCK_SCALE", 1e-10)
    assert kernel_build.library_path(("cc",)) != edited


@pytest.mark.parametrize(
    "cpuinfo, expected",
    [
        ({"vendor_id": "AuthenticAMD", "cpu family": "26", "flags": "fpu sse2 avx2 avx512f"}, ["-DFAST_DIVIDER=1"]),
        ({"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu sse2 avx2 avx512f"}, ["-DFAST_DIVIDER=1"]),
        ({"vendor_id": "AuthenticAMD", "cpu family": "25", "flags": "fpu sse2 avx2"}, []),
        ({"vendor_id": "GenuineIntel", "cpu family": "6", "flags": "fpu sse2 avx2 avx512f"}, []),
        ({}, []),  # no /proc/cpuinfo (or an ARM one, without vendor_id)
    ],
    ids=["Zen 5", "Zen 4", "Zen 3", "Intel", "no cpuinfo"],
)
def test_tuning_follows_the_cpu_and_keys_the_build(monkeypatch, cpuinfo, expected):
    """The divider's path is chosen for the CPUs it was measured faster on, ahead of FLAGS
    (where a test's -D must override it), and the choice is part of the cached library's key (two
    CPUs sharing a cache build their own)."""
    fields = dict(cpuinfo)
    monkeypatch.setattr(kernel_build, "cpuinfo_field", fields.get)
    assert kernel_build.tuning() == expected
    command = kernel_build.command(("cc",), kernel_build.MAIN_SOURCE, kernel_build.MAIN_SOURCE.with_suffix(".so"))
    assert all(command.index(flag) < command.index(kernel_build.FLAGS[0]) for flag in expected)
    key = kernel_build.library_path(("cc",))
    fields["cpu family"] = "23" if expected else "26"  # the other choice, on AMD's CPUs
    assert (kernel_build.library_path(("cc",)) != key) == (fields.get("vendor_id") == "AuthenticAMD")


def test_package_ships_every_source():
    """pyproject's package data covers every file the build reads (an installed package builds too),
    the license it names exists, and the version it gives is lowbit_optim.__version__."""
    import fnmatch
    import importlib.metadata
    import pathlib
    import tomllib

    root = pathlib.Path(__file__).parent.parent
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    assert "lowbit_optim.csrc" in pyproject["tool"]["setuptools"]["packages"]
    globs = pyproject["tool"]["setuptools"]["package-data"]["lowbit_optim.csrc"]
    for source in kernel_build.sources():
        assert any(fnmatch.fnmatch(source.name, g) for g in globs), f"{source.name} is not in the package data {globs}"
    assert all((root / name).is_file() for name in pyproject["project"]["license-files"])
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lowbit_optim.__version__"}
    assert importlib.metadata.version("lowbit_optim") == lowbit_optim.__version__, "reinstall: pip install -e ."


def test_an_editors_lock_file_beside_the_sources_is_not_one(monkeypatch, tmp_path):
    """Emacs keeps a dangling link .#update.h beside a header it edits: the build key read it and
    the kernel was unavailable (an editable install) while the file was open."""
    for source in kernel_build.sources():
        shutil.copy(source, tmp_path / source.name)
    (tmp_path / ".#update.h").symlink_to("user@host.1234:1700000000")
    monkeypatch.setattr(kernel_build, "SOURCE_DIR", tmp_path)
    assert [s.name for s in kernel_build.sources()] == sorted(s.name for s in tmp_path.iterdir() if s.name != ".#update.h")
    kernel_build.sources_digest()  # read them all: the link had raised FileNotFoundError


def test_hyper_parameters_are_checked_by_name():
    """The kernel's hyper-parameters are filled by the C struct's field names: a missing or unknown
    one is an error naming it, not a silently zero field."""
    fields = dict(lr=1e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, one_minus_beta1=0.1, one_minus_beta2=1e-3, decoupled_weight_decay=1, maximize=0)
    assert len(kernel_op.hyper_values("adam", fields)) == len(fields)
    with pytest.raises(ValueError, match=r"missing \['eps'\], unknown \['epsilon'\]"):
        kernel_op.hyper_values("adam", {**{k: v for k, v in fields.items() if k != "eps"}, "epsilon": 1e-8})
    for bad in (0.5, 2, 2**32, -1):  # a flag: C's int32 had wrapped 2**32 to 0
        with pytest.raises(ValueError, match=r"maximize of the kernel is a flag \(0 or 1\)"):
            kernel_op.hyper_values("adam", {**fields, "maximize": bad})
    # the structures are shared between calls with the same numbers, zeros' signs included
    assert kernel_op.hyper_values("adam", fields) == kernel_op.hyper_values("adam", dict(fields))
    assert math.copysign(1.0, kernel_op.hyper_values("adam", {**fields, "weight_decay": -0.0})[3]) == -1.0
    assert math.copysign(1.0, kernel_op.hyper_values("adam", fields)[3]) == 1.0


# ---- the torch op ----------------------------------------------------------------------------------


def op_arguments(state_format="8bit", amsgrad=False, seed=0):
    """fused_step_cpu's arguments for two Adam parameters (one quantized, one with fp32 states), as
    fused_cpu.step makes them, after one step through the optimizer (so states exist); the addends
    of states that keep a part outside their codes (8bit-lowrank's matrix)."""
    params, opt = run(True, shapes=[(71, 64), (200,)], state_format=state_format, amsgrad=amsgrad)
    items = [(p.detach(), p.grad, *(opt.state[p].get(k) for k in ("step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"))) for p in params]
    group = opt.param_groups[0]
    beta1, beta2 = group["betas"]
    hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], one_minus_beta1=1 - beta1,
                 one_minus_beta2=1 - beta2, decoupled_weight_decay=True, maximize=False)  # fmt: skip
    tensors, keys, addends = [], [], []
    for *_, m, v, vmax in items:
        for state in (m, v, vmax):
            keys.append(kernel_op.format_key(state))
            if state is not None:
                tensors.extend(state._inner().values() if isinstance(state, StateTensor) else [state])
            if isinstance(state, StateTensor) and state.has_addend:
                addends.append(state.kernel_addend(torch.empty(state.numel(), dtype=torch.float32)))
    return ("adam", kernel_op.hyper_values("adam", hyper), [i[0] for i in items], [i[1] for i in items], [i[2] for i in items], tensors, keys, [], addends)


def cloned(arguments):
    return tuple([t.clone() for t in a] if isinstance(a, list) and a and isinstance(a[0], torch.Tensor) else a for a in arguments)


@pytest.mark.parametrize("state_format", ["8bit", "4bit", {"exp_avg": "fp8", "exp_avg_sq": "factored"}, "8bit-lowrank"], ids=["8bit", "4bit", "factored", "8bit-lowrank"])
def test_op_under_compile_gives_the_direct_calls_bits(state_format):
    """lowbit_optim::fused_step_cpu is opaque to dynamo: under torch.compile(fullgraph=True) it is
    one node, and the step it runs writes the same bits as a direct call."""
    arguments = op_arguments(state_format, amsgrad=state_format != {"exp_avg": "fp8", "exp_avg_sq": "factored"})  # (refused for factored)
    direct, compiled = cloned(arguments), cloned(arguments)
    torch.ops.lowbit_optim.fused_step_cpu(*direct)
    torch._dynamo.reset()
    graphs = counters["stats"]["unique_graphs"]
    torch.compile(lambda *a: torch.ops.lowbit_optim.fused_step_cpu(*a), fullgraph=True)(*compiled)
    assert counters["stats"]["unique_graphs"] == graphs + 1
    for a, b in zip(direct[2:6] + direct[8:], compiled[2:6] + compiled[8:]):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    assert not torch.equal(direct[2][0], arguments[2][0]), "test setup: the step should move the parameter"


def test_op_passes_opcheck():
    """torch.library.opcheck: the schema declares what the op mutates, the fake implementation fits,
    and it works under AOT dispatch."""
    torch.library.opcheck(torch.ops.lowbit_optim.fused_step_cpu.default, op_arguments("4bit"))
    torch.library.opcheck(torch.ops.lowbit_optim.fused_step_cpu.default, op_arguments("8bit-lowrank"))


def test_op_refuses_bad_arguments():
    """The op checks what the C would read before it reads anything: counts, format keys, tensors."""
    arguments = list(op_arguments("8bit"))
    params_before = [p.clone() for p in arguments[2]]

    def refused(match, **changes):
        names = ["optimizer", "hyper", "params", "grads", "steps", "state_tensors", "state_formats", "corrections", "addends"]
        changed = [changes.get(name, value) for name, value in zip(names, arguments)]
        with pytest.raises(ValueError, match=match):
            torch.ops.lowbit_optim.fused_step_cpu(*changed)

    refused("has no optimizer 'rmsprop'", optimizer="rmsprop")
    refused("takes 5 hyper-parameters", optimizer="lion")  # another optimizer's arguments
    refused("takes 9 hyper-parameters", hyper=arguments[1][:-1])
    refused("takes 9 hyper-parameters .* 5 format keys", state_formats=arguments[6][:-1])
    refused("more tensors than state_formats describe", state_tensors=[*arguments[5], torch.zeros(1)])
    refused("fewer tensors than state_formats describe", state_tensors=arguments[5][:-1])
    refused("format key 999 names no state format", state_formats=[999, *arguments[6][1:]])
    refused(r"shape \(71, 64\): its exp_avg state is missing", state_formats=[kernel_op.ABSENT, *arguments[6][1:]], state_tensors=arguments[5][2:])
    refused(r"shape \(71, 64\): its exp_avg state: .* is inconsistent", state_tensors=[arguments[5][0][:-1], *arguments[5][1:]])
    refused(r"shape \(200,\): its gradient is", grads=[arguments[3][0], arguments[3][1][:-1]])
    refused(r"shape \(71, 64\): its step counter is", steps=[torch.zeros(0), arguments[4][1]])
    refused("corrections holds 1 tensors for 2 parameters", corrections=[torch.zeros(71 * 64, dtype=torch.int8)])
    no_correction = torch.zeros(0, dtype=torch.int8)
    refused(r"shape \(71, 64\): its int8-correction is .* beside a bfloat16 parameter", corrections=[torch.zeros(71 * 64, dtype=torch.int8), no_correction])
    refused("addends holds more tensors than the given states keep outside their codes", addends=[torch.zeros(71 * 64)])
    for before, after in zip(params_before, arguments[2]):
        assert torch.equal(before, after), "a refused call must step nothing"
    # what would overflow the C's chunk buffers: rows of 8191 elements beside blocks of 128
    wide = (torch.zeros(3 * 8191), torch.zeros(3 * 8191), torch.zeros(()), OptimState4bit.zeros((3, 8191)), FactoredState.zeros((3, 8191)), None)
    hyper = dict(zip([name for name, _ in kernel_op.kernel().optimizers["adam"].hyper._fields_], arguments[1]))
    with pytest.raises(ValueError, match=r"shape \(24573,\): a factored state's rows of 8191 elements and the other states' blocks meet only every 1048448"):
        fused_cpu.step("adam", [wide], hyper)



def resized(t: torch.Tensor) -> torch.Tensor:
    """``t`` with its storage resized in place to half (as FSDP frees memory): its shape kept."""
    t.untyped_storage().resize_(t.untyped_storage().nbytes() // 2)
    return t


def test_op_names_a_resized_storage_of_a_correction_or_an_addend():
    """A correction or an addend of the right size whose storage was resized in place is refused as
    such, not as a tensor of the wrong size."""
    param = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    opt = lowbit_optim.AdamW([param], state_format="8bit", param_update="int8-correction", fused=True)
    param.grad = torch.randn_like(param)
    opt.step()
    resized(opt.state[param]["param_correction"])
    with pytest.raises(ValueError, match=r"shape \(64, 64\): the storage of its int8-correction holds 2048 bytes, not the 4096"):
        opt.step()
    arguments = op_arguments("8bit-lowrank")
    with pytest.raises(ValueError, match=r"shape \(71, 64\): the storage of the addend of its exp_avg state holds"):
        torch.ops.lowbit_optim.fused_step_cpu(*arguments[:-1], [resized(arguments[-1][0])])



@pytest.mark.parametrize(
    "negate, options, what",
    [
        (lambda s: setattr(s["exp_avg"], "scale", s["exp_avg"].scale._neg_view()), dict(state_format="8bit"), "exp_avg state's scale"),
        (lambda s: s.__setitem__("exp_avg_sq", s["exp_avg_sq"]._neg_view()), dict(state_format="fp32"), "exp_avg_sq state"),
        (lambda s: s.__setitem__("param_correction", s["param_correction"]._neg_view()), dict(param_update="int8-correction"), "int8-correction"),
    ],
    ids=["a scale", "a plain state", "an int8-correction"],
)
def test_a_lazily_negated_tensor_the_kernel_writes_is_named(negate, options, what):
    """The dispatcher refuses a lazily negated tensor among those the op writes before the op's own
    checks run: the step names which one, and steps nothing."""
    param = torch.nn.Parameter(torch.randn(64, 64, dtype=torch.bfloat16))
    opt = lowbit_optim.AdamW([param], fused=True, **options)
    param.grad = torch.randn_like(param)
    opt.step()
    negate(opt.state[param])
    before = param.detach().clone()
    with pytest.raises(ValueError, match=rf"shape \(64, 64\): its {what} is a lazily negated"):
        opt.step()
    assert torch.equal(param, before)



def test_a_truncated_low_rank_factor_names_its_state():
    """A low-rank state's factor cut short (read by the products before the op's checks) is refused
    naming the state and the parameter."""
    param = torch.nn.Parameter(torch.randn(64, 96))
    opt = lowbit_optim.AdamW([param], state_format={"exp_avg": "8bit-lowrank", "exp_avg_sq": "8bit"}, fused=True)
    param.grad = torch.randn_like(param)
    opt.step()
    state = opt.state[param]["exp_avg"]
    assert state.rank > 0, "test setup: the state should hold factors"
    state.left = state.left[: state.left.numel() // 2]
    with pytest.raises(ValueError, match=r"shape \(64, 96\): its exp_avg state: OptimState8bitLowRank .* is inconsistent: left has"):
        opt.step()



@pytest.fixture
def checked_shapes(monkeypatch):
    """The shapes of the parameters whose states the op checks (kernel_op.check_inputs), from an
    empty memory of earlier checks on."""
    checked = []
    original = kernel_op.check_inputs
    monkeypatch.setattr(kernel_op, "check_inputs", lambda *a, **k: checked.append(a[0].shape) or original(*a, **k))
    monkeypatch.setattr(kernel_op, "_checked", kernel_op._KeptVerdicts())
    return checked


def test_op_finds_every_parameter_again_when_the_process_holds_more_than_its_bound(checked_shapes, monkeypatch):
    """The op's memory of checked states is bounded (states replaced over a long run leave entries):
    with more parameters in the process than that bound (3 or 4 calls of 2 against a bound of 4 here;
    16800 in a review, and 400 groups of 100), every call still finds its parameters again, rather
    than checking them all anew (which tripled the step time). States replaced at every call still
    leave at most about four times the bound."""
    monkeypatch.setattr(kernel_op, "_CHECKED_KEPT", 2)
    for count in (3, 4):
        calls = [list(op_arguments("8bit", seed=count)) for _ in range(count)]
        checked_shapes.clear()  # (what the optimizers that made them checked: each stepped alone)
        monkeypatch.setattr(kernel_op, "_checked", kernel_op._KeptVerdicts())
        for _ in range(3):
            for arguments in calls:
                torch.ops.lowbit_optim.fused_step_cpu(*arguments)
        assert len(checked_shapes) == 2 * count
    for _ in range(12):  # new states at every call: entries never used again
        torch.ops.lowbit_optim.fused_step_cpu(*op_arguments("8bit"))
    kept = kernel_op._checked
    assert len(kept.recent) + len(kept.older) <= 4 * 4 + 2


def test_op_checks_each_states_once_and_again_when_their_tensors_change(checked_shapes):
    """The op remembers a parameter's states that passed its checks by their tensors' dtypes, shapes,
    layouts, addresses and storage sizes: a second call over the same tensors checks only the
    parameter, gradient and counter; a state changed in place behind the same tensor objects
    (``.data =``, a shrinking ``resize_`` that keeps the address) is checked anew and refused, and so
    is one at the same address over a storage of another size."""
    arguments = list(op_arguments("8bit"))
    checked = checked_shapes
    torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    assert checked == [torch.Size([71, 64]), torch.Size([200])]
    torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    assert len(checked) == 2, "the same states were checked again"
    grads = [g.clone() for g in arguments[3]]  # new gradients: checked every call, without the states
    torch.ops.lowbit_optim.fused_step_cpu(*arguments[:3], grads, *arguments[4:])
    assert len(checked) == 2
    with pytest.raises(ValueError, match=r"shape \(200,\): its gradient is"):
        torch.ops.lowbit_optim.fused_step_cpu(*arguments[:3], [grads[0], grads[1][:-1]], *arguments[4:])
    codes = arguments[5][0]  # the (71, 64) parameter's exp_avg codes
    before = codes.clone()
    codes.data = before[:-1].clone()
    with pytest.raises(ValueError, match=r"shape \(71, 64\): its exp_avg state: .* is inconsistent"):
        torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    codes.data = before.clone()
    torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    address = codes.data_ptr()
    codes.resize_(codes.numel() - 64)
    assert codes.data_ptr() == address
    with pytest.raises(ValueError, match=r"shape \(71, 64\): its exp_avg state: .* is inconsistent"):
        torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    # the same address and shape, another storage size (a storage resized to 0 and back smaller often
    # gets its address back: a check remembered by address would pass it, and the C write past its end)
    spare = bytearray(2 * before.nbytes)
    exact = torch.frombuffer(spare, dtype=before.dtype, count=before.numel()).view(before.shape).copy_(before)
    roomy = torch.frombuffer(spare, dtype=before.dtype)[: before.numel()].view(before.shape)
    assert exact.data_ptr() == roomy.data_ptr() and exact.untyped_storage().nbytes() != roomy.untyped_storage().nbytes()
    arguments[5][0] = exact
    torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    count = len(checked)
    arguments[5][0] = roomy
    torch.ops.lowbit_optim.fused_step_cpu(*arguments)
    assert len(checked) == count + 1, "a state whose storage changed size at the same address was not checked again"


def test_an_optimizers_steps_check_each_parameter_once(checked_shapes):
    """Through the optimizer (one op call per param group; two groups, two formats), each
    parameter's states are checked at its first step only; states converted by a load of another
    format's checkpoint are checked at the next step."""
    checked = checked_shapes
    params = [torch.nn.Parameter(torch.randn(8 + i, 64)) for i in range(6)]
    groups = [{"params": params[:3]}, {"params": params[3:], "state_format": "fp8"}]
    opt = lowbit_optim.AdamW(groups, state_format="8bit", min_quantize_numel=0, fused=True)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    assert sorted(checked) == sorted(p.shape for p in params)
    other = lowbit_optim.AdamW([{"params": params[:3]}, {"params": params[3:]}], state_format="4bit", min_quantize_numel=0, fused=True)
    other.load_state_dict(opt.state_dict())
    checked.clear()
    for _ in range(2):
        other.step()
    assert sorted(checked) == sorted(p.shape for p in params)


@pytest.mark.parametrize("what", ["values", "gradient", "exp_avg state's codes", "exp_avg_sq state's scale"])
def test_a_storage_shrunk_under_its_tensor_is_refused(what):
    """Resizing a tensor's storage in place (as FSDP frees memory: ``untyped_storage().resize_(0)``)
    keeps its shape, so the C would read and write past the storage's end. After a step that left its
    states' checks remembered, the op refuses it, naming the tensor, and steps nothing; also where the
    storage, resized to 0 and back smaller, kept its address
    (test_op_checks_each_states_once_and_again_when_their_tensors_change)."""
    p = torch.nn.Parameter(torch.randn(256, 256))
    opt = lowbit_optim.AdamW([p], state_format="8bit", min_quantize_numel=0, fused=True)
    p.grad = torch.randn_like(p)
    opt.step()
    p.grad = torch.randn_like(p)
    state = opt.state[p]
    tensor = {"values": p.data, "gradient": p.grad, "exp_avg state's codes": state["exp_avg"].codes, "exp_avg_sq state's scale": state["exp_avg_sq"].scale}[what]
    before = p.detach().clone()
    storage = tensor.untyped_storage()
    half = storage.nbytes() // 2
    storage.resize_(0)
    storage.resize_(half)  # at the same address or not, as the allocator has it
    with pytest.raises(ValueError, match=rf"shape \(256, 256\): the storage of its {what} holds {half} bytes, not the \d+ its elements need"):
        opt.step()
    if what != "values":
        assert torch.equal(p.detach(), before)


@pytest.mark.parametrize("factor", ["left", "right"])
def test_low_rank_factors_replaced_by_a_short_tensor_are_refused(factor):
    """A low-rank state's factors are read (their product, the addend) before the op checks its other
    tensors: one replaced by a tensor of another size is refused with the state's own message."""
    p = torch.nn.Parameter(torch.randn(64, 128))
    opt = lowbit_optim.AdamW([p], state_format="8bit-lowrank", min_quantize_numel=0, fused=True)
    p.grad = torch.randn_like(p)
    opt.step()
    state = opt.state[p]["exp_avg"]
    setattr(state, factor, getattr(state, factor)[:5].clone())
    with pytest.raises(ValueError, match=r"shape \(64, 128\): .* is inconsistent: left has \d+ and right \d+ elements"):
        opt.step()


def test_a_state_with_odd_metadata_neither_stands_for_nor_passes_as_valid_ones():
    """Format keys tell metadata apart by type as well as value (signed=1 equals True): the op
    rebuilds and checks each state from the metadata its key registered, so a state made with
    signed=1 must get a key of its own, be refused, and leave valid states of its format stepping."""
    odd = OptimStateFp8.zeros((64, 64), signed=1)
    assert kernel_op.format_key(odd) != kernel_op.format_key(OptimStateFp8.zeros((64, 64), signed=True))
    p = torch.nn.Parameter(torch.randn(64, 64))
    opt = lowbit_optim.AdamW([p], state_format={"exp_avg": "fp8", "exp_avg_sq": "fp8"}, fused=True, min_quantize_numel=0)
    for _ in range(2):
        p.grad = torch.randn_like(p)
        opt.step()
    state = opt.state[p]["exp_avg"]
    state.signed = 1  # changed in place on the state object: another key, checked anew
    p.grad = torch.randn_like(p)
    with pytest.raises(ValueError, match="signed is 1, not a bool"):
        opt.step()


@pytest.mark.parametrize("which", ["params", "grads", "state_tensors"])
def test_op_refuses_tensors_on_the_meta_device(which):
    """A meta tensor among the op's CPU tensors dispatches the call to its fake kernel, which had
    returned without stepping anything or saying so (a state's codes replaced by a meta tensor)."""
    arguments = list(op_arguments("8bit"))
    index = {"params": 2, "grads": 3, "state_tensors": 5}[which]
    arguments[index] = [arguments[index][0].to("meta"), *arguments[index][1:]]
    with pytest.raises(ValueError, match=rf"on the meta device: {which}\[0\] is one \(nothing was stepped\)"):
        torch.ops.lowbit_optim.fused_step_cpu(*arguments)


def test_op_refuses_a_state_without_its_addend():
    """A state that keeps a part of its values outside its codes (8bit-lowrank's matrix) is stepped
    only with that part given as an addend of its size: the C would otherwise decode the codes alone,
    or read past the addend."""
    arguments = list(op_arguments("8bit-lowrank"))
    (addend,) = arguments[8]
    before = [t.clone() for t in arguments[5]]
    for addends, match in (
        ([], r"shape \(71, 64\): its exp_avg state keeps a part of its values outside its codes, and addends holds none"),
        ([addend[:-1]], r"shape \(71, 64\): the addend of its exp_avg state is .*, not 4544 contiguous float32"),
        ([addend.double()], "not 4544 contiguous float32"),
        ([addend.view(71, 64).t()], "not 4544 contiguous float32"),
    ):
        with pytest.raises(ValueError, match=match):
            torch.ops.lowbit_optim.fused_step_cpu(*arguments[:8], addends)
    assert all(torch.equal(a, b) for a, b in zip(before, arguments[5])), "a refused call must step nothing"


def test_op_refuses_an_addend_beside_other_codes(monkeypatch):
    """The C adds an addend to decoded codebook codes only: a state of another kind that says it keeps
    a part outside its codes is refused, not decoded without it."""
    arguments = op_arguments("fp8")
    monkeypatch.setattr(OptimStateFp8, "has_addend", property(lambda self: True))
    monkeypatch.setattr(kernel_op, "_checked", kernel_op._KeptVerdicts())  # verdicts on the class as it was
    addends = [torch.zeros(71 * 64), torch.zeros(71 * 64)]
    with pytest.raises(ValueError, match="the exp_avg state keeps a part outside its e4m3 codes"):
        torch.ops.lowbit_optim.fused_step_cpu(*arguments[:8], addends)



@pytest.mark.parametrize("fmt", ["8bit-lowrank", "4bit-lowrank-mulaw"])
def test_low_rank_states_of_one_row_or_column_take_the_kernel(fmt):
    """The compiled step takes its low-rank products from lowrank_products, as the kernel's part
    does, where inductor would have summed a one-column matrix's (1 x k) @ (k x 1) product in its own
    order: every shape gets the compiled step's bits from the kernel."""
    shapes = [(71, 64), (300, 1), (1, 300), (300, 2)]
    assert_identical(run(True, shapes=shapes, state_format=fmt, min_quantize_numel=1), run(False, shapes=shapes, state_format=fmt, min_quantize_numel=1))


# ---- factored states ------------------------------------------------------------------------------


def test_factored_sums_are_float64_sums():
    """One step from zero states: a factored second moment's new row and column sums are the float64
    sums of the step's fp32 values, rounded once (the compiled step adds fp32 in inductor's order).
    (600, 64) has more chunks than tasks; (300,) is a column, stored exactly, and so is (40000,),
    whose column sum comes from 79 chunks in 32 tasks."""
    torch.manual_seed(0)
    shapes = [(71, 64), (600, 64), (300,), (40000,)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = lowbit_optim.AdamW(params, lr=1e-2, betas=(0.9, 0.999), state_format=FACTORED, fused=True, min_quantize_numel=0)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        v = p.grad * p.grad * torch.tensor(1 - 0.999)  # the step's lerp from a zero state
        v = v.double().view(p.shape[0], -1)
        state = opt.state[p]["exp_avg_sq"]
        assert torch.equal(state.row, v.sum(1).float())
        assert torch.equal(state.col, v.sum(0).float())


def test_factored_sums_do_not_depend_on_threads():
    """A parameter's tasks, and so the order of its column sums, follow from its size alone: one
    thread and two give the same bits (here 75 chunks in 32 tasks, 9 in 9, and a column's 79 in 32)."""
    shapes = [(600, 64), (71, 64), (40000,)]
    with torch_threads(1):
        one = run(True, shapes=shapes, state_format=FACTORED)
    with torch_threads(2):
        two = run(True, shapes=shapes, state_format=FACTORED)
    assert_identical(one, two, exact_sums=True)


# a parameter of many tasks beside SHAPES' small ones: the threads grab them in turns (scheduler.h)
THREADED_SHAPES = [(600, 64), *SHAPES]
# every kernel update beside Adam's (cases of OTHER_OPTIMIZER_CASES), on the threads test's shapes
THREADED_OPTIMIZERS = ("SGD 8bit", "Lion 8bit, int8-correction", "AdEMAMix fp8, bf16 params, betas <= 0.5")
THREADED_CASES = [pytest.param(f, dict(state_format=f.spec), id=f.name) for f in FORMATS] + [
    pytest.param(None, OTHER_OPTIMIZER_CASES[name], id=name) for name in THREADED_OPTIMIZERS
]


@pytest.mark.parametrize("info, kwargs", THREADED_CASES)
def test_kernel_bits_do_not_depend_on_threads(info, kwargs):
    """The kernel's steps on 2 and 3 threads give one thread's bits, factored sums and low-rank
    parts included (a task's order, and a QR's, follow from sizes alone), for every registered
    format the kernel takes and the updates of SGD, Lion and AdEMAMix (Muon's momentum is
    elementwise as theirs; its iterations are torch's matmuls). The suite's workers run a thread each (conftest.py): here the threads meet."""
    if info is not None and not kernel_takes(info):
        pytest.skip("the kernel does not take this format (test_fused_matches_compiled_bitwise checks the refusal)")
    kwargs = dict(shapes=THREADED_SHAPES) | kwargs
    with torch_threads(1):
        one = run(True, **kwargs)
    for count in (2, 3):
        with torch_threads(count):
            assert_identical(one, run(True, **kwargs), exact_sums=True)


@pytest.mark.parametrize("state_format", [*("8bit", "4bit", "8bit-sr", "10bit-sr", "bf16-sr", "8bit-lowrank"), pytest.param(FACTORED, id="4bit + factored")])
def test_compiled_step_on_two_threads_gives_the_kernels_bits(state_format):
    """The compiled step's graphs on 2 threads (inductor's parallel loops; a new thread count
    recompiles) against the kernel on one: the same bits for codebooks, stochastic rounding, block
    floats and low-rank parts, factored sums within their few ulp."""
    kwargs = dict(shapes=THREADED_SHAPES, state_format=state_format)
    with torch_threads(1):
        kernel = run(True, **kwargs)
    with torch_threads(2):
        assert_identical(run(False, **kwargs), kernel)
