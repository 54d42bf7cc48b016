"""torchao optimizer checkpoints (torchao's own state subclasses) load into lowbit_optim and training
resumes: bit-exactly where the formats coincide (AdamW8bit -> "8bit-torchao", AdamW4bit -> "4bit-torchao",
AdamWFp8 -> "fp8-torchao"), converted where they do not (AdamW4bit -> lowbit_optim's "4bit"). lowbit_optim's
AdamW8bit ("8bit") loads torchao's codes and scales as they are and goes on with its own block scales.

Checkpoints go through torch.save and torch.load(weights_only=True), which accepts torchao's classes
once ``torchao.optim`` is imported (it allowlists them). Model and training as in test_optim's
test_matches_torchao: torchao quantizes only tensors whose numel is a multiple of its block size, so
the model is bias-free (a 6144-element quantized and a 512-element fp32-state weight).
"""

import copy
import functools
import types

import pytest
import torch

import lowbit_optim
from lowbit_optim import OptimState
from lowbit_optim.formats import get_format
from test_optim import LR, TORCHAO_CLASSES, assert_same_bits, dense, make_mlp, moments, save_and_load, train

ao = pytest.importorskip("torchao.optim")

STEPS = 3  # before the checkpoint, and after it in both runs

# lowbit_optim's optimizer for each format as a torchao user would write it after migrating (the
# default step: the fused CPU kernel), or with the eager reference step
MIGRATED = {
    "8bit-torchao": lambda params: lowbit_optim.AdamW(params, lr=LR, state_format="8bit-torchao"),
    "4bit-torchao": lambda params: lowbit_optim.AdamW(params, lr=LR, state_format="4bit-torchao"),
    "fp8-torchao": lambda params: lowbit_optim.AdamWFp8(params, lr=LR),
}


@pytest.fixture(autouse=True)
def eager_torchao(monkeypatch):
    # torchao compiles its step on every call: eagerly it computes the same numbers without ~25 s of graphs
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)


def torchao_run(torchao_class: str, make_model=lambda: make_mlp(8, bias=False)):
    """A model trained STEPS steps by torchao's ``torchao_class``, its optimizer, and the optimizer's
    checkpoint as torch.load returns it."""
    model = make_model()
    opt = getattr(ao, torchao_class)(model.parameters(), lr=LR)
    train(model, opt, STEPS)
    return model, opt, save_and_load(opt.state_dict())


def in_our_layout(state: torch.Tensor):
    """A torchao state's codes and scales as lowbit_optim stores them: flat uint8 codes (fp8: the
    e4m3 bit patterns; 4-bit: the same nibble packing)."""
    return types.SimpleNamespace(codes=state.codes.reshape(-1).view(torch.uint8), scale=state.scale)


@pytest.mark.parametrize("step_kind", ["eager", "fused"])
@pytest.mark.parametrize("state_format", TORCHAO_CLASSES)
def test_torchao_checkpoint_resumes_bit_exactly(state_format, step_kind):
    """The loaded states hold torchao's codes and scales bit for bit; STEPS more steps equal a
    continued torchao run (eager step: identical params; fused kernel: within 1e-6, as in
    test_matches_torchao)."""
    model, reference, checkpoint = torchao_run(TORCHAO_CLASSES[state_format])
    resumed_model = copy.deepcopy(model)
    if step_kind == "eager":
        resumed = lowbit_optim.AdamW(resumed_model.parameters(), lr=LR, state_format=state_format, compile=False)
    else:
        resumed = MIGRATED[state_format](resumed_model.parameters())
    check_resume(state_format, model, reference, checkpoint, resumed_model, resumed, atol=0 if step_kind == "eager" else 1e-6)


@pytest.mark.parametrize("state_format", ["4bit-torchao", "fp8-torchao"])
def test_torchao_checkpoint_of_partial_blocks_resumes_bit_exactly(state_format):
    """torchao keeps fp32 state for a tensor that is not a whole number of its blocks (here a 71 x 64
    weight of 4544 elements, and the biases); ``AdamWFp8`` and ``4bit-torchao`` do too, so such a
    model's checkpoint resumes as exactly as a bias-free one."""
    model, reference, checkpoint = torchao_run(TORCHAO_CLASSES[state_format], lambda: make_mlp(71))
    assert model[2].weight.numel() >= 4096 and type(checkpoint["state"][2]["exp_avg"]) is torch.Tensor
    resumed_model = copy.deepcopy(model)
    resumed = MIGRATED[state_format](resumed_model.parameters())
    check_resume(state_format, model, reference, checkpoint, resumed_model, resumed, atol=1e-6)


