"""LowBitOptimizer: what every optimizer of the package inherits.

An optimizer is its plain step function (functional.py, written as if states were fp32 tensors) and
a declaration: its states (``State``: name, signed or not, initial value, when it exists), its
hyper-parameters (the constructor's keywords, validated by ``_check_group``) and how they reach the
step function (``_step_arguments``: numbers, sent as 0-d tensors so that changing them never
recompiles, and flags, which pick a graph). Everything else lives here, once: param groups, state
formats per group and per state, ``min_quantize_numel``, ``param_update`` modes for bf16 weights,
creating states (DTensor ones under FSDP2), the compiled and eager steps, the fused CPU kernel where
an optimizer has one, ``opt.step()`` inside the user's torch.compile (step_op.py), checkpoints that
convert between formats, copies, and the errors for bad input.

See optim.py for the optimizers declared this way and examples/custom_optimizer.py for a new one.
"""

import contextlib
import copy
import functools
import inspect
import itertools
import math
import numbers
import types
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from . import foreign, formats, fused_cpu, in_backward, kernel_build, precision, step_op
from .distributed import is_dtensor, laid_out_like, like_param, local, map_local, shard_like
from .state import StateTensor, check_block_size, describe_tensor, not_plain, signedness_mismatch
from .user_frame import outside_stacklevel

# Per format x param dtype x flag combination there is one graph; more than dynamo's default limit
# of 8 per function is normal here and must not silently fall back to eager.
_RECOMPILE_LIMIT = 256
# Every optimizer, format and flag of a process compiles on the step function's one code object: a
# notebook's or a sweep's configurations add up (dynamo's default, 256, failed every new one for good)
_ACCUMULATED_RECOMPILE_LIMIT = 8192

# the last step's global gradient norm (max_grad_norm with step_in_backward), in each param group of a
# state_dict: torch.distributed.checkpoint's get_state_dict keeps only states and groups (older
# checkpoints hold it beside them)
_LAST_GRAD_NORM = "last_grad_norm"

# group keys fixed by the optimizer's construction: a loaded checkpoint must not change them
_STRUCTURAL_KEYS = (
    "state_format", "block_size", "min_quantize_numel", "param_update", "compensation_format",
    "foreach", "capturable", "differentiable", "fused",
)  # fmt: skip

# the structural keys that make the states (their formats, blocks, extra buffers): edited after a
# group is built, its states would no longer be what it says (the step checks, _check_edits)
_STATE_KEYS = ("state_format", "block_size", "min_quantize_numel", "param_update", "compensation_format")

# the per-parameter states lowbit_optim keeps beside an optimizer's declared ones
_OWN_STATE_NAMES = ("step", "compensation", "param_correction")

# the state names of the optimizers this process knows (torch.optim's, and each LowBitOptimizer
# subclass adds its own): a checkpoint's key among them that an optimizer does not keep says the
# checkpoint is another optimizer's; any other key is its user's, kept as torch.optim keeps it
_OPTIMIZER_STATE_NAMES = {
    "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "square_avg", "grad_avg", "acc_delta", "sum",
    "mu", "eta", "ax", "prev", "step_size", "mu_product", "exp_avg_slow",
}  # fmt: skip

_COUNT_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}


@functools.cache
def compiled_step(step_function):
    """``step_function`` under torch.compile, one compiled function per step function, shared by
    every optimizer instance and format. Shapes are dynamic, so the number of graphs depends on the
    formats and flags in use, never on the number of distinct parameter shapes."""
    return _compiled(step_function, step_function)


def _compiled(function, step_function):
    """``function`` under torch.compile with dynamic shapes and ``step_function``'s inductor options.
    It runs without duck sizing: sizes that happen to be equal in one call (a square matrix's two
    low-rank factors, two parameters of a foreach chunk) must not be assumed equal in the next, or
    a graph traced or cached so would be retraced per arrangement of shapes, or fail another's."""
    compiled = torch.compile(private_copy(function, "lowbit_optim"), fullgraph=True, dynamic=True, options=_inductor_options(step_function))

    def run(*args, **kwargs):
        # on meta: nothing to compute, and dynamo cannot fake a state subclass there; under a TorchDispatchMode
        # (FlopCounterMode) dynamo skips the frame, which fullgraph=True refuses: the same formulas eagerly
        if _on_meta(args[0]) or _WITHOUT_COMPILER or torch._C._len_torch_dispatch_stack():
            return function(*args, **kwargs)
        with _configured(torch.fx.experimental._config, use_duck_shape=False), _raised_recompile_limit():
            try:
                return compiled(*args, **kwargs)
            except Exception as error:  # (compiling fails before the graph runs: nothing is stepped yet)
                missing = _lacks_compiler(error)
                if missing is None:
                    raise
                _WITHOUT_COMPILER.append(missing)
                warnings.warn(
                    f"lowbit_optim: torch.compile found no C++ compiler ({type(missing).__name__}), so steps run "
                    "eagerly instead: the same formulas, slower. Install g++ (or set CXX), or pass compile=False to choose this",
                    stacklevel=outside_stacklevel(),
                )
        return function(*args, **kwargs)

    return run


def private_copy(function, owner: str):
    """``function`` under a code object of its own, named for ``owner``: dynamo keeps a function's
    graphs on its code object and counts them against recompile_limit there, so the optimizers'
    graphs of a public step function (lowbit_optim.adam_step) and those of a user who compiles it
    too must not share one (the user's would fail their limit of 8 after the optimizers' 6)."""
    if not isinstance(function, types.FunctionType):  # a functools.partial, a callable object: a function that calls it
        called = function

        def function(*args, **kwargs):
            return called(*args, **kwargs)

        function.__name__ = getattr(getattr(called, "func", called), "__name__", type(called).__name__)
    name = f"{function.__name__}__{owner}"
    code = function.__code__.replace(co_name=name, co_qualname=name)
    duplicate = types.FunctionType(code, function.__globals__, name, function.__defaults__, function.__closure__)
    duplicate.__kwdefaults__ = function.__kwdefaults__
    return duplicate


_WITHOUT_COMPILER: list = []  # the error that showed torch.compile has no C++ compiler here (then steps run eagerly)


