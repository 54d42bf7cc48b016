"""The optimizer step as one opaque op, for training steps compiled with torch.compile.

PyTorch documents compiling a function that calls ``opt.step()``. Traced by dynamo, our step would be
unrolled through the state subclasses, the fused kernel's ctypes call and cached tables: graph
breaks, warnings and minutes of compiling. So while dynamo traces, ``step()`` emits one custom op,
``lowbit_optim::step``, that declares what it mutates (the parameters) and, at run time, runs the
optimizer's ordinary step (its own compiled step or the fused kernel) on the tensors it is given.
Learning rates and other options are read when it runs: changing them recompiles nothing. Dynamo
writes back edits of Python objects only after its graph has run, so param_groups edited inside the
compiled function before ``step()`` would be seen a step late: there the step breaks the graph
(refused under fullgraph=True), and runs after the edits. Tensor options (a tensor lr) are the op's
inputs, so that one filled in place before ``step()`` in the graph reaches it. The op does not
declare the states it writes (their subclasses and the states a first step makes would cost guards
and recompiles): where the graph has used them before ``step()``, the step breaks it too.
"""

import contextlib
import itertools
import weakref
from collections.abc import Callable

import torch
from torch import Tensor
from torch._dynamo.comptime import comptime

# key -> optimizer: a graph holds the key as a constant; the op finds the optimizer by it at run time
_OPTIMIZERS: "weakref.WeakValueDictionary[int, torch.optim.Optimizer]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(optimizer) -> tuple[int, Callable[[], tuple[int, tuple]]]:
    """A key for ``optimizer`` (each copy needs its own) and the function that tells where its
    tensor options are, to be stored on it when it is made: registering while dynamo traces would
    break the graph. The function runs at trace time, not traced (reading every option would make
    dynamo guard on each float: a new graph for each lr); one per optimizer, since dynamo may make
    the key a symbolic int."""
    key = next(_KEYS)
    _OPTIMIZERS[key] = optimizer
    this = weakref.ref(optimizer)
    option_places = torch._dynamo.assume_constant_result(lambda: _option_places(this().__dict__["param_groups"]))
    option_places.optimizer = this  # how _break_if_edited finds it where dynamo made the key symbolic
    return key, option_places


# cudagraph_unsafe: a CUDA graph (torch.compile's mode="reduce-overhead") would replay the kernels the
# step launched once, without its Python: step counts, lr and states read from the host frozen
@torch.library.custom_op("lowbit_optim::step", mutates_args=("params",), tags=(torch.Tag.cudagraph_unsafe,))
def _step(optimizer_id: int, params: list[Tensor], grads: list[Tensor], positions: list[int], options: list[Tensor], places: int) -> None:
    optimizer = _OPTIMIZERS.get(optimizer_id)
    if optimizer is None or not 0 <= places < len(_PLACES):
        # only a graph traced from a live optimizer's step() holds a valid pair
        raise RuntimeError(f"lowbit_optim::step: optimizer key {optimizer_id} or option places {places} is no live optimizer's: the op is emitted by step() while torch.compile traces, not called directly")
    with _dispatch_keys_of_a_plain_call():
        optimizer._step_params(params, grads, positions, traced=(_PLACES[places], options))


# The dispatch keys a TorchDispatchMode's handler excludes that a tensor can carry. AOTAutograd runs
# a graph's first call under such a mode (it checks custom ops' aliasing), so that call alone would
# see them excluded, and the step's own compiled functions, whose guards read their inputs' keys as
# the call sees them, would compile again at the second call (a RecompileError under
# set_stance("fail_on_recompile")).
_KEYS_A_MODE_EXCLUDES = tuple(
    getattr(torch._C.DispatchKey, name) for name in ("ADInplaceOrView", "Conjugate", "Negative", "ZeroTensor", "PythonTLSSnapshot")
)


@contextlib.contextmanager
def _dispatch_keys_of_a_plain_call():
    """The op's body with the dispatch keys a plain call of it sees, whether or not a
    TorchDispatchMode is handling it."""
    excluded = torch._C._dispatch_tls_local_exclude_set()
    if not excluded.has(torch._C.DispatchKey.PythonTLSSnapshot):  # no mode is handling it
        yield
        return
    for key in _KEYS_A_MODE_EXCLUDES:
        excluded = excluded.remove(key)
    with torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), excluded):
        yield


@_step.register_fake
def _step_fake(optimizer_id: int, params: list[Tensor], grads: list[Tensor], positions: list[int], options: list[Tensor], places: int) -> None:
    return None


# where the groups' tensor options were when a graph was traced, a tuple of (group index, key, item
# index or -1) each; the op finds them by their index here
_PLACES: list[tuple] = []


def _option_places(groups: list[dict]) -> tuple[int, tuple]:
    """Where the groups' tensor options (a tensor lr, tensor betas) are now, and the index of that in
    _PLACES."""
    places = tuple(
        (g, key, i)
        for g, group in enumerate(groups)
        for key, value in group.items() if key != "params"
        for i, item in ([(-1, value)] if isinstance(value, Tensor) else enumerate(value) if isinstance(value, (tuple, list)) else [])
        if isinstance(item, Tensor)
    )  # fmt: skip
    if places not in _PLACES:
        _PLACES.append(places)
    return _PLACES.index(places), places


