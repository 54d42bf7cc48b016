"""Muon: what the shared optimizer suite (test_optimizers.py, where Muon is one registry entry) does not
cover. The eager step against torch.optim.Muon at fp32 round-off, the errors for what Muon cannot step,
and ``muon_split``, the usual recipe's split of a model between Muon and AdamW."""

import copy
import pickle
import re
import warnings

import pytest
import torch
from optimizer_info import OPTIMIZERS
from test_optimizers import gradients, run
from torch import nn

import lowbit_optim

MUON = next(o for o in OPTIMIZERS if o.cls is lowbit_optim.Muon)


@pytest.mark.parametrize("option", list(MUON.options))
def test_eager_step_is_torch_muon(option):
    """compile=False runs torch.optim.Muon's operations in its order: parameters and momentum within
    fp32 round-off after 10 steps (observed <= 1.2e-7: torch adds the update with one FMA, we round
    the product first). The compiled step is held to MUON_PARAM_TOL in test_optimizers.py."""
    kwargs = dict(lr=MUON.lr, **MUON.options[option])
    grads = gradients(MUON)
    ours, opt = run(lambda ps: lowbit_optim.Muon(ps, compile=False, **kwargs), grads, MUON)
    theirs, reference = run(lambda ps: torch.optim.Muon(ps, **kwargs), grads, MUON)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"], rtol=0, atol=1e-7)


def test_a_torch_muon_checkpoint_resumes():
    """torch.optim.Muon keeps only momentum buffers (no step counter): they load, and the steps go
    on as torch's."""
    kwargs = dict(lr=MUON.lr)
    grads = gradients(MUON)
    theirs, reference = run(lambda ps: torch.optim.Muon(ps, **kwargs), grads[:2], MUON)
    ours = [nn.Parameter(p.detach().clone()) for p in theirs]
    opt = lowbit_optim.Muon(ours, compile=False, **kwargs)
    opt.load_state_dict(copy.deepcopy(reference.state_dict()))  # its own buffers, as from a file
    for step_grads in grads[2:4]:
        for p, q, g in zip(ours, theirs, step_grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p, q, rtol=0, atol=5e-7)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: lowbit_optim.Muon([nn.Parameter(torch.zeros(10))]), r"2-D matrices only .* shape \(10,\): give embeddings"),
        (lambda: lowbit_optim.Muon([nn.Parameter(torch.zeros(2, 3, 4))]), r"shape \(2, 3, 4\)"),
        (lambda: lowbit_optim.Muon([nn.Parameter(torch.zeros(4, 4))], adjust_lr_fn="spectral"), "invalid adjust_lr_fn 'spectral'"),
        (lambda: lowbit_optim.Muon([nn.Parameter(torch.zeros(4, 4))], ns_steps=100), r"invalid ns_steps 100: an int in \[0, 100\)"),
        (lambda: lowbit_optim.Muon([nn.Parameter(torch.zeros(4, 4))], ns_coefficients=(1.0, 2.0)), "three numbers"),
        (lambda: lowbit_optim.Muon([nn.Parameter(torch.zeros(4, 4))], momentum=-0.1), "momentum must be >= 0"),
    ],
    ids=["vector", "3-D", "adjust_lr_fn", "ns_steps", "ns_coefficients", "momentum"],
)
def test_bad_input(make, match):
    with pytest.raises(ValueError, match=match):
        make()


class TinyLM(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16), nn.LayerNorm(16))
        self.lm_head = nn.Linear(16, 50, bias=False)
        if tied:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens):
        return self.lm_head(self.blocks(self.embed(tokens)))


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_muon_split(tied):
    """Hidden Linear weights go to Muon; the embedding, the head (tied or not), biases and norms to
    AdamW; frozen parameters too, by the same rule (as model.parameters() holds them: unfrozen
    later, they train); each parameter once."""
    model = TinyLM(tied)
    model.blocks[3].bias.requires_grad_(False)
    model.blocks[2].weight.requires_grad_(False)
    matrices, rest = lowbit_optim.muon_split(model)
    assert [id(p) for p in matrices] == [id(model.blocks[0].weight), id(model.blocks[2].weight)]
    expected = {id(p) for p in model.parameters()} - {id(p) for p in matrices}
    assert [id(p) for p in rest] == [id(p) for p in model.parameters() if id(p) in expected]
    assert id(model.lm_head.weight) in expected and id(model.embed.weight) in expected


