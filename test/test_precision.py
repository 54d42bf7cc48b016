"""Param-update precision for bf16 weights: stochastic rounding, Kahan summation, int8 correction.

The convergence test trains a small model in pure bf16 with lr=1e-5, where round-to-nearest drops
most updates: every other mode must keep up with fp32-master AdamW, on several state formats.
"""

import copy
import functools
import io
import re
import warnings

import pytest
import torch

import lowbit_optim
from lowbit_optim import precision, quant

from conftest import FORMATS

TORCHDISTX_ARGS = [
    "params", "lr", "betas", "eps", "weight_decay", "use_kahan_summation",
    "momentum_dtype", "variance_dtype", "compensation_buffer_dtype",
]  # fmt: skip


def _compiled(fn):
    return torch.compile(fn, fullgraph=True, dynamic=True)


# ---- rounding primitives ---------------------------------------------------------------------------


def test_bf16_round_nearest_matches_torch_cast():
    torch.manual_seed(0)
    x = torch.randn(200_000) * torch.logspace(-38, 38, 200_000)
    x = torch.cat([x, torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.3895e38, 1e-40])])
    for fn in (quant.bf16_round_nearest, _compiled(quant.bf16_round_nearest)):
        assert torch.equal(fn(x), x.bfloat16().float())


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_stochastic_rounding_is_unbiased(compiled):
    """The mean of many stochastic roundings equals the fp32 value; each result is a neighbour."""
    torch.manual_seed(0)
    values = torch.tensor([1.0 + 2**-9, 1.0 + 3 * 2**-10, -0.3, 1e-3 + 1e-7, 123.456])
    samples = 20_000
    x = values.repeat_interleave(samples)
    fn = _compiled(quant.bf16_stochastic_round) if compiled else quant.bf16_stochastic_round
    rounded = fn(x).float().view(len(values), samples)
    ulp = precision.bf16_ulp(values.bfloat16().float())
    # each sample is one of the two bf16 neighbours; the mean's standard error is <= ulp / (2 sqrt(n))
    assert bool(((rounded - values[:, None]).abs() <= ulp[:, None]).all())
    assert bool(((rounded.mean(1) - values).abs() <= 5 * ulp / (2 * samples**0.5)).all())
    assert not torch.equal(rounded[:, 0], rounded[:, 1])  # really random


def test_int8_correction_reconstructs_fp32():
    torch.manual_seed(0)
    x = torch.randn(100_000) * 10
    param, extra = x.bfloat16(), torch.zeros(100_000, dtype=torch.int8)
    precision.write_param(param, extra, x, x, "int8-correction")
    restored = precision.read_param(param, extra, "int8-correction")
    # bf16 keeps 8 significant bits; the int8 adds ~8 more: error <= half a unit (plus fp32 rounding)
    unit = precision.bf16_ulp(param.float()) / precision.CORRECTION_UNITS_PER_ULP
    assert bool(((restored - x).abs() <= unit / 2 * 1.01).all())
    assert float((param.float() - x).abs().max()) > 100 * float((restored - x).abs().max())


@pytest.mark.parametrize("mode", ["kahan", "int8-correction"])
def test_compiled_write_keeps_rounding_error(mode):
    """torch.compile must not fold the bf16 rounding away (it keeps bf16 intermediates in fp32)."""
    extra_dtype = torch.bfloat16 if mode == "kahan" else torch.int8

    def tiny_updates(param, extra):
        start = precision.read_param(param, extra, mode)
        precision.write_param(param, extra, start, start + 1e-5, mode)

    results = []
    for fn in (tiny_updates, _compiled(tiny_updates)):
        param, extra = torch.full((64,), 0.1, dtype=torch.bfloat16), torch.zeros(64, dtype=extra_dtype)
        for _ in range(5):
            fn(param, extra)
        results.append(precision.read_param(param, extra, mode) + (extra.float() if mode == "kahan" else 0))
    assert torch.allclose(results[0], results[1], atol=1e-7)
    start = float(torch.tensor(0.1).bfloat16())
    assert float(results[1][0]) == pytest.approx(start + 5e-5, abs=3e-6)


