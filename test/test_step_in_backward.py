"""``step_in_backward=True``: each parameter is stepped inside backward as soon as its gradient is
accumulated, and the gradient is freed.

The promise tested here: without clipping, the parameters and states after N steps are bit-identical
to the same optimizer stepping after backward, for every registered optimizer (kernel and compiled
paths), bf16 weights in every ``param_update`` mode, gradient accumulation, LR schedulers, bf16
autocast, param groups, checkpoints and copies; and what cannot combine is a clear error. FSDP2 is in
test_fsdp.py (its 2-rank job).
"""

import contextlib
import copy
import functools
import gc
import io
import pickle
import warnings

import pytest
import torch
from optimizer_info import OPTIMIZERS
from test_optim import assert_same_bits, regression_data
from torch import nn
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import lowbit_optim

FORMATS = ["fp32", "8bit", "4bit"]
SGD_INFO = next(o for o in OPTIMIZERS if o.name == "SGD")
STEPS = 3


def _pair(opt_info, fmt: str, dtype=torch.float32, **kwargs):
    """Two identical models, one with an optimizer stepping after backward, one stepping in it."""
    models = [opt_info.mlp(dtype=dtype) for _ in range(2)]
    spec = opt_info.spec(next(f for f in _format_infos() if f.name == fmt))
    options = dict(state_format=spec, min_quantize_numel=0, **kwargs)
    return models, [opt_info.make(models[0].parameters(), **options), opt_info.make(models[1].parameters(), step_in_backward=True, **options)]


def _format_infos():
    from conftest import FORMATS as ALL

    return ALL


def _loss(model, step: int):
    x, y = regression_data(model[-1].out_features, next(model.parameters()).dtype)
    return (model(x * (1 + 0.1 * step)) - y).float().square().mean()


def _train_both(models, opts, steps: int = STEPS, micro_batches: int = 1, schedulers=()):
    after, inside = models
    for step in range(steps):
        for micro in range(micro_batches):
            _loss(after, step * micro_batches + micro).backward()
        opts[0].step()
        opts[0].zero_grad()
        for micro in range(micro_batches):
            if micro < micro_batches - 1:
                with opts[1].accumulating():
                    _loss(inside, step * micro_batches + micro).backward()
                assert all(p.grad is not None for p in inside.parameters())  # kept for the next micro-batch
            else:
                _loss(inside, step * micro_batches + micro).backward()
        assert all(p.grad is None for p in inside.parameters()), "step_in_backward must free each gradient"
        opts[1].step()
        opts[1].zero_grad()
        for scheduler in schedulers:
            scheduler.step()


def _assert_same(models, opts):
    for p, q in zip(*(m.parameters() for m in models)):
        assert_same_bits(p, q, tuple(p.shape))
        assert opts[0].state[p].keys() == opts[1].state[q].keys()
        for name, value in opts[0].state[p].items():
            assert_same_bits(value, opts[1].state[q][name], (tuple(p.shape), name))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("opt_info", OPTIMIZERS, ids=str)
def test_equals_stepping_after_backward(opt_info, fmt):
    models, opts = _pair(opt_info, fmt)
    _train_both(models, opts)
    _assert_same(models, opts)


@pytest.mark.parametrize("param_update", ["nearest", "kahan", "int8-correction"])
def test_bf16_weights_in_every_param_update_mode(param_update):
    models, opts = _pair(OPTIMIZERS[0], "8bit", dtype=torch.bfloat16, param_update=param_update)
    _train_both(models, opts)
    _assert_same(models, opts)


def test_bf16_stochastic_rounding_draws_in_another_order():
    """param_update="stochastic" draws its random numbers from torch's generator as parameters are
    stepped: in backward that is last layer first, so the bits differ from stepping after backward,
    not the distribution. With SGD (no sign-like amplification of small differences, as in Adam's first
    steps) the two runs stay within one bf16 ulp per step of each other (the ulp of the tensor's
    largest value: rounding is what differs)."""
    torch.manual_seed(0)
    models, opts = _pair(SGD_INFO, "8bit", dtype=torch.bfloat16, param_update="stochastic")
    _train_both(models, opts)
    after, inside = ([p.detach().float() for p in m.parameters()] for m in models)
    for q, r in zip(after, inside):
        ulp = lowbit_optim.precision.bf16_ulp(torch.maximum(q.abs().max(), r.abs().max()))
        assert (q - r).abs().max() <= STEPS * ulp
    assert not all(torch.equal(q, r) for q, r in zip(after, inside))


