"""The usual Muon recipe: Muon on a model's hidden matrices, AdamW on everything else, as one
optimizer object (``MuonWithAdamW``) or as the split alone (``muon_split``)."""

import contextlib
import fnmatch
import re
import sys
import warnings
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from . import in_backward
from .base import StateFormatError, _keywords
from .optim import AdamW, Muon


def muon_split(model: nn.Module, head: str | bool | None = None) -> tuple[list[Tensor], list[Tensor]]:
    """``(matrices for Muon, the rest for AdamW)`` of ``model``'s parameters (frozen ones included,
    as ``model.parameters()`` holds them: they train once unfrozen), by the usual rule: Muon takes
    the weights of the ``nn.Linear`` layers but the head; AdamW takes embeddings, the output head,
    biases, norms and everything else (convolutions included, which torch.optim.Muon refuses). The
    head is the module named by ``head`` (a glob over qualified names, e.g. ``"lm_head"``; False:
    none, for a model whose output uses its embedding's weight through ``F.linear``), by default the
    last ``nn.Linear`` of ``model.modules()``, with a warning where that one looks hidden (it maps to
    an embedding's width); a weight tied to an embedding stays with AdamW too (so a model that
    registers its head before its blocks needs ``head=``). Only ``nn.Linear`` (and its subclasses)
    with a weight of its own counts: Hugging Face GPT-2's ``Conv1D``, ``nn.MultiheadAttention``'s
    ``in_proj_weight`` and a parametrized weight (``weight_norm``, ``spectral_norm``: warned of) do
    not, so pass such weights yourself. Each list can get its own optimizer and format (with
    ``step_in_backward=True``, which refuses frozen parameters, pass the trainable ones)::

        matrices, rest = muon_split(model)
        muon = Muon(matrices, lr=0.02, state_format="8bit")
        adamw = AdamW(rest, lr=3e-4, state_format="8bit")
    """
    return _muon_split(model, head)


def _muon_split(model: nn.Module, head) -> tuple[list[Tensor], list[Tensor]]:
    # muon_split's work, called by it and by MuonWithAdamW alike: its warnings' stacklevel names their caller
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"muon_split and MuonWithAdamW take the model (an nn.Module: they split it by module type), got "
            f"{type(model).__name__}; to choose the matrices yourself, build Muon and AdamW over your own lists"
        )
    if not (head is None or head is False or isinstance(head, str)):
        raise TypeError(f"head must be a name glob of the model's modules (e.g. 'lm_head') or False (no nn.Linear head), got {type(head).__name__}")
    named = list(model.named_modules())
    linears = [(name, m) for name, m in named if isinstance(m, nn.Linear)]
    computed = [name for name, m in linears if m._parameters.get("weight") is None]  # parametrized: its weight is made at each access
    if computed:
        warnings.warn(
            f"the weights of {computed} are parametrized (weight_norm, spectral_norm, parametrize): their parameters go to "
            "AdamW; pass them to Muon yourself (muon_split's lists) if they are matrices for it",
            stacklevel=3,
        )
    linears = [(name, m) for name, m in linears if name not in computed]
    if head is None:
        heads = {linears[-1][0]} if linears else set()
        _warn_if_hidden(named, linears)
    elif head is False:
        heads = set()
    else:
        heads = {name for name, _ in linears if fnmatch.fnmatchcase(name, head)}
        if not heads:
            raise ValueError(f"head={head!r} names no nn.Linear of the model; its Linear layers are {[n for n, _ in linears]}")
    embedded = {id(m.weight) for _, m in named if isinstance(m, nn.Embedding)}
    matrices = {id(m.weight): m.weight for name, m in linears if name not in heads and id(m.weight) not in embedded}
    params = list(model.parameters())
    return [p for p in params if id(p) in matrices], [p for p in params if id(p) not in matrices]


def _warn_if_hidden(named: list, linears: list) -> None:
    """Warn where the last nn.Linear, the default head, maps to an embedding's width (as a hidden
    layer does): either another nn.Linear maps to the embedding's entries (a head registered before
    the blocks) or none does (the output likely uses the embedding's weight)."""
    embeddings = [(name, m) for name, m in named if isinstance(m, nn.Embedding)]
    if not linears or not embeddings:
        return
    last, layer = linears[-1]
    widths = {m.embedding_dim: name for name, m in embeddings}
    if layer.out_features not in widths:
        return
    heads = [name for name, m in linears if any(m.out_features == e.num_embeddings for _, e in embeddings)]
    hidden = (f"the last nn.Linear, {last!r}, taken as the output head (AdamW), maps to the width of the embedding "
              f"{widths[layer.out_features]!r} ({layer.out_features}), as a hidden layer does")  # fmt: skip
    if heads:
        advice = f"while {heads[0]!r} maps to its entries, as a head does: if that is the head, pass head={heads[0]!r}"
    else:
        advice = (f"if the model's output uses the embedding's weight (tied, through F.linear), it has no nn.Linear head: "
                  f"pass head=False ({last!r} then goes to Muon), or head='...' naming the head")  # fmt: skip
    warnings.warn(f"{hidden}: {advice}", stacklevel=4)


