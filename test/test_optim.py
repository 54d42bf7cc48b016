"""Optimizer-level tests of lowbit_optim.Adam / AdamW, parametrized over the format registry.

Every test taking ``info`` runs once per registered format (``conftest.FORMATS``), so a newly
registered format inherits this suite. On CPU, torch.compile dominates the runtime: ~15-35 s for the
first graph of a process, ~4 s (plain state) or ~12 s (quantized state) for each further graph with a
cold inductor cache, 1-2 s with a warm one. The compiled tests therefore share few graphs: AdamW with
default flags (most tests), AdamW(amsgrad=True) (the amsgrad test), bf16 params with stochastic
rounding, and fp32-only variants in the torch.optim comparison. Tests about structure (state
classes, checkpoints, errors, hooks) run the step eagerly (``compile=False``): the same function,
which test_compiled_step_matches_eager ties to the compiled one.

States are checked by the registry name of their format (``stored_as``), so the expectations read
the same for plain and quantized formats.
"""

import copy
import functools
import inspect
import io
import sys
import warnings

import expecttest
import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

import lowbit_optim
from conftest import BUILTIN_FORMAT_NAMES, FormatInfo, all_formats, format_info, quantized_formats, stored_format
from lowbit_optim import LowRankState, OptimState, StateFormatError, StateTensor, StochasticBF16State, quant
from lowbit_optim.formats import PlainFormat, get_format, paired_label, paired_state_format, registered_formats

# ------------------------------------------------------------------------------------------------
# Shared model, data and helpers
# ------------------------------------------------------------------------------------------------

IN_FEATURES, HIDDEN, OUT_FEATURES = 96, 64, 71
# weights: 64x96 = 6144 elements (whole blocks of 128 and 256) and 71x64 = 4544 (> min_quantize_numel,
# not a multiple of any block size: the last block is padded); biases of 64 and 71 keep fp32 state.
LR = 1e-2


def make_mlp(out_features: int = OUT_FEATURES, *, bias: bool = True, dtype=torch.float32, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers = [nn.Linear(IN_FEATURES, HIDDEN, bias=bias), nn.Tanh(), nn.Linear(HIDDEN, out_features, bias=bias)]
    return nn.Sequential(*layers).to(dtype)


def regression_data(out_features: int = OUT_FEATURES, dtype=torch.float32, n: int = 64):
    """A fixed batch: inputs and the outputs of a random one-layer teacher."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, IN_FEATURES, generator=g)
    teacher = torch.randn(IN_FEATURES, out_features, generator=g) / IN_FEATURES**0.5
    return x.to(dtype), torch.tanh(x @ teacher).to(dtype)


def loss_of(model: nn.Module, data) -> torch.Tensor:
    x, y = data
    return (model(x) - y).float().square().mean()


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> list[float]:
    """``steps`` optimizer steps on the fixed batch (through a closure); returns the loss before
    each step and after the last one."""
    data = regression_data(model[-1].out_features, next(model.parameters()).dtype)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, data)
        loss.backward()
        return loss

    losses = [float(opt.step(closure).detach()) for _ in range(steps)]
    with torch.no_grad():
        return losses + [float(loss_of(model, data))]


def dense(t: torch.Tensor) -> torch.Tensor:
    """A state (quantized, torchao's, or plain) as a plain fp32 tensor."""
    if isinstance(t, StateTensor):
        return t.dequantize(torch.float32)
    return (t if type(t) is torch.Tensor else t.dequantize()).detach().float()


def stored_as(state: torch.Tensor) -> str:
    """The registry name of the format a state is stored in."""
    if isinstance(state, StateTensor):
        return type(state).name
    assert type(state) is torch.Tensor, type(state)
    return next(name for name, f in registered_formats().items() if isinstance(f, PlainFormat) and f.dtype == state.dtype)


def assert_same_bits(state: torch.Tensor, other: torch.Tensor, key) -> None:
    """Equal states, bit for bit (inner tensors of state subclasses)."""
    if isinstance(state, StateTensor):
        for name, t in state._inner().items():
            assert torch.equal(t, getattr(other, name)), (key, name)
    else:
        assert torch.equal(state, other), key


def importable_by_reference(cls) -> bool:
    """Whether pickle (torch.save) finds ``cls`` under its module and qualified name."""
    found = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is cls


def moments(opt: torch.optim.Optimizer, model: nn.Module) -> dict:
    """(parameter index, state name) -> state, for every moment of every parameter with state."""
    return {(i, k): v for i, p in enumerate(model.parameters()) for k, v in opt.state.get(p, {}).items() if k != "step"}


def rounding_bound(info: FormatInfo, reference: torch.Tensor, signed: bool, block_size: int) -> torch.Tensor:
    """Per element, the largest distance between ``reference`` and its quantization in ``info``'s
    format: the worst normalized rounding error times the reach of the element's block
    (FormatInfo.block_reach: its absmax, or a little more) (plus fp32 round-off of the scaling)."""
    flat = reference.detach().double().reshape(-1)
    padded = nn.functional.pad(flat, (0, -flat.numel() % block_size)).view(-1, block_size)
    reach = info.block_reach(padded, signed)[:, None].expand_as(padded).reshape(-1)[: flat.numel()].view(reference.shape)
    return info.max_rounding_error(signed) * reach * (1 + 1e-5) + 1e-30


def mismatch_fraction(a: torch.Tensor, b: torch.Tensor, rel: float = 1e-5) -> float:
    """Fraction of elements of two states that differ by more than ``rel`` times the larger state's
    absmax: fp32 round-off stays below it, a quantized code flipped to its neighbour does not."""
    a, b = dense(a), dense(b)
    scale = torch.maximum(a.abs().max(), b.abs().max())
    return float(((a - b).abs() > rel * scale).float().mean())


def redrawn_fraction(a: torch.Tensor, b: torch.Tensor) -> float:
    """The fraction of two stochastic states' blocks whose scales differ in the bits quant.dither
    hashes (0 for other states): fp32 round-off that moves a block's scale across a hash boundary
    (about 1 ulp move in 1024) draws the whole block anew, about half its codes one step apart."""
    if not (isinstance(a, OptimState) and getattr(a, "stochastic", False)):
        return 0.0
    hashed = [s.scale.view(torch.int32) >> quant.DITHER_DROPPED_BITS for s in (a, b)]
    return float((hashed[0] != hashed[1]).float().mean())


def assert_params_close(model_a: nn.Module, model_b: nn.Module, *, rtol: float, atol: float) -> None:
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m, name=name: f"parameter {name}: {m}")


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


@pytest.fixture
def eager_step(monkeypatch):
    """Optimizers built in this test run the step eagerly even where they cannot take
    ``compile=False`` (the torchao-style aliases): structure tests need no compiled graph."""
    monkeypatch.setattr(lowbit_optim.base, "compiled_step", lambda step_function: step_function)


# ------------------------------------------------------------------------------------------------
# 1. fp32 state reproduces torch.optim
# ------------------------------------------------------------------------------------------------

TORCH_PARITY_CASES = {
    "AdamW": (lowbit_optim.AdamW, torch.optim.AdamW, dict(weight_decay=0.1)),
    "Adam-L2": (lowbit_optim.Adam, torch.optim.Adam, dict(weight_decay=0.1)),
    "AdamW-amsgrad": (lowbit_optim.AdamW, torch.optim.AdamW, dict(amsgrad=True)),
    "Adam-L2-amsgrad-maximize": (lowbit_optim.Adam, torch.optim.Adam, dict(weight_decay=0.1, amsgrad=True, maximize=True)),
}

# Observed after 10 steps at lr=1e-2 (compiled fp32 arithmetic vs torch's eager single-tensor
# kernels): params differ by <= 1.1e-6, needing atol 7.3e-7 at rtol 1e-5; moments by <= 3.8e-8,
# needing atol 2.7e-8.
PARITY_PARAM_TOL = dict(rtol=1e-5, atol=1.5e-6)
PARITY_STATE_TOL = dict(rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", TORCH_PARITY_CASES, ids=list(TORCH_PARITY_CASES))
def test_fp32_state_matches_torch_optim(case):
    """state_format="fp32" is torch.optim.Adam / AdamW (L2 vs decoupled decay, amsgrad, maximize)."""
    ours_cls, torch_cls, kwargs = TORCH_PARITY_CASES[case]
    ours_model, torch_model = make_mlp(), make_mlp()
    ours = ours_cls(ours_model.parameters(), lr=LR, state_format="fp32", **kwargs)
    reference = torch_cls(torch_model.parameters(), lr=LR, **kwargs)
    train(ours_model, ours, 10)
    train(torch_model, reference, 10)

    assert_params_close(ours_model, torch_model, **PARITY_PARAM_TOL)
    expected = moments(reference, torch_model)
    assert moments(ours, ours_model).keys() == expected.keys()
    for key, state in moments(ours, ours_model).items():
        assert stored_as(state) == "fp32", key
        torch.testing.assert_close(state, expected[key], **PARITY_STATE_TOL, msg=lambda m, key=key: f"{key}: {m}")
    for p_ours, p_torch in zip(ours_model.parameters(), torch_model.parameters()):
        assert float(ours.state[p_ours]["step"]) == float(reference.state[p_torch]["step"]) == 10


# ------------------------------------------------------------------------------------------------
# 2. The compiled step equals the eager one
# ------------------------------------------------------------------------------------------------

# What the compiled step guarantees against the eager one. Both compute the same formula, but inductor
# may contract a * b + c into one FMA where the CPU has it (AVX2 and AVX-512 builds differ) and order
# reductions its own way, changing an fp32 result by an ulp. Where that moves a value across a
# rounding boundary, a code flips to its neighbour: that element's state differs by one code step,
# and its parameter by the difference of two Adam updates (each at most ~lr), not by round-off.
# Observed on AVX-512 after 3 steps: params differ by <= 4.3e-7 (bf16 state) and <= 1.2e-7 otherwise,
# no quantized code differs, a fraction 2.2e-4 of bf16 state elements by one bf16 ulp. On an AVX2
# EPYC: one 8-bit element of 4544 (2.2e-4) flipped, its parameter off by 5.7e-5.
# A stochastic format also draws anew where an ulp moved a value across a hash boundary (1 in 1024
# ulp moves, quant.dither): observed for 8bit-sr after 3 steps, 1.3e-3 of a weight's elements; and
# where one moved a block's scale across one, the whole block draws anew (redrawn_fraction).
COMPILED_PARAM_ATOL = 1e-6
MAX_CODE_FLIP_FRACTION = 1e-3
STOCHASTIC_FLIP_FACTOR = 4


def max_flip_fraction(info) -> float:
    return MAX_CODE_FLIP_FRACTION * (STOCHASTIC_FLIP_FACTOR if info.stochastic else 1)


def assert_params_agree_but_for_flipped_codes(model_a: nn.Module, model_b: nn.Module, steps: int, flips: float = MAX_CODE_FLIP_FRACTION) -> None:
    """Parameters within fp32 round-off (COMPILED_PARAM_ATOL) but for a fraction below ``flips`` of
    elements, which differ by less than two Adam updates per step."""
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        diff = (a - b).detach().abs()
        assert float((diff > COMPILED_PARAM_ATOL).float().mean()) < flips, name
        assert float(diff.max()) <= 2 * LR * steps, name


@all_formats
def test_compiled_step_matches_eager(info):
    """compile=True and compile=False run the same function: params and quantized states agree except
    where fp32 round-off (FMA contraction) flipped a code at a rounding boundary: a tiny fraction of
    elements, each state by one code step at most, each parameter by less than two updates."""
    models = [make_mlp(), make_mlp()]
    opts = [
        lowbit_optim.AdamW(m.parameters(), lr=LR, state_format=info.spec, compile=compiled, fused=False)
        for m, compiled in zip(models, (True, False))
    ]
    for model, opt in zip(models, opts):
        train(model, opt, 3)

    compiled_states, eager_states = (moments(o, m) for o, m in zip(opts, models))
    assert compiled_states.keys() == eager_states.keys()
    redrawn = sum(redrawn_fraction(state, eager_states[key]) for key, state in compiled_states.items())
    assert_params_agree_but_for_flipped_codes(*models, steps=3, flips=max_flip_fraction(info) + redrawn)
    for key, state in compiled_states.items():
        other = eager_states[key]
        assert stored_as(state) == stored_as(other) and state.dtype == other.dtype, key
        # a low-rank part's subspace iteration spreads round-off over every residual code: bound only
        if not isinstance(state, LowRankState):
            assert mismatch_fraction(state, other) < max_flip_fraction(info) + redrawn_fraction(state, other), key
        if isinstance(state, OptimState):
            bound = 2 * rounding_bound(info, dense(other), other.signed, other.block_size)
            assert bool(((dense(state) - dense(other)).abs() <= bound).all()), key


# ------------------------------------------------------------------------------------------------
# 3. Same numbers as torchao
# ------------------------------------------------------------------------------------------------

TORCHAO_CLASSES = {"8bit-torchao": "AdamW8bit", "4bit-torchao": "AdamW4bit", "fp8-torchao": "AdamWFp8"}


STEP_KINDS = {"eager": dict(compile=False), "compiled": dict(fused=False), "fused": dict(fused=True)}


@pytest.mark.parametrize("step_kind", STEP_KINDS)
@pytest.mark.parametrize("state_format", TORCHAO_CLASSES)
def test_matches_torchao(state_format, step_kind, monkeypatch):
    """After 5 steps, params and states equal torchao's. torchao quantizes only tensors whose numel
    is a multiple of the block size, so the model is bias-free with a 6144-element (quantized) and a
    512-element (fp32 state) weight. torchao runs eagerly (its internal torch.compile patched out:
    compiling it would cost ~25 s of graphs that test nothing of ours). Observed: our eager step is
    bit-identical to it, our compiled step (and the fused CPU kernel, bit-identical to it) within
    3e-8 with identical codes (and bit-identical to compiled torchao)."""
    ao = pytest.importorskip("torchao.optim")
    ours_model, ao_model = make_mlp(8, bias=False), make_mlp(8, bias=False)
    ours = lowbit_optim.AdamW(ours_model.parameters(), lr=LR, state_format=state_format, **STEP_KINDS[step_kind])
    reference = getattr(ao, TORCHAO_CLASSES[state_format])(ao_model.parameters(), lr=LR)
    train(ours_model, ours, 5)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    train(ao_model, reference, 5)

    assert_params_close(ours_model, ao_model, rtol=0, atol=1e-7 if step_kind == "eager" else 1e-6)
    expected = moments(reference, ao_model)
    assert moments(ours, ours_model).keys() == expected.keys()
    for key, state in moments(ours, ours_model).items():
        other = expected[key]
        assert isinstance(state, OptimState) == (type(other) is not torch.Tensor), key  # the same params quantized
        assert mismatch_fraction(state, other, rel=1e-6) == 0, key


@pytest.mark.parametrize("alias", [None, "AdamWFp8"], ids=["4bit-torchao", "AdamWFp8"])
def test_matches_torchao_with_bf16_params(alias, monkeypatch):
    """With bf16 parameters torchao keeps a tensor it does not quantize in the parameter's dtype, and
    so does lowbit_optim where it follows torchao's rule (4bit-torchao, the AdamWFp8 alias): the same
    bits after 5 steps, bf16 states included, eagerly (the alias steps in the kernel, whose fp32
    round-off, within 3e-8 of eager's (test_matches_torchao), can move a bf16 weight by one step)."""
    ao = pytest.importorskip("torchao.optim")
    ours_model, ao_model = make_mlp(8, bias=False, dtype=torch.bfloat16), make_mlp(8, bias=False, dtype=torch.bfloat16)
    if alias is None:
        ours = lowbit_optim.AdamW(ours_model.parameters(), lr=LR, state_format="4bit-torchao", compile=False)
        reference = ao.AdamW4bit(ao_model.parameters(), lr=LR)
    else:
        ours, reference = (getattr(module, alias)(m.parameters(), lr=LR) for module, m in ((lowbit_optim, ours_model), (ao, ao_model)))
    train(ours_model, ours, 5)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    train(ao_model, reference, 5)
    assert_params_close(ours_model, ao_model, rtol=0 if alias is None else 2**-7, atol=0)
    expected = moments(reference, ao_model)
    for key, state in moments(ours, ours_model).items():
        if type(expected[key]) is torch.Tensor:  # the tensor that neither quantizes
            assert stored_as(state) == "bf16", key
            if alias is None:
                assert torch.equal(state, expected[key]), key


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "compiled"])
@pytest.mark.parametrize("state_format", ["8bit-torchao", "fp8-torchao"])
@pytest.mark.parametrize("cls", [lowbit_optim.AdamW, lowbit_optim.AdEMAMix], ids=["AdamW", "AdEMAMix"])
def test_a_second_moment_rounded_to_zero_moves_no_weight(cls, state_format, fused):
    """torchao's rounding (8bit-torchao's, fp8-torchao's; bitsandbytes' too) stores a second moment
    far below its block's largest as 0, while the first moment keeps a value: where a later gradient
    is exactly 0 the update would be m / eps. Where v is 0 there is no update (torch.optim's would be
    0.0067 there). (The other formats store it as their smallest positive code: test_formats.)"""
    grad = torch.ones(256)
    grad[7] = 1e-5  # its square is 1e-10 of the block's largest: rounded to 0
    param = nn.Parameter(torch.zeros(256))
    opt = cls([param], lr=1e-2, weight_decay=0.0, state_format=state_format, min_quantize_numel=0, fused=fused)
    param.grad = grad
    opt.step()
    v = opt.state[param]["exp_avg_sq"].dequantize()
    assert v[7] == 0 and opt.state[param]["exp_avg"].dequantize()[7] != 0, "test setup: v rounds to 0, m does not"
    before = float(param[7])
    param.grad = torch.where(torch.arange(256) == 7, 0.0, 1.0)
    opt.step()
    assert float(param[7]) == before