def _behind(error: BaseException, matches: Callable[[BaseException], bool]) -> BaseException | None:
    """The first exception in ``error``'s chain (inductor's wrapped ones included) that ``matches``, or None."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if matches(error):
            return error
        error = getattr(error, "inner_exception", None) or error.__cause__ or error.__context__
    return None


def _lacks_compiler(error: BaseException) -> BaseException | None:
    """The InvalidCxxCompiler behind ``error``, or None."""
    return _behind(error, lambda e: type(e).__name__ == "InvalidCxxCompiler")


def _on_meta(first) -> bool:
    """Whether a compiled function's first argument, a tensor or a foreach chunk's list of calls
    (each beginning with its parameter, all on one device), is on the meta device."""
    return (first if isinstance(first, Tensor) else first[0][0]).is_meta


@contextlib.contextmanager
def _configured(config, **values):
    """``config``'s attributes set to ``values`` while in the block. Set and restored by hand: a
    config module's .patch builds a class per call (~13 us on the EPYC, paid per parameter and step
    by every compiled call; this takes ~5 us)."""
    previous = {name: getattr(config, name) for name in values}
    for name, value in values.items():
        setattr(config, name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(config, name, value)


def _raised_recompile_limit():
    """dynamo's recompile_limit at _RECOMPILE_LIMIT while in the block, and its limit of a code
    object's graphs in all at _ACCUMULATED_RECOMPILE_LIMIT (or the user's, if higher): around each
    compiled call (_compiled), so that a step the kernel takes alone does not pay for it."""
    accumulated = max(torch._dynamo.config.accumulated_recompile_limit, _ACCUMULATED_RECOMPILE_LIMIT)
    return _configured(torch._dynamo.config, recompile_limit=_RECOMPILE_LIMIT, accumulated_recompile_limit=accumulated)


def _inductor_options(step_function) -> dict | None:
    # a step function that computes in bf16 on purpose (Muon's Newton-Schulz) asks inductor to round
    # each bf16 result as eager does, rather than keep fused intermediates in fp32
    options = getattr(step_function, "inductor_options", None)
    return options if options is not None else getattr(getattr(step_function, "func", None), "inductor_options", None)  # a partial's function's


# parameters per foreach graph: its compile time grows with it (~1 s per parameter on 2 CPU cores),
# while the per-call overhead it saves is mostly gone at this size
FOREACH_CHUNK = 16
# elements per foreach graph, so that its scratch stays bounded however large the parameters: ~45 MiB
# at the ~5.4 bytes per element of 8bit measured on an H200 (326 MiB for a chunk of 63M), 160 MiB at
# the ~20 of the compiled step on the CPU. An elementwise step cuts larger parameters into slices
# (_pieces) of this size, each stepped by the per-parameter graph (few calls, whose host time is
# then a small part of theirs)
FOREACH_ELEMENTS = 8 << 20


@functools.cache
def compiled_foreach_step(step_function):
    """``step_function`` applied to a list of parameters in ONE compiled graph (``foreach``). Each
    call of a per-parameter graph costs tens of microseconds of guards, subclass unwrapping and
    kernel launches; on a GPU that, not the arithmetic, is most of the step's time. The numbers are
    the per-parameter graph's: each parameter's operations are the same, only traced together."""

    def step_each(calls: list[tuple], numbers: list[Tensor], param_updates: tuple[str, ...], flags: dict) -> None:
        for arguments, param_update in zip(calls, param_updates):
            step_function(*arguments, *numbers, **flags, param_update=param_update)

    return _compiled(step_each, step_function)


def _foreach_chunks(compiled: list[tuple]) -> list[list[tuple]]:
    """The (parameter, arguments, param_update) items in chunks of at most FOREACH_CHUNK items and
    FOREACH_ELEMENTS elements (a larger item alone) whose arguments have the same kinds (tensor
    class and dtype, or None), device (the parameter's) and mode, so that chunks of a model's
    repeated layers share one graph."""
    chunks, filling = [], {}  # filling: kind -> (its open chunk, that chunk's elements)
    for item in compiled:
        _, call, mode = item
        # the device once, the parameter's (a graph's tensors share one): a.device costs a new object each.
        # Which tensors have a size of 1 (a 1-element parameter, a state of one block), which dynamo
        # specializes: a chunk that mixed them compiled a graph per arrangement (16 for 256 parameters)
        kind = (call[0].device, mode, *((type(a), a.dtype, *_sizes_of_one(a)) if isinstance(a, Tensor) else a for a in call))
        chunk, elements = filling.get(kind, (None, 0))
        n = call[0].numel()
        if chunk is None or len(chunk) == FOREACH_CHUNK or elements + n > FOREACH_ELEMENTS:
            chunk, elements = [], 0
            chunks.append(chunk)
        chunk.append(item)
        filling[kind] = (chunk, elements + n)
    return chunks


def _sizes_of_one(t: Tensor) -> tuple[bool, ...]:
    """Whether each of the tensors a step reads of ``t`` (a state's inner ones) has one element."""
    # (by name, not through _inner()'s dict: this runs per state and step on the foreach path)
    return tuple(getattr(t, name).numel() == 1 for name in t.inner_names) if isinstance(t, StateTensor) else (t.numel() == 1,)


# elements per call of an elementwise compiled step on a large CPU parameter: its scratch (a few fp32
# copies of what it steps, ~20 bytes per element) then stays near 20 MiB, never a whole parameter's
# (on an accelerator the slices are FOREACH_ELEMENTS long: there each call costs its host time)
COMPILED_CHUNK = 1 << 20
# The fused kernel steps non-contiguous parameters (channels_last) through contiguous copies kept by
# the optimizer, up to this many elements at a time (or one larger parameter): 16 MiB of fp32 for
# the parameters' and as much for their gradients
SCRATCH_ELEMENTS = 1 << 22


def element_runs(entries: list, sizes: list[int], limit: int) -> list[list]:
    """``entries`` in order, in runs of at most ``limit`` elements (``sizes``: each entry's), a
    larger entry alone."""
    runs, elements = [[]], 0
    for entry, size in zip(entries, sizes):
        if runs[-1] and elements + size > limit:
            runs.append([])
            elements = 0
        runs[-1].append(entry)
        elements += size
    return [run for run in runs if run]


def _pieces(call: tuple, limit: int) -> list[tuple]:
    """A flat step function's arguments (param, grad, step, *states, param_extra) cut into
    consecutive slices of at most about ``limit`` elements on the states' block boundaries, so
    each slice computes exactly what the whole would (blocks are quantized alone, and the dither of
    stochastic rounding depends on an element's place in its block). The step counter is counted
    once: the later slices get a copy of its value before the step, and so of a state's count of
    writes (10bit-sr, bf16-sr: StateTensor.later_slice, which also makes the count salt a slice's
    blocks as their place in the whole state does). A state without a slice_unit (factored sums,
    a low-rank part) is never cut, nor a parameter of one chunk."""
    n = call[0].numel()
    if n <= limit:  # most parameters: nothing else to look at (this runs for each, every step)
        return [call]
    cut = [isinstance(a, Tensor) and a.dim() == 1 and a.numel() == n for a in call]
    if not cut[0]:
        return [call]
    unit = 1
    for a, sliced in zip(call, cut):
        if sliced and isinstance(a, StateTensor):
            if a.slice_unit is None:
                return [call]
            unit = math.lcm(unit, a.slice_unit)
    size = max(limit // unit, 1) * unit
    # detached views, as _flat's: dynamo cannot bind a view's size as its base's size minus its offset
    # (a first graph traced on slices whose last one ends in a partial block failed)
    pieces = [tuple(a[start : start + size].detach() if sliced else a for a, sliced in zip(call, cut)) for start in range(0, n, size)]
    step = call[2]
    if step is not None:  # the first slice counts the step; the others count copies of its value before it
        before = step.clone()
        pieces[1:] = [(*piece[:2], before.clone(), *piece[3:]) for piece in pieces[1:]]
    for i, a in enumerate(call):
        if cut[i] and isinstance(a, StateTensor) and a.whole_state_names:
            for k in range(1, len(pieces)):
                pieces[k] = (*pieces[k][:i], pieces[k][i].later_slice(k * size // a.slice_unit), *pieces[k][i + 1 :])
    return pieces


def _cpu_by_default(method):
    """``method`` with the tensors it makes without a device (step counters, as torch.optim's,
    scratch buffers, tables) on the CPU where the caller made another device the default
    (torch.set_default_device, ``with torch.device(...)``): they would land there."""

    @functools.wraps(method)
    def on_the_cpu(*args, **kwargs):
        if torch._C._len_torch_function_stack() and torch.get_default_device().type != "cpu":  # (the first: 0.05 us)
            with torch.device("cpu"):
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return on_the_cpu


class StateFormatError(ValueError):
    """A state format refused for one of an optimizer's states (one that holds nonnegative values only
    for a signed state, _check_signed; one too coarse for a slow average, _check_decays), with a
    per-state ``state_format`` that works. ``spelled`` is how the caller passes it: a wrapper such
    as MuonWithAdamW takes it inside its own keyword."""

    def __init__(self, reason: str, state_format: dict, spelled: str | None = None):
        self.reason, self.state_format, self.spelled = reason, state_format, spelled
        super().__init__(f"{reason}, e.g. {spelled or f'state_format={state_format}'}")

    def restated(self, *, context: str = "", spelled: str | None = None) -> "StateFormatError":
        """The same refusal with ``context`` before it, or its format spelled as the caller takes it."""
        return type(self)(context + self.reason, self.state_format, spelled or self.spelled)

    def __reduce__(self):  # pickles (multiprocessing) with its fields and notes, not only its message
        return type(self), (self.reason, self.state_format, self.spelled), self.__dict__


@dataclass(frozen=True)
class State:
    """A tensor an optimizer keeps per parameter, as its step function sees it (an fp32 tensor).

    - ``signed``: whether its values can be negative (picks the signed or unsigned codebook; a
      format holding only nonnegative values, such as ``factored``, refuses a signed state);
    - ``initial``: the value it starts from;
    - ``when``: a param-group key; the state exists only where that option is true or nonzero
      (amsgrad's running maximum, SGD's momentum buffer). The step function gets None otherwise;
    - ``follows``: another state whose format it takes (amsgrad's maximum follows exp_avg_sq); a
      per-state ``state_format`` dict names only the states that follow none;
    - ``decay``: for a moving average, the share of itself it keeps per step (its beta) as a function
      of the param group. A format whose rounding noise is fresh at every write holds signed averages
      up to its ``max_signed_decay`` only (lowrank.py), and the optimizer refuses it for a slower one
      when a group is added or a checkpoint loads its betas, and at the next step after a beta is
      edited (not a tensor beta changed in place);
    - ``running_max``: the state is a running maximum of each element (amsgrad's), which a format
      that keeps no element's value of its own (``factored``'s row and column sums) would shrink at
      every write: the optimizer refuses that format for it, as for a slow average (``decay``).
    """

    name: str
    signed: bool
    initial: float = 0.0
    when: str | None = None
    follows: str | None = None
    decay: Callable[[dict], float] | None = None
    running_max: bool = False

    def __post_init__(self):  # refused where it is declared, not at the first step
        if isinstance(self.initial, bool) or not isinstance(self.initial, numbers.Real):
            raise TypeError(
                f"State {self.name!r}: initial must be a number, the same for every group, got {self.initial!r}. For a "
                "start that depends on the group (as Adagrad's initial_accumulator_value), start at 0 and add it in the "
                "step function where the step count is 1"
            )

    def too_slow_for(self, fmt, group: dict) -> float | None:
        """This average's decay under ``group`` where ``fmt`` cannot hold it (above its
        max_signed_decay), else None (also for a state that does not exist under the group)."""
        if not self.signed or self.decay is None or fmt.max_signed_decay is None or (self.when is not None and not group.get(self.when)):
            return None
        decay = float(self.decay(group))
        # in float32: a beta given as a float32 tensor (0.99 is 0.9900000095) is the float it was written as
        return decay if _float32(decay) > _float32(fmt.max_signed_decay) else None


class LowBitOptimizer(torch.optim.Optimizer):
    """An optimizer with its states in any registered format, settable per param group (and per
    state with a dict ``{state name: format}``). Subclasses declare ``step_function``, ``states``,
    ``_check_group`` and ``_step_arguments`` and pass their hyper-parameters to ``__init__``.

    Options every optimizer takes (keyword-only):

    - ``state_format``: "fp32" (default), "bf16", "8bit", "4bit", "fp8", ... or a dict per state.
      Parameters with fewer than ``min_quantize_numel`` elements keep fp32 state; every larger one
      is quantized, padded to whole blocks (``block_size``: the format's default unless given).
    - ``param_update``: how updates land in bf16 parameters: "nearest", "stochastic", "kahan"
      (compensation buffer in ``compensation_format``, bf16 unless given; given without "kahan" it
      is refused) or "int8-correction" (precision.py).
      ``bf16_stochastic_round=True`` is torchao's spelling of ``param_update="stochastic"``.
    - ``compile=False`` runs the same step function eagerly (slow; for debugging).
    - ``fused`` (as in torch.optim): for optimizers with an update in the fused CPU kernel (Adam,
      AdamW, SGD, Lion, AdEMAMix; Muon's momentum), None steps every CPU parameter it can take in the kernel, True
      requires it, False never uses it (a class with ``fused_default_needs_codes``, Muon, leaves
      parameters whose states are all plain fp32 or bf16 tensors to the compiled step under None);
      the others always take the compiled step (None or False; True is an error).
    - ``foreach`` (as in torch.optim, a choice of implementation, never of numbers): True runs the
      compiled step as one graph per chunk of up to FOREACH_CHUNK parameters (and FOREACH_ELEMENTS
      elements), cutting the per-call overhead that dominates a GPU step (README, "On a GPU");
      False calls it per parameter, whose graphs compile far faster (~1 s per parameter in a
      foreach graph on 2 CPU cores); None, as in torch.optim, is True for parameters on an
      accelerator (any device but the CPU) when more than one is stepped at once (not the step in
      backward's single parameters), and False on the CPU (where the fused kernel steps most).
      ``capturable`` and ``differentiable`` must stay False.
    - ``step_in_backward=True`` steps each parameter inside backward, as soon as its gradient is
      accumulated, and frees that gradient: a whole model's gradients never exist at once. ``step()``
      then steps only gradients the backward left (none, in a plain loop) and ``zero_grad()`` has
      nothing to clear, so loops keep their shape; accumulate micro-batches inside
      ``with opt.accumulating():``. The numbers are those of stepping after backward (README,
      "Step in backward", for what cannot combine). ``max_grad_norm`` clips there with an estimate of
      the step's global gradient norm (in_backward.py); ``last_grad_norm`` is each step's.
    """

    step_function = None  # the plain step: (param, grad, step, *states, param_extra, *numbers, **flags, param_update)
    states: tuple[State, ...] = ()
    flat_step = True  # the step function sees 1-D views (one graph for every shape); False: the parameter's shape
    # each element's new values depend on the same element of every input only (no sum over the
    # parameter): a large parameter is then stepped in slices (COMPILED_CHUNK), bounding the scratch
    elementwise_step = False
    # True: fused=None takes the kernel only for parameters with a state in codes (a StateTensor);
    # for plain fp32 / bf16 states the compiled step is as fast (Muon: the kernel's part is one
    # elementwise pass, which the compiled step fuses into the graph of its iterations)
    fused_default_needs_codes = False
    family: str | None = None  # how messages name the optimizer (default: the class name)
    torch_name: str | None = None  # the torch.optim class computing the same step, if any (named in errors)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.step_function is None and cls.states:
            raise TypeError(f"{cls.__name__} declares states but no step_function: set step_function = staticmethod(your_step)")
        names = [s.name for s in cls.states]
        _OPTIMIZER_STATE_NAMES.update(names)
        reserved = sorted(set(_OWN_STATE_NAMES) & set(names))
        if reserved:
            raise TypeError(f"{cls.__name__} declares a state named {reserved[0]!r}, a name lowbit_optim keeps for its own: rename that state")
        if len(set(names)) != len(names):
            raise TypeError(f"{cls.__name__} declares two states named {next(n for n in names if names.count(n) > 1)!r}: give each state its own name")

    def __init__(
        self,
        params,
        hyperparameters: dict,
        *,
        state_format="fp32",
        block_size: int | None = None,
        min_quantize_numel: int = 4096,
        param_update: str = "nearest",
        compensation_format=None,
        bf16_stochastic_round: bool = False,
        compile: bool = True,
        fused: bool | None = None,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        step_in_backward: bool = False,
        max_grad_norm: float | None = None,
        **unknown,
    ):
        if unknown:  # (Python's own error would name LowBitOptimizer.__init__, not the class called)
            raise TypeError(
                f"{type(self).__name__} got an unexpected keyword argument {next(iter(unknown))!r}; it takes "
                f"{', '.join(_keywords(type(self)))}"
            )
        for key, value in (("bf16_stochastic_round", bf16_stochastic_round), ("compile", compile), ("step_in_backward", step_in_backward)):
            check_flag(key, value)
        if bf16_stochastic_round:
            if param_update not in ("nearest", "stochastic"):
                raise ValueError(f"bf16_stochastic_round=True contradicts param_update={param_update!r}; pass one of them")
            param_update = "stochastic"
        _check_torch_keywords(fused, foreach, capturable, differentiable)
        if _names_a_compensation(compensation_format) and self._refuses_unused_compensation and param_update != "kahan":
            params = list(params)  # (torch.optim lists them too) a group of its own may choose Kahan summation
            if not any(isinstance(g, dict) and g.get("param_update") == "kahan" for g in params):
                raise ValueError(_unused_compensation(compensation_format, param_update))
        if fused and not compile:
            raise ValueError("fused=True contradicts compile=False (the eager reference step); pass one of them")
        defaults = dict(
            **hyperparameters,
            state_format=state_format,
            block_size=block_size,
            min_quantize_numel=min_quantize_numel,
            param_update=param_update,
            compensation_format="bf16" if compensation_format is None else compensation_format,  # torchdistx's
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused if compile else False,
        )
        if step_in_backward and foreach:
            raise ValueError(
                "foreach=True steps parameters in groups after backward, and step_in_backward=True steps each one as "
                "its gradient arrives: pass one of them"
            )
        in_backward.check_max_grad_norm(max_grad_norm, step_in_backward)
        self._compile = bool(compile)
        self._step_in_backward = bool(step_in_backward)
        self._max_grad_norm = max_grad_norm
        self.last_grad_norm: Tensor | None = None  # with max_grad_norm: the last backward's global gradient norm
        self._step_op_key, self._option_places = step_op.register(self)
        self._constructed = False  # its parameters are owned once every group is accepted (in_backward.own)
        super().__init__(params, defaults)
        self._constructed = True
        in_backward.own(self, self._params(), stacklevel=3)

    # ---- what an optimizer declares ---------------------------------------------------------------

    def _check_group(self, group: dict) -> None:
        """Raise a ValueError naming a bad hyper-parameter of ``group`` (lr is checked already)."""

    # the positions of _step_arguments' numbers that the step takes in float64 (the others: fp32)
    float64_numbers: tuple[int, ...] = ()

    def _step_arguments(self, group: dict) -> tuple[tuple, dict]:
        """The step function's numbers (after the states and ``param_extra``: numbers and tensors
        become fp32 0-d tensors, those at the positions ``float64_numbers`` names float64 ones) and
        its flags (keywords that pick a graph)."""
        raise NotImplementedError(
            f"{type(self).__name__} defines no _step_arguments(group): return (numbers, flags), the numbers its step_function "
            "takes after the states and a dict of the keywords that pick its graph, e.g. "
            "return (group['lr'], group['eps']), dict(maximize=group['maximize'])"
        )

    # it takes over parameters that another optimizer steps in backward when it is built, so that
    # its step() need not be refused (in_backward._refuse_a_step_of_another)
    owns_in_backward = True

    # a compensation_format given without param_update="kahan" is refused (it would do nothing);
    # AnyPrecisionAdamW ignores it, as torchdistx does its compensation_buffer_dtype
    _refuses_unused_compensation = True

    # set once a step (step() or a hook of the step in backward) has stepped a parameter: before that,
    # a step without gradients warns (SGD without momentum keeps no state to tell by)
    _has_stepped = False

    _fused_step = None  # a method (items, group, corrections) -> None where the fused CPU kernel steps this optimizer
    # torchao's rule: a tensor that is not a whole number of blocks keeps fp32 state (its FP8 aliases
    # and its 4-bit format follow it, so that its runs and checkpoints carry on bit for bit);
    # otherwise the last block is padded
    whole_blocks_only = False

    # ---- copies ---------------------------------------------------------------------------------

    def _params(self) -> list[Tensor]:
        """Every parameter, in param-group order."""
        return [p for group in self.param_groups for p in group["params"]]

    @property
    def _groups(self) -> list[dict]:
        return self.__dict__["param_groups"]

    @property
    def _step_fn(self):
        cls = type(self)
        return compiled_step(cls.step_function) if self._compile else cls.step_function

    @property
    def _family(self) -> str:
        return self.family or type(self).__name__

    def __getstate__(self) -> dict:
        # torch.optim pickles only defaults, state and param groups; deepcopy and pickle need the rest
        keys = ("_compile", "_step_in_backward", "_max_grad_norm", "last_grad_norm")
        # each group's options as last checked, in param_groups' order: a copy refuses the edits the original would
        remembered = self.__dict__.get("_remembered_groups", {})
        checked = [remembered[id(g)][1] if remembered.get(id(g), (None,))[0] is g else None for g in self.param_groups]
        return {**super().__getstate__(), **{key: self.__dict__[key] for key in keys}, "_checked_options": checked}

    def __setstate__(self, state):
        defaults = dict(_compile=True, _step_in_backward=False, _max_grad_norm=None, last_grad_norm=None)
        for key, value in defaults.items():
            state.setdefault(key, self.__dict__.get(key, value))
        checked = state.pop("_checked_options", None)  # (a copy's: load_state_dict's call has none)
        super().__setstate__(state)
        if checked is not None:
            self.__dict__["_remembered_groups"] = {id(g): (g, options) for g, options in zip(self.param_groups, checked) if options is not None}
        if "_step_op_key" not in self.__dict__:  # a copy (not load_state_dict) is an optimizer of its own
            self._step_op_key, self._option_places = step_op.register(self)
            if self._step_in_backward:  # its parameters are copies too: they need hooks of their own
                for group in self.param_groups:
                    in_backward.hook_params(self, group, copied=True)
            in_backward.own(self, self._params(), stacklevel=3)
        for group in self.param_groups:
            for key, value in self.defaults.items():
                group.setdefault(key, value)

    # ---- param groups ---------------------------------------------------------------------------

    def add_param_group(self, param_group: dict) -> None:
        if not isinstance(param_group, dict):  # (torch.optim's own check, which comes after ours reads it)
            raise TypeError(f"param_group must be a dict such as {{'params': [...], 'lr': 1e-3}}, got {type(param_group).__name__}")
        # a group that names its own formats inherits the constructor's block_size without using it
        block_size_given = "block_size" in param_group or "state_format" not in param_group
        compensation_given = _names_a_compensation(param_group.get("compensation_format")) and self._refuses_unused_compensation
        super().add_param_group(param_group)
        try:
            self._check_new_group(self.param_groups[-1], block_size_given)
            group = self.param_groups[-1]
            if compensation_given and group["param_update"] != "kahan":
                raise ValueError(_unused_compensation(group["compensation_format"], group["param_update"], "a param group's "))
            if self._step_in_backward:  # checks every parameter before it hooks any
                in_backward.hook_params(self, self.param_groups[-1])
        except BaseException:
            self.param_groups.pop()  # a refused group must not be stepped (torch.optim refuses before adding)
            raise
        if self.__dict__.get("_constructed", True):  # (the constructor owns its groups' parameters once it is done)
            in_backward.own(self, self.param_groups[-1]["params"], stacklevel=2)

    def _check_new_group(self, group: dict, block_size_given: bool) -> None:
        """Validates and normalizes the group add_param_group has just added (the last one)."""
        for key, value in group.items():  # NumPy scalars as Python numbers: the step's float64 arithmetic (1 - beta) then holds
            if key != "params":
                group[key] = self._normalized(key, value)
        for state in self.states:
            if state.when is not None and state.when not in group:
                raise TypeError(f"{type(self).__name__}'s state {state.name!r} exists when={state.when!r}, which is no option of its groups: name one of {sorted(k for k in group if k != 'params')}")
        self._check_hyper_parameters(group)
        check_element_count("min_quantize_numel", group["min_quantize_numel"])
        no_kernel = _no_kernel_reason(type(self))
        if group["fused"] and no_kernel is not None:
            raise ValueError(f"fused=True, but {no_kernel}. Pass fused=None (the default) or False")
        if "bf16_stochastic_round" in group:  # torchao's per-group spelling
            check_flag("bf16_stochastic_round", group["bf16_stochastic_round"])
            if group.pop("bf16_stochastic_round"):
                group["param_update"] = "stochastic"
        precision.check_param_update(group["param_update"])
        # names keep state_dict() loadable with torch.load(weights_only=True)
        group["state_format"] = self._format_names(group["state_format"])
        group["compensation_format"] = formats.get_format(group["compensation_format"]).name
        used = self._state_format_names(group)
        devices = [p.device for p in group["params"] if p.device.type != "meta"]  # (meta: parameters not yet materialized)
        for state in self.states:
            fmt = formats.get_format(used[state.name])
            self._check_signed(state, fmt)
            if formats.is_quantized(fmt):
                fmt.check_format(state.signed, devices[0] if devices else torch.device("cpu"))
        self._check_decays(group)
        self._check_running_maxima(group)
        if group["param_update"] == "kahan":
            _check_compensation_format(formats.get_format(group["compensation_format"]))
        else:
            del used["compensation"]
        for name in used.values():
            fmt = formats.get_format(name)
            if group["block_size"] is not None and formats.is_blockwise(fmt):
                check_block_size(group["block_size"], fmt.bits, chosen=True)
        blockwise = group["block_size"] is not None and any(formats.is_blockwise(formats.get_format(n)) for n in used.values())
        if block_size_given and group["block_size"] is not None and not blockwise:
            raise ValueError(
                f"block_size={group['block_size']} applies to blockwise state formats (8bit, 4bit, fp8, ...), but "
                f"state_format {group['state_format']!r} has no blocks: drop block_size or pick a blockwise format"
            )
        if len({id(p) for p in group["params"]}) != len(group["params"]):  # torch.optim only warns, and steps such a parameter twice
            raise ValueError("a param group lists a parameter more than once: list each once (model.parameters() does)")
        for p in group["params"]:
            _check_param(p, self.torch_name)
        _check_fp16_update(group, group["params"])
        if group["fused"]:  # what the kernel refuses of a parameter itself (its states decide at its first step)
            for p in group["params"]:
                reason = None if p.device.type == "meta" else fused_cpu.param_unsupported_reason(local(p), None, {}, param_update_of(p, group))
                if reason is not None:  # (a RuntimeError, as torch.optim's fused=True refuses a parameter)
                    raise RuntimeError(_kernel_refuses(p, reason))
            quantized = any(p.numel() >= group["min_quantize_numel"] for p in group["params"])  # (smaller ones keep fp32 states)
            reason = fused_cpu.block_size_unsupported_reason(group["block_size"]) if blockwise and quantized else None
            if reason is not None:
                raise RuntimeError(f"fused=True, but the fused CPU kernel cannot step {reason}. Pass a smaller block_size, or fused=None to step such states with the compiled step")
        self._remember_group(group)

    def _check_hyper_parameters(self, group: dict) -> None:
        """The constructor's checks of a group's numbers, for its own groups and a checkpoint's."""
        for key, value in group.items():
            if key not in ("params", "lr"):  # (lr's own check has it)
                _check_float_range(key, value)
        _check_lr(group["lr"])
        flags = {*_flag_keys(type(self)), *(k for k, v in self.defaults.items() if isinstance(v, bool))}
        for key in sorted(flags):
            if key in group:
                check_flag(key, group[key])
        self._check_group(group)
        for key, value in group.items():  # after the optimizer's own checks, whose messages say more
            if key in self.defaults:  # (a key of the user's, kept as torch.optim keeps it, is not ours to check)
                _check_finite(key, value)

    def _format_keys(self) -> list[str]:
        """The states a per-state ``state_format`` dict names: those that follow no other."""
        return [s.name for s in self.states if s.follows is None]

    def _format_names(self, spec):
        """A format spec as registry names: one name, or {state name: name} for every format key."""
        if not isinstance(spec, Mapping):  # (a config's mapping, OmegaConf's DictConfig, reads as a dict)
            return formats.get_format(spec).name
        keys = self._format_keys()
        if set(spec) != set(keys):
            raise ValueError(f"a per-state state_format for {self._family} needs exactly the keys {keys}, got {sorted(spec)}")
        return {k: formats.get_format(spec[k]).name for k in keys}

    def _state_format_names(self, group: dict) -> dict:
        """State name -> format name under ``group``'s options, for every declared state and the
        Kahan "compensation" buffer."""
        spec = group["state_format"]
        names = {s.name: spec[s.follows or s.name] if isinstance(spec, dict) else spec for s in self.states}
        return {**names, "compensation": group["compensation_format"]}

    def _check_signed(self, state: State, fmt) -> None:
        if not state.signed or fmt.holds_signed:
            return
        unsigned = [s for s in self._format_keys() if not self._state(s).signed]
        if not unsigned:
            raise ValueError(
                f"the {fmt.name!r} state format holds nonnegative states only, and {self._family}'s "
                f"{' and '.join(self._format_keys())} can be negative: pick another format"
            )
        example = {k: (fmt.name if k in unsigned else "4bit") for k in self._format_keys()}
        raise StateFormatError(f"the {fmt.name!r} state format holds nonnegative states only: use it for {', '.join(unsigned)}", example)

    def _check_decays(self, group: dict) -> None:
        """Refuse a format for a signed average slower than it holds (State.decay,
        StateTensor.max_signed_decay), as the group stands: when it is added, and when a checkpoint
        loads its numbers, and at a step after an edit of them (_check_edits)."""
        used, too_slow = self._state_format_names(group), {}
        for state in self.states:
            fmt = formats.get_format(used[state.name])
            decay = state.too_slow_for(fmt, group)
            if decay is not None:
                too_slow[state.follows or state.name] = (state.name, decay, fmt.name, fmt.max_signed_decay)
        if not too_slow:
            return
        name, decay, fmt_name, limit = next(iter(too_slow.values()))
        example = self._example_format(group, dict.fromkeys(too_slow, "10bit-sr"))
        raise StateFormatError(
            f"the {fmt_name!r} state format cannot hold {self._family}'s {name}, an average that keeps {decay} of itself "
            f"per step: its rounding noise is drawn afresh at every write, and an average that keeps more than {limit} per "
            f"step gathers that noise faster than it lets it decay, growing without bound (README, \"Low-rank states and "
            f"slow averages\"). Use a format without that limit for it",
            example,
        )

    def _check_running_maxima(self, group: dict) -> None:
        """Refuse a format that keeps no element's value (holds_elements) for a running maximum
        (State.running_max) that exists under the group, as it stands: when the group is added, and
        at a step after an edit (amsgrad switched on)."""
        used = self._state_format_names(group)
        for state in self.states:
            fmt = formats.get_format(used[state.name])
            if state.running_max and not fmt.holds_elements and (state.when is None or group.get(state.when)):
                key = state.follows or state.name
                example = self._example_format(group, {key: "8bit-log"})
                raise StateFormatError(
                    f"the {fmt.name!r} state format keeps no element's value of its own, and {self._family}'s {state.name} "
                    f"is a running maximum of each element, which it would shrink at every write. Use another format for {key} "
                    "(a checkpoint's states convert to it as they load)"
                    + (f" or {state.when}=False (a checkpoint's param groups set their own {state.when})" if state.when else ""),
                    example,
                )

    def _example_format(self, group: dict, replaced: dict) -> dict:
        """The group's state_format per state, ``replaced``'s formats in place: a refusal's example."""
        spec = group["state_format"]
        return {k: replaced.get(k, spec[k] if isinstance(spec, dict) else spec) for k in self._format_keys()}

    def _state(self, name: str) -> State:
        return next(s for s in self.states if s.name == name)

    # ---- state ------------------------------------------------------------------------------------

    def state_format_of(self, param: Tensor, group: dict, state_name: str | None = None):
        """The format this optimizer stores ``param``'s state ``state_name`` in (fp32 for small
        tensors): a declared state (default: the first), or "compensation" for the Kahan buffer."""
        fmt = formats.get_format(self._state_format_names(group)[state_name or self.states[0].name])
        torchao_rule = self.whole_blocks_only or getattr(fmt, "whole_blocks_only", False)
        too_small = formats.is_quantized(fmt) and param.numel() < group["min_quantize_numel"]
        if too_small or (torchao_rule and formats.is_blockwise(fmt) and param.numel() % self._block_size(fmt, group)):
            # torchao keeps such a tensor's state in the parameter's dtype: so that its runs carry on exactly
            return formats.BF16 if torchao_rule and param.dtype == torch.bfloat16 else formats.FP32
        return fmt

    def _block_size(self, fmt, group: dict) -> int | None:
        if not formats.is_blockwise(fmt):
            return None
        return group["block_size"] or fmt.default_block_size

    def _declared(self, group: dict) -> list[State]:
        """The declared states that exist under ``group``'s options."""
        return [s for s in self.states if s.when is None or group[s.when]]

    def _state_names(self, param: Tensor, group: dict) -> list[str]:
        """The tensor states ``param`` has under ``group``'s options (besides "step", which exists
        where a declared state does)."""
        extra = precision.extra_state_name(param_update_of(param, group))
        return [s.name for s in self._declared(group)] + ([extra] if extra else [])

    def _init_state(self, param: Tensor, group: dict, state: dict) -> None:
        """Makes each state ``param`` lacks under ``group``'s options (all of them at its first step)
        as a first step makes it, from its initial value."""
        if self._declared(group) and "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32, device="cpu")  # never the default dtype: bf16 stops counting at 256
        for name in self._state_names(param, group):
            if name not in state:
                state[name] = self._new_state(param, group, name, _converted_buffer(param, state, name))

    def _signed(self, name: str) -> bool:
        return name == "compensation" or self._state(name).signed

    def _new_state(self, param: Tensor, group: dict, name: str, values: Tensor | None = None) -> Tensor:
        """``param``'s state ``name``, from its initial value or from ``values`` (of the local shard)."""
        # a DTensor (FSDP2) parameter gets a DTensor state holding the state of its local shard
        shard = local(param)
        if name == "param_correction":
            return like_param(torch.zeros(shard.shape, dtype=torch.int8, device=shard.device) if values is None else values, param)
        fmt = self.state_format_of(param, group, name)  # decided by the global shape
        state = fmt.zeros(shard.shape, self._signed(name), self._block_size(fmt, group), device=shard.device, dtype=param.dtype)
        initial = 0.0 if name == "compensation" else self._state(name).initial
        if values is not None:
            state.copy_(values)
        elif initial:
            state.copy_(torch.full(shard.shape, initial, dtype=torch.float32, device=shard.device))
        return like_param(state, param)

    # ---- stepping -------------------------------------------------------------------------------

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # GradScaler then sets grad_scale and found_inf on the optimizer and calls step(), which
        # refuses it under step_in_backward (instead of an assertion about missing inf checks)
        return self._step_in_backward

    @torch.no_grad()
    def step(self, closure=None):
        if self._step_in_backward and "grad_scale" in self.__dict__:
            in_backward.refuse_grad_scaler(self)
        if torch.compiler.is_compiling():  # inside the user's torch.compile: one opaque op (step_op.py)
            # the groups' lists read through another name: dynamo guards on every value of
            # self.param_groups (a new graph for each lr), not on what is read through an alias
            params = [p for group in self._groups for p in group["params"]]
            if closure is None and not any(is_dtensor(p) for p in params):
                return step_op.step(self._step_op_key, params, self._groups, self._option_places)
            return _step_outside_graph(self, closure)  # a closure runs backward: a graph break either way
        return self._step_eagerly(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._step_in_backward:
            in_backward.check_zero_grad(set_to_none)
        super().zero_grad(set_to_none)

    def _step_eagerly(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self._params()
        with_grads, grads, positions = step_op.with_grads(params)
        if params and not with_grads and not self.state and not self._has_stepped:
            warnings.warn(NO_GRADIENT.format(name=type(self).__name__, count=len(params)), stacklevel=outside_stacklevel())
        self._step_params(with_grads, grads, positions)
        return loss

    @_cpu_by_default
    def _step_params(self, params: list[Tensor], grads: list[Tensor], positions: list[int], traced: tuple | None = None) -> None:
        """Step ``params`` (the parameters that have a gradient, or the tensors the step op was
        given for them) with ``grads``; ``positions``: theirs among all parameters in param-group
        order (step_op.with_grads). ``traced``: the step op's (where the groups' tensor options
        are, and its tensors for them), whose positions were taken when its graph was compiled, so
        they are checked against the parameters as they are now."""
        owners = [(group, p) for group in self.param_groups for p in group["params"]]
        if traced and (
            any(not 0 <= i < len(owners) for i in positions) or len(set(positions)) != len(positions)
            or [owners[i][1].shape for i in positions] != [p.shape for p in params]
        ):  # fmt: skip
            raise RuntimeError(
                "the parameters of this optimizer changed after a torch.compile'd function that calls its step() "
                "was compiled; add parameters with add_param_group(), not by editing param_groups"
            )
        grads = [laid_out_like(g, owners[i][1]) for i, g in zip(positions, grads)]
        if self._step_in_backward:  # what backward left: clipped as the step's other gradients were
            grads = in_backward.clip_left_over(self, [owners[i][1] for i in positions], grads)
        self._check_edits(self.param_groups)
        for part in self.__dict__.get("_parts_stepped_after", ()):  # MuonWithAdamW's AdamW: refused before Muon's part steps
            part._check_edits(part.param_groups)  # (here, so that a compiled step, one op per part, refuses so too)
            part._check_step_would_run()
        items = self._checked_items(owners, positions, params, grads)
        self._check_kernel_takes(self.param_groups, items)
        # (after _check_edits: the op's tensors for the options are not the groups' own, and would count as edits)
        with step_op.options_as_given(self.param_groups, *traced) if traced else contextlib.nullcontext():
            for group in self.param_groups:
                self._step_group(group, items[id(group)])
        if params:
            self._has_stepped = True

    # ---- the step in backward -------------------------------------------------------------------

    @_cpu_by_default
    def _step_one(self, group: dict, param: Tensor, grad: Tensor) -> None:
        """Step one parameter of ``group`` (the step in backward's hook)."""
        self._check_edits([group])
        self._check_stepped(param, grad, group)
        self._step_group(group, [(param, param, grad)])  # (laid out like the parameter by the hook)
        self._has_stepped = True

    @contextlib.contextmanager
    def accumulating(self):
        """Backward inside only accumulates gradients (the micro-batches of gradient accumulation);
        the next backward outside steps each parameter with the sum. Without ``step_in_backward``
        nothing changes: step() is called by the loop then."""
        previous = self.__dict__.get("_accumulating", False)
        in_backward.begin_step(self)  # a new step's gradients begin
        self._accumulating = True
        try:
            yield self
        finally:
            self._accumulating = previous

    def _step_group(self, group: dict, items: list[tuple[Tensor, Tensor, Tensor]]) -> None:
        """Step each (parameter, its tensor to update, gradient) of ``group``."""
        arguments = {}  # by device (a group may span several, as torch.optim's: a model split over GPUs)
        declared = {s.name for s in self._declared(group)}
        fused, corrections = [], []  # what the fused CPU kernel steps, all in one call at the end
        strided = []  # (item, correction) of those it steps through contiguous scratch copies, one at a time
        compiled = {}  # by device and check (below): (parameter, its step function arguments, param_update) for the compiled step
        owners = []  # the Parameter of each of compiled's
        # an optimizer of one's own: each parameter's first compiled step has its writes checked (_step_compiled)
        checked = self.__dict__.setdefault("_writes_checked", torch.utils.weak.WeakIdKeyDictionary()) if _declared_outside(type(self)) else None
        fresh = []  # the parameters of compiled's whose writes are checked in this step
        for p, tensor, grad in items:
            if grad.is_neg():  # a lazily negated view: the kernel and inductor's code read its memory, not its values
                grad = grad.resolve_neg()
            first = checked is not None and p not in checked
            state, step, mode, extra, param, values = self._step_inputs(p, tensor, group, declared)
            if mode != group["param_update"]:  # not bf16 (now): a buffer its bf16 steps kept is stale
                fold_stale_buffers(param, state)
            if param.numel() == 0:  # an empty shard (more ranks than rows) has nothing to update
                if step is not None:
                    step.add_(1)
                continue
            grad = local(grad)
            if self._use_fused(p, group["fused"], param, grad, step, values, mode):
                correction = local(state[extra]) if extra else None  # int8-correction (the kernel's only extra)
                if param.is_contiguous() and grad.is_contiguous():
                    fused.append((param, grad, step, *values))
                    corrections.append(correction)
                else:  # channels_last, transposed: in the logical order, as the compiled step (and the states) read it
                    strided.append(((param, grad, step, *values), correction))
                continue
            if param.device not in arguments:  # once per group and step: a changed lr / beta / eps never recompiles
                arguments[param.device] = self._tensor_arguments(group, param.device)
            shaped = _flat if self.flat_step else local
            call = (
                shaped(param), shaped(grad), step, *(shaped(v) if v is not None else None for v in values),
                shaped(state[extra]) if extra else None,
            )  # fmt: skip
            compiled.setdefault((param.device, first), []).append((param, call, mode))
            owners.append(p)
            if first:
                fresh.append(p)
        if compiled:
            try:
                for (device, first), calls in compiled.items():
                    self._step_compiled(group, calls, *arguments[device], check=first)
                if fresh:
                    checked.update((p, True) for p in fresh)
            except Exception as error:  # a state edited after its checks fails deep in a trace: say which
                _explain_inconsistent_states(self, owners, error)
                unwritable = _behind(error, lambda e: isinstance(e, OSError) and e.errno in kernel_build.UNWRITABLE)
                if unwritable is not None:  # not the format's fault: say so, and where torch.compile writes
                    error.add_note(
                        f"lowbit_optim: torch.compile could not write its cache ({unwritable}): set TORCHINDUCTOR_CACHE_DIR "
                        "to a writable directory, or pass compile=False (the eager step)"
                    )
                elif isinstance(error, torch._dynamo.exc.TorchDynamoException):
                    error.add_note(
                        f"lowbit_optim: torch.compile failed on the step of this group's parameters (state_format "
                        f"{group['state_format']!r}). A format of your own whose encode or decode torch.compile cannot "
                        "trace (NumPy, data-dependent Python) steps with compile=False (the eager step)"
                    )
                raise
        if fused:
            self._fused_step(fused, group, corrections)
        # the strided ones in runs of at most SCRATCH_ELEMENTS elements (or one larger parameter), each
        # run in one call through buffers the optimizer keeps: fresh copies each step page-faulted
        # 4-6x the kernel's time, and a call per parameter cost many small ones 60 %
        for run in element_runs(strided, [entry[0][0].numel() for entry in strided], SCRATCH_ELEMENTS):
            self._step_through_scratch(group, run)

    def _step_through_scratch(self, group: dict, run: list[tuple]) -> None:
        """The kernel's step of each ((param, grad, step, *states), correction) of ``run`` in one call,
        its non-contiguous parameters and gradients copied into the optimizer's buffers, the
        parameters copied back."""
        sizes = {}  # (slot: 0 the parameters, 1 the gradients; dtype) -> elements
        for item, _ in run:
            for slot, t in enumerate(item[:2]):
                if not t.is_contiguous():
                    sizes[(slot, t.dtype)] = sizes.get((slot, t.dtype), 0) + t.numel()
        buffers = self.__dict__.setdefault("_scratch_buffers", {})  # (not pickled)
        for key, size in sizes.items():
            if key not in buffers or buffers[key].numel() < size:
                buffers[key] = torch.empty(size, dtype=key[1])
        used = dict.fromkeys(sizes, 0)
        items = []
        for (param, grad, *rest), _ in run:
            contiguous = []
            for slot, t in enumerate((param, grad)):
                if not t.is_contiguous():
                    start = used[(slot, t.dtype)]
                    used[(slot, t.dtype)] = start + t.numel()
                    t = buffers[(slot, t.dtype)][start : start + t.numel()].view(t.shape).copy_(t)
                contiguous.append(t)
            items.append((*contiguous, *rest))
        self._fused_step(items, group, [correction for _, correction in run])
        for ((param, *_), _), (stepped, *_) in zip(run, items):
            if stepped is not param:
                param.copy_(stepped)

    def _step_inputs(self, p: Tensor, tensor: Tensor, group: dict, declared: set) -> tuple:
        """(state, step counter, param_update mode, name of its extra state, the local tensor to
        update, the local states in self.states' order or None) of ``p`` in ``group``
        (``declared``: the names of its states there), its states made where missing."""
        mode = param_update_of(p, group)
        extra = precision.extra_state_name(mode)
        has_states = bool(declared or extra)  # as _state_names: a parameter without any keeps none (SGD)
        state = self.state[p] if has_states or p in self.state else {}
        if has_states and not state or extra and extra not in state or not declared <= state.keys():
            self._init_state(p, group, state)  # (a parameter cast to bf16 after its first step, amsgrad turned on)
        for name, value in state.items():  # (a loop: all() of a generator cost 0.2 us a parameter)
            # set by hand: the kernel or a trace would fail deep inside (a key of the user's is theirs)
            if not isinstance(value, Tensor) and (name in declared or name in _OWN_STATE_NAMES):
                raise TypeError(
                    f"the {name!r} state of a parameter of shape {tuple(p.shape)} is {repr(value)[:60]}, not a tensor: "
                    f"delete the parameter's states (del opt.state[p]) to start them afresh, or load a checkpoint with load_state_dict"
                )
        # counted where a state is (a buffer kept from before momentum was set to 0 waits, uncounted)
        step = state.get("step") if has_states else None
        param = local(tensor.detach())  # the step runs on local shards: one compiled graph with or without FSDP2
        values = [local(state[s.name]) if s.name in declared else None for s in self.states]
        return state, step, mode, extra, param, values

    def _checked_items(self, owners: list[tuple[dict, Tensor]], positions: list[int], params: list[Tensor], grads: list[Tensor]) -> dict:
        """{id(group): [(parameter, tensor to update, gradient)]} of what _step_params was given
        (``owners``: (group, parameter) of every parameter), each parameter checked (_check_stepped)."""
        items = {id(group): [] for group in self.param_groups}
        for i, tensor, grad in zip(positions, params, grads):
            group, p = owners[i]
            self._check_stepped(p, grad, group)
            items[id(group)].append((p, tensor, grad))
        return items

    @_cpu_by_default
    def _check_step_would_run(self) -> None:
        """Raise what this optimizer's step() would refuse of its parameters and gradients now,
        stepping nothing: MuonWithAdamW checks its AdamW part so before its Muon part steps."""
        owners = [(group, p) for group in self.param_groups for p in group["params"]]
        params, grads, positions = step_op.with_grads([p for _, p in owners])
        self._check_kernel_takes(self.param_groups, self._checked_items(owners, positions, params, grads))

    def _check_kernel_takes(self, groups: list[dict], items: dict) -> None:
        """Raise the error of fused=True where the kernel cannot take a parameter of ``groups``
        (``items``: _checked_items'; its states, made here, enter the verdict), before the step
        changes anything. Once a parameter has a verdict for its dtype it is skipped (each step would
        pay a few microseconds per parameter): only new states (the first step, a new format, a
        load) and a dtype changed through ``.data`` are decided here."""
        verdicts = self.__dict__.get("_kernel_verdicts", {})
        for group in groups:
            if not group["fused"]:
                continue
            declared = {s.name for s in self._declared(group)}
            for p, tensor, grad in items[id(group)]:
                decided = verdicts.get(id(p))
                if decided is not None and decided[1][1] is tensor.dtype:  # (its facts: mode, dtype, device)
                    continue
                _, step, mode, _, param, values = self._step_inputs(p, tensor, group, declared)
                if param.numel():
                    self._use_fused(p, True, param, local(grad), step, values, mode)

    @_cpu_by_default
    def _make_states(self) -> None:
        """Makes the states this optimizer's next step would make, stepping nothing: where dynamo
        traces its step (step_op.py), so that the traced code after the step can read a first
        step's states (under fullgraph=True, a missing one failed every call, none of which stepped).
        A parameter the step refuses gets none: the op raises why as it runs (raised here, dynamo
        would wrap it as its own internal error)."""
        for group in self.param_groups:
            declared = {s.name for s in self._declared(group)}
            for p in group["params"]:
                if p.grad is not None:
                    with contextlib.suppress(TypeError, ValueError, RuntimeError):
                        self._check_stepped(p, p.grad, group)
                        self._step_inputs(p, p, group, declared)

    def _check_stepped(self, p: Tensor, grad: Tensor, group: dict) -> None:
        """What the constructor checked of ``p`` may have changed through ``.data`` (``model.half()``
        after it), and autograd does not check a gradient assigned through it: each step checks them,
        where it begins (_step_params, _step_one), before any group is stepped and whatever a
        subclass's _step_group does."""
        if grad.is_sparse:
            raise RuntimeError(_sparse_gradients_refused(type(self).__name__, self.torch_name))
        _check_grad_shape(p, grad)
        state = self.state.get(p)
        if state:
            _check_states_fit(p, state, _kept_names(type(self)))
        if p.dtype not in _STEPPED_DTYPES:  # made float64 (or complex) after the constructor checked it
            _check_param(p, self.torch_name)
        _check_fp16_update(group, [p])

    def _remember_group(self, group: dict) -> dict:
        """The group's options as built, loaded or last checked, for _check_edits; a copy takes its
        original's (__getstate__). A group dict that replaced one is checked whole, then remembered."""
        # the state keys deep: a format dict edited in place must show; a list (betas=[...]) edited in place too
        options = {k: _remembered_value(k, v) for k, v in group.items() if k != "params"}
        self.__dict__.setdefault("_remembered_groups", {})[id(group)] = (group, options)
        return options

    def _check_edits(self, groups: list[dict]) -> None:
        """Each of ``groups`` as edited since it was built, loaded or last stepped (before any is
        stepped): a state key changed is refused (its states keep the formats they were made in,
        which the group, and state_dict(), would then misname); other options replaced are checked
        as the constructor checks them (betas made 1.0, a misspelt option), lr alone by itself (a
        scheduler's, every step). A list edited in place is seen; a tensor filled in place is not.
        Errors name a group by its index in param_groups; a part's (MuonWithAdamW's AdamW) by its
        index in the holder's, after the groups of ``_groups_before`` (Muon), and in the part's."""
        remembered = self.__dict__.get("_remembered_groups", {})
        for group in groups:
            then = remembered.get(id(group), (None, None))
            # a group dict put in param_groups in place of one (or a copy's from before its options were pickled):
            # its numbers checked whole
            replaced = then[0] is not group
            changed = set(group) - {"params"} if replaced else _changed_options(then[1], group)
            if not changed:
                continue
            index = next(i for i, g in enumerate(self.param_groups) if g is group)
            before = self.__dict__.get("_groups_before")
            if before is not None:  # the holder's index, and the part's
                index = f"{len(before.param_groups) + index} (opt.adamw.param_groups[{index}])"
            fixed = [] if replaced else [f"{key} from {then[1].get(key)!r} to {group.get(key)!r}" for key in _STATE_KEYS if key in changed]
            if fixed:
                raise ValueError(
                    f"param group {index}'s {'; '.join(fixed)}: a group's state settings are fixed when it is built. To "
                    f"convert its states, build a new optimizer with the new setting and load this one's state_dict() into it "
                    f"(a load converts every state)"
                )
            for key in changed & group.keys():  # (as the constructor takes them: a config's sequence)
                group[key] = self._normalized(key, group[key])
            with _naming_the_group(f"param group {index}, as {'replaced' if replaced else 'edited'} since it was built: "):
                if changed == {"lr"}:
                    _check_lr(group["lr"])
                    then[1]["lr"] = group["lr"]
                    continue
                self._check_numbers(group)
            self._remember_group(group)

    def _normalized(self, key: str, value):
        """A group option as the step reads it: NumPy numbers as Python numbers, and an option whose
        default is a tuple (betas) given as another sequence (a config's) as a tuple. A key of the
        user's keeps its type but for NumPy numbers, as before."""
        return _plain_numbers(_as_tuple(value) if key in _tuple_options(type(self)) else value)

    def _check_numbers(self, group: dict) -> None:
        """The constructor's checks of a group's numbers, its betas under its formats included."""
        self._check_hyper_parameters(group)
        self._check_decays(group)
        self._check_running_maxima(group)

    def _step_compiled(self, group: dict, compiled: list[tuple], numbers: list[Tensor], flags: dict, check: bool = False) -> None:
        """The step function on each (parameter, its flat arguments, param_update mode): per
        parameter, or all in one graph (``foreach``). ``check``: new states of an optimizer declared
        outside lowbit_optim, whose writes (a negative value into a state declared nonnegative) a
        compiled step cannot check: the step function runs eagerly on copies first, whose copy_
        checks each write (the numbers kept are the compiled step's, as on every other path)."""
        if check and self._compile:
            for _, call, mode in compiled:
                copies = [copy.deepcopy(a) if isinstance(a, StateTensor) else a.clone() if isinstance(a, Tensor) else a for a in call]
                type(self).step_function(*copies, *numbers, **flags, param_update=mode)
        foreach = group["foreach"]
        if foreach is None:  # as torch.optim: together on an accelerator, where host time per call dominates
            foreach = len(compiled) > 1 and compiled[0][0].device.type != "cpu"
        together = self._compile and foreach
        grouped, alone = [], []  # a slice fills a foreach chunk alone: the per-parameter graph steps it
        for p, call, mode in compiled:
            # slices small enough for the CPU's caches there; elsewhere few calls, each ~200 us of host time
            limit = FOREACH_ELEMENTS if together or p.device.type != "cpu" else COMPILED_CHUNK
            pieces = _pieces(call, limit) if self.elementwise_step else [call]
            if together and len(pieces) == 1:
                grouped.append((p, call, mode))
            else:
                alone += [(piece, mode) for piece in pieces]
        if grouped:
            step_each = compiled_foreach_step(type(self).step_function)
            for chunk in _foreach_chunks(grouped):
                step_each([call for _, call, _ in chunk], numbers, tuple(mode for _, _, mode in chunk), flags)
        for piece, mode in alone:
            self._step_fn(*piece, *numbers, **flags, param_update=mode)
        for param, (stepped, *_), _ in compiled:
            if stepped is not param and not param.is_contiguous():
                param.copy_(stepped.view(param.shape))  # the step updated a contiguous copy: write it back

    def _tensor_arguments(self, group: dict, device) -> tuple[list[Tensor], dict]:
        numbers, flags = self._step_arguments(group)
        # fp32, as a Python float's value is (the kernel takes them so), a float64 tensor too (a tensor
        # lr or betas a user made float64: it had stepped otherwise than the kernel); only those the
        # optimizer names (float64_numbers: Muon's lr, AdEMAMix's warm-ups) in float64
        tensors = [torch.as_tensor(v, dtype=torch.float64 if i in self.float64_numbers else torch.float32).to(device) for i, v in enumerate(numbers)]
        # 0-d, as a number: a one-element tensor of another shape (lr=torch.tensor([[1e-3]])) would broadcast the flat states
        return [t.reshape(()) if t.dim() and t.numel() == 1 else t for t in tensors], flags

    def _use_fused(self, p: Tensor, fused: bool | None, param: Tensor, grad: Tensor, step: Tensor, values: list, mode: str) -> bool:
        """Whether the fused CPU kernel steps ``p`` (``values``: its states in ``self.states``' order,
        None where absent)."""
        if fused is False or (fused is None and not param.is_cpu) or _no_kernel_reason(type(self)) is not None:
            return False
        if fused is None and self.fused_default_needs_codes and not any(isinstance(v, StateTensor) for v in values):
            return False
        # the parameter's reason first: an fp16 parameter's fp16 gradient is not the cause
        reason = self._kernel_verdict(p, param, step, values, mode) or fused_cpu.grad_unsupported_reason(grad)
        if reason is not None and fused:
            raise RuntimeError(_kernel_refuses(p, reason))
        return reason is None

    def _kernel_verdict(self, p: Tensor, param: Tensor, step: Tensor, values: list, mode: str) -> str | None:
        """fused_cpu.param_unsupported_reason, decided once per parameter and its states: a format's
        layout, the parameter's dtype and its param_update mode do not change from step to step. New
        state tensors (a load, a conversion, a new format) or another mode or dtype decide anew."""
        verdicts = self.__dict__.get("_kernel_verdicts")
        if verdicts is None:  # not pickled
            verdicts = self.__dict__["_kernel_verdicts"] = {}
        inputs = (step, *values)
        facts = (mode, param.dtype, param.is_cpu)  # what the verdict reads of param
        # by id, not the parameter: a dropped layer was kept for good (no weak reference either:
        # swap_tensors, which FSDP2's and swap-on-conversion's model.to() use, refuses one). Its states
        # by weak reference: held here, del opt.state[p] (a frozen layer's) freed no memory
        cached = verdicts.get(id(p))
        if cached is not None and len(cached[0]) == len(inputs) and all(map(_refers_to, cached[0], inputs)) and cached[1] == facts:
            return cached[2]
        if cached is None and len(verdicts) >= sum(len(g["params"]) for g in self.param_groups):  # one dropped since: its entry (and states) go
            live = {id(q) for q in self._params()}
            for key in [key for key in verdicts if key not in live]:
                del verdicts[key]
        states = {s.name: v for s, v in zip(self.states, values) if v is not None}
        reason = fused_cpu.param_unsupported_reason(param, step, states, mode)
        refs = tuple(None if t is None else weakref.ref(t) for t in inputs)
        verdicts[id(p)] = (refs, facts, reason)  # (a reused id: its states are new, so it is decided anew)
        return reason

    # ---- checkpoints ----------------------------------------------------------------------------

    @_cpu_by_default
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a checkpoint of this or any other format (or of the torch.optim optimizer this one
        reproduces, or of bitsandbytes' version of it, see ``foreign.from_bitsandbytes``): states
        are converted to this optimizer's formats; a checkpoint of the same format resumes
        bit-exactly."""
        if not isinstance(state_dict, dict):  # (torch.optim's load would fail copying it)
            _refuse_as_no_state_dict(state_dict)
        structural = [{k: g[k] for k in _STRUCTURAL_KEYS + self._structural_keys if k in g} for g in self.param_groups]
        saved, source, norm = {}, "checkpoint", None

        def prepare(optimizer, loaded: dict) -> dict:
            # after the user's pre-hooks, which may unwrap what their state_dict post-hooks wrapped
            nonlocal source, norm
            if not {"state", "param_groups"} <= loaded.keys():
                _refuse_as_no_state_dict(loaded)
            norm, loaded = _take_last_grad_norm(loaded)
            if foreign.is_bitsandbytes_state_dict(loaded, [s.name for s in self.states]):
                loaded = foreign.from_bitsandbytes(loaded, self)  # validated, in our names
                source = "bitsandbytes checkpoint"
            return loaded

        def check_hyper_parameters(optimizer, loaded: dict) -> None:
            # the constructor's checks, before anything is loaded: a step must not run on what it refuses
            groups = loaded["param_groups"]
            if isinstance(groups, list) and len(groups) != len(self.param_groups):  # (torch.optim's message names neither)
                raise ValueError(
                    f"the {source} has {len(groups)} param groups and this optimizer {len(self.param_groups)}: build it with "
                    "the param groups of the run that saved it (a Trainer checkpoint of its own optimizer has two, with and "
                    "without weight decay; lowbit_optim.hf's helper makes those with overrides={})"
                )
            for i, (group, ours, keep) in enumerate(zip(loaded["param_groups"], self.param_groups, structural)):
                with _naming_the_group(f"param group {i} of this {source}: "):
                    self._check_numbers({**self.defaults, **group, **keep, "params": ours["params"]})
            _check_parameter_ids(loaded, source)

        def keep_saved_tensors(optimizer, loaded: dict) -> None:
            # torch.optim casts floating-point states to their parameter's dtype (an fp32 state of a
            # bf16 parameter would come back rounded): remember them as saved, after the user's hooks
            ids = (i for g in loaded["param_groups"] for i in g["params"])
            params = (p for g in self.param_groups for p in g["params"])
            saved.update({p: loaded["state"][i] for i, p in zip(ids, params) if i in loaded["state"]})
            entries = []
            for index, (p, state) in enumerate((p, saved.get(p, {})) for g in self.param_groups for p in g["params"]):
                for name, value in state.items():  # torch.optim's load copies them before convert could say which
                    if isinstance(value, Tensor) and value.device.type == "meta":
                        raise ValueError(f"{_loaded_state(name, p, index)} is on the meta device, where it holds no values")
                    if name != "step":  # (counters are copied at the load)
                        entries.append((_loaded_state(name, p, index), value))
            _check_no_shared_memory(entries)

        def convert(optimizer) -> None:  # before the user's post-hooks: they see converted states
            self.__dict__.pop("_remembered_groups", None)  # the groups are new dicts
            index = itertools.count()  # a parameter's position in the checkpoint, across groups (errors name it)
            for group, keep in zip(self.param_groups, structural):
                group.update(keep)
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                self._remember_group(group)
                for p, i in zip(group["params"], index):
                    if p in self.state:
                        self.state[p].update({k: v for k, v in saved.get(p, {}).items() if isinstance(v, Tensor)})
                        self._convert_loaded_state(p, group, self.state[p], i)

        hooks = [
            self.register_load_state_dict_pre_hook(prepare),
            self.register_load_state_dict_pre_hook(check_hyper_parameters),
            self.register_load_state_dict_pre_hook(keep_saved_tensors),
            self.register_load_state_dict_post_hook(convert, prepend=True),
        ]
        kept = self.state, self.param_groups  # torch.optim's load builds new ones: a refused checkpoint leaves these
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            self.state, self.param_groups = kept  # as torch.optim, whose checks all come before it assigns
            raise
        finally:
            for hook in hooks:
                hook.remove()
        self.__dict__.pop("_kernel_verdicts", None)  # new states: fused=True's checks decide anew before a step
        in_backward.begin_step(self)
        if norm is not None and self._max_grad_norm is not None:  # the next step in backward clips with it
            in_backward.set_last_grad_norm(self, norm)
        else:  # the checkpoint's step had none: this optimizer's own last one is not its
            self.last_grad_norm = None

    def state_dict(self) -> dict:
        if self.last_grad_norm is None:
            return super().state_dict()

        def add_last_grad_norm(optimizer, state_dict: dict) -> None:  # the next step in backward clips with it
            for group in state_dict["param_groups"]:  # (torch.optim's state_dict makes new group dicts)
                group[_LAST_GRAD_NORM] = float(self.last_grad_norm)

        # before the user's post-hooks, which see it and may return another dict (one that wraps it)
        hook = self.register_state_dict_post_hook(add_last_grad_norm, prepend=True)
        try:
            return super().state_dict()
        finally:
            hook.remove()

    _structural_keys: tuple[str, ...] = ()  # an optimizer's own group keys that a checkpoint must not change

    # a checkpoint without step counters (torch.optim.SGD keeps none): the count they stand for
    _step_when_missing: float | None = None

    def _convert_loaded_state(self, param: Tensor, group: dict, state: dict, index: int) -> None:
        if not state:  # read before its first step (torch.optim's defaultdict keeps it): its first step makes it
            return
        declared = self._declared(group)
        expected = {s.name for s in declared} | ({"step"} if declared and self._step_when_missing is None else set())
        missing = expected - state.keys()
        if missing:
            options = [f"{s.when}={group[s.when]!r}" for s in declared if s.when is not None]
            raise ValueError(
                f"checkpoint state of parameter {index} (shape {tuple(param.shape)}) lacks {sorted(missing)}: it is "
                f"not a checkpoint of {self._family}{' with ' + ', '.join(options) if options else ''}"
            )
        others = set(state) - _kept_names(type(self))
        foreign = sorted(others & _OPTIMIZER_STATE_NAMES)
        if foreign:
            raise ValueError(
                f"checkpoint state of parameter {index} (shape {tuple(param.shape)}) holds {foreign}, which "
                f"{self._family} does not keep: it is a checkpoint of another optimizer"
            )
        for name in others:  # the user's (timm's Lookahead keeps its slow weights here): on the parameter's device and
            value = state[name]  # floating dtype, as torch.optim's load puts them
            if isinstance(value, Tensor):
                state[name] = value.to(param.device, param.dtype if value.is_floating_point() else None)
        names = self._state_names(param, group)
        # a declared state that its option has switched off for now (SGD's momentum 0 for a phase, amsgrad
        # off) stays, checked and converted, as a run keeps it and torch.optim's load does: switched on
        # again, it goes on from its values, as the uninterrupted run does
        dormant = [s.name for s in self.states if s.name in state and s.name not in names]
        kept = _loaded_precision_buffers(param, group, state, index)
        for name in list(state):
            if name not in ("step", *names, *dormant, *kept, *others):
                del state[name]  # a precision buffer this parameter's param_update does not keep
        for name in names + dormant:
            value = state.get(name)
            if value is None:  # a precision buffer the checkpoint did not have: start from zero error
                if not kept:  # (where it has the other mode's, the first step converts that)
                    state[name] = self._new_state(param, group, name)
                continue
            _check_loaded_state(name, value, param, index, name == "param_correction" or self._signed(name))
            value = shard_like(value, param)  # a full (unsharded) checkpoint value for a DTensor parameter
            if name != "param_correction":
                fmt = self.state_format_of(param, group, name)
                block_size = self._block_size(fmt, group)
                signed = self._signed(name)
                loaded = local(value)
                value = map_local(lambda v: formats.convert(fmt, v, signed, block_size), value)
                if isinstance(local(value), StateTensor) and local(value) is not loaded:  # made from another library's state (foreign.py): checked as ours
                    _check_state_tensor(_loaded_state(name, param, index), local(value))
            # a plain state as saved may be strided (torch.optim's zeros_like of a channels_last weight): the
            # steps write it flat, in place, and the kernel reads it element by element beside the parameter
            value = map_local(lambda v: v if isinstance(v, StateTensor) else v.contiguous(), value)
            state[name] = value.to(param.device)
        if not declared and not dormant:
            state.pop("step", None)
            return
        step = state.setdefault("step", self._step_when_missing)
        if isinstance(step, bool) or not (isinstance(step, (int, float)) or isinstance(step, Tensor) and _real_value(step) is not None and step.dtype != torch.bool):
            raise ValueError(
                f"{_loaded_state('step', param, index)} is {describe_tensor(step)}: "
                "it must be a number or a one-element tensor"
            )
        # 0-dim, as the counters it makes: a (1, 1) one would broadcast the compiled step's parameter
        state["step"] = torch.as_tensor(step, dtype=torch.float32).detach().clone().cpu().reshape(())
        count = float(state["step"])
        if not (math.isfinite(count) and count >= 0):  # a NaN or negative count would spoil every element's bias correction
            raise ValueError(f"{_loaded_state('step', param, index)} is {count}: it must count steps, a finite number >= 0")


_COMPENSATION_FORMATS = "'bf16-sr' (2 bytes), '8bit-log' (1) or 'fp32'"


def _check_compensation_format(fmt) -> None:
    """Raise a ValueError where a quantized ``fmt`` cannot hold Kahan's compensation: a signed
    running sum, written back every step, that grows by additions far below its values."""
    if not formats.is_quantized(fmt):
        return
    if not fmt.holds_signed:
        raise ValueError(
            f"compensation_format {fmt.name!r} holds nonnegative values only, and Kahan's compensation "
            f"(the rounding error of each bf16 weight) is signed: use a signed format, e.g. {_COMPENSATION_FORMATS}"
        )
    kept = _negative_extreme_kept(fmt)
    if kept < 0.999:
        raise ValueError(
            f"compensation_format {fmt.name!r} reads a block whose largest value is negative back as "
            f"{kept:.5f} of it (its signed codes stop short of -1): Kahan's compensation, written back every step, "
            f"would shrink by that each step and stall the weights that move down; use {_COMPENSATION_FORMATS}"
        )
    kept = _small_additions_kept(fmt)
    if kept < 0.5:
        raise ValueError(
            f"compensation_format {fmt.name!r} kept {max(kept, 0.0):.0%} of 64 additions of 1/1024 of a block's "
            "largest value, each written back: Kahan's compensation grows by such additions every step, and rounding to the "
            f"nearest code swallows one below half a code gap (weights would lag fp32 ones); use {_COMPENSATION_FORMATS}, "
            "which round stochastically"
        )


@functools.cache
def _negative_extreme_kept(fmt: type) -> float:
    """What a signed state of ``fmt`` keeps of a block's negative extreme, relative to its positive
    one (1.0: as much; bitsandbytes' signed 8-bit table stops at -0.99297)."""
    block = torch.linspace(-0.5, 0.5, fmt.default_block_size or 256, dtype=torch.float32)
    block[0] = 1.0
    read = [float(fmt.from_float(sign * block, True).dequantize()[0]) * sign for sign in (1.0, -1.0)]
    return read[1] / read[0]


@functools.cache
def _small_additions_kept(fmt: type) -> float:
    """The share of 64 additions of 2**-10 of its block's largest value that a signed state of ``fmt``
    keeps when written back after each, as Kahan's compensation is every step (the worse sign): about
    1 when it rounds stochastically, about 0 where nearest rounding swallows each addition."""
    start = torch.linspace(-0.5, 0.5, fmt.default_block_size or 256, dtype=torch.float32)
    shares = []
    for sign in (1.0, -1.0):
        start[0] = sign
        state = fmt.from_float(start.clone(), True)
        for _ in range(64):
            state.copy_(state.dequantize() + sign * 2.0**-10)
        shares.append(float(((state.dequantize() - start)[1:] * sign).mean()) / (64 * 2.0**-10))
    return min(shares)


def _names_a_compensation(compensation_format) -> bool:
    """Whether ``compensation_format`` asks for a Kahan buffer other than the default bf16 one (a
    group copied from an optimizer's param_groups holds that default, with Kahan summation or not)."""
    return compensation_format is not None and formats.get_format(compensation_format).name != "bf16"


def _unused_compensation(name, param_update: str, whose: str = "") -> str:
    return (
        f"{whose}compensation_format={name!r} is the buffer of param_update='kahan', but its param_update is "
        f"{param_update!r}, which keeps none: pass param_update='kahan' too, or drop compensation_format"
    )


def _check_fp16_update(group: dict, params: list[Tensor]) -> None:
    """fp16 parameters are rounded to nearest: another param_update would be dropped."""
    if group["param_update"] != "nearest" and any(p.dtype == torch.float16 for p in params):
        raise ValueError(
            f"param_update={group['param_update']!r} applies to bf16 parameters; fp16 ones are rounded to nearest, where "
            "small updates vanish. Keep fp16 weights in fp32 (torch.amp trains fp16 activations with fp32 weights) or convert them to bf16"
        )


def _keywords(cls: type) -> list[str]:
    """The keywords ``cls``'s constructor takes: its own and LowBitOptimizer's options."""
    own = [n for n, p in inspect.signature(cls.__init__).parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    base = [n for n, p in inspect.signature(LowBitOptimizer.__init__).parameters.items() if p.kind is p.KEYWORD_ONLY]
    return [n for n in dict.fromkeys(own + base) if n not in ("self", "params", "hyperparameters")]


@functools.cache
def _flag_keys(cls: type) -> tuple[str, ...]:
    """The group options of ``cls`` that are flags: its constructor's keywords with a bool default."""
    return tuple(name for name, p in inspect.signature(cls.__init__).parameters.items() if isinstance(p.default, bool))


@functools.cache
def _no_kernel_reason(cls: type) -> str | None:
    """Why the fused CPU kernel does not step optimizer class ``cls``; None where it does. It computes
    the numbers of the class that defines ``_fused_step``: a subclass with a step of its own (another
    step function, numbers or states) takes the compiled step."""
    if cls._fused_step is None:
        return f"the fused CPU kernel steps Adam, AdamW, SGD, Lion, AdEMAMix and Muon only; {cls.family or cls.__name__} takes the compiled step"
    owner = next(k for k in cls.__mro__ if "_fused_step" in vars(k))
    changed = [name for name in ("step_function", "_step_arguments", "states") if getattr(cls, name) is not getattr(owner, name)]
    if changed:
        return f"{cls.__name__} has its own {' and '.join(changed)}, and the fused CPU kernel computes {owner.__name__}'s step; it takes the compiled step"
    return None


# torch.optim steps nothing here, silently; the usual cause is a model wrapped after the optimizer was built
NO_GRADIENT = (
    "{name}.step() found no gradient on any of its {count} parameters, so nothing stepped. If the model was "
    "sharded with fully_shard (or its parameters were replaced) after the optimizer was built, the optimizer "
    "holds the old parameters: build it after fully_shard, from model.parameters()"
)


@torch.compiler.disable
@torch.no_grad()
def _step_outside_graph(optimizer: LowBitOptimizer, closure):
    return optimizer._step_eagerly(closure)


# ------------------------------------------------------------------------------------------------
# Checks shared by the optimizers
# ------------------------------------------------------------------------------------------------


def _check_torch_keywords(fused, foreach, capturable: bool, differentiable: bool) -> None:
    """torch.optim's keywords at the values that mean something here (see the class docstring)."""
    for name, value in (("fused", fused), ("foreach", foreach)):
        if value not in (None, True, False):
            raise ValueError(f"{name} must be None, True or False, got {value!r}")
    if fused and foreach:  # as torch.optim: two implementations, one to pick
        raise ValueError("fused=True and foreach=True cannot be given together: fused=True picks the fused CPU kernel, foreach=True the compiled step over chunks")
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


def check_element_count(key: str, value) -> None:
    """Refuses a number of elements (min_quantize_numel) that is not an int >= 0."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"invalid {key} {value!r}: use an int >= 0")


def check_flag(key: str, value) -> None:
    """Refuses a flag that is not a bool (NumPy's too) or a number equal to 1 or 0 (torch.optim takes
    amsgrad=1): a str ("False") would be true whatever it says, and None would pass for False."""
    value = _plain_number(value)
    if not (isinstance(value, numbers.Real) and value in (0, 1)):
        raise ValueError(f"{key} must be True or False (or 1 or 0), got {value!r}")


def _plain_number(value):
    """A NumPy scalar (np.float64, a float subclass, included; a bool) as the Python number it
    holds, which torch.load(weights_only=True) reads back; anything else as it is."""
    return value.item() if type(value).__module__ == "numpy" and getattr(value, "shape", None) == () else value


@functools.cache
def _tuple_options(cls) -> frozenset:
    """The options whose default in ``cls``'s constructor is a tuple (betas, ns_coefficients)."""
    try:
        parameters = inspect.signature(cls.__init__).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    return frozenset(p.name for p in parameters if isinstance(p.default, tuple))


def _as_tuple(value):
    """A sequence option given as another sequence than a tuple or list (OmegaConf's ListConfig,
    which Hydra's instantiate passes; a 1-D NumPy array or tensor) as a tuple, which torch.optim's
    indexing reads alike (a tensor's items: one-element tensors); anything else as it is."""
    if isinstance(value, (str, bytes, tuple, list)):
        return value
    if isinstance(value, Sequence) or (isinstance(value, Tensor) or type(value).__module__ == "numpy") and getattr(value, "ndim", None) == 1:
        return tuple(value)
    return value


def _plain_numbers(value):
    """``value`` through _plain_number, or a tuple's or list's items: rebuilt as its type (a
    namedtuple with _make) where one of them changes, else the same object."""
    if not isinstance(value, (tuple, list)):
        return _plain_number(value)
    plain = [_plain_number(v) for v in value]
    if all(p is v for p, v in zip(plain, value)):
        return value
    return getattr(value, "_make", type(value))(plain)


def _float32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _check_parameter_ids(loaded: dict, source: str) -> None:
    """Raise a ValueError where a checkpoint's param groups name one parameter twice (two parameters
    would load one state) or its states name parameters no group lists (they would load nowhere, and
    their parameters start over silently); torch.optim accepts both."""
    groups, states = loaded["param_groups"], loaded["state"]
    if not isinstance(groups, list) or not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return  # (torch.optim's load names what is wrong)
    listed = [i for g in groups for i in g["params"]]
    seen = set()
    for i in listed:
        if i in seen:
            raise ValueError(f"the {source}'s param groups list parameter {i!r} twice: it is corrupt (each entry names one parameter's state)")
        seen.add(i)
    unlisted = [i for i in states if i not in seen] if isinstance(states, dict) else []
    if unlisted:
        few = lambda ids: f"{ids[:3]}{' ...' if len(ids) > 3 else ''}" if ids else "none"  # noqa: E731
        raise ValueError(
            f"the {source} holds states of parameters {few(unlisted)} that no param group lists (it lists {few(listed)}): "
            "it is corrupt, or its param groups were edited"
        )


def _refuse_as_no_state_dict(value) -> None:
    """Raise the ValueError for a checkpoint that is no optimizer state dict, naming what it is."""
    found = sorted(value) if isinstance(value, dict) else type(value).__name__
    if found == ["adamw", "muon"]:
        raise ValueError(
            "this is a MuonWithAdamW checkpoint ({'muon': ..., 'adamw': ...}), of two optimizers: load it into a "
            "MuonWithAdamW, or load one part, e.g. state_dict['adamw'], into the optimizer that holds its parameters"
        )
    raise ValueError(
        f"not an optimizer state dict: it needs the keys 'state' and 'param_groups', got {found}. "
        "Pass what optimizer.state_dict() returned (not model.state_dict())"
    )


def _take_last_grad_norm(state_dict: dict) -> tuple[float | None, dict]:
    """A checkpoint's last gradient norm, checked, and the checkpoint without it (not a group option)."""
    groups = state_dict["param_groups"]
    groups = groups if isinstance(groups, list) else []  # (torch.optim's load names what else is wrong)
    found = [g[_LAST_GRAD_NORM] for g in groups if isinstance(g, dict) and g.get(_LAST_GRAD_NORM) is not None]
    found += [state_dict[_LAST_GRAD_NORM]] if state_dict.get(_LAST_GRAD_NORM) is not None else []
    for norm in found:
        if isinstance(norm, bool) or not (isinstance(norm, (int, float)) or isinstance(norm, Tensor) and _real_value(norm) is not None):
            raise ValueError(f"checkpoint {_LAST_GRAD_NORM!r} is {describe_tensor(norm)}: it must be a number or a one-element tensor")
        if float(norm) < 0:  # (inf or NaN: what a run saves after an overflowing or poisoned backward)
            raise ValueError(f"checkpoint {_LAST_GRAD_NORM!r} is {float(norm)}: a gradient norm is >= 0")
    if len({str(float(norm)) for norm in found}) > 1:  # (str: NaN equals NaN)
        raise ValueError(f"checkpoint {_LAST_GRAD_NORM!r} has different values ({[float(n) for n in found]}) in its param groups: a step has one norm")
    rest = {k: v for k, v in state_dict.items() if k != _LAST_GRAD_NORM}
    if isinstance(state_dict["param_groups"], list):
        rest["param_groups"] = [{k: v for k, v in g.items() if k != _LAST_GRAD_NORM} if isinstance(g, dict) else g for g in groups]
    return (float(found[0]) if found else None), rest


def _real_value(x) -> float | None:
    """The value of a real number or a one-element real tensor; None for anything else."""
    if isinstance(x, Tensor):  # (one on the meta device holds no value)
        return float(x) if x.numel() == 1 and not x.is_complex() and x.device.type != "meta" else None
    return float(x) if isinstance(x, numbers.Real) else None


def _remembered_value(key: str, value):
    """What _remember_group keeps of a group value: a copy of what can be edited in place."""
    if isinstance(value, (dict, list)) and key in _STATE_KEYS:
        return copy.deepcopy(value)
    return list(value) if isinstance(value, list) else value  # its items compared by identity first: tensors too


def _changed_options(then: dict, group: dict) -> set:
    """The options of ``group`` that are not those of ``then`` (as remembered): each the same object
    or an equal value of the same type (a scheduler sets a new float each step; an equal config
    list in place of a tuple is normalized as an edit); a tensor only as itself."""
    changed = set(then) ^ (set(group) - {"params"})
    for key, old in then.items():
        new = group.get(key, then)
        if new is old or key in changed:
            continue
        if isinstance(new, Tensor) or isinstance(old, Tensor) or type(new) is not type(old):
            changed.add(key)
            continue
        try:
            if new != old:
                changed.add(key)
        except Exception:  # containers of tensors or arrays, compared element by element
            changed.add(key)
    return changed


@contextlib.contextmanager
def _naming_the_group(context: str):
    """A group's refused number with ``context`` (which group, and how it came) before it."""
    try:
        yield
    except StateFormatError as error:  # still one, for a wrapper to restate
        raise error.restated(context=context) from None
    except ValueError as error:
        raise ValueError(context + str(error)) from None


def _check_float_range(key: str, value) -> None:
    """Raise a ValueError where ``value`` (or an item of it) is an int no float holds: the step
    computes in floats, and would fail with an OverflowError that names nothing."""
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, int) and not isinstance(v, bool) and abs(v) > _FLOAT_MAX:
            raise ValueError(f"invalid {key}: an integer of {v.bit_length()} bits, beyond the range of a float (about {_FLOAT_MAX:.1e}) in which the step computes")


_FLOAT_MAX = torch.finfo(torch.float64).max


def _check_finite(key: str, value) -> None:
    """Raise a ValueError where ``value`` (or an item of it) is a NaN or infinite number: one step
    would make every parameter of the group non-finite (weight_decay=inf, dampening=nan)."""
    for v in value if isinstance(value, (tuple, list)) else (value,):
        number = _real_value(v) if not isinstance(v, bool) else None
        if number is not None and not math.isfinite(number):
            raise ValueError(f"invalid {key} {value!r}: {key} must be finite")


def _check_lr(lr) -> None:
    _check_float_range("lr", lr)
    lr_value = _real_value(lr)
    if lr_value is None or not lr_value >= 0:
        raise ValueError(f"invalid learning rate {lr!r}: lr must be a number >= 0")
    _check_finite("lr", lr)


def sequence_given(value) -> str:
    """What a sequence option that is refused holds, for its message: how many items, or its type."""
    return f"{len(value)} given" if isinstance(value, (tuple, list)) else f"{describe_tensor(value)} given (pass a tuple)"


def check_betas(betas, who: str, example: tuple, bias_corrected: int = 0) -> None:
    """Raise a ValueError unless ``betas`` holds as many numbers (or one-element tensors) in [0, 1)
    as ``example``, the first ``bias_corrected`` of them below 1.0 in fp32, where the step computes
    their bias corrections."""
    if not isinstance(betas, (tuple, list)) or len(betas) != len(example):
        names = ", ".join(f"beta{i + 1}" for i in range(len(example)))
        given = sequence_given(betas)
        raise ValueError(f"invalid betas {betas!r}: {who} takes {_COUNT_WORDS[len(example)]}, ({names}), e.g. {example}; {given}")
    values = [_real_value(b) for b in betas]
    if None in values:
        raise ValueError(f"invalid betas {betas!r}: each beta must be a number (or a one-element tensor)")
    if not all(0.0 <= b < 1.0 for b in values):
        raise ValueError(f"invalid betas {betas!r}: each beta must be in [0, 1)")
    rounded = next((b for b in values[:bias_corrected] if _float32(b) == 1.0), None)
    if rounded is not None:  # a bias correction 1 - beta**step of 0: every parameter NaN, or no update
        raise ValueError(
            f"invalid betas {betas!r}: {rounded!r} is 1.0 in float32, in which the step computes its bias "
            f"correction 1 - beta**step (0); it must be below {1 - 2**-25!r} (1 - 2**-25)"
        )
    for i, b in enumerate(values[:bias_corrected]):
        off = (1 - _float32(b)) / (1 - b) - 1 if b else 0.0
        if abs(off) > 0.01:  # the bias correction sets the step's size until beta**step is small
            warnings.warn(
                f"beta{i + 1}={b!r} is {_float32(b)!r} in float32, in which the step computes its bias correction "
                f"1 - beta**step (as torchao's and bitsandbytes' Adam do; torch.optim uses float64): 1 - beta is {off:+.1%} off "
                f"there, so for the first ~{1 / (1 - b):.0e} steps a step is up to {abs(_step_size_off(i, off)):.1%} "
                f"{'larger' if _step_size_off(i, off) > 0 else 'smaller'} than torch.optim's. Use a beta that float32 holds more "
                "closely (0.99999 is 0.14 % off)",
                stacklevel=outside_stacklevel(),
            )


def _step_size_off(i: int, off: float) -> float:
    """How far a step's size is off where ``1 - beta{i+1}`` is ``off`` off: the step divides by
    beta1's correction and multiplies by the square root of beta2's."""
    return 1 / (1 + off) - 1 if i == 0 else math.sqrt(1 + off) - 1


def check_nonnegative(group: dict, *keys: str) -> None:
    """Raise a ValueError naming the first of ``keys`` whose value is not a number >= 0."""
    for key in keys:
        try:
            valid = bool(group[key] >= 0.0)
        except (TypeError, RuntimeError):
            valid = False
        if not valid:
            raise ValueError(f"invalid {key} {group[key]!r}: {key} must be >= 0")


# the torch.optim classes that take sparse gradients in place of ours (whose states are dense blocks)
_SPARSE_ALTERNATIVES = {"Adam": "torch.optim.SparseAdam", "AdamW": "torch.optim.SparseAdam", "SGD": "torch.optim.SGD"}


def _sparse_gradients_refused(name: str, torch_name: str | None) -> str:
    alternative = _SPARSE_ALTERNATIVES.get(torch_name)
    use = f"use {alternative} for those parameters, or " if alternative else ""
    return f"{name} does not support sparse gradients (its states are dense): {use}make the gradients dense (e.g. nn.Embedding(..., sparse=False))"


_STEPPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what _check_param passes


def _check_param(p: Tensor, torch_name: str | None) -> None:
    """``torch_name``: the torch.optim class that computes the same step, if torch has one."""
    alternative = f", or use torch.optim.{torch_name}" if torch_name else ""
    if p.is_complex():
        raise TypeError(
            "lowbit_optim does not support complex parameters; hold the weight as a real one, "
            f"nn.Parameter(torch.view_as_real(w).clone()), and use torch.view_as_complex(p) in the forward{alternative}"
        )
    if not p.is_floating_point():
        raise TypeError(f"parameters must be floating point, got {p.dtype}")
    if p.is_neg():  # the step writes its memory, which holds the values negated
        raise TypeError("a parameter that is a lazily negated view (torch's neg bit) cannot be stepped in place: make it nn.Parameter(t.resolve_neg())")
    if p.dtype == torch.float64:
        raise TypeError(
            "float64 parameters are not supported: lowbit_optim computes the step in float32 and would "
            f"round them. Convert the model to float32 (model.float()){alternative.replace(', or', ' or')}{' for float64' if torch_name else ''}"
        )
    if p.dtype not in _STEPPED_DTYPES:  # float8: most updates would round away
        raise TypeError(
            f"{p.dtype} parameters are not supported: lowbit_optim steps fp32, bf16 and fp16 parameters. Keep the "
            "weights in one of those and cast them in the forward (as float8 training does)"
        )


def _kernel_refuses(param: Tensor, reason: str) -> str:
    return (
        f"fused=True, but the fused CPU kernel cannot step a parameter of shape {tuple(param.shape)}: {reason}. "
        "Pass fused=None to step such parameters with the compiled step."
    )


def param_update_of(param: Tensor, group: dict) -> str:
    return precision.mode_for(param, group["param_update"])


def _check_grad_shape(param: Tensor, grad: Tensor) -> None:
    # autograd checks p.grad's shape, but not a tensor assigned to p.grad.data; the steps read grad as param's
    if grad.shape != param.shape:
        raise RuntimeError(
            f"the gradient of a parameter of shape {tuple(param.shape)} has shape {tuple(grad.shape)}; it was "
            "probably set through .data. Assign p.grad a tensor of the parameter's shape"
        )


def _loaded_precision_buffers(param: Tensor, group: dict, state: dict, index: int) -> set[str]:
    """The names of a loaded checkpoint's Kahan / int8-correction buffers, checked, that stay for
    ``param``'s first step where its group keeps either: it converts one of the other mode (they hold
    the same fp32 weights: it was dropped, the new one starting from zero error), or folds it into a
    parameter no longer bf16, as the run that saved it would have (it was dropped: the resumed run
    differed), from the weights then loaded. Where the group keeps none, dropped with a warning."""
    found = [name for name in precision.EXTRA_STATE_MODES if name in state]
    for name in found:
        _check_loaded_state(name, state[name], param, index, True)
    if found and precision.extra_state_name(group["param_update"]) is None:
        warnings.warn(
            f"the checkpoint's {' and '.join(found)} buffers (of bf16 weights, below their precision) are dropped: this "
            f"optimizer's param_update ({group['param_update']!r}) keeps none",
            stacklevel=outside_stacklevel(),
        )
        return set()
    for name in found:
        state[name] = shard_like(state[name], param).to(param.device)  # (a full checkpoint value of a DTensor's)
    return set(found)


def _held(buffer: Tensor) -> Tensor:
    """A precision buffer's values, of its local shard, as fp32."""
    held = local(buffer)
    return held.dequantize(torch.float32) if isinstance(held, StateTensor) else held.float()


def _converted_buffer(param: Tensor, state: dict, name: str) -> Tensor | None:
    """The values of ``state``'s precision buffer of the other mode (a checkpoint's, kept by
    _loaded_precision_buffers) as buffer ``name``'s, taken out of ``state``; None where there is none."""
    mode = precision.EXTRA_STATE_MODES.get(name)
    other = next((n for n in precision.EXTRA_STATE_MODES if n != name and n in state), None) if mode else None
    return None if other is None else precision.converted_extra(local(param), _held(state.pop(other)), mode)


def fold_stale_buffers(param: Tensor, state: dict) -> None:
    """A Kahan / int8-correction buffer that ``state`` holds though ``param`` (the local tensor it
    updates) is fp32 now (model.float() after bf16 steps), folded into it and dropped: a later cast
    back to bf16 read it as that weight's (a step of lr 0 moved weights), and makes one afresh."""
    if param.dtype == torch.float32:
        for name, mode in precision.EXTRA_STATE_MODES.items():
            if name in state:
                precision.fold_extra(param, _held(state.pop(name)), mode)


def _refers_to(ref: "weakref.ref | None", tensor: Tensor | None) -> bool:
    return tensor is None if ref is None else ref() is tensor


@functools.cache
def _declared_outside(cls: type) -> bool:
    """Whether ``cls``'s step function or its states are declared outside lowbit_optim (an optimizer
    of one's own), so that a mistake in them (a signed state declared nonnegative) is the user's."""
    owners = [next(k for k in cls.__mro__ if name in vars(k)) for name in ("step_function", "states")]
    return any(not k.__module__.startswith(__package__ + ".") for k in owners)


@functools.cache
def _kept_names(cls: type) -> frozenset[str]:
    """The per-parameter state names an optimizer of ``cls`` keeps: its declared states' and
    lowbit_optim's own (the step counter, precision buffers); any other key is its user's."""
    return frozenset({*(s.name for s in cls.states), *_OWN_STATE_NAMES})


def _check_states_fit(param: Tensor, state: dict, kept: frozenset[str]) -> None:
    # a parameter reshaped through .data (a weight transposed, of as many elements) would be stepped
    # with states that belong to other elements, or its kernel step refused after other groups stepped;
    # one materialized in place (to_empty with swapped tensors, as FSDP2's are) kept states on the meta
    # device, which each path refused in words of its own after other groups stepped. Every state: one
    # replaced by hand (opt.state[p]["exp_avg_sq"] = ...) steps silently, and its checkpoint is refused
    # (each step pays ~0.2 us per state). The states it keeps (``kept``), not a key of the user's
    # (torch.optim ignores those), nor the step counter
    for name, value in state.items():
        if name == "step" or name not in kept or not isinstance(value, Tensor):
            continue
        if value.shape != param.shape:
            raise ValueError(
                f"a parameter of shape {tuple(param.shape)} has a {name!r} state of shape {tuple(value.shape)}: the "
                "parameter's shape (through .data) or the state was changed after its states were made. Delete "
                "its states (del opt.state[p]) to start them afresh, or give the parameter back its shape"
            )
        if value.device != param.device:
            fix = (
                "a step or a load_state_dict while the model was on the meta device, before to_empty: meta states hold no "
                "values. Delete its states (del opt.state[p]) to start them afresh, or load the checkpoint after the model "
                "is materialized" if value.is_meta else
                "the model moved after its states were made or loaded. Load the optimizer's state_dict() back into it "
                "(a load puts each state on its parameter's device), or move the model before building the optimizer"
            )
            raise ValueError(f"a parameter on {param.device} has its {name!r} state on {value.device}: {fix}")


def _loaded_state(name: str, param: Tensor, index: int) -> str:
    """How load errors name a checkpoint state: by its parameter's place in the checkpoint."""
    return f"checkpoint state {name!r} of parameter {index} (shape {tuple(param.shape)})"


def _check_loaded_state(name: str, value, param: Tensor, index: int, signed: bool) -> None:
    """Raise a ValueError naming the parameter if checkpoint state ``name`` cannot be ``param``'s: a
    corrupt quantized state would make the fused kernel read and write past its buffers. A state that
    is not ``signed`` (a second moment) must hold no negative value."""
    where = _loaded_state(name, param, index)
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
    if not floating and value.dtype != torch.int8:
        raise ValueError(f"{where} has dtype {value.dtype}: int8-correction keeps int8 rounding errors")
    torchao = foreign.is_torchao_state(local(value))  # read by foreign.from_foreign, the state it makes checked as ours
    if isinstance(local(value), StateTensor):
        _check_state_tensor(where, local(value), signed)
        return
    if torchao:
        saved_signed = getattr(local(value), "signed", None)  # (torchao's fp8 keeps none)
        if saved_signed is not None and type(saved_signed) is not bool:
            raise ValueError(f"{where} is corrupt: its signed is {saved_signed!r}, not True or False")
        if saved_signed is not None and saved_signed != signed:
            raise ValueError(f"{where} is corrupt: {signedness_mismatch(saved_signed)}")
        # its scales are block maxima (over its table's largest value), whatever the state's sign
        values, held = foreign.torchao_parts(local(value), where)[1], "scale"
        if bool((values < 0).any()):
            raise ValueError(f"{where} is corrupt: its scale holds a negative value ({float(values.min())}), where it holds block maxima")
        if not signed:  # as it decodes (its table may hold negative values, its fp8 codes sign bits)
            decoded = foreign.from_foreign(local(value), signed)
            values, held = decoded.dequantize(torch.float32) if isinstance(decoded, StateTensor) else decoded.float(), "values"
    else:
        problem = not_plain(local(value))  # (one on the meta device: refused before torch.optim's load copies it)
        if problem is None and _overlaps(local(value)):
            problem = f"a view whose elements share memory (strides {local(value).stride()}), which a state written in place cannot be"
        if problem:
            raise ValueError(f"{where} is {problem}")
        values, held = local(value), "values"
    if not signed and bool((values < 0).any()):  # NaN passes: a poisoned block, as it was saved
        raise ValueError(f"{where} is corrupt: a negative value ({float(values.min())}) in its {held}, where it holds a nonnegative state")


def _check_state_tensor(where: str, state: StateTensor, signed: bool | None = None) -> None:
    """What the fused kernel and the compiled step trust of a loaded state, and of one converted
    from it (StateTensor.check_loaded), or a ValueError that names it by ``where``."""
    try:
        state.check_loaded(signed)
    except ValueError as error:
        raise ValueError(f"{where} is corrupt: {error}") from None


def _explain_inconsistent_states(optimizer: LowBitOptimizer, params: list[Tensor], error: Exception) -> None:
    """Raise a ValueError naming the first of ``params`` whose states no longer fit it (inner tensors
    replaced or resized after the checks), from ``error``, their compiled step's failure."""
    for p in params:  # (a plain state of another shape is refused before any step: _check_states_fit)
        for value in optimizer.state.get(p, {}).values():
            value = local(value)
            if isinstance(value, StateTensor):
                try:
                    value.check_layout()
                except ValueError as inconsistent:
                    raise ValueError(f"the compiled step cannot step a parameter of shape {tuple(p.shape)}: {inconsistent}") from error


def _check_no_shared_memory(entries: list[tuple[str, object]]) -> None:
    """Raise a ValueError naming two checkpoint states (``(where, value)``) whose tensors, or inner
    tensors, share memory: each is written in place, so one's steps would overwrite the other's."""
    spans = []  # (storage, first byte, end byte, where)
    for where, value in entries:
        value = local(value)
        if isinstance(value, StateTensor):
            tensors = [getattr(value, name, None) for name in value.inner_names]  # (one missing: refused later, named)
        elif isinstance(value, Tensor) and not foreign.is_torchao_state(value):  # (torchao's are read, and copied)
            tensors = [value]
        else:
            continue
        for t in tensors:
            if isinstance(t, Tensor) and not_plain(t) is None and t.numel():  # (anything else is refused later, named)
                first = t.storage_offset() * t.element_size()
                reach = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride())) + 1
                spans.append((t.untyped_storage().data_ptr(), first, first + reach * t.element_size(), where, t))
    spans.sort(key=lambda span: span[:2])
    for i, (storage, _, end, where, t) in enumerate(spans):
        for other, first, _, there, u in spans[i + 1 :]:
            if other != storage or first >= end:
                break
            if not _share_bytes(t, u):  # their extents overlap, their elements may not (interleaved views)
                continue
            if where == there:
                raise ValueError(f"{where} is corrupt: two of its tensors share memory, and each is written in place")
            raise ValueError(
                f"{where} and {there} share memory: each state is written in place, so one's steps would overwrite "
                "the other's. The checkpoint was saved from states that alias each other: save each its own tensor"
            )


def _share_bytes(t: Tensor, u: Tensor) -> bool:
    """Whether two tensors over one storage hold a byte in common (their extents overlap: checked
    element by element)."""

    def covered(x: Tensor) -> Tensor:  # every byte of every element, as offsets into the storage
        offsets = torch.tensor(x.storage_offset())
        for size, stride in zip(x.shape, x.stride()):
            offsets = offsets.unsqueeze(-1) + torch.arange(size) * stride
        return (offsets.reshape(-1, 1) * x.element_size() + torch.arange(x.element_size())).reshape(-1)

    return bool(torch.isin(covered(t), covered(u)).any())


def _overlaps(t: Tensor) -> bool:
    """Whether two of ``t``'s elements may share memory (an expanded view): unless each dimension,
    by increasing stride, steps past the reach of the smaller ones."""
    if t.numel() == 0:
        return False
    reach = 0
    for stride, size in sorted((stride, size) for size, stride in zip(t.shape, t.stride()) if size != 1):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


# each state's 1-D wrapper, kept while the state lives (its inner tensors are written in place) and
# its inner tensors are the state's: one assigned anew (state.codes = ...) makes a new wrapper
_FLAT_STATES = torch.utils.weak.WeakIdKeyDictionary()


def _flat(t: Tensor) -> Tensor:
    t = local(t)
    if isinstance(t, StateTensor):
        # a new wrapper over the same inner tensors, not an aten.view: dynamo cannot trace a subclass view
        flat = _FLAT_STATES.get(t)
        if flat is None or any(getattr(flat, name) is not getattr(t, name) for name in t.inner_names):
            flat = _FLAT_STATES[t] = t._like(shape=(t.numel(),))
        return flat
    # detached: a view keeps its base, whose shape dynamo would guard on (a new graph per rank or size-1 dim)
    return t.view(-1).detach() if t.is_contiguous() else t.reshape(-1)
