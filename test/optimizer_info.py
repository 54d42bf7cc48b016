"""OptimizerInfo: what the tests know about each optimizer, in the manner of torch's OptimizerInfo
(torch/testing/_internal/common_optimizers.py): how to build it for the shared tests, the option
sets its parity tests cover, and what its fp32-state numbers must equal (torch.optim's class of the
same name, else a float64 reference written here).

``OPTIMIZERS`` holds the built-in optimizers and every other LowBitOptimizer subclass that declares a
step function of its own, with defaults read from its signature: examples/custom_optimizer.py,
imported by conftest, joins that way. test_optimizers.py runs every one of them with every format
(``MATRIX``). AdamW is in the registry for the parity tests, while its own, deeper, format suite is
test_optim.py (so the matrix leaves it out rather than compiling its graphs twice).
"""

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from conftest import FORMATS, FormatInfo

import lowbit_optim
from lowbit_optim import LowBitOptimizer

# ------------------------------------------------------------------------------------------------
# float64 references: one step of one parameter; ``state`` holds float64 tensors named as ours
# ------------------------------------------------------------------------------------------------


def lion_reference(p, g, state, step, *, lr, betas=(0.9, 0.99), weight_decay=0.0, maximize=False):
    """Chen et al. 2023, Algorithm 2 (decoupled weight decay)."""
    beta1, beta2 = betas
    m = state.setdefault("exp_avg", torch.zeros_like(p))
    g = -g if maximize else g
    p.mul_(1 - lr * weight_decay).sub_(lr * torch.sign(beta1 * m + (1 - beta1) * g))
    m.mul_(beta2).add_((1 - beta2) * g)


def ademamix_reference(
    p, g, state, step, *, lr, betas=(0.9, 0.999, 0.9999), alpha=5.0, t_alpha=None, t_beta3=None, eps=1e-8, weight_decay=1e-2,
    maximize=False,
):  # fmt: skip
    """Pagliardini et al. 2024, Algorithm 1, with bitsandbytes' warm-ups of alpha and beta3."""
    beta1, beta2, beta3 = betas
    if t_alpha is not None:
        alpha = min(step * alpha / t_alpha, alpha)
    if t_beta3 is not None:
        s, log1, log3 = step / t_beta3, math.log(beta1), math.log(beta3)
        beta3 = min(math.exp(log1 * log3 / ((1 - s) * log3 + s * log1)), beta3)
    m1, m2, nu = (state.setdefault(name, torch.zeros_like(p)) for name in ("exp_avg", "exp_avg_slow", "exp_avg_sq"))
    g = -g if maximize else g
    m1.mul_(beta1).add_((1 - beta1) * g)
    m2.mul_(beta3).add_((1 - beta3) * g)
    nu.mul_(beta2).add_((1 - beta2) * g * g)
    denom = nu.sqrt() / math.sqrt(1 - beta2**step) + eps
    p.mul_(1 - lr * weight_decay).sub_(lr * (m1 / (1 - beta1**step) + alpha * m2) / denom)


# ------------------------------------------------------------------------------------------------
# The registry
# ------------------------------------------------------------------------------------------------

# Muon against torch.optim.Muon: the compiled step rounds the bf16 Newton-Schulz iterations as eager
# does (emulate_precision_casts), but inductor sums the norm and the products in its own order, and a
# value on a bf16 rounding boundary then rounds the other way, which moves the whole orthogonalized
# update of that matrix a little. Observed after 10 steps at lr 0.05: params within 1.5e-6 for 3 of
# the 4 option sets, 3.5e-4 for the other (one step's update is ~5e-3 per element); with
# compile=False, within 1.2e-7 (test_muon.py).
MUON_PARAM_TOL = dict(rtol=1e-5, atol=1e-3)