# ------------------------------------------------------------------------------------------------
# 4. Every format trains
# ------------------------------------------------------------------------------------------------

TRAIN_STEPS = 8


def fp32_reference_run() -> tuple[list[float], nn.Module]:
    model = make_mlp()
    losses = train(model, lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="fp32"), TRAIN_STEPS)
    return losses, model


@all_formats
def test_every_format_trains(info):
    """A few AdamW steps reduce the loss, and the params stay near fp32 AdamW's: observed after 8
    steps, their distance is <= 6% (8-bit formats) or 30% (4bit) of the distance the fp32 params
    travelled, and the loss is within 1% (8-bit) or 19% (4bit) of fp32's."""
    model = make_mlp()
    losses = train(model, lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec), TRAIN_STEPS)
    reference_losses, reference = fp32_reference_run()
    assert losses[-1] < 0.7 * losses[0], losses
    coarse = getattr(info.fmt, "bits", 4) < 8  # 4-bit codes, or factored second moments
    for (name, p), ref, p0 in zip(model.named_parameters(), reference.parameters(), make_mlp().parameters()):
        assert float((p - ref).detach().norm()) <= (0.5 if coarse else 0.15) * float((ref - p0).detach().norm()), name
    assert losses[-1] <= (1.3 if coarse else 1.05) * reference_losses[-1]


# ------------------------------------------------------------------------------------------------
# 5. State memory and which parameters get quantized
# ------------------------------------------------------------------------------------------------


class TestStateBytes(expecttest.TestCase):
    def test_bytes_per_param_of_builtin_formats(self):
        """Bytes of state per parameter element for one 256x1024 weight: two moments, one fp32
        scale per block per moment, and the step counter; a factored second moment is 256 + 1024
        fp32 sums beside a 4bit first moment."""
        rows = []
        for name in BUILTIN_FORMAT_NAMES:
            model = nn.Linear(1024, 256, bias=False)
            model.weight.grad = torch.ones_like(model.weight)
            spec = paired_state_format(name)
            opt = lowbit_optim.AdamW(model.parameters(), state_format=spec, compile=False)
            opt.step()
            rows.append(f"{paired_label(name):>5}: {lowbit_optim.bytes_per_param(opt):.4f}")
        self.assertExpectedInline(
            "\n".join(rows),
            """\
 fp32: 8.0000
 bf16: 4.0000
 8bit: 2.0313
4bit-torchao: 1.0625
  nf4: 1.0625
4bit-precond: 1.0625
4bit-uncalibrated: 1.0625
4bit-calibrated: 1.0625
 4bit: 1.0625
8bit-sr: 2.0313
8bit-torchao: 2.0313
8bit-linear: 2.0313
  fp8: 2.0313
fp8-torchao: 2.0313
4bit+factored: 0.5508
8bit-lowrank: 2.6563
4bit-lowrank: 2.3125
4bit-lowrank-mulaw: 2.3750
bf16-sr: 4.0001
10bit-sr: 2.5313
8bit-log: 2.0313""",
        )


