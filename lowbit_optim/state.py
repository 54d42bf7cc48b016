"""StateTensor and OptimState: the base tensor subclasses for compressed optimizer state.

A state looks like an ordinary float tensor of its logical shape but stores inner tensors: for an
OptimState, ``codes`` (uint8, flat, padded to whole blocks, two codes per byte for 4-bit formats)
and one fp32 ``scale`` per block. Every aten op is answered here, once, for all formats:

- metadata ops (detach, clone, view, slice, device moves) act on the inner tensors;
- ``copy_`` into a state quantizes, ``copy_`` out of it dequantizes;
- any other op falls back to dequantize -> run -> (for in-place ops) quantize back, so a step
  function written for fp32 tensors works unchanged. Ops returning views cannot be emulated that
  way (a write to the view would be lost) and raise an error naming the op and the format.

A format subclass only says how normalized values in [-1, 1] (or [-scale_max, scale_max]) become
codes and back: see ``formats.py``.
"""

import functools
import hashlib
import inspect
import math
import pathlib
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor
from torch._prims_common import infer_size
from torch.utils._python_dispatch import return_and_correct_aliasing
from torch.utils._pytree import tree_leaves, tree_map

from . import quant
from .registry import register_format

aten = torch.ops.aten

# how each refusal to cut or view a quantized state ends: the way out, also for a whole state dict
# (torch's set_optimizer_state_dict(full_state_dict=True) cuts each state for its rank)
DEQUANTIZE_FIRST = (
    "call .dequantize() first, and to write, copy_ the edited values back (v = state.dequantize(); v[...] = x; "
    "state.copy_(v)); a whole optimizer state dict: lowbit_optim.dequantize_state_dict(sd)"
)

_HANDLERS: dict = {}


def implements(*ops):
    """Register one handler for several aten ops (shared by every format)."""

    def register(handler: Callable) -> Callable:
        for op in ops:
            _HANDLERS[op] = handler
        return handler

    return register


@dataclass(frozen=True)
class KernelLayout:
    """How the fused CPU kernel (fused_cpu.py) steps a format: ``kind`` names the codec it runs
    ("codebook", "e4m3", "factored", "bf16-sr", "block-float"); ``tables`` holds the format's numbers that codec reads (CPU
    tensors, e.g. a codebook's values and its nearest-code tables); ``stochastic``: codes are rounded
    stochastically between the two codebook values around each value (quant.encode_stochastic with
    quant.dither), not to the nearest one."""

    kind: str
    tables: dict = field(default_factory=dict)
    stochastic: bool = False


def extend_fingerprint(fingerprint: str, text: str) -> str:
    """A format's numerics fingerprint (StateTensor._numerics_fingerprint) extended by ``text``: more
    of what defines its numbers (a subclass's tables, the source of functions it rounds with)."""
    return hashlib.sha256((fingerprint + text).encode()).hexdigest()[:16]


# what a blockwise format must inherit unchanged for the kernel's block scales and round trip to be its own
SCALED_AS_THE_KERNEL = ("quantize_", "dequantize", "_normalized_blocks", "_block_scales")


_SCALAR_TYPES = (type(None), bool, int, float, str, bytes, torch.dtype)


def _plain_text(value) -> str | None:
    """A text of ``value`` that is the same in every process, where it is made of plain values
    (numbers, strings, dtypes, and tuples, lists, sets and dicts of them), else None."""
    if type(value) in _SCALAR_TYPES:
        return repr(value)
    if type(value) in (tuple, list):
        items = [_plain_text(v) for v in value]
        return None if None in items else f"{type(value).__name__}({', '.join(items)})"
    if type(value) in (set, frozenset):  # in sorted order: a set's own order follows the hash seed
        items = [_plain_text(v) for v in value]
        return None if None in items else f"set({', '.join(sorted(items))})"
    if type(value) is dict:
        items = [(_plain_text(k), _plain_text(v)) for k, v in value.items()]
        return None if any(None in pair for pair in items) else f"dict({', '.join(sorted(f'{k}: {v}' for k, v in items))})"
    return None


def _class_values(cls) -> str:
    """The plain values that ``cls`` and its bases (below StateTensor's own) set as public class
    attributes, as text: what a format's methods may read (``levels``, ``fp8_dtype``, a table), so
    that a format edited there gets another fingerprint. (Private ones, such as a memo a method
    fills, and objects whose text may hold addresses are left out.)"""
    values = {}
    for klass in reversed(cls.__mro__[: cls.__mro__.index(StateTensor)]):
        values.update({k: text for k, v in vars(klass).items() if not k.startswith("_") and (text := _plain_text(v)) is not None})
    return repr(sorted(values.items()))


def _global_values(fn) -> str:
    """The plain values of the module globals that function ``fn`` (and the functions defined in
    it) reads, as text: a format's method may read a module constant as well as a class value."""
    names, codes = set(), [getattr(fn, "__code__", None)]
    while codes:
        code = codes.pop()
        if code is not None:
            names.update(code.co_names)
            codes += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    namespace = getattr(fn, "__globals__", {})
    return repr(sorted((n, text) for n in names if n in namespace and (text := _plain_text(namespace[n])) is not None))


@functools.cache
def _package_source() -> str:
    """The source of every lowbit_optim module: a format's numbers come from its methods and all
    they call (state.py's dispatch, a helper such as factored's _total), which no list of method
    names kept up with: a graph compiled before an edit of _total served the compiled step after it."""
    return "".join(map(_file_text, sorted(pathlib.Path(__file__).parent.glob("[!.]*.py"))))  # (not an editor's .#x.py)


def _file_text(path: pathlib.Path) -> str:
    try:
        return path.read_bytes().decode("utf-8", "replace")
    except OSError:  # (a file gone, or unreadable: its name, rather than no fingerprint at all)
        return path.name


def _modules_source(cls) -> str:
    """The source of the modules outside lowbit_optim that define ``cls`` and its bases (a user's
    format and its helpers), or their names where no source is kept."""
    texts = []
    for name in sorted({klass.__module__ for klass in cls.__mro__[: cls.__mro__.index(StateTensor)]}):
        if name.split(".")[0] != __package__:
            try:
                texts.append(inspect.getsource(sys.modules[name]))
            except (OSError, TypeError, KeyError):  # (an interactive session, or installed without sources)
                texts.append(name)
    return "".join(texts)


def _quant_fingerprint() -> str:
    """quant.py's constants (its source is the package's): the formats' methods call its functions,
    whose own constants (MIN_BLOCK_SCALE, read by block_absmax) their sources do not show, and which
    may be set at run time; a stale graph kept 1e-12. (Not its dunders: __file__ would tell one
    install of the same code from another.)"""
    return repr(sorted((n, text) for n, v in vars(quant).items() if not n.startswith("__") and (text := _plain_text(v)) is not None))


def computes_as(cls, base, *methods: str) -> bool:
    """Whether ``cls`` inherits ``methods`` from ``base`` unchanged: only then may it declare
    ``base``'s kernel layout (a subclass with its own encoding must take the compiled step)."""
    return all(getattr(getattr(cls, m), "__func__", getattr(cls, m)) is getattr(getattr(base, m), "__func__", getattr(base, m)) for m in methods)


# a block holds one scale, so blocks larger than a few thousand elements save nothing, while every
# state is padded to whole blocks: a larger block_size chosen now is a typo (2**40 bytes at the first
# step). A saved state's is its own (an earlier release took any): it loads, converted if need be
MAX_BLOCK_SIZE = 2**16


