"""Migration aliases: other libraries' class names and arguments on lowbit_optim's optimizers, so that
switching is an import change: torchao's (Adam8bit ... AdamWFp8), torchdistx's AnyPrecisionAdamW and
bitsandbytes' (AdamW8bit, Adam8bit, SGD8bit, Lion8bit, AdEMAMix8bit). Arguments that mean something
lowbit_optim does not do are accepted at their neutral value and refused, with the reason, otherwise.
"""

import warnings

import torch

from . import formats
from .base import check_element_count, check_flag
from .optim import Adam, AdamW, AdEMAMix, Lion, SGD

# ------------------------------------------------------------------------------------------------
# torchdistx
# ------------------------------------------------------------------------------------------------


class AnyPrecisionAdamW(AdamW):
    """torchdistx's AnyPrecisionAdamW arguments on lowbit_optim's AdamW, so migrating is an import change.

    ``momentum_dtype`` / ``variance_dtype`` / ``compensation_buffer_dtype`` take torch dtypes
    (float32, bfloat16) or any registered state format name ("8bit", "4bit", ...).
    ``use_kahan_summation`` applies to bf16 parameters (fp32 ones need no compensation). A param
    group may set them too, as torchdistx's groups do; they become its ``state_format``,
    ``param_update`` and ``compensation_format``.
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
        variance_dtype=torch.bfloat16,  # torchdistx's defaults: momentum in fp32, variance in bf16
        compensation_buffer_dtype=torch.bfloat16,
        **kwargs,
    ):
        options = _torchdistx_options(use_kahan_summation, momentum_dtype, variance_dtype, compensation_buffer_dtype)
        super().__init__(params, lr, betas, eps, weight_decay, **options, **kwargs)

    _refuses_unused_compensation = False  # torchdistx ignores compensation_buffer_dtype without Kahan summation

    def add_param_group(self, param_group: dict) -> None:
        given = {k: param_group[k] for k in _TORCHDISTX_OPTIONS if k in param_group}
        if given:
            ours = sorted(set(_TORCHDISTX_KEYS_OURS) & param_group.keys())
            if ours:
                raise ValueError(f"a param group sets {sorted(given)} and {ours}, which they become: set one or the other")
            d = self.defaults  # the constructor's options, for those the group leaves out
            built = dict(use_kahan_summation=d["param_update"] == "kahan", momentum_dtype=d["state_format"]["exp_avg"],
                         variance_dtype=d["state_format"]["exp_avg_sq"], compensation_buffer_dtype=d["compensation_format"])  # fmt: skip
            param_group = {k: v for k, v in param_group.items() if k not in given} | _torchdistx_options(**(built | given))
        super().add_param_group(param_group)

    def load_state_dict(self, state_dict: dict) -> None:
        """A checkpoint of this optimizer or of torchdistx's. As for any checkpoint, its states
        convert to this optimizer's settings (a Kahan buffer it does not use is dropped); torchdistx's
        group keys are not kept (they would contradict them), and a warning names a group whose
        keys chose other settings."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if isinstance(groups, list):
            for i, (saved, group) in enumerate(zip(groups, self.param_groups)):
                given = {k: saved[k] for k in _TORCHDISTX_OPTIONS if k in saved} if isinstance(saved, dict) else {}
                names = self._state_format_names(group)  # (a group's state_format may be one name for every state)
                ours = dict(state_format={k: names[k] for k in ("exp_avg", "exp_avg_sq")}, param_update=group["param_update"], compensation_format=group["compensation_format"])
                if len(given) == len(_TORCHDISTX_OPTIONS) and not _same_settings(given, ours):
                    warnings.warn(
                        f"param group {i} of this torchdistx checkpoint has {given}, and this optimizer's {ours}: its "
                        "states load converted to the latter (build the optimizer with the checkpoint's options to resume as it ran)",
                        stacklevel=2,
                    )
            groups = [{k: v for k, v in g.items() if k not in _TORCHDISTX_OPTIONS} if isinstance(g, dict) else g for g in groups]
            state_dict = {**state_dict, "param_groups": groups}
        super().load_state_dict(state_dict)


_TORCHDISTX_OPTIONS = ("use_kahan_summation", "momentum_dtype", "variance_dtype", "compensation_buffer_dtype")
_TORCHDISTX_KEYS_OURS = ("state_format", "param_update", "compensation_format")  # what they become


def _same_settings(given: dict, ours: dict) -> bool:
    """Whether torchdistx's options ``given`` choose our settings ``ours`` (the compensation's only
    with Kahan summation, as torchdistx ignores it otherwise)."""
    try:
        theirs = _torchdistx_options(**given)
    except ValueError:  # a dtype that maps to no format of ours
        return False
    if theirs["param_update"] == ours["param_update"] == "nearest":
        theirs["compensation_format"] = ours["compensation_format"]
    return theirs == ours