def quantization_probe_params() -> dict[str, nn.Parameter]:
    """Parameters around min_quantize_numel=4096: the decision depends only on numel."""
    shapes = {"bias": (64,), "small": (8, 511), "just_below": (4095,), "at_threshold": (64, 64), "odd_4097": (17, 241), "big": (64, 96)}
    torch.manual_seed(0)
    return {name: nn.Parameter(torch.randn(shape)) for name, shape in shapes.items()}


@pytest.mark.parametrize("min_quantize_numel", [4096, 0])
@quantized_formats
def test_which_params_are_quantized(info, min_quantize_numel):
    """numel < min_quantize_numel: plain fp32 state; otherwise the format's class, whatever the shape
    (4097 elements, not a multiple of any block size, is quantized), except in a format that, as
    torchao's, quantizes whole blocks only (4bit-torchao). min_quantize_numel=0 quantizes everything
    else."""
    params = quantization_probe_params()
    opt = lowbit_optim.AdamW(params.values(), state_format=info.spec, min_quantize_numel=min_quantize_numel, compile=False)
    for p in params.values():
        p.grad = torch.randn_like(p)
    opt.step()
    for name, p in params.items():
        for key in ("exp_avg", "exp_avg_sq"):
            expected = stored_format(info.moment_format(key), p.numel(), min_quantize_numel)
            quantized = expected != "fp32"
            assert opt.state_format_of(p, opt.param_groups[0], key).name == expected, name
            state = opt.state[p][key]
            assert stored_as(state) == expected and state.shape == p.shape, (name, key)
            assert not (quantized and info.blockwise) or state.block_size == info.block_size, (name, key)


# ------------------------------------------------------------------------------------------------
# 6. Checkpoints resume bit-exactly
# ------------------------------------------------------------------------------------------------


def save_and_load(state_dict: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@all_formats
def test_checkpoint_resumes_bit_exactly(info):
    """3 steps, state_dict -> torch.save -> torch.load(weights_only=True) -> a fresh optimizer over a
    copy of the model; 3 more steps in both: identical params and states."""
    # checked first: pickling a class its module does not hold re-imports the module, registering a
    # second class under the format's name for every later test in this process
    assert not info.quantized or importable_by_reference(info.fmt), f"torch.save cannot pickle {info.fmt.__qualname__} by reference"
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec)
    train(model, opt, 3)
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.AdamW(resumed_model.parameters(), lr=LR, state_format=info.spec)
    resumed.load_state_dict(save_and_load(opt.state_dict()))
    train(model, opt, 3)
    train(resumed_model, resumed, 3)

    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    expected = moments(opt, model)
    for key, state in moments(resumed, resumed_model).items():
        other = expected[key]
        assert type(state) is type(other) and state.dtype == other.dtype, key
        assert_same_bits(state, other, key)
    assert [float(s["step"]) for s in resumed.state.values()] == [6.0] * 4


# ------------------------------------------------------------------------------------------------
# 7. Checkpoints of other formats and other optimizers
# ------------------------------------------------------------------------------------------------


def assert_quantized_from(info: FormatInfo, opt, model, reference_states: dict) -> None:
    """Every large parameter's moments are in ``info``'s format, within its rounding bound of the
    reference values (a factored one: the reference's factorization); small ones stay plain fp32
    and exact."""
    for key, state in moments(opt, model).items():
        reference = dense(reference_states[key])
        if isinstance(state, OptimState):
            assert stored_as(state) == info.moment_format(key[1]), key
            bound = rounding_bound(info, reference, state.signed, state.block_size)
            assert bool(((dense(state) - reference).abs() <= bound).all()), key
        elif isinstance(state, StateTensor):
            assert stored_as(state) == info.moment_format(key[1]), key
            torch.testing.assert_close(dense(state), info.fmt.from_float(reference, state.signed).dequantize())
        else:
            assert stored_as(state) == "fp32" and torch.equal(state, reference), key
    assert any(isinstance(s, StateTensor) for s in moments(opt, model).values())


@quantized_formats
def test_torch_adamw_checkpoint_is_quantized_on_load(info):
    """A torch.optim.AdamW checkpoint loads into a quantized-format optimizer, which quantizes it
    and trains on."""
    model = make_mlp()
    torch_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train(model, torch_opt, 3)
    checkpoint = save_and_load(torch_opt.state_dict())
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec, compile=False)
    opt.load_state_dict(checkpoint)
    assert_quantized_from(info, opt, model, moments(torch_opt, model))
    losses = train(model, opt, 2)
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("to", ["4bit", "fp32"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_8bit_checkpoint_converts(to, dtype):
    """A checkpoint of one quantized format loads into an optimizer of another, converted, from
    its fp32 values: an fp16 parameter's second moments lie below fp16's range."""
    model = make_mlp(dtype=dtype)
    opt8 = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", compile=False)
    train(model, opt8, 3)
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=to, compile=False)
    opt.load_state_dict(save_and_load(opt8.state_dict()))
    reference = moments(opt8, model)
    if to == "fp32":
        assert all(torch.equal(dense(state), dense(reference[key])) for key, state in moments(opt, model).items())
    else:
        assert_quantized_from(format_info(to), opt, model, reference)


def as_first_4bit_release(checkpoint: dict) -> dict:
    """A 4bit-torchao checkpoint as the first release wrote its "4bit" ones: OptimState4bit states
    (then torchao's codebooks) without a format_version."""
    # state_dict() shares the optimizer's per-parameter dicts: edit copies
    checkpoint = {"state": {k: dict(v) for k, v in checkpoint["state"].items()}, "param_groups": [dict(g) for g in checkpoint["param_groups"]]}
    for state in checkpoint["state"].values():
        for key, value in state.items():
            if isinstance(value, lowbit_optim.OptimState4bitTorchao):
                old = lowbit_optim.OptimState4bit(value.codes, value.scale, value.shape, value.block_size, value.signed)
                del old.__dict__["format_version"]
                state[key] = old
    for group in checkpoint["param_groups"]:
        group["state_format"] = "4bit"
    return checkpoint


def test_first_release_4bit_checkpoint_keeps_its_numbers():
    """"4bit" meant torchao's codebooks before it became the NF4 recipe (format_version 2). Its old
    checkpoints load as the 4bit-torchao states they are: with state_format="4bit-torchao" training
    resumes bit-exactly; with "4bit" the values are converted, not misread."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="4bit-torchao")
    train(model, opt, 3)
    checkpoint = save_and_load(as_first_4bit_release(opt.state_dict()))

    resumed = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="4bit-torchao")
    resumed.load_state_dict(copy.deepcopy(checkpoint))
    for key, state in moments(resumed, model).items():
        other = moments(opt, model)[key]
        assert type(state) is type(other), key
        assert_same_bits(state, other, key)

    converted = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="4bit")
    converted.load_state_dict(checkpoint)
    assert_quantized_from(format_info("4bit"), converted, model, moments(opt, model))


class TestFormatVersions(expecttest.TestCase):
    def test_unknown_earlier_version_is_refused(self):
        state = lowbit_optim.OptimState8bit.from_float(torch.randn(300))
        state.__dict__["format_version"] = 7
        with self.assertRaises(ValueError) as caught:
            save_and_load({"s": state})
        self.assertExpectedInline(str(caught.exception), """this checkpoint holds a OptimState8bit ('8bit' state format) written when its codes meant other numbers (format version 7, this code's 1); load it with the code that wrote it and save dequantize()d states""")


@quantized_formats
def test_dequantized_checkpoint_loads_into_torch_adamw(info):
    """dequantize_state_dict turns a lowbit checkpoint into one torch.optim.AdamW loads and uses."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec, compile=False)
    train(model, opt, 3)
    plain = lowbit_optim.dequantize_state_dict(opt.state_dict())
    for i, state in plain["state"].items():
        for name, value in state.items():
            assert stored_as(value) == "fp32", (i, name)
    torch_opt = torch.optim.AdamW(model.parameters(), lr=LR)
    torch_opt.load_state_dict(plain)
    for key, state in moments(torch_opt, model).items():
        assert torch.equal(state, dense(moments(opt, model)[key])), key
    before = [p.detach().clone() for p in model.parameters()]
    losses = train(model, torch_opt, 2)
    assert losses[-1] < losses[0]
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(float(s["step"]) == 5 for s in torch_opt.state.values())


class TestCheckpointErrors(expecttest.TestCase):
    def test_foreign_checkpoints_raise(self):
        """A checkpoint of another model or another optimizer is refused with a clear message."""
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", compile=False)
        train(model, opt, 1)
        sgd_model = make_mlp()
        sgd = torch.optim.SGD(sgd_model.parameters(), lr=LR, momentum=0.9)
        train(sgd_model, sgd, 1)
        cases = {
            "other model": (make_mlp(OUT_FEATURES - 1), opt.state_dict()),
            "SGD": (make_mlp(), sgd.state_dict()),
        }
        rows = []
        for name, (target, checkpoint) in cases.items():
            target_opt = lowbit_optim.AdamW(target.parameters(), state_format="8bit", compile=False)
            with self.assertRaises(ValueError) as caught:
                target_opt.load_state_dict(save_and_load(checkpoint))
            rows.append(f"{name}: {caught.exception}")
        self.assertExpectedInline(
            "\n".join(rows),
            """\
other model: checkpoint state 'exp_avg' of parameter 2 has shape (71, 64) but the parameter has shape (70, 64): the checkpoint belongs to another model
SGD: checkpoint state of parameter 0 (shape (64, 96)) lacks ['exp_avg', 'exp_avg_sq', 'step']: it is not a checkpoint of Adam/AdamW""",
        )


# ------------------------------------------------------------------------------------------------
# 8. Hyper-parameter changes and parameter shapes never recompile
# ------------------------------------------------------------------------------------------------


HYPERPARAMETER_CHANGES = {
    "lr": dict(lr=3e-3),
    "lr as a tensor": dict(lr=torch.tensor(2e-3)),
    "betas": dict(betas=(0.8, 0.99)),
    "eps": dict(eps=1e-6),
    "weight_decay": dict(weight_decay=0.0),
}


@all_formats
def test_hyperparameter_changes_do_not_recompile(info):
    """lr / betas / eps / weight_decay enter the graph as tensors: changing them by hand or with a
    scheduler (StepLR; OneCycleLR also cycles betas[0]) compiles nothing new, and takes effect
    (lr=0 leaves the params unchanged)."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec, fused=False)
    train(model, opt, 2)
    graphs = unique_graphs()
    group = opt.param_groups[0]

    for change, values in HYPERPARAMETER_CHANGES.items():
        group.update(values)
        train(model, opt, 1)
        assert unique_graphs() == graphs, f"changing {change} recompiled"

    group.update(lr=0.0, weight_decay=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "lr=0 changed a parameter"

    group.update(lr=LR)
    step_lr = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    one_cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LR, total_steps=10, cycle_momentum=True)
    seen = set()
    for _ in range(4):
        train(model, opt, 1)
        step_lr.step()
        one_cycle.step()
        seen.add((group["lr"], group["betas"]))
    assert len({betas for _, betas in seen}) == 4  # OneCycleLR changed betas[0] at every step
    assert unique_graphs() == graphs, "an lr scheduler recompiled"


class ManyShapes(nn.Module):
    """13 Linear layers side by side on the same 128 inputs, 64..76 outputs (at least the low-rank
    formats' rank): 26 distinct parameter shapes; weights of 8192..9728 elements (quantized: whole
    128-blocks, every other one padded to 256-blocks), biases of 64..76 (fp32 state)."""

    def __init__(self, widths=range(64, 77)):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(128, b) for b in widths)

    def forward(self, x):
        return sum(layer(x).square().mean() for layer in self.layers)


@all_formats
def test_graph_count_does_not_grow_with_distinct_shapes(info):
    """Once the 4-shape MLP has stepped, a model with 26 other shapes (same ranks, same format)
    compiles no new graph."""
    model = make_mlp()
    train(model, lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec, fused=False), 1)
    graphs = unique_graphs()
    many = ManyShapes()
    assert len({p.shape for p in many.parameters()}) >= 25
    opt = lowbit_optim.AdamW(many.parameters(), lr=LR, state_format=info.spec, fused=False)
    x = torch.randn(4, 128)
    for _ in range(2):
        opt.zero_grad()
        many(x).backward()
        opt.step()
    assert unique_graphs() == graphs
    assert {stored_as(s) for s in moments(opt, many).values()} == ({info.name, "fp32"} if info.quantized else {info.name})


