"""lowbit_optim behaves like torch.optim where users' code expects it: copies and pickles of the
optimizer, any default dtype, exact resume for every parameter dtype, state_dict round trips,
torch.optim's keywords, and ``opt.step()`` inside the user's ``torch.compile``d function.

Structure tests run the step eagerly or in the fused kernel (cheap); the compiled-training test
shares the default AdamW graphs of the rest of the suite.
"""

import collections
import contextlib
import copy
import functools
import io
import operator
import pathlib
import pickle
import re
import subprocess
import sys
import warnings

import numpy as np

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils.flop_counter import FlopCounterMode

import lowbit_optim
from conftest import all_formats, torch_setting
from optimizer_info import OPTIMIZERS
from test_optim import LR, assert_same_bits, make_mlp, moments, regression_data, save_and_load, train


def trained(spec, steps: int = 2, dtype=torch.float32, **kwargs):
    model = make_mlp(dtype=dtype)
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=spec, **kwargs)
    train(model, opt, steps)
    return model, opt


def assert_same_training(model_a, opt_a, model_b, opt_b) -> None:
    for a, b in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(a, b)
    expected = moments(opt_a, model_a)
    assert moments(opt_b, model_b).keys() == expected.keys()
    for key, state in moments(opt_b, model_b).items():
        assert type(state) is type(expected[key]) and state.dtype == expected[key].dtype, key
        assert_same_bits(state, expected[key], key)
    assert [float(s["step"]) for s in opt_b.state.values()] == [float(s["step"]) for s in opt_a.state.values()]


# ------------------------------------------------------------------------------------------------
# Copies: deepcopy, pickle and whole-object torch.save step like the original
# ------------------------------------------------------------------------------------------------

COPIES = {
    "deepcopy": copy.deepcopy,
    "pickle": lambda obj: pickle.loads(pickle.dumps(obj)),
    "torch.save": lambda obj: torch.load(io.BytesIO(_saved(obj)), weights_only=False),
}


def _saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("how", COPIES)
@pytest.mark.parametrize("kwargs", [dict(), dict(compile=False)], ids=["fused", "eager"])
def test_copies_step_like_the_original(how, kwargs):
    """A copy of (model, optimizer) trains on exactly like the original (EMA / rollback code and
    whole-object checkpoints depend on it), and is an optimizer of its own."""
    model, opt = trained("8bit", **kwargs)
    model_copy, opt_copy = COPIES[how]((model, opt))
    train(model, opt, 2)
    train(model_copy, opt_copy, 2)
    assert_same_training(model, opt, model_copy, opt_copy)
    assert opt_copy._step_op_key != opt._step_op_key


# ------------------------------------------------------------------------------------------------
# Nothing depends on the default dtype
# ------------------------------------------------------------------------------------------------


def default_dtype_set(dtype: torch.dtype):
    return torch_setting(torch.get_default_dtype, torch.set_default_dtype, dtype)


@pytest.mark.parametrize("default_dtype", [torch.bfloat16, torch.float64], ids=["bf16", "fp64"])
@all_formats
def test_default_dtype_changes_nothing(info, default_dtype):
    """Under torch.set_default_dtype(...) states are created and stepped exactly as under fp32: the
    step counter stays float32 (in bf16 it would stop at 256) and quantized states keep their block
    layout."""
    x, y = regression_data()
    runs = []
    for dtype in (torch.get_default_dtype(), default_dtype):
        model = make_mlp()
        with default_dtype_set(dtype):  # only the optimizer's work: the model and data stay fp32
            opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=info.spec)
        for _ in range(2):
            (model(x) - y).square().mean().backward()
            with default_dtype_set(dtype):
                opt.step()
            opt.zero_grad()
        runs += [model, opt]
    assert_same_training(*runs)
    assert all(s["step"].dtype == torch.float32 for s in opt.state.values())


# ------------------------------------------------------------------------------------------------
# Resume is bit-exact for every parameter dtype
# ------------------------------------------------------------------------------------------------


RESUME_IN_A_FRESH_PROCESS = """
import sys, torch, lowbit_optim
saved = torch.load(sys.argv[1], weights_only=True)
p = torch.nn.Parameter(saved["param"])
opt = lowbit_optim.AdamW([p], lr=1e-2, state_format="8bit", fused=False)
opt.load_state_dict(saved["opt"])
p.grad = saved["grad"]
opt.step()
torch.save(p.detach(), sys.argv[2])
"""


def test_a_checkpoint_resumes_on_the_compiled_step_in_a_fresh_process(tmp_path):
    """The usual resume: a new process loads a checkpoint and steps, its first codebook state the
    loaded one. The compiled step (fused=False, every GPU step) had failed there, its format's
    tables first built inside its trace ("Could not guard on data-dependent expression"); they are
    built when the optimizer takes the format now (and with real tensors inside a trace as well:
    test_formats.py)."""
    p = nn.Parameter(torch.randn(64, 96, generator=torch.Generator().manual_seed(0)))
    opt = lowbit_optim.AdamW([p], lr=1e-2, state_format="8bit", fused=False)
    p.grad = torch.randn(64, 96)
    opt.step()
    grad = torch.randn(64, 96)
    torch.save({"param": p.detach().clone(), "opt": opt.state_dict(), "grad": grad}, tmp_path / "checkpoint.pt")
    p.grad = grad
    opt.step()
    subprocess.run([sys.executable, "-c", RESUME_IN_A_FRESH_PROCESS, str(tmp_path / "checkpoint.pt"), str(tmp_path / "param.pt")], check=True, capture_output=True)
    assert torch.equal(torch.load(tmp_path / "param.pt", weights_only=True), p.detach())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("spec", ["fp32", "8bit", "4bit"])
