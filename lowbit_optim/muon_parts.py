"""Muon's step (functional.muon_step) in parts, each compiled as the optimizer's step is (or eager):
the elementwise momentum, the Newton-Schulz iterations, the elementwise apply, and the last two
together (``finish``). Two paths run them apart, on the same values as the whole step: FSDP2, where
the iterations need the whole matrix and a rank holds some rows (muon_fsdp.py), and the fused CPU
kernel, which computes the momentum and leaves ``finish`` to these (Muon._fused_step)."""

from . import base, functional


class MuonParts:
    """The parts; compiled ones come from base.compiled_step, which keeps one per function."""

    def __init__(self, compile: bool):
        part = base.compiled_step if compile else (lambda fn: fn)
        self.momentum = part(functional.muon_momentum)
        self.newton_schulz = part(functional.newton_schulz)
        self.apply = part(functional.muon_apply)
        self.finish = part(functional.muon_finish)