def check_block_size(block_size, bits: int = 8, chosen: bool = False) -> int:
    """``block_size`` if it is a power of two that holds whole bytes of ``bits``-bit codes (and, if
    ``chosen`` now for new states, at most MAX_BLOCK_SIZE), else a ValueError."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a positive power of two (e.g. 128 or 256), got {block_size!r}")
    if chosen and block_size > MAX_BLOCK_SIZE:
        raise ValueError(
            f"block_size {block_size} is beyond the largest, {MAX_BLOCK_SIZE}: a block holds one scale, so larger blocks "
            "save no memory, and each state is padded to whole blocks. Use e.g. 256"
        )
    if block_size * bits % 8:
        least = 8 // math.gcd(bits, 8)
        raise ValueError(f"block_size {block_size} does not hold whole bytes of {bits}-bit codes; use at least {least}")
    return block_size


class StateTensor(Tensor):
    """What every state subclass shares: it looks like an ordinary float tensor of its logical shape,
    stores the inner tensors named in ``inner_names``, and answers aten ops through the shared handlers
    below (reading dequantizes, ``copy_`` quantizes). Subclasses: OptimState (codes + block scales)
    and FactoredState (row and column statistics, factored.py)."""

    name: ClassVar[str | None] = None  # registry key; None for abstract bases
    inner_names: ClassVar[tuple[str, ...]] = ()
    inner_dtypes: ClassVar[tuple[torch.dtype, ...]] = ()  # of the inner tensors, in inner_names' order
    holds_signed: ClassVar[bool] = True  # False: only nonnegative states (second moments)
    holds_elements: ClassVar[bool] = True  # False: no element's value of its own (factored's sums), so no running maximum
    # the slowest moving average (its per-step decay, beta) that a signed state in this format holds,
    # or None: any. A format whose rounding noise is drawn afresh at every write gathers it in an
    # average with a larger beta faster than the average lets it decay (lowrank.py)
    max_signed_decay: ClassVar[float | None] = None
    # whether the state is blocks of codes stored apart from each other, so that a slice on block
    # boundaries is a state of its own (the compiled step cuts large parameters so, base._pieces; DCP
    # reshards so, distributed.py): OptimState's are, factored sums and low-rank parts are not
    independent_blocks: ClassVar[bool] = False
    # inner tensors that describe the whole state rather than its elements (the count of writes of
    # 10bit-sr and bf16-sr, which salts their rounding with the block index): a slice of one step takes
    # them from later_slice (base._pieces), and a DCP checkpoint that reshards the state's codes
    # carries them over as saved (distributed.py)
    whole_state_names: ClassVar[tuple[str, ...]] = ()
    # inner tensors that hold no negative value, and what they hold: a loaded state with one there is
    # corrupt (base._check_state_tensor), where the step would make NaN of it
    nonnegative: ClassVar[dict[str, str]] = {}
    # Raise it when a release changes what a format's codes mean: checkpoints carry the version they
    # were written with, and loading one of another version fails instead of decoding wrong numbers.
    format_version: ClassVar[int] = 1

    signed: bool
    block_size: int | None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        owner = next(k for k in cls.__mro__ if "name" in vars(k))
        if cls.name is not None and owner is not cls and issubclass(owner, StateTensor):
            raise TypeError(
                f"{cls.__name__} inherits the format name {cls.name!r} from {owner.__name__}: give it a name of its own "
                f"(name = '...') to register it, or name = None for a base that is not a format"
            )
        torch.serialization.add_safe_globals([cls])  # torch.load(weights_only=True) may rebuild it
        if cls.name is not None:
            register_format(cls)

    def __init__(self, *args, **kwargs):
        self.format_version = type(self).format_version  # saved with the state by torch.save

    # ---- what a layout defines ----------------------------------------------------------------

    def _meta(self) -> tuple:
        """The constructor arguments after the inner tensors and the shape (the dtype comes last)."""
        raise NotImplementedError

    @classmethod
    def zeros(cls, shape, signed: bool | None = None, block_size: int | None = None, device=None, dtype=None):
        """A state of logical ``shape`` holding zeros; ``signed`` defaults to signed where the format
        holds signed values (``signedness``, as from_float's)."""
        raise NotImplementedError

    @classmethod
    def signedness(cls, signed: bool | None) -> bool:
        """``signed``, or where it is None (zeros' and from_float's default) whether the format holds signed values."""
        return cls.holds_signed if signed is None else signed

    def quantize_(self, x: Tensor) -> None:
        """Overwrite the inner tensors with the representation of float tensor ``x`` (same numel)."""
        raise NotImplementedError

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The plain tensor this state stands for, in ``dtype`` (default: its appearance dtype)."""
        raise NotImplementedError

    def _rows(self, start: int, end: int) -> "StateTensor":
        """The view of rows [start, end) that aten.slice along dim 0 returns."""
        raise NotImplementedError(f"{_format_name(self)} cannot be sliced; {DEQUANTIZE_FIRST}")

    @property
    def slice_unit(self) -> int | None:
        """The elements a step's slice starts at a multiple of (base._pieces): a block, or None
        where no slice computes what the whole does (factored sums, a low-rank part, whole-state
        tensors that no later_slice of the class hands out)."""
        return self.block_size if self.independent_blocks and self._later_slices_fit() else None

    def _later_slices_fit(self) -> bool:
        """Whether later_slice hands out this state's whole-state tensors as its quantize_ uses them:
        it has none, or its class's later_slice was written with (at or below) the class whose
        quantize_ it runs; a subclass with a quantize_ of its own, or none of later_slice, is stepped whole."""
        if not self.whole_state_names:
            return True
        mro = type(self).__mro__
        defined = {m: next(k for k in mro if m in vars(k)) for m in ("later_slice", "quantize_")}
        return issubclass(defined["later_slice"], defined["quantize_"])

    def later_slice(self, first_block: int) -> "StateTensor":
        """This slice (from block ``first_block`` of its state, in slice units) as a step's later
        slice holds it: the first slice counts the write in ``whole_state_names``' tensors, the later
        ones take copies that make them write as the whole state would (base._pieces)."""
        raise NotImplementedError(f"{type(self).__name__} keeps whole-state tensors {self.whole_state_names}: define later_slice for the compiled step's slices")

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        """What the fused CPU kernel needs to step this format, or None: only the compiled step can.
        It vouches for the inner tensors as this class stores them: a subclass that stores them in
        other dtypes takes the compiled step (kernel_op.format_kind)."""
        return None

    # A state whose values are its codes plus a part kept apart (LowRankState: a low-rank part that
    # spans the whole matrix) goes through the kernel in three moves: kernel_addend writes that part
    # as fp32 values, which the kernel adds to the decoded codes and overwrites with the state's new
    # values; kernel_residual(those values) then updates the part and returns what its codes must
    # hold, which the kernel encodes (fused_cpu.step). Both write into buffers they are given.
    @property
    def has_addend(self) -> bool:
        """Whether a part of this state's values lies outside its codes (then the kernel takes it
        from kernel_addend)."""
        return False

    def kernel_addend(self, out: Tensor) -> Tensor:
        """The part of this state's values outside its codes, written into ``out`` (numel flat fp32
        values) and returned (``has_addend``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no values outside its codes")

    def kernel_residual(self, values: Tensor) -> tuple["StateTensor", Tensor]:
        """Given the state's new flat fp32 values, update the part outside the codes and return the
        state of its codes alone and the flat values to encode into them, computed over ``values``
        (``has_addend``)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no values outside its codes")

    def _check_sizes(self) -> None:
        """Raise a ValueError if the inner tensors' sizes, or the metadata that sets them, do not fit
        the logical shape (check_layout has checked each is a 1-D tensor of its dtype)."""
        raise NotImplementedError(f"{type(self).__name__} must define _check_sizes")

    # ---- shared -------------------------------------------------------------------------------

    @classmethod
    def check_signed(cls, signed: bool) -> None:
        if signed and not cls.holds_signed:
            raise ValueError(
                f"the {cls.name!r} state format holds nonnegative states only: use it for exp_avg_sq, e.g. "
                f"state_format={{'exp_avg': '4bit', 'exp_avg_sq': {cls.name!r}}}"
            )

    @classmethod
    def from_float(cls, x: Tensor, signed: bool | None = None, block_size: int | None = None):
        """Quantize a float tensor; the state keeps its shape, device and dtype (as appearance).
        ``signed`` defaults to signed where the format holds signed values."""
        if not x.is_floating_point():
            raise TypeError(f"{cls.__name__}.from_float needs a floating-point tensor, got {x.dtype}")
        signed = cls.signedness(signed)
        out = cls.zeros(x.shape, signed, block_size, device=x.device, dtype=x.dtype)
        out.copy_(x)
        return out

    def check_layout(self) -> None:
        """Raise a ValueError saying what is wrong if the inner tensors do not fit the logical shape,
        as in a truncated or edited checkpoint: the fused kernel trusts them, and would read and write
        past their ends. What it decides must follow from the inner tensors' dtypes, shapes, layouts
        and devices and the metadata (``__tensor_flatten__``'s): the kernel's op remembers a verdict by
        those (kernel_op._Checked)."""
        try:
            signed = getattr(self, "signed", None)  # (a checkpoint's object may lack any attribute)
            if not isinstance(signed, bool):
                raise ValueError(f"signed is {signed!r}, not a bool")
            device = self.device
            for name, dtype in zip(self.inner_names, self.inner_dtypes):
                t = getattr(self, name, None)
                if not isinstance(t, Tensor) or t.dtype != dtype or t.dim() != 1 or not t.is_contiguous() or t.device != device:
                    raise ValueError(f"{name} must be a 1-D contiguous {dtype} tensor on {device}, not {describe_tensor(t)}")
                if not_plain(t):
                    raise ValueError(f"{name} is {not_plain(t)}")
            try:
                self._meta()  # every metadata attribute (a checkpoint's object may lack one)
            except AttributeError as missing:
                raise ValueError(f"its metadata is incomplete: {missing}") from None
            self._check_sizes()
        except ValueError as error:
            raise ValueError(
                f"{_format_name(self)} of shape {tuple(self.shape)} is inconsistent: {error}. Make states with "
                f"{type(self).__name__}.zeros() or .from_float(), or load an intact checkpoint"
            ) from None

    def check_values(self) -> None:
        """Raise a ValueError if a loaded state (its layout checked) holds values it cannot have, such
        as codes outside its codebook; read once, at a load: it may cost a pass over the state. Here:
        a nonnegative state (a second moment) that decodes to a negative value (an fp8 code's sign
        bit, a bf16-sr value), which would make NaN of the step's sqrt. A format whose decoded sign
        follows from what the load checks anyway (a nonnegative codebook, ``nonnegative`` inner
        tensors) may skip that pass."""
        if not self.signed:
            values = self.dequantize(torch.float32)  # (fp16 would read a tiny negative value as -0)
            if bool((values < 0).any()):
                raise ValueError(f"a negative value ({float(values.min())}) in its values, where it holds a nonnegative state")

    def check_loaded(self, signed: bool | None = None) -> None:
        """Raise a ValueError saying what is wrong with a state read from a file, before anything
        reads its codes: its layout (check_layout), its signedness where the caller knows which it
        holds (the other table would read its codes), a negative value where it keeps maxima or sums
        of squares (``nonnegative``), values it cannot hold (check_values)."""
        self.check_layout()
        if signed is not None and self.signed != signed:
            raise ValueError(signedness_mismatch(self.signed))
        for name, held in self.nonnegative.items():
            values = getattr(self, name)
            if bool((values < 0).any()):  # NaN passes: a poisoned block, as it was saved
                raise ValueError(f"its {name} holds a negative value ({float(values.min())}), where it holds {held}")
        self.check_values()  # (after the scales: a negative one would show as decoded values first)
        _FROM_FILE.pop(id(self), None)

    def _inner(self) -> dict[str, Tensor]:
        return {name: getattr(self, name) for name in self.inner_names}

    def _like(self, shape=None, dtype=None, **inner: Tensor) -> "StateTensor":
        """The same kind of state over ``inner`` tensors (default: these), shape and dtype."""
        tensors = [inner.get(name, t) for name, t in self._inner().items()]
        return type(self)(*tensors, self.shape if shape is None else shape, *self._meta(), dtype or self.dtype)

    def _map_inner(self, fn: Callable[[Tensor], Tensor], **kwargs) -> "StateTensor":
        return self._like(**kwargs, **{name: fn(t) for name, t in self._inner().items()})

    def _same_layout(self, other: Tensor) -> bool:
        """Whether ``other`` stores values exactly as this state does (a copy is then bit-exact)."""
        return (
            type(other) is type(self)
            and other._meta() == self._meta()
            and all(a.shape == b.shape for a, b in zip(other._inner().values(), self._inner().values()))
        )

    # what reads a tensor's storage directly (torch's wrapper subclass has none of its own: share_memory_()
    # crashed the process, tolist() and numpy() refused) reads the values, or shares the inner tensors
    def tolist(self):
        return self.dequantize().tolist()

    def numpy(self, *, force: bool = False):
        return self.dequantize().numpy(force=force)

    def __array__(self, *args, **kwargs):
        return self.dequantize().__array__(*args, **kwargs)

    def __format__(self, spec: str) -> str:
        return self.dequantize().__format__(spec) if self.dim() == 0 else super().__format__(spec)

    def share_memory_(self) -> "StateTensor":
        for t in self._inner().values():
            t.share_memory_()
        return self

    def is_shared(self) -> bool:
        return all(t.is_shared() for t in self._inner().values())

    @property
    def data(self) -> Tensor:
        return Tensor.data.__get__(self)

    @data.setter
    def data(self, value) -> None:  # torch's set_data would relabel the wrapper, leaving the codes as they were
        raise TypeError(
            f"{_format_name(self)}.data = ... would change its shape or dtype without its codes: write values with "
            "state.copy_(values), or replace the state (opt.state[p][name] = state.to(device))"
        )

    def __reduce_ex__(self, protocol):
        # saved as its attributes (inner tensors, metadata), rebuilt on its inner tensors' device, where
        # map_location put them: torch's rebuild of a wrapper subclass asks map_location for the wrapper's
        # device itself, and refuses a callable one (Lightning's default: lambda storage, loc: storage)
        return _rebuild_state, (type(self), self.dtype, tuple(self.shape), self.requires_grad, torch._utils._get_obj_state(self))

    def __setstate__(self, state):
        # torch.load rebuilds a saved state here (with or without weights_only)
        attributes = _saved_attributes(type(self), state)
        saved = attributes.get("format_version", 1)
        if saved != type(self).format_version:
            legacy = type(self).legacy_format(saved)
            if legacy is None:
                raise ValueError(
                    f"this checkpoint holds a {type(self).__name__} ({self.name!r} state format) written when its "
                    f"codes meant other numbers (format version {saved}, this code's {type(self).format_version}); load "
                    "it with the code that wrote it and save dequantize()d states"
                )
            # the same codes, read as the format that now holds their old meaning
            self.__class__ = legacy
            attributes["format_version"] = legacy.format_version
        kept = _instance_attributes(type(self))
        foreign = sorted(k for k in attributes if isinstance(k, str) and k not in kept) if kept is not None else []
        if foreign:  # e.g. inner_names or nonnegative: set on the object, they would switch off the checks of a load
            raise ValueError(
                f"this checkpoint's {type(self).__name__} ({self.name!r} state format) sets {foreign}, which such a state does "
                f"not keep (it keeps {sorted(kept)}): the checkpoint is edited or corrupt"
            )
        torch._utils._set_obj_state(self, state)
        _FROM_FILE[id(self)] = self

    @classmethod
    def legacy_format(cls, version: int) -> "type[StateTensor] | None":
        """The format whose codes mean what this one's meant in an earlier ``format_version``."""
        return None

    def __tensor_flatten__(self):
        return list(self.inner_names), (*self._meta(), self.dtype)

    @classmethod
    def __tensor_unflatten__(cls, inner, meta, outer_size, outer_stride):
        return cls(*(inner[name] for name in cls.inner_names), outer_size, *meta)

    def _stable_hash_for_caching(self) -> str:
        # lets torch.compile's AOT cache reuse graphs across processes. The key holds the metadata and
        # what the format computes (a class keeping its name while changing its codebook must not
        # load graphs compiled for the old one)
        cls = type(self)
        meta = ":".join(map(str, (*self._meta(), self.dtype)))
        # and which inner sizes are 0 or 1: compiling specializes on those (a factored state's row
        # sums of a (1, n) parameter against an (n,) one's), so a graph must not serve the other
        sizes = ",".join(f"{name}{tuple(d if d < 2 else 'n' for d in t.shape)}" for name, t in self._inner().items())
        return f"{cls.__module__}.{cls.__qualname__}:{cls._numerics_fingerprint(self.signed)}:{meta}:{sizes}"

    @classmethod
    def check_format(cls, signed: bool, device: torch.device = torch.device("cpu")) -> None:
        """Raise a ValueError naming what is wrong with this format for a state of this signedness
        (a codebook's values) on ``device``: an optimizer calls it when it takes the format, so that
        a malformed format is refused there rather than at the first step."""

    @classmethod
    @functools.cache
    def _numerics_fingerprint(cls, signed: bool) -> str:
        """A hash of the code that defines the format's numbers (its encoding and scaling)."""
        parts = []
        for name in ("encode", "decode", "rounding_space", "calibrated", "quantize_", "dequantize", "_normalized_blocks", "_block_scales", "scale_min"):
            if not hasattr(cls, name):
                continue
            fn = getattr(getattr(cls, name), "__func__", getattr(cls, name))
            try:
                parts.append(inspect.getsource(fn))
            except (OSError, TypeError):  # defined where no source is kept (e.g. an interactive session)
                parts.append(fn.__qualname__)
            parts.append(_global_values(fn))
        parts.append(":".join(f"{k}={getattr(cls, k, None)}" for k in ("bits", "scale_max", "inner_names", "inner_dtypes")))
        parts.append(_class_values(cls))
        parts.append(_quant_fingerprint())
        parts += [_package_source(), _modules_source(cls)]
        return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]

    def __repr__(self):
        meta = "".join(f", {k}={v}" for k, v in self._describe().items())
        return f"{type(self).__name__}(shape={tuple(self.shape)}{meta}, dtype={self.dtype}, device={self.device})"

    def _describe(self) -> dict:
        return {"signed": self.signed}

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func, _dequantize_and_run)
        return handler(func, args, kwargs)