@dataclass(frozen=True, eq=False)  # hashed by identity: tests cache per optimizer
class OptimizerInfo:
    cls: type
    lr: float  # for the shared tests' MLP (a few steps must visibly train it)
    kwargs: dict = field(default_factory=dict)  # the shared tests' other constructor keywords
    options: dict = field(default_factory=lambda: {"default": {}})  # parity tests: id -> keywords beyond lr
    reference: Callable | None = None  # float64 reference step; None: torch.optim.<cls.torch_name>
    hyperparameter_changes: dict = field(default_factory=lambda: {"lr": dict(lr=3e-3)})  # none may recompile
    bitsandbytes: tuple[str, dict, tuple] | None = None  # 32-bit bnb class, its extra keywords, the option ids it computes alike
    matrices_only: bool = False  # steps 2-D parameters only (Muon): the shared tests' models have no biases
    parity_param_tol: dict | None = None  # against torch.optim's class, where PARITY_PARAM_TOL is too tight
    # compiled vs eager: where a rounding flip moves a whole matrix a little (Muon's bf16 iterations)
    # rather than one element a lot, this tolerance replaces COMPILED_PARAM_ATOL; the elements outside
    # it are still counted against the flip allowance (a flipped momentum code moves its own element
    # most: on an AMD EPYC family 26, 4bit after 3 steps, one of 6144 by 2.2e-3)
    compiled_param_tol: dict | None = None

    @property
    def shapes(self) -> list[tuple[int, ...]]:
        """The parity tests' parameters: one above min_quantize_numel, one below."""
        return [(64, 96), (7, 10) if self.matrices_only else (71,)]

    def mlp(self, **kwargs):
        """The shared tests' model (test_optim.make_mlp), without biases for matrices_only."""
        from test_optim import make_mlp

        return make_mlp(bias=kwargs.pop("bias", not self.matrices_only), **kwargs)

    @property
    def name(self) -> str:
        return self.cls.__name__

    @property
    def torch_cls(self):
        return getattr(torch.optim, self.cls.torch_name) if self.cls.torch_name else None

    @property
    def format_keys(self) -> list[str]:
        return [s.name for s in self.cls.states if s.follows is None]

    def signed(self, state_name: str) -> bool:
        return next(s.signed for s in self.cls.states if s.name == state_name)

    @property
    def group(self) -> dict:
        """The hyper-parameters of the shared tests' groups: the constructor's defaults and ``kwargs``."""
        parameters = inspect.signature(self.cls.__init__).parameters.values()
        return {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty} | self.kwargs

    def holds(self, info: FormatInfo, state_name: str) -> bool:
        """Whether ``info``'s format holds ``state_name`` in the shared tests' groups: a nonnegative
        format no signed state, a format with a max_signed_decay no slower signed average."""
        state = next(s for s in self.cls.states if s.name == state_name)
        return (info.fmt.holds_signed or not state.signed) and state.too_slow_for(info.fmt, self.group) is None

    def spec(self, info: FormatInfo):
        """The ``state_format`` that puts ``info``'s format on every state it can hold (``holds``; the
        others fp32), or None where it holds none of this optimizer's states (``factored`` for SGD)."""
        held = [k for k in self.format_keys if self.holds(info, k)]
        if not held:
            return None
        return info.name if len(held) == len(self.format_keys) else {k: (info.name if k in held else "fp32") for k in self.format_keys}

    def format_of(self, info: FormatInfo, state_name: str) -> str:
        """The format name ``spec(info)`` gives ``state_name`` (before the min_quantize_numel rule)."""
        spec = self.spec(info)
        follows = next(s.follows for s in self.cls.states if s.name == state_name)
        return spec if isinstance(spec, str) else spec[follows or state_name]

    def make(self, params, **kwargs) -> LowBitOptimizer:
        return self.cls(params, **{"lr": self.lr, **self.kwargs, **kwargs})

    def __repr__(self):
        return self.name


