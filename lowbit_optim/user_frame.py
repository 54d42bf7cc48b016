"""Where a warning points: the user's line, the first frame outside lowbit_optim and torch."""

import os
import sys

import torch


def outside_stacklevel() -> int:
    """warnings.warn's stacklevel, for its caller, of the first frame outside lowbit_optim and torch:
    the user's opt.step(), through torch's step hooks, an lr scheduler's wrapper or MuonWithAdamW."""
    inside = tuple(os.path.dirname(os.path.abspath(module.__file__)) + os.sep for module in (sys.modules[__package__], torch))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(inside):
        frame, level = frame.f_back, level + 1
    return level
