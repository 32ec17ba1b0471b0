// XLA FFI handlers of the custom calls (Stage1, Stage2) on the `cpu` platform. Each one checks
// what it is handed and calls into kernels/cpu; shapes were already validated at trace time in
// Python.
#include "ffi/cpu_handlers.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

#include "ffi/handler_util.h"
#include "ffi/runtime_registry.h"
#include "ffi/signatures.h"
#include "kernels/common/layout_check.h"
#include "kernels/common/mxfp8.h"
#include "kernels/cpu/combine.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/stage.h"
#include "kernels/cpu/stage2.h"
#include "kernels/cpu/window_table.h"

namespace ffi = xla::ffi;

namespace {

using namespace jsm::sig;  // the buffer aliases
using jsm::handler::check_dtype;
using jsm::handler::check_send_rows;
using jsm::handler::last_dim;
using jsm::handler::rows_of;

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> values,
                        ffi::Result<ffi::AnyBuffer> scales) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "quantize values"));
  JSM_RETURN_IF_ERROR(check_dtype(*scales, ffi::DataType::U8, "quantize scales"));
  const int64_t H = last_dim(x), n = int64_t(x.element_count()) / H, HS = H / jsm::kBlock;
  auto* v = static_cast<uint8_t*>(values->untyped_data());
  auto* s = static_cast<uint8_t*>(scales->untyped_data());
  if (x.element_type() == ffi::DataType::BF16) {
    const auto* xp = static_cast<const uint16_t*>(x.untyped_data());
    for (int64_t r = 0; r < n; ++r) jsm::quantize_row_bf16(xp + r * H, H, v + r * H, s + r * HS);
  } else if (x.element_type() == ffi::DataType::F32) {
    const auto* xp = static_cast<const float*>(x.untyped_data());
    for (int64_t b = 0; b < n * HS; ++b) s[b] = jsm::quantize_block(xp + b * jsm::kBlock, v + b * jsm::kBlock);
  } else {
    return ffi::Error::InvalidArgument("jax_sdma_moe quantize: x must be bfloat16 or float32");
  }
  return ffi::Error::Success();
}

ffi::Error RouteImpl(S32Mat ids, ffi::Result<S32Mat> send_counts,
                     ffi::Result<S32Mat> send_pos,
                     ffi::Result<S32Scalar> num_invalid, int64_t runtime) {
  JSM_RETURN_IF_ERROR(jsm::runtime_registry::check_open(runtime, "route on cpu"));
  const auto T = ids.dimensions()[0], K = ids.dimensions()[1];
  const auto R = send_counts->dimensions()[0], EL = send_counts->dimensions()[1];
  *num_invalid->typed_data() = jsm::route(ids.typed_data(), T, K, R, EL,
                                          send_counts->typed_data(), send_pos->typed_data());
  return ffi::Error::Success();
}

ffi::Error QpackImpl(BF16Mat x, F32Mat weights,
                     S32Mat send_pos, ffi::Result<ffi::AnyBuffer> values,
                     ffi::Result<ffi::AnyBuffer> scales, ffi::Result<S32Vec> token,
                     ffi::Result<S32Vec> slot, ffi::Result<F32Vec> weight, bool token_rows) {
  JSM_RETURN_IF_ERROR(check_dtype(*values, ffi::DataType::F8E4M3FN, "qpack values"));
  jsm::RowHeaders out{token->typed_data(), slot->typed_data(), weight->typed_data()};
  const auto T = x.dimensions()[0], H = x.dimensions()[1], K = send_pos.dimensions()[1];
  const int64_t S = token->element_count();
  JSM_RETURN_IF_ERROR(check_send_rows(*values, *scales, S, T, token_rows, "qpack"));
  jsm::qpack_rows(reinterpret_cast<const uint16_t*>(x.typed_data()), weights.typed_data(),
                  send_pos.typed_data(), T, K, H, S, token_rows,
                  static_cast<uint8_t*>(values->untyped_data()),
                  static_cast<uint8_t*>(scales->untyped_data()), out);
  return ffi::Error::Success();
}

