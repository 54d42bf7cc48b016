"""Registers the example format of examples/custom_format.py ("int8-linear") for the benchmarks, under
the module name the tests use, so that every registered format is measured."""

import importlib.util
import pathlib
import sys

_NAME = "examples.custom_format"
_PATH = pathlib.Path(__file__).resolve().parent.parent / "examples" / "custom_format.py"

if _NAME not in sys.modules and _PATH.exists():
    _spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _module
    _spec.loader.exec_module(_module)