def test_muon_split_of_a_model_whose_output_uses_its_embedding():
    """A model computing its logits with F.linear(h, embed.weight) has no nn.Linear head: the default
    takes its last hidden layer for one (silently, to AdamW), so that is warned of; head=False gives
    every nn.Linear to Muon."""

    class FunctionalHead(TinyLM):
        def __init__(self):
            super().__init__()
            del self.lm_head

        def forward(self, tokens):
            return nn.functional.linear(self.blocks(self.embed(tokens)), self.embed.weight)

    model = FunctionalHead()
    with pytest.warns(UserWarning, match=r"the last nn.Linear, 'blocks.2', taken as the output head .* pass head=False"):
        matrices, _ = lowbit_optim.muon_split(model)
    assert [id(p) for p in matrices] == [id(model.blocks[0].weight)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matrices, _ = lowbit_optim.muon_split(model, head=False)
        lowbit_optim.muon_split(TinyLM())  # a head to the vocabulary: no warning
    assert [id(p) for p in matrices] == [id(model.blocks[0].weight), id(model.blocks[2].weight)]


def test_muon_split_of_a_model_that_registers_its_head_first():
    """The default head is the last nn.Linear: a model that registers lm_head before its blocks
    would give its last hidden layer (mapping to the embedding's width) to AdamW and the head to
    Muon, so that is warned of, naming the layer that maps to the vocabulary (it went silently
    where such a layer existed); head= names it."""

    class HeadFirst(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm_head = nn.Linear(16, 50, bias=False)
            self.embed = nn.Embedding(50, 16)
            self.blocks = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))

    model = HeadFirst()
    with pytest.warns(UserWarning, match=r"the last nn.Linear, 'blocks.2', .* as a hidden layer does: while 'lm_head' maps to its entries, as a head does: if that is the head, pass head='lm_head'"):
        lowbit_optim.muon_split(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        matrices, _ = lowbit_optim.muon_split(model, head="lm_head")
    assert [id(p) for p in matrices] == [id(model.blocks[0].weight), id(model.blocks[2].weight)]


def test_muon_split_warns_of_parametrized_weights():
    """A parametrized weight (spectral_norm here) is made at each access, never a parameter of the
    model: its parameters go to AdamW, warned of (they went silently)."""
    model = TinyLM()
    torch.nn.utils.parametrizations.spectral_norm(model.blocks[2])
    with pytest.warns(UserWarning, match=r"the weights of \['blocks.2'\] are parametrized .* pass them to Muon yourself") as warned:
        matrices, rest = lowbit_optim.muon_split(model)
    assert warned[0].filename == __file__  # the line that called muon_split
    assert [id(p) for p in matrices] == [id(model.blocks[0].weight)]
    assert any(p is model.blocks[2].parametrizations.weight.original for p in rest)


def test_mistakes_are_named():
    """Plausible mistakes give errors that name the fix (they were AttributeErrors, or TypeErrors
    naming LowBitOptimizer.__init__)."""
    model = TinyLM()
    cases = [
        (lambda: lowbit_optim.MuonWithAdamW(model.parameters()), TypeError, "take the model \\(an nn.Module.* got generator"),
        (lambda: lowbit_optim.MuonWithAdamW(model, muon=0.02), TypeError, "muon must be a dict of its optimizer's keywords"),
        (lambda: lowbit_optim.MuonWithAdamW(model, head=model.lm_head), TypeError, "head must be a name glob"),
        (lambda: lowbit_optim.Muon([model.blocks[0].weight], betas=(0.9, 0.95)), TypeError, "Muon got an unexpected keyword argument 'betas'; it takes lr, weight_decay, momentum"),
    ]
    for make, error, match in cases:
        with pytest.raises(error, match=match):
            make()


def test_a_parameter_in_both_parts_is_refused():
    """opt.muon.add_param_group of a parameter opt.adamw holds: each part would step it (one
    torch.optim optimizer refuses a parameter in two groups)."""
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, compile=False)
    opt.muon.add_param_group({"params": [model.lm_head.weight]})
    model(torch.randint(0, 50, (2, 5))).square().mean().backward()
    with pytest.raises(ValueError, match=r"a parameter of shape \(50, 16\) is in both opt.muon's and opt.adamw's param groups"):
        opt.step()


