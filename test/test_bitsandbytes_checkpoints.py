"""bitsandbytes optimizer checkpoints load into lowbit_optim, so that switching mid-run is an import
change: AdamW8bit / AdamW32bit -> AdamW, Adam8bit / Adam32bit -> Adam (its weight decay decoupled, as
theirs), Lion8bit / Lion32bit -> Lion, SGD8bit / SGD32bit -> SGD, AdEMAMix8bit /
AdEMAMix(optim_bits=32) -> AdEMAMix.

bitsandbytes (0.50) steps on the CPU; its state_dict() puts state1 / state2 (codes or fp32 values),
absmax1 / absmax2 (one scale per block of 256) and qmap1 / qmap2 (the code tables) of each parameter
under "__bnb_optimizer_quant_state__"; AdEMAMix stacks its two first moments in state1 (2, *shape).
bitsandbytes' dynamic 8-bit code tables are our "8bit" codebooks value for value, so an 8bit
optimizer keeps its codes and scales: the loaded state is bitsandbytes' state bit for bit. Its
quantizer is not exact nearest rounding (zero encodes as 4.4e-5 of the block's absmax, for one), so
after loading the two runs go on with slightly different codes: "close", not equal.

The model (test_optim.make_mlp): a 6144-element weight (24 whole blocks), a 4544-element one (a
short last block) and two biases below min_8bit_size (fp32 state in bitsandbytes' 8-bit optimizers).
"""

import copy

import expecttest
import pytest
import torch
from test_optim import assert_same_bits, eager_step, make_mlp, save_and_load, stored_as, train  # noqa: F401

import lowbit_optim
from lowbit_optim.formats import get_format

bnb = pytest.importorskip("bitsandbytes")
from bitsandbytes import functional as bnb_functional  # noqa: E402

STEPS = 3  # before the checkpoint, and after it in both runs