def test_resume_is_exact_for_every_param_dtype(spec, dtype):
    """torch.optim.Optimizer.load_state_dict casts floating-point states to the parameter's dtype;
    the fp32 state of a small (unquantized) tensor of a bf16/fp16 model must not come back rounded."""
    model, opt = trained(spec, dtype=dtype, compile=False)
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.AdamW(resumed_model.parameters(), lr=LR, state_format=spec, compile=False)
    resumed.load_state_dict(save_and_load(opt.state_dict()))
    assert_same_training(model, opt, resumed_model, resumed)  # states as saved, in fp32
    train(model, opt, 2)
    train(resumed_model, resumed, 2)
    assert_same_training(model, opt, resumed_model, resumed)


def test_state_dict_round_trip_is_unchanged():
    """load_state_dict(state_dict()) gives back the same state_dict (no key gained or lost), with the
    param-group keys of torch.optim.AdamW."""
    model, opt = trained("8bit", compile=False)
    saved = opt.state_dict()
    reloaded = lowbit_optim.AdamW(copy.deepcopy(model).parameters(), lr=LR, state_format="8bit", compile=False)
    reloaded.load_state_dict(save_and_load(saved))
    assert reloaded.state_dict()["param_groups"] == saved["param_groups"]
    torch_keys = torch.optim.AdamW(make_mlp().parameters()).state_dict()["param_groups"][0].keys()
    assert torch_keys <= saved["param_groups"][0].keys()


# ------------------------------------------------------------------------------------------------
# torch.optim's keywords
# ------------------------------------------------------------------------------------------------


def test_adam_decoupled_weight_decay_is_adamw():
    """Adam(decoupled_weight_decay=True) is AdamW, as in torch >= 2.7; foreach, capturable=False and
    differentiable=False are accepted and change nothing."""
    steps = []
    for cls, kwargs in [(lowbit_optim.AdamW, {}), (lowbit_optim.Adam, dict(decoupled_weight_decay=True, foreach=True, capturable=False, differentiable=False))]:
        model = make_mlp()
        opt = cls(model.parameters(), lr=LR, weight_decay=0.1, state_format="8bit", **kwargs)
        train(model, opt, 2)
        steps.append((model, opt))
    assert_same_training(*steps[0], *steps[1])
    assert steps[1][1].state_dict()["param_groups"][0]["decoupled_weight_decay"] is True


@pytest.mark.parametrize("options", [{}, {"fused": False}, {"compile": False}], ids=["fused", "compiled", "eager"])
def test_a_lazily_negated_gradient_steps_as_its_values(options):
    """A gradient with torch's neg bit (z.conj().imag) is -memory: the kernel and inductor's code,
    which read memory, step with its values as torch.optim does."""
    steps = []
    for negated in (False, True):
        p = nn.Parameter(torch.linspace(-1, 1, 4096))
        opt = lowbit_optim.AdamW([p], lr=0.1, state_format="8bit", **options)
        g = torch.linspace(1, 2, 4096)
        p.grad = torch.complex(torch.zeros(4096), -g).conj().imag if negated else g
        assert p.grad.is_neg() == negated and torch.equal(p.grad, g)
        opt.step()
        steps.append(p.detach().clone())
    assert torch.equal(*steps)


@pytest.mark.parametrize("options", [{}, {"fused": False}], ids=["fused", "compiled"])
def test_a_state_whose_tensors_are_assigned_anew_steps_them(options):
    """state.codes = ... (a user's reset or repair) is what the next step reads and writes."""
    runs = []
    for reassign in (False, True):
        p = nn.Parameter(torch.linspace(-1, 1, 4096))
        opt = lowbit_optim.AdamW([p], lr=0.1, state_format="8bit", **options)
        for i in range(3):
            p.grad = torch.linspace(1, 2, 4096) * (i + 1)
            opt.step()
            state = opt.state[p]["exp_avg"]
            if reassign:
                state.codes, state.scale = state.codes.clone(), state.scale.clone()
        runs.append((p.detach().clone(), opt.state[p]["exp_avg"]))
    assert torch.equal(runs[0][0], runs[1][0])
    assert_same_bits(runs[1][1], runs[0][1], "exp_avg")


