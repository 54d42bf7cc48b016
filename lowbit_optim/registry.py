"""The state format registry: short names ("8bit", "4bit", "fp32", ...) -> formats.

The bottom floor of the package: it imports nothing from it, so every module may import it. A
StateTensor subclass with a ``name`` registers itself when it is defined; a PlainFormat when it is
made.
"""

import inspect

_REGISTRY: dict = {}


def _defined_in(cls) -> str | None:
    try:
        return inspect.getfile(cls)
    except (TypeError, OSError):  # a PlainFormat instance, or a class of no file
        return None


def _same_format(existing, fmt) -> bool:
    # a module imported twice (e.g. an example run as a script and imported by the tests) defines its
    # format class twice: the same format, not a name clash. Another file's class of the same name,
    # or a class made again with other numbers, is another format.
    if existing is fmt:
        return True
    if existing is None or getattr(existing, "__qualname__", None) != getattr(fmt, "__qualname__", 0) or _defined_in(existing) != _defined_in(fmt):
        return False
    try:
        return all(existing._numerics_fingerprint(signed) == fmt._numerics_fingerprint(signed) for signed in (True, False))
    except Exception:  # noqa: BLE001 - numbers it cannot tell apart: the same definition, as before
        return True


def register_format(fmt) -> None:
    """Make ``fmt`` (a StateTensor subclass or PlainFormat) available as ``state_format=fmt.name``."""
    if not isinstance(getattr(fmt, "name", None), str):
        raise TypeError(f"register_format takes a format (a StateTensor subclass that sets a `name`, or a PlainFormat), got {fmt!r}")
    existing = _REGISTRY.get(fmt.name)
    if existing is not None and not _same_format(existing, fmt):
        raise ValueError(
            f"state format name {fmt.name!r} is already taken by {existing!r}: give yours another name (a class defined "
            "again with other numbers, as a notebook cell run again, needs a fresh interpreter)"
        )
    _REGISTRY[fmt.name] = fmt


def registered_formats() -> dict:
    """Name -> format, for every registered format (built-in ones first)."""
    return dict(_REGISTRY)


def get_format(spec):
    """Resolve a format name or a registered format. Raises a ValueError listing the choices."""
    if isinstance(spec, str):
        if spec in _REGISTRY:
            return _REGISTRY[spec]
    elif spec is not None and _same_format(_REGISTRY.get(getattr(spec, "name", None)), spec):  # None: no name, not no format
        return spec
    raise ValueError(
        f"unknown state format {spec!r}; use one of {sorted(_REGISTRY)} or an OptimState subclass that sets a `name`"
    )