# our optimizer -> (bitsandbytes' 8-bit class and keywords, its 32-bit class and keywords, our alias,
# our keywords). Hyper-parameters differ from the defaults so that loading them can be checked.
CASES = {
    "AdamW": (("AdamW8bit", {}), ("AdamW32bit", {}), "AdamW8bit", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    # bitsandbytes' Adam decouples its weight decay: its checkpoint makes ours do so too
    "Adam": (("Adam8bit", {}), ("Adam32bit", {}), "Adam8bit", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.1)),
    "Lion": (("Lion8bit", {}), ("Lion32bit", {}), "Lion8bit", dict(lr=3e-3, betas=(0.95, 0.98), weight_decay=0.1)),
    "SGD": (("SGD8bit", {}), ("SGD32bit", {}), "SGD8bit", dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "AdEMAMix": (
        ("AdEMAMix8bit", {}),
        ("AdEMAMix", dict(optim_bits=32)),
        "AdEMAMix8bit",
        dict(lr=1e-2, betas=(0.8, 0.99, 0.999), alpha=4.0, t_alpha=10, t_beta3=20),
    ),
}
# the hyper-parameters bitsandbytes records, as our param groups hold them after loading
LOADED_KEYS = {"AdamW": ("lr", "betas", "weight_decay"), "Adam": ("lr", "betas", "weight_decay", "decoupled_weight_decay"), "Lion": ("lr", "betas", "weight_decay"), "SGD": ("lr", "momentum", "weight_decay"),
               "AdEMAMix": ("lr", "betas", "alpha", "t_alpha", "t_beta3")}  # fmt: skip
STATE_NAMES = {"AdamW": ("exp_avg", "exp_avg_sq"), "Adam": ("exp_avg", "exp_avg_sq"), "Lion": ("exp_avg",), "SGD": ("momentum_buffer",),
               "AdEMAMix": ("exp_avg", "exp_avg_slow", "exp_avg_sq")}  # fmt: skip

# Continuing 3 steps from the loaded state, against bitsandbytes continuing: the parameter change
# of each tensor, relative. 32-bit into fp32: fp32 round-off (observed 2.7e-7 absolute). 8-bit: its
# quantizer and ours round differently (observed up to 1.6 % into 8bit, 2.6 % into fp32).
RELATIVE_CHANGE_TOL_8BIT = 0.05


def bitsandbytes_run(name: str, bits: int):
    """A model trained STEPS steps by bitsandbytes' version of our ``name``, its optimizer, and the
    checkpoint as torch.load(weights_only=True) returns it."""
    (cls8, kw8), (cls32, kw32), _, kwargs = CASES[name]
    cls, extra = (cls8, kw8) if bits == 8 else (cls32, kw32)
    model = make_mlp()
    opt = getattr(bnb.optim, cls)(model.parameters(), **kwargs, **extra)
    train(model, opt, STEPS)
    return model, opt, save_and_load(opt.state_dict())


def bitsandbytes_states(opt, model, name: str) -> dict:
    """(parameter index, our state name) -> the state of bitsandbytes' version of our ``name``:
    (codes, absmax, qmap) or fp32 values."""
    out = {}
    for i, p in enumerate(model.parameters()):
        state = opt.state[p]
        pieces = []
        for j in (1, 2):
            if f"state{j}" not in state:
                continue
            value = state[f"state{j}"]
            stacked = value.dim() == p.dim() + 1
            halves = value.unbind(0) if stacked else [value]
            if value.dtype == torch.uint8:
                absmax = state[f"absmax{j}"].unbind(0) if stacked else [state[f"absmax{j}"]]
                pieces += [(h, a, state[f"qmap{j}"]) for h, a in zip(halves, absmax)]
            else:
                pieces += list(halves)
        out.update({(i, state_name): piece for state_name, piece in zip(STATE_NAMES[name], pieces)})
    return out


def values_of(piece) -> torch.Tensor:
    """What a bitsandbytes state stands for, computed by bitsandbytes."""
    if isinstance(piece, tuple):
        codes, absmax, qmap = piece
        return bnb_functional.dequantize_blockwise(codes, absmax=absmax, code=qmap, blocksize=256)
    return piece


def ours(name: str, params, state_format: str, **kwargs):
    # lr=0.5 and friends: loading must replace them with the checkpoint's hyper-parameters
    defaults = dict(lr=0.5, momentum=0.5) if name == "SGD" else dict(lr=0.5)
    return getattr(lowbit_optim, name)(params, **defaults, state_format=state_format, compile=False, **kwargs)


@torch.no_grad()
def relative_change_error(model, reference, start) -> list[float]:
    return [float((p - q).norm() / (q - s).norm()) for p, q, s in zip(model.parameters(), reference.parameters(), start)]


@pytest.mark.parametrize("state_format", ["8bit-sr", "8bit-torchao"])
def test_bitsandbytes_codes_load_as_they_are_into_formats_that_read_them_alike(state_format):
    """bitsandbytes' 8-bit codes and block scales load unchanged into every format that reads the
    8-bit tree's codes as they do (formats.convert), not requantized: 8bit-torchao's absmax scales
    would shrink each block's negative extreme (8bit-sr's writes would keep these values, so it
    passed before as well)."""
    model, reference, checkpoint = bitsandbytes_run("Lion", 8)
    resumed = ours("Lion", model.parameters(), state_format)
    resumed.load_state_dict(checkpoint)
    for (i, state_name), piece in bitsandbytes_states(reference, model, "Lion").items():
        p = list(model.parameters())[i]
        state = resumed.state[p][state_name]
        if isinstance(piece, tuple):
            codes, absmax, _ = piece
            assert stored_as(state) == state_format, (i, state_name)
            assert torch.equal(state.codes[: p.numel()], codes.reshape(-1)) and torch.equal(state.scale, absmax), (i, state_name)


@pytest.mark.parametrize("state_format", ["8bit", "fp32", "4bit"])
@pytest.mark.parametrize("bits", [8, 32])
@pytest.mark.parametrize("name", CASES)
def test_bitsandbytes_checkpoint_loads(name, bits, state_format):
    """The loaded states: bitsandbytes' codes and scales bit for bit (8-bit into 8bit), the exact
    values they stand for (into fp32; 32-bit states as saved), their quantization (into 4bit, and
    32-bit into 8bit); the step count and hyper-parameters of the checkpoint, our formats. Then 3
    more steps in both: 32-bit into fp32 within fp32 round-off of bitsandbytes, 8-bit into 8bit or
    fp32 within 5 % of its parameter change; and a lowbit_optim checkpoint of the loaded optimizer
    resumes bit-exactly."""
    model, reference, checkpoint = bitsandbytes_run(name, bits)
    theirs = bitsandbytes_states(reference, model, name)
    resumed_model = copy.deepcopy(model)
    resumed = ours(name, resumed_model.parameters(), state_format)
    resumed.load_state_dict(checkpoint)

    group, kwargs = resumed.param_groups[0], CASES[name][3] | {"decoupled_weight_decay": True}
    for key in LOADED_KEYS[name]:
        assert group[key] == kwargs[key], key
    assert group["state_format"] == state_format
    assert set(theirs) == {(i, n) for i, p in enumerate(resumed_model.parameters()) for n in resumed.state[p] if n != "step"}
    for (i, state_name), piece in theirs.items():
        p = list(resumed_model.parameters())[i]
        state = resumed.state[p][state_name]
        assert float(resumed.state[p]["step"]) == STEPS
        expected_format = state_format if p.numel() >= 4096 else "fp32"
        assert stored_as(state) == expected_format and state.shape == p.shape, (i, state_name)
        values = values_of(piece)
        signed = next(s.signed for s in resumed.states if s.name == state_name)
        if expected_format == "fp32":
            assert torch.equal(state, values), (i, state_name)
        elif expected_format == "8bit" and isinstance(piece, tuple):  # the codes and scales kept
            codes, absmax, _ = piece
            assert state.block_size == 256 and torch.equal(state.codes[: p.numel()], codes.reshape(-1)), (i, state_name)
            assert torch.equal(state.scale, absmax) and torch.equal(state.dequantize(), values), (i, state_name)
        else:  # requantized from the exact values
            assert_same_bits(state, get_format(expected_format).from_float(values, signed), (i, state_name))

    start = [p.detach().clone() for p in model.parameters()]
    copy_model = copy.deepcopy(resumed_model)
    copy_opt = ours(name, copy_model.parameters(), state_format)
    copy_opt.load_state_dict(save_and_load(resumed.state_dict()))
    for m, o in ((model, reference), (resumed_model, resumed), (copy_model, copy_opt)):
        train(m, o, STEPS)
    for a, b in zip(resumed_model.parameters(), copy_model.parameters()):
        assert torch.equal(a, b)
    if bits == 32 and state_format == "fp32":
        for a, b in zip(resumed_model.parameters(), model.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-6)
    elif state_format != "4bit":
        errors = relative_change_error(resumed_model, model, start)
        assert max(errors) < RELATIVE_CHANGE_TOL_8BIT, errors


@pytest.mark.parametrize("name", CASES)
def test_switching_from_bitsandbytes_is_an_import_change(name, eager_step):
    """bitsandbytes' code with lowbit_optim's alias of the same name (AdamW8bit, Lion8bit, SGD8bit,
    AdEMAMix8bit): it loads the bitsandbytes checkpoint keeping every 8-bit code and goes on within
    5 % of bitsandbytes' parameter change."""
    model, reference, checkpoint = bitsandbytes_run(name, 8)
    (cls, extra), _, alias, kwargs = CASES[name]
    resumed_model = copy.deepcopy(model)
    resumed = getattr(lowbit_optim, alias)(resumed_model.parameters(), **kwargs)
    resumed.load_state_dict(checkpoint)
    for (i, state_name), (codes, _, _) in ((k, v) for k, v in bitsandbytes_states(reference, model, name).items() if isinstance(v, tuple)):
        state = resumed.state[list(resumed_model.parameters())[i]][state_name]
        assert stored_as(state) == "8bit" and torch.equal(state.codes[: codes.numel()], codes.reshape(-1))
    start = [p.detach().clone() for p in model.parameters()]
    train(model, reference, STEPS)
    train(resumed_model, resumed, STEPS)
    assert max(relative_change_error(resumed_model, model, start)) < RELATIVE_CHANGE_TOL_8BIT


def test_an_sgd_checkpoint_with_dampening_goes_on_as_bitsandbytes_ran():
    """bitsandbytes' SGD records dampening (its betas' second) but its step never applies it: the
    load takes dampening=0, with a warning that says so, and goes on as bitsandbytes does (applying
    the recorded 0.5 left 39 % of its parameter change)."""
    kwargs = dict(CASES["SGD"][3], dampening=0.5)
    model = make_mlp()
    reference = bnb.optim.SGD8bit(model.parameters(), **kwargs)
    train(model, reference, STEPS)
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.SGD8bit(resumed_model.parameters(), **kwargs)
    with pytest.warns(UserWarning, match=r"records dampening=0.5, which bitsandbytes' step does not apply: loaded as dampening=0"):
        resumed.load_state_dict(save_and_load(reference.state_dict()))
    assert resumed.param_groups[0]["dampening"] == 0.0 and resumed.param_groups[0]["momentum"] == 0.9
    start = [p.detach().clone() for p in model.parameters()]
    train(model, reference, STEPS)
    train(resumed_model, resumed, STEPS)
    assert max(relative_change_error(resumed_model, model, start)) < RELATIVE_CHANGE_TOL_8BIT


@pytest.mark.parametrize("named", [False, True], ids=["parameters", "named_parameters"])
@pytest.mark.parametrize("name", CASES)
def test_a_checkpoint_saved_before_the_first_step_loads_its_hyper_parameters(name, named):
    """bitsandbytes' state_dict() before any step holds no states (at most an empty one, of a
    parameter whose state was read), so its param groups tell it (bitsandbytes' keys alone, an LR
    scheduler's and the parameters' names beside them): its hyper-parameters load as after a step
    (SGD's momentum from its betas, Adam's weight decay decoupled), and none of its keys is left in
    our groups."""
    (cls, extra), _, _, kwargs = CASES[name]
    params = (lambda model: model.named_parameters()) if named else (lambda model: model.parameters())
    model = make_mlp()
    opt = getattr(bnb.optim, cls)(params(model), **kwargs, **extra)
    opt.state[model[0].weight]  # an empty state, as torch.optim's state_dict() then saves
    torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)  # adds initial_lr
    resumed = ours(name, params(make_mlp()), "8bit")
    resumed.load_state_dict(save_and_load(opt.state_dict()))
    group = resumed.param_groups[0]
    for key in LOADED_KEYS[name]:
        assert group[key] == (kwargs | {"decoupled_weight_decay": True})[key], key
    assert group.keys() == ours(name, params(make_mlp()), "8bit").param_groups[0].keys() | {"initial_lr"}
    assert not any(resumed.state.values())