ffi::Error PackImpl(ffi::AnyBuffer x_values, ffi::AnyBuffer x_scales,
                    F32Mat weights, S32Mat send_pos,
                    ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::AnyBuffer> scales,
                    ffi::Result<S32Vec> token, ffi::Result<S32Vec> slot,
                    ffi::Result<F32Vec> weight, bool token_rows) {
  JSM_RETURN_IF_ERROR(check_dtype(x_values, ffi::DataType::F8E4M3FN, "pack x values"));
  JSM_RETURN_IF_ERROR(check_dtype(x_scales, ffi::DataType::U8, "pack x scales"));
  jsm::RowHeaders out{token->typed_data(), slot->typed_data(), weight->typed_data()};
  const auto T = rows_of(x_values), H = last_dim(x_values), K = send_pos.dimensions()[1];
  const int64_t S = token->element_count();
  JSM_RETURN_IF_ERROR(check_send_rows(*values, *scales, S, T, token_rows, "pack"));
  jsm::pack_rows(static_cast<const uint8_t*>(x_values.untyped_data()),
                 static_cast<const uint8_t*>(x_scales.untyped_data()), weights.typed_data(),
                 send_pos.typed_data(), T, K, H, S, token_rows,
                 static_cast<uint8_t*>(values->untyped_data()),
                 static_cast<uint8_t*>(scales->untyped_data()), out);
  return ffi::Error::Success();
}

// The rows a dispatch reads from its send buffer: send_counts >= 0, at most its rows in all
// (primitives.dispatch takes any counts; route's always pass).
ffi::Error check_send_counts(const S32Mat& send_counts, int64_t send_rows) {
  const int32_t* c = send_counts.typed_data();
  int64_t sum = 0;
  for (int64_t i = 0; i < int64_t(send_counts.element_count()); ++i) {
    if (c[i] < 0)
      return ffi::Error::InvalidArgument("jax_sdma_moe dispatch (cpu): send_counts[" +
                                         std::to_string(i) + "] = " + std::to_string(c[i]) +
                                         " is negative");
    sum += c[i];
  }
  if (sum > send_rows)
    return ffi::Error::InvalidArgument("jax_sdma_moe dispatch (cpu): send_counts add up to " +
                                       std::to_string(sum) + " rows, more than the send buffer's " +
                                       std::to_string(send_rows));
  return ffi::Error::Success();
}

// The experts' landed rows a GEMM reads and writes (gemm1, gemm2): EL of them, each within
// [0, M_cap), in order, none overlapping (kernels/common/layout_check.h); what: the call.
ffi::Error check_expert_rows(const S32Vec& offsets, const S32Vec& counts, int64_t EL,
                             int64_t m_cap, const char* what) {
  const std::string where = std::string("jax_sdma_moe ") + what + " (cpu): ";
  if (int64_t(offsets.element_count()) != EL || int64_t(counts.element_count()) != EL)
    return ffi::Error::InvalidArgument(where + "expert_offsets and expert_counts must hold " +
                                       std::to_string(EL) + " experts (the weights')");
  const jsm::LayoutFault f =
      jsm::check_experts(offsets.typed_data(), counts.typed_data(), EL, m_cap);
  if (f.rule == jsm::kLayoutOk) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(where + jsm::layout_fault_message(f, "", m_cap, 0, 0, 0));
}