@pytest.mark.parametrize("source", ["lowbit_optim.Adam", "torch.optim.AdamW"])
def test_adam_resumes_the_checkpoints_decoupled_weight_decay(source):
    """Adam takes decoupled_weight_decay from a checkpoint, as torch.optim.Adam does (with its
    weight_decay: either alone would be a decay neither run used); AdamW stays decoupled."""
    def make(cls, params, **kwargs):
        return cls(params, lr=LR, **kwargs) if cls.__module__.startswith("torch") else cls(params, lr=LR, state_format="fp32", **kwargs)

    saved_cls = lowbit_optim.Adam if source == "lowbit_optim.Adam" else torch.optim.AdamW
    saved_kwargs = dict(weight_decay=0.5) | (dict(decoupled_weight_decay=True) if saved_cls is lowbit_optim.Adam else {})
    model = make_mlp()
    opt = make(saved_cls, model.parameters(), **saved_kwargs)
    train(model, opt, 2)
    checkpoint = save_and_load(opt.state_dict())
    runs = []
    for cls in (torch.optim.Adam, lowbit_optim.Adam):
        resumed_model = copy.deepcopy(model)
        resumed = make(cls, resumed_model.parameters())
        resumed.load_state_dict(copy.deepcopy(checkpoint))
        assert resumed.param_groups[0]["decoupled_weight_decay"] is True and resumed.param_groups[0]["weight_decay"] == 0.5
        train(resumed_model, resumed, 2)
        runs.append(resumed_model)
    train(model, opt, 2)
    for ours, theirs, uninterrupted in zip(runs[1].parameters(), runs[0].parameters(), model.parameters()):
        torch.testing.assert_close(ours, theirs)
        torch.testing.assert_close(ours, uninterrupted)
    adam = lowbit_optim.Adam(make_mlp().parameters(), lr=LR, weight_decay=0.5, state_format="fp32")
    adamw = lowbit_optim.AdamW(make_mlp().parameters(), lr=LR)
    adamw.load_state_dict(adam.state_dict())
    assert adamw.param_groups[0]["decoupled_weight_decay"] is True


# ------------------------------------------------------------------------------------------------
# opt.step() inside the user's torch.compile
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "compiled"])
def test_step_inside_torch_compile(fused):
    """PyTorch's documented pattern (``@torch.compile def fn(): opt.step()``): the step is one
    opaque op in the user's graph (step_op.py), with no graph break and no warning, and the same
    bits as calling opt.step() eagerly. Changing lr does not recompile."""
    check_step_inside_torch_compile(lambda params: lowbit_optim.AdamW(params, lr=LR, state_format="8bit", fused=fused), LR)
    # a CUDA graph (mode="reduce-overhead") must not capture it: its replays would skip the step's Python
    assert torch.Tag.cudagraph_unsafe in torch.ops.lowbit_optim.step.default.tags


def check_step_inside_torch_compile(make, lr: float, mlp=make_mlp) -> None:
    """The optimizers ``make(params)`` builds for two ``mlp()`` models, stepped by ``@torch.compile(
    fullgraph=True) def fn(): opt.step()`` and eagerly, one after the other for 3 steps with lr
    changed between them (test_optimizers.py runs it for every optimizer). After the first step
    nothing compiles again: not the user's function, nor the step's own compiled functions (the
    README's advice for error_on_recompile / set_stance("fail_on_recompile"))."""
    (model, opt), (reference_model, reference) = ((m, make(m.parameters())) for m in (mlp(), mlp()))
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))

    compiles = CompileCounterWithBackend("inductor")

    @torch.compile(fullgraph=True, backend=compiles)
    def compiled_step():
        opt.step()

    counters.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for m, o, step_fn in ((model, opt, compiled_step), (reference_model, reference, reference.step)):
            for step in range(3):
                with torch.compiler.set_stance("fail_on_recompile") if step else contextlib.nullcontext():
                    m(x).square().mean().backward()
                    step_fn()
                m.zero_grad()
                o.param_groups[0]["lr"] = lr / (step + 2)
    # torch's own warnings are not ours to fix: DeprecationWarnings (torch.jit inside inductor), and
    # on Python 3.13.0 dynamo's "Guards may run slower" (warned from torch's files)
    torch_files = str(pathlib.Path(torch.__file__).parent)
    ours = [w for w in caught if not issubclass(w.category, DeprecationWarning) and not w.filename.startswith(torch_files)]
    assert [str(w.message) for w in ours] == []
    assert sum(counters["graph_break"].values()) == 0
    assert compiles.frame_count == 1
    assert_same_training(reference_model, reference, model, opt)


DEFAULT_DEVICE_CASES = {
    "default": lambda model: lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit"),
    "fused": lambda model: lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", fused=True),
    "compiled": lambda model: lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", fused=False),
    # (its AdamW part's checks, before its Muon part steps, make that part's first states)
    "MuonWithAdamW": lambda model: lowbit_optim.MuonWithAdamW(model, muon=dict(lr=LR), adamw=dict(lr=LR, fused=True)),
}


