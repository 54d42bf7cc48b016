"""Corrupt state never reaches the fused C kernel, which reads and writes every tensor through a raw
pointer, trusting its size.

A checkpoint is data from a file: a quantized state whose inner tensors do not fit its shape must be
refused when it is loaded, with an error naming the parameter, and the kernel's entry point checks
every tensor again at each step (the state may have been changed since). A gradient of another shape
(assigned through ``.data``, which autograd does not check) is refused by every step path.

The fuzz cases and the kernel's entry-point cases run in a child process (``python
test/test_validation.py``), so that a crash, the bug these tests guard against, fails the tests
instead of killing pytest.
"""

import copy
import importlib
import io
import json
import os
import pathlib
import random
import re
import subprocess
import sys

import pytest
import torch

import lowbit_optim
from conftest import QUANTIZED_FORMATS, ROOT, FormatInfo, quantized_formats
from lowbit_optim import FactoredState, OptimState, OptimState8bit, StateTensor, fused_cpu
from lowbit_optim.formats import get_format, registered_formats
from test_optim import assert_same_bits

# a quantized weight whose last block is padded, and a bias small enough to keep fp32 state
SHAPES = [(70, 64), (96,)]  # 4480 elements: whole 128-blocks (4bit-torchao quantizes it), a padded last 256-block
OPTIONS = dict(lr=1e-2, amsgrad=True, min_quantize_numel=256)


def options_for(spec) -> dict:
    """OPTIONS, but without amsgrad's running maximum where exp_avg_sq's format cannot hold it (factored)."""
    fmt = lowbit_optim.formats.get_format(spec["exp_avg_sq"] if isinstance(spec, dict) else spec)
    return OPTIONS | {"amsgrad": fmt.holds_elements}
CHECKED = "exp_avg_sq"  # quantized in every quantized format's spec (factored holds only this one)


# the fuzz runs once, in a child process a module fixture starts: under `--dist loadgroup` (the README's
# command) every test of this file runs in one worker, which starts it once
pytestmark = pytest.mark.xdist_group("test_validation")


def make_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]


def set_grads(params) -> None:
    generator = torch.Generator().manual_seed(1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)