def _torchdistx_options(use_kahan_summation, momentum_dtype, variance_dtype, compensation_buffer_dtype) -> dict:
    """torchdistx's options as lowbit_optim's."""
    check_flag("use_kahan_summation", use_kahan_summation)
    return dict(
        state_format={"exp_avg": _dtype_format(momentum_dtype), "exp_avg_sq": _dtype_format(variance_dtype)},
        param_update="kahan" if use_kahan_summation else "nearest",
        compensation_format=_dtype_format(compensation_buffer_dtype),
    )


def _dtype_format(dtype) -> str:
    plain = {torch.float32: "fp32", torch.bfloat16: "bf16"}
    if isinstance(dtype, torch.dtype):
        if dtype not in plain:
            raise ValueError(f"unsupported state dtype {dtype}; use torch.float32, torch.bfloat16 or a format name such as '8bit'")
        return plain[dtype]
    return formats.get_format(dtype).name


# ------------------------------------------------------------------------------------------------
# torchao: class names and signatures
# ------------------------------------------------------------------------------------------------


def _fixed_format_alias(base: type, state_format: str, name: str, whole_blocks_only: bool = False) -> type:
    wd = base.default_weight_decay
    if name in _BITSANDBYTES_NAMES:  # torchao's keywords, and bitsandbytes' arguments of the same class name after amsgrad

        def __init__(
            self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, amsgrad=False, optim_bits=32, args=None, min_8bit_size=4096,
            is_paged=False, *, block_size=None, bf16_stochastic_round=False, percentile_clipping=100, block_wise=True, max_unorm=0.0,
        ):  # fmt: skip
            if optim_bits not in (8, 32):  # bitsandbytes' 8-bit classes ignore it (0.50 takes only 32)
                raise ValueError(f"{name}(optim_bits={optim_bits!r}) is not supported: its states are 8-bit. Leave optim_bits at its default")
            options = _bitsandbytes_options(name, args, min_8bit_size, is_paged, percentile_clipping, block_wise, max_unorm)
            base.__init__(self, params, lr, betas, eps, weight_decay, amsgrad, block_size=block_size, bf16_stochastic_round=bf16_stochastic_round, **options)

    else:

        def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=wd, amsgrad=False, *, block_size=None, bf16_stochastic_round=False):
            base.__init__(
                self, params, lr, betas, eps, weight_decay, amsgrad,
                state_format=state_format, block_size=block_size, bf16_stochastic_round=bf16_stochastic_round,
            )  # fmt: skip

    def add_param_group(self, param_group: dict) -> None:
        base.add_param_group(self, param_group)
        _lr_as_tensors(self.param_groups[-1:])

    def load_state_dict(self, state_dict: dict) -> None:
        base.load_state_dict(self, state_dict)
        _lr_as_tensors(self.param_groups)  # a checkpoint of another optimizer may hold a float

    methods = {"__init__": __init__, "add_param_group": add_param_group, "load_state_dict": load_state_dict}
    for method in methods.values():
        method.__qualname__ = f"{name}.{method.__name__}"  # what a TypeError names
    doc = f"{base.__name__} with {state_format} state; same signature as torchao.optim.{name}"
    doc += f", and bitsandbytes.optim.{name}'s arguments." if name in _BITSANDBYTES_NAMES else "."
    return type(name, (base,), {**methods, "__doc__": doc, "__module__": __name__, "whole_blocks_only": whole_blocks_only})


def _lr_as_tensors(groups: list[dict]) -> None:
    for group in groups:  # as torchao's: its users change lr with .fill_()
        if not isinstance(group["lr"], torch.Tensor):
            group["lr"] = torch.tensor(group["lr"], dtype=torch.float32)


_BITSANDBYTES_NAMES = ("Adam8bit", "AdamW8bit")  # bitsandbytes' class names too: its arguments as well as torchao's
Adam8bit = _fixed_format_alias(Adam, "8bit", "Adam8bit")
AdamW8bit = _fixed_format_alias(AdamW, "8bit", "AdamW8bit")
# the 4-bit aliases take lowbit_optim's 4-bit recipe; state_format="4bit-torchao" is torchao's numerics
Adam4bit = _fixed_format_alias(Adam, "4bit", "Adam4bit")
AdamW4bit = _fixed_format_alias(AdamW, "4bit", "AdamW4bit")
# torchao keeps fp32 state for a tensor that is not whole blocks: so do its FP8 aliases (its own
# names). The 8-bit ones are bitsandbytes' names too, which quantize such a tensor, as "8bit" does.
AdamFp8 = _fixed_format_alias(Adam, "fp8-torchao", "AdamFp8", whole_blocks_only=True)
AdamWFp8 = _fixed_format_alias(AdamW, "fp8-torchao", "AdamWFp8", whole_blocks_only=True)