class ConvNet(nn.Module):
    """Parameters of rank 1 (first), 2, 3 and 4, in that order."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.proj = nn.Linear(16, 16)
        self.conv1d = nn.Conv1d(4, 4, 3)
        self.conv2d = nn.Conv2d(4, 4, 3)

    def forward(self, x):  # x: (batch, 4, 16)
        h = self.conv1d(self.proj(self.norm(x)))
        return h.sum() + self.conv2d(x.view(-1, 4, 4, 4)).sum()


def isolated_compile(fn, backend):
    """torch.compile of a renamed copy of ``fn``: dynamo keeps compiled graphs and the history that
    decides which dimensions are dynamic per code name and location, so the copy starts afresh
    whatever other tests in this process compiled."""
    return torch.compile(lowbit_optim.base.private_copy(fn, "isolated"), backend=backend, fullgraph=True, dynamic=True)


def test_optimizers_compile_their_own_copy_of_a_public_step_function():
    """The optimizers' graphs are not kept on lowbit_optim.adam_step's code, where a user's own
    torch.compile of it would count them against its recompile_limit (8 by default: after the
    optimizers' 6 formats a user's 8bit and 4bit calls had failed it)."""
    model = make_mlp()
    train(model, lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="fp32", fused=False), 1)
    assert torch._dynamo.eval_frame._debug_get_cache_entry_list(lowbit_optim.adam_step.__code__) == []


def counted_compile(monkeypatch, build):
    """(a counter of graphs, what ``build()`` returns): one of the optimizers' own compiled calls (with
    its configuration, its limits) built under dynamo's eager backend, which counts its graphs."""
    counter, real_compile = CompileCounter(), torch.compile
    with monkeypatch.context() as patched:
        patched.setattr(torch, "compile", lambda fn, **options: real_compile(fn, backend=counter, fullgraph=True, dynamic=True))
        return counter, build()


def test_a_process_may_compile_more_graphs_than_dynamos_accumulated_limit(monkeypatch):
    """Every optimizer, format and flag of a process compiles on one code object: a long notebook or
    sweep reached dynamo's accumulated_recompile_limit (256), after which every new configuration's
    step failed for good (a review's 93rd). The compiled call raises that limit as it raises
    recompile_limit (here the process's is 1, and two configurations step)."""
    counter, compiled = counted_compile(monkeypatch, lambda: lowbit_optim.base._compiled(lowbit_optim.adam_step, lowbit_optim.adam_step))
    monkeypatch.setattr(lowbit_optim.base, "compiled_step", lambda step_function: compiled)
    # config.patch, not monkeypatch: pytest 9.2's undo deletes an attribute missing from the module's
    # __dict__, and a config module's are not there, so the entry was gone for every later test
    with torch._dynamo.config.patch(accumulated_recompile_limit=1):
        for maximize in (False, True):
            p = nn.Parameter(torch.randn(64))
            opt = lowbit_optim.AdamW([p], state_format="fp32", fused=False, maximize=maximize)
            p.grad = torch.randn_like(p)
            opt.step()
        assert counter.frame_count == 2 and torch._dynamo.config.accumulated_recompile_limit == 1


def test_a_step_function_that_is_no_function_gets_a_copy_of_its_own():
    """A step function may be any callable torch.compile takes (a functools.partial, an object with
    __call__): its private copy is a function that calls it, under a code object of its own."""

    class Doubled:
        def __call__(self, x):
            return 2 * x

    for step_function, name in [(functools.partial(torch.mul, 2.0), "mul"), (Doubled(), "Doubled")]:
        copy_fn = lowbit_optim.base.private_copy(step_function, "lowbit_optim")
        assert copy_fn.__code__.co_name == f"{name}__lowbit_optim"
        assert torch.equal(torch.compile(copy_fn, backend="eager", fullgraph=True)(torch.tensor(3.0)), torch.tensor(6.0))
    # and a partial of a step function compiles with that function's inductor options
    assert lowbit_optim.base._inductor_options(functools.partial(lowbit_optim.muon_step, nesterov=False)) == lowbit_optim.muon_step.inductor_options


@pytest.mark.parametrize("state_format, small", [("fp32", 1), ("8bit", 64)], ids=["1-element", "one block"])
def test_foreach_graphs_do_not_depend_on_where_sizes_of_one_fall(monkeypatch, state_format, small):
    """dynamo specializes a size of 1 (a 1-element parameter, the scale of a state of one block): a
    chunk holding one at another place compiled a graph of its own (a review: 16 graphs for 256
    parameters). Such parameters now fill chunks of their own: 2 graphs here, where there had been 5
    (one per chunk), counted with dynamo's eager backend on the optimizers' own compiled call."""
    counter, step_each = counted_compile(monkeypatch, lambda: lowbit_optim.base.compiled_foreach_step.__wrapped__(lowbit_optim.adam_step))
    monkeypatch.setattr(lowbit_optim.base, "compiled_foreach_step", lambda step_function: step_each)
    params = [nn.Parameter(torch.randn(small if i % 17 == 5 else 512)) for i in range(68)]  # at another place in each chunk of 16
    opt = lowbit_optim.AdamW(params, state_format=state_format, min_quantize_numel=0, fused=False, foreach=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert counter.frame_count == 2


def test_graph_count_does_not_grow_with_parameter_rank(monkeypatch):
    """An MLP whose first parameter is 1-D (as when a LayerNorm comes first), then 3-D and 4-D conv
    weights and a (1, N) weight (a Linear(N, 1) head) must add no graphs: the step sees flat,
    detached views, so dynamo has no base tensor of another rank to guard on. Counted with dynamo's
    eager backend on an isolated copy of the step (the guards are dynamo's; no inductor cost)."""
    counter = CompileCounter()
    isolated = isolated_compile(lowbit_optim.adam_step, counter)
    monkeypatch.setattr(lowbit_optim.base, "compiled_step", lambda step_function: isolated)

    def step_all(params):
        opt = lowbit_optim.AdamW(params, state_format="fp32", fused=False)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()

    step_all([nn.Parameter(torch.randn(s)) for s in [(64,), (64, 96)]])
    graphs = counter.frame_count
    step_all(list(ConvNet().parameters()) + [nn.Parameter(torch.randn(1, 64))])
    assert counter.frame_count == graphs


# ------------------------------------------------------------------------------------------------
# 9. torch.optim.Optimizer behaviour
# ------------------------------------------------------------------------------------------------


def test_zero_grad_hooks_and_closure():
    """Step pre/post hooks fire around the closure, whose loss step() returns; zero_grad follows
    torch.optim (set_to_none by default)."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", compile=False)
    calls = []
    opt.register_step_pre_hook(lambda o, args, kwargs: calls.append("pre"))
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append("post"))
    data = regression_data()

    def closure():
        calls.append("closure")
        opt.zero_grad()
        loss = loss_of(model, data)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert calls == ["pre", "closure", "post"]
    assert isinstance(loss, torch.Tensor) and torch.equal(loss, loss_of(make_mlp(), data))

    opt.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert opt.step() is None


def test_params_without_grad_are_skipped():
    """Params whose grad is None (unused, or frozen with requires_grad=False) get no state and stay put."""
    model = make_mlp()
    unused = nn.Parameter(torch.randn(64, 96))
    model[2].weight.requires_grad_(False)
    frozen = model[2].weight
    opt = lowbit_optim.AdamW([*model.parameters(), unused], lr=LR, state_format="4bit", compile=False)
    snapshot = {id(p): p.detach().clone() for p in (unused, frozen)}
    train(model, opt, 2)
    for p in (unused, frozen):
        assert p not in opt.state and torch.equal(p, snapshot[id(p)])
    assert len(opt.state) == 3


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_a_param_group_over_two_devices(compile):
    """A group whose parameters lie on two devices (a model split over two GPUs, as HF's
    device_map="auto" makes it, under one optimizer) steps each with its own device's numbers, as
    torch.optim does: the hyper-parameter tensors were made once, on the first one's device. The
    meta device stands in for the other accelerator (its 0-d tensors mix with the CPU's no more than
    cuda:0's with cuda:1's)."""
    elsewhere = nn.Parameter(torch.zeros(8, device="meta"))
    here, alone = (nn.Parameter(torch.randn(8, generator=torch.Generator().manual_seed(0))) for _ in range(2))
    opts = [lowbit_optim.AdamW(params, lr=LR, fused=False, compile=compile) for params in ([elsewhere, here], [alone])]
    for step in range(2):
        grad = torch.randn(8, generator=torch.Generator().manual_seed(step))
        elsewhere.grad, here.grad, alone.grad = torch.zeros(8, device="meta"), grad.clone(), grad.clone()
        for opt in opts:
            opt.step()
    assert torch.equal(here, alone)


@all_formats
def test_non_contiguous_params_update_in_place(info):
    """A transposed (non-contiguous) parameter steps exactly like its contiguous copy and keeps its
    layout: the step works on a contiguous copy and writes it back."""
    torch.manual_seed(0)
    weight = torch.randn(96, 64)
    transposed, contiguous = nn.Parameter(weight.clone().t()), nn.Parameter(weight.clone().t().contiguous())
    opts = [lowbit_optim.AdamW([p], lr=LR, state_format=info.spec, compile=False) for p in (transposed, contiguous)]
    for _ in range(2):
        grad = torch.randn(64, 96)
        for p, opt in zip((transposed, contiguous), opts):
            p.grad = grad.clone()
            opt.step()
    assert not transposed.is_contiguous() and torch.equal(transposed, contiguous)


def test_add_param_group_with_its_own_format():
    """A group added later takes the defaults for what it does not set, and may set its own format."""
    model, extra = make_mlp(), make_mlp(seed=1)
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", compile=False)
    opt.add_param_group({"params": list(extra.parameters()), "state_format": "4bit", "lr": 1e-3})
    group = opt.param_groups[1]
    assert group["lr"] == 1e-3 and group["betas"] == (0.9, 0.999) and group["weight_decay"] == 1e-2
    for m in (model, extra):
        for p in m.parameters():
            p.grad = torch.randn_like(p)
    opt.step()
    assert stored_as(opt.state[model[0].weight]["exp_avg"]) == "8bit"
    assert stored_as(opt.state[extra[0].weight]["exp_avg"]) == "4bit"
    with pytest.raises(ValueError, match="unknown state format"):
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))], "state_format": "9bit"})


class TiedNet(nn.Module):
    """Embedding (8192 elements), two 64x64 blocks, and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, 64)
        self.blocks = nn.ModuleList([nn.Linear(64, 64) for _ in range(2)])
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return nn.functional.cross_entropy(self.head(h), tokens)