@pytest.mark.parametrize("case", list(DEFAULT_DEVICE_CASES))
def test_a_default_device_around_the_step_places_nothing(case):
    """torch.set_default_device / ``with torch.device(...)`` around step() and load_state_dict()
    (here "meta", which holds no values) changes nothing: the tensors the optimizer makes without a
    device (step counters, as torch.optim's, scratch buffers) are on the CPU as without it. They
    landed there, and the step failed."""
    x, y = regression_data()
    runs = []
    for device in (None, "meta"):
        model = make_mlp()
        opt = DEFAULT_DEVICE_CASES[case](model)
        for _ in range(2):
            (model(x) - y).square().mean().backward()
            with torch.device(device) if device else contextlib.nullcontext():
                opt.step()
            opt.zero_grad()
        with torch.device(device) if device else contextlib.nullcontext():
            opt.load_state_dict(save_and_load(opt.state_dict()))
        runs.append((model, opt))
    assert {t.device.type for state in runs[1][1].state.values() for t in state.values()} == {"cpu"}
    assert_same_training(*runs[0], *runs[1])


def test_a_step_under_a_torch_dispatch_mode_runs_eagerly():
    """Under a TorchDispatchMode (FlopCounterMode counting a training step's flops) dynamo skips the
    compiled step's frames, which it refused ("found no compiled frames"): the step takes the same
    formulas eagerly, with compile=False's bits, as torch.optim steps there."""
    x, y = regression_data()
    runs = []
    for options, mode in ((dict(fused=False), FlopCounterMode(display=False)), (dict(compile=False), contextlib.nullcontext())):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit", **options)
        for _ in range(2):
            (model(x) - y).square().mean().backward()
            with mode:
                opt.step()
            opt.zero_grad()
        runs.append((model, opt))
    assert_same_training(*runs[0], *runs[1])


def test_a_refused_step_inside_torch_compile_raises_its_own_error():
    """A state set by hand to a number, stepped inside the user's torch.compile: the step's own
    TypeError, as outside (raised where dynamo traced the step, making its states, it came wrapped
    as dynamo's internal error)."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")
    x, y = regression_data()
    (model(x) - y).square().mean().backward()
    opt.step()
    opt.state[model[0].weight]["exp_avg_sq"] = 0.5
    with pytest.raises(TypeError, match=r"the 'exp_avg_sq' state of a parameter of shape \(64, 96\) is 0.5, not a tensor"):
        torch.compile(lambda: opt.step())()


def test_grad_scaler_skips_non_finite_steps():
    """torch.amp.GradScaler drives the optimizer as it drives torch.optim: scaled gradients are
    unscaled before the step, and a step with a non-finite gradient (which would poison a whole block
    of state) is skipped, leaving parameters and states untouched."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y = regression_data()
    for poison in (False, True):
        before = copy.deepcopy((model, opt))
        scaler.scale((model(x) - y).square().mean()).backward()
        if poison:
            model[0].weight.grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    assert_same_training(*before, model, opt)
    assert all(float(s["step"]) == 1 for s in opt.state.values())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_inside_torch_compile_follows_replaced_params():
    """Wrappers such as accelerate's FSDP2 preparation replace the tensors in param_groups directly
    (not through add_param_group): the compiled step then steps the new parameters, not the old."""
    old, new = make_mlp(), make_mlp(seed=1)
    opt = lowbit_optim.AdamW(old.parameters(), lr=LR, state_format="8bit")
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(0))

    @torch.compile(fullgraph=True)
    def compiled_step():
        opt.step()

    opt.param_groups[0]["params"] = list(new.parameters())
    before = [p.detach().clone() for p in (*old.parameters(), *new.parameters())]
    for m in (old, new):
        m(x).square().mean().backward()
    compiled_step()
    after = [p.detach() for p in (*old.parameters(), *new.parameters())]
    changed = [not torch.equal(a, b) for a, b in zip(before, after)]
    assert changed == [False] * 4 + [True] * 4


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "compiled"])
def test_gradients_set_inside_torch_compile(fused):
    """A torch.compile'd function that sets the gradients itself (``p.grad = g``, as after
    ``torch.autograd.grad``) and calls opt.step(): dynamo sets them on the parameters only after its
    graph has run, so the step op steps the parameters that had gradients when it was traced, with
    the gradients it was given. The same bits as eager."""
    (model, opt), (reference_model, reference) = ((m, lowbit_optim.AdamW(m.parameters(), lr=LR, state_format="8bit", fused=fused)) for m in (make_mlp(), make_mlp()))
    x, y = regression_data()

    @torch.compile
    def compiled_step(grads):
        for p, g in zip(model.parameters(), grads):
            p.grad = g
        opt.step()

    for _ in range(3):
        for m, step in ((model, compiled_step), (reference_model, None)):
            grads = torch.autograd.grad((m(x) - y).square().mean(), list(m.parameters()))
            if step is None:
                for p, g in zip(m.parameters(), grads):
                    p.grad = g
                reference.step()
            else:
                step(grads)
    assert_same_training(reference_model, reference, model, opt)


