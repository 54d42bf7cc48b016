"""Every optimizer declared on LowBitOptimizer (SGD, Lion, AdEMAMix, the example RMSprop, ...) with every
registered format, parametrized over the registries (test/optimizer_info.py, test/conftest.py), so that
a new optimizer or format inherits these tests.

1. fp32 state computes the optimizer's numbers: torch.optim's class of the same name (SGD, AdamW,
   RMSprop) or a float64 reference (Lion, AdEMAMix), for every option set its info lists, and
   bitsandbytes' 32-bit version where it has one;
2. the matrix (optimizer x format): it trains, keeps each state in its format, resumes bit-exactly
   from a checkpoint, state_dict round-trips, copies step like the original, the compiled step
   matches the eager one and hyper-parameter changes never recompile;
3. per optimizer: ``opt.step()`` inside the user's torch.compile, bf16 weights with every
   ``param_update`` mode, ``fused``;
4. SGD without momentum keeps no state; torch.optim.SGD checkpoints load; the constructors take
   torch.optim's arguments; bitsandbytes' aliases; bad input;
5. declaring an optimizer: the example is picked up, a State's initial value.

Cost: the compiled tests share graphs (one test per matrix cell compiles, checks against eager and
then changes hyper-parameters); everything structural runs the step eagerly (``compile=False``).
"""

import ast
import copy
import functools
import inspect
import re
import warnings

import expecttest
import pytest
import torch
from conftest import CUSTOM_OPTIMIZER_EXAMPLE, FORMATS, format_info, stored_format
from optimizer_info import BUILTIN_OPTIMIZERS, MATRIX, OPTIMIZERS, OPTION_CASES, all_optimizers, compiled_matrix, matrix, matrix_optimizers
from test_optim import (
    COMPILED_PARAM_ATOL,
    LR,
    PARITY_PARAM_TOL,
    PARITY_STATE_TOL,
    assert_same_bits,
    dense,
    eager_step,  # noqa: F401 - a fixture
    make_mlp,
    max_flip_fraction,
    mismatch_fraction,
    redrawn_fraction,
    save_and_load,
    stored_as,
    train,
    unique_graphs,
)
from torch import nn

import lowbit_optim
from lowbit_optim import LowRankState
from test_drop_in import assert_same_training, check_step_inside_torch_compile

FP32 = format_info("fp32")
ADAMW = next(o for o in OPTIMIZERS if o.cls is lowbit_optim.AdamW)
STEPS = 10
def gradients(opt_info, steps: int = STEPS) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [[torch.randn(shape, generator=g) for shape in opt_info.shapes] for _ in range(steps)]


def initial_params(opt_info) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randn(shape, generator=g) for shape in opt_info.shapes]


def run(make, grads: list[list[torch.Tensor]], opt_info, device: str = "cpu") -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """``make(params)``'s optimizer stepped with the given gradients, on ``device``."""
    params = [nn.Parameter(p.to(device, copy=True)) for p in initial_params(opt_info)]
    opt = make(params)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device, copy=True)
        opt.step()
    return params, opt


def states_of(opt, params) -> dict:
    return {(i, k): v for i, p in enumerate(params) for k, v in opt.state.get(p, {}).items() if k != "step"}


# ------------------------------------------------------------------------------------------------
# 1. fp32 state computes the optimizer's numbers
# ------------------------------------------------------------------------------------------------