class OptimState(StateTensor):
    """Base class of block-quantized optimizer states. Subclasses set ``name``, ``bits``,
    ``default_block_size`` and implement ``encode``/``decode`` (see ``CodebookState`` for the usual
    case of a table of code values)."""

    inner_names = ("codes", "scale")
    inner_dtypes = (torch.uint8, torch.float32)
    nonnegative = {"scale": "block maxima"}
    bits: ClassVar[int] = 8  # 8, 4 (two codes per byte) or 10 (quant.pack_codes)
    default_block_size: ClassVar[int] = 256
    scale_max: ClassVar[float] = 1.0  # the code value a block's largest value (its absmax, mostly) maps to
    independent_blocks = True
    # a nonnegative state's positive value that rounds to the code of 0 takes the smallest positive
    # code instead (positive_floor): an Adam second moment read as 0, beside a first moment that is
    # not, made steps 30-60x too large where a block's gradients span 1e4 (False: torchao's rounding)
    floors_positive: ClassVar[bool] = True

    codes: Tensor
    scale: Tensor
    block_size: int

    @classmethod
    def check_format(cls, signed: bool, device: torch.device = torch.device("cpu")) -> None:
        lowest = cls.scale_min(signed)  # the kernel reads it as fp32: it must be one, as scale_max is
        if not (isinstance(lowest, float) and -math.inf < lowest < 0 and torch.tensor(lowest, dtype=torch.float32).item() == lowest):
            raise ValueError(
                f"{cls.__name__}.scale_min({signed}) = {lowest!r}: it must be a negative finite float that fp32 holds "
                "exactly, the code value a block's most negative value maps to"
            )
        if cls.bits <= 8:  # codes of one byte or less: encode's, unpacked, are uint8 (float ones took 4 bytes each)
            # one block as quantize_ passes it (a row), from -scale_max (or 0) to scale_max, in
            # float32 (not the default dtype)
            n = cls.default_block_size
            probe = torch.linspace(-1.0 if signed else 0.0, 1.0, n, dtype=torch.float32, device=device).mul(cls.scale_max).view(1, n)
            what = f"one block of {n} values from {float(probe[0, 0])} to {cls.scale_max} (float32, on {device})"
            try:
                codes = cls.encode(probe, signed)
            except Exception as e:
                raise ValueError(f"{cls.__name__}.encode fails on {what}: {type(e).__name__}: {e}") from e
            if not isinstance(codes, Tensor) or codes.dtype != torch.uint8 or codes.shape != probe.shape:
                raise ValueError(
                    f"{cls.__name__}.encode gives {describe_tensor(codes)} for {what}: it must give one "
                    "torch.uint8 code per value, in the values' shape (unpacked: the state packs codes of fewer bits)"
                )

    # ---- what a format defines --------------------------------------------------------------

    @classmethod
    def encode(cls, normalized: Tensor, signed: bool) -> Tensor:
        """fp32 values in [-scale_max, scale_max] -> codes (one per element, unpacked; uint8 up to 8 bits)."""
        raise NotImplementedError

    @classmethod
    def decode(cls, codes: Tensor, signed: bool) -> Tensor:
        """Codes (unpacked) -> fp32 values."""
        raise NotImplementedError

    @classmethod
    def encode_blocks(cls, normalized: Tensor, scale: Tensor, signed: bool) -> Tensor:
        """The codes of blocks (the rows of ``normalized``) whose scales are ``scale``: ``encode``'s.
        A stochastic format's random numbers depend on the scales too (StochasticRounding)."""
        return cls.encode(normalized, signed)

    @classmethod
    def scale_min(cls, signed: bool) -> float:
        """The code value a block's most negative value maps to, where that takes a larger scale than
        its largest value at scale_max: -scale_max for codes symmetric about 0."""
        return -float(cls.scale_max)

    @classmethod
    def decodes_as(cls, other, signed: bool) -> bool:
        """Whether a state of format ``other`` stands for the same numbers read as one of this format,
        so that it changes between them without requantizing (formats.convert). Only codebook formats
        tell (CodebookState); any other is requantized."""
        return False

    @classmethod
    def rounding_space(cls, values: Tensor, signed: bool) -> Tensor:
        """A strictly increasing map of normalized values (float64): ``encode`` picks the code
        nearest to a value in this space. The identity: the nearest value."""
        return values

    @classmethod
    def positive_floor(cls, signed: bool) -> tuple[int, int] | None:
        """(the code of 0, the smallest positive code) where a positive value of a nonnegative state
        that encodes to the former takes the latter (``floors_positive``), or None: a signed state,
        codes of more than 8 bits, or no code of 0 (4-bit second moments, block floats)."""
        if signed or not cls.floors_positive or cls.bits > 8:
            return None
        return _positive_floor(cls)

    @classmethod
    def calibrated(cls, signed: bool) -> bool:
        """Whether a block's stored scale is its absmax times the calibration factor of
        ``quant.calibrated_scale`` (unbiased blocks) rather than the absmax itself."""
        return False

    # ---- construction ------------------------------------------------------------------------

    def __init_subclass__(cls, **kwargs):
        if cls.bits not in (4, 8, 10):
            raise TypeError(f"{cls.__name__}.bits must be 8, 4 or 10, got {cls.bits}")
        super().__init_subclass__(**kwargs)

    @staticmethod
    def __new__(cls, codes: Tensor, scale: Tensor, shape, block_size: int, signed: bool, dtype=torch.float32):
        return Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=codes.device)

    def __init__(self, codes: Tensor, scale: Tensor, shape, block_size: int, signed: bool, dtype=torch.float32):
        super().__init__()
        self.codes = codes
        self.scale = scale
        self.block_size = block_size
        self.signed = signed

    @classmethod
    def zeros(cls, shape, signed: bool | None = None, block_size: int | None = None, device=None, dtype=None):
        """A state of logical ``shape`` holding zeros (all-zero scales)."""
        signed = cls.signedness(signed)
        shape = torch.Size((shape,) if isinstance(shape, int) else shape)
        codes, scale, block_size = cls._zero_blocks(shape.numel(), signed, block_size, device)
        return cls(codes, scale, shape, block_size, signed, dtype=dtype or torch.float32)

    @classmethod
    def _zero_blocks(cls, numel: int, signed: bool, block_size: int | None, device) -> tuple[Tensor, Tensor, int]:
        """(codes, scale, block_size) of ``numel`` zeros."""
        block_size = check_block_size(cls.default_block_size if block_size is None else block_size, cls.bits, chosen=True)
        blocks = quant.num_blocks(numel, block_size)
        codes = cls.encode(torch.zeros(block_size, dtype=torch.float32, device=device), signed)  # zero's code, once
        packed = quant.pack_codes(codes, cls.bits, block_size)  # one block's bytes: packing all would hold int32 copies of every code
        return packed.repeat(blocks), torch.zeros(blocks, dtype=torch.float32, device=device), block_size

    def _meta(self) -> tuple:
        return (self.block_size, self.signed)

    def _check_sizes(self) -> None:
        bits, block_size = type(self).bits, self.block_size  # the class's bits, as the kernel reads them
        check_block_size(block_size, bits)
        blocks = quant.num_blocks(self.numel(), block_size)
        if self.scale.numel() != blocks or self.codes.numel() != blocks * block_size * bits // 8:
            raise ValueError(
                f"codes has {self.codes.numel()} and scale {self.scale.numel()} elements, but {self.numel()} elements "
                f"in {blocks} blocks of {block_size} need {blocks * block_size * bits // 8} bytes of {bits}-bit codes "
                f"and {blocks} scales"
            )

    def _describe(self) -> dict:
        return {"signed": self.signed, "block_size": self.block_size}

    # ---- quantization (traced by torch.compile through copy_) ---------------------------------

    @property
    def padded_numel(self) -> int:
        return self.scale.numel() * self.block_size

    def quantize_(self, x: Tensor) -> None:
        """Overwrite codes and scales with the quantization of float tensor ``x`` (same numel)."""
        normalized, scale = self._normalized_blocks(x)
        codes = self.encode_blocks(normalized, scale, self.signed)
        floor = type(self).positive_floor(self.signed)
        if floor is not None:
            zero, smallest = floor
            codes = torch.where((codes == zero) & (normalized > 0), smallest, codes)
        if self.calibrated(self.signed):
            scale = quant.calibrated_scale(scale, normalized, self.decode(codes, self.signed))
        self._store(codes, scale)

    def _normalized_blocks(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``x`` in blocks (rows) divided by their scales (_block_scales)."""
        blocks = quant.to_blocks(x.float(), self.block_size, self.padded_numel)
        scale = self._block_scales(blocks)
        return blocks / scale[:, None], scale

    def _block_scales(self, blocks: Tensor) -> Tensor:
        """Each block's scale: its largest value maps to scale_max, or its most negative one to
        scale_min, whichever needs the larger scale (quant.block_scales)."""
        return quant.block_scales(blocks, self.scale_max, type(self).scale_min(self.signed))

    def _store(self, codes: Tensor, scale: Tensor) -> None:
        self.codes.copy_(quant.pack_codes(codes.view(-1), self.bits, self.block_size))
        self.scale.copy_(scale)

    def unpacked_codes(self) -> Tensor:
        """The codes, one per element of the padded blocks (``quant.code_dtype(bits)``)."""
        return quant.unpack_codes(self.codes, self.bits, self.block_size)

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The plain tensor this state stands for, in ``dtype`` (default: its appearance dtype)."""
        codes = self.unpacked_codes()
        values = self.decode(codes, self.signed).view(-1, self.block_size) * self.scale[:, None]
        numel = self.numel()
        if isinstance(numel, int) and numel % self.block_size:
            # torch 2.13's C++ inductor, compiling for fixed sizes, splits a loop over the first numel of
            # these values into whole blocks and drops the last, partial one (CppScheduling.try_loop_split):
            # a strided view of them is read at plain indices instead (the same view in eager)
            flat = values.as_strided((numel,), (1,))
        else:
            flat = values.view(-1)[:numel]
        return flat.view(self.shape).to(dtype or self.dtype)

    # ---- views and sharding -------------------------------------------------------------------

    def _rows(self, start: int, end: int) -> "OptimState":
        # needed by FSDP2 / DCP to take row shards; only whole blocks can be cut out of a quantized state
        rows = self.shape[0] if self.dim() else 1
        row_numel = self.numel() // rows if rows else 0
        first, last = start * row_numel, end * row_numel
        bs = self.block_size
        if first % bs or (last % bs and last != self.numel()):
            raise ValueError(
                f"cannot slice {_format_name(self)} rows [{start}:{end}] of shape {tuple(self.shape)}: elements "
                f"[{first}:{last}] do not start and end on block boundaries (block_size={bs}). "
                f"Slice at multiples of {bs} elements or {DEQUANTIZE_FIRST}."
            )
        first_block, end_block = first // bs, quant.num_blocks(last, bs)
        per_block = bs * self.bits // 8
        codes = self.codes[first_block * per_block : end_block * per_block]
        return self._like(codes=codes, scale=self.scale[first_block:end_block], shape=(end - start, *self.shape[1:]))


class CodebookState(OptimState):
    """A format given by a table of code values: ``codebook(signed)`` returns up to 2**bits sorted
    floats in [-1, 1] that end at ``scale_max`` (1.0, where each block's absmax lands); encoding picks
    the exact nearest one (ties to the larger), via lookup tables, nearest in value or in the
    format's ``rounding_space``. Codes are bytes or nibbles: bits 8 or 4."""

    def __init_subclass__(cls, **kwargs):
        if cls.bits not in (4, 8):  # a code is a byte or a nibble (quant.py: at most 256 codebook values)
            raise TypeError(f"{cls.__name__}.bits must be 8 or 4 for a codebook (at most 256 values), got {cls.bits}; 10-bit states are block floats (block_float.py)")
        super().__init_subclass__(**kwargs)

    @classmethod
    def codebook(cls, signed: bool) -> list[float]:
        raise NotImplementedError(f"{cls.__name__} defines no codebook: a CodebookState subclass returns its code values from codebook(signed)")

    @classmethod
    def check_format(cls, signed: bool, device: torch.device = torch.device("cpu")) -> None:
        _table_values(cls, signed)
        super().check_format(signed, device)

    def check_values(self) -> None:
        # (a nonnegative state's codebook is nonnegative, its scales are checked: no decoding pass)
        values = _table_values(type(self), self.signed)["codebook"][0]  # codes past the codebook's decode to NaN
        count = sum(not math.isnan(v) for v in values)
        if count == 2**self.bits or not self.codes.numel():  # every code is a value (8bit's, 4bit's): no pass
            return
        top = int(self.unpacked_codes().max())
        if top >= count:
            raise ValueError(f"a code is {top}, past the codebook's {count} values (codes 0 to {count - 1}), where it decodes to NaN")

    @classmethod
    def scale_min(cls, signed: bool) -> float:
        lowest = _table_values(cls, signed)["codebook"][0][0]  # the dynamic tree's: -0.99297
        return lowest if signed and lowest < 0 else super().scale_min(signed)

    @classmethod
    def decodes_as(cls, other, signed: bool) -> bool:
        """Whether a state of format ``other`` stands for the same numbers read as one of this format
        (one codebook and packing; how writes round or scale may differ: 8bit, 8bit-sr, 8bit-torchao),
        so that it changes between them without requantizing."""
        reads = ("decode", "dequantize", "unpacked_codes")
        return (
            isinstance(other, type) and issubclass(other, CodebookState) and (other.bits, other.inner_names) == (cls.bits, cls.inner_names)
            and computes_as(cls, CodebookState, *reads) and computes_as(other, CodebookState, *reads)
            and _table_values(cls, signed)["codebook"] == _table_values(other, signed)["codebook"]
        )  # fmt: skip

    @classmethod
    def encode(cls, normalized: Tensor, signed: bool) -> Tensor:
        base_code, threshold = _code_tables(cls, signed, normalized.device)
        return quant.encode_nearest(normalized, base_code, threshold)

    @classmethod
    def decode(cls, codes: Tensor, signed: bool) -> Tensor:
        return quant.decode_codebook(codes, _codebook_tensor(cls, signed, codes.device))

    @classmethod
    def kernel_layout(cls, signed: bool) -> KernelLayout | None:
        if not computes_as(cls, CodebookState, "encode", "encode_blocks", "decode", *SCALED_AS_THE_KERNEL):
            return None
        return cls._codebook_layout(signed)

    @classmethod
    def _codebook_layout(cls, signed: bool, stochastic: bool = False) -> KernelLayout:
        names = ("codebook", "base_code", "threshold", "decision_thresholds")
        return KernelLayout("codebook", {name: _table(cls, signed, name, torch.device("cpu")) for name in names}, stochastic)

    @classmethod
    @functools.cache
    def _numerics_fingerprint(cls, signed: bool) -> str:
        tables = _table_values(cls, signed)
        text = repr([tables[name][0] for name in ("codebook", "threshold")])
        return extend_fingerprint(super()._numerics_fingerprint(signed), text)


@functools.cache
def _positive_floor(cls) -> tuple[int, int] | None:
    """OptimState.positive_floor of a nonnegative state: from its decoded codes, once per format
    (with real tensors even where the first call comes from inside a trace, as _table_values)."""
    with torch.utils._python_dispatch._disable_current_modes():
        values = cls.decode(torch.arange(2**cls.bits, dtype=torch.uint8), False)
        positive = torch.where(values > 0, values, math.inf)
        if not bool((values == 0).any() and positive.isfinite().any()):
            return None
        return int((values == 0).int().argmax()), int(positive.argmin())  # the first code of 0 (fp8's +0)


def _codebook_tensor(cls, signed: bool, device: torch.device) -> Tensor:
    return _table(cls, signed, "codebook", device)


def _code_tables(cls, signed: bool, device: torch.device) -> tuple[Tensor, Tensor]:
    return _table(cls, signed, "base_code", device), _table(cls, signed, "threshold", device)


@functools.cache
def _table_values(cls, signed: bool) -> dict[str, tuple[list, torch.dtype]]:
    """Codebook and encoding tables as Python lists, built once per format and signedness (checked
    when an optimizer takes the format: CodebookState.check_format). Built with real tensors even
    where the first call comes from inside a trace (fake tensors would give symbolic lists)."""
    with torch.utils._python_dispatch._disable_current_modes():
        return _build_tables(cls, signed)


def _build_tables(cls, signed: bool) -> dict[str, tuple[list, torch.dtype]]:
    which = f"{cls.__name__}.codebook({signed})"
    # decode returns fp32 values, so the decision boundaries must be those of the fp32 codebook
    codebook = torch.tensor(cls.codebook(signed), dtype=torch.float32).tolist()
    if not 2 <= len(codebook) <= 2**cls.bits:
        raise ValueError(f"{which} has {len(codebook)} values; it needs at least 2, and {cls.bits} bits hold {2**cls.bits}")
    if not all(a < b for a, b in zip(codebook, codebook[1:])) or not all(map(math.isfinite, codebook)):  # NaN fails too
        raise ValueError(f"{which} must list finite values strictly increasing (as fp32): sort them, drop repeats, NaN and infinities")
    if not signed and codebook[0] < 0:  # a nonnegative state (a second moment) must not decode below 0
        raise ValueError(f"{which} holds a nonnegative state's codes and starts at {codebook[0]!r}: drop its negative values")
    top = torch.tensor(float(cls.scale_max), dtype=torch.float32).item()
    if not 0 < top < math.inf:
        raise ValueError(f"{cls.__name__}.scale_max = {cls.scale_max!r}: it must be positive and finite (as fp32), where each block's absmax lands")
    if codebook[-1] != top:  # a block's absmax maps to scale_max: below it, every block's largest value would be clipped
        raise ValueError(
            f"{which} ends at {codebook[-1]!r}, not at scale_max = {top!r} (as fp32), where each block's "
            f"absmax lands: end the codebook there, or set scale_max to its largest value"
        )
    space = None if cls.rounding_space.__func__ is OptimState.rounding_space.__func__ else functools.partial(cls.rounding_space, signed=signed)
    thresholds = quant.decision_thresholds(codebook, space)
    try:
        base_code, threshold = quant.nearest_code_tables(thresholds)
    except ValueError as error:
        raise ValueError(f"{which}: {error}: space its neighbouring values further apart (more than about 2**-8 of their size)") from None
    unused = [math.nan] * (2**cls.bits - len(codebook))  # codes encode never produces decode to NaN
    return {
        "codebook": (codebook + unused, torch.float32),
        "base_code": (base_code.tolist(), torch.uint8),
        "threshold": (threshold.tolist(), torch.float32),
        "decision_thresholds": (thresholds.tolist(), torch.float32),
    }


@functools.cache
def _cached_table(cls, signed: bool, name: str, device: torch.device) -> Tensor:
    values, dtype = _table_values(cls, signed)[name]
    return torch.tensor(values, dtype=dtype, device=device)


def _table(cls, signed: bool, name: str, device: torch.device) -> Tensor:
    # While torch.compile traces (fake tensors) a cached real tensor cannot enter the graph, but a
    # tensor built from Python numbers becomes a graph constant. Eager code uses the cached copy.
    if torch._guards.detect_fake_mode() is not None:
        values, dtype = _table_values(cls, signed)[name]
        return torch.tensor(values, dtype=dtype, device=device)
    return _cached_table(cls, signed, name, device)


# ------------------------------------------------------------------------------------------------
# Shared handlers
# ------------------------------------------------------------------------------------------------


def _rebuild_state(cls, dtype, shape, requires_grad, state) -> "StateTensor":
    """A saved state (StateTensor.__reduce_ex__), as torch.load rebuilds it: a state of ``cls`` on its
    inner tensors' device, given its attributes, which __setstate__ checks. A checkpoint saved before
    it (through torch's rebuild of wrapper subclasses) loads as it did."""
    if not (isinstance(cls, type) and issubclass(cls, StateTensor)):
        raise ValueError(f"this checkpoint rebuilds a state of {cls!r}, which is no lowbit_optim state class: it is corrupt")
    inner = [t for t in _saved_attributes(cls, state).values() if isinstance(t, Tensor)]
    device = inner[0].device if inner else torch.device("cpu")
    rebuilt = Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)
    rebuilt.__setstate__(state)
    return rebuilt


