// The CPU kernels' entry points, for the Python bindings and for the kernels that call others
// (decoder_stack_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <tuple>

at::Tensor decode_attention(at::Tensor query, at::Tensor key_cache, at::Tensor value_cache,
                            at::Tensor block_table, at::Tensor seq_lens, double scale);
void prefill_attention_(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps);
void rotary_embedding_(at::Tensor query, at::Tensor key, const at::Tensor& cos, const at::Tensor& sin);
void reshape_and_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache, at::Tensor value_cache,
                       const at::Tensor& slot_mapping);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor pack_gemm_weight(const at::Tensor& weight);
at::Tensor small_gemm(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias);
std::tuple<at::Tensor, at::Tensor, at::Tensor> pack_quantized_weight(const at::Tensor& values, const at::Tensor& scales,
                                                                     const c10::optional<at::Tensor>& offsets,
                                                                     int64_t bits, int64_t zero_point);
at::Tensor quantized_gemm(const at::Tensor& x, const at::Tensor& values, const at::Tensor& scales,
                          const c10::optional<at::Tensor>& offsets, int64_t N, int64_t bits, int64_t zero_point,
                          const c10::optional<at::Tensor>& bias, int64_t activation_planes);
bool int8_dot_available();
at::Tensor argmax_rows(const at::Tensor& logits);
