"""The optimizers: Adam, AdamW, SGD, Lion, AdEMAMix and Muon, each a step function (functional.py) and a
declaration of its states and hyper-parameters on LowBitOptimizer (base.py), which gives every one
of them every state format, param_update mode, checkpoint conversion, FSDP2 and compiled stepping.
Also the helpers for param groups by module, dequantized checkpoints and state memory.
"""

import fnmatch
from collections.abc import Mapping

import torch
from torch import Tensor, nn

from . import functional, fused_cpu, muon_fsdp
from .base import SCRATCH_ELEMENTS, LowBitOptimizer, State, check_betas, check_nonnegative, element_runs, sequence_given
from .distributed import is_dtensor, local, map_local
from .muon_parts import MuonParts
from .state import StateTensor


class Adam(LowBitOptimizer):
    """Adam (torch.optim.Adam's arguments and numbers) with its moments in any registered format. A
    ``state_format`` dict ``{"exp_avg": ..., "exp_avg_sq": ...}`` chooses per moment (amsgrad's
    ``max_exp_avg_sq`` follows ``exp_avg_sq``). On the CPU the fused kernel steps it (``fused``).

    ``decoupled_weight_decay=True`` makes Adam AdamW (as in torch >= 2.7). Every other option is
    LowBitOptimizer's (state formats, ``min_quantize_numel``, ``param_update``, ``compile``, ...).
    """

    step_function = staticmethod(functional.adam_step)
    elementwise_step = True
    states = (
        State("exp_avg", signed=True, decay=lambda group: group["betas"][0]),
        State("exp_avg_sq", signed=False, decay=lambda group: group["betas"][1]),
        State("max_exp_avg_sq", signed=False, when="amsgrad", follows="exp_avg_sq", running_max=True),
    )
    family = "Adam/AdamW"
    torch_name = "Adam"
    default_weight_decay = 0.0
    default_decoupled_weight_decay = False

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float | None = None,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        decoupled_weight_decay: bool | None = None,
        **options,
    ):
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self.default_decoupled_weight_decay
        elif self.default_decoupled_weight_decay and not decoupled_weight_decay:
            raise ValueError(f"{type(self).__name__} always decouples weight decay; use lowbit_optim.Adam for L2 regularization")
        if weight_decay is None:
            weight_decay = self.default_weight_decay
        hyperparameters = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
            decoupled_weight_decay=bool(decoupled_weight_decay),
        )  # fmt: skip
        super().__init__(params, hyperparameters, **options)

    def _check_group(self, group: dict) -> None:
        check_betas(group["betas"], "Adam", (0.9, 0.999), bias_corrected=2)
        check_nonnegative(group, "eps", "weight_decay")

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        beta1, beta2 = group["betas"]
        numbers = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"], 1 - beta1, 1 - beta2)
        return numbers, dict(decoupled_weight_decay=group["decoupled_weight_decay"], maximize=group["maximize"])

    def _fused_step(self, items: list[tuple], group: dict, corrections: list) -> None:
        fused_cpu.adam_step(items, group, corrections)


class AdamW(Adam):
    """AdamW (decoupled weight decay, default 1e-2) with its moments in any registered format."""

    torch_name = "AdamW"
    default_weight_decay = 1e-2
    default_decoupled_weight_decay = True
    _structural_keys = ("decoupled_weight_decay",)  # an Adam checkpoint does not make it L2 (Adam takes the saved flag, as torch's)


class SGD(LowBitOptimizer):
    """torch.optim.SGD (momentum, dampening, Nesterov, L2 weight decay, maximize) with its momentum
    buffer in any registered format; without momentum there is no state at all. As in torch.optim,
    the first step stores the gradient itself in the buffer. For 8-bit momentum use
    ``state_format="8bit-linear"`` (formats.OptimState8bitLinear)."""

    step_function = staticmethod(functional.sgd_step)
    elementwise_step = True
    states = (State("momentum_buffer", signed=True, when="momentum", decay=lambda group: group["momentum"]),)
    torch_name = "SGD"
    _step_when_missing = 1.0  # torch.optim.SGD checkpoints count no steps; a buffer means one was taken

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        **options,
    ):
        hyperparameters = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, hyperparameters, **options)

    def _check_group(self, group: dict) -> None:
        check_nonnegative(group, "momentum", "weight_decay")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError(
                f"nesterov=True needs momentum > 0 and dampening=0, got momentum={group['momentum']!r} and "
                f"dampening={group['dampening']!r}"
            )

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        numbers = (group["lr"], group["momentum"], group["weight_decay"], 1 - group["dampening"])
        return numbers, dict(nesterov=group["nesterov"], maximize=group["maximize"])

    def _fused_step(self, items: list[tuple], group: dict, corrections: list) -> None:
        fused_cpu.sgd_step(items, group, corrections)