def save(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def load(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)


def checkpoint(spec) -> bytes:
    """The saved state dict of a small model after one (eager) step."""
    params = make_params()
    opt = lowbit_optim.AdamW(params, state_format=spec, compile=False, **options_for(spec))
    set_grads(params)
    opt.step()
    return save(opt.state_dict())


def kernel_steps(spec) -> bool:
    """Whether the fused kernel steps every format of ``spec`` (each declares a kernel layout); a
    format without one (a custom encoding) takes the compiled step, and the kernel never gets it."""
    names = spec.values() if isinstance(spec, dict) else [spec]
    formats = [lowbit_optim.formats.get_format(name) for name in names]
    return all(f.kernel_layout(signed) is not None for f in formats if isinstance(f, type) for signed in ((True, False) if f.holds_signed else (False,)))


def fresh_optimizer(spec):
    params = make_params()
    return params, lowbit_optim.AdamW(params, state_format=spec, fused=True if kernel_steps(spec) else None, **options_for(spec))


def non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """The same values with a stride of 2."""
    return torch.stack([t, t], -1).select(-1, 0)


# ---- corrupt checkpoints are refused on load, naming the parameter -----------------------------


def _inner(state: StateTensor, index: int) -> str:
    return state.inner_names[index]  # codes / scale, a factored state's row / col, or bf16-sr's values / writes


def _bad_metadata(state: StateTensor) -> None:
    if isinstance(state, OptimState):
        state.block_size //= 2
    elif isinstance(state, FactoredState):
        state.part = "yes"
    else:
        pytest.skip(f"{type(state).__name__} keeps no block_size or part to corrupt")


CORRUPTIONS = {
    "short codes": (lambda s: setattr(s, _inner(s, 0), getattr(s, _inner(s, 0))[:-1]), "elements"),
    "short scale": (lambda s: setattr(s, _inner(s, 1), getattr(s, _inner(s, 1))[:-1]), "elements"),
    "wrong dtype": (lambda s: setattr(s, _inner(s, 1), getattr(s, _inner(s, 1)).double()), r"must be a 1-D contiguous torch\.(float32|int64) tensor"),
    "non-contiguous": (lambda s: setattr(s, _inner(s, 0), non_contiguous(getattr(s, _inner(s, 0)))), "not a non-contiguous"),
    "2-D codes": (lambda s: setattr(s, _inner(s, 0), getattr(s, _inner(s, 0)).view(1, -1)), "must be a 1-D"),
    "wrong block_size": (_bad_metadata, "elements|part is 'yes'"),
    "signed not a bool": (lambda s: setattr(s, "signed", 1), "signed is 1, not a bool"),
    "signed missing": (lambda s: delattr(s, "signed"), "signed is None, not a bool"),
    "signed flipped": (lambda s: setattr(s, "signed", not s.signed), "a signed state, where it holds a nonnegative one"),
    # memory that does not hold the values as read: inductor's code and the kernel read it directly
    "a state as codes": (lambda s: setattr(s, _inner(s, 0), state_dressed_as(getattr(s, _inner(s, 0)))), "is a OptimState8bit, not a plain tensor"),
    "a negated view as scale": (lambda s: setattr(s, _inner(s, 1), (-getattr(s, _inner(s, 1)))._neg_view()), "lazily negated"),
}


def state_dressed_as(t: torch.Tensor) -> StateTensor:
    """An 8-bit state that looks like ``t`` (a 1-D tensor of its dtype and size), not its memory."""
    inner = OptimState8bit.zeros(t.numel(), signed=False)
    return OptimState8bit(inner.codes, inner.scale, t.shape, 256, False, dtype=t.dtype)


@quantized_formats
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_checkpoint_state_is_refused(info, corruption):
    corrupt, message = CORRUPTIONS[corruption]
    state_dict = load(checkpoint(info.spec))
    corrupt(state_dict["state"][0][CHECKED])
    _, opt = fresh_optimizer(info.spec)
    with pytest.raises(ValueError, match=rf"checkpoint state '{CHECKED}' of parameter 0 \(shape \(70, 64\)\) is corrupt: .*({message})"):
        opt.load_state_dict(load(save(state_dict)))


@quantized_formats
@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_corrupt_dcp_checkpoint_state_is_refused(info, corruption, tmp_path):
    """The same corruptions in a torch.distributed.checkpoint: its load copies each saved state into
    the optimizer's (distributed.ShardView, or a state's copy_ where DCP does not view it in rows),
    and a saved state is refused before anything reads it."""
    import torch.distributed.checkpoint as dcp

    corrupt, message = CORRUPTIONS[corruption]
    state_dict = load(checkpoint(info.spec))
    if not isinstance(state_dict["state"][0][CHECKED], OptimState) and corruption in ("signed missing", "signed flipped"):
        # DCP saves such a state (factored, bf16-sr) detached, which needs its metadata; its values do not depend on the flag
        pytest.skip(f"dcp.save cannot write a {info.name} state whose signed is missing; a flipped one is read alike")
    corrupt(state_dict["state"][0][CHECKED])
    dcp.save(state_dict, checkpoint_id=tmp_path, no_dist=True)
    params, opt = fresh_optimizer(info.spec)
    set_grads(params)
    opt.step()  # states to load into
    target = opt.state_dict()
    with pytest.raises(dcp.api.CheckpointException) as refused:  # (DCP's, a BaseException, holds the error and its traceback)
        dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    assert re.search(rf"(quantized state in the checkpoint|copy_ from a checkpoint's state, which is corrupt).*({message})", str(refused.value)), str(refused.value)[:3000]


@pytest.mark.parametrize(
    "value, message",
    [
        (torch.zeros(70, 64, dtype=torch.int32), "has dtype torch.int32, not a floating-point dtype"),
        (torch.zeros(69, 64), "has shape \\(69, 64\\) but the parameter has shape \\(70, 64\\)"),
        ([0.0] * 4544, "is a list, not a tensor"),
        (torch.zeros(1).expand(70, 64), "is a view whose elements share memory \\(strides \\(0, 0\\)\\)"),
        (torch.zeros(70, 64).to_sparse(), "is a torch.sparse_coo tensor, not a dense one"),
        (torch.zeros(70, 64, device="meta"), "is on the meta device"),
        (torch.zeros(70, 64)._neg_view(), "lazily negated"),
    ],
    ids=["integer", "another shape", "not a tensor", "expanded", "sparse", "meta", "negated view"],
)
def test_plain_checkpoint_state_is_checked(value, message):
    state_dict = load(checkpoint("fp32"))
    state_dict["state"][0]["exp_avg"] = value
    _, opt = fresh_optimizer("fp32")
    with pytest.raises(ValueError, match=rf"checkpoint state 'exp_avg' of parameter 0 .*{message}"):
        opt.load_state_dict(load(save(state_dict)))


@pytest.mark.parametrize(
    "ids, message",
    [
        ([0, 0], r"the checkpoint's param groups list parameter 0 twice: it is corrupt"),
        ([5, 6], r"the checkpoint holds states of parameters \[0, 1\] that no param group lists \(it lists \[5, 6\]\)"),
    ],
    ids=["listed twice", "states unlisted"],
)
def test_checkpoint_parameter_ids_name_each_state_once(ids, message):
    """torch.optim loads one state into two parameters, or none (its parameters start over, silently)."""
    state_dict = load(checkpoint("8bit"))
    state_dict["param_groups"][0]["params"] = ids
    _, opt = fresh_optimizer("8bit")
    with pytest.raises(ValueError, match=message):
        opt.load_state_dict(state_dict)


def test_errors_name_a_parameter_by_its_place_in_the_checkpoint():
    """Across groups: the second group's second parameter is parameter 4 of the checkpoint."""
    def make():
        params = [torch.nn.Parameter(torch.randn(300)) for _ in range(5)]
        return params, lowbit_optim.AdamW([{"params": params[:3]}, {"params": params[3:]}], state_format="8bit", min_quantize_numel=0)

    params, opt = make()
    set_grads(params)
    opt.step()
    state_dict = load(save(opt.state_dict()))
    state_dict["state"][4]["exp_avg"].scale = state_dict["state"][4]["exp_avg"].scale[:-1]
    with pytest.raises(ValueError, match=r"checkpoint state 'exp_avg' of parameter 4 \(shape \(300,\)\) is corrupt"):
        make()[1].load_state_dict(state_dict)


@pytest.mark.parametrize(
    "step", [torch.zeros(0), torch.zeros(2), "1", None, True, torch.tensor(1 + 2j), torch.tensor(True)], ids=["empty", "two", "str", "None", "bool", "complex", "bool tensor"]
)
def test_checkpoint_step_must_be_a_number(step):
    state_dict = load(checkpoint("8bit"))
    state_dict["state"][1]["step"] = step
    _, opt = fresh_optimizer("8bit")
    expected = r"checkpoint state 'step' of parameter 1 \(shape \(96,\)\) is .*: it must be a number or a one-element tensor"
    with pytest.raises(ValueError, match=expected):
        opt.load_state_dict(load(save(state_dict)))


@pytest.mark.parametrize("spec", ["8bit", {"exp_avg": "8bit-linear", "exp_avg_sq": "10bit-sr"}], ids=["8bit", "10bit-sr"])
def test_a_refused_checkpoint_leaves_the_optimizer_as_it_was(spec):
    """A checkpoint refused part-way (parameter 1's step is bad, after parameter 0's states were
    converted) leaves the optimizer's states and groups as they were, as torch.optim does, whose
    checks all come before it assigns: its next step is the one it would have taken."""
    params, opt = fresh_optimizer(spec)
    set_grads(params)
    opt.step()
    reference_params, reference = copy.deepcopy((params, opt))
    state_dict = load(checkpoint(spec))
    state_dict["state"][1]["step"] = "1"
    state_dict["param_groups"][0]["lr"] = 0.5
    with pytest.raises(ValueError, match=r"checkpoint state 'step' of parameter 1"):
        opt.load_state_dict(state_dict)
    assert opt.param_groups[0]["lr"] == OPTIONS["lr"]
    for ps, o in ((params, opt), (reference_params, reference)):
        set_grads(ps)
        o.step()
    for p, q in zip(params, reference_params):
        assert torch.equal(p, q)
        assert opt.state[p].keys() == reference.state[q].keys()
        for name, value in opt.state[p].items():
            assert_same_bits(value, reference.state[q][name], name)


@pytest.mark.parametrize("step", [-1.0, float("nan"), float("inf")], ids=["negative", "NaN", "inf"])
def test_checkpoint_step_must_count_steps(step):
    """A step counter that no run makes (negative, NaN, infinite) would make every element of the
    parameter NaN through its bias correction: refused."""
    state_dict = load(checkpoint("8bit"))
    state_dict["state"][1]["step"] = torch.tensor(step)
    _, opt = fresh_optimizer("8bit")
    with pytest.raises(ValueError, match=r"checkpoint state 'step' of parameter 1 \(shape \(96,\)\) is .*: it must count steps, a finite number >= 0"):
        opt.load_state_dict(load(save(state_dict)))


@quantized_formats
def test_negative_maxima_and_sums_of_squares_are_refused(info):
    """Block scales are block maxima, factored rows and columns sums of squares (a format's
    ``nonnegative``): a negative value (an edited checkpoint) would turn a second moment negative and
    the step NaN, and is refused; a NaN one is a block a non-finite gradient poisoned, saved as it was."""
    state = load(checkpoint(info.spec))["state"][0][CHECKED]
    if not state.nonnegative:
        pytest.skip(f"{type(state).__name__} keeps no maxima or sums")
    for name, held in state.nonnegative.items():
        state_dict = load(checkpoint(info.spec))
        values = getattr(state_dict["state"][0][CHECKED], name)
        values[3] = -values[3].abs() - 1.0
        _, opt = fresh_optimizer(info.spec)
        with pytest.raises(ValueError, match=rf"checkpoint state '{CHECKED}' of parameter 0 \(shape \(70, 64\)\) is corrupt: its {name} holds a negative value \(.*\), where it holds {held}"):
            opt.load_state_dict(load(save(state_dict)))


BAD_HYPER_PARAMETERS = {
    "lr=-1": ("lr", -1.0, "invalid learning rate -1.0"),
    "beta2=1.5": ("betas", (0.9, 1.5), r"invalid betas \(0.9, 1.5\): each beta must be in \[0, 1\)"),
    "three betas": ("betas", (0.9, 0.99, 0.999), r"invalid betas \(0.9, 0.99, 0.999\): Adam takes two"),
    "NaN weight decay": ("weight_decay", float("nan"), "invalid weight_decay nan"),
    "weight decay a str": ("weight_decay", "0.1", "invalid weight_decay '0.1'"),
    "maximize a str": ("maximize", "False", r"maximize must be True or False \(or 1 or 0\), got 'False'"),  # (a str is true)
    "amsgrad 2": ("amsgrad", 2, r"amsgrad must be True or False \(or 1 or 0\), got 2"),
    "lr on the meta device": ("lr", torch.tensor(0.1, device="meta"), r"invalid learning rate tensor\(\.\.\., device='meta', size=\(\)\): lr must be a number >= 0"),
}


@pytest.mark.parametrize("case", list(BAD_HYPER_PARAMETERS))
def test_checkpoint_hyper_parameters_are_checked(case):
    """A checkpoint's param groups pass the constructor's checks before anything is loaded: a value
    the constructor refuses would train silently wrong (lr=-1) or NaN, or fail at the next step with
    an unrelated error. The optimizer keeps its own groups and states."""
    key, value, message = BAD_HYPER_PARAMETERS[case]
    state_dict = load(checkpoint("8bit"))
    state_dict["param_groups"][0][key] = value
    _, opt = fresh_optimizer("8bit")
    before = copy.deepcopy(opt.param_groups)
    with pytest.raises(ValueError, match=rf"param group 0 of this checkpoint: {message}"):
        opt.load_state_dict(load(save(state_dict)))
    assert [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups] == [{k: v for k, v in g.items() if k != "params"} for g in before]
    assert not opt.state


def test_a_non_contiguous_correction_loads_and_steps_in_the_kernel():
    """An int8-correction saved from a transposed view (non-contiguous) is loaded contiguous: the
    fused kernel, which reads it beside the parameter, steps it as it steps the saved one."""
    runs = []
    for transposed in (False, True):
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(64, 96, dtype=torch.bfloat16))
        opt = lowbit_optim.AdamW([param], state_format="8bit", param_update="int8-correction", fused=True)
        param.grad = torch.randn(64, 96, dtype=torch.bfloat16)
        opt.step()
        state_dict = opt.state_dict()
        if transposed:
            correction = state_dict["state"][0]["param_correction"]
            state_dict["state"][0]["param_correction"] = correction.t().contiguous().t()
            assert not state_dict["state"][0]["param_correction"].is_contiguous()
        opt.load_state_dict(state_dict)
        param.grad = torch.randn(64, 96, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))
        opt.step()
        runs.append((param.detach().clone(), opt.state[param]["param_correction"].clone()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_codes_past_the_codebook_are_refused():
    """8bit-linear has 255 values: code 255 decodes to NaN (and NaN's its block at the next step)."""
    params, opt = fresh_optimizer("8bit-linear")
    set_grads(params)
    opt.step()
    state_dict = load(save(opt.state_dict()))
    state_dict["state"][0]["exp_avg"].codes[7] = 255
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 .* is corrupt: a code is 255, past the codebook's 255 values \(codes 0 to 254\)"):
        fresh_optimizer("8bit-linear")[1].load_state_dict(state_dict)


@pytest.mark.parametrize("into", ["fp32", "8bit", "4bit"])
@pytest.mark.parametrize("saved", ["plain", "torchao"])
def test_a_negative_second_moment_is_refused_in_any_layout(saved, into):
    """A second moment is nonnegative: a negative one (an edited checkpoint) would make the step NaN
    as it is, or be clamped silently by a conversion; refused whatever the layout it comes in."""
    state_dict = load(checkpoint("fp32"))
    v = state_dict["state"][0]["exp_avg_sq"]
    v[3, 5] = -1.0
    if saved == "torchao":
        from torchao.optim.subclass_8bit import OptimState8bit as TorchaoState8bit

        state = TorchaoState8bit.zeros(v.shape, False, 128)  # (torchao takes whole blocks only: 4480 = 35 x 128)
        state.copy_(v.abs())
        state_dict["state"][0]["exp_avg_sq"] = TorchaoState8bit(state.codes, -state.scale, state.qmap, False)
    message = r"a negative value \(.*\) in its values, where it holds a nonnegative state" if saved == "plain" else r"its scale holds a negative value \(.*\), where it holds block maxima"
    with pytest.raises(ValueError, match=rf"'exp_avg_sq' of parameter 0 .* is corrupt: {message}"):
        fresh_optimizer(into)[1].load_state_dict(load(save(state_dict)))


@quantized_formats
def test_a_nonnegative_state_that_decodes_negative_is_refused(info):
    """A second moment whose codes decode below 0 made NaN of the next step (sqrt of a negative):
    bf16-sr's values and fp8's sign bits loaded so, where a plain state's negative value was
    refused. A signed state's negative values marked nonnegative: refused where its format then
    decodes them negative, loaded and stepped finitely where its unsigned reading is nonnegative."""
    state_dict = load(checkpoint(info.spec))
    saved = state_dict["state"][0][CHECKED]
    values = -saved.dequantize().abs() - 1e-3
    if not info.fmt.holds_signed:  # refused as it is written (edited inner tensors: test_negative_maxima_and_sums...)
        with pytest.raises(ValueError, match="copy_ of a negative value"):
            type(saved).from_float(values, False)
        return
    negative = type(saved).from_float(values, True, saved.block_size)
    negative.signed = False
    state_dict["state"][0][CHECKED] = negative
    decodes_negative = float(negative.dequantize().min()) < 0
    assert decodes_negative or info.name not in ("fp8", "bf16-sr")  # (the review's cases)
    params, opt = fresh_optimizer(info.spec)
    try:
        opt.load_state_dict(load(save(state_dict)))
    except ValueError as error:
        assert re.search(rf"'{CHECKED}' of parameter 0 .* is corrupt: ", str(error)), error
    else:
        assert not decodes_negative
        set_grads(params)
        opt.step()
        assert all(bool(p.isfinite().all()) for p in params)


@pytest.mark.parametrize("name", ["fp8", "bf16-sr"])
def test_a_tiny_negative_second_moment_of_an_fp16_parameter_is_refused(name):
    """A state on an fp16 parameter appears fp16, where -1e-9 reads as -0: the load's check of a
    nonnegative state reads its values in fp32."""
    fmt = get_format(name)
    state = fmt.from_float(torch.full((3, 100), -1e-9), fmt.holds_signed)
    state.signed = False
    with pytest.raises(ValueError, match=r"a negative value \(-[0-9.e-]+\) in its values, where it holds a nonnegative state"):
        state.to(torch.float16).check_values()


@pytest.mark.parametrize("attribute", ["inner_names", "inner_dtypes", "nonnegative", "bits", "decode"])
def test_a_checkpoint_that_sets_what_a_state_class_declares_is_refused(attribute):
    """torch.load sets a saved state's attributes on it: a file that set the class's declarations
    (nonnegative={} switched off the negative-scale check, inner_dtypes the codes' dtype check) loaded,
    then stepped to NaN or wrong numbers. Only what a state keeps on itself loads."""
    state_dict = load(checkpoint("8bit"))
    state = state_dict["state"][0][CHECKED]
    state.__dict__[attribute] = {"inner_names": (), "inner_dtypes": (), "nonnegative": {}, "bits": 4, "decode": 0}[attribute]
    with pytest.raises(ValueError, match=rf"OptimState8bit \('8bit' state format\) sets \['{attribute}'\], which such a state does not keep"):
        load(save(state_dict))


NON_FINITE_OPTIONS = [
    ("SGD", {"momentum": 0.9, "dampening": float("nan")}, "dampening"),
    ("AdamW", {"weight_decay": float("inf")}, "weight_decay"),
    ("AdamW", {"lr": float("inf")}, "lr"),
    ("AdamW", {"eps": float("inf")}, "eps"),
    ("Muon", {"ns_coefficients": (float("nan"), -4.775, 2.0315)}, "ns_coefficients"),
]


@pytest.mark.parametrize("name, options, key", NON_FINITE_OPTIONS, ids=[k for _, _, k in NON_FINITE_OPTIONS])
def test_non_finite_options_are_refused(name, options, key):
    """A NaN or infinite option made every parameter of its group non-finite at one step; refused by
    the constructor and in a checkpoint's param groups."""
    cls = getattr(lowbit_optim, name)
    make = lambda **kw: cls([torch.nn.Parameter(torch.randn(8, 8))], compile=False, **kw)  # noqa: E731
    message = rf"invalid {key} .*: {key} must be finite"
    with pytest.raises(ValueError, match=message):
        make(**options)
    state_dict = make(**{k: v for k, v in options.items() if k != key}).state_dict()
    state_dict["param_groups"][0].update(options)
    with pytest.raises(ValueError, match=message):
        make().load_state_dict(state_dict)
    # a key of the user's own, kept as torch.optim keeps it, is theirs
    make(**{k: v for k, v in options.items() if k != key}).add_param_group({"params": [torch.nn.Parameter(torch.randn(2, 2))], "clip_value": float("inf")})


def test_a_load_decodes_no_codebook_state(monkeypatch):
    """Whether a nonnegative state decodes negative follows, for a codebook format, from its codebook
    and scales (checked anyway): a load decodes none of them (once it decoded each twice, 100x the
    load's time)."""
    specs = ["8bit", {"exp_avg": "8bit", "exp_avg_sq": "factored"}]
    loads = [(fresh_optimizer(spec)[1], load(checkpoint(spec))) for spec in specs]
    decoded = []
    for cls in (OptimState8bit, FactoredState):
        monkeypatch.setattr(cls, "dequantize", lambda self, *a, _decode=cls.dequantize, **k: decoded.append(self.name) or _decode(self, *a, **k))
    for opt, state_dict in loads:
        opt.load_state_dict(state_dict)
    assert decoded == []


def test_a_factored_part_in_a_checkpoint_is_refused():
    """A state marked a row slice of a larger one (part=True) loaded: fused=True then refused it at
    the step as a slice, the default stepped it with the compiled step. A parameter's state is whole."""
    spec = {"exp_avg": "8bit", "exp_avg_sq": "factored"}
    state_dict = load(checkpoint(spec))
    state_dict["state"][0][CHECKED].part = True
    with pytest.raises(ValueError, match=rf"'{CHECKED}' of parameter 0 .* is corrupt: a row slice of a larger factored state \(part=True\)"):
        fresh_optimizer(spec)[1].load_state_dict(load(save(state_dict)))


def test_states_that_share_memory_are_refused():
    """torch.save keeps aliasing: two states over one memory would each overwrite the other's steps.
    States that are disjoint views of one buffer (a flat-buffer optimizer's) load."""
    state_dict = load(checkpoint("fp32"))
    state_dict["state"][0]["exp_avg_sq"] = state_dict["state"][0]["exp_avg"]
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 .* and .*'exp_avg_sq' of parameter 0 .* share memory"):
        fresh_optimizer("fp32")[1].load_state_dict(load(save(state_dict)))
    state_dict = load(checkpoint("8bit"))
    state_dict["state"][0]["exp_avg_sq"].scale = state_dict["state"][0]["exp_avg"].scale  # one state's inner tensor in another's
    with pytest.raises(ValueError, match="share memory"):
        fresh_optimizer("8bit")[1].load_state_dict(load(save(state_dict)))
    state_dict = load(checkpoint("fp32"))
    names = [(s, k) for s in state_dict["state"].values() for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")]
    flat = torch.cat([s[k].reshape(-1) for s, k in names])  # one buffer, each state a view of its own part
    for (s, k), view in zip(names, flat.split([s[k].numel() for s, k in names])):
        s[k] = view.view(s[k].shape)
    fresh_optimizer("fp32")[1].load_state_dict(load(save(state_dict)))  # disjoint: loads
    state_dict = load(checkpoint("fp32"))
    for s in state_dict["state"].values():  # interleaved in one buffer, each state its own elements: loads
        both = torch.stack([s["exp_avg"], s["exp_avg_sq"]], -1)
        s["exp_avg"], s["exp_avg_sq"] = both[..., 0], both[..., 1]
    fresh_optimizer("fp32")[1].load_state_dict(load(save(state_dict)))


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "compiled"])
def test_a_strided_plain_state_loads_contiguous_and_steps(fused):
    """torch.optim makes a channels_last weight's states channels_last (zeros_like): loaded as saved,
    the steps wrote a flat copy and the states stayed as loaded. They load contiguous and step as
    torch.optim's do."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(8, 16, 3).to(memory_format=torch.channels_last)
    x = torch.randn(4, 8, 10, 10).to(memory_format=torch.channels_last)
    reference = torch.optim.AdamW(conv.parameters(), lr=1e-2)
    conv(x).square().mean().backward()
    reference.step()
    state_dict = copy.deepcopy(reference.state_dict())
    assert not state_dict["state"][0]["exp_avg"].is_contiguous()
    ours = copy.deepcopy(conv)
    opt = lowbit_optim.AdamW(ours.parameters(), lr=1e-2, state_format="fp32", fused=fused)
    opt.load_state_dict(state_dict)
    for model, optimizer in ((conv, reference), (ours, opt)):
        for _ in range(2):
            optimizer.zero_grad()
            model(x).square().mean().backward()
            optimizer.step()
    assert opt.state[ours.weight]["exp_avg"].is_contiguous()
    torch.testing.assert_close(ours.weight, conv.weight, rtol=0, atol=1e-6)
    torch.testing.assert_close(opt.state[ours.weight]["exp_avg"], reference.state[conv.weight]["exp_avg"], rtol=0, atol=1e-7)


def test_a_one_element_hyper_parameter_of_any_shape_steps_as_a_number():
    """lr = torch.tensor([[1e-3]]) (torch.optim takes it): the compiled step broadcast the flat
    states to (1, n) and failed inside dynamo; it steps as lr=1e-3."""
    runs = []
    for lr in (1e-3, torch.tensor([[1e-3]])):
        params = make_params()
        opt = lowbit_optim.AdamW(params, lr=lr, betas=(torch.tensor([[0.9]]), 0.999), state_format="8bit", fused=False)
        set_grads(params)
        opt.step()
        runs.append([p.detach().clone() for p in params])
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_a_one_element_step_loads_as_a_counter():
    """A one-element step of any shape loads as the 0-dim counter the optimizer makes: a (1, 1) one
    kept as is broadcast the compiled step's parameter to (1, n) and failed."""
    param = torch.nn.Parameter(torch.randn(8, 8))
    opt = lowbit_optim.AdamW([param], compile=True, fused=False)
    param.grad = torch.randn(8, 8)
    opt.step()
    state_dict = opt.state_dict()
    state_dict["state"][0]["step"] = torch.ones(1, 1)
    opt.load_state_dict(state_dict)
    opt.step()
    assert opt.state[param]["step"].shape == () and opt.state[param]["step"].item() == 2


# ---- a gradient of another shape ---------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"fused": False}, {"compile": False}], ids=["fused", "compiled", "eager"])
def test_gradient_of_another_shape_is_refused(options):
    """Autograd checks what is assigned to p.grad, not to p.grad.data: the step checks it. (The
    compiled path refuses it before compiling anything.)"""
    params = make_params()
    opt = lowbit_optim.AdamW(params, state_format="8bit", **(OPTIONS | options))
    set_grads(params)
    params[0].grad.data = torch.randn(10)
    before = [p.detach().clone() for p in params]
    expected = r"gradient of a parameter of shape \(70, 64\) has shape \(10,\); it was probably set through \.data"
    with pytest.raises(RuntimeError, match=expected):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


STATES_EDITED_AFTER_A_STEP = {
    "codes cut short": (lambda state: setattr(state["exp_avg"], "codes", state["exp_avg"].codes[:100].clone()), r"is inconsistent: codes has 100"),
    "scales cut short": (lambda state: setattr(state["exp_avg_sq"], "scale", state["exp_avg_sq"].scale[:3].clone()), r"is inconsistent: .* scale 3 elements"),
    # (a state of another shape is refused before any step: test_optim.py)
}


@pytest.mark.parametrize("case", list(STATES_EDITED_AFTER_A_STEP))
def test_the_compiled_step_names_a_state_edited_after_its_checks(case):
    """A state whose tensors were replaced after a step fails inside the compiled step's trace; the
    error then names the parameter and what is wrong with its state (the kernel's op checks every call)."""
    edit, problem = STATES_EDITED_AFTER_A_STEP[case]
    params = make_params()
    opt = lowbit_optim.AdamW(params, state_format="8bit", **(OPTIONS | {"fused": False}))
    set_grads(params)
    opt.step()
    edit(opt.state[params[0]])
    with pytest.raises(ValueError, match=rf"the compiled step cannot step a parameter of shape \(70, 64\): .*{problem}"):
        opt.step()


@pytest.mark.parametrize("fused", [True, False], ids=["kernel", "compiled"])
@pytest.mark.parametrize("name, value", [("step", 5), ("exp_avg", 0.0), ("param_correction", None)])
def test_a_state_set_to_what_is_no_tensor_is_named(name, value, fused):
    """A state set by hand to a number or None: the kernel raised an AttributeError deep inside (or,
    for an int8-correction of None, stepped without it) and the compiled step a dynamo error. Both
    now name the state, before anything is stepped."""
    param = torch.nn.Parameter(torch.randn(70, 64, dtype=torch.bfloat16))
    opt = lowbit_optim.AdamW([param], state_format="8bit", param_update="int8-correction", fused=fused)
    param.grad = torch.randn_like(param)
    opt.step()
    opt.state[param][name] = value
    before = param.detach().clone()
    with pytest.raises(TypeError, match=rf"the {name!r} state of a parameter of shape \(70, 64\) is {value!r}, not a tensor: .*del opt.state\[p\]"):
        opt.step()
    assert torch.equal(param, before)


def test_check_layout_accepts_what_the_library_makes():
    """Views, row slices and flattened states keep valid layouts (the checks are no stricter than
    the states the package itself builds)."""
    for info in QUANTIZED_FORMATS:
        signed = info.fmt.holds_signed
        state = info.fmt.from_float(torch.randn(64, 96).abs(), signed)
        try:
            rows = [state[0:32], state[32:64], state[0:0]]
        except NotImplementedError:  # a format may refuse row slices (8bit-lowrank: its low-rank part spans all rows)
            rows = []
        for view in (state, state.view(-1), state.view(96, 64), *rows):
            view.check_layout()


# ---- the fuzz and the kernel's entry point, in a child process ---------------------------------


def run_child(plugins: list[str]) -> tuple[list[dict], dict | None]:
    """Every case's result (one dict each), and if the child did not finish, the case it was
    running (family, format, case) and a message with its exit status and the end of its stderr.
    ``plugins``: the modules given to pytest with -p (a user's formats), which the child imports."""
    # the package this process tests, and the root (examples.custom_format pickles by reference from it)
    path = [str(pathlib.Path(lowbit_optim.__file__).parent.parent), str(ROOT), os.environ.get("PYTHONPATH", "")]
    # MALLOC_PERTURB_: freed and fresh heap memory filled with junk, so that misreads show
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "MALLOC_PERTURB_": "165", "LOWBIT_TEST_PLUGINS": ",".join(plugins)}
    child = subprocess.run([sys.executable, __file__], capture_output=True, text=True, timeout=300, env=env, check=False)
    results, running = [], None
    for line in child.stdout.splitlines():
        record = json.loads(line)
        running = record.get("start")
        if running is None:
            results.append(record)
    if child.returncode == 0:
        return results, None
    message = f"the child exited with status {child.returncode} while running {running}:\n{child.stderr[-3000:]}"
    return results, {"running": running, "message": message}