@pytest.mark.parametrize("opt_info", [OPTIMIZERS[0], SGD_INFO], ids=str)
def test_gradient_accumulation_steps_at_the_last_micro_batch(opt_info):
    models, opts = _pair(opt_info, "8bit")
    _train_both(models, opts, micro_batches=3)
    _assert_same(models, opts)


def test_lr_scheduler_follows_without_warnings():
    models, opts = _pair(OPTIMIZERS[0], "8bit")
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (1 + step)) for opt in opts]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        _train_both(models, opts, steps=4, schedulers=schedulers)
    assert opts[1].param_groups[0]["lr"] == opts[0].param_groups[0]["lr"] < OPTIMIZERS[0].lr
    _assert_same(models, opts)


def test_bf16_autocast():
    models, opts = _pair(OPTIMIZERS[0], "4bit")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _train_both(models, opts)
    _assert_same(models, opts)


def test_param_groups_by_module():
    models = [OPTIMIZERS[0].mlp() for _ in range(2)]
    opts = [
        lowbit_optim.AdamW(lowbit_optim.param_groups_by_module(m, {"0": {"state_format": "8bit"}}, min_quantize_numel=0), lr=1e-2, step_in_backward=sib)
        for m, sib in zip(models, (False, True))
    ]
    assert len(opts[1].param_groups) == 2  # the second layer (fp32, the default), the first (8bit)
    opts[1].param_groups[1]["lr"] = opts[0].param_groups[1]["lr"] = 3e-3  # a group's own lr is read at each step
    _train_both(models, opts)
    _assert_same(models, opts)


def test_checkpoint_resumes_exactly():
    opt_info = OPTIMIZERS[0]
    models, opts = _pair(opt_info, "4bit")
    _train_both(models, opts, steps=2)
    resumed_model = copy.deepcopy(models[1])
    resumed = opt_info.make(resumed_model.parameters(), state_format="4bit", min_quantize_numel=0, step_in_backward=True)
    resumed.load_state_dict(opts[1].state_dict())
    _train_both([models[0], resumed_model], [opts[0], resumed], steps=2)
    _assert_same([models[0], resumed_model], [opts[0], resumed])


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copied_model_and_optimizer_step_in_backward(how):
    """A copy of a model with its optimizer (one memo: the copy steps the copied parameters) steps
    in the copy's backward; the original's hooks keep stepping the original only."""
    models, opts = _pair(OPTIMIZERS[0], "8bit")
    _train_both(models, opts, steps=1)
    pair = {"model": models[1], "opt": opts[1]}
    copied = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    before = [p.detach().clone() for p in models[1].parameters()]
    _train_both([models[0], copied["model"]], [opts[0], copied["opt"]], steps=2)
    _assert_same([models[0], copied["model"]], [opts[0], copied["opt"]])
    for p, b in zip(models[1].parameters(), before):
        assert_same_bits(p, b, tuple(p.shape))  # the original was not stepped by the copy's backward


def test_step_takes_gradients_the_backward_left():
    """Gradients set by hand (not accumulated by backward) are stepped by step(), as without
    step_in_backward."""
    models, opts = _pair(OPTIMIZERS[0], "8bit")
    for model, opt in zip(models, opts):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        assert all(p.grad is not None for p in model.parameters())
        opt.zero_grad()
    _assert_same(models, opts)


def test_muon_with_adamw():
    models = [OPTIMIZERS[0].mlp() for _ in range(2)]
    opts = [lowbit_optim.MuonWithAdamW(m, state_format="8bit", min_quantize_numel=0, step_in_backward=sib) for m, sib in zip(models, (False, True))]
    _train_both(models, opts)
    for p, q in zip(*(m.parameters() for m in models)):
        assert_same_bits(p, q, tuple(p.shape))