@pytest.mark.parametrize("path", ["step", "deepcopy", "step_in_backward", "inside torch.compile"])
def test_muon_with_adamw_names_an_edited_group_by_its_index_in_param_groups(path):
    """An edit of AdamW's part refused at the step names the group as opt.param_groups lists it
    (Muon's groups first) and as the part does, on every path that checks it (a copy's first step
    had taken its groups unchecked), before either part steps (compiled, Muon's had stepped)."""
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, compile=False, step_in_backward=path == "step_in_backward")
    if path == "deepcopy":
        model, opt = copy.deepcopy((model, opt))
    index = len(opt.muon.param_groups)
    assert opt.param_groups[index] is opt.adamw.param_groups[0]
    opt.param_groups[index]["lr"] = -1.0
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=rf"param group {index} \(opt.adamw.param_groups\[0\]\), as edited since it was built: invalid learning rate -1.0"):
        model(torch.randint(0, 50, (2, 5))).square().mean().backward()
        if path == "inside torch.compile":
            torch.compile(opt.step, fullgraph=True)()
        else:
            opt.step()
    # refused before either part stepped (compiled, each part is an op: Muon's checks AdamW's first)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(int(state["step"]) == 0 for state in opt.state.values())  # (a check may make states, stepping none)


def test_muon_step_refuses_what_muon_refuses_before_writing():
    """The public muon_step refuses a vector and an unknown adjust_lr_fn as Muon does, before the
    step counter or the momentum is written (a misspelt adjust_lr_fn had stepped at "original")."""
    def call(param, **flags):
        step, buffer = torch.zeros(()), torch.zeros_like(param)
        numbers = [torch.tensor(x) for x in (0.02, 0.998, 0.95, 0.05, 1e-7)]
        flags = dict(nesterov=True, ns_coefficients=(3.4445, -4.775, 2.0315), ns_steps=5, adjust_lr_fn=None, param_update="nearest") | flags
        try:
            lowbit_optim.muon_step(param, torch.ones_like(param), step, buffer, None, *numbers, **flags)
        finally:
            assert float(step) == 0 and not buffer.any()

    with pytest.raises(ValueError, match=r"muon_step steps matrices, got a parameter of shape \(8,\)"):
        call(torch.zeros(8))
    with pytest.raises(ValueError, match="invalid adjust_lr_fn 'match_rms_adamw ': use None, 'original' or 'match_rms_adamw'"):
        call(torch.zeros(8, 4), adjust_lr_fn="match_rms_adamw ")


@pytest.mark.parametrize(
    "refused",
    [
        pytest.param(dict(half_embedding=True, fused=True), id="kernel-refuses-adamws-part"),
        pytest.param(dict(sparse=True), id="sparse-embedding-gradient"),
    ],
)
def test_muon_with_adamw_refuses_before_either_part_steps(refused):
    """What AdamW's part refuses in a step (fused=True where the embedding was made fp16 through
    .data, which the kernel does not take; a sparse embedding gradient) is refused before Muon's part
    steps: a caught error leaves both as they were."""
    options = dict(refused)
    model = TinyLM()
    model.embed.sparse = options.pop("sparse", False)
    half_embedding = options.pop("half_embedding", False)
    model.bfloat16()
    if "fused" not in options:  # (fused=True contradicts the eager step)
        options["compile"] = False
    opt = lowbit_optim.MuonWithAdamW(model, state_format="8bit", min_quantize_numel=0, **options)
    model(torch.randint(0, 50, (2, 5))).float().square().mean().backward()
    if half_embedding:
        weight = model.embed.weight
        weight.data, weight.grad = weight.data.half(), weight.grad.half()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"fused=True, but the fused CPU kernel cannot step a parameter of shape \(50, 16\): parameter dtype torch.float16|sparse gradients"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(int(state["step"]) == 0 for state in opt.state.values())  # (the check may make states, stepping none)


