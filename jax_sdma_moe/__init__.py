"""jax_sdma_moe: expert-parallel MoE Stage1 (routing, MX-fp8 quantisation, dispatch of token rows,
grouped GEMM1 + SwiGLU) as XLA FFI custom calls. See docs/DESIGN.md and docs/ARCHITECTURE.md."""
from . import api, engines, layout, primitives, reference  # noqa: F401  (public submodules)
from .api import quantize, quantize_w1, stage1
from .config import SHAPES, MoEShape, Stage1Config
from .runtime import Runtime
from .types import MXFP8, QuantizedW1, Stage1Output

__all__ = ["quantize", "quantize_w1", "stage1", "Stage1Config", "Runtime", "Stage1Output",
           "QuantizedW1", "MXFP8", "MoEShape", "SHAPES", "reference", "layout", "primitives",
           "engines"]
__version__ = "0.1.0"
