"""Other libraries' optimizer states in checkpoints, read as lowbit_optim states so that their runs
resume here: torchao's OptimState8bit, OptimState4bit and OptimStateFp8 (state tensor subclasses),
and bitsandbytes' state dicts (plain tensors under its own key names: state1, absmax1, qmap1, ...).

They are recognized by duck typing (class module and name, key names), without importing their
library: the package depends on torch only. What they hold comes from a file, so it is validated
before use.
"""

import math
import warnings

import torch
from torch import Tensor

from . import quant
from .registry import get_format
from .state import check_block_size, describe_tensor, not_plain

# torchao class name -> (our format holding the same numbers, bits per code)
_TORCHAO = {"OptimState8bit": ("8bit", 8), "OptimState4bit": ("4bit-torchao", 4), "OptimStateFp8": ("fp8", 8)}


def is_torchao_state(t) -> bool:
    """Whether ``t`` is one of torchao's state classes from_foreign reads."""
    return type(t).__module__.startswith("torchao.") and type(t).__name__ in _TORCHAO


def from_foreign(state: Tensor, signed: bool) -> Tensor:
    """``state`` unchanged unless another library wrote it. A torchao state becomes the state of our
    equivalent format over the same codes and scales where the layouts coincide (training resumes
    bit-exactly), else a plain fp32 tensor of the values it stands for. ``signed`` is what the
    optimizer expects; a state recording its own signedness keeps it."""
    cls = type(state)
    if not is_torchao_state(state):
        return state
    name, bits = _TORCHAO[cls.__name__]
    fmt, fp8 = get_format(name), name == "fp8"
    what = f"torchao {cls.__name__} of shape {tuple(state.shape)} in this checkpoint"
    (codes, scale, table), signed = torchao_parts(state, what), getattr(state, "signed", signed)
    if fp8 and not (codes.dtype.is_floating_point and codes.dtype.itemsize == 1):
        raise ValueError(f"{what} has codes of dtype {codes.dtype}, not a float8 dtype")
    if not fp8 and codes.dtype != torch.uint8:
        raise ValueError(f"{what} has codes of dtype {codes.dtype}, not uint8")
    if scale.dtype != torch.float32 or scale.dim() != 1:
        raise ValueError(f"{what} has scales of dtype {scale.dtype} and shape {tuple(scale.shape)}, not a 1-D float32 tensor")
    blocks, numel = scale.numel(), state.numel()
    # torchao quantizes only whole blocks: every block full, no padding
    if blocks == 0 or numel % blocks or codes.numel() * 8 != numel * bits:
        raise ValueError(
            f"{what} has {codes.numel()} bytes of {bits}-bit codes and {blocks} block scales, which do not "
            f"cover {numel} elements in whole blocks"
        )
    block_size = numel // blocks
    codes = codes.reshape(-1)
    if fp8:
        exact = codes.dtype == fmt.fp8_dtype
    else:
        if table.dtype != torch.float32 or table.shape != (2**bits,):
            raise ValueError(f"{what} has a code table of dtype {table.dtype} and shape {tuple(table.shape)}, not {2**bits} float32 values")
        if not bool(table.isfinite().all()):  # each of its codes would decode to NaN or inf
            raise ValueError(f"{what} has a code table with a non-finite value: it is corrupt")
        ours = fmt.decode(torch.arange(2**bits, dtype=torch.uint8, device=table.device), signed)
        exact = torch.equal(table, ours)
    if exact and _valid_block_size(block_size, bits):
        codes = codes.view(torch.uint8)  # fp8: ours are the e4m3 bit patterns
        return fmt(codes, scale, state.shape, block_size, signed, dtype=state.dtype)
    # no format of ours holds these codes: the values they stand for, requantized by the caller
    if fp8:
        values = codes.float()
    else:
        values = quant.decode_codebook(quant.unpack_nibbles(codes) if bits == 4 else codes, table)
    return (values.view(blocks, block_size) * scale[:, None]).view(state.shape)