class MuonWithAdamW(torch.optim.Optimizer):
    """Muon on ``model``'s hidden matrices and AdamW on the rest (``muon_split``), in one optimizer::

        opt = MuonWithAdamW(model, muon=dict(lr=0.02, state_format="8bit-lowrank"), adamw=dict(lr=3e-4, betas=(0.9, 0.95)), state_format="8bit")

    ``options`` (``state_format``, ``min_quantize_numel``, ``compile``, ...) go to both; ``muon`` and
    ``adamw`` hold each one's own keywords and override them. ``param_groups`` lists the Muon groups,
    then the AdamW groups (the dicts the two hold, read anew each time: a part's add_param_group or
    load_state_dict shows), so lr schedulers, GradScaler and ``zero_grad`` see every parameter; a
    scheduler scales each group from its own initial lr. ``state_dict()`` is ``{"muon": ...,
    "adamw": ...}``, with this optimizer's state_dict hooks run as torch.optim runs them; to
    torch.distributed.checkpoint's helpers (get/set_state_dict, also through accelerate's wrapper)
    it is one optimizer's layout, Muon's groups then AdamW's: the checkpoint they make of the list
    ``opt.optimizers``. ``opt.muon`` and ``opt.adamw`` are the two.
    """

    owns_in_backward = True  # its parts own their parameters (in_backward.own)

    def __init__(self, model: nn.Module, *, muon: dict | None = None, adamw: dict | None = None, head: str | bool | None = None, **options):
        for name, part in (("muon", muon), ("adamw", adamw)):
            if part is not None and not isinstance(part, dict):
                raise TypeError(f"{name} must be a dict of its optimizer's keywords (e.g. {name}=dict(lr=0.02)), got {type(part).__name__}")
        if any((part or {}).get("max_grad_norm") is not None for part in (options, muon, adamw)):
            raise ValueError(
                "max_grad_norm on MuonWithAdamW would clip Muon's and AdamW's gradients against two separate norms: "
                "build Muon and AdamW yourself (muon_split) if you want that, or drop max_grad_norm"
            )
        matrices, rest = _muon_split(model, head)
        muon_options, adamw_options = {**options, **(muon or {})}, {**options, **(adamw or {})}
        if "compensation_format" in options:  # a shared Kahan buffer: for the part (or parts) that sums so
            kahan = [part for part in (muon_options, adamw_options) if part.get("param_update") == "kahan"]
            for part, own in ((muon_options, muon), (adamw_options, adamw)):
                if kahan and part not in kahan and "compensation_format" not in (own or {}):
                    del part["compensation_format"]
        if muon_options.get("step_in_backward"):  # which refuses frozen parameters
            matrices = [p for p in matrices if p.requires_grad]
        if adamw_options.get("step_in_backward"):
            rest = [p for p in rest if p.requires_grad]
        if not matrices:
            raise ValueError(
                "the model has no nn.Linear weight for Muon but its head (parametrized ones do not count): use AdamW alone, "
                "or pass head=False if its output uses the embedding's weight"
            )
        self._built = False
        with warnings.catch_warnings(record=True) as warned:  # (said once both parts are built: a take-over)
            warnings.simplefilter("always")
            with _suggesting_inside("muon", shared=options.keys(), own=(muon or {}).keys()):
                self.muon = Muon(matrices, **muon_options)
            try:
                with _suggesting_inside("adamw", shared=options.keys(), own=(adamw or {}).keys()):
                    self.adamw = AdamW(rest, **adamw_options) if rest else None
            except BaseException:
                in_backward.disown(self.muon)  # built, but no optimizer of the user's: the optimizers before it keep its parameters
                raise
        for w in warned:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        super().__init__([{"params": matrices}], {})  # torch.optim's hooks and attributes; its groups are not read
        self._built = True
        self._link_parts()

    def _link_parts(self) -> None:
        # AdamW's part names an edited group it refuses (in whichever step checks it) by its index in
        # param_groups, after Muon's groups; Muon's part checks AdamW's before it steps
        if self.adamw is not None:
            self.adamw._groups_before = self.muon
            self.muon._parts_stepped_after = (self.adamw,)

    # torch.optim's constructor and __setstate__ set these; once built, they are the two optimizers'
    # own, read anew each time (their load_state_dict replaces both with new objects). Built is read as
    # an attribute: a wrapper that takes this class and forwards what it lacks to the optimizer
    # (Lightning's LightningOptimizer, Fabric's) reads the optimizer's
    def _is_built(self) -> bool:
        return getattr(self, "_built", False)

    @property
    def param_groups(self) -> list[dict]:
        if not self._is_built():
            return self.__dict__["param_groups"]
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[dict]) -> None:
        self._refuse_once_built("param_groups")
        self.__dict__["param_groups"] = groups

    @property
    def state(self) -> Mapping:
        if not self._is_built():
            return self.__dict__["state"]
        return _States(self.optimizers)

    @state.setter
    def state(self, state: dict) -> None:
        self._refuse_once_built("state")
        self.__dict__["state"] = state

    def _refuse_once_built(self, name: str) -> None:
        if self._is_built():  # it would be lost: the two optimizers' are read
            raise AttributeError(f"MuonWithAdamW's {name} is its two optimizers': set opt.muon.{name} and opt.adamw.{name} instead")

    @contextlib.contextmanager
    def accumulating(self):
        """Both optimizers' ``accumulating()`` (step_in_backward's gradient accumulation)."""
        with contextlib.ExitStack() as stack:
            for optimizer in self.optimizers:
                stack.enter_context(optimizer.accumulating())
            yield self

    def __getstate__(self) -> dict:
        # as torch.optim: no hooks, and no step a scheduler wrapped on this instance (it holds the scheduler)
        return {"muon": self.muon, "adamw": self.adamw, "defaults": self.defaults}

    def __setstate__(self, state: dict) -> None:
        super().__setstate__({**state, "state": {}, "param_groups": []})  # torch.optim's hooks and attributes
        self._built = True
        self._link_parts()

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.muon] + ([self.adamw] if self.adamw else [])

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # GradScaler then hands this optimizer its scale, which step() refuses where a part steps in backward
        return any(o._step_supports_amp_scaling for o in self.optimizers)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if any(o._step_in_backward for o in self.optimizers):
            in_backward.check_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        if "grad_scale" in self.__dict__:
            in_backward.refuse_grad_scaler(self)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not torch.compiler.is_compiling():  # traced, it would guard on every parameter
            self._check_parts_disjoint()
        # Muon's part checks AdamW's edits and what its step would refuse before it steps anything
        # (_parts_stepped_after), also as an op of a compiled step: a refusal must not leave one part stepped
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def _check_parts_disjoint(self) -> None:
        """A parameter added to both parts (opt.muon.add_param_group of one AdamW holds) would be
        stepped twice: refused, as one torch.optim optimizer refuses a parameter in two groups."""
        if self.adamw is None:
            return
        in_adamw = {id(p) for group in self.adamw.param_groups for p in group["params"]}
        twice = [p for group in self.muon.param_groups for p in group["params"] if id(p) in in_adamw]
        if twice:
            raise ValueError(
                f"a parameter of shape {tuple(twice[0].shape)} is in both opt.muon's and opt.adamw's param groups, and "
                "each would step it: add a parameter to one part only"
            )

    def _split_layout(self, state_dict) -> dict:
        """One optimizer's layout (_one_layout's: DCP's helpers load it, its parameters named or
        numbered) as {"muon": ..., "adamw": ...}: the first groups are Muon's, as many as it has."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"state", "param_groups"}:
            raise ValueError("torch.distributed.checkpoint's helpers gave MuonWithAdamW a state dict that is not one optimizer's layout")
        counts = [len(optimizer.param_groups) for optimizer in self.optimizers]
        groups = state_dict["param_groups"]
        if len(groups) != sum(counts):
            raise ValueError(
                f"the checkpoint has {len(groups)} param groups and this MuonWithAdamW {sum(counts)} ({counts[0]} Muon's, then "
                "AdamW's): the checkpoint's split between Muon and AdamW differs from this model's"
            )
        parts = []
        for start, stop in ((0, counts[0]), (counts[0], len(groups))):
            names = [name for group in groups[start:stop] for name in group["params"]]
            parts.append({"state": {name: state_dict["state"][name] for name in names if name in state_dict["state"]}, "param_groups": groups[start:stop]})
        return {"muon": parts[0], "adamw": parts[1] if self.adamw else None}

    def state_dict(self) -> dict:
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        parts = [optimizer.state_dict() for optimizer in self.optimizers]
        if _called_by_dcp_helpers():
            state_dict = _one_layout(parts)
        else:
            state_dict = {"muon": parts[0], "adamw": parts[1] if self.adamw else None}
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        return state_dict

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = state_dict.copy() if isinstance(state_dict, dict) else state_dict  # as torch.optim, for its hooks
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        if _called_by_dcp_helpers():
            state_dict = self._split_layout(state_dict)
        if not isinstance(state_dict, dict) or set(state_dict) != {"muon", "adamw"}:
            raise ValueError("a MuonWithAdamW state_dict is {'muon': ..., 'adamw': ...}; this one is not (saved by another optimizer?)")
        if (state_dict["adamw"] is None) != (self.adamw is None):
            raise ValueError("the checkpoint's split between Muon and AdamW differs from this model's")
        kept = [(o, o.state, o.param_groups) for o in self.optimizers]
        try:
            with _suggesting_inside("muon"):
                self.muon.load_state_dict(state_dict["muon"])
            if self.adamw:
                with _suggesting_inside("adamw"):
                    self.adamw.load_state_dict(state_dict["adamw"])
        except BaseException:  # AdamW's part refused: Muon's as it was too
            for optimizer, state, groups in kept:
                optimizer.state, optimizer.param_groups = state, groups
            raise
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def add_param_group(self, param_group: dict) -> None:
        if self._built:  # the constructor's own call only sets up torch.optim's bookkeeping
            raise TypeError("add groups to opt.muon or opt.adamw, which know what each parameter needs")
        super().add_param_group(param_group)


def _called_by_dcp_helpers() -> bool:
    """Whether torch.distributed.checkpoint's get/set_(optimizer_)state_dict called: they read and
    write one optimizer's layout ({"state", "param_groups"}, numbered as opt.param_groups lists the
    parameters), not {"muon", "adamw"} (they failed with KeyError: 'state'). Any frame up the stack
    counts: they may call through a wrapper (accelerate's AcceleratedOptimizer, in its FSDP2
    checkpoints)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") != "torch.distributed.checkpoint.state_dict":
        frame = frame.f_back
    return frame is not None