def test_groups_edited_inside_torch_compile_before_the_step():
    """A compiled function that sets lr and betas, then calls opt.step(): dynamo writes the edits
    back only after its graph has run, so the step op would read last step's values (lr 0 moved
    the weights). The step breaks the graph there and steps as eager does; under fullgraph=True it
    is refused with the fix. Edits outside the function still recompile nothing."""
    x, y = regression_data()
    runs = []
    for compiled in (False, True):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")

        def set_and_step(lr, beta1):
            for group in opt.param_groups:
                group["lr"], group["betas"] = lr, (beta1, 0.999)
            opt.step()

        step = torch.compile(set_and_step) if compiled else set_and_step
        moved = []
        for lr, beta1 in ((LR, 0.9), (0.0, 0.5), (LR / 2, 0.8), (0.0, 0.9)):
            before = [p.detach().clone() for p in model.parameters()]
            (model(x) - y).square().mean().backward()
            step(lr, beta1)
            opt.zero_grad()
            moved.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters())))
        assert moved == [True, False, True, False]
        runs.append((model, opt))
    assert_same_training(*runs[0], *runs[1])

    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")
    (model(x) - y).square().mean().backward()

    @torch.compile(fullgraph=True)
    def set_lr_and_step(lr):
        opt.param_groups[0]["lr"] = lr
        opt.step()

    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"param_groups of AdamW were edited inside .* tensor lr and fill_\(\) it"):
        set_lr_and_step(0.0)

    other = lowbit_optim.AdamW(make_mlp().parameters(), lr=LR, state_format="8bit")
    for p in other.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)

    @torch.compile(fullgraph=True)
    def step_then_edit_then_step_another(lr):  # as a scheduler's step between two optimizers' steps
        opt.step()
        opt.param_groups[0]["lr"] = lr
        other.step()

    step_then_edit_then_step_another(LR / 2)
    assert opt.param_groups[0]["lr"] == LR / 2


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "compiled"])
def test_tensor_options_filled_inside_torch_compile_before_the_step(fused):
    """The fix the refusal above names: a tensor lr (and tensor betas) fill_()ed in the compiled
    function before opt.step(), under fullgraph=True. Dynamo writes the fill back only after its
    graph has run; the step op takes the tensors as inputs, so each step uses the values just set,
    as eager does (it used the previous step's: the first step ran at lr 0). Edits after the step
    and new values recompile nothing."""
    x, y = regression_data()
    runs = []
    for compiled in (False, True):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=torch.tensor(0.0), betas=(torch.tensor(0.0), 0.999), state_format="8bit", fused=fused)
        group = opt.param_groups[0]

        def set_and_step(lr, beta1):
            group["lr"].fill_(lr)
            group["betas"][0].fill_(beta1)
            opt.step()

        compiles = CompileCounterWithBackend("inductor")
        step = torch.compile(set_and_step, fullgraph=True, backend=compiles) if compiled else set_and_step
        for lr, beta1 in ((LR, 0.9), (LR / 2, 0.5), (2 * LR, 0.8)):
            (model(x) - y).square().mean().backward()
            step(torch.tensor(lr), torch.tensor(beta1))
            opt.zero_grad()
        assert not compiled or compiles.frame_count == 1
        runs.append((model, opt))
    assert_same_training(*runs[0], *runs[1])


def test_states_used_inside_torch_compile_around_the_step():
    """The step op does not declare the states it writes: a momentum edited in the compiled function
    before opt.step() was lost, and a read after it gave the value before it (a logged update of 0).
    Where the graph has taken a state before the step, the step breaks the graph (refused under
    fullgraph=True); a read after the step only, in a new graph input, sees the stepped state."""
    x, y = regression_data()
    runs = []
    for compiled in (False, True):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")
        weight = model[0].weight

        def damp_step_and_measure():
            momentum = opt.state[weight]["exp_avg"]
            before = momentum.dequantize()
            momentum.mul_(0.5)
            opt.step()
            return (opt.state[weight]["exp_avg"].dequantize() - before).norm()

        def step_and_read():
            opt.step()
            return opt.state[weight]["exp_avg_sq"].dequantize().sum()

        changes, reads = [], []
        for fn, out in ((damp_step_and_measure, changes), (step_and_read, reads), (damp_step_and_measure, changes)):
            (model(x) - y).square().mean().backward()
            if fn is damp_step_and_measure and not opt.state:  # the first step makes the states
                opt.step()
                opt.zero_grad()
                (model(x) - y).square().mean().backward()
            out.append((torch.compile(fn) if compiled else fn)())
            opt.zero_grad()
        runs.append((model, opt, changes, reads))
    (model, opt, changes, reads), (c_model, c_opt, c_changes, c_reads) = runs
    assert all(float(c) > 0 for c in c_changes)
    torch.testing.assert_close(c_changes, changes, rtol=1e-5, atol=0)  # (norms and sums: compiled reductions)
    torch.testing.assert_close(c_reads, reads, rtol=1e-5, atol=0)
    assert_same_training(model, opt, c_model, c_opt)

    @torch.compile(fullgraph=True)
    def damp_and_step():
        opt.state[model[0].weight]["exp_avg"].mul_(0.5)
        opt.step()

    @torch.compile(fullgraph=True)
    def reset_and_step():  # an assignment, written back after the graph: it overwrote the step's update
        opt.state[model[0].weight]["exp_avg"] = torch.zeros_like(model[0].weight)
        opt.step()

    (model(x) - y).square().mean().backward()
    for refused in (damp_and_step, reset_and_step):
        with pytest.raises(torch._dynamo.exc.Unsupported, match=r"AdamW's states are used inside this torch.compile'd function before its step\(\)"):
            refused()