# ---- training in pure bf16 --------------------------------------------------------------------------


def _loss_decrease(make_optimizer, dtype, steps=60) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64)).to(dtype)
    x, y = torch.randn(256, 64, dtype=dtype), torch.randn(256, 64)
    opt = make_optimizer(model.parameters())

    def loss():
        return torch.nn.functional.mse_loss(model(x).float(), y)

    first = loss().item()
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()
    return first - loss().item()


@pytest.fixture(scope="module")
def fp32_master_decrease():
    return _loss_decrease(lambda ps: torch.optim.AdamW(ps, lr=1e-5), torch.float32)


@pytest.mark.parametrize("state_format", ["fp32", "4bit"])
@pytest.mark.parametrize("mode", lowbit_optim.PARAM_UPDATES)
def test_small_lr_bf16_training_tracks_fp32_master(mode, state_format, fp32_master_decrease):
    decrease = _loss_decrease(
        lambda ps: lowbit_optim.AdamW(ps, lr=1e-5, param_update=mode, state_format=state_format, min_quantize_numel=0),
        torch.bfloat16,
    )
    if mode == "nearest":
        assert decrease < 0.3 * fp32_master_decrease  # updates below half a bf16 ulp vanish
    else:
        assert decrease > 0.75 * fp32_master_decrease


def _kahan_movement(sign: float, dtype=torch.bfloat16, **kwargs) -> float:
    """How far 300 AdamW steps of lr 1e-5 move 512 weights of 1.0 (norm gains) with gradients of
    ``sign`` (noise as large: the weights' residues spread out): the mean |weight + compensation - 1|."""
    p = torch.nn.Parameter(torch.ones(512, dtype=dtype))
    opt = lowbit_optim.AdamW([p], lr=1e-5, weight_decay=0.0, min_quantize_numel=0, compile=False, **kwargs)
    g = torch.Generator().manual_seed(1)
    for _ in range(300):
        p.grad = (sign * (torch.randn(512, generator=g) + 1)).to(dtype)
        opt.step()
    compensation = opt.state[p].get("compensation")
    held = torch.zeros(512) if compensation is None else compensation.float()
    return float((p.detach().float() + held - 1).abs().mean())


@functools.cache
def _fp32_movement(sign: float) -> float:
    return _kahan_movement(sign, torch.float32)


def _refused_as_compensation(name: str) -> str | None:
    """The constructor's refusal of format ``name`` as Kahan's compensation, or None."""
    try:
        lowbit_optim.AdamW([torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))], param_update="kahan", compensation_format=name)
    except ValueError as error:
        return str(error)
    return None


SIGNED_FORMATS = [i.name for i in FORMATS if i.fmt.holds_signed and i.name != "bf16"]  # (torchdistx's default: +-10 %, README)


@pytest.mark.parametrize("compensation_format", SIGNED_FORMATS)
@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["down", "up"])
def test_kahan_weights_move_as_fp32_ones_either_way_or_the_format_is_refused(sign, compensation_format):
    """Weights of 1.0 at lr 1e-5 (each step about a tenth of half an ulp) move as fp32 weights do, down
    as up, with every compensation format the constructor takes ('8bit-sr' since its block scales
    keep a block's most negative value). It refuses formats with absmax scales whose signed codes stop
    short of -1 ('8bit' did so until then: the buffer shrank at every write, and weights moving down
    stalled) and formats rounded to nearest ('fp8' moved 58 % as far down, 'nf4' 82 %, '8bit-linear' 93 %)."""
    if _refused_as_compensation(compensation_format) is None:
        moved = _kahan_movement(sign, param_update="kahan", compensation_format=compensation_format)
        assert moved == pytest.approx(_fp32_movement(sign), rel=0.03)