torch.serialization.add_safe_globals([_rebuild_state])


def _saved_attributes(cls, state) -> dict:
    """A saved state's attributes: torch pickles its __dict__, alone or paired with its slots."""
    attributes = state[0] if isinstance(state, tuple) and len(state) == 2 else state
    if not isinstance(attributes, dict):
        raise ValueError(f"this checkpoint's {cls.__name__} holds {type(state).__name__} attributes, not a dict: it is edited or corrupt")
    return attributes


@functools.cache
def _instance_attributes(cls: type) -> frozenset | None:
    """The attributes a state of ``cls`` keeps on itself (its inner tensors and metadata), or None
    where a state cannot be made to tell."""
    try:
        return frozenset(vars(cls.zeros((1,), cls.holds_signed)))
    except Exception:  # noqa: BLE001 - a format of the user's: its checkpoints load unchecked here, as before
        return None


def signedness_mismatch(saved_signed: bool) -> str:
    """What a loaded state of the other signedness is (its codes would be read in the other table:
    an unsigned momentum's as nonnegative)."""
    held, kept = ("a signed", "a nonnegative") if saved_signed else ("an unsigned (nonnegative)", "a signed")
    return f"{held} state, where it holds {kept} one (or it is of another optimizer)"


def _format_name(state: StateTensor) -> str:
    return f"{type(state).__name__} ({state.name!r} state format)"


