"""torch.optim.Optimizer subclasses: param groups, state creation, format choice, the compiled step."""

import fnmatch

import torch
from torch import Tensor, nn

from . import formats, fused_cpu, precision, step_op
from .functional import adam_step
from .state import StateTensor, check_block_size, describe_tensor
from .distributed import is_dtensor, like_param, local, map_local, shard_like

# One compiled step shared by every optimizer and format. Shapes are dynamic, so the number of
# graphs depends on the formats and flags in use, never on the number of distinct parameter shapes.
_compiled_adam_step = torch.compile(adam_step, fullgraph=True, dynamic=True)

# Per format x param dtype x flag combination there is one graph; more than dynamo's default limit
# of 8 per function is normal here and must not silently fall back to eager.
_RECOMPILE_LIMIT = 256

# group keys fixed by the optimizer's construction: a loaded checkpoint must not change them
_STRUCTURAL_KEYS = (
    "state_format", "block_size", "min_quantize_numel", "param_update", "compensation_format",
    "decoupled_weight_decay", "foreach", "capturable", "differentiable", "fused",
)  # fmt: skip

# state name -> whether its values can be negative (picks the signed or unsigned codebook)
_SIGNED = {"exp_avg": True, "exp_avg_sq": False, "max_exp_avg_sq": False, "compensation": True}