# Lion and AdEMAMix against float64: observed after 10 steps params within 1.2e-7 and states within
# 6e-8 (fp32 round-off); a Lion update whose sign input rounds across zero would differ by 2 lr.
REFERENCE_PARAM_TOL = dict(rtol=1e-5, atol=1e-6)
REFERENCE_STATE_TOL = dict(rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("opt_info, option", OPTION_CASES)
def test_fp32_state_matches_reference(opt_info, option):
    """state_format="fp32" (the compiled step) computes the optimizer's numbers: torch.optim's class
    of the same name, stepped with the same gradients, or a float64 reference."""
    kwargs = dict(lr=opt_info.lr, **opt_info.options[option])
    grads = gradients(opt_info)
    params, opt = run(lambda ps: opt_info.cls(ps, state_format="fp32", **kwargs), grads, opt_info)
    ours = states_of(opt, params)
    if opt_info.reference is None and opt_info.torch_cls is None:
        pytest.skip(f"{opt_info.name} names no torch.optim class (torch_name) and its OptimizerInfo gives no float64 reference")
    if opt_info.reference is None:
        ref_params, ref_opt = run(lambda ps: opt_info.torch_cls(ps, **kwargs), grads, opt_info)
        expected, param_tol, state_tol = states_of(ref_opt, ref_params), opt_info.parity_param_tol or PARITY_PARAM_TOL, PARITY_STATE_TOL
    else:
        ref_params, expected = [p.double() for p in initial_params(opt_info)], {}
        for i, p in enumerate(ref_params):
            state = {}
            for step, step_grads in enumerate(grads, start=1):
                opt_info.reference(p, step_grads[i].double(), state, step, **kwargs)
            expected.update({(i, k): v for k, v in state.items()})
        param_tol, state_tol = REFERENCE_PARAM_TOL, REFERENCE_STATE_TOL
    for i, (p, ref) in enumerate(zip(params, ref_params)):
        torch.testing.assert_close(p.detach().double(), ref.detach().double(), **param_tol, msg=lambda m, i=i: f"param {i}: {m}")
    assert ours.keys() == expected.keys()
    for key, state in ours.items():
        assert stored_as(state) == "fp32", key
        # atol scaled to the state: an SGD momentum buffer grows to ~1 / (1 - momentum) gradients
        atol = state_tol["atol"] * max(1.0, float(expected[key].abs().max()))
        torch.testing.assert_close(state.double(), expected[key].double(), rtol=state_tol["rtol"], atol=atol, msg=lambda m, key=key: f"{key}: {m}")


BITSANDBYTES_CASES = [pytest.param(o, option, id=f"{o.name}-{option}") for o in OPTIMIZERS if o.bitsandbytes for option in o.bitsandbytes[2]]


@pytest.mark.parametrize("opt_info, option", BITSANDBYTES_CASES)
def test_fp32_state_matches_bitsandbytes(opt_info, option):
    """Within float tolerance of bitsandbytes' 32-bit version (its CPU step): observed after 10 steps
    params within 2.4e-7 (its updates multiply where ours interpolate)."""
    bnb = pytest.importorskip("bitsandbytes")
    name, extra, _ = opt_info.bitsandbytes
    kwargs = dict(lr=opt_info.lr, **opt_info.options[option])
    grads = gradients(opt_info)
    params, _ = run(lambda ps: opt_info.cls(ps, state_format="fp32", **kwargs), grads, opt_info)
    bnb_params, _ = run(lambda ps: getattr(bnb.optim, name)(ps, **kwargs, **extra), grads, opt_info)
    for i, (p, ref) in enumerate(zip(params, bnb_params)):
        torch.testing.assert_close(p, ref, rtol=1e-5, atol=2e-6, msg=lambda m, i=i: f"param {i}: {m}")


# ------------------------------------------------------------------------------------------------
# 2. The matrix: every optimizer x every format
# ------------------------------------------------------------------------------------------------

TRAIN_STEPS = 8


def trained(opt_info, info, steps: int = TRAIN_STEPS, **kwargs):
    model = opt_info.mlp()
    opt = opt_info.make(model.parameters(), state_format=opt_info.spec(info), **kwargs)
    return model, opt, train(model, opt, steps)


@functools.cache
def fp32_losses(opt_info) -> list[float]:
    return trained(opt_info, FP32, compile=False)[2]


@matrix
def test_trains_with_states_in_their_format(opt_info, info):
    """A few steps reduce the loss about as much as the same optimizer with fp32 states; each
    declared state of a large parameter is stored in its format, a small one's in fp32."""
    model, opt, losses = trained(opt_info, info, compile=False)
    reference = fp32_losses(opt_info)
    assert losses[-1] < 0.8 * losses[0], losses
    coarse = getattr(info.fmt, "bits", 4) < 8
    assert losses[-1] <= (1.3 if coarse else 1.05) * reference[-1], (losses[-1], reference[-1])
    group = opt.param_groups[0]
    for name, p in model.named_parameters():
        state = opt.state[p]
        assert set(state) == {"step", *(s.name for s in opt_info.cls.states if s.when is None or group[s.when])}, name
        for key, value in state.items():
            if key != "step":
                expected = stored_format(opt_info.format_of(info, key), p.numel(), group["min_quantize_numel"])
                assert stored_as(value) == expected and value.shape == p.shape, (name, key)


@matrix
def test_checkpoint_and_deepcopy_step_like_the_original(opt_info, info):
    """After 3 steps: state_dict -> torch.save -> torch.load(weights_only=True) -> a fresh optimizer,
    and a deepcopy of (model, optimizer); 2 more steps in all three: identical params and states.
    load_state_dict(state_dict()) gives back the same param groups."""
    model, opt, _ = trained(opt_info, info, steps=3, compile=False)
    resumed_model = copy.deepcopy(model)
    resumed = opt_info.make(resumed_model.parameters(), state_format=opt_info.spec(info), compile=False)
    saved = opt.state_dict()
    resumed.load_state_dict(save_and_load(saved))
    assert resumed.state_dict()["param_groups"] == saved["param_groups"]
    model_copy, opt_copy = copy.deepcopy((model, opt))
    for m, o in ((model, opt), (resumed_model, resumed), (model_copy, opt_copy)):
        train(m, o, 2)
    assert_same_training(model, opt, resumed_model, resumed)
    assert_same_training(model, opt, model_copy, opt_copy)


def _switchable_states() -> list:
    """(optimizer, option, a value of it under which the state exists) for each state an option
    switches on (SGD's momentum buffer, AdamW's amsgrad maximum)."""
    cases = []
    for opt_info in OPTIMIZERS:
        for state in opt_info.cls.states:
            if state.when is not None:
                on = next(o[state.when] for o in (opt_info.kwargs, *opt_info.options.values()) if o.get(state.when))
                cases.append(pytest.param(opt_info, state.when, on, id=f"{opt_info.name}-{state.when}"))
    return cases


@pytest.mark.parametrize("opt_info, option, on", _switchable_states())
def test_a_state_switched_off_at_a_checkpoint_goes_on_when_switched_on(opt_info, option, on):
    """A checkpoint taken while a group's momentum (amsgrad) is off for a phase holds the momentum
    buffer (the running maximum) that the run keeps for when it is on again: the load dropped it, so
    the resumed run restarted it where the uninterrupted one, and torch.optim's, went on."""
    model = opt_info.mlp()
    opt = opt_info.make(model.parameters(), state_format=opt_info.spec(format_info("8bit")), compile=False, **{option: on})
    train(model, opt, 2)
    opt.param_groups[0][option] = type(on)()
    train(model, opt, 1)
    resumed_model = copy.deepcopy(model)
    resumed = opt_info.make(resumed_model.parameters(), state_format=opt_info.spec(format_info("8bit")), compile=False, **{option: type(on)()})
    resumed.load_state_dict(save_and_load(opt.state_dict()))
    for o in (opt, resumed):
        o.param_groups[0][option] = on
    for m, o in ((model, opt), (resumed_model, resumed)):
        train(m, o, 2)
    assert_same_training(model, opt, resumed_model, resumed)


def assert_agree_but_for_flipped_codes(runs, opt_info, info, param_tol: dict | None = None) -> None:
    """Two runs of the same steps, each (params, optimizer) (compiled and eager, or on two devices),
    agree within fp32 round-off (or ``param_tol``), but for codes flipped at a rounding boundary and
    what such a flip moves: each quantized state can flip codes of its own, and a flip moves the
    parameter, hence the next gradients (AdEMAMix's three states flip about 3x as much as one;
    observed with 4bit after 3 steps: 8 of 6144 weight elements, 7 of 6144 exp_avg codes)."""
    flips = max_flip_fraction(info) * len(opt_info.cls.states)
    (params, _), (others, _) = runs
    first, second = ({key: v.cpu() for key, v in states_of(o, ps).items()} for ps, o in runs)
    assert first.keys() == second.keys()
    redrawn = sum(redrawn_fraction(state, second[key]) for key, state in first.items())
    tol = param_tol or opt_info.compiled_param_tol or dict(rtol=0.0, atol=COMPILED_PARAM_ATOL)
    for i, (a, b) in enumerate(zip(params, others)):
        a, b = a.detach().cpu(), b.detach().cpu()
        outside = (a - b).abs() > tol["atol"] + tol["rtol"] * b.abs()
        assert float(outside.float().mean()) < flips + redrawn, (f"parameter {i}", (a - b).abs().max().item())
    for key, state in first.items():
        assert stored_as(state) == stored_as(second[key]), key
        if not isinstance(state, LowRankState):
            assert mismatch_fraction(state, second[key]) < flips + redrawn_fraction(state, second[key]), key
        else:  # its subspace iteration spreads round-off over every residual code: a bound only
            assert_low_rank_states_close(state, second[key], key)


def assert_low_rank_states_close(a, b, key, steps: int = 8) -> None:
    """Each run's residual codes are within half a code step of its own momentum, and the two
    momenta drift apart by at most that much per step: within ``steps`` code steps of the larger
    block scale, plus fp32 round-off of the low-rank part (1e-5 of the state's absmax; it dominates
    where the residual is tiny). A loose bound, which a wrong low-rank part or residual exceeds."""
    codebook = type(a).codebook(a.signed)
    gap = max(y - x for x, y in zip(codebook, codebook[1:]))
    scale = max(float(a.scale.abs().max()), float(b.scale.abs().max()))
    values = dense(a), dense(b)
    worst = float((values[0] - values[1]).abs().max())
    assert worst <= steps * gap * scale + 1e-5 * float(values[1].abs().max()), (key, worst, gap * scale)


@compiled_matrix
def test_compiled_step_matches_eager_and_hyperparameters_do_not_recompile(opt_info, info):
    """The compiled step computes the eager step's numbers (up to codes flipped by fp32 round-off at
    a rounding boundary, as for AdamW in test_optim.py); then changing each hyper-parameter, by
    hand or with a scheduler, compiles nothing new, and lr=0 leaves the parameters unchanged."""
    models = [opt_info.mlp(), opt_info.mlp()]
    opts = [opt_info.make(m.parameters(), state_format=opt_info.spec(info), compile=c) for m, c in zip(models, (True, False))]
    for model, opt in zip(models, opts):
        train(model, opt, 3)
    assert_agree_but_for_flipped_codes([(list(m.parameters()), o) for m, o in zip(models, opts)], opt_info, info)

    model, opt = models[0], opts[0]
    graphs = unique_graphs()
    group = opt.param_groups[0]
    for change, values in opt_info.hyperparameter_changes.items():
        group.update(values)
        train(model, opt, 1)
        assert unique_graphs() == graphs, f"changing {change} recompiled"
    group.update(lr=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    train(model, opt, 1)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "lr=0 changed a parameter"
    group.update(lr=opt_info.lr)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(2):
        train(model, opt, 1)
        scheduler.step()
    assert unique_graphs() == graphs, "an lr scheduler recompiled"


# ------------------------------------------------------------------------------------------------
# 3. Per optimizer
# ------------------------------------------------------------------------------------------------


@matrix_optimizers
def test_step_inside_torch_compile(opt_info):
    """``@torch.compile def fn(): opt.step()``: one opaque op (step_op.py), no graph break, the same
    bits as calling opt.step() eagerly, and no recompilation when lr changes."""
    check_step_inside_torch_compile(lambda params: opt_info.make(params, state_format="8bit"), opt_info.lr, opt_info.mlp)


def test_ademamix_recipe_steps_inside_torch_compile():
    """The README's AdEMAMix recipe, whose 10bit-sr states count their writes inside the opaque op:
    the same bits and counts as the eager step."""
    ademamix = next(o for o in OPTIMIZERS if o.cls is lowbit_optim.AdEMAMix)
    recipe = {"exp_avg": "8bit-linear", "exp_avg_slow": "10bit-sr", "exp_avg_sq": "10bit-sr"}
    check_step_inside_torch_compile(lambda params: ademamix.make(params, state_format=recipe), ademamix.lr, ademamix.mlp)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# every optimizer, and a state of every kind, each once (foreach is the GPU's default): each case
# compiles a two-parameter graph of its own (~14 s cold on 2 vCPUs), so optimizers and kinds are
# paired up; an optimizer declared later takes 8bit states
FOREACH_FORMATS = {"SGD": ["8bit-sr"], "Lion": ["4bit"], "AdEMAMix": ["fp8"], "Muon": ["8bit-lowrank"], "RMSprop": ["10bit-sr"], "AdamW": ["factored", "bf16-sr"]}
FOREACH_CASES = [pytest.param(o, name, id=f"{o.name}-{name}") for o in OPTIMIZERS for name in FOREACH_FORMATS.get(o.name, ["8bit"])]


@pytest.mark.parametrize("opt_info, fmt", FOREACH_CASES)
@pytest.mark.parametrize("device", DEVICES)
def test_foreach_is_the_per_parameter_step_in_one_graph(monkeypatch, opt_info, fmt, device):
    """``foreach=True`` steps a group's parameters in one compiled graph: the bits of one call per
    parameter (``foreach=False``) for two quantized parameters of one kind, so one chunk and one
    graph, the second non-contiguous; that graph is traced once, a new lr reuses it. (Parameters of
    other kinds, as a bf16 one or one with fp32 states, would each fill a chunk of their own:
    a one-parameter graph, which shows nothing of parameters traced together.)"""
    g = torch.Generator().manual_seed(5)
    shapes = [(64, 96), (96, 80)]  # two sizes in one graph; the second transposed

    def make_params():
        values = [torch.randn(shape, generator=g) for shape in shapes]
        values[1] = values[1].t()  # non-contiguous
        assert not values[1].is_contiguous()
        return [nn.Parameter(v.to(device)) for v in values]

    chunk_sizes, chunks = [], lowbit_optim.base._foreach_chunks

    def recorded(compiled):
        found = chunks(compiled)
        chunk_sizes.append([len(chunk) for chunk in found])
        return found

    monkeypatch.setattr(lowbit_optim.base, "_foreach_chunks", recorded)
    runs = []
    for foreach in (False, True):
        g.manual_seed(5)
        params = make_params()
        opt = opt_info.make(params, state_format=opt_info.spec(format_info(fmt)), foreach=foreach, fused=False)
        for step in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g).to(p)
            if step == 1:
                graphs = unique_graphs()
                opt.param_groups[0]["lr"] = opt_info.lr / 2
            opt.step()
        assert not foreach or unique_graphs() == graphs, "the foreach graph was traced again"
        assert chunk_sizes == ([[2]] * 3 if foreach else []), "both parameters in one chunk"
        runs.append((params, opt))
    (params, opt), (grouped, grouped_opt) = runs
    for p, q in zip(params, grouped):
        assert torch.equal(p, q)
        for name, state in opt.state[p].items():
            assert_same_bits(state, grouped_opt.state[q][name], name)


@pytest.mark.parametrize(
    "foreach, device, grouped",
    [(None, "cpu", False), (True, "cpu", True), (False, "cpu", False), (None, "meta", True), (False, "meta", False)],
)
def test_foreach_choice(monkeypatch, foreach, device, grouped):
    """foreach=True steps the compiled step's parameters in chunks of one graph each (chunks of the
    same kinds of arguments, at most FOREACH_CHUNK long); False, one call per parameter; None, as
    torch.optim, True on an accelerator (meta stands in for one here) and False on the CPU."""
    calls = []

    def spy(step_function):
        def step_each(calls_, numbers, modes, flags):
            calls.append(len(calls_))
            for arguments, mode in zip(calls_, modes):
                step_function(*arguments, *numbers, **flags, param_update=mode)

        return step_each

    monkeypatch.setattr(lowbit_optim.base, "compiled_foreach_step", spy)
    monkeypatch.setattr(lowbit_optim.base, "compiled_step", lambda step_function: step_function)
    monkeypatch.setattr(lowbit_optim.base, "FOREACH_CHUNK", 3)
    shapes = [(64, 96), (71,), (80, 64), (90,), (64, 64), (72, 64), (100, 64)]  # 5 quantized, 2 fp32 states
    params = [nn.Parameter(torch.randn(shape, device=device)) for shape in shapes]
    opt = lowbit_optim.AdamW(params, state_format="8bit", foreach=foreach, fused=False)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert calls == ([3, 2, 2] if grouped else [])
    if foreach is None and device != "cpu":  # one parameter alone (the step in backward's case): its own graph
        calls.clear()
        opt._step_one(opt.param_groups[0], params[0], params[0].grad)
        assert calls == []


SWITCHED_STATES = [pytest.param(o, state, id=f"{o.name}-{state.when}") for o in OPTIMIZERS for state in o.cls.states if state.when is not None]


@pytest.mark.parametrize("fused", [None, False], ids=["kernel", "eager"])
@pytest.mark.parametrize("opt_info, state", SWITCHED_STATES)
def test_a_state_switched_on_after_steps_is_made_as_a_first_step_makes_it(opt_info, state, fused):
    """A state that exists under an option (amsgrad's max_exp_avg_sq, SGD's momentum buffer) and
    the option turned on after some steps: the next step makes it as a first step does, in the
    group's format (it had raised a bare KeyError)."""
    params = [nn.Parameter(p) for p in initial_params(opt_info)]
    flag = isinstance(inspect.signature(opt_info.cls).parameters[state.when].default, bool)
    off, on = (False, True) if flag else (0.0, 0.9)
    opt = opt_info.make(params, state_format=opt_info.spec(format_info("8bit")), min_quantize_numel=0, fused=fused, compile=fused is None, **{state.when: off})
    for i, step_grads in enumerate(gradients(opt_info, 3)):
        if i == 1:
            opt.param_groups[0][state.when] = on
        for p, g in zip(params, step_grads):
            p.grad = g
        opt.step()
    for p in params:
        assert isinstance(opt.state[p][state.name], lowbit_optim.OptimState8bit), state.name


@pytest.mark.parametrize("param_update", ["kahan", "int8-correction"])
def test_momentum_switched_on_beside_a_precision_buffer(param_update):
    """SGD without momentum keeps only a bf16 parameter's precision buffer, and no step counter:
    momentum turned on then makes the counter with the buffer (it had stepped a missing counter)."""
    p = nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
    opt = lowbit_optim.SGD([p], lr=0.1, momentum=0.0, param_update=param_update, state_format="8bit", compile=False)
    for i in range(3):
        if i == 1:
            opt.param_groups[0]["momentum"] = 0.9
        p.grad = torch.randn_like(p)
        opt.step()
    assert float(opt.state[p]["step"]) == 2 and isinstance(opt.state[p]["momentum_buffer"], lowbit_optim.OptimState8bit)


@pytest.mark.parametrize("foreach", [False, True], ids=["per-parameter", "foreach"])
@all_optimizers
def test_parameters_on_meta_step_without_a_graph(opt_info, foreach):
    """A model on the meta device (deferred init) steps as torch.optim steps one: its states are
    made there in their formats, and nothing is compiled (dynamo cannot fake a state subclass that
    lives on meta; there is nothing to compute)."""
    params = [nn.Parameter(torch.empty(shape, device="meta")) for shape in opt_info.shapes]
    opt = opt_info.make(params, state_format=opt_info.spec(format_info("8bit")), foreach=foreach)
    graphs = unique_graphs()
    for p in params:
        p.grad = torch.empty_like(p)
    opt.step()
    assert unique_graphs() == graphs
    states = [s for p in params for name, s in opt.state[p].items() if name != "step"]
    assert states and all(s.is_meta for s in states)
    assert any(isinstance(s, lowbit_optim.OptimState8bit) for s in states)


@pytest.mark.parametrize("param_update", ["nearest", "stochastic", "kahan", "int8-correction"])
@matrix_optimizers
def test_bf16_params_train(opt_info, param_update):
    """bf16 weights train with 8-bit states under every param_update mode, which keeps its buffer."""
    model = opt_info.mlp(bias=False, dtype=torch.bfloat16)
    opt = opt_info.make(model.parameters(), state_format="8bit", param_update=param_update, compile=False)
    losses = train(model, opt, TRAIN_STEPS)
    assert losses[-1] < 0.8 * losses[0], losses
    extra = lowbit_optim.precision.extra_state_name(param_update)
    for p in model.parameters():
        assert p.dtype == torch.bfloat16 and bool(p.isfinite().all())
        assert (extra in opt.state[p]) == (extra is not None)


@matrix_optimizers
@pytest.mark.parametrize("fmt", ["fp32", "8bit-lowrank"])
def test_fused(opt_info, fmt):
    """An optimizer with an update in the fused CPU kernel (Adam/AdamW, SGD, Lion, AdEMAMix, Muon) steps
    with it under fused=True and fused=None (the default), the same bits as the compiled step
    (fused=False; test_fused_cpu.py covers the formats and options), with plain states and with a
    state that keeps a part outside its codes (8bit-lowrank's matrices: its addend); one without is
    refused fused=True with the reason, and fused=None takes the compiled step."""
    info = format_info(fmt)
    if opt_info.spec(info) is None:
        pytest.skip(f"{opt_info.name} keeps no state {fmt} holds")
    if opt_info.cls._fused_step is None:
        with pytest.raises(ValueError, match="the fused CPU kernel steps Adam, AdamW, SGD, Lion, AdEMAMix and Muon only"):
            opt_info.make(opt_info.mlp().parameters(), fused=True)
        choices = (None, False)
    else:
        choices = (True, None, False)
    runs = [trained(opt_info, info, steps=2, fused=fused)[:2] for fused in choices]
    for run in runs[1:]:
        assert_same_training(*runs[0], *run)


@pytest.mark.parametrize("opt_info", OPTIMIZERS, ids=str)
def test_a_non_finite_gradient_shows_in_the_parameter(opt_info):
    """A NaN or inf gradient element makes its parameter element non-finite at that step (README,
    "Non-finite gradients"), the kernel and the compiled step alike: never a parameter that silently
    stops moving (Lion's sign() is 0 for NaN, and its momentum stays NaN for good)."""
    choices = (None, False) if opt_info.cls._fused_step is None else (True, False)
    stepped = []
    for fused in choices:
        param = nn.Parameter(initial_params(opt_info)[0])
        opt = opt_info.make([param], state_format="fp32", fused=fused)
        param.grad = torch.randn(param.shape, generator=torch.Generator().manual_seed(1))
        param.grad[3, 5], param.grad[40, 1] = float("nan"), float("inf")
        opt.step()
        assert not param[3, 5].isfinite() and not param[40, 1].isfinite(), f"fused={fused}: a parameter element stayed finite"
        stepped.append(param.detach())
    torch.testing.assert_close(*stepped, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("opt_info", OPTIMIZERS, ids=str)
def test_a_step_that_finds_no_gradient_before_any_state_warns(opt_info):
    """A step that finds no gradient on any parameter, before any state was made, warns and names
    the usual cause (an optimizer built before fully_shard replaced the parameters; FSDP2's case is
    tested in test_fsdp.py); once a state exists, a step without gradients is quiet, as in
    torch.optim (layers frozen for a while)."""
    params = [nn.Parameter(p) for p in initial_params(opt_info)]
    opt = opt_info.make(params, state_format="8bit", compile=False)
    with pytest.warns(UserWarning, match=rf"{opt_info.cls.__name__}.step\(\) found no gradient on any of its {len(params)} parameters.*after fully_shard") as warned:
        opt.step()
    assert warned[0].filename == __file__  # the line that called step()
    torch.optim.lr_scheduler.StepLR(opt, 1)  # its wrapper of step() is torch's: the warning still names this line
    with pytest.warns(UserWarning, match="found no gradient") as warned:
        opt.step()
    assert warned[0].filename == __file__
    assert not opt.state
    params[0].grad = torch.ones_like(params[0])
    opt.step()
    opt.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


@pytest.mark.parametrize("opt_info", OPTIMIZERS, ids=str)
def test_a_step_in_backward_whose_hooks_never_ran_warns(opt_info):
    """step_in_backward=True built before fully_shard (or before the parameters were replaced): the
    hooks sit on the old parameters and never run, and step() finds no gradient on them either. It
    warns as the step after backward does; once the hooks have stepped, step() is quiet."""
    model = opt_info.mlp()
    opt = opt_info.make(model.parameters(), state_format="8bit", compile=False, step_in_backward=True)
    replaced = copy.deepcopy(model)  # what fully_shard makes of the model: other parameters
    replaced(torch.ones(2, model[0].in_features)).sum().backward()
    with pytest.warns(UserWarning, match=rf"{opt_info.cls.__name__}.step\(\) found no gradient .*after fully_shard"):
        opt.step()
    model(torch.ones(2, model[0].in_features)).sum().backward()  # the hooks step each parameter
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_sgd_without_momentum_steps_without_gradients_quietly_once_it_has_stepped(step_in_backward):
    """SGD without momentum keeps no state, so "no state yet" cannot tell a first step from a later
    one: a step without gradients after it has stepped (layers frozen for a while) is quiet."""
    model = make_mlp()
    opt = lowbit_optim.SGD(model.parameters(), lr=0.1, compile=False, step_in_backward=step_in_backward)
    model(torch.ones(2, model[0].in_features)).sum().backward()
    opt.step()
    opt.zero_grad()
    assert not opt.state
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


FUNCTIONAL_OPTIMIZERS = [o for o in BUILTIN_OPTIMIZERS if o.cls.step_function.__module__ == "lowbit_optim.functional"]


def _public_step_call(opt_info, dtype=torch.float32):
    """A call of ``opt_info``'s public step function (lowbit_optim.adam_step, ...) as its optimizer
    makes it on one (32, 48) parameter with 8bit states, after one step: (function, arguments, flags)."""
    param = nn.Parameter(torch.randn(32, 48, dtype=dtype))
    opt = opt_info.make([param], state_format="8bit", compile=False)
    param.grad = torch.randn_like(param)
    opt.step()
    group, state = opt.param_groups[0], opt.state[param]
    numbers, flags = opt._tensor_arguments(group, param.device)
    states = [state.get(s.name) for s in opt.states]
    return opt.step_function, [param.detach(), param.grad, state["step"], *states, None, *numbers], flags


@pytest.mark.parametrize("opt_info", FUNCTIONAL_OPTIMIZERS, ids=str)
def test_public_step_functions_refuse_a_call_no_optimizer_makes(opt_info):
    """The step functions are public: a counter that is not a tensor, a number given as a Python
    float, a signed state made unsigned (clamped at 0, silently) or a bf16 weight's missing Kahan
    buffer are refused by name, before the step counter or any state is written."""
    fn, args, flags = _public_step_call(opt_info)
    fn(*args, **flags, param_update="nearest")  # the call as made steps

    def call_with(index, value):
        fn(*args[:index], value, *args[index + 1 :], **flags, param_update="nearest")

    with pytest.raises(TypeError, match="step must be the step counter, a 0-d float32 tensor"):
        call_with(2, 1)
    lr_index = 3 + len(opt_info.cls.states) + 1  # after the states and param_extra
    with pytest.raises(TypeError, match=r"lr must be a 0-d tensor, e.g. torch.tensor\(0.5\)"):
        call_with(lr_index, 0.5)
    signed = next(s for s in opt_info.cls.states if s.signed)
    unsigned = lowbit_optim.get_format("8bit").zeros(args[0].shape, signed=False)
    with pytest.raises(ValueError, match=f"{signed.name} can be negative, but it is an unsigned OptimState8bit"):
        call_with(3 + opt_info.cls.states.index(signed), unsigned)

    fn, args, flags = _public_step_call(opt_info, torch.bfloat16)
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    with pytest.raises(ValueError, match=r"param_update='kahan' keeps a buffer beside the parameter \(compensation\): pass it as param_extra"):
        fn(*args, **flags, param_update="kahan")
    for a, b in zip(args, before):
        assert not isinstance(a, torch.Tensor) or torch.equal(a.dequantize() if hasattr(a, "codes") else a, b.dequantize() if hasattr(b, "codes") else b)


# ------------------------------------------------------------------------------------------------
# 4. SGD specifics, torch checkpoints, bitsandbytes aliases, bad input
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
def test_sgd_without_momentum_keeps_no_state(state_format):
    """momentum=0: no state at all (as torch.optim.SGD), whatever the format; momentum set later
    creates the buffer, whose first step takes the gradient."""
    model = make_mlp()
    opt = lowbit_optim.SGD(model.parameters(), lr=0.1, state_format=state_format, compile=False)
    train(model, opt, 2)
    assert len(opt.state) == 0 and opt.state_dict()["state"] == {} and lowbit_optim.bytes_per_param(opt) == 0
    opt.param_groups[0]["momentum"] = 0.9
    train(model, opt, 1)
    assert all(set(s) == {"step", "momentum_buffer"} and float(s["step"]) == 1 for s in opt.state.values())


def test_torch_sgd_checkpoint_loads():
    """A torch.optim.SGD checkpoint (momentum buffers, no step counters) resumes in fp32 as torch
    goes on, and loads quantized into 8bit."""
    model = make_mlp()
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
    train(model, torch_opt, 3)
    checkpoint = save_and_load(torch_opt.state_dict())
    ours_model = copy.deepcopy(model)
    ours = lowbit_optim.SGD(ours_model.parameters(), lr=0.05, momentum=0.9, nesterov=True, compile=False)
    ours.load_state_dict(checkpoint)
    train(model, torch_opt, 3)
    train(ours_model, ours, 3)
    for a, b in zip(ours_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, **PARITY_PARAM_TOL)
    quantized = lowbit_optim.SGD(make_mlp().parameters(), lr=0.05, momentum=0.9, state_format="8bit", compile=False)
    quantized.load_state_dict(checkpoint)
    assert {stored_as(s["momentum_buffer"]) for s in quantized.state.values()} == {"8bit", "fp32"}


def test_lion_checkpoint_without_step_counters_loads():
    """lion-pytorch (the usual reference Lion) saves exp_avg alone, no step counter: such a checkpoint
    resumes exactly, as Lion's update reads no count."""
    model = make_mlp()
    opt = lowbit_optim.Lion(model.parameters(), lr=1e-3, weight_decay=0.1, compile=False)
    train(model, opt, 2)
    checkpoint = save_and_load(opt.state_dict())
    for state in checkpoint["state"].values():
        del state["step"]
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.Lion(resumed_model.parameters(), lr=1e-3, weight_decay=0.1, compile=False)
    resumed.load_state_dict(checkpoint)
    train(model, opt, 2)
    train(resumed_model, resumed, 2)
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("opt_info", [o for o in BUILTIN_OPTIMIZERS if o.torch_cls], ids=str)
def test_constructor_and_groups_like_torch(opt_info):
    """Where torch.optim has the optimizer, the constructor takes its arguments (positional ones in
    its order) with its defaults, and state_dict's param groups hold its keys."""
    options = {n: p for n, p in inspect.signature(lowbit_optim.LowBitOptimizer).parameters.items() if p.kind == p.KEYWORD_ONLY}
    ours = {**inspect.signature(opt_info.cls).parameters, **options}  # the keywords **options passes on
    theirs = inspect.signature(opt_info.torch_cls).parameters
    for name, param in theirs.items():
        assert name in ours, name
        assert param.kind == ours[name].kind or param.kind == param.POSITIONAL_OR_KEYWORD and ours[name].kind == param.KEYWORD_ONLY, name
        assert param.default == ours[name].default or name == "weight_decay", name  # Adam's default is decided by the class
    positional = [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD][: len(positional)] == positional
    model = opt_info.mlp()
    keys = opt_info.torch_cls(model.parameters()).state_dict()["param_groups"][0].keys()
    assert keys <= opt_info.make(model.parameters()).state_dict()["param_groups"][0].keys()


BITSANDBYTES_ALIASES = {
    "SGD8bit": (lowbit_optim.SGD, dict(lr=0.05, momentum=0.9)),
    "Lion8bit": (lowbit_optim.Lion, {}),
    "AdEMAMix8bit": (lowbit_optim.AdEMAMix, dict(t_alpha=100)),
}


def signature_of(cls) -> list[tuple[str, str]]:
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()]


@pytest.mark.parametrize("alias", BITSANDBYTES_ALIASES)
def test_bitsandbytes_aliases(alias, eager_step):
    """SGD8bit, Lion8bit and AdEMAMix8bit take bitsandbytes' arguments (names, order, defaults), keep
    8-bit states from min_8bit_size elements on, and step like the optimizer with state_format="8bit"."""
    cls = getattr(lowbit_optim, alias)
    base, kwargs = BITSANDBYTES_ALIASES[alias]
    ours = [(n, k, d) for n, k, d in signature_of(cls) if k != "KEYWORD_ONLY"]
    try:
        import bitsandbytes
    except ImportError:
        pass
    else:
        assert ours == signature_of(getattr(bitsandbytes.optim, alias))
    assert issubclass(cls, base)
    model, reference_model = make_mlp(), make_mlp()
    opt = cls(model.parameters(), **kwargs, min_8bit_size=5000)
    reference = base(reference_model.parameters(), **kwargs, state_format="8bit", min_quantize_numel=5000)
    train(model, opt, 2)
    train(reference_model, reference, 2)
    assert_same_training(reference_model, reference, model, opt)
    assert {stored_as(v) for k, v in opt.state[model[0].weight].items() if k != "step"} == {"8bit"}  # 6144 elements
    assert {stored_as(v) for k, v in opt.state[model[2].weight].items() if k != "step"} == {"fp32"}  # 4544 < 5000


def one_param(cls, **kwargs):
    return lambda: cls([nn.Parameter(torch.randn(64, 64))], **kwargs)


BAD_INPUT = {
    "RMSprop(fused=True)": one_param(CUSTOM_OPTIMIZER_EXAMPLE.RMSprop, fused=True),
    "SGD(nesterov=True)": one_param(lowbit_optim.SGD, nesterov=True),
    "SGD(momentum=-1)": one_param(lowbit_optim.SGD, momentum=-1),
    'SGD(state_format="factored")': one_param(lowbit_optim.SGD, momentum=0.9, state_format="factored"),
    'Lion(state_format={"exp_avg_sq": "8bit"})': one_param(lowbit_optim.Lion, state_format={"exp_avg_sq": "8bit"}),
    "Lion(betas=(0.9, 0.99, 0.999))": one_param(lowbit_optim.Lion, betas=(0.9, 0.99, 0.999)),
    "Lion(lr=-1)": one_param(lowbit_optim.Lion, lr=-1),
    'AdEMAMix(state_format="factored")': one_param(lowbit_optim.AdEMAMix, state_format="factored"),
    "AdEMAMix(betas=(0.9, 0.999))": one_param(lowbit_optim.AdEMAMix, betas=(0.9, 0.999)),
    "AdEMAMix(t_alpha=0)": one_param(lowbit_optim.AdEMAMix, t_alpha=0),
    "AdEMAMix(alpha=-1)": one_param(lowbit_optim.AdEMAMix, alpha=-1),
    "AdEMAMix(betas=(0, 0.999, 0.9999), t_beta3=10)": one_param(lowbit_optim.AdEMAMix, betas=(0, 0.999, 0.9999), t_beta3=10),
    "Lion(float64 parameter)": lambda: lowbit_optim.Lion([nn.Parameter(torch.randn(4, dtype=torch.float64))]),
    "Lion8bit(percentile_clipping=5)": one_param(lowbit_optim.Lion8bit, percentile_clipping=5),
    "Lion8bit(is_paged=True)": one_param(lowbit_optim.Lion8bit, is_paged=True),
    "SGD8bit(block_wise=False)": lambda: lowbit_optim.SGD8bit([nn.Parameter(torch.randn(4))], lr=0.1, block_wise=False),
    "SGD8bit(args={...})": lambda: lowbit_optim.SGD8bit([nn.Parameter(torch.randn(4))], 0.1, args={"optim_bits": 8}),
    "AdamW checkpoint into Lion": lambda: _load_into(lowbit_optim.Lion, lowbit_optim.AdamW),
    "Lion checkpoint into SGD": lambda: _load_into(lowbit_optim.SGD, lowbit_optim.Lion, momentum=0.9),
}


def _load_into(cls, saved_cls, **kwargs):
    model = make_mlp()
    saved = saved_cls(model.parameters(), compile=False)
    train(model, saved, 1)
    cls(model.parameters(), compile=False, **kwargs).load_state_dict(saved.state_dict())


class TestBadInput(expecttest.TestCase):
    def test_messages(self):
        rows = []
        for name, make in BAD_INPUT.items():
            with self.assertRaises((ValueError, TypeError, RuntimeError)) as caught:
                make()
            rows.append(f"{name}: {type(caught.exception).__name__}: {caught.exception}")
        self.assertExpectedInline("\n".join(rows), """\
RMSprop(fused=True): ValueError: fused=True, but the fused CPU kernel steps Adam, AdamW, SGD, Lion, AdEMAMix and Muon only; RMSprop takes the compiled step. Pass fused=None (the default) or False
SGD(nesterov=True): ValueError: nesterov=True needs momentum > 0 and dampening=0, got momentum=0.0 and dampening=0.0
SGD(momentum=-1): ValueError: invalid momentum -1: momentum must be >= 0
SGD(state_format="factored"): ValueError: the 'factored' state format holds nonnegative states only, and SGD's momentum_buffer can be negative: pick another format
Lion(state_format={"exp_avg_sq": "8bit"}): ValueError: a per-state state_format for Lion needs exactly the keys ['exp_avg'], got ['exp_avg_sq']
Lion(betas=(0.9, 0.99, 0.999)): ValueError: invalid betas (0.9, 0.99, 0.999): Lion takes two, (beta1, beta2), e.g. (0.9, 0.99); 3 given
Lion(lr=-1): ValueError: invalid learning rate -1: lr must be a number >= 0
AdEMAMix(state_format="factored"): StateFormatError: the 'factored' state format holds nonnegative states only: use it for exp_avg_sq, e.g. state_format={'exp_avg': '4bit', 'exp_avg_slow': '4bit', 'exp_avg_sq': 'factored'}
AdEMAMix(betas=(0.9, 0.999)): ValueError: invalid betas (0.9, 0.999): AdEMAMix takes three, (beta1, beta2, beta3), e.g. (0.9, 0.999, 0.9999); 2 given
AdEMAMix(t_alpha=0): ValueError: invalid t_alpha 0: pass None (no warm-up) or a number of steps > 0
AdEMAMix(alpha=-1): ValueError: invalid alpha -1: alpha must be >= 0
AdEMAMix(betas=(0, 0.999, 0.9999), t_beta3=10): ValueError: t_beta3 warms beta3 up from beta1 in log space: beta1 and beta3 must be > 0, got betas (0, 0.999, 0.9999)
Lion(float64 parameter): TypeError: float64 parameters are not supported: lowbit_optim computes the step in float32 and would round them. Convert the model to float32 (model.float())
Lion8bit(percentile_clipping=5): ValueError: Lion8bit(percentile_clipping=5) is not supported: bitsandbytes' adaptive gradient clipping; clip with torch.nn.utils.clip_grad_norm_. Leave percentile_clipping at its default
Lion8bit(is_paged=True): ValueError: Lion8bit(is_paged=True) is not supported: bitsandbytes' paged (CUDA unified memory) states; lowbit_optim's states are ordinary tensors. Leave is_paged at its default
SGD8bit(block_wise=False): ValueError: SGD8bit(block_wise=False) is not supported: lowbit_optim's 8-bit states are always blockwise. Leave block_wise at its default
SGD8bit(args={...}): ValueError: SGD8bit(args={'optim_bits': 8}) is not supported: bitsandbytes' configuration object; pass its fields as keywords. Leave args at its default
AdamW checkpoint into Lion: ValueError: checkpoint state of parameter 0 (shape (64, 96)) holds ['exp_avg_sq'], which Lion does not keep: it is a checkpoint of another optimizer
Lion checkpoint into SGD: ValueError: checkpoint state of parameter 0 (shape (64, 96)) lacks ['momentum_buffer']: it is not a checkpoint of SGD with momentum=0.9""")


# ------------------------------------------------------------------------------------------------
# 5. Declaring an optimizer
# ------------------------------------------------------------------------------------------------


def test_custom_optimizer_example_is_picked_up():
    """examples/custom_optimizer.py's RMSprop, imported by conftest, is in the registry and so in
    every test above, with every format (factored too: its only state is nonnegative)."""
    assert CUSTOM_OPTIMIZER_EXAMPLE is not None, "examples/custom_optimizer.py is missing"
    infos = [o for o in OPTIMIZERS if o.cls is CUSTOM_OPTIMIZER_EXAMPLE.RMSprop]
    assert len(infos) == 1 and infos[0].torch_cls is torch.optim.RMSprop
    assert {f.name for f in FORMATS} == {case.values[1].name for case in MATRIX if case.values[0] is infos[0]}


@pytest.mark.parametrize("state_format", ["fp32", "8bit"])
def test_declared_initial_value(state_format):
    """A State's ``initial`` is the value it starts from (stored in its format): an RMSprop whose
    square average starts at 0.5 and never moves (alpha=1) keeps 0.5."""

    class HalfStart(CUSTOM_OPTIMIZER_EXAMPLE.RMSprop):
        states = (lowbit_optim.State("square_avg", signed=False, initial=0.5),)

    p = nn.Parameter(torch.randn(64, 96))
    opt = HalfStart([p], alpha=1.0, state_format=state_format, compile=False)
    p.grad = torch.randn_like(p)
    opt.step()
    assert stored_as(opt.state[p]["square_avg"]) == state_format
    assert torch.equal(opt.state[p]["square_avg"].float(), torch.full((64, 96), 0.5))


class LrTwice(lowbit_optim.AdamW):
    """A subclass with numbers of its own: twice the lr."""

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        (lr, *numbers), flags = super()._step_arguments(group)
        return (2 * lr, *numbers), flags


class MuonLrTwice(lowbit_optim.Muon):
    """A subclass that scales a float64 number (Muon's lr, at a position float64_numbers names)."""

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        (lr, *numbers), flags = super()._step_arguments(group)
        return (2 * lr, *numbers), flags


def test_a_subclass_may_scale_the_numbers_its_step_takes_in_float64():
    """The numbers a step takes in float64 are named by position (float64_numbers), so a subclass
    may compute with them as super()._step_arguments returns them (a wrapper around them had failed
    such arithmetic): twice Muon's lr steps as lr=0.04 does, bit for bit."""
    runs = []
    for cls, lr in ((MuonLrTwice, 0.02), (lowbit_optim.Muon, 0.04)):
        torch.manual_seed(0)
        p = nn.Parameter(torch.randn(32, 16))
        opt = cls([p], lr=lr, weight_decay=0.0, fused=False)  # (the decay is computed from the group's lr)
        p.grad = torch.randn_like(p)
        opt.step()
        runs.append(p.detach().clone())
    assert torch.equal(*runs)


def test_a_subclass_with_its_own_step_takes_the_compiled_step():
    """The fused CPU kernel computes the step of the class that defines ``_fused_step``: a subclass
    with its own step function, numbers (``_step_arguments``) or states takes the compiled step,
    which gives its numbers, and fused=True says why it cannot be had."""
    runs = []
    for fused in (None, False):
        model = make_mlp()
        opt = LrTwice(model.parameters(), lr=LR, state_format="8bit", fused=fused)
        train(model, opt, 2)
        runs.append((model, opt))
    assert_same_training(*runs[0], *runs[1])
    model = make_mlp()
    reference = lowbit_optim.AdamW(model.parameters(), lr=2 * LR, state_format="8bit")
    train(model, reference, 2)
    assert_same_training(model, reference, *runs[0])  # lr twice is AdamW at 2 lr
    with pytest.raises(ValueError, match="LrTwice has its own _step_arguments, and the fused CPU kernel computes Adam's step"):
        LrTwice(make_mlp().parameters(), fused=True)


# every optimizer with every format that limits the averages it holds (max_signed_decay: lowrank.py)
DECAY_LIMITED = [(o, f) for o in OPTIMIZERS for f in FORMATS if isinstance(f.fmt, type) and f.fmt.max_signed_decay is not None]


@pytest.mark.parametrize("opt_info, info", DECAY_LIMITED, ids=[f"{o}-{f.name}" for o, f in DECAY_LIMITED])
def test_a_format_is_refused_for_averages_slower_than_it_holds(opt_info, info):
    """Each signed average (State.decay) in a format whose rounding noise is fresh at every write: an
    optimizer whose default beta for it is above the format's max_signed_decay refuses the format,
    naming the state and a state_format that works; one within the limit takes it."""
    for state in opt_info.cls.states:
        if not state.signed or state.decay is None:
            continue
        spec = {k: (info.name if k == state.name else "fp32") for k in opt_info.format_keys}
        decay = state.decay(opt_info.group)
        if decay <= info.fmt.max_signed_decay:
            opt_info.make(opt_info.mlp().parameters(), state_format=spec)
            continue
        message = f"cannot hold {opt_info.make(opt_info.mlp().parameters())._family}'s {state.name}, an average that keeps {decay} of itself per step"
        with pytest.raises(ValueError, match=message) as caught:
            opt_info.make(opt_info.mlp().parameters(), state_format=spec)
        suggested = ast.literal_eval(str(caught.value).split("state_format=")[-1])  # the message's example
        opt_info.make(opt_info.mlp().parameters(), state_format=suggested)


def test_ademamix_keeps_its_slow_momentum_out_of_4bit_lowrank():
    """The case that diverged (README, "Low-rank states and slow averages"): AdEMAMix's exp_avg_slow
    (beta3 = 0.9999) in 4bit-lowrank, which the MLP task's training left at a loss of 39, refused
    with the whole message; Lion's momentum (beta2 = 0.99) in it and AdEMAMix's with beta3 = 0.99 taken."""
    with pytest.raises(ValueError) as caught:
        lowbit_optim.AdEMAMix(make_mlp().parameters(), state_format="4bit-lowrank")
    expecttest.assert_expected_inline(str(caught.value), """the '4bit-lowrank' state format cannot hold AdEMAMix's exp_avg_slow, an average that keeps 0.9999 of itself per step: its rounding noise is drawn afresh at every write, and an average that keeps more than 0.99 per step gathers that noise faster than it lets it decay, growing without bound (README, "Low-rank states and slow averages"). Use a format without that limit for it, e.g. state_format={'exp_avg': '4bit-lowrank', 'exp_avg_slow': '10bit-sr', 'exp_avg_sq': '4bit-lowrank'}""")
    lowbit_optim.Lion(make_mlp().parameters(), state_format="4bit-lowrank")
    lowbit_optim.AdEMAMix(make_mlp().parameters(), betas=(0.9, 0.999, 0.99), state_format="4bit-lowrank")
    # the limit's own beta given as a float32 tensor (0.9900000095) is the 0.99 it was written as
    lowbit_optim.Lion(make_mlp().parameters(), betas=(torch.tensor(0.9), torch.tensor(0.99)), state_format="4bit-lowrank")


@pytest.mark.parametrize("cls, kwargs, fmt, refused", [
    (lowbit_optim.Lion, {}, "4bit-lowrank-mulaw", "Lion's exp_avg, an average that keeps 0.99"),  # beta2 (+318 %)
    (lowbit_optim.Lion, dict(betas=(0.99, 0.9)), "4bit-lowrank-mulaw", None),  # beta1 is no average's
    (lowbit_optim.SGD, dict(lr=0.1, momentum=0.99), "4bit-lowrank-mulaw", "SGD's momentum_buffer, an average that keeps 0.99"),
    (lowbit_optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.5), "4bit-lowrank-mulaw", None),  # dampening scales the input only
    (lowbit_optim.Muon, dict(momentum=0.99), "4bit-lowrank-mulaw", "Muon's momentum_buffer, an average that keeps 0.99"),
    (lowbit_optim.AdEMAMix, dict(betas=(0.97, 0.999, 0.9999)), "4bit-lowrank-mulaw", "AdEMAMix's exp_avg, an average that keeps 0.97"),
], ids=["lion-beta2", "lion-beta1", "sgd", "sgd-dampening", "muon", "ademamix-both"])  # fmt: skip
def test_each_optimizer_declares_the_beta_of_its_averages(cls, kwargs, fmt, refused):
    """Which beta each state's average keeps (State.decay), pinned against the optimizers' update
    rules: Lion's momentum moves by beta2, SGD's and Muon's by momentum, AdEMAMix's by beta1 and
    beta3. The suggested state_format is taken, also where two states are too slow (AdEMAMix)."""
    params = lambda: [nn.Parameter(torch.randn(64, 64))]  # noqa: E731 - a matrix: Muon takes nothing else
    if refused is None:
        cls(params(), **kwargs, state_format=fmt)
        return
    with pytest.raises(ValueError, match=re.escape(refused)) as caught:
        cls(params(), **kwargs, state_format=fmt)
    suggested = ast.literal_eval(str(caught.value).split("state_format=")[-1])
    cls(params(), **kwargs, state_format=suggested)
    if cls is lowbit_optim.AdEMAMix:
        assert suggested == {"exp_avg": "10bit-sr", "exp_avg_slow": "10bit-sr", "exp_avg_sq": fmt}