# the tensor types that are no subclass: their memory is their values (and never a DTensor, distributed.py)
PLAIN_TENSOR_TYPES = (Tensor, torch.nn.Parameter)


def not_plain(t: Tensor) -> str | None:
    """Why ``t``'s memory does not hold its values as its elements read them (None: it does), which
    the fused kernel and inductor's code read directly: a tensor subclass (a state inside a state),
    a lazily negated or conjugated view, or a sparse layout."""
    if type(t) not in PLAIN_TENSOR_TYPES:
        return f"a {type(t).__name__}, not a plain tensor"
    if t.layout != torch.strided:
        return f"a {t.layout} tensor, not a dense one"
    if t.is_neg() or t.is_conj():
        return "a lazily negated or conjugated view (torch's neg or conj bit): pass t.resolve_neg() or t.resolve_conj()"
    return None


def storage_holds(t: Tensor) -> bool:
    """Whether a contiguous tensor's storage holds its elements (what C reading it from its data
    pointer needs): resizing the storage in place (``t.untyped_storage().resize_(0)``, as FSDP does
    to free memory) keeps the tensor's shape."""
    return t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size()


def storage_shortfall(t: Tensor) -> str:
    """What the storage of a tensor that ``storage_holds`` refuses holds, for its error message."""
    needed = (t.storage_offset() + t.numel()) * t.element_size()
    return f"holds {t.untyped_storage().nbytes()} bytes, not the {needed} its elements need (a storage resized in place)"


