// The CPU kernels as one Python module (kvkernels/cpu_extension.py builds it).
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                               torch::Tensor block_table, torch::Tensor seq_lens, double scale);
void prefill_attention_(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                        const at::Tensor& value_cache, const at::Tensor& block_table, const at::Tensor& seq_lens,
                        const at::Tensor& query_start_loc, double scale);
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
                          const c10::optional<at::Tensor>& bias, bool int8_activations);
bool int8_dot_available();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (float32, CPU)");
  m.def("prefill_attention_", &prefill_attention_,
        "paged causal attention of the chunks of two or more tokens, into out (float32, CPU)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual) * weight, x + residual)");
  m.def("rotary_embedding_", &rotary_embedding_, "rotate-half rotary embedding of query and key, in place");
  m.def("reshape_and_cache", &reshape_and_cache, "write keys and values into the paged cache (slot -1: skip)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [tokens, 2 * intermediate]");
  m.def("pack_gemm_weight", &pack_gemm_weight, "[N, K] weight -> [ceil(N / 16), K, 16] panels for small_gemm");
  m.def("small_gemm", &small_gemm, "x W^T (+ b) for a few rows, from pack_gemm_weight's panels");
  m.def("pack_quantized_weight", &pack_quantized_weight,
        "int8 values [N, K] (4 bits: plus zero_point in 0..15), scales and offsets [N, K / G] -> the panels of "
        "quantized_gemm");
  m.def("quantized_gemm", &quantized_gemm,
        "x W^T (+ b) with W from pack_quantized_weight's panels, x float32 (CPU); int8_activations: x quantized "
        "to int8 in blocks of 32 and multiplied as integers (needs int8_dot_available())");
  m.def("int8_dot_available", &int8_dot_available,
        "whether quantized_gemm takes int8_activations here (AVX-512 VNNI and VBMI)");
}