def _option_at(groups: list[dict], place: tuple):
    """The option at ``place``, or None where there is none now."""
    g, key, i = place
    value = groups[g].get(key) if g < len(groups) else None
    if i != -1:
        value = value[i] if isinstance(value, (tuple, list)) and i < len(value) else None
    return value


@contextlib.contextmanager
def options_as_given(groups: list[dict], places: tuple, given: list[Tensor]):
    """The groups' tensor options at ``places`` replaced by those the op was given, for the step:
    an in-place edit traced before step() (``lr.fill_(...)``) is written back to the group's
    tensor only after the graph has run, and reaches the op through its input. (An option that
    became a tensor after the graph was traced, which it cannot have edited, is read as it is.)"""
    live = [_option_at(groups, place) for place in places]
    swaps = [(place, tensor) for place, tensor, now in zip(places, given, live) if isinstance(now, Tensor) and now is not tensor]
    saved = [(groups[g], key, groups[g][key]) for (g, key, _), _ in swaps]
    for (g, key, i), tensor in swaps:
        value = groups[g][key]
        groups[g][key] = tensor if i == -1 else type(value)(tensor if j == i else v for j, v in enumerate(value))
    try:
        yield
    finally:
        for group, key, value in reversed(saved):
            group[key] = value


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


STATES_USED_IN_GRAPH = (
    "{name}'s states are used inside this torch.compile'd function before its step(): the step writes them as "
    "it runs, which the graph does not see (an edit before it would be lost, a read after it would give the "
    "values before it). Use opt.state outside the compiled function, or compile without fullgraph=True (the "
    "step then runs after a graph break)"
)


def _break_if_edited(ctx) -> None:
    """At trace time: a graph break where the traced code has edited, and not yet written back, the
    param_groups list, a group or a group's params list of the optimizer stepped (the local
    ``key``; where dynamo made it symbolic, of any optimizer), or has taken one of its states (or a
    state's inner tensor) into the graph. Dynamo's records are internal: where they are not as read
    here, nothing is checked."""
    try:
        output = ctx._ComptimeContext__tx.output
        edits, nodes = output.side_effects, output.graph.nodes
        tracked = edits.id_to_variable
    except AttributeError:
        return
    stepped = _stepped(ctx)
    inputs = {id(example) for example in (getattr(node.meta.get("grapharg"), "example", None) for node in nodes if node.op == "placeholder") if example is not None}
    for optimizer in stepped:
        name = type(optimizer).__name__
        groups = optimizer.__dict__.get("param_groups", [])
        for edited in (groups, *groups, *(group["params"] for group in groups)):
            variable = tracked.get(id(edited))
            if variable is not None and edits.is_modified(variable):
                ctx.graph_break(GROUPS_EDITED_IN_GRAPH.format(name=name))
        for edited in (optimizer.state, *optimizer.state.values()):  # a state assigned: written back after the graph
            variable = tracked.get(id(edited))
            if variable is not None and edits.is_modified(variable):
                ctx.graph_break(STATES_USED_IN_GRAPH.format(name=name))
        if any(id(t) in inputs for states in optimizer.state.values() for value in states.values() for t in _tensors_of(value)):
            ctx.graph_break(STATES_USED_IN_GRAPH.format(name=name))


def _make_states(ctx) -> None:
    """At trace time: the states the stepped optimizer's step will make, made now (base's
    _make_states), so that code traced after the step finds them (a new graph input each)."""
    stepped = _stepped(ctx)
    if len(stepped) == 1:  # (where dynamo made the key symbolic and neither tells which: none)
        stepped[0]._make_states()


def _stepped(ctx) -> list:
    """The optimizer being stepped, from the traced ``step``'s locals: by its key, or where dynamo made
    that symbolic, by its option_places function (every optimizer where neither tells)."""
    key = ctx.get_local("key")
    if key.is_python_constant():
        return [_OPTIMIZERS[key.as_python_constant()]]
    try:
        function = ctx.get_local("option_places")._i_will_not_complain_if_bc_breaks_VariableTracker().fn
    except AttributeError:  # (dynamo's internals: where they are not as read here, every optimizer)
        function = None
    this = getattr(function, "optimizer", None)
    optimizer = this() if this is not None else None
    return [optimizer] if optimizer is not None else list(_OPTIMIZERS.values())


def _tensors_of(value) -> list:
    """A state and, for a tensor subclass (a quantized state), its inner tensors."""
    if not isinstance(value, Tensor):
        return []
    flatten = getattr(value, "__tensor_flatten__", None)
    inner = [getattr(value, n) for n in flatten()[0]] if flatten is not None else []
    return [value, *inner]


def step(key: int, params: list[Tensor], groups: list[dict], option_places) -> None:
    """The step of the optimizer registered as ``key`` over ``params`` (all of its parameters, in
    param-group order; ``groups``: its param_groups; ``option_places``: what register gave) as one
    op of the graph being traced."""
    comptime(_break_if_edited)
    comptime(_make_states)
    index, places = option_places()
    options = [groups[g][name] if i == -1 else groups[g][name][i] for g, name, i in places]
    torch.ops.lowbit_optim.step(key, *with_grads(params), options, index)
