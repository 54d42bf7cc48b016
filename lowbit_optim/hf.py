"""Hugging Face Trainer: ``optimizer_cls_and_kwargs`` for a lowbit_optim optimizer.

Imports nothing from transformers: for ``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))``, Trainer
calls ``cls(params, **kwargs)`` with its own param groups, or with ``kwargs.pop("params")`` if given.
"""

import inspect

from torch import nn

from .optim import Adam, AdamW, param_groups_by_module


def optimizer_cls_and_kwargs(model: nn.Module, args=None, *, optimizer_cls=AdamW, overrides=None, **kwargs) -> tuple[type, dict]:
    """``(optimizer_cls, kwargs)`` for ``transformers.Trainer(optimizer_cls_and_kwargs=...)``::

        trainer = Trainer(model, args, ..., optimizer_cls_and_kwargs=optimizer_cls_and_kwargs(model, args, state_format="8bit"))

    - ``args`` (``TrainingArguments``) supplies lr and weight_decay, and to Adam/AdamW (their
      subclasses included) also betas and eps, as for Trainer's own optimizers: to an
      ``optimizer_cls_and_kwargs`` optimizer Trainer passes only weight decay, so it would run at its
      default lr, betas and eps. ``adam_beta1/2`` and ``adam_epsilon`` are Adam's, so SGD, Lion and
      AdEMAMix keep their own defaults (Lion's betas mean something else). ``kwargs`` (e.g.
      ``state_format``, ``momentum``) override them.
    - ``overrides`` (default: embeddings keep fp32 state, as bitsandbytes does under Trainer) are
      per-module group options, see ``param_groups_by_module``.
    - Biases and norm weights (parameters of fewer than 2 dims) get no weight decay, as in
      Trainer's default groups for transformer models (an optimizer whose constructor takes no
      ``weight_decay``, by name or through ``**kwargs``, gets none of it). Frozen parameters are left out.
    - ``step_in_backward=True`` is refused where Trainer would act on gradients after backward:
      gradient accumulation (Trainer runs several backward passes per step without telling the
      optimizer) and its clipping (``args.max_grad_norm``; pass ``max_grad_norm`` here instead).
    """
    if args is not None and kwargs.get("step_in_backward"):
        _check_step_in_backward(args)
    parameters = inspect.signature(optimizer_cls).parameters  # **kwargs passes it on (a subclass of AdamW)
    takes_decay = "weight_decay" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if args is not None:
        from_args = {"lr": args.learning_rate, **({"weight_decay": args.weight_decay} if takes_decay else {})}
        if issubclass(optimizer_cls, Adam):
            from_args.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
        kwargs = {**from_args, **kwargs}
    overrides = {nn.Embedding: "fp32"} if overrides is None else overrides
    params = []
    for group in param_groups_by_module(model, overrides):
        trainable = [p for p in group.pop("params") if p.requires_grad]
        for decay in (True, False):
            chosen = [p for p in trainable if (p.dim() >= 2) == decay]
            if chosen:
                params.append({**group, "params": chosen, **({} if decay or not takes_decay else {"weight_decay": 0.0})})
    return optimizer_cls, {**kwargs, "params": params}


def _check_step_in_backward(args) -> None:
    if args.gradient_accumulation_steps > 1:
        raise ValueError(
            f"step_in_backward=True steps at every backward, and Trainer runs gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps} backward passes per step: set gradient_accumulation_steps=1 (use a "
            "larger per-device batch), or step after backward"
        )
    if args.max_grad_norm:
        raise ValueError(
            f"Trainer clips gradients after backward (max_grad_norm={args.max_grad_norm}), when step_in_backward=True "
            "has already used and freed them: set TrainingArguments(max_grad_norm=0) and pass max_grad_norm=... to "
            "optimizer_cls_and_kwargs instead (it clips in backward)"
        )