def step_tied(opt, model):
    opt.zero_grad()
    model(torch.arange(32) % 128).backward()
    opt.step()


def state_formats(opt, model) -> dict[str, str]:
    return {name: stored_as(opt.state[p]["exp_avg"]) for name, p in model.named_parameters()}


def test_per_group_state_format():
    """Hand-made groups: the embedding keeps fp32 state, the rest is 4-bit."""
    model = TiedNet()
    embed = [model.embed.weight]
    rest = [p for p in model.parameters() if p is not model.embed.weight]
    opt = lowbit_optim.AdamW([{"params": embed, "state_format": "fp32"}, {"params": rest}], state_format="4bit", compile=False)
    step_tied(opt, model)
    assert state_formats(opt, model) == {
        "embed.weight": "fp32",
        "blocks.0.weight": "4bit",
        "blocks.0.bias": "fp32",  # below min_quantize_numel
        "blocks.1.weight": "4bit",
        "blocks.1.bias": "fp32",
    }


@pytest.mark.parametrize(
    "overrides, expected_groups, expected_states",
    [
        (
            {nn.Embedding: "fp32"},
            [("4bit", 1e-3, ["blocks.0.weight", "blocks.0.bias", "blocks.1.weight", "blocks.1.bias"]), ("fp32", 1e-3, ["embed.weight"])],
            ["fp32", "4bit", "fp32", "4bit", "fp32"],
        ),
        (  # the first matching key wins; the group of unmatched params is dropped when empty
            {"blocks.0": {"state_format": "fp32", "lr": 1e-2}, "blocks.*": "8bit", nn.Embedding: "fp32"},
            [
                ("fp32", 1e-2, ["blocks.0.weight", "blocks.0.bias"]),
                ("8bit", 1e-3, ["blocks.1.weight", "blocks.1.bias"]),
                ("fp32", 1e-3, ["embed.weight"]),
            ],
            ["fp32", "fp32", "fp32", "8bit", "fp32"],
        ),
    ],
    ids=["by-type", "by-name-glob"],
)
def test_param_groups_by_module(overrides, expected_groups, expected_states):
    """Groups by module type or qualified-name glob; the tied head weight is assigned once, to the
    group of the first module holding it (the embedding)."""
    model = TiedNet()
    names = {p: n for n, p in model.named_parameters()}
    opt = lowbit_optim.AdamW(lowbit_optim.param_groups_by_module(model, overrides), lr=1e-3, state_format="4bit", compile=False)
    assert [(g["state_format"], g["lr"], [names[p] for p in g["params"]]) for g in opt.param_groups] == expected_groups
    step_tied(opt, model)
    assert list(state_formats(opt, model).values()) == expected_states


# ------------------------------------------------------------------------------------------------
# 10. torchao-compatible aliases
# ------------------------------------------------------------------------------------------------

ALIASES = {
    "Adam8bit": "8bit",
    "AdamW8bit": "8bit",
    "Adam4bit": "4bit",
    "AdamW4bit": "4bit",
    "AdamFp8": "fp8-torchao",
    "AdamWFp8": "fp8-torchao",
}
TORCHAO_SIGNATURE = [
    ("self", "POSITIONAL_OR_KEYWORD"),
    ("params", "POSITIONAL_OR_KEYWORD"),
    ("lr", "POSITIONAL_OR_KEYWORD"),
    ("betas", "POSITIONAL_OR_KEYWORD"),
    ("eps", "POSITIONAL_OR_KEYWORD"),
    ("weight_decay", "POSITIONAL_OR_KEYWORD"),
    ("amsgrad", "POSITIONAL_OR_KEYWORD"),
    ("block_size", "KEYWORD_ONLY"),
    ("bf16_stochastic_round", "KEYWORD_ONLY"),
]


def signature_of(cls) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name) for p in inspect.signature(cls.__init__).parameters.values()]


@pytest.mark.parametrize("alias", ALIASES)
def test_torchao_aliases(alias, eager_step):
    """Adam8bit ... AdamWFp8 take torchao's arguments (same names and kinds), default weight_decay
    like torchao (1e-2 for AdamW, 0 for Adam), and store their states in their format."""
    cls = getattr(lowbit_optim, alias)
    torchao_names = {name for name, _ in TORCHAO_SIGNATURE}
    assert [p for p in signature_of(cls) if p[0] in torchao_names] == TORCHAO_SIGNATURE  # Adam8bit, AdamW8bit: bitsandbytes' too
    try:
        import torchao.optim
    except ImportError:
        pass
    else:
        assert [p for p in signature_of(cls) if p[0] in torchao_names] == signature_of(getattr(torchao.optim, alias))

    is_adamw = alias.startswith("AdamW")
    assert issubclass(cls, lowbit_optim.AdamW if is_adamw else lowbit_optim.Adam)
    assert cls(make_mlp().parameters()).param_groups[0]["weight_decay"] == (1e-2 if is_adamw else 0)

    model = make_mlp()
    opt = cls(model.parameters(), 1e-3, (0.9, 0.99), 1e-8, 0.0, True, block_size=64, bf16_stochastic_round=False)
    train(model, opt, 1)
    state = opt.state[model[0].weight]
    moments_stored = {k: stored_as(v) for k, v in state.items() if k != "step"}
    assert moments_stored == dict.fromkeys(["exp_avg", "exp_avg_sq", "max_exp_avg_sq"], ALIASES[alias])  # amsgrad=True
    assert state["exp_avg"].block_size == 64
    assert stored_as(opt.state[model[0].bias]["exp_avg"]) == "fp32"


@pytest.mark.parametrize("alias", ["AdamW8bit", "AdamWFp8"])
def test_torchao_aliases_keep_lr_as_a_tensor(alias):
    """As torchao's optimizers, the aliases keep each group's lr as a tensor, which torchao's users
    change with ``param_groups[0]["lr"].fill_()``: that takes effect, as a float lr does; a
    TypeError names the alias."""
    cls = getattr(lowbit_optim, alias)
    runs = []
    for change in ("fill_", "assign", "construct"):
        model = make_mlp()
        opt = cls(model.parameters(), lr=1e-4 if change == "construct" else 1e-2)
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3))]})
        assert all(isinstance(group["lr"], torch.Tensor) for group in opt.param_groups)
        if change == "fill_":
            opt.param_groups[0]["lr"].fill_(1e-4)
        elif change == "assign":
            opt.param_groups[0]["lr"] = 1e-4
        train(model, opt, 2)
        runs.append(list(model.parameters()))
    for params in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], params))
    with pytest.raises(TypeError, match=rf"^{alias}.__init__\(\) got an unexpected keyword argument 'min_size'"):
        cls(make_mlp().parameters(), min_size=16)
    model = make_mlp()
    opt = cls(model.parameters())
    opt.load_state_dict(lowbit_optim.AdamW(model.parameters(), state_format="8bit").state_dict())  # a float lr
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)


# ------------------------------------------------------------------------------------------------
# 11. Bad input
# ------------------------------------------------------------------------------------------------


def sparse_gradient_step(cls=lowbit_optim.AdamW):
    p = nn.Parameter(torch.randn(10))
    opt = cls([p], lr=1e-3, compile=False)
    p.grad = torch.randn(10).to_sparse()
    opt.step()


def edited_between_steps(key, value, cls=lowbit_optim.AdamW, copied=False, **kwargs):
    """A group's setting changed after a step (``copied``: in a deep copy of the optimizer, which
    had stepped as its groups said): a state setting (its states would keep their old format) or
    a number the constructor would refuse."""
    def run():
        p = nn.Parameter(torch.randn(64, 64))
        opt = cls([p], compile=False, **kwargs)
        p.grad = torch.randn(64, 64)
        opt.step()
        if copied:
            opt = copy.deepcopy(opt)
        group = opt.param_groups[0]
        if isinstance(group[key], dict):
            group[key].update(value)  # in place
        else:
            group[key] = value
        opt.step()

    return run


def step_without_step_arguments():
    class NoArguments(lowbit_optim.LowBitOptimizer):
        step_function = staticmethod(lowbit_optim.sgd_step)
        states = ()

        def __init__(self, params, lr=1e-3, **options):
            super().__init__(params, dict(lr=lr), **options)

    p = nn.Parameter(torch.randn(4))
    opt = NoArguments([p])
    p.grad = torch.randn(4)
    opt.step()


def made_after_construction(dtype):
    p = nn.Parameter(torch.randn(8))
    opt = lowbit_optim.AdamW([p])
    p.data = p.data.to(dtype)
    p.grad = torch.randn(8).to(dtype)
    opt.step()


