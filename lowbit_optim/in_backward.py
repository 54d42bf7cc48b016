"""The step in backward (``step_in_backward=True``): each parameter is stepped by a hook as soon as
backward has accumulated its gradient, and the gradient is freed, so a whole model's gradients never
exist at once (README, "Step in backward").

A hook steps one parameter with the optimizer's own per-group step (the fused CPU kernel or the
compiled step, as after backward), so without clipping the numbers are those of stepping after
backward. Inside ``optimizer.accumulating()`` the hooks do nothing and gradients accumulate.

Global gradient-norm clipping cannot be exact here: the first parameters are stepped before the
last gradients exist. ``max_grad_norm`` gives each gradient clip_grad_norm_'s coefficient,
``min(1, max_norm / (norm + 1e-6))``, for an estimate of this step's global norm: the larger of the
previous step's and the norm of this step's gradients seen so far (a lower bound of this step's, so
a first step, or a spike, is clipped as soon as it shows). ``last_grad_norm`` reports each step's
norm, as clip_grad_norm_ returns it, when backward ends (not with reentrant activation checkpointing,
``use_reentrant=True``, whose inner backward passes end the count early). Gradients the last backward
did not reach (accumulated for a branch its micro-batch did not take) are stepped by step(), clipped
by the step's norm with theirs added (``clip_left_over``), which also ends the count where no
callback did (compiled autograd runs none). Under FSDP2 a hook sees its rank's shard:
the norm so far is this rank's (still a lower bound of the step's), and the step's global norm is
summed over the ranks once, when backward ends.
"""

import functools
import math
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from .distributed import is_dtensor, is_sharded, laid_out_like, local

# torch.nn.utils.clip_grads_with_norm_'s guard against a zero norm
_CLIP_EPS = 1e-6


def hook_params(optimizer, group: dict, copied: bool = False) -> None:
    """Step each parameter of param group ``group`` in backward (once ``own`` makes the optimizer
    their owner). ``copied``: the group of a copy (deepcopy, unpickling), whose parameters may have
    been frozen since the original's constructor hooked them: hooked too, for when they thaw."""
    for p in group["params"]:  # every check before any hook: a refused group leaves none behind
        if optimizer._max_grad_norm is not None and is_dtensor(p) and p.device_mesh.ndim != 1:
            raise ValueError(
                f"max_grad_norm with step_in_backward=True sums gradient norms over a 1-D mesh (FSDP2's fully_shard); "
                f"this parameter is on a {p.device_mesh.ndim}-D mesh: drop max_grad_norm"
            )
        if not p.requires_grad and not copied:
            raise ValueError(
                f"a parameter of shape {tuple(p.shape)} does not require grad: step_in_backward=True steps each parameter "
                "from a hook on its gradient, made with the optimizer. Pass the trainable ones "
                "([p for p in model.parameters() if p.requires_grad]) and add others with add_param_group once unfrozen"
            )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not all(is_dtensor(p) for p in group["params"]):
        warnings.warn(
            "step_in_backward=True steps each parameter as soon as backward has accumulated its gradient: under "
            "DistributedDataParallel that is before DDP averages it over the ranks, and the replicas part. Shard the "
            "model with FSDP2 (fully_shard), whose shards' hooks run after their reduce-scatter, or pass "
            "step_in_backward=False with DDP (this warning does not apply to a pipeline stage or a per-rank model)",
            stacklevel=4,
        )
    owner = weakref.ref(optimizer)  # a parameter's hook must not keep its optimizer alive
    handles = []
    for p in group["params"]:
        frozen = not p.requires_grad  # (a copy's: torch hooks only a tensor that requires grad)
        if frozen:
            p.requires_grad_(True)
        try:
            handles.append(p.register_post_accumulate_grad_hook(functools.partial(_step_in_backward, owner)))
        finally:
            if frozen:
                p.requires_grad_(False)
    # the optimizer's end takes its hooks off (each would cost every later backward a call per parameter)
    weakref.finalize(optimizer, _remove, handles).atexit = False
    _refuse_steps_of_others()


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()


# Each parameter's optimizers that step it in backward, or after it where one of those had it
# before, in the order they were built: the last one alive steps it. The hooks of earlier ones,
# which would take and free its gradient first (so that the new one would never step), do nothing;
# when the new one is dropped (or its constructor fails), the one before it steps again.
_OWNERS = WeakIdKeyDictionary()