def test_states_read_after_a_first_step_inside_torch_compile():
    """A state read after opt.step() in a fullgraph=True function, from the first call on: the
    states a first step makes are made where dynamo traces the step (missing there, they failed
    every call, none of which stepped). Reads and training are the eager ones."""
    x, y = regression_data()
    runs = []
    for compiled in (False, True):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")

        def step_and_read():
            opt.step()
            return opt.state[model[0].weight]["exp_avg"].dequantize().abs().sum()

        step_fn = torch.compile(step_and_read, fullgraph=True) if compiled else step_and_read
        reads = []
        for _ in range(3):
            (model(x) - y).square().mean().backward()
            reads.append(step_fn())
            opt.zero_grad()
        runs.append((model, opt, reads))
    (model, opt, reads), (c_model, c_opt, c_reads) = runs
    torch.testing.assert_close(c_reads, reads, rtol=1e-5, atol=0)  # (sums: compiled reductions)
    assert_same_training(model, opt, c_model, c_opt)


def test_another_optimizers_states_used_before_a_step_break_nothing():
    """Optimizers given to the compiled function as arguments (dynamo makes their keys symbolic):
    one's state logged between the two steps is the other's business, under fullgraph=True."""
    x, y = regression_data()
    models = [make_mlp(), make_mlp()]
    first, second = (lowbit_optim.AdamW(m.parameters(), lr=LR, state_format="8bit", compile=False) for m in models)

    def train_step(first, second, weight):
        first.step()
        norm = first.state[weight]["exp_avg"].dequantize().norm()
        second.step()
        return norm

    compiled = torch.compile(train_step, fullgraph=True, backend="eager", dynamic=True)
    for step in (lambda *_: first.step() or second.step() or torch.ones(()), compiled, compiled):  # (the first step makes the states)
        for m in models:
            (m(x) - y).square().mean().backward()
        assert float(step(first, second, models[0][0].weight)) > 0
        first.zero_grad()
        second.zero_grad()


def test_a_refused_edit_steps_no_group():
    """An edit a step refuses (a group's lr made negative) is found before any group is stepped,
    MuonWithAdamW's two optimizers' too: fixed and stepped again, nothing is stepped twice."""
    first, second = nn.Parameter(torch.ones(8)), nn.Parameter(torch.ones(8))
    opt = lowbit_optim.AdamW([{"params": [first]}, {"params": [second]}], lr=LR)
    first.grad, second.grad = torch.ones(8), torch.ones(8)
    opt.param_groups[1]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"param group 1, as edited since it was built: invalid learning rate -1.0"):
        opt.step()
    assert torch.equal(first, torch.ones(8)) and not opt.state
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 2))
    wrapped = lowbit_optim.MuonWithAdamW(model, compile=False)
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    wrapped.adamw.param_groups[0]["eps"] = -1.0
    index = len(wrapped.muon.param_groups)  # in wrapped.param_groups, after Muon's
    with pytest.raises(ValueError, match=rf"param group {index} \(opt.adamw.param_groups\[0\]\), as edited since it was built: invalid eps -1.0"):
        wrapped.step()
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


@pytest.mark.parametrize("where", ["the caller's list", "the group's list"])
def test_a_list_value_edited_in_place_is_checked(where):
    """betas given as a list and then edited in place (the caller's list, or the group's) is an edit
    the next step checks, as a list replaced by another would be."""
    betas = [0.9, 0.999]
    p = nn.Parameter(torch.ones(8))
    opt = lowbit_optim.AdamW([p], lr=LR, betas=betas, compile=False)
    p.grad = torch.ones(8)
    opt.step()
    (betas if where == "the caller's list" else opt.param_groups[0]["betas"])[1] = 1.5
    with pytest.raises(ValueError, match=r"as edited since it was built: invalid betas \[0.9, 1.5\]"):
        opt.step()