class Adam(torch.optim.Optimizer):
    """Adam with optimizer state in any registered format (``state_format="8bit"``, ``"4bit"``,
    ``"fp8"``, ``"bf16"``, ``"fp32"`` or an OptimState subclass), settable per param group. A dict
    ``{"exp_avg": ..., "exp_avg_sq": ...}`` chooses per moment (amsgrad's max follows exp_avg_sq).

    Parameters with fewer than ``min_quantize_numel`` elements keep fp32 state; every larger one is
    quantized, padded to whole blocks. The choice depends only on the parameter's full shape.

    ``param_update`` sets how updates land in bf16 parameters: "nearest", "stochastic", "kahan"
    (compensation buffer in ``compensation_format``: "bf16", "fp32" or any state format) or
    "int8-correction" (bf16 + int8 = 24-bit master weights); see precision.py.
    ``bf16_stochastic_round=True`` is torchao's spelling of ``param_update="stochastic"``.
    ``compile=False`` runs the same step function eagerly (slow; for debugging).

    ``fused`` (as in torch.optim): on the CPU the default (None) steps every parameter it can in
    one call of the fused C kernel (fused_cpu.py; same numbers as the compiled step, in one pass
    over memory) and the rest with the compiled step; True requires the kernel for every
    parameter (an error says why one cannot use it); False always uses the compiled step.

    torch.optim's other keywords are accepted so that code written for it runs unchanged:
    ``decoupled_weight_decay=True`` makes Adam AdamW (as in torch >= 2.7); ``foreach`` only picks
    torch's implementation, never its numbers, so any value is accepted and ignored; ``capturable``
    and ``differentiable`` must stay False (an error says so).
    """

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
        state_format="fp32",
        block_size: int | None = None,
        min_quantize_numel: int = 4096,
        param_update: str = "nearest",
        compensation_format="bf16",
        bf16_stochastic_round: bool = False,
        compile: bool = True,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        decoupled_weight_decay: bool | None = None,
    ):
        if decoupled_weight_decay is None:
            decoupled_weight_decay = self.default_decoupled_weight_decay
        elif self.default_decoupled_weight_decay and not decoupled_weight_decay:
            raise ValueError(f"{type(self).__name__} always decouples weight decay; use lowbit_optim.Adam for L2 regularization")
        if weight_decay is None:
            weight_decay = self.default_weight_decay
        if bf16_stochastic_round:
            if param_update not in ("nearest", "stochastic"):
                raise ValueError(f"bf16_stochastic_round=True contradicts param_update={param_update!r}; pass one of them")
            param_update = "stochastic"
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            state_format=state_format,
            block_size=block_size,
            min_quantize_numel=min_quantize_numel,
            param_update=param_update,
            compensation_format=compensation_format,
            decoupled_weight_decay=bool(decoupled_weight_decay),
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused if compile else False,
        )
        _check_torch_keywords(fused, foreach, capturable, differentiable)
        if fused and not compile:
            raise ValueError("fused=True contradicts compile=False (the eager reference step); pass one of them")
        self._compile = compile
        self._step_op_key = step_op.register(self)
        super().__init__(params, defaults)

    @property
    def _groups(self) -> list[dict]:
        return self.__dict__["param_groups"]

    @property
    def _step_fn(self):
        return _compiled_adam_step if self._compile else adam_step

    # ---- copies ---------------------------------------------------------------------------------

    def __getstate__(self) -> dict:
        # torch.optim pickles only defaults, state and param groups; deepcopy and pickle need the rest
        return {**super().__getstate__(), "_compile": self._compile}

    # ---- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        # a group that names its own formats inherits the constructor's block_size without using it
        block_size_given = "block_size" in param_group or "state_format" not in param_group
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _check_hyperparameters(group)
        if group.pop("bf16_stochastic_round", False):  # torchao's per-group spelling
            group["param_update"] = "stochastic"
        precision.check_param_update(group["param_update"])
        # names keep state_dict() loadable with torch.load(weights_only=True)
        group["state_format"] = _format_names(group["state_format"])
        group["compensation_format"] = formats.get_format(group["compensation_format"]).name
        used = {**_moment_formats(group), "compensation": group["compensation_format"]}
        for state_name, name in used.items():
            fmt = formats.get_format(name)
            if formats.is_quantized(fmt):
                fmt.check_signed(_SIGNED[state_name])
            if group["block_size"] is not None and formats.is_blockwise(fmt):
                check_block_size(group["block_size"], fmt.bits)
        if group["param_update"] != "kahan":
            del used["compensation"]
        if block_size_given and group["block_size"] is not None and not any(formats.is_blockwise(formats.get_format(n)) for n in used.values()):
            raise ValueError(
                f"block_size={group['block_size']} applies to blockwise state formats (8bit, 4bit, fp8, ...), but "
                f"state_format {group['state_format']!r} has no blocks: drop block_size or pick a blockwise format"
            )
        for p in group["params"]:
            if p.is_complex():
                raise TypeError(
                    "lowbit_optim does not support complex parameters; optimize torch.view_as_real(p) "
                    "as a real parameter instead, or use torch.optim.Adam"
                )
            if not p.is_floating_point():
                raise TypeError(f"parameters must be floating point, got {p.dtype}")
            if p.dtype == torch.float64:
                raise TypeError(
                    "float64 parameters are not supported: lowbit_optim computes the step in float32 and would "
                    "round them. Convert the model to float32 (model.float()) or use torch.optim.AdamW for float64"
                )

    def __setstate__(self, state):
        state.setdefault("_compile", self.__dict__.get("_compile", True))
        super().__setstate__(state)
        if "_step_op_key" not in self.__dict__:  # a copy (not load_state_dict) is an optimizer of its own
            self._step_op_key = step_op.register(self)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    # ---- state ------------------------------------------------------------------------------------

    def state_format_of(self, param: Tensor, group: dict, state_name: str = "exp_avg"):
        """The format this optimizer stores ``param``'s state ``state_name`` in (fp32 for small
        tensors): a moment, or "compensation" for the Kahan buffer."""
        name = group["compensation_format"] if state_name == "compensation" else _moment_formats(group)[state_name]
        fmt = formats.get_format(name)
        if formats.is_quantized(fmt) and param.numel() < group["min_quantize_numel"]:
            return formats.FP32
        return fmt

    def _block_size(self, fmt, group: dict) -> int | None:
        if not formats.is_blockwise(fmt):
            return None
        return group["block_size"] or fmt.default_block_size

    def _init_state(self, param: Tensor, group: dict, state: dict) -> None:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)  # never the default dtype: bf16 stops counting at 256
        for name in self._state_names(param, group):
            state[name] = self._new_state(param, group, name)

    def _new_state(self, param: Tensor, group: dict, name: str) -> Tensor:
        # a DTensor (FSDP2) parameter gets a DTensor state holding the state of its local shard
        shard = local(param)
        if name == "param_correction":
            return like_param(torch.zeros(shard.shape, dtype=torch.int8, device=shard.device), param)
        fmt = self.state_format_of(param, group, name)  # decided by the global shape
        state = fmt.zeros(shard.shape, _SIGNED[name], self._block_size(fmt, group), device=shard.device, dtype=param.dtype)
        return like_param(state, param)

    def _state_names(self, param: Tensor, group: dict) -> list[str]:
        """The tensor states ``param`` has under ``group``'s options (besides "step")."""
        names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if group["amsgrad"] else [])
        extra = precision.extra_state_name(_param_update(param, group))
        return names + ([extra] if extra else [])

    @torch.no_grad()
    def step(self, closure=None):
        if torch.compiler.is_compiling():  # inside the user's torch.compile: one opaque op (step_op.py)
            # the groups' lists read through another name: dynamo guards on every value of
            # self.param_groups (a new graph for each lr), not on what is read through an alias
            params = [p for group in self._groups for p in group["params"]]
            if closure is None and not any(is_dtensor(p) for p in params):
                return step_op.step(self._step_op_key, params)
            return _step_outside_graph(self, closure)  # a closure runs backward: a graph break either way
        return self._step_eagerly(closure)

    def _step_eagerly(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_params(*step_op.with_grads([p for group in self.param_groups for p in group["params"]]))
        return loss

    def _step_params(self, params: list[Tensor], grads: list[Tensor]) -> None:
        """Step ``params`` (every parameter that has a gradient, in param-group order, or the
        tensors the step op was given for them) with ``grads``."""
        stepped = [[p for p in group["params"] if p.grad is not None] for group in self.param_groups]
        if [p.shape for ps in stepped for p in ps] != [p.shape for p in params]:
            raise RuntimeError(
                "the parameters of this optimizer changed after a torch.compile'd function that calls its step() "
                "was compiled; add parameters with add_param_group(), not by editing param_groups"
            )
        given = iter(zip(params, grads))
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            for group, ps in zip(self.param_groups, stepped):
                self._step_group(group, [(p, *next(given)) for p in ps])

    def _step_group(self, group: dict, items: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        """Step each (parameter, its tensor to update, gradient) of ``group``."""
        hyper = None
        fused = []  # what the fused CPU kernel steps, all in one call at the end
        for p, tensor, grad in items:
            _check_grad_shape(p, grad)
            if grad.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients; use torch.optim.SparseAdam")
            state = self.state[p]
            if not state:
                self._init_state(p, group, state)
            param = local(tensor.detach())  # the step runs on local shards: one compiled graph with or without FSDP2
            if param.numel() == 0:  # an empty shard (more ranks than rows) has nothing to update
                state["step"].add_(1)
                continue
            mode = _param_update(p, group)
            moments = [local(state["exp_avg"]), local(state["exp_avg_sq"])]
            moments.append(local(state["max_exp_avg_sq"]) if group["amsgrad"] else None)
            if self._use_fused(p, group["fused"], param, local(grad), state["step"], moments, mode):
                fused.append((param, local(grad), state["step"], *moments))
                continue
            if hyper is None:  # once per group and step: a changed lr / beta / eps never recompiles
                hyper = _hyperparameter_tensors(group, p.device)
            flat = _flat(param)
            extra = precision.extra_state_name(mode)
            self._step_fn(
                flat,
                _flat(grad),
                state["step"],
                *(_flat(m) if m is not None else None for m in moments),
                _flat(state[extra]) if extra else None,
                *hyper,
                decoupled_weight_decay=group["decoupled_weight_decay"],
                maximize=group["maximize"],
                param_update=mode,
            )
            if not param.is_contiguous():
                param.copy_(flat.view(param.shape))  # the step updated a contiguous copy: write it back
        if fused:
            fused_cpu.adam_step(fused, group)

    def _use_fused(self, p: Tensor, fused: bool | None, param: Tensor, grad: Tensor, step: Tensor, moments: list, mode: str) -> bool:
        if fused is False or (fused is None and param.device.type != "cpu"):
            return False
        states = {name: m for name, m in zip(("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), moments) if m is not None}
        reason = fused_cpu.unsupported_reason(param, grad, step, states, mode)
        if reason is not None and fused:
            raise RuntimeError(
                f"fused=True, but the fused CPU kernel cannot step a parameter of shape {tuple(p.shape)}: {reason}. "
                "Pass fused=None to step such parameters with the compiled step."
            )
        return reason is None

    # ---- checkpoints ----------------------------------------------------------------------------

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint of this or any other format (or of torch.optim.Adam/AdamW): states are
        converted to this optimizer's formats; a checkpoint of the same format resumes bit-exactly."""
        if not isinstance(state_dict, dict) or not {"state", "param_groups"} <= state_dict.keys():
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(
                f"not an optimizer state dict: it needs the keys 'state' and 'param_groups', got {found}. "
                "Pass what optimizer.state_dict() returned (not model.state_dict())"
            )
        structural = [{k: g[k] for k in _STRUCTURAL_KEYS} for g in self.param_groups]
        saved = {}

        def keep_saved_tensors(optimizer, loaded: dict) -> None:
            # torch.optim casts floating-point states to their parameter's dtype (an fp32 state of a
            # bf16 parameter would come back rounded): remember them as saved, after the user's hooks
            ids = (i for g in loaded["param_groups"] for i in g["params"])
            params = (p for g in self.param_groups for p in g["params"])
            saved.update({p: loaded["state"][i] for i, p in zip(ids, params) if i in loaded["state"]})

        def convert(optimizer) -> None:  # before the user's post-hooks: they see converted states
            for group, keep in zip(self.param_groups, structural):
                group.update(keep)
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                for i, p in enumerate(group["params"]):
                    if p in self.state:
                        self.state[p].update({k: v for k, v in saved.get(p, {}).items() if isinstance(v, Tensor)})
                        self._convert_loaded_state(p, group, self.state[p], i)

        hooks = [self.register_load_state_dict_pre_hook(keep_saved_tensors), self.register_load_state_dict_post_hook(convert, prepend=True)]
        try:
            super().load_state_dict(state_dict)
        finally:
            for hook in hooks:
                hook.remove()

    def _convert_loaded_state(self, param: Tensor, group: dict, state: dict, index: int) -> None:
        expected = {"step", "exp_avg", "exp_avg_sq"} | ({"max_exp_avg_sq"} if group["amsgrad"] else set())
        missing = expected - state.keys()
        if missing:
            raise ValueError(
                f"checkpoint state of parameter {index} (shape {tuple(param.shape)}) lacks {sorted(missing)}: it is "
                f"not a checkpoint of Adam/AdamW{' with amsgrad=True' if group['amsgrad'] else ''}"
            )
        names = self._state_names(param, group)
        for name in list(state):
            if name != "step" and name not in names:
                del state[name]  # e.g. a Kahan buffer this optimizer does not use
        for name in names:
            value = state.get(name)
            if value is None:  # a precision buffer the checkpoint did not have: start from zero error
                state[name] = self._new_state(param, group, name)
                continue
            _check_loaded_state(name, value, param, index)
            value = shard_like(value, param)  # a full (unsharded) checkpoint value for a DTensor parameter
            if name != "param_correction":
                fmt = self.state_format_of(param, group, name)
                block_size = self._block_size(fmt, group)
                value = map_local(lambda v: formats.convert(fmt, v, _SIGNED[name], block_size), value)
            state[name] = value.to(param.device)
        step = state["step"]
        if isinstance(step, bool) or not (isinstance(step, (int, float)) or isinstance(step, Tensor) and step.numel() == 1):
            raise ValueError(
                f"checkpoint state 'step' of parameter {index} (shape {tuple(param.shape)}) is {describe_tensor(step)}: "
                "it must be a number or a one-element tensor"
            )
        state["step"] = torch.as_tensor(step, dtype=torch.float32).detach().clone().cpu()


@torch.compiler.disable
@torch.no_grad()
def _step_outside_graph(optimizer: Adam, closure):
    return optimizer._step_eagerly(closure)


class AdamW(Adam):
    """AdamW (decoupled weight decay, default 1e-2) with optimizer state in any registered format."""

    default_weight_decay = 1e-2
    default_decoupled_weight_decay = True


class AnyPrecisionAdamW(AdamW):
    """torchdistx's AnyPrecisionAdamW arguments on lowbit_optim's AdamW, so migrating is an import change.

    ``momentum_dtype`` / ``variance_dtype`` / ``compensation_buffer_dtype`` take torch dtypes
    (float32, bfloat16) or any registered state format name ("8bit", "4bit", ...).
    ``use_kahan_summation`` applies to bf16 parameters (fp32 ones need no compensation).
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        use_kahan_summation: bool = False,
        momentum_dtype=torch.float32,
        variance_dtype=torch.float32,
        compensation_buffer_dtype=torch.bfloat16,
        **kwargs,
    ):
        super().__init__(
            params, lr, betas, eps, weight_decay,
            state_format={"exp_avg": _dtype_format(momentum_dtype), "exp_avg_sq": _dtype_format(variance_dtype)},
            param_update="kahan" if use_kahan_summation else "nearest",
            compensation_format=_dtype_format(compensation_buffer_dtype),
            **kwargs,
        )  # fmt: skip


def _dtype_format(dtype) -> str:
    plain = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if isinstance(dtype, torch.dtype):
        if dtype not in plain:
            raise ValueError(f"unsupported state dtype {dtype}; use torch.float32, torch.bfloat16 or a format name such as '8bit'")
        return plain[dtype]
    return formats.get_format(dtype).name


def _check_torch_keywords(fused, foreach, capturable: bool, differentiable: bool) -> None:
    """torch.optim's keywords at the values that mean something here (see Adam's docstring)."""
    for name, value in (("fused", fused), ("foreach", foreach)):
        if value not in (None, True, False):
            raise ValueError(f"{name} must be None, True or False, got {value!r}")
    if capturable:
        raise ValueError(
            "capturable=True (CUDA-graph capture of the step) is not supported: lowbit_optim keeps the step "
            "counter on the CPU. Pass capturable=False"
        )
    if differentiable:
        raise ValueError(
            "differentiable=True is not supported: quantized states cannot carry gradients through the step. "
            "Pass differentiable=False, or use torch.optim for a differentiable optimizer"
        )


def _check_hyperparameters(group: dict) -> None:
    betas = group["betas"]
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise ValueError(f"invalid betas {betas!r}: Adam takes two, (beta1, beta2), e.g. (0.9, 0.999)")
    lr, (beta1, beta2), eps, wd = group["lr"], betas, group["eps"], group["weight_decay"]
    lr_value = float(lr) if isinstance(lr, Tensor) and lr.numel() == 1 else lr
    if not isinstance(lr_value, (int, float)) or not lr_value >= 0:
        raise ValueError(f"invalid learning rate {lr!r}: lr must be a number >= 0")
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"invalid betas {group['betas']!r}: each beta must be in [0, 1)")
    if not eps >= 0.0:
        raise ValueError(f"invalid eps {eps!r}: eps must be >= 0")
    if not wd >= 0.0:
        raise ValueError(f"invalid weight_decay {wd!r}: weight_decay must be >= 0")
    if not isinstance(group["min_quantize_numel"], int) or group["min_quantize_numel"] < 0:
        raise ValueError(f"invalid min_quantize_numel {group['min_quantize_numel']!r}: use an int >= 0")


def _format_names(spec):
    """A format spec as registry names: one name, or {"exp_avg": name, "exp_avg_sq": name}."""
    if not isinstance(spec, dict):
        return formats.get_format(spec).name
    if set(spec) != {"exp_avg", "exp_avg_sq"}:
        raise ValueError(f"a per-moment state_format needs exactly the keys 'exp_avg' and 'exp_avg_sq', got {sorted(spec)}")
    return {k: formats.get_format(v).name for k, v in spec.items()}


def _moment_formats(group: dict) -> dict:
    spec = group["state_format"]
    exp_avg, exp_avg_sq = (spec["exp_avg"], spec["exp_avg_sq"]) if isinstance(spec, dict) else (spec, spec)
    return {"exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "max_exp_avg_sq": exp_avg_sq}


def _param_update(param: Tensor, group: dict) -> str:
    # the rounding modes exist for bf16 weights; an fp32 weight takes the fp32 result as it is
    return group["param_update"] if param.dtype == torch.bfloat16 else "nearest"


def _check_grad_shape(param: Tensor, grad: Tensor) -> None:
    # autograd checks p.grad's shape, but not a tensor assigned to p.grad.data; the steps read grad as param's
    if grad.shape != param.shape:
        raise RuntimeError(
            f"the gradient of a parameter of shape {tuple(param.shape)} has shape {tuple(grad.shape)}; it was "
            "probably set through .data. Assign p.grad a tensor of the parameter's shape"
        )


def _check_loaded_state(name: str, value, param: Tensor, index: int) -> None:
    """Raise a ValueError naming the parameter if checkpoint state ``name`` cannot be ``param``'s: a
    corrupt quantized state would make the fused kernel read and write past its buffers."""
    where = f"checkpoint state {name!r} of parameter {index} (shape {tuple(param.shape)})"
    if not isinstance(value, Tensor):
        raise ValueError(f"{where} is {describe_tensor(value)}, not a tensor")
    if value.shape != param.shape:
        raise ValueError(
            f"checkpoint state {name!r} of parameter {index} has shape {tuple(value.shape)} but the "
            f"parameter has shape {tuple(param.shape)}: the checkpoint belongs to another model"
        )
    floating = name != "param_correction"  # int8-correction's rounding errors are int8
    if value.is_floating_point() != floating:
        raise ValueError(f"{where} has dtype {value.dtype}, not a {'floating-point' if floating else 'integer'} dtype")
    if isinstance(local(value), StateTensor):
        try:
            local(value).check_layout()
        except ValueError as error:
            raise ValueError(f"{where} is corrupt: {error}") from None


def _hyperparameter_tensors(group: dict, device) -> list[Tensor]:
    beta1, beta2 = group["betas"]
    values = (group["lr"], beta1, beta2, group["weight_decay"], group["eps"], 1 - beta1, 1 - beta2)
    return [torch.as_tensor(v, dtype=torch.float32).to(device) for v in values]


def _flat(t: Tensor) -> Tensor:
    t = local(t)
    if isinstance(t, StateTensor):
        # a new wrapper over the same inner tensors, not an aten.view: dynamo cannot trace a subclass view
        return t._like(shape=(t.numel(),))
    # detached: a view keeps its base, whose shape dynamo would guard on (a new graph per rank or size-1 dim)
    return t.view(-1).detach() if t.is_contiguous() else t.reshape(-1)


# ------------------------------------------------------------------------------------------------
# Migration aliases: torchao's class names and signatures
# ------------------------------------------------------------------------------------------------


def _fixed_format_alias(base: type, state_format: str, name: str) -> type:
    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=base.default_weight_decay,
        amsgrad=False,
        *,
        block_size=None,
        bf16_stochastic_round=False,
    ):
        base.__init__(
            self, params, lr, betas, eps, weight_decay, amsgrad,
            state_format=state_format, block_size=block_size, bf16_stochastic_round=bf16_stochastic_round,
        )  # fmt: skip

    doc = f"{base.__name__} with {state_format} state; same signature as torchao.optim.{name}."
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": __name__})


Adam8bit = _fixed_format_alias(Adam, "8bit", "Adam8bit")
AdamW8bit = _fixed_format_alias(AdamW, "8bit", "AdamW8bit")
# the 4-bit aliases take lowbit_optim's 4-bit recipe; state_format="4bit-torchao" is torchao's numerics
Adam4bit = _fixed_format_alias(Adam, "4bit", "Adam4bit")
AdamW4bit = _fixed_format_alias(AdamW, "4bit", "AdamW4bit")
AdamFp8 = _fixed_format_alias(Adam, "fp8", "AdamFp8")
AdamWFp8 = _fixed_format_alias(AdamW, "fp8", "AdamWFp8")


# ------------------------------------------------------------------------------------------------
# Per-module overrides
# ------------------------------------------------------------------------------------------------


def param_groups_by_module(model: nn.Module, overrides: dict, **group_defaults) -> list[dict]:
    """Split ``model``'s parameters into param groups by module, e.g. to keep embeddings in fp32::

        groups = param_groups_by_module(model, {nn.Embedding: {"state_format": "fp32"}})
        opt = AdamW(groups, state_format="8bit")

    ``overrides`` maps a module type or a glob over qualified module names (``"lm_head"``,
    ``"blocks.*.attn"``) to group options. The first matching key wins; a parameter shared by several
    modules (tied weights) goes to the group of the first module that holds it. Parameters matched by
    no key form the first group, with ``group_defaults``. Values may also be a bare format name.
    """
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
    checkpoints themselves and need no such step)."""
    state = {
        key: {name: (v.dequantize(torch.float32) if isinstance(v, StateTensor) else v) for name, v in s.items()}
        for key, s in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def bytes_per_param(optimizer: torch.optim.Optimizer) -> float:
    """Bytes of optimizer state (moments, scales, step counters) per parameter element (with FSDP2:
    this rank's states per element of its shards)."""
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
    "Adam",
    "AnyPrecisionAdamW",
    "AdamW",
    "Adam8bit",
    "AdamW8bit",
    "Adam4bit",
    "AdamW4bit",
    "AdamFp8",
    "AdamWFp8",
    "bytes_per_param",
    "dequantize_state_dict",
    "param_groups_by_module",
]