def made_float64_after_construction():
    made_after_construction(torch.float64)


def made_float8_after_construction():
    made_after_construction(torch.float8_e4m3fn)


def changed_after_a_step(change, kwargs: dict | None = None, groups: int = 1, device: str = "cpu") -> list[nn.Parameter]:
    """Parameters of shape (20, 15) in groups of their own (the last on ``device``), stepped once, the
    last changed by ``change`` and stepped again (what the step refuses); returns them."""
    params = [nn.Parameter(torch.randn(20, 15, device="cpu" if i < groups - 1 else device)) for i in range(groups)]
    opt = lowbit_optim.AdamW([{"params": [p]} for p in params], **(kwargs or {}))
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    change(params[-1])
    params[-1].grad = torch.randn_like(params[-1])
    before = [p.detach().clone() for p in params]
    try:
        opt.step()
    finally:  # refused before any group stepped
        assert all(float(opt.state[p]["step"]) == 1 and torch.equal(p, b) for p, b in zip(params[:-1], before))
    return params


def transposed_after_a_step(kwargs: dict | None = None, groups: int = 1) -> list[nn.Parameter]:
    return changed_after_a_step(lambda p: setattr(p, "data", p.data.t().contiguous()), kwargs, groups)


def materialized_after_a_meta_step(kwargs: dict | None = None, groups: int = 1) -> list[nn.Parameter]:
    """As to_empty materializes a model in place (with swapped tensors, as FSDP2's are): its states
    stay on the meta device."""
    return changed_after_a_step(lambda p: torch.utils.swap_tensors(p, nn.Parameter(torch.randn(20, 15))), kwargs, groups, "meta")


STEP_PATHS = [dict(), dict(fused=False), dict(compile=False), dict(state_format="8bit", min_quantize_numel=0), dict(state_format="8bit", min_quantize_numel=0, fused=False)]


@pytest.mark.parametrize("kwargs", STEP_PATHS, ids=str)
def test_a_state_replaced_by_one_of_another_shape_is_refused(kwargs):
    """Any state, not only a parameter's first: a second moment replaced by hand with a flat one
    stepped silently (or failed in dynamo's words), and its checkpoint was refused at load. A key
    the optimizer does not keep is the user's, and is not checked."""
    p = nn.Parameter(torch.randn(20, 15))
    opt = lowbit_optim.AdamW([p], **kwargs)
    p.grad = torch.randn_like(p)
    opt.step()
    opt.state[p]["update_count"] = torch.tensor(1.0)  # a key of the user's: ignored, as torch.optim ignores it
    opt.step()
    opt.state[p]["exp_avg_sq"] = torch.zeros(300)
    with pytest.raises(ValueError, match=r"a parameter of shape \(20, 15\) has a 'exp_avg_sq' state of shape \(300,\)"):
        opt.step()


def test_a_key_of_the_users_steps_and_survives_a_checkpoint():
    """A key the optimizer does not keep is its user's (timm's Lookahead keeps its slow weights in the
    optimizer's state): it steps, and a checkpoint with it loads and resumes, as under torch.optim
    (its load had called it another optimizer's checkpoint, and a number there failed the step). A
    key of another optimizer's states still says so (test_optimizers' table)."""
    runs = []
    for resumed in (False, True):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(20, 15))
        opt = lowbit_optim.AdamW([p], state_format="8bit", min_quantize_numel=0)
        p.grad = torch.randn_like(p)
        opt.step()
        opt.state[p]["lookahead_slow_buff"] = p.detach().clone()
        opt.state[p]["count"] = 3
        if resumed:
            saved = save_and_load(opt.state_dict())
            opt = lowbit_optim.AdamW([p], state_format="8bit", min_quantize_numel=0)
            opt.load_state_dict(saved)
        p.grad = torch.randn_like(p)
        opt.step()
        runs.append((p.detach().clone(), opt.state[p]["lookahead_slow_buff"], opt.state[p]["count"]))
    (a, slow_a, count_a), (b, slow_b, count_b) = runs
    assert torch.equal(a, b) and torch.equal(slow_a, slow_b) and count_a == count_b == 3


@pytest.mark.parametrize("kwargs", STEP_PATHS, ids=str)
def test_deleting_a_frozen_parameters_states_frees_them(kwargs):
    """del opt.state[p] (a layer frozen for good) gives its states' memory back, as under torch.optim:
    the kernel's cached verdict on them had held them until the optimizer died (a review: 128 MiB)."""
    import gc
    import weakref

    head, body = nn.Parameter(torch.randn(64)), nn.Parameter(torch.randn(20, 15))
    opt = lowbit_optim.AdamW([head, body], **kwargs)
    for _ in range(2):
        head.grad, body.grad = torch.randn_like(head), torch.randn_like(body)
        opt.step()
    states = [weakref.ref(t) for t in opt.state[body].values()]
    body.grad = None
    del opt.state[body]
    head.grad = torch.randn_like(head)
    opt.step()
    gc.collect()
    assert [r() for r in states] == [None] * len(states)


@pytest.mark.parametrize("kwargs", STEP_PATHS, ids=str)
def test_a_parameter_reshaped_after_its_states_were_made_is_refused_before_any_step(kwargs):
    """p.data given another shape of as many elements (a weight transposed between layouts): its
    states belong to other elements. Every path refuses it, before any group steps (it was stepped
    with misplaced moments, or refused after the groups before it had stepped)."""
    with pytest.raises(ValueError, match=r"a parameter of shape \(15, 20\) has a 'exp_avg' state of shape \(20, 15\)"):
        transposed_after_a_step(kwargs, groups=2)  # (which checks that no group stepped)


@pytest.mark.parametrize("kwargs", STEP_PATHS, ids=str)
def test_a_parameter_materialized_after_a_meta_step_is_refused_before_any_step(kwargs):
    """Each path refused meta states in words of its own (the kernel's "nothing was stepped", dynamo's
    fake tensors, eager's device mismatch), after the groups before it had stepped."""
    with pytest.raises(ValueError, match=r"a parameter on cpu has its 'exp_avg' state on meta: a step or a load_state_dict while the model was on the meta device"):
        materialized_after_a_meta_step(kwargs, groups=2)


def fp16_parameter_fused():
    p = nn.Parameter(torch.randn(8, dtype=torch.float16))
    p.grad = torch.randn_like(p)
    lowbit_optim.AdamW([p], fused=True).step()


def with_one_param(**kwargs):
    return lambda: lowbit_optim.AdamW([nn.Parameter(torch.randn(8))], **kwargs)