def test_muon_split_head_by_name():
    model = TinyLM()
    matrices, _ = lowbit_optim.muon_split(model, head="blocks.2")
    assert [id(p) for p in matrices] == [id(model.blocks[0].weight), id(model.lm_head.weight)]
    with pytest.raises(ValueError, match=r"head='head' names no nn.Linear .*'lm_head'"):
        lowbit_optim.muon_split(model, head="head")


def test_recipe_trains_with_8bit_states():
    """The recipe of the README: Muon on the hidden matrices with 8bit-lowrank momentum, AdamW on the
    rest with 8bit states."""
    torch.manual_seed(0)
    model = TinyLM()
    tokens = torch.randint(0, 50, (8, 12))
    matrices, rest = lowbit_optim.muon_split(model)
    opts = [lowbit_optim.Muon(matrices, lr=0.02, state_format="8bit-lowrank", min_quantize_numel=0, compile=False),
            lowbit_optim.AdamW(rest, lr=3e-3, state_format="8bit", min_quantize_numel=0, compile=False)]  # fmt: skip
    losses = []
    for _ in range(20):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        losses.append(float(loss))
        loss.backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    assert losses[-1] < 0.7 * losses[0], losses
    assert isinstance(opts[0].state[matrices[0]]["momentum_buffer"], lowbit_optim.OptimState8bitLowRank)
    assert isinstance(opts[1].state[rest[0]]["exp_avg"], lowbit_optim.OptimState8bit)


def _lm_steps(optimizers, model, steps: int, schedulers=()) -> list[float]:
    """``steps`` steps of TinyLM on a fixed batch, stepping each of ``optimizers`` (then schedulers)."""
    tokens = torch.randint(0, 50, (8, 12), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        losses.append(float(loss))
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        for scheduler in schedulers:
            scheduler.step()
    return losses


RECIPE = dict(muon=dict(lr=0.02), adamw=dict(lr=3e-3, state_format="fp32"), state_format="8bit", min_quantize_numel=0, compile=False)


def test_muon_with_adamw_without_gradients_warns_at_the_callers_line():
    """Each part's no-gradient warning names the line that called MuonWithAdamW.step() (it named
    muon.py's call of the part)."""
    opt = lowbit_optim.MuonWithAdamW(TinyLM(), **RECIPE)
    with pytest.warns(UserWarning, match="found no gradient") as warned:
        opt.step()
    assert [w.filename for w in warned] == [__file__, __file__]


def test_muon_with_adamw_is_the_two_optimizers():
    """One object: the same steps as Muon and AdamW built on muon_split's lists, each group with its
    own lr under one scheduler, and its own format."""
    torch.manual_seed(0)
    model, reference_model = TinyLM(), TinyLM()
    reference_model.load_state_dict(model.state_dict())
    opt = lowbit_optim.MuonWithAdamW(model, **RECIPE)
    matrices, rest = lowbit_optim.muon_split(reference_model)
    pair = [lowbit_optim.Muon(matrices, lr=0.02, state_format="8bit", min_quantize_numel=0, compile=False),
            lowbit_optim.AdamW(rest, lr=3e-3, state_format="fp32", min_quantize_numel=0, compile=False)]  # fmt: skip
    assert [id(g) for g in opt.param_groups] == [id(g) for o in opt.optimizers for g in o.param_groups]
    losses = _lm_steps([opt], model, 5, [torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)])
    expected = _lm_steps(pair, reference_model, 5, [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in pair])
    assert losses == expected and losses[-1] < losses[0]
    assert [g["lr"] for g in opt.param_groups] == [0.02 * 0.25, 3e-3 * 0.25]
    for p, q in zip(model.parameters(), reference_model.parameters()):
        assert torch.equal(p, q)
    assert isinstance(opt.state[model.blocks[0].weight]["momentum_buffer"], lowbit_optim.OptimState8bit)
    assert type(opt.state[model.embed.weight]["exp_avg"]) is torch.Tensor