def test_step_in_a_fullgraph_function_with_a_scheduler_attached():
    """A scheduler wraps opt.step in a function dynamo will not trace (README): ``type(opt).step(opt)``
    compiles with fullgraph=True and steps as eager opt.step() does, the scheduler's lr included."""
    x, y = regression_data()
    runs = []
    for compiled in (False, True):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format="8bit")
        scheduler = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        step = torch.compile(lambda: type(opt).step(opt), fullgraph=True) if compiled else opt.step
        for _ in range(3):
            (model(x) - y).square().mean().backward()
            step()
            opt.zero_grad()
            with warnings.catch_warnings():  # the compiled run's: it saw no wrapped opt.step()
                warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler.step\(\)` before `optimizer.step\(\)`")
                scheduler.step()
        runs.append((model, opt))
    assert runs[1][1].param_groups[0]["lr"] == LR / 8
    assert_same_training(*runs[0], *runs[1])


@pytest.mark.parametrize("positions", [[0, 5], [-1, 0], [0, 0]], ids=["past the end", "negative", "twice"])
def test_step_op_refuses_positions_that_are_no_parameters(positions):
    """The step op steps the parameters at the positions its graph was traced with; positions that
    no longer name distinct parameters (edited param_groups, or a direct call) are refused."""
    params = [nn.Parameter(torch.randn(4)) for _ in range(2)]
    opt = lowbit_optim.AdamW(params)
    tensors = [params[i % 2] for i in positions]
    with pytest.raises(RuntimeError, match="the parameters of this optimizer changed after a torch.compile'd function"):
        torch.ops.lowbit_optim.step(opt._step_op_key, tensors, [torch.ones(4) for _ in positions], positions, [], opt._option_places()[0])


@pytest.mark.parametrize("key_shift, places_shift", [(10**9, 0), (0, 10**9), (0, -10**9)], ids=["key", "places", "negative places"])
def test_step_op_refuses_keys_of_no_live_optimizer(key_shift, places_shift):
    """A key or option-places index no graph of a live optimizer holds (a direct call) is refused by
    name, not a raw KeyError or IndexError (or a negative index taken from the end)."""
    param = nn.Parameter(torch.randn(4))
    opt = lowbit_optim.AdamW([param])
    with pytest.raises(RuntimeError, match="is no live optimizer's: the op is emitted by step"):
        torch.ops.lowbit_optim.step(opt._step_op_key + key_shift, [param], [torch.ones(4)], [0], [], opt._option_places()[0] + places_shift)


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "compiled"])
def test_sgd_momentum_switched_off_and_on_again(fused):
    """A scheduler may take SGD's momentum to 0 and back (CyclicLR with base_momentum=0): as
    torch.optim.SGD, the buffer then waits untouched and the step goes on from it when momentum
    returns (not as a first step); its counter counts the steps that used it."""
    model, reference_model = make_mlp(), make_mlp()
    opt = lowbit_optim.SGD(model.parameters(), lr=LR, momentum=0.9, state_format="fp32", fused=fused)
    reference = torch.optim.SGD(reference_model.parameters(), lr=LR, momentum=0.9)
    x, y = regression_data()
    for momentum in (0.9, 0.9, 0.0, 0.0, 0.5, 0.9):
        for m, o in ((model, opt), (reference_model, reference)):
            o.param_groups[0]["momentum"] = momentum
            (m(x) - y).square().mean().backward()
            o.step()
            o.zero_grad()
    for p, q in zip(model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], rtol=1e-6, atol=1e-7)
    assert {float(s["step"]) for s in opt.state.values()} == {4.0}


def test_a_refused_param_group_is_not_added():
    """add_param_group that raises leaves the optimizer as it was (torch.optim checks before it
    adds): the refused parameters are not stepped, and the group can be added again once fixed."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model[0].parameters(), lr=LR)
    for bad in (dict(state_format="9bit"), dict(betas=(1.5, 0.9)), dict(params=[nn.Parameter(torch.randn(4, dtype=torch.float64))])):
        with pytest.raises((ValueError, TypeError)):
            opt.add_param_group({"params": list(model[2].parameters()), **bad})
        assert len(opt.param_groups) == 1
    opt.add_param_group({"params": list(model[2].parameters()), "state_format": "8bit"})
    assert len(opt.param_groups) == 2


def test_numpy_and_tensor_hyper_parameters():
    """Numbers as NumPy scalars (np.float32 lr and betas, which are not Python floats) train as the
    Python floats they hold, and one-element tensor betas are accepted, as torch.optim accepts them."""
    runs = []
    for lr, betas in ((float(np.float32(LR)), (float(np.float32(0.9)), 0.999)), (np.float32(LR), (np.float32(0.9), np.float64(0.999)))):
        model = make_mlp()
        opt = lowbit_optim.AdamW(model.parameters(), lr=lr, betas=betas, state_format="8bit")
        train(model, opt, 3)
        assert all(isinstance(v, float) for v in (opt.param_groups[0]["lr"], *opt.param_groups[0]["betas"]))  # np.float32 is not one
        runs.append((model, opt))
    assert_same_training(*runs[0], *runs[1])
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, betas=(torch.tensor(0.9), torch.tensor(0.999)), state_format="8bit")
    losses = train(model, opt, 3)
    assert losses[-1] < losses[0]


# a sequence that is no tuple or list and a mapping that is no dict, as OmegaConf's ListConfig and
# DictConfig (what Hydra's instantiate passes)
ConfigList, ConfigDict = collections.UserList, collections.UserDict


@pytest.mark.parametrize("sequence", [ConfigList, np.array, torch.tensor], ids=["config list", "numpy array", "tensor"])
def test_options_from_a_config_train_as_tuples_and_dicts(sequence):
    """betas, ns_coefficients and a per-state state_format as a config file's containers (a sequence
    that is no tuple or list, a 1-D NumPy array, a mapping that is no dict) are read as torch.optim
    reads them: the group holds them as a tuple and a dict of names, and trains as with those."""
    cases = [
        (lowbit_optim.AdamW, dict(betas=(0.9, 0.95), state_format={"exp_avg": "8bit", "exp_avg_sq": "4bit"})),
        (lowbit_optim.AdEMAMix, dict(betas=(0.9, 0.95, 0.999))),
        (lowbit_optim.Muon, dict(ns_coefficients=(3.4445, -4.775, 2.0315), weight_decay=0.0)),
    ]
    for cls, options in cases[:2] if sequence is torch.tensor else cases:  # (Muon's coefficients are Python numbers)
        runs = []
        for config in (False, True):
            model = make_mlp(bias=False)
            if sequence is torch.tensor:  # a tensor's betas are fp32, as one-element tensors: the reference's too
                options = {k: tuple(torch.tensor(v)) if isinstance(v, tuple) else v for k, v in options.items()}
            given = {k: (ConfigDict(v) if isinstance(v, dict) else sequence(v) if isinstance(v, tuple) else v) if config else v for k, v in options.items()}
            opt = cls(model.parameters(), **given, compile=False)
            group = opt.param_groups[0]
            assert all(type(group[k]) is type(v) and all(map(operator.eq, group[k], v)) if isinstance(v, tuple) else group[k] == v for k, v in options.items())
            train(model, opt, 2)
            save_and_load(opt.state_dict())  # (weights_only: NumPy's float64, a float subclass, as a float)
            opt.param_groups[0].update({k: sequence(v) for k, v in options.items() if isinstance(v, tuple)})  # edited to equal values
            train(model, opt, 1)
            assert all(type(opt.param_groups[0][k]) is tuple for k, v in options.items() if isinstance(v, tuple))
            runs.append((model, opt))
        assert_same_training(*runs[0], *runs[1])


def test_one_element_numpy_options_stay_as_given():
    """A NumPy array of one number for a number option (weight_decay, eps) is read as before, not
    made a tuple (only options whose default is a tuple, betas, are)."""
    model = make_mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=LR, weight_decay=np.array([0.01]), eps=np.array([1e-8]), compile=False)
    train(model, opt, 1)
    assert isinstance(opt.param_groups[0]["weight_decay"], np.ndarray) and isinstance(opt.param_groups[0]["eps"], np.ndarray)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: lowbit_optim.AdamW(p, betas=torch.tensor([[0.9, 0.999]])), "Adam takes two, (beta1, beta2), e.g. (0.9, 0.999); a torch.float32 tensor of shape (1, 2) on cpu given (pass a tuple)"),
        (lambda p: lowbit_optim.Lion(p, betas=(0.9, 0.99, 0.999)), "Lion takes two, (beta1, beta2), e.g. (0.9, 0.99); 3 given"),
        (lambda p: lowbit_optim.Muon(p, ns_coefficients=(3.4445, -4.775)), "Muon takes three numbers (a, b, c), e.g. (3.4445, -4.775, 2.0315); 2 given"),
        (lambda p: lowbit_optim.Muon(p, ns_coefficients=("3.4", -4.775, 2.0)), "Muon takes three numbers (a, b, c), e.g. (3.4445, -4.775, 2.0315); each a Python number"),
    ],
    ids=["tensor betas", "three betas for two", "two coefficients", "a string coefficient"],
)
def test_a_wrong_sequence_option_says_what_was_given(make, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        make([nn.Parameter(torch.randn(4, 4))])


def test_namedtuple_group_values():
    """A namedtuple as a group's value (betas from a config, a key of the user's own) is kept as
    that namedtuple, its NumPy numbers made Python numbers, as torch.optim keeps it."""
    Betas = collections.namedtuple("Betas", "beta1 beta2")
    Tag = collections.namedtuple("Tag", "name layer")
    model = make_mlp()
    opt = lowbit_optim.AdamW([{"params": model[0].parameters(), "tag": Tag("first", 0)}], betas=Betas(np.float32(0.9), 0.999), compile=False)
    opt.add_param_group({"params": list(model[2].parameters()), "betas": Betas(0.8, 0.99), "tag": Tag("last", 2)})
    first, last = opt.param_groups
    assert first["betas"] == Betas(float(np.float32(0.9)), 0.999) and type(first["betas"][0]) is float
    assert type(first["betas"]) is Betas and first["tag"] == Tag("first", 0) and last["tag"] == Tag("last", 2)
    train(model, opt, 1)



@pytest.mark.parametrize(
    "make",
    [functools.partial(lambda info, model: info.make(model.parameters(), state_format="8bit", compile=False), info) for info in OPTIMIZERS]
    + [lambda model: lowbit_optim.MuonWithAdamW(model, state_format="8bit", min_quantize_numel=0, compile=False)],
    ids=[info.name for info in OPTIMIZERS] + ["MuonWithAdamW"],
)
def test_a_state_entry_read_before_any_step_round_trips(make):
    """Reading ``opt.state[p]`` of a parameter that has not stepped (a frozen one, or one before its
    first step) gives ``{}`` and keeps it, as torch.optim's defaultdict does: the checkpoint that
    saves it loads, and the parameter's first step after the load is a first step in both runs."""
    model = make_mlp(bias=False)
    opt = make(model)
    first, later = list(model.parameters())
    assert opt.state[first] == {} and first in opt.state
    later.grad = torch.ones_like(later)
    opt.step()
    resumed_model = copy.deepcopy(model)
    resumed = make(resumed_model)
    resumed.load_state_dict(save_and_load(opt.state_dict()))
    for m, o in ((model, opt), (resumed_model, resumed)):
        for p in m.parameters():
            p.grad = torch.linspace(-1, 1, p.numel()).view_as(p)
        o.step()
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    assert float(resumed.state[next(resumed_model.parameters())]["step"]) == 1