# ------------------------------------------------------------------------------------------------
# bitsandbytes: class names and signatures (0.50; older releases' keywords accepted where neutral)
# ------------------------------------------------------------------------------------------------


def _bitsandbytes_options(name: str, args, min_8bit_size: int, is_paged: bool, percentile_clipping, block_wise, max_unorm) -> dict:
    """lowbit_optim's options for bitsandbytes' 8-bit arguments: 8-bit blockwise states (blocks of
    256, bitsandbytes' dynamic codebook), fp32 states below ``min_8bit_size`` elements."""
    refused = {
        "args": (args is not None, "bitsandbytes' configuration object; pass its fields as keywords"),
        "is_paged": (is_paged, "bitsandbytes' paged (CUDA unified memory) states; lowbit_optim's states are ordinary tensors"),
        "percentile_clipping": (percentile_clipping != 100, "bitsandbytes' adaptive gradient clipping; clip with torch.nn.utils.clip_grad_norm_"),
        "block_wise": (not block_wise, "lowbit_optim's 8-bit states are always blockwise"),
        "max_unorm": (max_unorm != 0.0, "bitsandbytes' update-norm clipping"),
    }
    check_flag("is_paged", is_paged)
    check_flag("block_wise", block_wise)
    check_element_count("min_8bit_size", min_8bit_size)  # (else named min_quantize_numel)
    values = dict(args=args, is_paged=is_paged, percentile_clipping=percentile_clipping, block_wise=block_wise, max_unorm=max_unorm)
    for key, (bad, why) in refused.items():
        if bad:
            raise ValueError(f"{name}({key}={values[key]!r}) is not supported: {why}. Leave {key} at its default")
    return dict(state_format="8bit", min_quantize_numel=min_8bit_size)


class SGD8bit(SGD):
    """SGD with 8-bit momentum; bitsandbytes.optim.SGD8bit's arguments. Its numbers are
    torch.optim.SGD's: dampening and nesterov apply (bitsandbytes ignores both; at their defaults the
    two agree), and momentum=0 is allowed (no state). Its momentum keeps bitsandbytes' codebook
    (``8bit``, whose block scales keep a block's negative extreme: on the MLP task as close to fp32
    state as ``SGD(..., state_format="8bit-linear")``, README)."""

    def __init__(
        self, params, lr, momentum=0, dampening=0, weight_decay=0, nesterov=False, args=None, min_8bit_size=4096,
        *, percentile_clipping=100, block_wise=True, max_unorm=0.0,
    ):  # fmt: skip
        options = _bitsandbytes_options("SGD8bit", args, min_8bit_size, False, percentile_clipping, block_wise, max_unorm)
        super().__init__(params, lr, momentum, dampening, weight_decay, nesterov, **options)


class Lion8bit(Lion):
    """Lion with 8-bit momentum; bitsandbytes.optim.Lion8bit's arguments. Its momentum keeps
    bitsandbytes' codebook (``8bit``); ``Lion(..., state_format="8bit-linear")`` trained closer to
    fp32 state at the same size on the MLP task (README)."""

    def __init__(
        self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0, args=None, min_8bit_size=4096, is_paged=False,
        *, percentile_clipping=100, block_wise=True, max_unorm=0.0,
    ):  # fmt: skip
        options = _bitsandbytes_options("Lion8bit", args, min_8bit_size, is_paged, percentile_clipping, block_wise, max_unorm)
        super().__init__(params, lr, betas, weight_decay, **options)


class AdEMAMix8bit(AdEMAMix):
    """AdEMAMix with 8-bit states; bitsandbytes.optim.AdEMAMix8bit's arguments."""

    def __init__(
        self, params, lr=1e-3, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8,
        weight_decay=1e-2, min_8bit_size=4096, is_paged=False,
    ):  # fmt: skip
        options = _bitsandbytes_options("AdEMAMix8bit", None, min_8bit_size, is_paged, 100, True, 0.0)
        # bitsandbytes takes 0 (any false value) as no warm-up
        super().__init__(params, lr, betas, alpha, t_alpha or None, t_beta3 or None, eps, weight_decay, **options)


__all__ = [
    "AdEMAMix8bit",
    "Adam4bit",
    "Adam8bit",
    "AdamFp8",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "AnyPrecisionAdamW",
    "Lion8bit",
    "SGD8bit",
]