def test_torchao_8bit_checkpoint_of_partial_blocks_is_quantized():
    """``AdamW8bit`` is bitsandbytes' name too and quantizes a tensor that is not whole blocks, as
    bitsandbytes (and "8bit") does: torchao's fp32 state of such a tensor loads quantized from its
    values; the whole-block tensors keep torchao's codes."""
    model, reference, checkpoint = torchao_run("AdamW8bit", lambda: make_mlp(71))
    resumed_model = copy.deepcopy(model)
    resumed = lowbit_optim.AdamW8bit(resumed_model.parameters(), lr=LR)
    resumed.load_state_dict(checkpoint)
    uneven = resumed_model[2].weight
    for key, state in moments(reference, model).items():
        ours = moments(resumed, resumed_model)[key]
        if type(state) is not torch.Tensor:
            assert_same_bits(ours, in_our_layout(state), key)
        elif key[0] == 2:  # the 71 x 64 weight
            assert_same_bits(ours, get_format("8bit").from_float(state, ours.signed), key)
        else:
            assert torch.equal(ours, state), key
    assert isinstance(resumed.state[uneven]["exp_avg"], OptimState)


def check_resume(state_format, model, reference, checkpoint, resumed_model, resumed, atol: float) -> None:
    """``resumed`` loads torchao's ``checkpoint``: its states hold torchao's codes and scales bit
    for bit (plain states equal), and STEPS more steps stay within ``atol`` of torchao's run."""
    resumed.load_state_dict(checkpoint)
    expected = moments(reference, model)
    assert moments(resumed, resumed_model).keys() == expected.keys()
    for key, state in moments(resumed, resumed_model).items():
        other = expected[key]
        if type(other) is torch.Tensor:  # a parameter torchao keeps in fp32 state
            assert type(state) is torch.Tensor and torch.equal(state, other), key
            continue
        assert type(state).name == state_format and state.block_size == other.block_size, key
        assert_same_bits(state, in_our_layout(other), key)
    assert all(float(resumed.state[p]["step"]) == STEPS for p in resumed_model.parameters())

    train(model, reference, STEPS)
    train(resumed_model, resumed, STEPS)
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


def test_torchao_4bit_checkpoint_converts_to_our_4bit():
    """A torchao AdamW4bit checkpoint loaded into lowbit_optim.AdamW4bit (its own "4bit" recipe) is
    requantized from torchao's values; into fp32 state it is those values. Resumed from it, the 4bit
    run stays about as near the fp32 one (exact values) as torchao's continued run does (observed:
    14% and 12% of the distance the first layer travels; 0.8% and 0.4% for the second)."""
    model, reference, _ = torchao_run("AdamW4bit")
    expected = moments(reference, model)
    runs = {"4bit": lowbit_optim.AdamW4bit, "fp32": functools.partial(lowbit_optim.AdamW, state_format="fp32")}
    for name, optimizer_class in runs.items():
        runs[name] = resumed_model = copy.deepcopy(model)
        resumed = optimizer_class(resumed_model.parameters(), lr=LR)
        # a checkpoint of its own: the optimizer takes over plain states (as torch.optim does), not copies
        resumed.load_state_dict(save_and_load(reference.state_dict()))
        for key, state in moments(resumed, resumed_model).items():
            if name == "fp32" or not isinstance(state, OptimState):
                assert type(state) is torch.Tensor and torch.equal(state, dense(expected[key])), key
            else:
                assert type(state).name == "4bit", key
                assert_same_bits(state, get_format("4bit").from_float(dense(expected[key]), state.signed), key)
        train(resumed_model, resumed, STEPS)

    start = copy.deepcopy(model)
    train(model, reference, STEPS)
    for params in zip(runs["4bit"].parameters(), runs["fp32"].parameters(), model.parameters(), start.parameters()):
        ours, exact, theirs, p0 = (p.detach() for p in params)
        assert bool(ours.isfinite().all())
        travelled = float((theirs - p0).norm())
        assert float((ours - exact).norm()) <= 0.2 * travelled
        assert float((theirs - exact).norm()) <= 0.2 * travelled


def test_foreign_code_table_is_decoded_with_it():
    """A torchao state whose code table is not ours (say, a later torchao's) is not misread: its
    values, decoded with its own table, are requantized."""
    model, _, checkpoint = torchao_run("AdamW8bit")
    state = checkpoint["state"][0]["exp_avg"]
    state.qmap = state.qmap * 0.5  # what these codes mean now: half the values
    values = state.dequantize()  # torchao's decoding
    resumed = lowbit_optim.AdamW8bit(model.parameters(), lr=LR)
    resumed.load_state_dict(checkpoint)
    assert_same_bits(resumed.state[model[0].weight]["exp_avg"], get_format("8bit").from_float(values), "exp_avg")