class ForwardingWrapper:
    """What Lightning's LightningOptimizer and Fabric's _FabricOptimizer make of an optimizer: an object
    of their class and the optimizer's, without its attributes, that forwards what it lacks to it."""

    def __init__(self, optimizer):
        self._optimizer = optimizer
        self.__class__ = type("Wrapped" + type(optimizer).__name__, (ForwardingWrapper, type(optimizer)), {})

    def __getattr__(self, name):
        return getattr(self._optimizer, name)


def test_muon_with_adamw_behind_a_wrapper_that_forwards_attributes():
    """MuonWithAdamW's param_groups and state (properties of its class) read a flag on the object
    itself: behind Lightning's wrapper they raised KeyError ('param_groups'), in manual optimization,
    a warm-up that edits param_groups and every Fabric loop's zero_grad."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, **RECIPE)
    wrapped = ForwardingWrapper(opt)
    assert isinstance(wrapped, lowbit_optim.MuonWithAdamW)
    assert [id(g) for g in wrapped.param_groups] == [id(g) for g in opt.param_groups]
    _lm_steps([opt], model, 1)
    assert wrapped.state[model.blocks[0].weight] is opt.state[model.blocks[0].weight]
    for group in wrapped.param_groups:
        group["lr"] = 0.5 * group["lr"]
    assert [g["lr"] for g in opt.param_groups] == [0.01, 1.5e-3]
    wrapped.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_muon_with_adamw_state_reads_like_torch_optims():
    """``opt.state[p]`` of a parameter not yet stepped is its part's ``{}`` (torch.optim's
    defaultdict gives one; logging code reads it before the first step), ``in`` and ``get`` add
    none, and the step fills what indexing made."""
    torch.manual_seed(0)
    model = TinyLM()
    opt, reference = lowbit_optim.MuonWithAdamW(model, **RECIPE), torch.optim.AdamW(model.parameters())
    matrix, embedding = model.blocks[0].weight, model.embed.weight
    for o in (opt, reference):
        assert matrix not in o.state and o.state.get(matrix) is None and len(o.state) == 0
        assert o.state[matrix] == {} and o.state[embedding] == {} and matrix in o.state and len(o.state) == 2
    assert matrix in opt.muon.state and embedding in opt.adamw.state and embedding not in opt.muon.state
    assert opt.state[torch.zeros(1)] == {} and len(opt.state) == 2  # a tensor of neither part: a new {}
    _lm_steps([opt], model, 1)
    assert isinstance(opt.state[matrix]["momentum_buffer"], lowbit_optim.OptimState8bit) and "exp_avg" in opt.state[embedding]


def test_muon_with_adamw_checkpoint_resumes_exactly(tmp_path):
    """state_dict through torch.save into a fresh object (its lr scheduler made before the load, as
    training scripts do) resumes bit for bit; a deepcopy of model and optimizer together steps as
    the original, and pickling works, with a scheduler attached (it wraps the instance's step: the
    copy must not take that along); another optimizer's state_dict is refused."""
    import copy
    import pickle

    def scheduler(opt):
        return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)

    torch.manual_seed(0)
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, **RECIPE)
    schedule = scheduler(opt)
    _lm_steps([opt], model, 3, [schedule])
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "schedule": schedule.state_dict()}, tmp_path / "ckpt.pt")
    copied_model, copied = copy.deepcopy((model, opt))
    copied_schedule = scheduler(copied)
    copied_schedule.load_state_dict(schedule.state_dict())
    pickle.loads(pickle.dumps(opt))
    expected = _lm_steps([opt], model, 3, [schedule])

    resumed_model = TinyLM()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    resumed_model.load_state_dict(saved["model"])
    resumed = lowbit_optim.MuonWithAdamW(resumed_model, **RECIPE)
    resumed_schedule = scheduler(resumed)
    resumed.load_state_dict(saved["opt"])
    resumed_schedule.load_state_dict(saved["schedule"])
    assert len(resumed.state) == len(opt.state)
    assert _lm_steps([resumed], resumed_model, 3, [resumed_schedule]) == expected
    assert _lm_steps([copied], copied_model, 3, [copied_schedule]) == expected
    assert [g["lr"] for g in resumed.param_groups] == [g["lr"] for o in resumed.optimizers for g in o.param_groups] == [g["lr"] for g in opt.param_groups]
    for p, q, r in zip(model.parameters(), resumed_model.parameters(), copied_model.parameters()):
        assert torch.equal(p, q) and torch.equal(p, r)
    with pytest.raises(ValueError, match=r"\{'muon': ..., 'adamw': ...\}"):
        resumed.load_state_dict(resumed.muon.state_dict())
    with pytest.raises(TypeError, match="opt.muon or opt.adamw"):
        resumed.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})