def torchao_parts(state: Tensor, what: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """A torchao state's codes, block scales and code table (None for fp8), each a plain dense
    tensor that holds values (as the reads of them take them), or a ValueError naming ``what``: a
    file may hold anything."""
    names = ("codes", "scale") if _TORCHAO[type(state).__name__][0] == "fp8" else ("codes", "scale", "qmap")
    parts = [getattr(state, name, None) for name in names]
    for name, part in zip(names, parts):
        problem = _plain_tensor_problem(part)
        if problem:
            raise ValueError(f"{what} is corrupt: its {name} is {problem}")
    return (*parts, None) if len(parts) == 2 else tuple(parts)


def _plain_tensor_problem(t) -> str | None:
    """Why ``t``, read from a file, is no plain dense tensor that holds values (None: it is one)."""
    if not isinstance(t, Tensor):
        return "missing" if t is None else f"{describe_tensor(t)}, not a tensor"
    if t.device.type == "meta":
        return "on the meta device, where it holds no values"
    return not_plain(t)


def _valid_block_size(block_size: int, bits: int) -> bool:
    try:
        check_block_size(block_size, bits)
    except ValueError:
        return False
    return True


# ------------------------------------------------------------------------------------------------
# bitsandbytes: optimizer state dicts (its states are plain tensors under its own key names)
# ------------------------------------------------------------------------------------------------

# bitsandbytes >= 0.49.2 moves a parameter's state tensors under this key in state_dict() (to hide
# them from FSDP's gathering); older releases keep them beside "step"
BITSANDBYTES_WRAPPER = "__bnb_optimizer_quant_state__"
# blockwise 8-bit states: blocks of 256 since bitsandbytes 0.44, of 2048 before (told apart by the
# number of block scales; a state of one block is read with 256)
_BNB_BLOCK_SIZES = (256, 2048)
_BNB_KEYS = ("step", "state1", "state2", "absmax1", "absmax2", "qmap1", "qmap2")
_BNB_UNREADABLE = {
    "max1": "non-blockwise 8-bit states (block_wise=False)",
    "new_max1": "non-blockwise 8-bit states (block_wise=False)",
    "unorm_vec": "the update norm of max_unorm clipping (LAMB, LARS)",
    "gnorm_vec": "the gradient norms of percentile_clipping, which lowbit_optim does not do: clip with "
    "torch.nn.utils.clip_grad_norm_ and delete 'gnorm_vec' from the states to load the rest",
}
# bitsandbytes' param-group keys that are hyper-parameters (the others, e.g. a scheduler's
# "initial_lr", are kept as saved)
_BNB_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3")
# what any torch optimizer's group may hold beside its own: the parameters' names (built from
# named_parameters()) and what torch's LR schedulers add
_ANY_OPTIMIZERS_KEYS = {"param_names", "initial_lr", "max_lr", "min_lr", "max_momentum", "base_momentum"}
# bitsandbytes' two-state optimizers (Adam, AdamW, AdEMAMix, LAMB) save these since 0.44; its
# one-state SGD and Lion never do, and save eps=0
_TWO_STATE_KEYS = ("alpha", "t_alpha", "t_beta3")
_LOAD_INTO_ITS_OWN = (
    "it is a checkpoint of another optimizer. bitsandbytes' checkpoints do not name their optimizer: load it into "
    "the one that saved it (AdamW8bit: AdamW, Lion8bit: Lion, SGD8bit: SGD with momentum, AdEMAMix8bit: AdEMAMix)"
)


def is_bitsandbytes_state_dict(state_dict: dict, own_states) -> bool:
    """Whether ``state_dict`` (already known to have "state") was written by a bitsandbytes
    optimizer: some parameter's state holds bitsandbytes' key names (``own_states``: the state names
    of the optimizer loading it, which never count as bitsandbytes'), or, saved before any step, its
    param groups hold bitsandbytes' keys alone, and those any optimizer's may hold (parameter names, an
    LR scheduler's): betas and eps among them, where torch.optim's and torchao's have flags such as
    maximize or amsgrad, and lowbit_optim's their state formats."""
    states = state_dict["state"].values() if isinstance(state_dict["state"], dict) else ()
    keys = {"state1", BITSANDBYTES_WRAPPER} - set(own_states)
    if any(isinstance(s, dict) and not keys.isdisjoint(s) for s in states):
        return True
    groups = state_dict.get("param_groups")
    unstepped = not any(states) and isinstance(groups, list) and groups and all(isinstance(g, dict) for g in groups)
    return bool(unstepped) and all({"betas", "eps"} <= g.keys() - _ANY_OPTIMIZERS_KEYS <= {"params", *_BNB_HYPERPARAMETERS} for g in groups)


def from_bitsandbytes(state_dict: dict, optimizer) -> dict:
    """A bitsandbytes optimizer's ``state_dict()`` as the state dict of ``optimizer`` (a
    LowBitOptimizer), for its ``load_state_dict`` to validate and convert to its formats.

    - States: bitsandbytes' ``state1`` and ``state2`` (AdEMAMix: ``state1`` holds its two first
      moments stacked, shape (2, *param.shape)) become the optimizer's declared states in order. A
      blockwise 8-bit state (uint8 codes of the parameter's shape, ``absmax`` per block of 256, or
      of 2048 before bitsandbytes 0.44, code table ``qmap``) whose table is our 8bit codebook becomes an 8bit state over the same
      codes and scales (an 8bit optimizer keeps them: bit-exact); any other table, the values its
      codes stand for. 32-bit states are taken as they are.
    - Hyper-parameters bitsandbytes records (lr, betas, eps, weight_decay, AdEMAMix's alpha,
      t_alpha, t_beta3; SGD's momentum, which it stores as betas) come from the checkpoint, as
      torch.optim's do, and so does what its Adam does without recording it: decoupled weight
      decay (Adam's ``decoupled_weight_decay=True``), and its SGD: no dampening (the betas' second
      records one its step ignores; a warning says so where it is not 0); everything else (state
      formats, nesterov, maximize, ...) stays as the optimizer was built.

    bitsandbytes' checkpoints do not name their optimizer: one with as many states as ``optimizer``
    declares is taken as its own (a Lion checkpoint loads into SGD, whose momentum would then be
    Lion's beta1); one saved before a step, if its groups' keys are of the kind (one state or two)
    ``optimizer`` keeps. Empty states (read before a step) load as torch.optim's do. Every tensor is
    checked (type, dtype, shape, block count, table size) before use.
    """
    groups, saved_groups = optimizer.param_groups, state_dict["param_groups"]
    sizes = [len(g["params"]) for g in groups]
    if not isinstance(saved_groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in saved_groups):
        raise ValueError("this bitsandbytes checkpoint's param_groups is not a list of groups with 'params' lists")
    if not isinstance(state_dict["state"], dict):
        raise ValueError(f"this bitsandbytes checkpoint's state is a {type(state_dict['state']).__name__}, not a dict of parameter states")
    saved_sizes = [len(g["params"]) for g in saved_groups]
    if saved_sizes != sizes:
        raise ValueError(
            f"this bitsandbytes checkpoint has param groups of {saved_sizes} parameters, this optimizer of {sizes}: "
            "build the optimizer over the same parameters, in the same groups"
        )
    states, new_groups = {}, []
    index = 0
    for group, saved in zip(groups, saved_groups):
        translated = _bitsandbytes_group(saved, group, optimizer.defaults)
        new_groups.append(translated)
        declared = [(s.name, s.signed) for s in optimizer._declared(translated)]
        saved_states = [state_dict["state"].get(key) for key in saved["params"]]
        if not any(s for s in saved_states if isinstance(s, dict)):  # nothing to count: the group's keys tell one state from two
            _check_state_count(saved, declared, len(new_groups) - 1, optimizer._family)
        for key, param, state in zip(saved["params"], group["params"], saved_states):
            if isinstance(state, dict) and not state:  # read before a step: loads as torch.optim's does
                states[key] = {}
            elif state is not None:
                states[key] = _bitsandbytes_param_state(state, param, declared, index, optimizer._family)
            index += 1
    return {**state_dict, "state": states, "param_groups": new_groups}


def _bitsandbytes_group(saved: dict, group: dict, defaults: dict) -> dict:
    """``group``'s options with the hyper-parameters of bitsandbytes' param group ``saved`` and its
    keys of no optimizer's (``defaults``: this optimizer's), e.g. a scheduler's "initial_lr"."""
    out = {k: v for k, v in group.items() if k != "params"}
    out.update({k: v for k, v in saved.items() if k not in defaults and k not in _BNB_HYPERPARAMETERS and k != "params"})
    for key in ("lr", "eps", "weight_decay", "alpha", "t_alpha", "t_beta3"):
        if key in saved and key in group:
            value = saved[key]
            out[key] = (value or None) if key.startswith("t_") else value  # bitsandbytes: 0 is no warm-up
    if "decoupled_weight_decay" in group:  # bitsandbytes' Adam decouples weight decay, as AdamW
        out["decoupled_weight_decay"] = True
    betas = saved.get("betas")
    if betas is not None:
        if "betas" in group:
            out["betas"] = tuple(betas) if isinstance(betas, (tuple, list)) else betas
        elif "momentum" in group and isinstance(betas, (tuple, list)) and len(betas) == 2:
            # bitsandbytes' SGD: betas=(momentum, dampening), whose step never applies the dampening
            out["momentum"], out["dampening"] = betas[0], 0.0
            if betas[1] != 0:
                warnings.warn(
                    f"this bitsandbytes SGD checkpoint records dampening={betas[1]!r}, which bitsandbytes' step does not apply: "
                    "loaded as dampening=0, so that training goes on as it ran (set the group's 'dampening' after the load to apply it)",
                    stacklevel=4,
                )
    out["params"] = list(saved["params"])
    return out


def _check_state_count(saved: dict, declared: list, index: int, family: str) -> None:
    """Refuses bitsandbytes' param group ``saved``, of parameters with no state, for an optimizer
    keeping ``declared`` states if its keys are another kind's: alpha, t_alpha and t_beta3 a
    two-state optimizer's, eps=0 without them SGD's or Lion's. (Older releases' two-state groups lack
    alpha: one with eps > 0 may be of either kind.)"""
    if any(key in saved for key in _TWO_STATE_KEYS):
        theirs, why = 2, f"it holds {', '.join(_TWO_STATE_KEYS)}, which bitsandbytes' Adam, AdamW, AdEMAMix and LAMB save"
    elif isinstance(saved.get("eps"), (int, float)) and saved["eps"] == 0:
        theirs, why = 1, "its eps is 0, as bitsandbytes' SGD and Lion save it"
    else:
        return
    if (len(declared) >= 2) != (theirs == 2):
        names = ", ".join(name for name, _ in declared) or "none"
        raise ValueError(
            f"param group {index} of this bitsandbytes checkpoint is of an optimizer keeping {_count(theirs, 'state')} "
            f"({why}), and {family} keeps {len(declared)} ({names} under this param group's options): {_LOAD_INTO_ITS_OWN}"
        )


def _bitsandbytes_param_state(state, param: Tensor, declared: list, index: int, family: str) -> dict:
    shape = tuple(param.shape)
    where = f"bitsandbytes state of parameter {index} (shape {shape})"
    if not isinstance(state, dict):
        raise ValueError(f"{where} is a {type(state).__name__}, not a dict")
    state = dict(state)
    wrapped = state.pop(BITSANDBYTES_WRAPPER, {})
    if not isinstance(wrapped, dict):
        raise ValueError(f"{where}: {BITSANDBYTES_WRAPPER!r} is a {type(wrapped).__name__}, not a dict")
    state.update(wrapped)
    unknown = sorted(set(state) - set(_BNB_KEYS))
    if unknown:
        why = "; ".join(sorted({_BNB_UNREADABLE[k] for k in unknown if k in _BNB_UNREADABLE}))
        why = why or "keys of no bitsandbytes optimizer lowbit_optim reads"
        raise ValueError(
            f"{where} holds {unknown} ({why}): lowbit_optim reads bitsandbytes' blockwise 8-bit and 32-bit states "
            "(step, state1, state2, absmax1, absmax2, qmap1, qmap2)"
        )
    pieces = []  # ((codes or fp32 values, absmax, qmap, block size: None for fp32), state key)
    for i in (1, 2):
        if f"state{i}" in state:
            pieces += _bitsandbytes_pieces(state, i, shape, where)
        elif i == 1 or f"absmax{i}" in state or f"qmap{i}" in state:
            raise ValueError(f"{where} lacks 'state{i}' but holds {sorted(state)}: the checkpoint is truncated or edited")
    if len(pieces) != len(declared):
        names = [name for name, _ in declared]
        raise ValueError(
            f"{where} holds {_count(len(pieces), 'state tensor')} ({', '.join(key for _, key in pieces)}), and {family} keeps "
            f"{len(declared)} ({', '.join(names) or 'none'} under this param group's options): {_LOAD_INTO_ITS_OWN}"
        )
    out = {name: _bitsandbytes_state(piece, signed, shape) for (name, signed), (piece, _) in zip(declared, pieces)}
    if "step" in state:
        out["step"] = state["step"]
    return out


def _bitsandbytes_pieces(state: dict, i: int, shape: tuple, where: str) -> list:
    """bitsandbytes' ``state{i}`` (with its absmax and qmap if 8-bit), validated, as one piece per
    optimizer state: two for AdEMAMix's stacked first moments."""
    key = f"state{i}"
    value = state[key]
    if type(value) is not Tensor:  # not a subclass: bitsandbytes keeps plain tensors
        raise ValueError(f"{where}: {key} is {_describe(value)}, not a plain tensor")
    for name in (key, f"absmax{i}", f"qmap{i}"):  # dense ones that hold values: a file may hold anything
        problem = _plain_tensor_problem(state[name]) if name in state else None
        if problem:
            raise ValueError(f"{where}: {name} is {problem}")
    if tuple(value.shape) == shape:
        stacked = 1
    elif tuple(value.shape) == (2, *shape):
        stacked = 2  # AdEMAMix: (fast, slow) first moments
    else:
        raise ValueError(
            f"{where}: {key} has shape {tuple(value.shape)}, not the parameter's shape (or (2, *shape) for AdEMAMix's "
            "first moments): the checkpoint belongs to another model"
        )
    halves = value.unbind(0) if stacked == 2 else [value]
    label = [f"{key}[0]", f"{key}[1]"] if stacked == 2 else [key]
    if value.dtype == torch.float32:  # 32-bit states (and 8-bit optimizers' states below min_8bit_size)
        if f"absmax{i}" in state or f"qmap{i}" in state:
            raise ValueError(f"{where}: {key} is float32 but absmax{i} / qmap{i} are present: the checkpoint is edited")
        return [((h, None, None, None), name) for h, name in zip(halves, label)]
    if value.dtype != torch.uint8:
        raise ValueError(f"{where}: {key} has dtype {value.dtype}; bitsandbytes' states are float32 or uint8 (8-bit codes)")
    absmax, qmap = state.get(f"absmax{i}"), state.get(f"qmap{i}")
    numel = math.prod(shape)
    # absmax's shape -> block size: one scale per block (per stacked first moment); where both block
    # sizes give one block, 256 (the later key) wins
    lead = (2,) if stacked == 2 else ()
    block_sizes = {(*lead, -(-numel // b)): b for b in reversed(_BNB_BLOCK_SIZES)}
    if not isinstance(absmax, Tensor) or absmax.dtype != torch.float32 or tuple(absmax.shape) not in block_sizes:
        wanted = (*lead, -(-numel // _BNB_BLOCK_SIZES[0]))
        raise ValueError(
            f"{where}: the 8-bit {key} needs absmax{i}, a float32 tensor of shape {wanted} (one scale per block of "
            f"{_BNB_BLOCK_SIZES[0]}; of {_BNB_BLOCK_SIZES[1]} before bitsandbytes 0.44), got {_describe(absmax)}"
        )
    block_size = block_sizes[tuple(absmax.shape)]
    absmax = absmax.reshape(stacked, -1)  # AdEMAMix: (2, blocks)
    if not isinstance(qmap, Tensor) or qmap.dtype != torch.float32 or tuple(qmap.shape) != (256,):
        raise ValueError(f"{where}: the 8-bit {key} needs qmap{i}, a float32 table of 256 code values, got {_describe(qmap)}")
    if not bool(qmap.isfinite().all()):  # each of its codes would decode to NaN or inf
        raise ValueError(f"{where}: qmap{i} holds a non-finite value: it is corrupt")
    if bool((absmax < 0).any()):  # block maxima; a negative one would flip its block's values
        raise ValueError(f"{where}: absmax{i} holds a negative value ({float(absmax.min())}), where it holds block maxima: it is corrupt")
    return [((h, s, qmap, block_size), name) for h, s, name in zip(halves, absmax.unbind(0), label)]


def _bitsandbytes_state(piece: tuple, signed: bool, shape: tuple) -> Tensor:
    """One validated bitsandbytes state as ours: fp32 values, or an 8bit state over its codes."""
    value, absmax, qmap, block_size = piece
    if absmax is None:
        return value.detach().clone()
    fmt = get_format("8bit")
    codes = value.detach().reshape(-1).to(torch.uint8, copy=True)
    scale = absmax.detach().clone()
    padding = scale.numel() * block_size - codes.numel()
    if torch.equal(qmap, fmt.decode(torch.arange(256, dtype=torch.uint8, device=qmap.device), signed)):
        # ours pads the last block with zero's code (bitsandbytes' last block is short)
        codes = torch.cat([codes, fmt.encode(torch.zeros(padding, device=codes.device), signed)])
        return fmt(codes, scale, torch.Size(shape), block_size, signed)
    values = quant.decode_codebook(codes, qmap)  # uint8 codes index the 256-entry table: always in range
    values = torch.nn.functional.pad(values, (0, padding)).view(-1, block_size) * scale[:, None]
    return values.view(-1)[: codes.numel()].view(shape)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _describe(value) -> str:
    if isinstance(value, Tensor):
        kind = "tensor" if type(value) is Tensor else type(value).__name__
        return f"a {value.dtype} {kind} of shape {tuple(value.shape)}"
    return "missing" if value is None else f"a {type(value).__name__}"
