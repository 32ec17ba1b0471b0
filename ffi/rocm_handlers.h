// The FFI handler symbols of the ROCm platform (defined in rocm_handlers.cc). GEMM1 and the fused
// dispatch + GEMM1 call the FlyDSL kernels of kernels/rocm/flydsl/ and exist in builds that have
// them (JSM_ROCM_FLYDSL).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmQuantizeRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmRouteRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmQpackRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmPackRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchGraphRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCheckOverflowRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCheckLayoutRocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmGemm2Rocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCombineRocm);
#ifdef JSM_ROCM_FLYDSL
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmGemm1Rocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchGemm1Rocm);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchGemm1GraphRocm);
#endif