def _clipped_pair(max_grad_norm: float):
    """SGD: its step is linear in the gradient, so the clipping shows in every parameter (Adam's
    would mostly cancel)."""
    models = [SGD_INFO.mlp() for _ in range(2)]
    options = dict(state_format="8bit", min_quantize_numel=0)
    return models, [SGD_INFO.make(models[0].parameters(), **options), SGD_INFO.make(models[1].parameters(), step_in_backward=True, max_grad_norm=max_grad_norm, **options)]


def _train_clipped(models, opts, max_grad_norm: float, steps: range) -> list:
    """The reference (stepping after backward) clips as max_grad_norm promises: each gradient, in the
    order backward produces them (recorded by a hook that runs after the optimizer's), gets
    clip_grad_norm_'s coefficient for the larger of the previous step's global norm and the norm of
    the gradients so far, itself included."""
    order = []
    for p in models[1].parameters():
        p.register_post_accumulate_grad_hook(order.append)
    pairs = dict(zip(models[1].parameters(), models[0].parameters()))
    norms, previous = [], torch.zeros(())
    for step in steps:
        order.clear()
        _loss(models[1], step).backward()
        _loss(models[0], step).backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in models[0].parameters()]))
        square_sum = torch.zeros(())
        for p in [pairs[q] for q in order]:
            square_sum += torch.linalg.vector_norm(p.grad, 2, dtype=torch.float32).square()
            p.grad.mul_(torch.clamp(max_grad_norm / (torch.maximum(square_sum.sqrt(), previous) + 1e-6), max=1.0))
        previous = norms[-1]
        opts[0].step()
        opts[0].zero_grad()
        torch.testing.assert_close(opts[1].last_grad_norm, norms[-1])
    return norms


def test_max_grad_norm_clips_with_an_estimate_of_the_steps_norm():
    models, opts = _clipped_pair(0.05)
    norms = _train_clipped(models, opts, 0.05, range(4))
    assert all(n > 0.05 for n in norms), "test setup: the clipping should bite"
    for p, q in zip(*(m.parameters() for m in models)):
        assert_same_bits(p, q, tuple(p.shape))


@pytest.mark.parametrize("how", ["state_dict", "get_state_dict", "wrapped by hooks"])
def test_max_grad_norm_resumes_exactly(how):
    """The last norm travels in the state dict, also through torch.distributed.checkpoint's
    get_optimizer_state_dict (which keeps only states and groups), and through a state_dict
    post-hook that wraps the dict and a load pre-hook that unwraps it, as torch.optim allows (the
    norm was added after the user's post-hooks: a KeyError; the load checked the dict before the
    user's pre-hooks: refused): a resumed run clips its next step as the original."""
    models, opts = _clipped_pair(0.05)
    _train_clipped(models, opts, 0.05, range(2))
    resumed_model = copy.deepcopy(models[1])
    resumed = SGD_INFO.make(resumed_model.parameters(), state_format="8bit", min_quantize_numel=0, step_in_backward=True, max_grad_norm=0.05)
    if how == "state_dict":
        resumed.load_state_dict(torch.load(_saved(opts[1].state_dict()), weights_only=True))
    elif how == "wrapped by hooks":
        opts[1].register_state_dict_post_hook(lambda optimizer, state_dict: {"version": 2, "optimizer": state_dict})
        resumed.register_load_state_dict_pre_hook(lambda optimizer, wrapped: wrapped["optimizer"])
        resumed.load_state_dict(torch.load(_saved(opts[1].state_dict()), weights_only=True))
    else:
        saved = torch.load(_saved(get_optimizer_state_dict(models[1], opts[1])), weights_only=True)
        set_optimizer_state_dict(resumed_model, resumed, saved)
    assert resumed.last_grad_norm is not None and "last_grad_norm" not in resumed.param_groups[0]  # not a group option
    for step in range(2, 4):
        for model in (models[1], resumed_model):
            _loss(model, step).backward()
    for p, q in zip(models[1].parameters(), resumed_model.parameters()):
        assert_same_bits(p, q, tuple(p.shape))


