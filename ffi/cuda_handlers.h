// The FFI handler symbols of the CUDA platform (defined in cuda_handlers.cu).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmQuantizeCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmRouteCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmQpackCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmPackCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchGemm1Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchGraphCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchGemm1GraphCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmGemm1Cuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCheckOverflowCuda);