def test_unstepped_checkpoints_of_others_are_not_taken_for_bitsandbytes():
    """torch.optim's and torchao's groups hold flags bitsandbytes' have not (maximize, amsgrad): their
    checkpoints saved before a step load as themselves (Adam's weight decay stays L2)."""
    for other in (torch.optim.Adam(make_mlp().parameters(), weight_decay=0.1), pytest.importorskip("torchao.optim").Adam8bit(make_mlp().parameters(), weight_decay=0.1)):
        resumed = ours("Adam", make_mlp().parameters(), "8bit")
        resumed.load_state_dict(save_and_load(other.state_dict()))
        assert resumed.param_groups[0]["decoupled_weight_decay"] is False, type(other)


@pytest.mark.parametrize("alias", ["Adam8bit", "AdamW8bit", "Lion8bit", "SGD8bit", "AdEMAMix8bit"])
def test_aliases_take_bitsandbytes_arguments(alias):
    """Each alias of a bitsandbytes class name takes its arguments: the same names in the same
    positions, the same defaults where both have one; its positional call builds the same groups as
    the keywords."""
    import inspect

    theirs = inspect.signature(getattr(bnb.optim, alias).__init__).parameters
    ours = inspect.signature(getattr(lowbit_optim, alias).__init__).parameters
    positional = [n for n, p in theirs.items() if p.kind == p.POSITIONAL_OR_KEYWORD]
    assert [n for n, p in ours.items() if p.kind == p.POSITIONAL_OR_KEYWORD][: len(positional)] == positional
    assert theirs.keys() <= ours.keys()
    for name, p in theirs.items():
        if p.default is not p.empty and ours[name].default is not p.empty:
            assert ours[name].default == p.default, name
    values = {n: p.default for n, p in theirs.items() if n not in ("self", "params") and p.default is not p.empty} | {"lr": 0.1, "min_8bit_size": 16}
    by_position = getattr(lowbit_optim, alias)(make_mlp().parameters(), *(values[n] for n in positional[2:]))
    by_keyword = getattr(lowbit_optim, alias)(make_mlp().parameters(), **{n: values[n] for n in positional[2:]})
    assert [{k: v for k, v in g.items() if k != "params"} for g in by_position.param_groups] == [
        {k: v for k, v in g.items() if k != "params"} for g in by_keyword.param_groups
    ]
    assert by_keyword.param_groups[0]["min_quantize_numel"] == 16