def _saved(state_dict) -> io.BytesIO:
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return buffer


def test_what_cannot_combine_is_an_error():
    params = OPTIMIZERS[0].mlp().parameters()
    with pytest.raises(ValueError, match="foreach=True .* step_in_backward=True .* pass one of them"):
        lowbit_optim.AdamW(params, foreach=True, step_in_backward=True)
    with pytest.raises(ValueError, match="step_in_backward must be True or False"):
        lowbit_optim.AdamW(params, step_in_backward="yes")
    with pytest.raises(ValueError, match="max_grad_norm .* needs step_in_backward=True; .*clip_grad_norm_ before step"):
        lowbit_optim.AdamW(params, max_grad_norm=1.0)
    for bad in (0.0, -1.0, float("inf"), "1", True):
        with pytest.raises(ValueError, match="invalid max_grad_norm"):
            lowbit_optim.AdamW(params, step_in_backward=True, max_grad_norm=bad)
    opt = lowbit_optim.AdamW(params, step_in_backward=True, max_grad_norm=1.0)
    for bad in (torch.ones(3), torch.tensor(1 + 1j), torch.tensor(1.0, device="meta")):
        with pytest.raises(ValueError, match="checkpoint 'last_grad_norm' is .* a number or a one-element tensor"):
            opt.load_state_dict({**opt.state_dict(), "last_grad_norm": bad})
    with pytest.raises(ValueError, match="checkpoint 'last_grad_norm' is -5.0: a gradient norm is >= 0"):  # no run makes one
        opt.load_state_dict({**opt.state_dict(), "last_grad_norm": torch.tensor(-5.0)})
    opt.load_state_dict({**opt.state_dict(), "last_grad_norm": torch.tensor(float("inf"))})  # saved after an overflow: as it was
    assert opt.last_grad_norm == float("inf")
    saved = opt.state_dict()
    assert saved["param_groups"][0]["last_grad_norm"] == float("inf")  # where get_state_dict keeps it
    with pytest.raises(ValueError, match="checkpoint 'last_grad_norm' is -5.0: a gradient norm is >= 0"):
        opt.load_state_dict({**saved, "param_groups": [{**saved["param_groups"][0], "last_grad_norm": -5.0}]})
    with pytest.raises(ValueError, match=r"'last_grad_norm' has different values \(\[inf, 2.0\]\)"):
        opt.load_state_dict({**saved, "last_grad_norm": 2.0})


@pytest.mark.parametrize("wrapped", [False, True], ids=["AdamW", "MuonWithAdamW"])
def test_zero_grad_keeping_zero_gradients_is_refused(wrapped):
    """zero_grad(set_to_none=False): stepping after backward, a parameter the next backward does not
    reach is stepped with its zero gradient (weight decay, momentum); in backward it never is."""
    model = OPTIMIZERS[0].mlp()
    opt = lowbit_optim.MuonWithAdamW(model, head="2", step_in_backward=True) if wrapped else lowbit_optim.AdamW(model.parameters(), step_in_backward=True)
    with pytest.raises(ValueError, match=r"zero_grad\(set_to_none=False\) .* call zero_grad\(\)"):
        opt.zero_grad(set_to_none=False)
    _loss(model, 0).backward()
    opt.zero_grad()  # the default is fine


