"""lowbit_optim: Adam/AdamW with 8-bit, 4-bit, FP8, bf16 or fp32 optimizer state, one compiled step."""

from .formats import (
    BF16,
    FP32,
    OptimState4bit,
    OptimState4bitPrecond,
    OptimState4bitTorchao,
    OptimState8bit,
    OptimStateFp8,
    OptimStateNF4,
    PlainFormat,
    get_format,
    register_format,
    registered_formats,
)
from .functional import adam_step
from .precision import PARAM_UPDATES
from .optim import (
    Adam,
    Adam4bit,
    Adam8bit,
    AdamFp8,
    AdamW,
    AdamW4bit,
    AdamW8bit,
    AdamWFp8,
    AnyPrecisionAdamW,
    bytes_per_param,
    dequantize_state_dict,
    param_groups_by_module,
)
from .state import CodebookState, OptimState

__all__ = [
    "Adam",
    "Adam4bit",
    "Adam8bit",
    "AdamFp8",
    "AdamW",
    "AdamW4bit",
    "AdamW8bit",
    "AdamWFp8",
    "AnyPrecisionAdamW",
    "BF16",
    "CodebookState",
    "FP32",
    "OptimState",
    "OptimState4bit",
    "OptimState4bitPrecond",
    "OptimState4bitTorchao",
    "OptimState8bit",
    "OptimStateFp8",
    "OptimStateNF4",
    "PARAM_UPDATES",
    "PlainFormat",
    "adam_step",
    "bytes_per_param",
    "dequantize_state_dict",
    "get_format",
    "param_groups_by_module",
    "register_format",
    "registered_formats",
]
