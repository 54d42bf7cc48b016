"""Hugging Face Trainer: ``optimizer_cls_and_kwargs`` for a lowbit_optim optimizer.

Imports nothing from transformers. It hands Trainer an optimizer factory (transformers >= 5.23: a
first element that is not an Optimizer class), which Trainer calls as ``factory()(model, **kwargs)``
with the model it trains, so that the param groups are that model's: with ``Trainer(model_init=...)``
it is not the model the helper was given.
"""

import functools
import inspect
import os
import warnings

from torch import nn

from .base import LowBitOptimizer
from .muon import MuonWithAdamW
from .optim import Adam, AdamW, param_groups_by_module


def optimizer_cls_and_kwargs(model: nn.Module, args=None, *, optimizer_cls=AdamW, overrides=None, **kwargs) -> tuple:
    """``(factory, kwargs)`` for ``transformers.Trainer(optimizer_cls_and_kwargs=...)``::

        trainer = Trainer(model, args, ..., optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(model, args, state_format="8bit"))

    Trainer builds ``optimizer_cls`` (a class, or a ``functools.partial`` of one) with
    ``factory()(model, **kwargs)``, from the model it trains (``model`` here is only checked).

    - ``args`` (``TrainingArguments``) supplies lr and weight_decay, and to Adam/AdamW (their
      subclasses included) also betas and eps, as for Trainer's own optimizers: to an
      ``optimizer_cls_and_kwargs`` optimizer Trainer passes only weight decay, so it would run at its
      default lr, betas and eps. ``adam_beta1/2`` and ``adam_epsilon`` are Adam's, so SGD, Lion and
      AdEMAMix keep their own defaults (Lion's betas mean something else). ``kwargs`` (e.g.
      ``state_format``, ``momentum``) override them. They are read when Trainer builds the
      optimizer, so a hyperparameter search's trials (set on the same ``args``) get their own.
      Without ``args`` the optimizer keeps its default lr unless ``lr`` is given (a warning says so).
    - ``optimizer_cls``: a lowbit_optim optimizer or a subclass of one (another is refused: it
      would ignore the groups' formats).
    - ``overrides`` (default: embeddings keep fp32 state, as bitsandbytes does under Trainer) are
      per-module group options, see ``param_groups_by_module``; one that sets ``weight_decay`` keeps it
      for its parameters of every dimension.
    - Parameters of fewer than 2 dims (biases, norm weights) get no weight decay. Trainer's own groups
      go by name and module type instead (no "bias" or "norm" in the name, not in an nn.LayerNorm):
      the same split for GPT-2, BERT or Llama, not for, e.g., T5's 2-D ``relative_attention_bias``
      (decayed here) or a 1-D layer scale (not decayed here). An optimizer whose constructor takes no
      ``weight_decay``, by name or through ``**kwargs``, gets none of it. Frozen parameters are left out.
    - ``step_in_backward=True`` (here or in a ``functools.partial``) needs ``args`` and is refused
      where Trainer would act on gradients after backward: gradient accumulation (Trainer runs several
      backward passes per step without telling the optimizer), its clipping
      (``args.max_grad_norm``; pass ``max_grad_norm`` here instead: without step_in_backward it is
      refused, Trainer clips), fp16's scaler, and several processes without FSDP2 (DDP averages
      gradients after the step in backward has used them; FSDP version 1 accumulates them into flat
      parameters).
    - MuonWithAdamW, which splits a model itself, is built with ``Trainer(optimizers=(opt, None))``.
    """
    cls, bound = _unwrapped(optimizer_cls)
    if not isinstance(cls, type):
        raise TypeError(f"optimizer_cls must be an optimizer class or a functools.partial of one, got {optimizer_cls!r}")
    if not issubclass(cls, (LowBitOptimizer, MuonWithAdamW)):  # (whose groups' formats another would ignore)
        raise TypeError(
            f"optimizer_cls must be a lowbit_optim optimizer (or a subclass of one), got {cls.__module__}.{cls.__qualname__}: "
            "the helper would hand it lowbit_optim's options (state_format) and TrainingArguments' options by lowbit_optim's "
            "rules; for another optimizer use Trainer's own (TrainingArguments(optim=...), or optimizer_cls_and_kwargs=(cls, {...}))"
        )
    if issubclass(cls, MuonWithAdamW):
        raise TypeError(
            "MuonWithAdamW splits a model into Muon's and AdamW's parameters itself and takes no param groups: build it "
            "and pass it as Trainer(model, args, optimizers=(lowbit_optim.MuonWithAdamW(model, ...), None))"
        )
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Module to train, got {type(model).__name__}")
    if args is not None and not hasattr(args, "learning_rate"):  # (an optimizer passed where args goes fails only in Trainer)
        fix = "pass the optimizer as optimizer_cls=" if isinstance(args, type) else "pass Trainer's TrainingArguments, whose learning_rate it reads"
        raise TypeError(f"args must be the TrainingArguments (or None), got {args!r}: {fix}")
    chosen = {**bound, **kwargs}
    if chosen.get("max_grad_norm") is not None and not chosen.get("step_in_backward"):
        raise ValueError(
            "max_grad_norm here clips in backward, for step_in_backward=True; stepping after backward, Trainer clips: set "
            "TrainingArguments(max_grad_norm=...) instead"
        )
    if chosen.get("step_in_backward"):
        _check_step_in_backward(args)  # now, and again when Trainer builds the optimizer (args may change)
    if args is None and "lr" not in chosen:
        warnings.warn(
            f"optimizer_cls_and_kwargs without args (the TrainingArguments): the optimizer takes {cls.__name__}'s default lr "
            "and weight decay, not TrainingArguments' learning_rate and weight_decay, which Trainer does not pass it: pass "
            "optimizer_cls_and_kwargs(model, args, ...), or lr=... to use another",
            stacklevel=2,
        )
    takes_decay = _takes_keyword(cls, "weight_decay")
    if not takes_decay and args is not None and getattr(args, "weight_decay", 0) and "weight_decay" not in chosen:
        warnings.warn(
            f"TrainingArguments' weight_decay ({args.weight_decay}) is not passed to {cls.__name__}, whose __init__ does not "
            "name it (LowBitOptimizer's **options refuse it): name weight_decay in its __init__ to take it, or set "
            "TrainingArguments(weight_decay=0.0)",
            stacklevel=2,
        )
    overrides = {nn.Embedding: "fp32"} if overrides is None else overrides
    return _Factory(_OptimizerFactory, optimizer_cls, overrides, takes_decay, args), kwargs