def test_the_last_optimizer_built_steps_in_backward():
    """An earlier optimizer's hook would take and free each gradient first, so that a new one never
    stepped: the last one built steps (an earlier one still alive, held here by its scheduler, is
    warned of and does nothing), also when a loop rebinds one name."""
    model = OPTIMIZERS[0].mlp()
    first = lowbit_optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1.0)
    _loss(model, 0).backward()
    with pytest.warns(UserWarning, match=r"now stepped by this AdamW, built later; the earlier one, still alive .* no longer steps them"):
        second = lowbit_optim.AdamW(model.parameters(), lr=0.0, step_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    _loss(model, 1).backward()
    assert all(p.grad is None for p in model.parameters())  # stepped (by the new one, with lr 0) and freed
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(float(second.state[p]["step"]) == 1 and float(scheduler.optimizer.state[p]["step"]) == 1 for p in model.parameters())
    for lr in (1e-2, 1e-3):  # a notebook cell run twice, a sweep over one model
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            opt = lowbit_optim.AdamW(model.parameters(), lr=lr, step_in_backward=True)
        _loss(model, 2).backward()
        assert all(float(opt.state[p]["step"]) == 1 for p in model.parameters())


def _train_step(model, opt, step):
    _loss(model, step).backward()
    opt.step()
    opt.zero_grad()


_compiled_train_step = torch.compile(_train_step, backend="eager")


def test_a_compiled_training_step_steps_in_backward():
    """backward inside a torch.compile'd function calls the hooks from the compiled frame: they step
    eagerly (not traced by dynamo), with the numbers of the same loop uncompiled."""
    models = [OPTIMIZERS[0].mlp() for _ in range(2)]
    opts = [lowbit_optim.AdamW(m.parameters(), lr=1e-2, state_format="8bit", min_quantize_numel=0, step_in_backward=True) for m in models]

    for step in range(2):
        _train_step(models[0], opts[0], step)
        _compiled_train_step(models[1], opts[1], step)
    _assert_same(models, opts)


@pytest.mark.parametrize("how", ["torch.compile'd step", "compiled autograd"])
def test_max_grad_norm_counts_the_norm_of_a_compiled_backward(how):
    """The end-of-backward callback that records the step's norm ran traced inside a compiled
    training step (its write lost) and never under compiled autograd: last_grad_norm stayed None
    and each step clipped with its norm so far only. Both loops now clip as the eager one."""
    from torch._dynamo import compiled_autograd

    models = [SGD_INFO.mlp() for _ in range(2)]
    opts = [SGD_INFO.make(m.parameters(), state_format="fp32", step_in_backward=True, max_grad_norm=0.05) for m in models]

    for step in range(3):
        _train_step(models[0], opts[0], step)
        if how == "compiled autograd":
            with compiled_autograd._enable(functools.partial(torch.compile, backend="eager")):
                _loss(models[1], step).backward()
            opts[1].step()
        else:
            _compiled_train_step(models[1], opts[1], step)
        torch.testing.assert_close(opts[1].last_grad_norm, opts[0].last_grad_norm, rtol=1e-6, atol=0)
    for p, q in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_loading_a_checkpoint_without_a_norm_forgets_the_last_one():
    """A checkpoint saved before any clipped step holds no last_grad_norm: loading it (a roll-back
    past a spike) leaves none, as a fresh optimizer loading it has, not the spike's."""
    model = SGD_INFO.mlp()
    opt = SGD_INFO.make(model.parameters(), state_format="fp32", step_in_backward=True, max_grad_norm=0.05)
    checkpoint = opt.state_dict()
    _loss(model, 0).backward()
    assert opt.last_grad_norm is not None
    opt.load_state_dict(checkpoint)
    assert opt.last_grad_norm is None


def test_an_optimizer_stepping_after_backward_takes_the_parameters_over():
    """An optimizer built later on the parameters of one stepping in backward (still alive: its
    scheduler holds it) would find no gradient, the old one's hooks having stepped and freed them: a
    lowbit_optim one takes the parameters over (warned of), and torch.optim's step() is refused.
    Once the new one is dropped, the old one steps them again."""
    model = OPTIMIZERS[0].mlp()
    first = lowbit_optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    torch.optim.lr_scheduler.LambdaLR(first, lambda step: 1.0)
    with pytest.warns(UserWarning, match=r"now stepped by this SGD, built later"):
        second = lowbit_optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _loss(model, 0).backward()
    assert all(p.grad is not None and not first.state[p] for p in model.parameters())  # left to the new one
    second.step()
    assert all(float(second.state[p]["step"]) == 1 for p in model.parameters())
    theirs = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match=r"this SGD steps a parameter of shape \(\d+, \d+\) that an optimizer built with step_in_backward=True \(AdamW\)"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lowbit_optim.AdamW(model.parameters(), step_in_backward=True)  # dropped at once: the first owns them again
        del second
        gc.collect()
        theirs.step()
    with pytest.raises(RuntimeError, match=r"this SGD steps a parameter .* step_in_backward=True \(AdamW\)"):
        torch.compile(theirs.step, backend="eager")()  # inside torch.compile too (it was traced past)
    model.zero_grad()
    _loss(model, 1).backward()
    assert all(p.grad is None and float(first.state[p]["step"]) == 1 for p in model.parameters())

    class Lookahead(torch.optim.Optimizer):  # a wrapper on the owner's own groups (timm's builds so) steps through it
        def __init__(self, inner):
            super().__init__(inner.param_groups, {})
            self.inner = inner

        def step(self, closure=None):
            return self.inner.step(closure)

    with pytest.warns(UserWarning, match=r"Lookahead steps through AdamW, built with step_in_backward=True, .* the wrapper finds no gradients"):
        wrapper = Lookahead(first)
        wrapper.step()  # (timm's then keeps no slow weights: it skips a parameter without a gradient)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wrapper.step()  # once per wrapper


def test_a_constructor_that_fails_leaves_the_parameters_to_their_optimizer():
    """A constructor refusing a later param group had taken the earlier groups' parameters from the
    optimizer stepping them in backward (and warned that it stepped them): they are left to it."""
    model = OPTIMIZERS[0].mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    first, *rest = model.parameters()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning of a take-over that did not happen
        with pytest.raises(ValueError, match="invalid learning rate"):
            lowbit_optim.AdamW([{"params": [first]}, {"params": rest, "lr": -1.0}], step_in_backward=True)
        with pytest.raises(ValueError, match="invalid learning rate"):  # its Muon part built, its AdamW part refused
            lowbit_optim.MuonWithAdamW(model, head="2", step_in_backward=True, adamw=dict(lr=-1.0))
    _loss(model, 0).backward()
    assert all(p.grad is None and float(opt.state[p]["step"]) == 1 for p in model.parameters())


def test_hooks_follow_the_param_groups_as_edited():
    """torch.optim reads param_groups at each step: a parameter taken out of its group is no longer
    stepped, and one whose group moved is stepped with its group's options (a hook once held a
    group's index: the removed one trained on, another group's lr applied, or an IndexError)."""
    model = OPTIMIZERS[0].mlp()
    params = list(model.parameters())
    opt = lowbit_optim.SGD([{"params": params[:2], "lr": 0.1}, {"params": params[2:], "lr": 0.0}], step_in_backward=True)
    removed = params[0]
    opt.param_groups[0]["params"].remove(removed)
    opt.param_groups.reverse()
    before = [p.detach().clone() for p in params]
    _loss(model, 0).backward()
    assert removed.grad is not None and torch.equal(removed, before[0])  # not stepped, its gradient kept
    assert not torch.equal(params[1], before[1]) and all(torch.equal(p, b) for p, b in zip(params[2:], before[2:]))
    del opt.param_groups[0]
    model.zero_grad()
    _loss(model, 1).backward()  # the lr-0 group's parameters are in no group now: not stepped
    assert all(p.grad is not None for p in params[2:])
    group = opt.param_groups[0]
    assert group["params"][0] is params[1]
    group["params"][0] = params[2]  # an edit that keeps the list and its length
    model.zero_grad()
    before = [p.detach().clone() for p in params]
    _loss(model, 2).backward()
    assert params[1].grad is not None and torch.equal(params[1], before[1]) and not torch.equal(params[2], before[2])


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "inside torch.compile"])
def test_left_over_gradients_are_clipped_with_the_steps_norm(compiled):
    """A layer that only an accumulated micro-batch reached keeps its gradient after the last
    backward (its hook did not fire): step() steps it clipped by the step's global norm, which now
    counts it, as clip_grad_norm_ after backward would (that layer: the same parameters); also where
    step() is called in a torch.compile'd function (the step op)."""
    def make():
        torch.manual_seed(0)
        return nn.Linear(64, 64), nn.Linear(64, 64)

    batches = [torch.randn(16, 64, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    runs = []
    for in_backward in (False, True):
        a, b = make()
        params = [*a.parameters(), *b.parameters()]
        kwargs = dict(step_in_backward=True, max_grad_norm=0.01) if in_backward else {}
        opt = lowbit_optim.AdamW(params, lr=1e-2, state_format="fp32", **kwargs)
        with opt.accumulating() if in_backward else contextlib.nullcontext():
            (a(batches[0]).square().mean() + b(batches[0]).square().mean()).backward()  # b in this micro-batch only
        a(batches[1]).square().mean().backward()
        norm = opt.last_grad_norm if in_backward else torch.nn.utils.clip_grad_norm_(params, 0.01)
        assert (b.weight.grad is not None) and (a.weight.grad is None) == in_backward
        (torch.compile(opt.step) if compiled and in_backward else opt.step)()
        runs.append((b, norm if not in_backward else opt.last_grad_norm))
    (exact, exact_norm), (ours, total) = runs
    torch.testing.assert_close(total, exact_norm, rtol=1e-6, atol=0)
    for p, q in zip(ours.parameters(), exact.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)


@pytest.mark.parametrize("skip_step", [False, True], ids=["with step()", "without step()"])
def test_left_over_clipping_counts_this_steps_gradients_only(skip_step):
    """The norm step() adds left-over gradients to is the last backward's only where that backward
    belongs to this step: skipping the no-op step() after a stepping backward changes nothing."""
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, state_format="fp32", step_in_backward=True, max_grad_norm=0.01, compile=False)
    model(torch.randn(4, 16)).square().mean().backward()  # stepped in backward
    if not skip_step:
        opt.step()
    with opt.accumulating():  # every micro-batch of the next step accumulated: step() steps them
        model(torch.randn(4, 16)).square().mean().backward()
    exact = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    opt.step()
    torch.testing.assert_close(opt.last_grad_norm, exact, rtol=1e-6, atol=0)


def test_ddp_replicas_are_warned_of(monkeypatch):
    """Under DDP the hooks would step with each rank's gradient before its all-reduce: a process
    group of several ranks and parameters that are not FSDP2 shards warn, at construction."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    with pytest.warns(UserWarning, match="DistributedDataParallel .* replicas part"):
        lowbit_optim.AdamW(nn.Linear(4, 4).parameters(), step_in_backward=True)


@pytest.mark.parametrize("wrapped", [False, True], ids=["AdamW", "MuonWithAdamW"])
def test_grad_scaler_is_refused(wrapped):
    """GradScaler unscales gradients after backward, but the step in backward has used them: the
    scaler's step() refuses clearly instead of an assertion about inf checks (MuonWithAdamW's too,
    whose parts are the ones stepping in backward)."""
    model = OPTIMIZERS[0].mlp()
    if wrapped:
        opt = lowbit_optim.MuonWithAdamW(model, head="2", step_in_backward=True, compile=False)
    else:
        opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True, compile=False)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model, 0)).backward()
    with pytest.raises(RuntimeError, match="GradScaler .* step_in_backward=True"):
        scaler.step(opt)
    # the scale it handed the optimizer is taken off again: a step without the scaler works
    assert "grad_scale" not in opt.__dict__ and "found_inf" not in opt.__dict__
    _loss(model, 1).backward()
    opt.step()


def test_freed_optimizer_leaves_inert_hooks():
    model = OPTIMIZERS[0].mlp()
    opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    del opt
    _loss(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters())  # nothing stepped, nothing freed


class _FailsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("boom")


@pytest.mark.parametrize("failed", ["counting the next one's first parameter", "counting a branch the next one skips"])
def test_a_backward_that_raises_leaves_no_stale_clipping(failed):
    """A backward that raises midway never ends its norm count; the next backward starts afresh,
    also where the failed one counted only a branch the next one does not take (whose norms were
    added in: the next backward's first parameter was not among them)."""
    models, opts = _clipped_pair(0.05)
    model, opt = models[1], opts[1]
    x, _ = regression_data(model[-1].out_features)
    if failed == "counting the next one's first parameter":  # the last layer steps first
        loss = (model[2](_FailsInBackward.apply(model[1](model[0](x)))) ** 2).mean()
    else:  # the branch's hooks run, then the failure
        branch = nn.Linear(model[-1].out_features, model[-1].out_features)
        opt.add_param_group({"params": list(branch.parameters())})
        loss = branch(_FailsInBackward.apply(model(x))).square().mean()
    with pytest.raises(RuntimeError, match="boom"):
        loss.backward()
    assert opt.last_grad_norm is None
    reference = copy.deepcopy(model)  # hooks are not copied: its backward only computes gradients
    _loss(model, 0).backward()
    _loss(reference, 0).backward()
    torch.testing.assert_close(opt.last_grad_norm, torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()]))


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_copy_holds_parameters_frozen_since_the_constructor(how):
    """A parameter frozen after the constructor hooked it (fine-tuning that freezes a layer) is
    copied with the optimizer: the copy hooks it too, and steps it in backward once it thaws, as the
    original does."""
    models, opts = _pair(OPTIMIZERS[0], "8bit")
    for model in models:
        model[0].requires_grad_(False)
    _train_both(models, opts, steps=1)
    pair = {"model": models[1], "opt": opts[1]}
    copied = copy.deepcopy(pair) if how == "deepcopy" else pickle.loads(pickle.dumps(pair))
    assert not any(p.requires_grad for p in copied["model"][0].parameters())
    for model in (models[0], copied["model"]):
        model[0].requires_grad_(True)
    _train_both([models[0], copied["model"]], [opts[0], copied["opt"]], steps=2)
    _assert_same([models[0], copied["model"]], [opts[0], copied["opt"]])