BAD_INPUT = {
    "sparse gradient": sparse_gradient_step,
    "sparse gradient, SGD": lambda: sparse_gradient_step(lowbit_optim.SGD),
    "sparse gradient, Lion": lambda: sparse_gradient_step(lowbit_optim.Lion),
    "complex parameter": lambda: lowbit_optim.AdamW([nn.Parameter(torch.randn(4, dtype=torch.complex64))]),
    "integer parameter": lambda: lowbit_optim.AdamW([torch.zeros(4, dtype=torch.int64)]),
    "lr=-1": with_one_param(lr=-1),
    "betas=(1.0, 0.9)": with_one_param(betas=(1.0, 0.9)),
    "betas=(0.9, 0.99999999)": with_one_param(betas=(0.9, 0.99999999)),
    "eps=-1": with_one_param(eps=-1),
    "weight_decay=-1": with_one_param(weight_decay=-1),
    "weight_decay=10**400": with_one_param(weight_decay=10**400),
    'state_format="9bit"': with_one_param(state_format="9bit"),
    "state_format=None": with_one_param(state_format=None),
    "state_format edited between steps": edited_between_steps("state_format", "4bit", state_format="8bit"),
    "a state's format edited in place": edited_between_steps("state_format", {"exp_avg": "fp8"}, state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"}),
    "min_quantize_numel edited between steps": edited_between_steps("min_quantize_numel", 10**6),
    "state_format edited in a copy": edited_between_steps("state_format", "4bit", state_format="8bit", copied=True),
    "betas edited between steps": edited_between_steps("betas", (0.9, 0.99999999)),
    "lr edited between steps": edited_between_steps("lr", -1e-3),
    "Muon's ns_steps edited between steps": edited_between_steps("ns_steps", 150, cls=lowbit_optim.Muon),
    "betas edited past a format's slowest average": edited_between_steps("betas", (0.97, 0.999), state_format="4bit-lowrank-mulaw"),
    "block_size=100": with_one_param(state_format="8bit", block_size=100),
    "block_size=0": with_one_param(state_format="8bit", block_size=0),
    "block_size with fp32 states": with_one_param(state_format="fp32", block_size=64),
    "block_size=2**40": with_one_param(state_format="8bit", block_size=2**40),  # (a typo: 4 TB at the first step)
    "fused=True, block_size=2**14": lambda: lowbit_optim.AdamW([nn.Parameter(torch.randn(64, 64))], state_format="8bit", block_size=2**14, fused=True),
    "betas=(0.9,)": with_one_param(betas=(0.9,)),
    "float64 parameter": lambda: lowbit_optim.AdamW([nn.Parameter(torch.randn(4, dtype=torch.float64))]),
    "float8 parameter": lambda: lowbit_optim.AdamW([nn.Parameter(torch.randn(4).to(torch.float8_e4m3fn))]),
    "a parameter made float8 through .data": made_float8_after_construction,
    "a parameter materialized after a meta step": materialized_after_a_meta_step,
    "a parameter made float64 through .data": made_float64_after_construction,
    "a parameter transposed through .data after a step": transposed_after_a_step,
    "fused=True, an fp16 parameter": fp16_parameter_fused,
    "negated-view parameter": lambda: lowbit_optim.AdamW([nn.Parameter(torch.randn(4)._neg_view())]),
    "compensation_format='factored'": with_one_param(param_update="kahan", compensation_format="factored"),
    "an optimizer without _step_arguments": step_without_step_arguments,
    "a parameter listed twice": lambda: lowbit_optim.AdamW([weight := nn.Parameter(torch.randn(4)), weight]),
    "capturable=True": with_one_param(capturable=True),
    "differentiable=True": with_one_param(differentiable=True),
    "foreach='yes'": with_one_param(foreach="yes"),
    "fused=True, foreach=True": with_one_param(fused=True, foreach=True),
    "betas=('0.9', 0.999)": with_one_param(betas=("0.9", 0.999)),
    "compile='False'": with_one_param(compile="False"),  # (a str is true: it compiled, and None did not)
    "compile=None": with_one_param(compile=None),
    "bf16_stochastic_round='False'": with_one_param(bf16_stochastic_round="False"),
    "a group's bf16_stochastic_round='False'": lambda: lowbit_optim.AdamW([{"params": [nn.Parameter(torch.randn(8))], "bf16_stochastic_round": "False"}]),
    "AnyPrecisionAdamW(use_kahan_summation='False')": lambda: lowbit_optim.AnyPrecisionAdamW([nn.Parameter(torch.randn(8))], use_kahan_summation="False"),
    "AdamW8bit(block_wise='False')": lambda: lowbit_optim.AdamW8bit([nn.Parameter(torch.randn(8))], block_wise="False"),
    "AdamW8bit(min_8bit_size=-1)": lambda: lowbit_optim.AdamW8bit([nn.Parameter(torch.randn(8))], min_8bit_size=-1),
    "add_param_group given a list": lambda: with_one_param()().add_param_group([nn.Parameter(torch.randn(8))]),
    "AnyPrecisionAdamW.add_param_group given a list": lambda: lowbit_optim.AnyPrecisionAdamW([nn.Parameter(torch.randn(8))]).add_param_group([nn.Parameter(torch.randn(8))]),
    "AdamW(decoupled_weight_decay=False)": with_one_param(decoupled_weight_decay=False),
    "a model's state dict": lambda: with_one_param()().load_state_dict(nn.Linear(2, 2).state_dict()),
    "param_groups_by_module given parameters": lambda: lowbit_optim.param_groups_by_module(nn.Linear(2, 2).parameters(), {nn.Linear: "fp32"}),
    "param_groups_by_module given a list": lambda: lowbit_optim.param_groups_by_module(nn.Linear(2, 2), [nn.Linear]),
    "bytes_per_param given a name": lambda: lowbit_optim.bytes_per_param("8bit"),
    "dequantize_state_dict(None)": lambda: lowbit_optim.dequantize_state_dict(None),
    "register_format given a name": lambda: lowbit_optim.register_format("8bit"),
}


def test_a_beta_that_float32_holds_far_off_warns():
    """The bias correction is computed in fp32 from the fp32 beta (torchao's and bitsandbytes'
    arithmetic): where fp32 moves 1 - beta by over 1 %, the first ~1/(1 - beta) steps are off
    torch.optim's by the figure the warning gives (a review measured 9.2 % for beta2 = 0.9999999,
    50 % for beta1 = 0.99999997); closer betas (the defaults, 0.99999) step on without a word."""
    with pytest.warns(UserWarning, match=r"beta2=0.9999999 is 0.99999988\d* in float32, .* 1 - beta is \+19.2% off there, so for the first ~1e\+07 steps a step is up to 9.2% larger than torch.optim's"):
        lowbit_optim.AdamW([nn.Parameter(torch.zeros(4))], betas=(0.9, 0.9999999))
    with pytest.warns(UserWarning, match=r"beta1=0.99999997 .* up to 49.7% smaller than torch.optim's"):
        lowbit_optim.AdEMAMix([nn.Parameter(torch.zeros(4))], betas=(0.99999997, 0.999, 0.9999))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for betas in ((0.9, 0.999), (0.9, 0.99999), (0.0, 0.0)):
            lowbit_optim.AdamW([nn.Parameter(torch.zeros(4))], betas=betas)
        lowbit_optim.Lion([nn.Parameter(torch.zeros(4))], betas=(0.9, 0.9999999))  # (Lion's enter as 1 - beta, from float64)


def test_a_saved_state_of_blocks_beyond_the_largest_choice_loads_converted(monkeypatch):
    """block_size above 2**16 is refused as a choice (a typo), but a state an earlier release saved
    with one is its own: a load converts it to the optimizer's block size, not "corrupt"."""
    p = nn.Parameter(torch.randn(2**17))
    with monkeypatch.context() as earlier:  # what an earlier release took
        earlier.setattr(lowbit_optim.state, "MAX_BLOCK_SIZE", 2**20)
        opt = lowbit_optim.AdamW([p], state_format="8bit", block_size=2**17)
        p.grad = torch.randn_like(p)
        opt.step()
    saved = save_and_load(opt.state_dict())
    assert saved["state"][0]["exp_avg"].block_size == 2**17
    fresh = lowbit_optim.AdamW([p], state_format="8bit")
    fresh.load_state_dict(saved)
    state = fresh.state[p]["exp_avg"]
    assert state.block_size == 256
    expected = lowbit_optim.formats.get_format("8bit").from_float(saved["state"][0]["exp_avg"].dequantize(torch.float32), True, 256)
    assert torch.equal(state.dequantize(), expected.dequantize())


def test_fused_true_refuses_a_long_block_size_only_where_a_state_would_have_blocks(monkeypatch):
    """Blocks longer than the kernel's chunks are refused when built with fused=True, but only where
    a parameter is large enough to be quantized (smaller ones keep fp32 states, which the kernel
    steps); without a kernel, its own reason is given at the step, not a block size's."""
    params = [nn.Parameter(torch.randn(1024)), nn.Parameter(torch.randn(64))]
    opt = lowbit_optim.AdamW(params, state_format="8bit", block_size=2**14, fused=True)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    assert all(type(opt.state[p]["exp_avg"]) is torch.Tensor for p in params)
    monkeypatch.setattr(lowbit_optim.kernel_abi, "load", lambda: (None, "no C compiler found (set CC)"))
    lowbit_optim.AdamW([nn.Parameter(torch.randn(64, 64, device="meta"))], state_format="8bit", block_size=256, fused=True)


def test_betas_without_a_bias_correction_may_round_to_one_in_fp32():
    """Only the betas of a bias correction, computed in fp32, must be below 1.0 there (Adam's, AdEMAMix's
    first two): Lion's and AdEMAMix's beta3, whose 1 - beta the step takes from float64, step on."""
    for make in (lambda ps: lowbit_optim.Lion(ps, betas=(0.99999999, 0.99999999)), lambda ps: lowbit_optim.AdEMAMix(ps, betas=(0.9, 0.999, 0.99999999))):
        p = nn.Parameter(torch.zeros(4))
        opt = make([p])
        p.grad = torch.ones(4)
        opt.step()
        assert bool(p.isfinite().all()) and not torch.equal(p, torch.zeros(4))


class TestBadInput(expecttest.TestCase):
    def test_messages(self):
        """Each bad input raises a clear error (the list of registered formats is elided, so that a
        newly registered format does not change the table)."""
        rows = []
        for name, make in BAD_INPUT.items():
            with self.assertRaises((ValueError, TypeError, RuntimeError)) as caught:
                make()
            message = str(caught.exception).replace(str(sorted(registered_formats())), "[<registered formats>]")
            rows.append(f"{name}: {type(caught.exception).__name__}: {message}")
        self.assertExpectedInline(
            "\n".join(rows),
            """\
sparse gradient: RuntimeError: AdamW does not support sparse gradients (its states are dense): use torch.optim.SparseAdam for those parameters, or make the gradients dense (e.g. nn.Embedding(..., sparse=False))
sparse gradient, SGD: RuntimeError: SGD does not support sparse gradients (its states are dense): use torch.optim.SGD for those parameters, or make the gradients dense (e.g. nn.Embedding(..., sparse=False))
sparse gradient, Lion: RuntimeError: Lion does not support sparse gradients (its states are dense): make the gradients dense (e.g. nn.Embedding(..., sparse=False))
complex parameter: TypeError: lowbit_optim does not support complex parameters; hold the weight as a real one, nn.Parameter(torch.view_as_real(w).clone()), and use torch.view_as_complex(p) in the forward, or use torch.optim.AdamW
integer parameter: TypeError: parameters must be floating point, got torch.int64
lr=-1: ValueError: invalid learning rate -1: lr must be a number >= 0
betas=(1.0, 0.9): ValueError: invalid betas (1.0, 0.9): each beta must be in [0, 1)
betas=(0.9, 0.99999999): ValueError: invalid betas (0.9, 0.99999999): 0.99999999 is 1.0 in float32, in which the step computes its bias correction 1 - beta**step (0); it must be below 0.9999999701976776 (1 - 2**-25)
eps=-1: ValueError: invalid eps -1: eps must be >= 0
weight_decay=-1: ValueError: invalid weight_decay -1: weight_decay must be >= 0
weight_decay=10**400: ValueError: invalid weight_decay: an integer of 1329 bits, beyond the range of a float (about 1.8e+308) in which the step computes
state_format="9bit": ValueError: unknown state format '9bit'; use one of [<registered formats>] or an OptimState subclass that sets a `name`
state_format=None: ValueError: unknown state format None; use one of [<registered formats>] or an OptimState subclass that sets a `name`
state_format edited between steps: ValueError: param group 0's state_format from '8bit' to '4bit': a group's state settings are fixed when it is built. To convert its states, build a new optimizer with the new setting and load this one's state_dict() into it (a load converts every state)
a state's format edited in place: ValueError: param group 0's state_format from {'exp_avg': '8bit', 'exp_avg_sq': '4bit'} to {'exp_avg': 'fp8', 'exp_avg_sq': '4bit'}: a group's state settings are fixed when it is built. To convert its states, build a new optimizer with the new setting and load this one's state_dict() into it (a load converts every state)
min_quantize_numel edited between steps: ValueError: param group 0's min_quantize_numel from 4096 to 1000000: a group's state settings are fixed when it is built. To convert its states, build a new optimizer with the new setting and load this one's state_dict() into it (a load converts every state)
state_format edited in a copy: ValueError: param group 0's state_format from '8bit' to '4bit': a group's state settings are fixed when it is built. To convert its states, build a new optimizer with the new setting and load this one's state_dict() into it (a load converts every state)
betas edited between steps: ValueError: param group 0, as edited since it was built: invalid betas (0.9, 0.99999999): 0.99999999 is 1.0 in float32, in which the step computes its bias correction 1 - beta**step (0); it must be below 0.9999999701976776 (1 - 2**-25)
lr edited between steps: ValueError: param group 0, as edited since it was built: invalid learning rate -0.001: lr must be a number >= 0
Muon's ns_steps edited between steps: ValueError: param group 0, as edited since it was built: invalid ns_steps 150: an int in [0, 100), e.g. 5
betas edited past a format's slowest average: StateFormatError: param group 0, as edited since it was built: the '4bit-lowrank-mulaw' state format cannot hold Adam/AdamW's exp_avg, an average that keeps 0.97 of itself per step: its rounding noise is drawn afresh at every write, and an average that keeps more than 0.95 per step gathers that noise faster than it lets it decay, growing without bound (README, "Low-rank states and slow averages"). Use a format without that limit for it, e.g. state_format={'exp_avg': '10bit-sr', 'exp_avg_sq': '4bit-lowrank-mulaw'}
block_size=100: ValueError: block_size must be a positive power of two (e.g. 128 or 256), got 100
block_size=0: ValueError: block_size must be a positive power of two (e.g. 128 or 256), got 0
block_size with fp32 states: ValueError: block_size=64 applies to blockwise state formats (8bit, 4bit, fp8, ...), but state_format 'fp32' has no blocks: drop block_size or pick a blockwise format
block_size=2**40: ValueError: block_size 1099511627776 is beyond the largest, 65536: a block holds one scale, so larger blocks save no memory, and each state is padded to whole blocks. Use e.g. 256
fused=True, block_size=2**14: RuntimeError: fused=True, but the fused CPU kernel cannot step block_size 16384 (at most 8192). Pass a smaller block_size, or fused=None to step such states with the compiled step
betas=(0.9,): ValueError: invalid betas (0.9,): Adam takes two, (beta1, beta2), e.g. (0.9, 0.999); 1 given
float64 parameter: TypeError: float64 parameters are not supported: lowbit_optim computes the step in float32 and would round them. Convert the model to float32 (model.float()) or use torch.optim.AdamW for float64
float8 parameter: TypeError: torch.float8_e4m3fn parameters are not supported: lowbit_optim steps fp32, bf16 and fp16 parameters. Keep the weights in one of those and cast them in the forward (as float8 training does)
a parameter made float8 through .data: TypeError: torch.float8_e4m3fn parameters are not supported: lowbit_optim steps fp32, bf16 and fp16 parameters. Keep the weights in one of those and cast them in the forward (as float8 training does)
a parameter materialized after a meta step: ValueError: a parameter on cpu has its 'exp_avg' state on meta: a step or a load_state_dict while the model was on the meta device, before to_empty: meta states hold no values. Delete its states (del opt.state[p]) to start them afresh, or load the checkpoint after the model is materialized
a parameter made float64 through .data: TypeError: float64 parameters are not supported: lowbit_optim computes the step in float32 and would round them. Convert the model to float32 (model.float()) or use torch.optim.AdamW for float64
a parameter transposed through .data after a step: ValueError: a parameter of shape (15, 20) has a 'exp_avg' state of shape (20, 15): the parameter's shape (through .data) or the state was changed after its states were made. Delete its states (del opt.state[p]) to start them afresh, or give the parameter back its shape
fused=True, an fp16 parameter: RuntimeError: fused=True, but the fused CPU kernel cannot step a parameter of shape (8,): parameter dtype torch.float16 (it takes float32 and bfloat16). Pass fused=None to step such parameters with the compiled step.
negated-view parameter: TypeError: a parameter that is a lazily negated view (torch's neg bit) cannot be stepped in place: make it nn.Parameter(t.resolve_neg())
compensation_format='factored': ValueError: compensation_format 'factored' holds nonnegative values only, and Kahan's compensation (the rounding error of each bf16 weight) is signed: use a signed format, e.g. 'bf16-sr' (2 bytes), '8bit-log' (1) or 'fp32'
an optimizer without _step_arguments: NotImplementedError: NoArguments defines no _step_arguments(group): return (numbers, flags), the numbers its step_function takes after the states and a dict of the keywords that pick its graph, e.g. return (group['lr'], group['eps']), dict(maximize=group['maximize'])
a parameter listed twice: ValueError: a param group lists a parameter more than once: list each once (model.parameters() does)
capturable=True: ValueError: capturable=True (CUDA-graph capture of the step) is not supported: lowbit_optim keeps the step counter on the CPU. Pass capturable=False
differentiable=True: ValueError: differentiable=True is not supported: quantized states cannot carry gradients through the step. Pass differentiable=False, or use torch.optim for a differentiable optimizer
foreach='yes': ValueError: foreach must be None, True or False, got 'yes'
fused=True, foreach=True: ValueError: fused=True and foreach=True cannot be given together: fused=True picks the fused CPU kernel, foreach=True the compiled step over chunks
betas=('0.9', 0.999): ValueError: invalid betas ('0.9', 0.999): each beta must be a number (or a one-element tensor)
compile='False': ValueError: compile must be True or False (or 1 or 0), got 'False'
compile=None: ValueError: compile must be True or False (or 1 or 0), got None
bf16_stochastic_round='False': ValueError: bf16_stochastic_round must be True or False (or 1 or 0), got 'False'
a group's bf16_stochastic_round='False': ValueError: bf16_stochastic_round must be True or False (or 1 or 0), got 'False'
AnyPrecisionAdamW(use_kahan_summation='False'): ValueError: use_kahan_summation must be True or False (or 1 or 0), got 'False'
AdamW8bit(block_wise='False'): ValueError: block_wise must be True or False (or 1 or 0), got 'False'
AdamW8bit(min_8bit_size=-1): ValueError: invalid min_8bit_size -1: use an int >= 0
add_param_group given a list: TypeError: param_group must be a dict such as {'params': [...], 'lr': 1e-3}, got list
AnyPrecisionAdamW.add_param_group given a list: TypeError: param_group must be a dict such as {'params': [...], 'lr': 1e-3}, got list
AdamW(decoupled_weight_decay=False): ValueError: AdamW always decouples weight decay; use lowbit_optim.Adam for L2 regularization
a model's state dict: ValueError: not an optimizer state dict: it needs the keys 'state' and 'param_groups', got ['bias', 'weight']. Pass what optimizer.state_dict() returned (not model.state_dict())
param_groups_by_module given parameters: TypeError: model must be the nn.Module whose modules decide the groups, got generator: pass the model, not model.parameters()
param_groups_by_module given a list: TypeError: overrides must map module types or name patterns to group options (e.g. {nn.Embedding: 'fp32'}), got list
bytes_per_param given a name: TypeError: bytes_per_param measures an optimizer's states: pass the optimizer, got str
dequantize_state_dict(None): TypeError: dequantize_state_dict takes what optimizer.state_dict() returned, got NoneType
register_format given a name: TypeError: register_format takes a format (a StateTensor subclass that sets a `name`, or a PlainFormat), got '8bit'""",
        )


# ------------------------------------------------------------------------------------------------
# 12. amsgrad
# ------------------------------------------------------------------------------------------------


def test_amsgrad_with_a_factored_second_moment_is_refused_when_switched_on_or_loaded():
    """A factored exp_avg_sq cannot hold amsgrad's maximum (test below): refused too where amsgrad
    comes on after the group was built, at the next step (before it steps), and where a checkpoint's
    group sets it (one saved before the refusal), naming the way out."""
    spec = {"exp_avg": "8bit", "exp_avg_sq": "factored"}
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=spec)
    train(model, opt, 1)
    checkpoint = save_and_load(opt.state_dict())
    opt.param_groups[0]["amsgrad"] = True
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(StateFormatError, match=r"param group 0, as edited since it was built: the 'factored' state format keeps no element's value"):
        train(model, opt, 1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    checkpoint["param_groups"][0]["amsgrad"] = True
    with pytest.raises(StateFormatError, match=r"param group 0 of this checkpoint: .*a checkpoint's param groups set their own amsgrad"):
        lowbit_optim.AdamW(make_mlp().parameters(), lr=LR, state_format=spec).load_state_dict(checkpoint)


@quantized_formats
def test_amsgrad_state_is_quantized_and_dominates(info):
    """max_exp_avg_sq is stored in the format and never below exp_avg_sq beyond the quantization
    error of both (each within its rounding bound; max's block absmax bounds v's). fp32 amsgrad
    equals torch.optim.AdamW(amsgrad=True): see test_fp32_state_matches_torch_optim. A format that
    keeps no element's value (factored's sums) is refused: the maximum spread over its rows and
    columns shrank where it was largest (a review: 10 to 7 at one element over 200 steps)."""
    model = make_mlp()
    if not get_format(info.moment_format("exp_avg_sq")).holds_elements:
        with pytest.raises(StateFormatError, match=r"keeps no element's value of its own, and Adam/AdamW's max_exp_avg_sq is a running maximum"):
            lowbit_optim.AdamW(model.parameters(), lr=LR, amsgrad=True, state_format=info.spec)
        return
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, amsgrad=True, state_format=info.spec)
    losses = train(model, opt, 5)
    assert losses[-1] < losses[0]
    for p in model.parameters():
        state = opt.state[p]
        v, v_max = state["exp_avg_sq"], state["max_exp_avg_sq"]
        assert stored_as(v_max) == stored_as(v) == (info.moment_format("exp_avg_sq") if isinstance(v, StateTensor) else "fp32")
        if not isinstance(v, StateTensor):
            assert bool((v_max >= v).all())
            continue
        if isinstance(v, StochasticBF16State):  # each within one bf16 spacing (2**-7 of itself) of its value
            assert bool((dense(v_max) >= dense(v) - 2**-6 * dense(v_max) * (1 + 1e-3)).all())
            continue
        assert not v_max.signed
        slack = 2 * rounding_bound(info, dense(v_max), False, v_max.block_size)
        assert bool((dense(v_max) >= dense(v) - slack).all())