class _Factory(functools.partial):
    """The first element of the pair, which Trainer calls: not an optimizer itself."""

    def __getattr__(self, name: str):
        raise AttributeError(
            f"{name!r}: this is the optimizer factory of optimizer_cls_and_kwargs(...)'s pair, not an optimizer: pass the "
            "pair as Trainer(optimizer_cls_and_kwargs=...), not as optimizers=, or build the optimizer with "
            "factory, kwargs = optimizer_cls_and_kwargs(model, args); opt = factory()(model, **kwargs)"
        )


class _OptimizerFactory:
    """What Trainer calls with the model it trains: the optimizer over that model's param groups."""

    def __init__(self, optimizer_cls, overrides: dict, takes_decay: bool, args, *params, **kwargs):
        if params or kwargs:  # called as an optimizer class, cls(params, **kwargs): transformers before 5.23
            raise TypeError(
                "optimizer_cls_and_kwargs returns an optimizer factory, which Trainer calls with its model from "
                "transformers 5.23 on (pip install 'transformers>=5.23'); to build the optimizer yourself: "
                "factory, kwargs = optimizer_cls_and_kwargs(model, args); opt = factory()(model, **kwargs)"
            )
        self.optimizer_cls, self.overrides, self.takes_decay, self.args = optimizer_cls, overrides, takes_decay, args

    def __call__(self, model: nn.Module, **kwargs):
        # the options in args as they are now: a hyperparameter search sets each trial's on the same args
        bound = _unwrapped(self.optimizer_cls)[1]
        if self.args is not None:
            kwargs = {**{k: v for k, v in self.from_args().items() if k not in bound}, **kwargs}  # the partial's own win, as kwargs do
        if {**bound, **kwargs}.get("step_in_backward"):
            _check_step_in_backward(self.args)
        return self.optimizer_cls(param_groups(model, self.overrides, self.takes_decay), **kwargs)

    def from_args(self) -> dict:
        """What ``args`` (TrainingArguments) gives the optimizer: lr and weight decay, and Adam's betas and eps."""
        args = self.args
        cls = _unwrapped(self.optimizer_cls)[0]
        options = {"lr": args.learning_rate, **({"weight_decay": args.weight_decay} if self.takes_decay else {})}
        if issubclass(cls, Adam):
            options.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        return options