def test_a_freed_optimizer_takes_its_hooks_off():
    """Each optimizer built and dropped (a notebook cell run again, a sweep on one model) left a hook
    on every parameter, which every later backward called."""
    model = OPTIMIZERS[0].mlp()
    with pytest.warns(UserWarning, match="built later; the earlier one, still alive"):  # (while the next is built)
        for _ in range(3):
            opt = lowbit_optim.AdamW(model.parameters(), lr=1e-2, step_in_backward=True)
    assert all(len(p._post_accumulate_grad_hooks) == 1 for p in model.parameters())  # the live one's
    del opt
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_muon_with_adamw_accumulates_and_refuses_two_clipping_norms():
    models = [OPTIMIZERS[0].mlp() for _ in range(2)]
    opts = [lowbit_optim.MuonWithAdamW(m, state_format="8bit", min_quantize_numel=0, step_in_backward=sib) for m, sib in zip(models, (False, True))]
    _train_both(models, opts, micro_batches=2)
    for p, q in zip(*(m.parameters() for m in models)):
        assert_same_bits(p, q, tuple(p.shape))
    with pytest.raises(ValueError, match="two separate norms"):
        lowbit_optim.MuonWithAdamW(models[0], step_in_backward=True, max_grad_norm=1.0)


def test_a_correction_of_another_dtype_is_refused_at_load():
    model = OPTIMIZERS[0].mlp(dtype=torch.bfloat16)
    opt = lowbit_optim.AdamW(model.parameters(), param_update="int8-correction")
    _loss(model, 0).backward()
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["param_correction"] = saved["state"][0]["param_correction"].to(torch.int16)
    with pytest.raises(ValueError, match="param_correction.* has dtype torch.int16: int8-correction keeps int8"):
        opt.load_state_dict(saved)


def test_frozen_parameters_are_refused_before_any_hook():
    """A parameter that does not require grad cannot be hooked: the error says which to pass (the
    trainable ones) instead of torch's, and a group refused for it leaves no group and no hook."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"a parameter of shape \(8,\) does not require grad: .*\[p for p in model.parameters\(\) if p.requires_grad\]"):
        lowbit_optim.AdamW(model.parameters(), step_in_backward=True)
    opt = lowbit_optim.AdamW(model[0].parameters(), lr=0.1, step_in_backward=True, compile=False)
    with pytest.raises(ValueError, match="does not require grad"):
        opt.add_param_group({"params": list(model[1].parameters())})
    assert len(opt.param_groups) == 1
    before = model[1].weight.detach().clone()
    model(torch.randn(4, 8)).square().sum().backward()
    assert torch.equal(model[1].weight, before) and model[1].weight.grad is not None  # not hooked: not stepped, not freed