def _owner(param: Tensor):
    owners = _OWNERS.get(param, [])
    while owners and owners[-1]() is None:
        owners.pop()
    return owners[-1]() if owners else None


def own(optimizer, params: list[Tensor], stacklevel: int) -> None:
    """Make ``optimizer`` (built, or its param group added) the owner of ``params``: all of them
    where it steps in backward, else those an optimizer stepping in backward has (whose hooks then
    leave them to it); an earlier owner still alive is warned of."""
    owner = weakref.ref(optimizer)
    others = {}
    for p in params:
        previous = _owner(p)
        if previous is not None and previous is not optimizer:
            others[id(previous)] = previous
        if optimizer._step_in_backward or previous is not None:
            _OWNERS.setdefault(p, []).append(owner)
    if optimizer._step_in_backward:
        _STEPPING_IN_BACKWARD.add(optimizer)
    if others:
        warnings.warn(
            f"parameters that {', '.join(sorted({type(o).__name__ for o in others.values()}))} stepped in backward "
            f"(step_in_backward=True) are now stepped by this {type(optimizer).__name__}, built later; the earlier one, "
            "still alive (held by a name being reassigned, a scheduler, a Trainer), no longer steps them",
            stacklevel=stacklevel + 1,
        )


def disown(optimizer) -> None:
    """Forget ``optimizer`` as an owner (a part of a composite whose other part failed): the owners
    before it step again."""
    for group in optimizer.__dict__.get("param_groups", []):
        for p in group["params"]:
            owners = _OWNERS.get(p, [])
            owners[:] = [o for o in owners if o() is not optimizer]


_REFUSING = []  # the handle of the global step pre-hook below, once registered
_STEPPING_IN_BACKWARD = weakref.WeakSet()  # the live owners stepping in backward: none, and the hook has nothing to do


def _refuse_steps_of_others() -> None:
    """Once an optimizer steps in backward: any other optimizer's step() (torch.optim's: it cannot
    take the parameters over when built) over parameters it owns is refused, since their gradients
    are gone."""
    if not _REFUSING:
        _REFUSING.append(register_optimizer_step_pre_hook(_refuse_a_step_of_another))


# the wrappers warned that they step through an optimizer that steps in backward (once each)
_WARNED_WRAPPERS: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()


def _refuse_a_step_of_another(optimizer, args, kwargs) -> None:
    if not _STEPPING_IN_BACKWARD or getattr(type(optimizer), "owns_in_backward", False):
        return  # (lowbit_optim's own take parameters over when built, and warn)
    _refuse_if_owned(optimizer)


@torch.compiler.disable  # inside a torch.compile'd step too: checked as it runs, not traced
def _refuse_if_owned(optimizer) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            owner = _owner(p)
            if owner is None or owner is optimizer:
                continue
            if not any(group is g for g in owner.param_groups):
                raise RuntimeError(
                    f"this {type(optimizer).__name__} steps a parameter of shape {tuple(p.shape)} that an optimizer "
                    f"built with step_in_backward=True ({type(owner).__name__}) steps in backward, freeing its gradient "
                    "first; that optimizer is still alive (held by a name, a scheduler, a Trainer): drop every "
                    "reference to it, or build it with step_in_backward=False"
                )
            if optimizer not in _WARNED_WRAPPERS:  # a wrapper (timm's Lookahead) holds its owner's group dicts: it steps through it
                _WARNED_WRAPPERS.add(optimizer)
                warnings.warn(
                    f"{type(optimizer).__name__} steps through {type(owner).__name__}, built with step_in_backward=True, "
                    "which steps each parameter in backward and frees its gradient: the wrapper finds no gradients, and "
                    "what it does with them is skipped (timm's Lookahead keeps no slow weights: plain "
                    f"{type(owner).__name__}). Build {type(owner).__name__} with step_in_backward=False to combine them",
                    stacklevel=3,
                )


def _group_of(optimizer, param: Tensor) -> dict | None:
    """``param``'s group in ``optimizer`` as its param groups are in this backward (None: none holds
    it any more): the map is made once per backward (autograd's graph task), so any edit between
    backwards shows."""
    task = torch._C._current_graph_task_id()
    cached = optimizer.__dict__.get("_groups_by_param")
    if cached is None or cached[0] != task or task == -1:
        cached = optimizer.__dict__["_groups_by_param"] = (task, {id(p): g for g in optimizer.param_groups for p in g["params"]})
    return cached[1].get(id(param))


