// How the custom calls' dictionary attributes decode into the plain option structs of
// kernels/common/options.h. The member names (and their order, which is the structs' member
// order) are the attribute's keys, exactly: a dictionary with a key more or less fails to decode.
#pragma once

#include "kernels/common/options.h"
#include "xla/ffi/api/ffi.h"

XLA_FFI_REGISTER_ENUM_ATTR_DECODING(jsm::EngineId);

// attribute `dispatch`
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jsm::DispatchOptions,
                                      ::xla::ffi::StructMember<jsm::EngineId>("engine"),
                                      ::xla::ffi::StructMember<int64_t>("window_set"),
                                      ::xla::ffi::StructMember<int64_t>("row_align"),
                                      ::xla::ffi::StructMember<double>("timeout_s"),
                                      ::xla::ffi::StructMember<int64_t>("fault_absent_rank"),
                                      ::xla::ffi::StructMember<int64_t>("fault_delay_rank"),
                                      ::xla::ffi::StructMember<int64_t>("fault_delay_ms"),
                                      ::xla::ffi::StructMember<int64_t>("runtime"),
                                      ::xla::ffi::StructMember<bool>("global_overflow"));

// attribute `gemm1`
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jsm::Gemm1Options,
                                      ::xla::ffi::StructMember<bool>("has_limit"),
                                      ::xla::ffi::StructMember<float>("swiglu_limit"),
                                      ::xla::ffi::StructMember<int64_t>("tile_tokens"));