ffi::Error DispatchImpl(ffi::AnyBuffer values, ffi::AnyBuffer scales, S32Vec token,
                        S32Vec slot, F32Vec weight,
                        S32Mat send_counts, S32Scalar rank,
                        ffi::Result<ffi::AnyBuffer> out_values, ffi::Result<ffi::AnyBuffer> out_scales,
                        ffi::Result<S32Vec> src_rank, ffi::Result<S32Vec> out_token,
                        ffi::Result<S32Vec> out_slot, ffi::Result<F32Vec> out_weight,
                        ffi::Result<S32Vec> expert_offsets,
                        ffi::Result<S32Vec> expert_counts,
                        ffi::Result<S32Scalar> num_rows, ffi::Result<S32Scalar> overflow,
                        jsm::DispatchOptions opt) {
  JSM_RETURN_IF_ERROR(jsm::runtime_registry::check_open(opt.runtime, "dispatch on cpu"));
  // engine local (R = 1) places the rows directly; engine cpu runs the window protocol
  if (opt.engine != jsm::EngineId::kCpu && opt.engine != jsm::EngineId::kLocal)
    return jsm::handler::wrong_engine("dispatch (cpu)", opt.engine, "engines cpu and local");
  JSM_RETURN_IF_ERROR(check_dtype(values, ffi::DataType::F8E4M3FN, "dispatch values"));
  JSM_RETURN_IF_ERROR(check_dtype(*out_values, ffi::DataType::F8E4M3FN, "dispatch landed values"));
  JSM_RETURN_IF_ERROR(
      check_send_rows(values, scales, token.element_count(), 0, false, "dispatch"));
  jsm::DispatchGeometry g{send_counts.dimensions()[0], send_counts.dimensions()[1], last_dim(values),
                          rows_of(*out_values), rows_of(values)};
  JSM_RETURN_IF_ERROR(check_send_counts(send_counts, g.send_rows));
  jsm::SendView send{static_cast<const uint8_t*>(values.untyped_data()),
                     static_cast<const uint8_t*>(scales.untyped_data()),
                     token.typed_data(), slot.typed_data(), weight.typed_data(),
                     send_counts.typed_data()};
  jsm::LandedView out{static_cast<uint8_t*>(out_values->untyped_data()),
                      static_cast<uint8_t*>(out_scales->untyped_data()),
                      src_rank->typed_data(), out_token->typed_data(), out_slot->typed_data(),
                      out_weight->typed_data(), expert_offsets->typed_data(),
                      expert_counts->typed_data(), num_rows->typed_data(), overflow->typed_data()};
  if (opt.engine == jsm::EngineId::kLocal) {
    const std::string err = jsm::dispatch_local_cpu(g, opt, send, out);
    if (!err.empty()) return ffi::Error::InvalidArgument("jax_sdma_moe dispatch (cpu): " + err);
    return ffi::Error::Success();
  }
  std::string err = jsm::dispatch_cpu(*rank.typed_data(), g, opt, send, out);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err);
  return ffi::Error::Success();
}

ffi::Error Gemm1Impl(ffi::AnyBuffer a_values, ffi::AnyBuffer a_scales,
                     S32Vec expert_offsets, S32Vec expert_counts,
                     ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales, ffi::RemainingRets rets,
                     jsm::Gemm1Options opt) {
  JSM_RETURN_IF_ERROR(check_dtype(a_values, ffi::DataType::F8E4M3FN, "gemm1 rows"));
  JSM_RETURN_IF_ERROR(check_dtype(w_values, ffi::DataType::F8E4M3FN, "gemm1 weights"));
  const auto wd = w_values.dimensions();  // [EL, 2I, H]
  jsm::Gemm1Problem p{rows_of(a_values), last_dim(a_values), wd[1] / 2, wd[0], opt.has_limit,
                      opt.swiglu_limit};
  JSM_RETURN_IF_ERROR(check_expert_rows(expert_offsets, expert_counts, p.EL, p.m_cap, "gemm1"));
  const auto* av = static_cast<const uint8_t*>(a_values.untyped_data());
  const auto* as = static_cast<const uint8_t*>(a_scales.untyped_data());
  const auto* wv = static_cast<const uint8_t*>(w_values.untyped_data());
  const auto* ws = static_cast<const uint8_t*>(w_scales.untyped_data());
  const int32_t* offs = expert_offsets.typed_data();
  const int32_t* cnts = expert_counts.typed_data();
  const int64_t I = p.I, IS = I / jsm::kBlock;
  auto h = rets.get<ffi::AnyBuffer>(0);
  if (!h.has_value()) return h.error();
  if (rets.size() == 1) {
    JSM_RETURN_IF_ERROR(check_dtype(**h, ffi::DataType::BF16, "gemm1 output"));
    auto* out = static_cast<uint16_t*>((*h)->untyped_data());
    jsm::gemm1(av, as, offs, cnts, wv, ws, p, [&](int64_t r, int64_t c0, const float* v) {
      for (int i = 0; i < jsm::kBlock; ++i) out[r * I + c0 + i] = jsm::f32_to_bf16(v[i]);
    });
    jsm::for_each_padding_row(offs, cnts, p.EL, p.m_cap, [&](int64_t r) {
      std::fill_n(out + r * I, I, uint16_t(0));
    });
    return ffi::Error::Success();
  }
  auto hs = rets.get<ffi::AnyBuffer>(1);
  if (!hs.has_value()) return hs.error();
  JSM_RETURN_IF_ERROR(check_dtype(**h, ffi::DataType::F8E4M3FN, "gemm1 mxfp8 output"));
  auto* ov = static_cast<uint8_t*>((*h)->untyped_data());
  auto* os = static_cast<uint8_t*>((*hs)->untyped_data());
  jsm::gemm1(av, as, offs, cnts, wv, ws, p, [&](int64_t r, int64_t c0, const float* v) {
    os[r * IS + c0 / jsm::kBlock] = jsm::quantize_block(v, ov + r * I + c0);
  });
  const float zeros[jsm::kBlock] = {};
  jsm::for_each_padding_row(offs, cnts, p.EL, p.m_cap, [&](int64_t r) {
    for (int64_t b = 0; b < IS; ++b) os[r * IS + b] = jsm::quantize_block(zeros, ov + r * I + b * jsm::kBlock);
  });
  return ffi::Error::Success();
}