# ------------------------------------------------------------------------------------------------
# 13. bf16 parameters
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stochastic_round", [False, True], ids=["nearest", "stochastic"])
@all_formats
def test_bf16_params_train(info, stochastic_round):
    """A bf16 model trains with every format, with and without bf16 stochastic rounding (its
    statistics are tested elsewhere); quantized states take the param's dtype as appearance.
    Stochastic rounding runs compiled (its graph holds everything the nearest-rounding one does,
    plus the random bits) for each format derived from no other registered one; nearest rounding,
    and a derived format (its parent's graph with another codebook or rounding: nf4, 8bit-sr, 4bit,
    whose compiled stochastic graph test_precision trains), run eagerly, sparing ~5-14 s graphs."""
    model = make_mlp(bias=False, dtype=torch.bfloat16)
    compiled = stochastic_round and not info.derived
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec, bf16_stochastic_round=stochastic_round, compile=compiled)
    losses = train(model, opt, TRAIN_STEPS)
    assert losses[-1] < 0.7 * losses[0], losses
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and bool(p.isfinite().all())
        state = opt.state[p]["exp_avg_sq"]
        stored = stored_format(info.moment_format("exp_avg_sq"), p.numel(), dtype=p.dtype)
        assert stored_as(state) == stored
        assert state.dtype == (torch.bfloat16 if isinstance(state, StateTensor) else get_format(stored).dtype)