def _one_layout(parts: list[dict]) -> dict:
    """The two parts' state dicts as one optimizer's: Muon's groups, then AdamW's, the parameters
    numbered on across them (as opt.param_groups lists them, the order DCP's helpers name them in)."""
    state, groups, offset = {}, [], 0
    for part in parts:
        renumber = {index: offset + i for i, index in enumerate(index for group in part["param_groups"] for index in group["params"])}
        groups += [{**group, "params": [renumber[index] for index in group["params"]]} for group in part["param_groups"]]
        state.update({renumber[index]: value for index, value in part["state"].items()})
        offset += len(renumber)
    return {"state": state, "param_groups": groups}


@contextlib.contextmanager
def _suggesting_inside(keyword: str, shared=(), own=()):
    """A format one of MuonWithAdamW's optimizers refuses is named as that one's (its checkpoint's
    group numbers count its own groups) and suggested inside ``keyword``, where the wrapper takes a
    per-state ``state_format`` (a flat one goes to both, whose states differ). A keyword it does not
    take (``own``: given inside ``keyword=dict(...)``; ``shared``: the wrapper's own, given to both) is
    named with the part that refused it, and with the other part if that one takes it."""
    try:
        yield
    except StateFormatError as refused:
        raise refused.restated(context=f"{keyword}: ", spelled=f"{keyword}=dict(state_format={refused.state_format})") from None
    except TypeError as refused:
        unexpected = re.search(r"unexpected keyword argument '(\w+)'", str(refused))
        if unexpected is None or unexpected.group(1) not in (*shared, *own):  # raised deeper down, not about a keyword given
            raise
        name = unexpected.group(1)
        part, other, other_name = (Muon, AdamW, "adamw") if keyword == "muon" else (AdamW, Muon, "muon")
        where = f"inside {keyword}=dict(...)" if name in own else "to MuonWithAdamW, which passes its keywords to both optimizers"
        if name in _keywords(other):
            fix = f"it is {other.__name__}'s: pass it inside {other_name}=dict({name}=...)"
        else:
            fix = f"neither optimizer takes it ({part.__name__} takes {', '.join(_keywords(part))})"
        raise TypeError(f"MuonWithAdamW's {keyword} ({part.__name__}) takes no keyword {name!r}, given {where}: {fix}") from None


class _States(Mapping):
    """The two optimizers' ``state`` as one read-only mapping (their keys are disjoint). Unlike a
    ChainMap it never indexes a defaultdict with a parameter it does not hold (which would add one
    to the wrong optimizer): a parameter without state yet gets its own optimizer's ``{}``, as
    torch.optim's defaultdict gives it (one of neither, a new ``{}``); ``in`` and ``get`` add none."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    def __getitem__(self, param):
        for optimizer in self.optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        holds = (o for o in self.optimizers if any(p is param for group in o.param_groups for p in group["params"]))
        owner = next(holds, None)
        return owner.state[param] if owner is not None else {}

    def __contains__(self, param) -> bool:
        return any(param in optimizer.state for optimizer in self.optimizers)

    def get(self, param, default=None):
        return self[param] if param in self else default

    def __iter__(self):
        return (param for optimizer in self.optimizers for param in optimizer.state)

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self.optimizers)