def test_a_checkpoint_with_slower_betas_is_refused():
    """load_state_dict takes the checkpoint's betas under this optimizer's formats: a beta3 of
    0.9999 loaded into a 4bit-lowrank AdEMAMix would be the divergent case, and is refused before
    anything is loaded."""
    source = lowbit_optim.AdEMAMix(make_mlp().parameters(), betas=(0.9, 0.999, 0.9999))
    train(make_mlp(), source, 0)
    target = lowbit_optim.AdEMAMix(make_mlp().parameters(), betas=(0.9, 0.999, 0.99), state_format="4bit-lowrank")
    with pytest.raises(ValueError, match=re.escape("param group 0 of this checkpoint: the '4bit-lowrank' state format cannot hold AdEMAMix's exp_avg_slow")):
        target.load_state_dict(source.state_dict())
    assert target.param_groups[0]["betas"] == (0.9, 0.999, 0.99)


@pytest.mark.parametrize("states, message", [
    ((lowbit_optim.State("step", signed=True),), "declares a state named 'step', a name lowbit_optim keeps for its own"),
    ((lowbit_optim.State("m", signed=True), lowbit_optim.State("m", signed=True)), "declares two states named 'm'"),
], ids=["reserved", "twice"])  # fmt: skip
def test_state_names_are_checked_when_the_class_is_made(states, message):
    """A state named as the step counter overwrote it (silently wrong steps, then a checkpoint that
    does not load); two states of one name shadowed each other."""
    with pytest.raises(TypeError, match=message):
        type("Custom", (lowbit_optim.AdamW,), {"states": states})