def describe_tensor(t) -> str:
    """What ``t`` is, for error messages about tensors of the wrong kind."""
    if not isinstance(t, Tensor):
        return f"a {type(t).__name__}"
    return f"a {'' if t.is_contiguous() else 'non-contiguous '}{t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def _dequantize_arg(x):
    return x.dequantize() if isinstance(x, StateTensor) else x


def _in_fp32(x):
    """An argument of an op that writes states only: a state's values in fp32, a plain tensor (which
    it only reads) or a dtype of lower precision widened to fp32."""
    if isinstance(x, StateTensor):
        return x.dequantize(torch.float32)
    if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
        return x.float()
    if isinstance(x, torch.dtype) and x in (torch.float16, torch.bfloat16):
        return torch.float32
    return x


def _dequantize_and_run(func, args, kwargs):
    """Generic fallback: run ``func`` on dequantized arguments; write mutated states back."""
    # below autograd (inside a custom op's kernel, e.g. step_op.py) composite ops such as .to() arrive
    # undecomposed: decompose them as the autograd layer would have
    decomposed = func.decompose(*args, **kwargs)
    if decomposed is not NotImplemented:
        return decomposed
    schema = func._schema
    state = next(x for x in tree_leaves((args, kwargs)) if isinstance(x, StateTensor))
    if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
        raise NotImplementedError(
            f"{_format_name(state)} does not support aten.{func.__name__}: it returns a view, which a quantized "
            f"state cannot provide: {DEQUANTIZE_FIRST}."
        )
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    bound = _bind(schema, args, kwargs) if mutated else {}
    written = [t for name in mutated for t in tree_leaves(bound.get(name)) if isinstance(t, Tensor)]
    # an aten op that writes states only computes in fp32, whatever their appearance dtype: an fp16
    # parameter's state holds moments outside fp16's range (state.mul_(1.0) zeroed or NaN'd them).
    # What it reads in a lower precision is widened alike (exactly), a dtype= too. One that writes a
    # plain tensor reads states in their appearance dtype, as that tensor's peers; a collective
    # exchanges the dtype every rank allocated
    in_fp32 = func.namespace == "aten" and written and all(isinstance(t, StateTensor) for t in written)
    plain_args, plain_kwargs = tree_map(_in_fp32 if in_fp32 else _dequantize_arg, (args, kwargs))
    out = func(*plain_args, **plain_kwargs)
    if not mutated:
        return out
    plain_bound = _bind(schema, plain_args, plain_kwargs)
    for name in mutated:  # also lists of states, as in the _foreach_*_ ops
        for original, new_value in zip(tree_leaves(bound.get(name)), tree_leaves(plain_bound.get(name))):
            if isinstance(original, StateTensor):
                original.copy_(new_value)
    # an in-place or out= op returns its mutated argument: hand back the state, not the temporary
    if len(schema.returns) == 1 and schema.returns[0].alias_info is not None:
        return bound[mutated[0]]
    return out