def test_the_compensation_formats_the_readme_names_are_taken_and_nearest_rounded_ones_refused():
    refused = {name: _refused_as_compensation(name) for name in SIGNED_FORMATS}
    assert [name for name in ("fp32", "bf16-sr", "8bit-log", "10bit-sr", "4bit", "8bit-sr") if refused[name]] == []
    for name in ("fp8", "nf4", "8bit-linear", "4bit-calibrated", "8bit-lowrank", "8bit"):
        assert re.fullmatch(rf"compensation_format '{name}' kept -?\d+% of 64 additions .* round stochastically", refused[name])


@pytest.mark.parametrize("compensation_format", ["8bit-torchao", "4bit-torchao", "4bit-precond"])
def test_a_compensation_format_that_shrinks_negative_blocks_is_refused(compensation_format):
    with pytest.raises(ValueError, match=rf"compensation_format '{compensation_format}' reads a block whose largest value is negative back as 0.\d+ of it"):
        lowbit_optim.AdamW([torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))], param_update="kahan", compensation_format=compensation_format)


def test_a_compensation_format_without_kahan_summation_is_refused():
    """It used to be ignored: the weights were rounded to nearest, with no buffer and no word."""
    params = [torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))]
    with pytest.raises(ValueError, match=r"compensation_format='8bit-log' is the buffer of param_update='kahan', but its param_update is 'stochastic'"):
        lowbit_optim.AdamW(params, param_update="stochastic", compensation_format="8bit-log")
    with pytest.raises(ValueError, match=r"a param group's compensation_format='fp32' is the buffer of param_update='kahan', but its param_update is 'nearest'"):
        lowbit_optim.AdamW([{"params": params, "compensation_format": "fp32"}])
    # the constructor's buffer for a group that chooses Kahan summation; torchdistx's alias ignores it, as torchdistx does
    opt = lowbit_optim.AdamW([{"params": params, "param_update": "kahan"}], compensation_format="fp32")
    assert opt.param_groups[0]["compensation_format"] == "fp32"
    opt = lowbit_optim.AdamW(params)
    assert opt.param_groups[0]["compensation_format"] == "bf16"
    lowbit_optim.AnyPrecisionAdamW(params, compensation_buffer_dtype=torch.float32)
    # a group copied from an optimizer's own holds the default buffer: taken, as it was
    more = [torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]
    opt.add_param_group({**opt.param_groups[0], "params": more})
    lowbit_optim.AdamW(opt.param_groups)
    # MuonWithAdamW's shared options: the buffer of the part that sums so
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    both = lowbit_optim.MuonWithAdamW(model, adamw=dict(param_update="kahan"), compensation_format="bf16-sr", compile=False)
    assert [g["compensation_format"] for g in (both.muon.param_groups[0], both.adamw.param_groups[0])] == ["bf16", "bf16-sr"]


@pytest.mark.parametrize("mode", [m for m in lowbit_optim.PARAM_UPDATES if m != "nearest"])
def test_fp16_weights_made_after_the_constructor_are_refused_at_the_step(mode):
    """model.half() after building: the mode, which fp16 weights cannot take, was dropped silently
    (rounded to nearest, small updates vanishing); the step refuses as the constructor does."""
    model = torch.nn.Linear(4, 4)
    opt = lowbit_optim.AdamW(model.parameters(), param_update=mode, compile=False)
    model.half()
    model(torch.randn(2, 4, dtype=torch.float16)).float().sum().backward()
    with pytest.raises(ValueError, match=rf"param_update='{mode}' applies to bf16 parameters; fp16 ones are rounded to nearest"):
        opt.step()


# ---- API ----------------------------------------------------------------------------------------------


def _bf16_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Linear(64, 2)).to(torch.bfloat16)


def _stood_for(optimizer, weight, mode):
    """The fp32 weight bf16 ``weight`` and its buffer under ``mode`` (kahan, int8-correction) stand for."""
    buffer = optimizer.state[weight][precision.extra_state_name(mode)].float()
    return weight.float() + (buffer if mode == "kahan" else buffer * precision.bf16_ulp(weight.float()) / precision.CORRECTION_UNITS_PER_ULP)