@pytest.fixture(scope="module")
def child_results(request):
    return run_child([p for p in request.config.option.plugins or [] if not p.startswith("no:")])


def _results(child_results, family: str, name: str) -> list[dict]:
    """This format's results of a family of cases; fails if the child crashed in them or before."""
    results, crash = child_results
    if crash is not None and crash["running"] is not None and crash["running"][:2] == [family, name]:
        pytest.fail(crash["message"])
    mine = [r for r in results if r["family"] == family and r["format"] == name]
    assert mine, f"the child never ran the {family} cases of {name}: {crash and crash['message']}"
    return mine


@quantized_formats
def test_fuzzed_checkpoints_never_crash_or_load_silently(child_results, info):
    failures = []
    for r in _results(child_results, "checkpoint", info.name):
        if r["outcome"] == "refused" and "parameter" not in r["detail"]:
            failures.append(f"{r['case']}: refused without naming the parameter: {r['detail']}")
        elif r["outcome"] in ("raised", "step failed"):
            failures.append(f"{r['case']}: {r['outcome']}: {r['detail']}")
        elif r["outcome"] == "stepped" and r["must_refuse"]:
            failures.append(f"{r['case']}: a corrupt state loaded silently")
        elif r["outcome"] == "stepped" and not r["finite"] and not r["semantic"]:
            failures.append(f"{r['case']}: loaded, and the step made non-finite parameters")
    assert not failures, "\n".join(failures)