@torch.compiler.disable  # called by backward inside a torch.compile'd function: the step is not traced
@torch.no_grad()
def _step_in_backward(owner: weakref.ref, param: Tensor) -> None:
    """The hook on each parameter: step it with the gradient backward has just accumulated, then
    free that gradient."""
    optimizer = owner()
    if optimizer is None or _owner(param) is not optimizer or optimizer.__dict__.get("_accumulating") or param.grad is None:
        return
    group = _group_of(optimizer, param)
    if group is None:  # taken out of the optimizer's groups: not stepped, as by torch.optim
        return
    grad = param.grad = laid_out_like(param.grad, param)  # (reduced once, for the norm and the step)
    if optimizer._max_grad_norm is not None:
        grad.mul_(_clip_coefficient(optimizer, param, grad))  # as clip_grads_with_norm_ does, also by 1
    optimizer._step_one(group, param, grad)
    param.grad = None


def _clip_coefficient(optimizer, param: Tensor, grad: Tensor) -> Tensor:
    """The coefficient for ``grad``: clip_grad_norm_'s for the larger of the previous step's norm and
    the norm of this step's gradients so far, ``grad`` included."""
    norms = optimizer.__dict__.get("_backward_norms")
    end = optimizer.__dict__.get("_backward_end")
    # an earlier backward raised before its end: autograd dropped its callback, whatever its hooks counted
    if norms is not None and (param in norms or end is not None and end() is None):
        norms = None
    if norms is None:  # the first gradient of this backward: queue the bookkeeping that ends it
        begin_step(optimizer)  # an earlier backward's norm, whose step() was skipped, is not this step's
        norms = optimizer._backward_norms = {}
        optimizer._backward_square_sum = torch.zeros((), device=grad.device)
        callback = functools.partial(_end_of_backward, weakref.ref(optimizer))
        torch.autograd.Variable._execution_engine.queue_callback(callback)
        optimizer._backward_end = weakref.ref(callback)
    shard = local(grad)  # under FSDP2, this rank's rows: their sums add up over the ranks at the end
    norm = norms[param] = torch.linalg.vector_norm(shard, 2, dtype=torch.float32)
    optimizer._backward_square_sum = optimizer._backward_square_sum.to(shard.device) + norm.square()
    previous = optimizer.last_grad_norm if optimizer.last_grad_norm is not None else torch.zeros(())  # 0 before the first step
    estimate = torch.maximum(optimizer._backward_square_sum.sqrt(), previous.to(shard.device))
    return torch.clamp(optimizer._max_grad_norm / (estimate + _CLIP_EPS), max=1.0)


@torch.compiler.disable  # run by a backward inside a torch.compile'd function: traced, its writes were lost
def _end_of_backward(owner: weakref.ref) -> None:
    """The global norm of this step's gradients (as torch.nn.utils.get_total_norm gives it: the norm
    of the parameters' norms, in param-group order) and the coefficient that clips the next step."""
    optimizer = owner()
    if optimizer is not None:
        end_backward(optimizer)


def end_backward(optimizer) -> None:
    """_end_of_backward's work, also for step(), where a backward's callback never ran (compiled
    autograd runs none); nothing where it did."""
    if "_backward_norms" not in optimizer.__dict__:
        return
    norms = optimizer.__dict__.pop("_backward_norms")
    optimizer.__dict__.pop("_backward_square_sum", None)
    norm = _global_norm(optimizer, norms)
    if norm is not None:
        set_last_grad_norm(optimizer, norm)
        optimizer._norm_is_this_steps = True  # for clip_left_over, until the step


def begin_step(optimizer) -> None:
    """A new step's gradients begin (its first backward, or accumulating()): the last backward's
    norm no longer counts in clip_left_over."""
    optimizer.__dict__.pop("_norm_is_this_steps", None)