def _bind(schema, args, kwargs) -> dict:
    """Argument name -> value, for positional and keyword arguments alike."""
    return {**{a.name: v for a, v in zip(schema.arguments, args)}, **kwargs}


@implements(aten.detach.default, aten.alias.default)
def _view_of_inner(func, args, kwargs):
    # detach: needed by torch.optim state_dict and torch.save; alias: by torch.compile's functionalization
    out = args[0]._map_inner(func)
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten.clone.default)
def _clone(func, args, kwargs):
    # needed by copy.deepcopy and user code cloning a state dict
    return args[0]._map_inner(torch.clone)


@implements(aten.new_empty.default)
def _new_empty(func, args, kwargs):
    # of its own shape and dtype: a state of the same kind, its inner tensors unset. DCP's
    # async_save stages a state so, then sets the staged copies of its inner tensors on it; the
    # fallback's plain tensor had been written to the checkpoint in its place, uninitialized
    state, size, dtype = args[0], torch.Size(args[1]), kwargs.get("dtype")
    if size != state.shape or dtype not in (None, state.dtype):  # another shape or dtype: a plain tensor, as before
        return _dequantize_and_run(func, args, kwargs)
    device = kwargs.get("device")
    return state._map_inner(lambda t: torch.empty_like(t, device=device))