def test_muon_with_adamw_goes_to_dcp_helpers_as_one_optimizer():
    """torch.distributed.checkpoint's get/set_(optimizer_)state_dict take one optimizer's layout.
    Given MuonWithAdamW, also through a wrapper that holds it (as accelerate's does), its state dict
    is that layout (they failed with KeyError: 'state'): the checkpoint they make of opt.optimizers,
    flattened or not, which loads either way into a fresh object and resumes bit for bit (FSDP2's:
    test_fsdp.py; accelerate's FSDP2 checkpoints: test_hf.py). A checkpoint whose groups do not split
    as this model's is refused."""
    from torch.distributed.checkpoint import state_dict as dcp_helpers

    class Wrapped(torch.optim.Optimizer):  # as accelerate's AcceleratedOptimizer: it delegates to the one it holds
        def __init__(self, inner):
            self.inner = inner

        param_groups = property(lambda self: self.inner.param_groups)
        state = property(lambda self: self.inner.state)

        def state_dict(self):
            return self.inner.state_dict()

        def load_state_dict(self, state_dict):
            self.inner.load_state_dict(state_dict)

        def step(self, closure=None):
            return self.inner.step(closure)

        def zero_grad(self, set_to_none=True):
            self.inner.zero_grad(set_to_none)

    def fresh():
        torch.manual_seed(0)
        model = TinyLM()
        return model, lowbit_optim.MuonWithAdamW(model, **RECIPE)

    model, opt = fresh()
    _lm_steps([opt], model, 2)
    flat = dcp_helpers.StateDictOptions(flatten_optimizer_state_dict=True)
    saved = dcp_helpers.get_optimizer_state_dict(model, opt)
    assert saved.keys() == {"state", "param_groups"}
    for given, options in ((Wrapped(opt), None), (opt.optimizers, None), (opt, flat), (opt.optimizers, flat)):
        made = dcp_helpers.get_optimizer_state_dict(model, given, options=options)
        assert str(made) == str(dcp_helpers.get_optimizer_state_dict(model, opt, options=options)), (given, options)
    checkpoint = copy.deepcopy(dcp_helpers.get_state_dict(model, opt))  # (the helpers return the live tensors)
    flat_checkpoint = copy.deepcopy(dcp_helpers.get_optimizer_state_dict(model, opt, options=flat))
    after = _lm_steps([opt], model, 2)
    for target, optim_sd, options in ((lambda o: o, checkpoint[1], None), (Wrapped, checkpoint[1], None), (lambda o: o.optimizers, checkpoint[1], None), (lambda o: o, flat_checkpoint, flat)):
        resumed_model, resumed = fresh()
        model_sd, optim_sd = copy.deepcopy((checkpoint[0], optim_sd))  # (loading adopts its tensors, which then step)
        dcp_helpers.set_state_dict(resumed_model, target(resumed), model_state_dict=model_sd, optim_state_dict=optim_sd, options=options)
        assert isinstance(resumed.state[resumed_model.blocks[0].weight]["momentum_buffer"], lowbit_optim.OptimState8bit)
        assert _lm_steps([resumed], resumed_model, 2) == after
        for p, q in zip(model.parameters(), resumed_model.parameters()):
            assert torch.equal(p, q)
    torch.manual_seed(0)
    resumed_model = TinyLM()
    resumed = lowbit_optim.MuonWithAdamW(resumed_model, **{**RECIPE, "head": False})  # the head with Muon
    with pytest.raises(ValueError, match=r"lacks \['momentum_buffer'\]: it is not a checkpoint of Muon"):
        dcp_helpers.set_optimizer_state_dict(resumed_model, resumed, checkpoint[1])
    resumed_model, resumed = fresh()
    with pytest.raises(ValueError, match=r"has 1 param groups and this MuonWithAdamW 2 \(1 Muon's, then AdamW's\)"):
        dcp_helpers.set_optimizer_state_dict(resumed_model, resumed, opt.muon.state_dict())  # numbered: loaded as it is