def test_an_incomplete_optimizer_class_says_what_it_lacks():
    """States without a step function are refused when the class is made (not as 'NoneType is not
    callable' at the first step); a state's ``when`` that names no option, when the optimizer is."""
    with pytest.raises(TypeError, match="NoStep declares states but no step_function: set step_function = staticmethod"):
        type("NoStep", (lowbit_optim.LowBitOptimizer,), {"states": (lowbit_optim.State("m", signed=True),)})
    when = type("When", (lowbit_optim.AdamW,), {"states": (*lowbit_optim.AdamW.states, lowbit_optim.State("extra", signed=True, when="nope"))})
    with pytest.raises(TypeError, match="When's state 'extra' exists when='nope', which is no option of its groups"):
        when(make_mlp().parameters())
    # a start that depends on the group (as ``decay`` does) crashed in torch.full at the first step
    with pytest.raises(TypeError, match="State 'sum': initial must be a number, the same for every group"):
        lowbit_optim.State("sum", signed=False, initial=lambda group: group["initial_accumulator_value"])


@pytest.mark.parametrize("path", [dict(), dict(fused=False)], ids=["default", "compiled"])
def test_an_optimizer_of_ones_own_that_writes_a_negative_value_into_a_nonnegative_state_is_told(path):
    """A state declared nonnegative (signed=False) that the step writes negative values into was kept
    at 0 by the compiled step, silently (eagerly copy_ refused it). An optimizer declared outside
    lowbit_optim runs each parameter's first step eagerly on copies too, so the mistake is named
    (also where opt.state[p] holds a key of the user's already); declared signed, it trains."""
    from lowbit_optim import precision

    def velocity_step(param, grad, step, velocity, param_extra, lr, momentum, *numbers, param_update, **flags):
        p = precision.read_param(param, param_extra, param_update)
        v = velocity.float() * momentum + grad.float()
        velocity.copy_(v)
        precision.write_param(param, param_extra, p, p - lr * v, param_update)

    class Declared(lowbit_optim.SGD):  # SGD's numbers and flags, a step and a state of its own
        step_function = staticmethod(velocity_step)
        states = (lowbit_optim.State("velocity", signed=True, when="momentum", decay=lambda group: group["momentum"]),)

    class MisDeclared(Declared):
        states = (lowbit_optim.State("velocity", signed=False, when="momentum", decay=lambda group: group["momentum"]),)

    for cls, touched in ((MisDeclared, False), (MisDeclared, True), (Declared, False)):
        param = torch.nn.Parameter(torch.zeros(300))
        opt = cls([param], lr=0.1, momentum=0.9, state_format="8bit", min_quantize_numel=0, **path)
        param.grad = torch.linspace(-1, 1, 300)
        if touched:  # a key of the user's in opt.state[param] before the first step
            opt.state[param]["note"] = 1
        if cls is MisDeclared:
            with pytest.raises(ValueError, match=r"negative value .* declare it State\(\.\.\., signed=True\)"):
                opt.step()
            continue
        for _ in range(2):
            opt.step()
        assert float(opt.state[param]["velocity"].dequantize()[0]) == pytest.approx(-1.9, rel=0.01)