@quantized_formats
def test_fused_kernel_checks_every_tensor_it_is_given(child_results, info):
    """fused_cpu.adam_step called directly with a state corrupted in memory, a gradient, step or
    parameter the kernel would misread: a ValueError naming the parameter's shape, nothing stepped."""
    if not kernel_steps(info.spec):
        pytest.skip(f"{info.name} takes the compiled step: the fused kernel never gets its states")
    failures = [
        f"{r['case']}: {r['outcome']}: {r['detail']}"
        for r in _results(child_results, "kernel", info.name)
        if r["outcome"] != "refused" or "cannot step a parameter of shape (70, 64)" not in r["detail"]
    ]
    assert not failures, "\n".join(failures)


# ---- the child's side ------------------------------------------------------------------------


def tensor_mutations(t: torch.Tensor, rng: random.Random, plain: bool = False) -> dict:
    """name -> t changed in size, shape, dtype or layout (each one invalid for an inner tensor)."""
    n = t.numel()
    if n:
        out = {
            "truncated": t.reshape(-1)[: rng.randrange(n)],
            "extended": torch.cat([t.reshape(-1), t.reshape(-1)[: rng.randint(1, n)]]),
            "2-D": t.reshape(2, -1) if n % 2 == 0 else t.reshape(1, -1),
            "empty": t.reshape(-1)[:0].clone(),
        }
    else:  # an inner tensor that is empty when valid (8bit-lowrank's factors at rank 0)
        out = {"extended": torch.zeros(1, dtype=t.dtype)}
    if not plain and n > 1:  # a non-contiguous plain state is valid (the compiled step takes it), an empty one too;
        out["non-contiguous"] = non_contiguous(t)  # one element is contiguous with any stride (bf16-sr's writes)
    for dtype in (torch.int8, torch.float16, torch.float64, torch.int32, torch.uint8, torch.float32):
        if dtype != t.dtype:
            out[f"as {dtype}"] = t.to(dtype)
    return out