def test_muon_with_adamw_follows_its_parts_and_runs_state_dict_hooks():
    """A group added to opt.adamw (as the wrapper's own refusal says) or a part's load_state_dict
    (as DCP's helpers load opt.optimizers) shows in param_groups and state: schedulers, GradScaler
    and zero_grad reach it. state_dict and load_state_dict run this optimizer's hooks, as torch.optim."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, **RECIPE)
    _lm_steps([opt], model, 1)
    extra = nn.Parameter(torch.ones(3))
    opt.adamw.add_param_group({"params": [extra], "lr": 0.1})
    assert [id(g) for g in opt.param_groups] == [id(g) for o in opt.optimizers for g in o.param_groups] and len(opt.param_groups) == 3
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    extra.grad = torch.ones(3)
    opt.step()
    scheduler.step()
    assert opt.param_groups[-1]["lr"] == 0.05 and extra in opt.state
    opt.zero_grad()
    assert extra.grad is None

    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("state_dict pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "note": calls.append("state_dict post")})
    opt.register_load_state_dict_pre_hook(lambda o, sd: calls.append("load pre") or {k: v for k, v in sd.items() if k != "note"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load post"))
    saved = opt.state_dict()
    assert "note" in saved
    for group in saved["muon"]["param_groups"] + saved["adamw"]["param_groups"]:
        group["lr"] = 0.0
    opt.adamw.load_state_dict(saved["adamw"])  # a part alone, as DCP's helpers load them
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.0, 0.0]
    opt.load_state_dict(saved)
    assert calls == ["state_dict pre", "state_dict post", "load pre", "load post"]
    assert [g["lr"] for g in opt.param_groups] == [0.0, 0.0, 0.0] and len(opt.state) == len(list(model.parameters())) + 1
    with pytest.raises(AttributeError, match=r"set opt.muon.state and opt.adamw.state instead"):
        opt.state = {}


def test_muon_with_adamw_names_the_part_a_keyword_belongs_to_and_dequantizes_per_part():
    """A keyword one part does not take names that part and where it belongs (the wrapper's own go
    to both); dequantize_state_dict gives each part's state dict, which torch.optim's Muon and AdamW
    load and step with."""
    with pytest.raises(TypeError, match=r"muon \(Muon\) takes no keyword 'betas'.*inside adamw=dict\(betas=...\)"):
        lowbit_optim.MuonWithAdamW(TinyLM(), betas=(0.9, 0.95))
    with pytest.raises(TypeError, match=r"adamw \(AdamW\) takes no keyword 'nesterov', given inside adamw=dict\(...\): it is Muon's: pass it inside muon=dict\(nesterov=...\)"):
        lowbit_optim.MuonWithAdamW(TinyLM(), adamw=dict(nesterov=True))
    # a typo is no keyword of the other part: it was sent there, which refused it too
    with pytest.raises(TypeError, match=r"muon \(Muon\) takes no keyword 'weight_decy', given to MuonWithAdamW, .*: neither optimizer takes it \(Muon takes lr, weight_decay, "):
        lowbit_optim.MuonWithAdamW(TinyLM(), weight_decy=0.1)
    with pytest.raises(TypeError, match=r"adamw \(AdamW\) takes no keyword 'weight_decy', given inside adamw=dict\(...\): neither optimizer takes it \(AdamW takes lr, betas, "):
        lowbit_optim.MuonWithAdamW(TinyLM(), adamw=dict(weight_decy=0.1))
    with pytest.raises(ValueError, match=r"this is a MuonWithAdamW checkpoint .* load it into a MuonWithAdamW, or load one part"):
        lowbit_optim.AdamW(TinyLM().parameters()).load_state_dict(lowbit_optim.MuonWithAdamW(TinyLM()).state_dict())
    torch.manual_seed(0)
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, **RECIPE)
    _lm_steps([opt], model, 2)
    plain = lowbit_optim.dequantize_state_dict(opt.state_dict())
    matrices, rest = lowbit_optim.muon_split(model)
    theirs = [torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=3e-3)]
    for torch_opt, part in zip(theirs, ("muon", "adamw")):
        torch_opt.load_state_dict(plain[part])
        assert all(type(v) is torch.Tensor for s in torch_opt.state.values() for v in s.values())
    before = [p.detach().clone() for p in model.parameters()]
    _lm_steps(theirs, model, 1)
    assert all(not torch.equal(b, p) and bool(p.isfinite().all()) for b, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        lowbit_optim.dequantize_state_dict({"model": {}})


def test_muon_with_adamw_refused_checkpoint_leaves_both_as_they_were():
    """A checkpoint whose AdamW part is refused (after Muon's part loaded) leaves Muon's part as it
    was too: the next steps are those of an untouched copy."""
    import copy

    torch.manual_seed(0)
    model = TinyLM()
    opt = lowbit_optim.MuonWithAdamW(model, **RECIPE)
    _lm_steps([opt], model, 2)
    saved = opt.state_dict()
    _lm_steps([opt], model, 1)  # the checkpoint is now a step behind
    copied_model, copied = copy.deepcopy((model, opt))
    bad = copy.deepcopy(saved)
    next(iter(bad["adamw"]["state"].values()))["step"] = "1"
    with pytest.raises(ValueError, match="checkpoint state 'step' of parameter"):
        opt.load_state_dict(bad)
    assert [id(g) for g in opt.param_groups] == [id(g) for o in opt.optimizers for g in o.param_groups]
    assert _lm_steps([opt], model, 2) == _lm_steps([copied], copied_model, 2)
    for p, q in zip(model.parameters(), copied_model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("side", ["muon", "adamw"])
def test_muon_with_adamw_suggests_a_format_where_it_takes_one(side):
    """A format too coarse for one side's slow average (README, "Low-rank states and slow averages")
    is refused with a suggestion inside that side's keyword: a flat per-state state_format would go
    to both optimizers, whose states differ. The suggestion is accepted, in the constructor and when
    a checkpoint with the slow average loads."""
    slow = dict(muon=dict(momentum=0.99), adamw=dict(betas=(0.99, 0.999)))[side]
    kwargs = dict(state_format="4bit-lowrank-mulaw", min_quantize_numel=0, compile=False)
    with pytest.raises(lowbit_optim.StateFormatError) as refused:
        lowbit_optim.MuonWithAdamW(TinyLM(), **kwargs, **{side: slow})
    suggested = refused.value.state_format
    assert str(refused.value).endswith(f"e.g. {side}=dict(state_format={suggested})")
    accepted = lowbit_optim.MuonWithAdamW(TinyLM(), **kwargs, **{side: {**slow, "state_format": suggested}})
    copied = pickle.loads(pickle.dumps(refused.value))
    assert (copied.args, copied.state_format, copied.spelled) == (refused.value.args, suggested, refused.value.spelled)

    target = lowbit_optim.MuonWithAdamW(TinyLM(), **kwargs)
    with pytest.raises(lowbit_optim.StateFormatError, match=re.escape(f"e.g. {side}=dict(state_format={suggested})")) as loading:
        target.load_state_dict(accepted.state_dict())
    assert str(loading.value).startswith(f"{side}: param group 0 of this checkpoint: the '4bit-lowrank-mulaw' state format cannot hold")


def test_muon_with_adamw_suggests_a_signed_format_inside_adamw():
    """The other per-state suggestion (a format for nonnegative states given a signed one) is
    spelled inside the wrapper's keyword too, and is accepted there."""
    with pytest.raises(lowbit_optim.StateFormatError) as refused:
        lowbit_optim.MuonWithAdamW(TinyLM(), adamw=dict(state_format="factored"), compile=False)
    suggested = refused.value.state_format
    assert suggested == {"exp_avg": "4bit", "exp_avg_sq": "factored"}
    assert str(refused.value) == (
        "adamw: the 'factored' state format holds nonnegative states only: use it for exp_avg_sq, "
        "e.g. adamw=dict(state_format={'exp_avg': '4bit', 'exp_avg_sq': 'factored'})"
    )
    lowbit_optim.MuonWithAdamW(TinyLM(), adamw=dict(state_format=suggested), compile=False)