@pytest.mark.parametrize(
    "corrupt, message",
    [
        pytest.param(lambda s: setattr(s, "scale", s.scale[:-1]), "do not cover 6144 elements in whole blocks", id="scale-count"),
        pytest.param(lambda s: setattr(s, "scale", s.scale.double()), "not a 1-D float32 tensor", id="scale-dtype"),
        pytest.param(lambda s: setattr(s, "codes", s.codes.float()), "not uint8", id="codes-dtype"),
        pytest.param(lambda s: setattr(s, "qmap", s.qmap[:16]), "not 256 float32 values", id="code-table"),
        # read into our state over the same codes and scales, then checked as ours
        pytest.param(lambda s: setattr(s, "scale", -s.scale), "its scale holds a negative value", id="negative-scale"),
        pytest.param(lambda s: setattr(s, "scale", torch.stack([s.scale, s.scale], -1).select(-1, 0)), "scale must be a 1-D contiguous", id="scale-strided"),
        # a table not ours: decoded with it, where a negative scale flipped its blocks' signs silently
        pytest.param(lambda s: (setattr(s, "scale", -s.scale), setattr(s, "qmap", s.qmap * (1 + 2**-20))), "its scale holds a negative value", id="negative-scale-foreign-table"),
        pytest.param(lambda s: s.qmap.__setitem__(3, float("nan")), "has a code table with a non-finite value", id="code-table-nan"),
        # what the reads take for plain tensors (a file may hold anything): named, not an AttributeError or torch's
        pytest.param(lambda s: delattr(s, "qmap"), "is corrupt: its qmap is missing", id="code-table-missing"),
        pytest.param(lambda s: setattr(s, "scale", s.scale.to_sparse()), "is corrupt: its scale is a torch.sparse_coo tensor, not a dense one", id="scale-sparse"),
        pytest.param(lambda s: setattr(s, "codes", s.codes.to("meta")), "is corrupt: its codes is on the meta device", id="codes-meta"),
        pytest.param(lambda s: setattr(s, "signed", "yes"), "is corrupt: its signed is 'yes', not True or False", id="signed-not-bool"),
    ],
)
def test_invalid_torchao_state_is_refused(corrupt, message):
    """What a checkpoint file holds is checked before it is read: a clear error, not a misread state."""
    model, _, checkpoint = torchao_run("AdamW8bit")
    corrupt(checkpoint["state"][0]["exp_avg"])
    with pytest.raises(ValueError, match=message):
        lowbit_optim.AdamW8bit(model.parameters(), lr=LR).load_state_dict(checkpoint)


def test_torchao_states_swapped_are_refused():
    """exp_avg and exp_avg_sq swapped: torchao's states record their signedness, which used to be
    kept, so the momentum loaded nonnegative and half the second moment clamped to 0, silently.
    Refused as the same swap in our own checkpoint is."""
    model, _, checkpoint = torchao_run("AdamW8bit")
    state = checkpoint["state"][0]
    state["exp_avg"], state["exp_avg_sq"] = state["exp_avg_sq"], state["exp_avg"]
    with pytest.raises(ValueError, match=r"'exp_avg' of parameter 0 .* is corrupt: an unsigned \(nonnegative\) state, where it holds a signed one"):
        lowbit_optim.AdamW8bit(model.parameters(), lr=LR).load_state_dict(checkpoint)


@pytest.mark.parametrize("into", ["fp8", "fp32", "bf16", "8bit"])
def test_a_torchao_second_moment_that_decodes_negative_is_refused(into):
    """A torchao fp8 second moment with negative codes (torchao's fp8 keeps the sign bit) loaded as a
    plain fp32 or bf16 state (NaN at the next step) or was clamped to 0 into 8bit, silently; refused
    into any format, as its nonnegative values load."""
    from torchao.optim.subclass_fp8 import OptimStateFp8 as TorchaoFp8

    for sign in (1.0, -1.0):
        model = make_mlp(8, bias=False)
        opt = lowbit_optim.AdamW(model.parameters(), lr=LR, state_format=into, min_quantize_numel=0, compile=False)
        train(model, opt, 1)
        state_dict = opt.state_dict()
        weight = state_dict["state"][0]["exp_avg_sq"]
        torchao_state = TorchaoFp8.zeros(weight.shape, block_size=256)
        torchao_state.copy_(torch.rand(weight.shape, generator=torch.Generator().manual_seed(0)) * sign)
        state_dict["state"][0]["exp_avg_sq"] = torchao_state
        if sign > 0:
            opt.load_state_dict(save_and_load(state_dict))
        else:
            with pytest.raises(ValueError, match=r"'exp_avg_sq' of parameter 0 .* is corrupt: a negative value .* in its values, where it holds a nonnegative state"):
                opt.load_state_dict(save_and_load(state_dict))