def checkpoint_mutations(state_dict: dict, rng: random.Random) -> list[tuple[str, object, bool, bool]]:
    """(name, function changing a state dict, whether it must be refused, whether it changes only
    what the codes mean (a flipped signed: the layout stays valid, the values need not be finite))."""
    cases = []
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            where = f"param {index} {key}"
            if key == "step":
                for name, step, refuse in [
                    ("empty", torch.zeros(0), True), ("two values", torch.zeros(2), True), ("a str", "1", True),
                    ("a list", [1.0], True), ("None", None, True), ("float64", torch.tensor(1.0, dtype=torch.float64), False),
                    ("an int", 1, False), ("shape (1, 1)", torch.ones(1, 1), False),
                ]:  # fmt: skip
                    cases.append((f"{where} {name}", _setter(index, key, step), refuse, False))
            elif not isinstance(value, StateTensor):
                for name, new in tensor_mutations(value, rng, plain=True).items():
                    refuse = new.shape != value.shape or not new.is_floating_point()
                    cases.append((f"{where} {name}", _setter(index, key, new), refuse, False))
            else:
                cases += state_mutations(index, key, value, rng)
    return cases


def state_mutations(index, key, state: StateTensor, rng: random.Random) -> list:
    where = f"param {index} {key}"
    cases = []
    for field in state.inner_names:
        for name, new in tensor_mutations(getattr(state, field), rng).items():
            cases.append((f"{where} {field} {name}", _attribute_setter(index, key, field, new), True, False))
    attributes = {"signed": [1, "yes", None]}
    if isinstance(state, OptimState):
        bs = state.block_size
        attributes["block_size"] = [bs // 2, bs * 2, 3, 0, -bs, str(bs), float(bs), True, None, 2**40]
    elif isinstance(state, FactoredState):
        attributes["part"] = ["yes", 1, None]
    for attribute, values in attributes.items():
        for value in values:
            cases.append((f"{where} {attribute}={value!r}", _attribute_setter(index, key, attribute, value), True, False))
    cases.append((f"{where} signed flipped", _attribute_setter(index, key, "signed", not state.signed), False, True))
    if isinstance(state, OptimState):  # twice the block size, with scales to match: valid, and loads
        cases.append((f"{where} block_size doubled consistently", _double_blocks(index, key), False, False))
    for shape in [(64, 70), (70, 63), (4480,), (0,), (70, 64, 1)]:
        if torch.Size(shape) != state.shape:
            cases.append((f"{where} shape {shape}", _reshaper(index, key, shape), True, False))
    return cases


def _setter(index, key, value):
    def mutate(state_dict):
        state_dict["state"][index][key] = value

    return mutate


def _reshaper(index, key, shape):
    def mutate(state_dict):
        state = state_dict["state"][index][key]
        state_dict["state"][index][key] = state._like(shape=shape)  # the same inner tensors

    return mutate


def _attribute_setter(index, key, attribute, value):
    def mutate(state_dict):
        setattr(state_dict["state"][index][key], attribute, value)

    return mutate


def _double_blocks(index, key):
    def mutate(state_dict):
        state = state_dict["state"][index][key]
        blocks = -(-state.numel() // (2 * state.block_size))
        state.block_size *= 2
        state.scale = state.scale[:blocks].clone()
        state.codes = torch.cat([state.codes, state.codes])[: blocks * state.block_size * state.bits // 8].clone()

    return mutate


def random_combinations(state_dict: dict, rng: random.Random, count: int) -> list:
    """``count`` cases of two mutations at once (together they may make a valid state again, e.g. a
    tensor truncated then extended: none must be refused, all must be safe)."""
    singles = checkpoint_mutations(state_dict, rng)
    cases = []
    for _ in range(count):
        (name_a, a, _, semantic_a), (name_b, b, _, semantic_b) = rng.sample(singles, 2)
        cases.append((f"{name_a} + {name_b}", _both(a, b), False, semantic_a or semantic_b))
    return cases


def _both(a, b):
    def mutate(state_dict):
        a(state_dict)
        b(state_dict)

    return mutate


def _announce(**record) -> None:
    print(json.dumps(record), flush=True)


def fuzz_checkpoints(info) -> None:
    base = checkpoint(info.spec)
    rng = random.Random(f"fuzz-{info.name}")
    cases = checkpoint_mutations(load(base), rng) + random_combinations(load(base), rng, 30)
    for case, mutate, must_refuse, semantic in cases:
        _announce(start=["checkpoint", info.name, case])
        record = dict(family="checkpoint", format=info.name, case=case, must_refuse=must_refuse, semantic=semantic)
        state_dict = load(base)
        mutate(state_dict)
        try:
            loaded = load(save(state_dict))
        except (ValueError, TypeError, RuntimeError) as error:  # fine as well
            _announce(**record, outcome="refused by torch.load", detail=str(error))
            continue
        params, opt = fresh_optimizer(info.spec)
        try:
            opt.load_state_dict(loaded)
        except (ValueError, TypeError, RuntimeError) as error:
            _announce(**record, outcome="refused", detail=str(error))
            continue
        except Exception as error:  # noqa: BLE001 - reported as a failure
            _announce(**record, outcome="raised", detail=f"{type(error).__name__}: {error}")
            continue
        set_grads(params)
        try:
            opt.step()
        except Exception as error:  # noqa: BLE001 - reported as a failure
            _announce(**record, outcome="step failed", detail=f"{type(error).__name__}: {error}")
            continue
        _announce(**record, outcome="stepped", finite=all(bool(p.isfinite().all()) for p in params), detail="")


def fuzz_kernel_entry(info) -> None:
    """Corrupt what fused_cpu.adam_step is given, in memory, and call it directly."""
    rng = random.Random(f"kernel-{info.name}")
    params, opt = fresh_optimizer(info.spec)
    set_grads(params)
    opt.step()
    p = params[0]
    group, state = opt.param_groups[0], opt.state[p]
    quantized = state[CHECKED]
    cases = {}
    for field in quantized.inner_names:
        for name, new in tensor_mutations(getattr(quantized, field), rng).items():
            cases[f"{CHECKED} {field} {name}"] = ("state", field, new)
    for name, new in tensor_mutations(p.grad, rng, plain=True).items():
        if name != "2-D":  # as many elements in 2-D are read right: the kernel reads every tensor flat
            cases[f"gradient {name}"] = ("grad", None, new)
    cases["gradient expanded"] = ("grad", None, torch.zeros(1).expand(p.shape))
    cases["parameter non-contiguous"] = ("param", None, non_contiguous(p.detach()))
    cases["step empty"] = ("step", None, torch.zeros(0))
    cases["step float64"] = ("step", None, torch.zeros((), dtype=torch.float64))
    if "max_exp_avg_sq" in state:  # (not where amsgrad is refused for the format: options_for)
        cases["max_exp_avg_sq missing"] = ("max", None, None)
    for case, (what, field, new) in cases.items():
        _announce(start=["kernel", info.name, case])
        moments = [state["exp_avg"], quantized._like(), state.get("max_exp_avg_sq")]
        item = [p.detach(), p.grad, state["step"]]
        if what == "state":
            setattr(moments[1], field, new)
        elif what == "max":
            moments[2] = None
        else:
            item[["param", "grad", "step"].index(what)] = new
        before = p.detach().clone()
        try:
            fused_cpu.adam_step([(*item, *moments)], group)
        except ValueError as error:
            outcome = "refused" if torch.equal(p, before) else "refused after stepping"
            _announce(family="kernel", format=info.name, case=case, outcome=outcome, detail=str(error))
            continue
        _announce(family="kernel", format=info.name, case=case, outcome="stepped", detail=f"finite: {bool(p.isfinite().all())}")


if __name__ == "__main__":
    for plugin in filter(None, os.environ.get("LOWBIT_TEST_PLUGINS", "").split(",")):
        importlib.import_module(plugin)  # a user's formats, registered as pytest's -p registered them
    torch.set_num_threads(1)
    for info in (i for i in (FormatInfo(n, f) for n, f in registered_formats().items()) if i.quantized):  # the plugins' too
        fuzz_checkpoints(info)
        if kernel_steps(info.spec):
            fuzz_kernel_entry(info)