def _takes_keyword(cls: type, name: str) -> bool:
    """Whether building ``cls`` takes keyword ``name``: an ``__init__`` up its classes names it and
    each one below passes it on through ``**kwargs`` (a subclass of AdamW). LowBitOptimizer's
    ``**unknown`` takes none: an optimizer of one's own without weight decay is given none."""
    for klass in cls.__mro__:
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters
        if name in parameters:
            return True
        if klass is LowBitOptimizer or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            return False
    return False


def _unwrapped(optimizer_cls) -> tuple:
    """(the class, the keywords bound to it) of an optimizer class or a functools.partial of one."""
    if isinstance(optimizer_cls, functools.partial):
        return optimizer_cls.func, optimizer_cls.keywords
    return optimizer_cls, {}


def param_groups(model: nn.Module, overrides: dict, takes_decay: bool) -> list[dict]:
    """``model``'s trainable parameters in ``param_groups_by_module`` groups, each split into those
    with weight decay (2 dims or more) and those without (unless an override sets its own)."""
    params = []
    for group in param_groups_by_module(model, overrides):
        trainable = [p for p in group.pop("params") if p.requires_grad]
        for decay in (True, False):
            chosen = [p for p in trainable if (p.dim() >= 2) == decay]
            if chosen:
                undecayed = not decay and takes_decay and "weight_decay" not in group  # (an override's own wins)
                params.append({**group, "params": chosen, **({"weight_decay": 0.0} if undecayed else {})})
    return params


def _shards_with_fsdp(args) -> bool:
    """Whether Trainer will shard the model with FSDP: named in TrainingArguments (fsdp=...,
    parallelism_config's dp_shard_size) or chosen through accelerate (``accelerate launch --use_fsdp``)."""
    sharded = getattr(getattr(args, "parallelism_config", None), "dp_shard_size", 1) or 1
    return bool(getattr(args, "fsdp", False)) or sharded > 1 or _launched_with_fsdp()


def _launched_with_fsdp() -> bool:
    """Whether ``accelerate launch --use_fsdp`` started this process (its environment says so, read
    as accelerate's Accelerator reads it: "1" makes no FSDP plugin)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def _fsdp_version(args) -> str:
    """The FSDP version Trainer would shard with: its fsdp_config's (transformers' default 2) where
    TrainingArguments name FSDP, else that of accelerate's plugin, made from the environment of
    ``accelerate launch --use_fsdp`` (whose default is 1)."""
    if not getattr(args, "fsdp", None) and _launched_with_fsdp():
        return os.environ.get("FSDP_VERSION", "1")
    return str((getattr(args, "fsdp_config", None) or {}).get("version", 2))


def _check_step_in_backward(args) -> None:
    if args is None:
        raise ValueError(
            "step_in_backward=True needs args, the TrainingArguments, to check what Trainer does with gradients after "
            "backward (accumulation, clipping, fp16's scaler), which the step in backward has already used and freed: "
            "pass optimizer_cls_and_kwargs(model, args, ...)"
        )
    if args.gradient_accumulation_steps > 1:
        raise ValueError(
            f"step_in_backward=True steps at every backward, and Trainer runs gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps} backward passes per step: set gradient_accumulation_steps=1 (use a "
            "larger per-device batch), or step after backward"
        )
    if _shards_with_fsdp(args) and _fsdp_version(args) == "1":
        raise ValueError(
            "step_in_backward=True is made for FSDP2 (fully_shard), whose sharded parameters' hooks run after their "
            "gradients are reduced; FSDP version 1 accumulates gradients into flat parameters: set "
            "fsdp_config={'version': 2}, or step after backward"
        )
    if getattr(args, "world_size", 1) > 1 and not _shards_with_fsdp(args):
        raise ValueError(
            f"step_in_backward=True under Trainer's {args.world_size} processes without FSDP (DistributedDataParallel, "
            "DeepSpeed) steps each parameter before its gradient is averaged over the processes, and the replicas drift "
            "apart: step after backward (step_in_backward=False)"
        )
    if getattr(args, "fp16", False):
        raise ValueError(
            "TrainingArguments(fp16=True) scales the loss with a GradScaler (on accelerators), which unscales gradients "
            "after backward, when step_in_backward=True has already stepped with them scaled: use bf16=True (no scaler)"
        )
    if args.max_grad_norm:
        raise ValueError(
            f"Trainer clips gradients after backward (max_grad_norm={args.max_grad_norm}), when step_in_backward=True "
            "has already used and freed them: set TrainingArguments(max_grad_norm=0) and pass max_grad_norm=... to "
            "optimizer_cls_and_kwargs instead (it clips in backward)"
        )