ffi::Error Gemm2Impl(ffi::AnyBuffer h, S32Vec expert_offsets, S32Vec expert_counts,
                     ffi::AnyBuffer w_values, ffi::AnyBuffer w_scales,
                     std::optional<ffi::AnyBuffer> h_scales, ffi::Result<ffi::AnyBuffer> y,
                     int64_t /*tile_tokens: the CUDA kernel's*/) {
  JSM_RETURN_IF_ERROR(check_dtype(w_values, ffi::DataType::F8E4M3FN, "gemm2 weights"));
  JSM_RETURN_IF_ERROR(check_dtype(*y, ffi::DataType::BF16, "gemm2 output"));
  if (h_scales.has_value()) {
    JSM_RETURN_IF_ERROR(check_dtype(h, ffi::DataType::F8E4M3FN, "gemm2 MX-fp8 rows"));
    JSM_RETURN_IF_ERROR(check_dtype(*h_scales, ffi::DataType::U8, "gemm2 row scales"));
  } else {
    JSM_RETURN_IF_ERROR(check_dtype(h, ffi::DataType::BF16, "gemm2 bf16 rows"));
  }
  const auto wd = w_values.dimensions();  // [EL, H, I]
  jsm::Gemm2Problem p{rows_of(h), wd[1], wd[2], wd[0]};
  JSM_RETURN_IF_ERROR(check_expert_rows(expert_offsets, expert_counts, p.EL, p.m_cap, "gemm2"));
  jsm::gemm2(h.untyped_data(),
             h_scales.has_value() ? static_cast<const uint8_t*>(h_scales->untyped_data()) : nullptr,
             expert_offsets.typed_data(), expert_counts.typed_data(),
             static_cast<const uint8_t*>(w_values.untyped_data()),
             static_cast<const uint8_t*>(w_scales.untyped_data()), p,
             static_cast<uint16_t*>(y->untyped_data()));
  return ffi::Error::Success();
}

ffi::Error CombineImpl(ffi::AnyBuffer rows, S32Vec src_rank, S32Vec token, S32Vec slot,
                       F32Vec weight, S32Scalar rank, ffi::Result<ffi::AnyBuffer> y,
                       jsm::DispatchOptions opt, int64_t topk) {
  JSM_RETURN_IF_ERROR(jsm::runtime_registry::check_open(opt.runtime, "combine on cpu"));
  // engine local (and engine xla after its exchange): every row is this rank's; engine cpu runs
  // the return protocol between the ranks
  if (opt.engine != jsm::EngineId::kCpu && opt.engine != jsm::EngineId::kLocal)
    return jsm::handler::wrong_engine("combine (cpu)", opt.engine, "engines cpu and local");
  JSM_RETURN_IF_ERROR(check_dtype(rows, ffi::DataType::BF16, "combine rows"));
  JSM_RETURN_IF_ERROR(check_dtype(*y, ffi::DataType::BF16, "combine output"));
  const auto yd = y->dimensions();  // [T, H]
  // the ranks: the window table's (engine cpu); 1 for a combine within the rank
  const int64_t R = opt.engine == jsm::EngineId::kCpu ? jsm::cpu_windows::num_ranks(opt.window_set)
                                                     : 1;
  if (R == 0)
    return ffi::Error::InvalidArgument("jax_sdma_moe combine (cpu): unknown or closed Runtime "
                                       "(window table " + std::to_string(opt.window_set) + ")");
  jsm::CombineGeometry g{R, yd[0], topk, yd[1], rows_of(rows)};
  jsm::ReturnRows in{static_cast<const uint16_t*>(rows.untyped_data()), src_rank.typed_data(),
                     token.typed_data(), slot.typed_data(), weight.typed_data()};
  auto* out = static_cast<uint16_t*>(y->untyped_data());
  // the headers the rows are returned by: each names a rank, token and slot of this combine, once
  const jsm::LayoutFault f = jsm::check_rows(in.src_rank, in.token, in.slot, g.m_cap, R, g.T, g.K);
  if (f.rule != jsm::kLayoutOk)
    return ffi::Error::InvalidArgument("jax_sdma_moe combine (cpu): " +
                                       jsm::layout_fault_message(f, "", g.m_cap, R, g.T, g.K));
  std::string err;
  if (opt.engine == jsm::EngineId::kLocal) err = jsm::combine_local(g, in, out);
  if (!err.empty()) return ffi::Error::InvalidArgument("jax_sdma_moe combine (cpu): " + err);
  if (opt.engine == jsm::EngineId::kLocal) return ffi::Error::Success();
  err = jsm::combine_cpu(*rank.typed_data(), g, opt, in, out);
  if (!err.empty()) return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, err);
  return ffi::Error::Success();
}

