"""The state format registry: short names ("8bit", "4bit", "fp32", ...) -> formats.

The bottom floor of the package: it imports nothing from it, so every module may import it. A
StateTensor subclass with a ``name`` registers itself when it is defined; a PlainFormat when it is
made.
"""

_REGISTRY: dict = {}


def _same_format(existing, fmt) -> bool:
    # a module imported twice (e.g. an example run as a script and imported by the tests) defines its
    # format class twice: the same format, not a name clash
    return existing is fmt or (existing is not None and getattr(existing, "__qualname__", None) == getattr(fmt, "__qualname__", 0))


def register_format(fmt) -> None:
    """Make ``fmt`` (a StateTensor subclass or PlainFormat) available as ``state_format=fmt.name``."""
    existing = _REGISTRY.get(fmt.name)
    if existing is not None and not _same_format(existing, fmt):
        raise ValueError(f"state format name {fmt.name!r} is already taken by {existing!r}")
    _REGISTRY[fmt.name] = fmt


def registered_formats() -> dict:
    """Name -> format, for every registered format (built-in ones first)."""
    return dict(_REGISTRY)


def get_format(spec):
    """Resolve a format name or a registered format. Raises a ValueError listing the choices."""
    if isinstance(spec, str):
        if spec in _REGISTRY:
            return _REGISTRY[spec]
    elif _same_format(_REGISTRY.get(getattr(spec, "name", None)), spec):
        return spec
    raise ValueError(
        f"unknown state format {spec!r}; use one of {sorted(_REGISTRY)} or an OptimState subclass that sets a `name`"
    )