BUILTIN_OPTIMIZERS = [
    OptimizerInfo(
        lowbit_optim.AdamW,
        lr=1e-2,
        options={"default": dict(weight_decay=0.1), "amsgrad": dict(amsgrad=True)},
    ),
    OptimizerInfo(
        lowbit_optim.SGD,
        lr=0.3,
        kwargs=dict(momentum=0.9),
        options={
            "no momentum": {},
            "momentum": dict(momentum=0.9),
            "momentum, weight decay": dict(momentum=0.9, weight_decay=0.1),
            "nesterov, weight decay": dict(momentum=0.9, nesterov=True, weight_decay=0.1),
            "dampening, maximize": dict(momentum=0.9, dampening=0.3, maximize=True),
        },
        hyperparameter_changes={
            "lr": dict(lr=3e-2),
            "lr as a tensor": dict(lr=torch.tensor(2e-2)),
            "momentum": dict(momentum=0.8),
            "dampening": dict(dampening=0.1),
            "weight_decay": dict(weight_decay=0.01),
        },
        bitsandbytes=("SGD32bit", {}, ("momentum", "momentum, weight decay")),
    ),
    OptimizerInfo(
        lowbit_optim.Lion,
        lr=3e-3,
        options={"default": {}, "weight decay, maximize": dict(weight_decay=0.5, maximize=True), "betas": dict(betas=(0.95, 0.98))},
        reference=lion_reference,
        hyperparameter_changes={
            "lr": dict(lr=1e-3),
            "lr as a tensor": dict(lr=torch.tensor(2e-3)),
            "betas": dict(betas=(0.8, 0.999)),
            "weight_decay": dict(weight_decay=0.1),
        },
        bitsandbytes=("Lion32bit", {}, ("default", "betas")),
    ),
    OptimizerInfo(
        lowbit_optim.AdEMAMix,
        lr=1e-2,
        options={
            "default": {},
            "warm-ups": dict(t_alpha=4, t_beta3=6),
            "betas, alpha, maximize": dict(betas=(0.8, 0.99, 0.999), alpha=2.0, weight_decay=0.0, maximize=True),
        },
        reference=ademamix_reference,
        hyperparameter_changes={
            "lr": dict(lr=3e-3),
            "lr as a tensor": dict(lr=torch.tensor(2e-3)),
            "betas": dict(betas=(0.8, 0.99, 0.999)),
            "alpha": dict(alpha=3.0),
            "eps": dict(eps=1e-6),
            "weight_decay": dict(weight_decay=0.0),
        },
        bitsandbytes=("AdEMAMix", dict(optim_bits=32), ("default", "warm-ups")),
    ),
    OptimizerInfo(
        lowbit_optim.Muon,
        lr=0.05,
        options={
            "default": {},
            "no nesterov, weight decay": dict(nesterov=False, weight_decay=0.5),
            "match_rms_adamw, momentum": dict(adjust_lr_fn="match_rms_adamw", momentum=0.8),
            "ns_steps, ns_coefficients": dict(ns_steps=3, ns_coefficients=(2.0, -1.5, 0.5)),
        },
        hyperparameter_changes={
            "lr": dict(lr=2e-2),
            "lr as a tensor": dict(lr=torch.tensor(3e-2)),
            "momentum": dict(momentum=0.9),
            "weight_decay": dict(weight_decay=0.01),
            "eps": dict(eps=1e-6),
        },
        matrices_only=True,
        parity_param_tol=MUON_PARAM_TOL,
        compiled_param_tol=MUON_PARAM_TOL,
    ),
]


def _declared_optimizers(cls=LowBitOptimizer) -> list[type]:
    """Every subclass of ``cls`` that declares a step function of its own (not an alias)."""
    found = []
    for sub in cls.__subclasses__():
        if "step_function" in vars(sub):
            found.append(sub)
        found += _declared_optimizers(sub)
    return found


def _discovered(cls: type) -> OptimizerInfo:
    """Defaults for an optimizer the tests know nothing about: its own default lr (1e-3 where it has
    none: a required lr, or one taken through **kwargs)."""
    lr = inspect.signature(cls).parameters.get("lr")
    return OptimizerInfo(cls, lr=1e-3 if lr is None or lr.default is inspect.Parameter.empty else lr.default)


_KNOWN = {info.cls for info in BUILTIN_OPTIMIZERS} | {lowbit_optim.Adam}  # Adam: AdamW's info covers its step
OPTIMIZERS = BUILTIN_OPTIMIZERS + [_discovered(cls) for cls in _declared_optimizers() if cls not in _KNOWN]
MATRIX_OPTIMIZERS = [info for info in OPTIMIZERS if info.cls is not lowbit_optim.AdamW]  # AdamW: test_optim.py

# every optimizer x every format that can hold one of its states
MATRIX = [pytest.param(o, f, id=f"{o.name}-{f.name}") for o in MATRIX_OPTIMIZERS for f in FORMATS if o.spec(f) is not None]
matrix = pytest.mark.parametrize("opt_info, info", MATRIX)
# the compiled tests' formats: plain, 8-bit and 4-bit codes and a factored state. Each cell costs its own
# graphs (~4-20 s on 2 cores); how each format's codec compiles is tested for every format with AdamW
# (test_optim.py), what is new here is each optimizer's step function around them.
COMPILED_FORMATS = ("fp32", "8bit", "4bit", "factored")
compiled_matrix = pytest.mark.parametrize("opt_info, info", [case for case in MATRIX if case.values[1].name in COMPILED_FORMATS])
all_optimizers = pytest.mark.parametrize("opt_info", OPTIMIZERS, ids=[o.name for o in OPTIMIZERS])
matrix_optimizers = pytest.mark.parametrize("opt_info", MATRIX_OPTIMIZERS, ids=[o.name for o in MATRIX_OPTIMIZERS])

# (optimizer, option id) for every option set of every optimizer
OPTION_CASES = [pytest.param(o, option, id=f"{o.name}-{option}") for o in OPTIMIZERS for option in o.options]