def test_unknown_code_table_loads_as_values():
    """A blockwise 8-bit state whose code table is not our codebook (here: bitsandbytes' table,
    reversed, with the codes mapped along) loads as the values it stands for."""
    model, reference, checkpoint = bitsandbytes_run("Lion", 8)
    wrapped = checkpoint["state"][0]["__bnb_optimizer_quant_state__"]
    expected = values_of((wrapped["state1"], wrapped["absmax1"], wrapped["qmap1"]))
    wrapped["state1"], wrapped["qmap1"] = 255 - wrapped["state1"], wrapped["qmap1"].flip(0)
    resumed = ours("Lion", model.parameters(), "fp32")
    resumed.load_state_dict(checkpoint)
    assert torch.equal(resumed.state[model[0].weight]["exp_avg"], expected)


def test_checkpoint_of_bitsandbytes_before_0_44_loads():
    """Releases before 0.49.2 keep the state tensors beside "step" (no wrapper), and before 0.44 the
    8-bit states have blocks of 2048: such a checkpoint (made here by requantizing a Lion8bit one with
    bitsandbytes' own quantizer) loads as the values it stands for (fp32), or as an 8bit state of
    blocks of 2048 over the same codes, which an 8bit optimizer (blocks of 256) requantizes."""
    model, _, checkpoint = bitsandbytes_run("Lion", 8)
    expected = {}
    for key, state in checkpoint["state"].items():
        flat = {**{k: v for k, v in state.items() if k != "__bnb_optimizer_quant_state__"}, **state["__bnb_optimizer_quant_state__"]}
        if flat["state1"].dtype == torch.uint8:
            values = values_of((flat["state1"], flat["absmax1"], flat["qmap1"]))
            codes, quant_state = bnb_functional.quantize_blockwise(values, code=flat["qmap1"], blocksize=2048)
            flat["state1"], flat["absmax1"] = codes, quant_state.absmax
            expected[key] = bnb_functional.dequantize_blockwise(codes, absmax=quant_state.absmax, code=flat["qmap1"], blocksize=2048)
        checkpoint["state"][key] = flat
    params = list(model.parameters())
    fp32 = ours("Lion", params, "fp32")
    fp32.load_state_dict(checkpoint)
    eight = ours("Lion", params, "8bit")
    eight.load_state_dict(checkpoint)
    for key, values in expected.items():
        assert torch.equal(fp32.state[params[key]]["exp_avg"], values)
        state = eight.state[params[key]]["exp_avg"]
        assert state.block_size == 256 and torch.equal(state.dequantize(), get_format("8bit").from_float(values).dequantize())