def _train(model, opt, steps):
    for i in range(steps):
        x = torch.randn(8, 80, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def test_any_precision_adamw_maps_torchdistx_arguments():
    import inspect

    assert list(inspect.signature(lowbit_optim.AnyPrecisionAdamW).parameters)[: len(TORCHDISTX_ARGS)] == TORCHDISTX_ARGS
    model = _bf16_model()
    opt = lowbit_optim.AnyPrecisionAdamW(
        model.parameters(), use_kahan_summation=True, momentum_dtype=torch.bfloat16, variance_dtype="8bit",
        compensation_buffer_dtype="4bit", min_quantize_numel=0,
    )  # fmt: skip
    _train(model, opt, 1)
    state = opt.state[model[0].weight]
    assert state["exp_avg"].dtype == torch.bfloat16 and not isinstance(state["exp_avg"], lowbit_optim.OptimState)
    assert type(state["exp_avg_sq"]) is lowbit_optim.OptimState8bit
    assert type(state["compensation"]) is lowbit_optim.OptimState4bit
    assert opt.param_groups[0]["weight_decay"] == 0.0
    # torchdistx's defaults (src/python/torchdistx/optimizers/anyprecision_optimizer.py): momentum in fp32, variance in bf16
    assert lowbit_optim.AnyPrecisionAdamW(model.parameters()).param_groups[0]["state_format"] == {"exp_avg": "fp32", "exp_avg_sq": "bf16"}
    with pytest.raises(ValueError, match="unsupported state dtype"):
        lowbit_optim.AnyPrecisionAdamW(model.parameters(), momentum_dtype=torch.float16)


def test_any_precision_adamw_takes_torchdistx_options_per_group():
    """torchdistx reads its options from each group: a group's own apply to its states, the
    constructor's to the options it leaves out; one also setting what they become is refused."""
    model = _bf16_model()
    first, second = model[0].weight, model[1].weight
    opt = lowbit_optim.AnyPrecisionAdamW(
        [{"params": [first], "momentum_dtype": torch.bfloat16}, {"params": [second], "use_kahan_summation": True, "variance_dtype": "8bit"}],
        momentum_dtype="8bit", min_quantize_numel=0, compile=False,
    )  # fmt: skip
    _train(model, opt, 1)
    assert not isinstance(opt.state[first]["exp_avg"], lowbit_optim.OptimState) and opt.state[first]["exp_avg"].dtype == torch.bfloat16
    assert "compensation" not in opt.state[first]
    assert [type(opt.state[second][n]) for n in ("exp_avg", "exp_avg_sq")] == [lowbit_optim.OptimState8bit] * 2
    assert opt.state[second]["compensation"].dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"a param group sets \['momentum_dtype'\] and \['state_format'\], which they become"):
        opt.add_param_group({"params": [model[0].bias], "momentum_dtype": torch.bfloat16, "state_format": "8bit"})


TORCHDISTX_KAHAN = dict(use_kahan_summation=True, momentum_dtype=torch.bfloat16, variance_dtype=torch.bfloat16, compensation_buffer_dtype=torch.bfloat16)


def as_torchdistx_checkpoint(state_dict: dict) -> dict:
    """``state_dict`` laid out as torchdistx's AnyPrecisionAdamW saves it: its options as group keys
    (Kahan summation, bf16 states), none of lowbit_optim's."""
    ours = ("state_format", "param_update", "compensation_format", "block_size", "min_quantize_numel", "fused", "compile")
    groups = [{**{k: v for k, v in g.items() if k not in ours}, **TORCHDISTX_KAHAN} for g in state_dict["param_groups"]]
    return {"state": state_dict["state"], "param_groups": groups}


