"""Hugging Face Trainer: ``optimizer_cls_and_kwargs`` for a lowbit_optim optimizer.

Imports nothing from transformers: for ``Trainer(optimizer_cls_and_kwargs=(cls, kwargs))``, Trainer
calls ``cls(params, **kwargs)`` with its own param groups, or with ``kwargs.pop("params")`` if given.
"""

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
      Trainer's default groups for transformer models. Frozen parameters are left out.
    """
    if args is not None:
        from_args = {"lr": args.learning_rate, "weight_decay": args.weight_decay}
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
                params.append({**group, "params": chosen, **({} if decay else {"weight_decay": 0.0})})
    return optimizer_cls, {**kwargs, "params": params}
