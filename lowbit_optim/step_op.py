"""The optimizer step as one opaque op, for training steps compiled with torch.compile.

PyTorch documents compiling a function that calls ``opt.step()``. Traced by dynamo, our step would be
unrolled through the state subclasses, the fused kernel's ctypes call and cached tables: graph
breaks, warnings and minutes of compiling. So while dynamo traces, ``step()`` emits one custom op,
``lowbit_optim::step``, that declares what it mutates (the parameters) and, at run time, runs the
optimizer's ordinary step (its own compiled step or the fused kernel) on the tensors it is given.
Learning rates and other options are read when it runs: changing them recompiles nothing. Dynamo
writes back edits of Python objects only after its graph has run, so param_groups edited inside the
compiled function before ``step()`` would be seen a step late: there the step breaks the graph
(refused under fullgraph=True), and runs after the edits.
"""

import itertools
import weakref

import torch
from torch import Tensor
from torch._dynamo.comptime import comptime

# key -> optimizer: a graph holds the key as a constant; the op finds the optimizer by it at run time
_OPTIMIZERS: "weakref.WeakValueDictionary[int, torch.optim.Optimizer]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(optimizer) -> int:
    """A key for ``optimizer`` (each copy needs its own), to be stored on it when it is made:
    registering while dynamo traces would break the graph."""
    key = next(_KEYS)
    _OPTIMIZERS[key] = optimizer
    return key


@torch.library.custom_op("lowbit_optim::step", mutates_args=("params",))
def _step(optimizer_id: int, params: list[Tensor], grads: list[Tensor], positions: list[int]) -> None:
    _OPTIMIZERS[optimizer_id]._step_params(params, grads, positions, traced=True)


@_step.register_fake
def _step_fake(optimizer_id: int, params: list[Tensor], grads: list[Tensor], positions: list[int]) -> None:
    return None


def with_grads(params: list[Tensor]) -> tuple[list[Tensor], list[Tensor], list[int]]:
    """The parameters that have a gradient, those gradients and the parameters' positions in
    ``params``. The op takes the positions as traced: a gradient assigned inside the compiled
    function is set on the parameter only after the graph has run."""
    positions = [i for i, p in enumerate(params) if p.grad is not None]
    return [params[i] for i in positions], [params[i].grad for i in positions], positions


GROUPS_EDITED_IN_GRAPH = (
    "param_groups of {name} were edited inside this torch.compile'd function, before its step(): dynamo writes "
    "such edits back only after the graph has run, and the step reads them as it runs. Edit them outside the "
    "compiled function, give the group a tensor lr and fill_() it, or compile without fullgraph=True (the step "
    "then runs after a graph break)"
)


def _break_if_groups_edited(ctx) -> None:
    """At trace time: a graph break where the traced code has edited, and not yet written back, the
    param_groups list, a group or a group's params list of the optimizer stepped (the local
    ``key``; where dynamo made it symbolic, of any optimizer). Dynamo's record of edits is internal:
    where it is not as read here, nothing is checked."""
    try:
        edits = ctx._ComptimeContext__tx.output.side_effects
        tracked = edits.id_to_variable
    except AttributeError:
        return
    key = ctx.get_local("key")
    stepped = [_OPTIMIZERS[key.as_python_constant()]] if key.is_python_constant() else list(_OPTIMIZERS.values())
    for optimizer in stepped:
        groups = optimizer.__dict__.get("param_groups", [])
        for edited in (groups, *groups, *(group["params"] for group in groups)):
            variable = tracked.get(id(edited))
            if variable is not None and edits.is_modified(variable):
                ctx.graph_break(GROUPS_EDITED_IN_GRAPH.format(name=type(optimizer).__name__))


def step(key: int, params: list[Tensor]) -> None:
    """The step of the optimizer registered as ``key`` over ``params`` (all of its parameters, in
    param-group order) as one op of the graph being traced."""
    comptime(_break_if_groups_edited)
    torch.ops.lowbit_optim.step(key, *with_grads(params))