# ------------------------------------------------------------------------------------------------
# Refused: corrupt or foreign checkpoints
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoints() -> dict:
    return {(name, bits): bitsandbytes_run(name, bits)[2] for name in ("AdamW", "Lion", "AdEMAMix") for bits in (8,)}


def edited(checkpoint: dict, index: int = 0, **changes) -> dict:
    """A copy of ``checkpoint`` with parameter ``index``'s wrapped tensors changed (None: removed)."""
    out = copy.deepcopy(checkpoint)
    wrapped = out["state"][index]["__bnb_optimizer_quant_state__"]
    for key, value in changes.items():
        if value is None:
            del wrapped[key]
        else:
            wrapped[key] = value
    return out


class TestRefused(expecttest.TestCase):
    @pytest.fixture(autouse=True)
    def _checkpoints(self, checkpoints):
        self.checkpoints = checkpoints

    def test_messages(self):
        adamw, lion, ademamix = (self.checkpoints[(n, 8)] for n in ("AdamW", "Lion", "AdEMAMix"))
        state1, lion_absmax, lion_qmap = (lion["state"][0]["__bnb_optimizer_quant_state__"][k] for k in ("state1", "absmax1", "qmap1"))
        bad_group = copy.deepcopy(lion)
        unstepped = {n: save_and_load(getattr(bnb.optim, cls)(make_mlp().parameters(), **kw, **extra).state_dict()) for n, ((cls, extra), _, _, kw) in CASES.items()}
        bad_group["param_groups"][0]["betas"] = (1.5, 0.99)
        cases = {
            "AdamW8bit into Lion": ("Lion", adamw),
            "AdEMAMix8bit into AdamW": ("AdamW", ademamix),
            "Lion8bit into AdEMAMix": ("AdEMAMix", lion),
            "unstepped AdamW8bit into SGD": ("SGD", unstepped["AdamW"]),
            "unstepped AdEMAMix8bit into Lion": ("Lion", unstepped["AdEMAMix"]),
            "unstepped Lion8bit into AdamW": ("AdamW", unstepped["Lion"]),
            "unstepped SGD8bit into AdEMAMix": ("AdEMAMix", unstepped["SGD"]),
            "state1 of another shape": ("Lion", edited(lion, state1=state1[:10])),
            "state1 of int16 codes": ("Lion", edited(lion, state1=state1.to(torch.int16))),
            "absmax1 missing": ("Lion", edited(lion, absmax1=None)),
            "absmax1 a block short": ("Lion", edited(lion, absmax1=torch.zeros(23))),
            "qmap1 of 255 values": ("Lion", edited(lion, qmap1=torch.zeros(255))),
            "qmap1 with a NaN": ("Lion", edited(lion, qmap1=lion_qmap.index_fill(0, torch.tensor([3]), float("nan")))),
            "absmax1 negative, qmap1 not ours": ("Lion", edited(lion, absmax1=torch.full_like(lion_absmax, -0.5), qmap1=lion_qmap * (1 + 2**-20))),
            "state1 missing": ("Lion", edited(lion, state1=None)),
            "state1 a subclass": ("Lion", edited(lion, state1=torch.nn.Parameter(state1.float(), requires_grad=False))),
            "state1 sparse": ("Lion", edited(lion, state1=state1.to_sparse())),
            "absmax1 on the meta device": ("Lion", edited(lion, absmax1=lion_absmax.to("meta"))),
            "qmap1 sparse": ("Lion", edited(lion, qmap1=lion_qmap.to_sparse())),
            "non-blockwise 8-bit (max1)": ("Lion", edited(lion, max1=torch.zeros(1))),
            "percentile clipping (gnorm_vec)": ("Lion", edited(lion, gnorm_vec=torch.zeros(100))),
            "beta1 of 1.5": ("Lion", bad_group),
            "another grouping": ("Lion", {**lion, "param_groups": lion["param_groups"] * 2}),
        }
        rows = []
        for case, (name, checkpoint) in cases.items():
            opt = ours(name, make_mlp().parameters(), "8bit")
            with self.assertRaises(ValueError) as caught:
                opt.load_state_dict(checkpoint)
            rows.append(f"{case}: {caught.exception}")
        self.assertExpectedInline("\n".join(rows), """\
AdamW8bit into Lion: bitsandbytes state of parameter 0 (shape (64, 96)) holds 2 state tensors (state1, state2), and Lion keeps 1 (exp_avg under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
AdEMAMix8bit into AdamW: bitsandbytes state of parameter 0 (shape (64, 96)) holds 3 state tensors (state1[0], state1[1], state2), and Adam/AdamW keeps 2 (exp_avg, exp_avg_sq under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
Lion8bit into AdEMAMix: bitsandbytes state of parameter 0 (shape (64, 96)) holds 1 state tensor (state1), and AdEMAMix keeps 3 (exp_avg, exp_avg_slow, exp_avg_sq under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
unstepped AdamW8bit into SGD: param group 0 of this bitsandbytes checkpoint is of an optimizer keeping 2 states (it holds alpha, t_alpha, t_beta3, which bitsandbytes' Adam, AdamW, AdEMAMix and LAMB save), and SGD keeps 1 (momentum_buffer under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
unstepped AdEMAMix8bit into Lion: param group 0 of this bitsandbytes checkpoint is of an optimizer keeping 2 states (it holds alpha, t_alpha, t_beta3, which bitsandbytes' Adam, AdamW, AdEMAMix and LAMB save), and Lion keeps 1 (exp_avg under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
unstepped Lion8bit into AdamW: param group 0 of this bitsandbytes checkpoint is of an optimizer keeping 1 state (its eps is 0, as bitsandbytes' SGD and Lion save it), and Adam/AdamW keeps 2 (exp_avg, exp_avg_sq under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
unstepped SGD8bit into AdEMAMix: param group 0 of this bitsandbytes checkpoint is of an optimizer keeping 1 state (its eps is 0, as bitsandbytes' SGD and Lion save it), and AdEMAMix keeps 3 (exp_avg, exp_avg_slow, exp_avg_sq under this param group's options): it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)
state1 of another shape: bitsandbytes state of parameter 0 (shape (64, 96)): state1 has shape (10, 96), not the parameter's shape (or (2, *shape) for AdEMAMix's first moments): the checkpoint belongs to another model
state1 of int16 codes: bitsandbytes state of parameter 0 (shape (64, 96)): state1 has dtype torch.int16; bitsandbytes' states are float32 or uint8 (8-bit codes)
absmax1 missing: bitsandbytes state of parameter 0 (shape (64, 96)): the 8-bit state1 needs absmax1, a float32 tensor of shape (24,) (one scale per block of 256; of 2048 before bitsandbytes 0.44), got missing
absmax1 a block short: bitsandbytes state of parameter 0 (shape (64, 96)): the 8-bit state1 needs absmax1, a float32 tensor of shape (24,) (one scale per block of 256; of 2048 before bitsandbytes 0.44), got a torch.float32 tensor of shape (23,)
qmap1 of 255 values: bitsandbytes state of parameter 0 (shape (64, 96)): the 8-bit state1 needs qmap1, a float32 table of 256 code values, got a torch.float32 tensor of shape (255,)
qmap1 with a NaN: bitsandbytes state of parameter 0 (shape (64, 96)): qmap1 holds a non-finite value: it is corrupt
absmax1 negative, qmap1 not ours: bitsandbytes state of parameter 0 (shape (64, 96)): absmax1 holds a negative value (-0.5), where it holds block maxima: it is corrupt
state1 missing: bitsandbytes state of parameter 0 (shape (64, 96)) lacks 'state1' but holds ['absmax1', 'qmap1', 'step']: the checkpoint is truncated or edited
state1 a subclass: bitsandbytes state of parameter 0 (shape (64, 96)): state1 is a torch.float32 Parameter of shape (64, 96), not a plain tensor
state1 sparse: bitsandbytes state of parameter 0 (shape (64, 96)): state1 is a torch.sparse_coo tensor, not a dense one
absmax1 on the meta device: bitsandbytes state of parameter 0 (shape (64, 96)): absmax1 is on the meta device, where it holds no values
qmap1 sparse: bitsandbytes state of parameter 0 (shape (64, 96)): qmap1 is a torch.sparse_coo tensor, not a dense one
non-blockwise 8-bit (max1): bitsandbytes state of parameter 0 (shape (64, 96)) holds ['max1'] (non-blockwise 8-bit states (block_wise=False)): lowbit_optim reads bitsandbytes' blockwise 8-bit and 32-bit states (step, state1, state2, absmax1, absmax2, qmap1, qmap2)
percentile clipping (gnorm_vec): bitsandbytes state of parameter 0 (shape (64, 96)) holds ['gnorm_vec'] (the gradient norms of percentile_clipping, which lowbit_optim does not do: clip with torch.nn.utils.clip_grad_norm_ and delete 'gnorm_vec' from the states to load the rest): lowbit_optim reads bitsandbytes' blockwise 8-bit and 32-bit states (step, state1, state2, absmax1, absmax2, qmap1, qmap2)
beta1 of 1.5: param group 0 of this bitsandbytes checkpoint: invalid betas (1.5, 0.99): each beta must be in [0, 1)
another grouping: this bitsandbytes checkpoint has param groups of [4, 4] parameters, this optimizer of [4]: build the optimizer over the same parameters, in the same groups""")