class Lion(LowBitOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms") with its momentum in
    any registered format: the update is lr times the sign of ``beta1 * m + (1 - beta1) * g``, then
    ``m`` moves to ``beta2 * m + (1 - beta2) * g``; weight decay is decoupled (as bitsandbytes').
    For 8-bit momentum use ``state_format="8bit-linear"`` (formats.OptimState8bitLinear), with
    ``block_size=32`` to stay within 0.5 % of fp32 momentum on the MLP task (README)."""

    step_function = staticmethod(functional.lion_step)
    elementwise_step = True
    states = (State("exp_avg", signed=True, decay=lambda group: group["betas"][1]),)  # m = beta2 * m + (1 - beta2) * g
    _step_when_missing = 1.0  # lion-pytorch's checkpoints count no steps (Lion's update uses none)

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-4,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 0.0,
        *,
        maximize: bool = False,
        **options,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize), **options)

    def _check_group(self, group: dict) -> None:
        check_betas(group["betas"], "Lion", (0.9, 0.99))
        check_nonnegative(group, "weight_decay")

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        beta1, beta2 = group["betas"]
        return (group["lr"], group["weight_decay"], 1 - beta1, 1 - beta2), dict(maximize=group["maximize"])

    def _fused_step(self, items: list[tuple], group: dict, corrections: list) -> None:
        fused_cpu.lion_step(items, group, corrections)


class Muon(LowBitOptimizer):
    """Muon (Jordan et al. 2024) with torch.optim.Muon's arguments and numbers, its momentum buffer in
    any registered format: the momentum (Nesterov's look-ahead by default) of each 2-D weight is
    orthogonalized by ``ns_steps`` Newton-Schulz iterations in bf16, then applied with decoupled
    weight decay and an lr scaled by the matrix's shape (``adjust_lr_fn``: None or "original",
    sqrt(max(1, rows / cols)); "match_rms_adamw", 0.2 * sqrt(max(rows, cols))).

    Like torch.optim.Muon it steps matrices only: give embeddings, the output head, biases and norms
    to AdamW (``MuonWithAdamW`` does both in one object, ``muon_split`` splits a model). Under FSDP2
    each matrix's update is gathered to one rank, orthogonalized once and scattered back
    (muon_fsdp.py). On the CPU its momentum takes the fused kernel, the iterations the compiled step
    (``_fused_step``). For 8-bit momentum use ``state_format="8bit-lowrank"``, for 4-bit
    ``"4bit-lowrank-mulaw"`` (lowrank.py): plain 8- and 4-bit codes lose much of Muon's accuracy.
    """

    step_function = staticmethod(functional.muon_step)
    states = (State("momentum_buffer", signed=True, decay=lambda group: group["momentum"]),)
    torch_name = "Muon"
    _step_when_missing = 1.0  # torch.optim.Muon checkpoints count no steps (Muon's step uses none)
    flat_step = False  # Newton-Schulz needs each matrix's shape
    # plain fp32 / bf16 momentum: the compiled step is as fast by default (benchmarks/default_vs_compiled.py)
    fused_default_needs_codes = True

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (3.4445, -4.775, 2.0315),
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        **options,
    ):
        hyperparameters = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn,
        )  # fmt: skip
        super().__init__(params, hyperparameters, **options)

    def _check_group(self, group: dict) -> None:
        check_nonnegative(group, "weight_decay", "momentum", "eps")
        coefficients, steps = group["ns_coefficients"], group["ns_steps"]
        if not isinstance(coefficients, (tuple, list)) or len(coefficients) != 3 or not all(isinstance(c, (int, float)) for c in coefficients):
            given = "each a Python number" if isinstance(coefficients, (tuple, list)) and len(coefficients) == 3 else sequence_given(coefficients)
            raise ValueError(f"invalid ns_coefficients {coefficients!r}: Muon takes three numbers (a, b, c), e.g. (3.4445, -4.775, 2.0315); {given}")
        group["ns_coefficients"] = tuple(float(c) for c in coefficients)
        if isinstance(steps, bool) or not isinstance(steps, int) or not 0 <= steps < 100:
            raise ValueError(f"invalid ns_steps {steps!r}: an int in [0, 100), e.g. 5")
        functional.check_adjust_lr_fn(group["adjust_lr_fn"])
        for p in group["params"]:
            if is_dtensor(p):
                muon_fsdp.check_sharding(p)
            if p.dim() != 2:
                raise ValueError(
                    f"Muon steps 2-D matrices only (as torch.optim.Muon), got a parameter of shape {tuple(p.shape)}: give "
                    "embeddings, the output head, biases, norms and convolutions to AdamW (lowbit_optim.muon_split splits a model)"
                )

    def _step_group(self, group: dict, items: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        sharded = [item for item in items if is_dtensor(item[0])]
        if sharded:  # FSDP2: the iterations need whole matrices
            muon_fsdp.step(self, group, sharded)
        if len(sharded) < len(items):
            super()._step_group(group, [item for item in items if not is_dtensor(item[0])])

    float64_numbers = (0,)  # lr: scaled by the matrix's shape in float64 and rounded once (functional.muon_step)

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        lr, momentum = group["lr"], group["momentum"]
        lr64 = lr.detach().double() if isinstance(lr, Tensor) else torch.tensor(float(lr), dtype=torch.float64)
        decay = 1 - lr64 * group["weight_decay"]  # float64, rounded once to fp32 as torch's Python float is
        flags = dict(nesterov=group["nesterov"], ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"], adjust_lr_fn=group["adjust_lr_fn"])
        return (lr64, decay.float(), momentum, 1 - momentum, group["eps"]), flags

    def _fused_step(self, items: list[tuple], group: dict, corrections: list) -> None:
        """The momentum of every (param, grad, step, momentum_buffer) in the fused CPU kernel, written
        in bf16 (the rounding the iterations start with: the same numbers), then each matrix's
        iterations and apply, in one compiled call (muon_parts.py). In runs of at most
        SCRATCH_ELEMENTS elements (a larger matrix alone): the bf16 momenta in flight were the whole
        group's, 2 bytes a parameter."""
        (lr, decay, _, _, eps), flags = self._tensor_arguments(group, torch.device("cpu"))
        parts = MuonParts(self._compile)
        finish_flags = {k: flags[k] for k in ("ns_coefficients", "ns_steps", "adjust_lr_fn")}  # nesterov was the momentum's
        for run in element_runs(list(zip(items, corrections)), [item[0].numel() for item in items], SCRATCH_ELEMENTS):
            starts = [torch.empty(item[0].shape, dtype=torch.bfloat16) for item, _ in run]
            fused_cpu.muon_momentum([(start, *item[1:]) for start, (item, _) in zip(starts, run)], group)
            for ((param, *_), correction), start in zip(run, starts):
                mode = "int8-correction" if correction is not None else "nearest"  # the two the kernel's verdict lets through
                parts.finish(param, correction, start, lr, decay, eps, **finish_flags, param_update=mode)


class AdEMAMix(LowBitOptimizer):
    """AdEMAMix (Pagliardini et al. 2024) with bitsandbytes' numbers and arguments (but optim_bits; t_alpha /
    t_beta3 None, not 0, for no warm-up: AdEMAMix8bit takes bitsandbytes' as they are): Adam's moments
    plus a slow first moment ``exp_avg_slow`` (beta3), added to the update with weight ``alpha``;
    decoupled weight decay. ``t_alpha`` / ``t_beta3`` warm alpha and beta3 up over that many steps
    (None: no warm-up). ``state_format`` may be a dict over exp_avg, exp_avg_slow and exp_avg_sq."""

    step_function = staticmethod(functional.ademamix_step)
    elementwise_step = True
    states = (
        State("exp_avg", signed=True, decay=lambda group: group["betas"][0]),
        State("exp_avg_slow", signed=True, decay=lambda group: group["betas"][2]),  # where beta3's warm-up ends
        State("exp_avg_sq", signed=False, decay=lambda group: group["betas"][1]),
    )

    def __init__(
        self,
        params,
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
        alpha: float = 5.0,
        t_alpha: int | None = None,
        t_beta3: int | None = None,
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        maximize: bool = False,
        **options,
    ):
        hyperparameters = dict(
            lr=lr, betas=betas, alpha=alpha, t_alpha=t_alpha, t_beta3=t_beta3, eps=eps, weight_decay=weight_decay, maximize=maximize
        )
        super().__init__(params, hyperparameters, **options)

    def _check_group(self, group: dict) -> None:
        check_betas(group["betas"], "AdEMAMix", (0.9, 0.999, 0.9999), bias_corrected=2)  # beta3: in float64
        check_nonnegative(group, "alpha", "eps", "weight_decay")
        for key in ("t_alpha", "t_beta3"):
            value = group[key]
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
                raise ValueError(f"invalid {key} {value!r}: pass None (no warm-up) or a number of steps > 0")
        beta1, _, beta3 = group["betas"]
        if group["t_beta3"] is not None and not (beta1 > 0 and beta3 > 0):
            raise ValueError(f"t_beta3 warms beta3 up from beta1 in log space: beta1 and beta3 must be > 0, got betas {group['betas']!r}")

    float64_numbers = (7, 8, 9, 10)  # alpha, t_alpha, beta3, t_beta3: the warm-ups in float64 (functional.ademamix_step)

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        beta1, beta2, beta3 = group["betas"]
        t_alpha, t_beta3 = group["t_alpha"], group["t_beta3"]
        exact = [float(v) for v in (group["alpha"], t_alpha or 1, beta3, t_beta3 or 1)]  # (float64_numbers)
        numbers = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"], 1 - beta1, 1 - beta2, *exact)
        return numbers, dict(maximize=group["maximize"], schedule_alpha=t_alpha is not None, schedule_beta3=t_beta3 is not None)

    def _fused_step(self, items: list[tuple], group: dict, corrections: list) -> None:
        fused_cpu.ademamix_step(items, group, corrections)


# ------------------------------------------------------------------------------------------------
# Per-module overrides
# ------------------------------------------------------------------------------------------------


def param_groups_by_module(model: nn.Module, overrides: dict, **group_defaults) -> list[dict]:
    """Split ``model``'s parameters into param groups by module, e.g. to keep embeddings in fp32::

        groups = param_groups_by_module(model, {nn.Embedding: {"state_format": "fp32"}})
        opt = AdamW(groups, state_format="8bit")

    ``overrides`` maps a module type or a glob over qualified module names (``"lm_head"``,
    ``"blocks.*.attn.*"``) to group options. A key matches the module that holds a parameter itself
    (``blocks.0.attn.q_proj`` for its weight, not ``blocks.0.attn``: hence the trailing ``.*``). The
    first matching key wins; a parameter shared by several
    modules (tied weights) goes to the group of the first module that holds it. Parameters matched by
    no key form the first group, with ``group_defaults``. Values may also be a bare format name.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the nn.Module whose modules decide the groups, got {type(model).__name__}: pass the model, not model.parameters()")
    if not isinstance(overrides, Mapping):
        raise TypeError(f"overrides must map module types or name patterns to group options (e.g. {{nn.Embedding: 'fp32'}}), got {type(overrides).__name__}")
    overrides = {k: ({"state_format": v} if isinstance(v, str) or isinstance(v, type) else dict(v)) for k, v in overrides.items()}
    for key in overrides:
        if not isinstance(key, (str, type)):
            raise TypeError(f"override keys must be module types or name patterns, got {key!r}")
    chosen: dict[Tensor, object] = {}
    for module_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if p in chosen:
                continue
            chosen[p] = next(
                (key for key in overrides if (isinstance(key, type) and isinstance(module, key)) or (isinstance(key, str) and fnmatch.fnmatchcase(module_name, key))),
                None,
            )
    groups = [{"params": [p for p, key in chosen.items() if key is None], **group_defaults}]
    for key, options in overrides.items():
        params = [p for p, k in chosen.items() if k is key]
        if params:
            groups.append({"params": params, **group_defaults, **options})
    return [g for g in groups if g["params"]]


def dequantize_state_dict(state_dict: dict) -> dict:
    """A copy of an optimizer state dict with every quantized state replaced by a plain fp32 tensor,
    e.g. to load a lowbit_optim checkpoint into torch.optim.AdamW (lowbit_optim optimizers convert
    checkpoints themselves and need no such step). A MuonWithAdamW state dict gives each part's
    (``{"muon": ..., "adamw": ...}``), for torch.optim.Muon and torch.optim.AdamW."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"dequantize_state_dict takes what optimizer.state_dict() returned, got {type(state_dict).__name__}")
    if set(state_dict) == {"muon", "adamw"}:
        return {part: None if saved is None else dequantize_state_dict(saved) for part, saved in state_dict.items()}
    if "state" not in state_dict:
        raise ValueError(f"not an optimizer state dict (its keys: {sorted(state_dict)}); one has 'state' and 'param_groups'")
    state = {key: {name: map_local(_dequantized, v) for name, v in s.items()} for key, s in state_dict["state"].items()}
    return {**state_dict, "state": state}


def _dequantized(value):
    return value.dequantize(torch.float32) if isinstance(value, StateTensor) else value


def bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state (moments, scales, step counters) per parameter element (with FSDP2:
    this rank's states per element of its shards)."""
    if not (hasattr(optimizer, "state") and hasattr(optimizer, "param_groups")):
        raise TypeError(f"bytes_per_param measures an optimizer's states: pass the optimizer, got {type(optimizer).__name__}")
    storages = {}
    for state in optimizer.state.values():
        for value in state.values():
            value = local(value)
            for t in (value._inner().values() if isinstance(value, StateTensor) else [value]):
                if isinstance(t, Tensor):
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    params = sum(local(p).numel() for g in optimizer.param_groups for p in g["params"] if p in optimizer.state)
    return sum(storages.values()) / max(params, 1)


__all__ = [
    "AdEMAMix",
    "Adam",
    "AdamW",
    "Lion",
    "Muon",
    "SGD",
    "bytes_per_param",
    "dequantize_state_dict",
    "param_groups_by_module",
]
