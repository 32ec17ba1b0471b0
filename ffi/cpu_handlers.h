// The FFI handler symbols of the `cpu` platform (defined in cpu_handlers.cc).
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmQuantizeCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmRouteCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmQpackCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmPackCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmDispatchCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmGemm1Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCheckOverflowCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmGemm2Cpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JsmCombineCpu);