@implements(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(func, args, kwargs):
    # the inner tensors do not depend on the logical shape, so any shape with the same numel is free;
    # needed by the optimizer's flat step
    state, shape = args[0], args[1]
    # torch's own rule and errors: another element count would read the padding of the last block as values
    out = state._like(shape=torch.Size(infer_size(shape, state.numel())))
    return return_and_correct_aliasing(func, args, kwargs, out) if func is aten.view.default else out


def slice_bounds(start, end, rows: int) -> tuple[int, int]:
    """aten.slice's start/end (None, negative or out of range) as 0 <= start <= end <= rows."""
    start = 0 if start is None else min(max(start + rows if start < 0 else start, 0), rows)
    end = rows if end is None else min(max(end + rows if end < 0 else end, start), rows)
    return start, end


@implements(aten.slice.Tensor)
def _slice(func, args, kwargs):
    state, dim, start, end, step = (list(args) + [0, None, None, 1][len(args) - 1 :])[:5]
    if dim != 0 or step != 1:
        raise NotImplementedError(f"{_format_name(state)} can only be sliced along dim 0 with step 1 (got dim={dim}, step={step})")
    out = state._rows(*slice_bounds(start, end, state.shape[0] if state.dim() else 1))
    return return_and_correct_aliasing(func, args, kwargs, out)


@implements(aten._to_copy.default)
def _to_copy(func, args, kwargs):
    # .to(device) moves the inner tensors; .to(dtype) only changes the appearance dtype (what
    # dequantize() returns). Needed by torch.optim.Optimizer.load_state_dict and .cuda()/.cpu().
    state, device, dtype = args[0], kwargs.get("device"), kwargs.get("dtype")
    if dtype is not None and not dtype.is_floating_point:  # .bool(), .long(): the values cast, as a plain tensor
        return state.dequantize(torch.float32).to(device=device, dtype=dtype)
    return state._map_inner(lambda t: t.to(device, copy=True), dtype=dtype)


# states rebuilt from a file (__setstate__) and not checked since (check_loaded), by id (a weak set
# would compare tensors with ==); an entry goes when its state dies
_FROM_FILE: "weakref.WeakValueDictionary[int, StateTensor]" = weakref.WeakValueDictionary()


def from_file(state: StateTensor) -> bool:
    """Whether ``state`` was read from a file (torch.load) and not checked since."""
    return _FROM_FILE.get(id(state)) is state


# tensor subclasses of other modules that copy_ into a state reads as the values they stand for,
# given (source, destination): distributed.py registers its ShardView (a quantized checkpoint's rows,
# which DCP copies into a state it does not view in rows, a bf16-sr or factored one)
COPY_SOURCES: dict[type, Callable[[Tensor, Tensor], Tensor]] = {}


@implements(aten.copy_.default)
def _copy_(func, args, kwargs):
    # the write path of every step function: quantize into a state, dequantize out of one
    dst, src = args[0], args[1]
    as_values = COPY_SOURCES.get(type(src))
    if as_values is not None:
        src = as_values(src, dst)
    if isinstance(src, StateTensor) and from_file(src):  # DCP's route for a state it does not view in rows
        try:
            src.check_loaded()
        except ValueError as error:
            raise ValueError(f"copy_ from a checkpoint's state, which is corrupt: {error}") from None
    # values pass in fp32 whatever the appearance dtype (an fp16 parameter's state holds moments
    # outside fp16's range); the destination rounds them once, to its own dtype
    if not isinstance(dst, StateTensor):
        return dst.copy_(src.dequantize(torch.float32))
    if dst.shape != src.shape:
        raise RuntimeError(f"copy_ into {_format_name(dst)} of shape {tuple(dst.shape)} from shape {tuple(src.shape)}: shapes must match")
    if dst._same_layout(src):
        for name, t in dst._inner().items():  # same layout: bit-exact, no requantization
            t.copy_(getattr(src, name))
    else:
        values = src.dequantize(torch.float32) if isinstance(src, StateTensor) else src
        # a negative value in a nonnegative state: each format read it otherwise (0, its magnitude, or as
        # it was, and the next step NaN'd). Checked on real tensors: not where the step is traced, nor on meta
        if not dst.signed and type(values) in PLAIN_TENSOR_TYPES and not values.is_meta and bool((values < 0).any()):
            raise ValueError(
                f"copy_ of a negative value ({float(values.min()):.3g}) into {_format_name(dst)}, a nonnegative state "
                "(a second moment): write values >= 0 (e.g. values.clamp(min=0)), or, in an optimizer of your own "
                "whose state this is and may be negative, declare it State(..., signed=True)"
            )
        dst.quantize_(values)
    return dst


@implements(aten.is_pinned.default)
def _is_pinned(func, args, kwargs):
    # needed by DataLoader-style pinning checks and CPU offload
    return all(t.is_pinned() for t in args[0]._inner().values())


def _collective_ops(*names, namespaces=("_c10d_functional", "c10d_functional")):
    """The c10d ops of these names (by default the functional ones, old and new namespace) that this
    torch build has registered; one registered later reaches the fallback, which does the same:
    dequantize and run."""
    ops = []
    for namespace in namespaces:
        for name in names:
            try:
                ops.append(getattr(getattr(torch.ops, namespace), name).default)
            except (AttributeError, RuntimeError):
                pass
    return ops


@implements(*_collective_ops("broadcast_", namespaces=("c10d",)))
def _broadcast(func, args, kwargs):
    # a state reaches a broadcast where it is sent (set_optimizer_state_dict(broadcast_from_rank0=True)):
    # it goes as its values in its dtype, into plain tensors the other ranks allocated so, whose loads
    # requantize them: they may hold other states than this rank's, and the replicas drift apart
    if not (torch.distributed.is_initialized() and torch.distributed.get_world_size() == 1):  # (alone, no rank receives)
        warnings.warn(
            "a quantized optimizer state is broadcast as its values, which the other ranks requantize: they may then hold "
            "other states than this rank (broadcast_from_rank0=True). Pass the state dict through "
            "lowbit_optim.dequantize_state_dict first, so that every rank quantizes the same fp32 values, or load the "
            "checkpoint on every rank, which restores its states exactly",
            stacklevel=2,
        )
    return _dequantize_and_run(func, args, kwargs)


@implements(*_collective_ops("all_gather_into_tensor"))
def _all_gather(func, args, kwargs):
    # needed by DTensor.full_tensor() (and full_state_dict=True): gathers the exact dequantized values of
    # every shard; shards are padded to blocks on their own, so their codes cannot simply be concatenated
    return func(args[0].dequantize(), *args[1:], **kwargs)