def clip_left_over(optimizer, params: list[Tensor], grads: list[Tensor]) -> list[Tensor]:
    """Gradients that step() finds under max_grad_norm: accumulated (``accumulating()``) for
    parameters the last backward did not reach, whose hooks therefore did not step them (a branch
    that micro-batch did not take). Their norm joins the step's (``last_grad_norm``), and they are
    clipped by its coefficient, exact by now, as clip_grads_with_norm_ would: returned clipped, new
    tensors (the step op, inside a compiled function, may not write its gradient arguments)."""
    end_backward(optimizer)  # (where no callback ended the last backward)
    this_steps = optimizer.__dict__.pop("_norm_is_this_steps", False)  # else last_grad_norm is an earlier step's
    if optimizer._max_grad_norm is None or not grads:
        return grads
    left_over = _global_norm(optimizer, {p: torch.linalg.vector_norm(local(g), 2, dtype=torch.float32) for p, g in zip(params, grads)})
    seen = optimizer.last_grad_norm if this_steps else torch.zeros(())
    total = torch.hypot(seen.double(), left_over.double().cpu())
    set_last_grad_norm(optimizer, total)
    coefficient = torch.clamp(optimizer._max_grad_norm / (total.float() + _CLIP_EPS), max=1.0)
    return [g * coefficient.to(g.device) for g in grads]


def _global_norm(optimizer, norms: dict) -> Tensor | None:
    """The norm of the parameters' gradient norms ``norms`` (param -> its local shard's), in
    param-group order, over the ranks where they are FSDP2 shards; None where there are none."""
    ordered = [(p, norms[p]) for group in optimizer.param_groups for p in group["params"] if p in norms]
    if not ordered:
        return None
    sharded = [n for p, n in ordered if is_sharded(p)]  # (a Replicate parameter's norm counts once, not once a rank)
    if not sharded:
        return torch.linalg.vector_norm(torch.stack([n.cpu() for _, n in ordered]), 2)
    # float64 sums (fp32 squares are exact in it): the norm's bits do not depend on the order in which
    # a reduction kernel or the ranks add them (an fp32 sum of the same six squares differed by an ulp
    # between a backward callback and the main thread, on an AMD EPYC family 26)
    square_sum = torch.stack(sharded).double().square().sum()  # this rank's shards: summed over the ranks
    dist.all_reduce(square_sum, group=next(p for p, _ in ordered if is_sharded(p)).device_mesh.get_group())
    whole = [n.to(square_sum.device) for p, n in ordered if not is_sharded(p)]  # the same on every rank: once
    return (square_sum + torch.stack(whole).double().square().sum() if whole else square_sum).sqrt()


def set_last_grad_norm(optimizer, norm) -> None:
    """Record a step's global gradient norm (also a checkpoint's): the next step clips with it."""
    optimizer.last_grad_norm = torch.as_tensor(norm, dtype=torch.float32).detach().clone().cpu().reshape(())


def refuse_grad_scaler(optimizer) -> None:
    """GradScaler's step() on an optimizer stepping in backward: refused, and its scale taken off the
    optimizer (GradScaler removes it only after a step returns), so that later steps without it work."""
    optimizer.__dict__.pop("grad_scale", None)
    optimizer.__dict__.pop("found_inf", None)
    raise RuntimeError(
        "GradScaler cannot drive an optimizer with step_in_backward=True: it unscales gradients after backward, and the "
        "step in backward has already used them (scaled). Train in bf16 (autocast needs no scaler), or pass step_in_backward=False"
    )


def check_zero_grad(set_to_none: bool) -> None:
    """zero_grad(set_to_none=False) under step_in_backward: refused (its zero gradients are stepped
    after backward, never in it)."""
    if not set_to_none:
        raise ValueError(
            "zero_grad(set_to_none=False) keeps zero gradients, with which an optimizer stepping after backward steps "
            "the parameters a backward did not reach (weight decay, momentum); step_in_backward=True frees each "
            "gradient as it steps and cannot: call zero_grad() (set_to_none=True, torch's default)"
        )


def check_max_grad_norm(max_grad_norm, step_in_backward: bool) -> None:
    if max_grad_norm is None:
        return
    if not step_in_backward:
        raise ValueError(
            "max_grad_norm clips in backward (with an estimate of the step's norm) and needs step_in_backward=True; "
            "stepping after backward, clip exactly with torch.nn.utils.clip_grad_norm_ before step()"
        )
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0 or math.isinf(max_grad_norm):
        raise ValueError(f"invalid max_grad_norm {max_grad_norm!r}: use a finite number > 0, or None")