@pytest.mark.parametrize("built", ["as saved", "defaults"])
def test_any_precision_adamw_loads_a_torchdistx_checkpoint(built):
    """torchdistx's group keys are not kept (they would say Kahan summation where the optimizer does
    none). Built with the checkpoint's options, the run resumes bit-exactly, Kahan buffer and all;
    built otherwise, the states convert to its settings, and a warning names the group."""
    model = _bf16_model()
    opt = lowbit_optim.AnyPrecisionAdamW(model.parameters(), lr=1e-2, **TORCHDISTX_KAHAN)
    _train(model, opt, 2)
    checkpoint = as_torchdistx_checkpoint(copy.deepcopy(opt.state_dict()))
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.AnyPrecisionAdamW(resumed_model.parameters(), lr=1e-2, **(TORCHDISTX_KAHAN if built == "as saved" else {}))
    if built == "as saved":
        resumed.load_state_dict(checkpoint)
    else:
        with pytest.warns(UserWarning, match=r"param group 0 of this torchdistx checkpoint has \{'use_kahan_summation': True.*its states load converted"):
            resumed.load_state_dict(checkpoint)
    assert not {"use_kahan_summation", "momentum_dtype", "variance_dtype", "compensation_buffer_dtype"} & resumed.param_groups[0].keys()
    assert ("compensation" in resumed.state[resumed_model[0].weight]) == (built == "as saved")
    if built == "as saved":
        _train(model, opt, 2)
        _train(resumed_model, resumed, 2)
        for a, b in zip(model.parameters(), resumed_model.parameters()):
            assert torch.equal(a, b)


@pytest.mark.parametrize("saved, loaded", [("kahan", "int8-correction"), ("int8-correction", "kahan"), ("kahan", "nearest")])
def test_a_buffer_of_the_other_param_update_loads_converted(saved, loaded):
    """A Kahan checkpoint loaded by an int8-correction optimizer, or the other way round: the buffer
    converts at the parameter's first step (both hold the fp32 weights, the int8 units to 1/254 of
    an ulp), from the weights loaded by then, whatever the order of the two loads; it was dropped,
    the new one starting from zero error. Where the optimizer keeps none, a warning says it is dropped."""
    model = _bf16_model()
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-3, param_update=saved, compensation_format="fp32" if saved == "kahan" else None)
    _train(model, opt, 3)
    weight = model[0].weight
    unit = precision.bf16_ulp(weight.float()) / precision.CORRECTION_UNITS_PER_ULP
    expected = _stood_for(opt, weight, saved)
    assert bool((expected != weight.float()).any()), "test setup: buffers that hold something"
    fresh = copy.deepcopy(model)
    for p in fresh.parameters():  # a model built afresh: its weights are loaded after the optimizer's state
        p.data.zero_()
    resumed = lowbit_optim.AdamW(fresh.parameters(), lr=0.0, param_update=loaded, **({"compensation_format": "fp32"} if loaded == "kahan" else {}))
    if loaded == "nearest":
        with pytest.warns(UserWarning, match=r"the checkpoint's compensation buffers .* are dropped: this optimizer's param_update \('nearest'\)"):
            resumed.load_state_dict(opt.state_dict())
        return
    resumed.load_state_dict(opt.state_dict())
    fresh.load_state_dict(model.state_dict())
    for group in resumed.param_groups:  # a step that moves nothing
        group["lr"] = 0.0
    for p in fresh.parameters():
        p.grad = torch.zeros_like(p)
    resumed.step()  # (a weight just above a power of two may round to the finer bf16 value below it)
    assert bool(((_stood_for(resumed, fresh[0].weight, loaded) - expected).abs() <= unit / 2).all())


