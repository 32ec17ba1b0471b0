"""jax_sdma_moe: the expert-parallel MoE layer as XLA FFI custom calls — Stage1 (routing, MX-fp8
quantisation, dispatch of token rows, grouped GEMM1 + SwiGLU) and Stage2 (grouped GEMM2, the
weighted combine back to each token's rank). Forward only (inference): it has no derivative."""
from . import api, engines, layout, primitives, reference  # noqa: F401  (public submodules)
from .api import moe, quantize, quantize_w1, quantize_w2, stage1, stage2
from .config import SHAPES, MoEShape, Stage1Config
from .runtime import Runtime
from .types import MXFP8, MoEStats, QuantizedW1, QuantizedW2, Stage1Output

__all__ = ["quantize", "quantize_w1", "quantize_w2", "stage1", "stage2", "moe", "Stage1Config",
           "Runtime", "Stage1Output", "MoEStats", "QuantizedW1", "QuantizedW2", "MXFP8", "MoEShape", "SHAPES",
           "reference", "layout", "primitives", "engines"]
__version__ = "0.1.0"