// An axis-wide check (stage1(check=True)'s overflow, stage2's peers' layouts): the count passes
// through with the guarded arrays, and a non-zero one fails the call.
ffi::Error CheckOverflowImpl(S32Scalar overflow, S32Scalar rank, ffi::RemainingArgs guarded,
                             ffi::Result<S32Scalar> out, ffi::RemainingRets guarded_out,
                             int64_t cap, int64_t what) {
  const int32_t n = *overflow.typed_data();
  *out->typed_data() = n;
  JSM_RETURN_IF_ERROR(jsm::handler::pass_through(guarded, guarded_out, std::memcpy));
  if (n > 0)
    return jsm::handler::axis_check_error(jsm::handler::AxisCheck(what), n, *rank.typed_data(),
                                          cap);
  return ffi::Error::Success();
}

// jsm.stage2's check of out1's layout (kernels/common/layout_check.h): the offsets and counts
// pass through (gemm2 takes the copies, so the check runs first); the call fails naming the
// first field, index and value that break the §4 layout.
ffi::Error CheckLayoutImpl(S32Vec expert_offsets, S32Vec expert_counts, S32Vec src_rank,
                           S32Vec src_token, S32Vec topk_slot, ffi::Result<S32Vec> out_offsets,
                           ffi::Result<S32Vec> out_counts, int64_t num_ranks, int64_t num_tokens,
                           int64_t topk) {
  const int64_t EL = expert_offsets.element_count(), M = src_rank.element_count();
  std::copy_n(expert_offsets.typed_data(), EL, out_offsets->typed_data());
  std::copy_n(expert_counts.typed_data(), EL, out_counts->typed_data());
  jsm::LayoutFault f = jsm::check_experts(expert_offsets.typed_data(),
                                          expert_counts.typed_data(), EL, M);
  if (f.rule == jsm::kLayoutOk)
    f = jsm::check_rows(src_rank.typed_data(), src_token.typed_data(), topk_slot.typed_data(), M,
                        num_ranks, num_tokens, topk);
  if (f.rule == jsm::kLayoutOk) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(
      "jax_sdma_moe.stage2: " +
      jsm::layout_fault_message(f, "out1.", M, num_ranks, num_tokens, topk));
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCheckLayoutCpu, CheckLayoutImpl,
                              jsm::sig::check_layout(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCheckOverflowCpu, CheckOverflowImpl,
                              jsm::sig::check_overflow(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQuantizeCpu, QuantizeImpl,
                              jsm::sig::quantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmRouteCpu, RouteImpl,
                              jsm::sig::route(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmQpackCpu, QpackImpl,
                              jsm::sig::qpack(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmPackCpu, PackImpl,
                              jsm::sig::pack(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmDispatchCpu, DispatchImpl,
                              jsm::sig::dispatch(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm1Cpu, Gemm1Impl,
                              jsm::sig::gemm1(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmGemm2Cpu, Gemm2Impl,
                              jsm::sig::gemm2(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JsmCombineCpu, CombineImpl,
                              jsm::sig::combine(ffi::Ffi::Bind()));