@pytest.mark.parametrize("mode", ["kahan", "int8-correction"])
def test_a_checkpoint_saved_after_model_float_resumes_exactly(mode):
    """Saved after model.float() and before the step that folds the buffer in: the resumed run folds
    it as the original does (the load had dropped it, as an fp32 parameter's)."""
    model = _bf16_model()
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-3, param_update=mode)
    _train(model, opt, 3)
    model.float()
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.AdamW(resumed_model.parameters(), lr=1e-3, param_update=mode)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    for m, o in ((model, opt), (resumed_model, resumed)):
        for i in range(2):
            o.zero_grad()
            m(torch.randn(8, 80, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            o.step()
    assert "compensation" not in resumed.state[model[0].weight] and "param_correction" not in resumed.state[resumed_model[0].weight]
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)


def test_any_precision_adamw_loads_matching_torchdistx_options_without_a_warning():
    """A group whose state_format is one name for every state (fp32) matches torchdistx's fp32
    momentum and variance: no warning (it compared the name with the per-state dict)."""
    model = _bf16_model()
    opt = lowbit_optim.AnyPrecisionAdamW([{"params": model.parameters(), "state_format": "fp32"}], compile=False)
    _train(model, opt, 1)
    checkpoint = copy.deepcopy(opt.state_dict())
    for group in checkpoint["param_groups"]:
        group.update(use_kahan_summation=False, momentum_dtype=torch.float32, variance_dtype=torch.float32, compensation_buffer_dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.load_state_dict(checkpoint)


def test_precision_buffers_only_for_bf16_params():
    fp32 = torch.nn.Parameter(torch.randn(80))
    bf16 = torch.nn.Parameter(torch.randn(80, dtype=torch.bfloat16))
    opt = lowbit_optim.AdamW([fp32, bf16], param_update="int8-correction")
    for p in (fp32, bf16):
        p.grad = torch.ones_like(p)
    opt.step()
    assert "param_correction" not in opt.state[fp32]
    assert opt.state[bf16]["param_correction"].dtype == torch.int8


@pytest.mark.parametrize("cls", [lowbit_optim.Adam, lowbit_optim.AdamW, lowbit_optim.AdamW8bit, lowbit_optim.Adam4bit])
def test_bf16_stochastic_round_flag(cls):
    opt = cls(_bf16_model().parameters(), bf16_stochastic_round=True)
    assert opt.param_groups[0]["param_update"] == "stochastic"


def test_flag_conflict_and_unknown_mode_are_errors():
    params = _bf16_model().parameters
    with pytest.raises(ValueError, match="contradicts"):
        lowbit_optim.AdamW(params(), bf16_stochastic_round=True, param_update="kahan")
    with pytest.raises(ValueError, match="unknown param_update 'exact'"):
        lowbit_optim.AdamW(params(), param_update="exact")


def _sgd_step_by_hand(param, extra, mode):
    number = functools.partial(torch.tensor, dtype=torch.float32)
    lowbit_optim.sgd_step(param, torch.zeros_like(param, dtype=torch.float32), None, None, extra, number(1e-3), number(0.0),
                          number(0.0), number(1.0), nesterov=False, maximize=False, param_update=mode)  # fmt: skip


@pytest.mark.parametrize("mode", ["stochastic", "kahan", "int8-correction"])
def test_step_functions_called_by_hand_write_fp32_parameters_as_they_are(mode):
    """As the optimizers do: the modes are for bf16 weights; an fp32 one keeps the step's value
    (a step of zero leaves it as it was, not rounded to bf16)."""
    param = torch.full((4,), 1.2345678)
    _sgd_step_by_hand(param, None, mode)
    assert torch.equal(param, torch.full((4,), 1.2345678))


def test_step_functions_called_by_hand_check_their_mode():
    param = torch.ones(4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="unknown param_update 'stochastc'"):
        _sgd_step_by_hand(param, None, "stochastc")
    with pytest.raises(ValueError, match=r"unknown param_update 'stochastc'"):
        _sgd_step_by_hand(param.float(), None, "stochastc")  # (whatever the dtype)
    with pytest.raises(ValueError, match=r"param_update='kahan' keeps a buffer beside the parameter \(compensation\): pass it as param_extra"):
        _sgd_step_by_hand(param, None, "kahan")


@pytest.mark.parametrize("mode,compensation", [("kahan", "8bit-log"), ("kahan", "bf16"), ("int8-correction", None), ("stochastic", None)])
def test_checkpoint_resumes_exactly(mode, compensation):
    """Stochastic rounding draws from torch's generator: the resumed run restores its state, as the
    README says to."""
    model = _bf16_model()
    kwargs = dict(lr=1e-3, param_update=mode, state_format="4bit", min_quantize_numel=0)
    if compensation is not None:
        kwargs["compensation_format"] = compensation
    opt = lowbit_optim.AdamW(model.parameters(), **kwargs)
    _train(model, opt, 3)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.AdamW(resumed_model.parameters(), **kwargs)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    rng = torch.get_rng_state()
    _train(model, opt, 3)
    torch.set_rng_state(rng)
    _train(resumed_model, resumed, 3)
    for a, b in zip(model.parameters(), resumed_model.parameters()):
        assert torch.equal(a, b)
    name = precision.extra_state_name(mode)
    if name is None:
        return
    a, b = opt.state[model[0].weight][name], resumed.state[resumed_model[0].weight][name]
    assert torch.equal(a.dequantize() if isinstance(a, lowbit_optim.OptimState) else a, b.dequantize() if isinstance(b, lowbit_optim.OptimState) else b)


def test_loading_without_precision_buffer_starts_from_zero_error():
    model = _bf16_model()
    plain = lowbit_optim.AdamW(model.parameters())
    _train(model, plain, 1)
    kahan = lowbit_optim.AdamW(model.parameters(), param_update="kahan")
    kahan.load_state_dict(plain.state_dict())
    assert torch.equal(kahan.state[model[0].weight]["compensation"], torch.zeros(64, 80, dtype=torch.bfloat16))
    _train(model, kahan, 1)


@pytest.mark.parametrize("mode", ["kahan", "int8-correction"])
def test_a_model_cast_to_bf16_after_a_step_starts_its_buffer_from_zero_error(mode):
    """model.bfloat16() keeps the Parameter objects: their next step makes the buffer their mode
    needs, from zero error, as a load without it does."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Linear(64, 2))
    opt = lowbit_optim.AdamW(model.parameters(), param_update=mode)
    model(torch.randn(8, 80)).square().mean().backward()
    opt.step()
    name = precision.extra_state_name(mode)
    assert name not in opt.state[model[0].weight]
    model.bfloat16()
    _train(model, opt, 2)
    assert opt.state[model[0].weight][name].shape == (64, 80) and bool(model[0].weight.isfinite().all())


@pytest.mark.parametrize("fused", [None, False], ids=["fused", "compiled"])
@pytest.mark.parametrize("mode", ["kahan", "int8-correction"])
def test_a_model_made_fp32_after_bf16_steps_takes_the_weights_its_buffer_stood_for(mode, fused):
    """model.float() after bf16 steps: the next step folds the buffer into the fp32 weights (the
    weights that run stood for) and drops it, and a cast back to bf16 starts one afresh. The stale
    buffer was kept, and read as the new bf16 weights' (a step of lr 0 moved them)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(80, 64), torch.nn.Linear(64, 2)).bfloat16()
    exact = {"compensation_format": "fp32"} if mode == "kahan" else {}
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-3, param_update=mode, fused=fused, **exact)
    _train(model, opt, 3)
    name, weight = precision.extra_state_name(mode), model[0].weight
    stood_for = _stood_for(opt, weight, mode)
    assert bool((stood_for != weight.float()).any()), "test setup: a buffer that holds something"
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        before = weight.detach().clone()
        opt.param_groups[0]["lr"] = 0.0  # a step that moves nothing
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        if dtype == torch.float32:
            assert torch.equal(weight, stood_for) and name not in opt.state[weight]
        else:
            assert torch.equal(weight, before) and not bool(opt.state[weight][name].float().any())


@pytest.mark.parametrize("mode", ["stochastic", "kahan", "int8-correction"])
def test_fp16_parameters_refuse_a_bf16_param_update(mode):
    """The param_update modes keep bf16 weights precise; fp16 weights would be rounded to nearest
    whatever was asked (small updates vanishing silently): refused with the alternatives."""
    p = torch.nn.Parameter(torch.ones(256, dtype=torch.float16))
    with pytest.raises(ValueError, match=rf"param_update='{mode}' applies to bf16 parameters; fp16 ones are rounded to nearest"):
        lowbit_optim.SGD([p], lr=1e-4, param_update=mode)
    lowbit_optim.SGD([p], lr=1e-4)  # nearest, as torch.optim
