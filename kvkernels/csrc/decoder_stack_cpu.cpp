// A decode step's decoder layers in one call from Python. Called one by one from Python (modules, views, checks,
// a dozen calls a layer), the kernels left the host walking between them for about 30% of a token's time at one
// stream: 11 ms a token against 7.5 ms through this one call (the default model's Q4_1 weights, 2 threads). Here
// the same kernels run in the same order on the same tensors, so the results are the Python loop's bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>
#include <omp.h>

#include <atomic>
#include <cstring>
#include <exception>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "decode_attention_cpu.h"
#include "decoder_stack_cpu.h"
#include "fused_rows.h"
#include "quantized_gemm_cpu.h"
#include "stealing_parallel.h"

StackLinear::StackLinear(LinearArgs args) {
  std::tie(weight, scales, offsets, bias, out_features, bits, zero_point, int8_activations) = std::move(args);
  TORCH_CHECK(bits == 0 || scales.has_value(), "decoder stack: a quantized linear needs its scales");
#if defined(KVSERVE_INT8_DOT)
  if (bits != 0 && int8_activations)
    int8_weights.emplace(weight.size(1), weight, *scales, offsets, out_features, bits, zero_point, bias);
#endif
}

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (bits == 0) return small_gemm(x, weight, out_features, bias);
  return quantized_gemm(x, weight, *scales, offsets, out_features, bits, zero_point, bias, int8_activations);
}

void DecoderStack::add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps, LinearArgs qkv, LinearArgs o,
                             LinearArgs gate_up, LinearArgs down) {
  layers_.push_back(StackLayer{std::move(input_norm), std::move(post_norm), eps, StackLinear(std::move(qkv)),
                               StackLinear(std::move(o)), StackLinear(std::move(gate_up)),
                               StackLinear(std::move(down))});
  const StackLayer& layer = layers_.back();
#if defined(KVSERVE_INT8_DOT)
  for (const StackLinear* linear : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
    int8_dot_ = int8_dot_ && linear->int8_weights.has_value();
#else
  int8_dot_ = false;
#endif
}

int64_t DecoderStack::team_rows() const {
#if defined(KVSERVE_INT8_DOT)
  if (int8_dot_ && !layers_.empty() && fused::norm_in_torch_order(layers_[0].input_norm.numel()))
    return int8_dot::kRows;
#endif
  return 0;
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(const at::Tensor& embeddings, const at::Tensor& cos,
                                                         const at::Tensor& sin, const std::vector<at::Tensor>& key_caches,
                                                         const std::vector<at::Tensor>& value_caches,
                                                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                         const at::Tensor& slot_mapping) const {
  const int64_t L = static_cast<int64_t>(layers_.size());
  TORCH_CHECK(static_cast<int64_t>(key_caches.size()) == L && static_cast<int64_t>(value_caches.size()) == L,
              "decoder stack: ", L, " layers but ", key_caches.size(), " key and ", value_caches.size(),
              " value caches");
  TORCH_CHECK(embeddings.dim() == 2 && embeddings.size(0) == block_table.size(0),
              "decoder stack: decode steps only, one token per sequence");
  const int64_t T = embeddings.size(0);
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  const auto cos_c = cos.contiguous(), sin_c = sin.contiguous();
  // the attention kernel's index types, converted once for all layers
  const auto table = block_table.to(at::kInt).contiguous(), lens = seq_lens.to(at::kInt).contiguous();
#if defined(KVSERVE_INT8_DOT)
  const int threads = at::get_num_threads();
  if (T <= team_rows() && threads > 1 && !at::in_parallel_region())
    return forward_team(embeddings, cos_c, sin_c, key_caches, value_caches, table, lens, slot_mapping, threads);
#endif
  at::Tensor x = embeddings, residual;
  for (int64_t l = 0; l < L; ++l) {
    const StackLayer& layer = layers_[l];
    at::Tensor h;
    if (l == 0) {
      residual = x;
      h = rms_norm(x, layer.input_norm, layer.eps);
    } else {
      std::tie(h, residual) = add_rms_norm(x, residual, layer.input_norm, layer.eps);
    }
    // attention: the same views of the qkv projection the Python module takes
    const auto qkv = layer.qkv(h);
    auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
    auto q = parts[0].view({T, num_heads_, head_dim_});
    auto k = parts[1].view({T, num_kv_heads_, head_dim_});
    auto v = parts[2].view({T, num_kv_heads_, head_dim_});
    rotary_embedding_(q, k, cos_c, sin_c);
    reshape_and_cache(k, v, key_caches[l], value_caches[l], slot_mapping);
    auto o = decode_attention(q, key_caches[l], value_caches[l], table, lens, scale_);
    h = layer.o(o.reshape({T, -1}));
    std::tie(h, residual) = add_rms_norm(h, residual, layer.post_norm, layer.eps);
    x = layer.down(silu_and_mul(layer.gate_up(h)));
  }
  return {x, residual};
}

#if defined(KVSERVE_INT8_DOT)
// At a few rows a decode step streams its weights from memory, and between its GEMMs run small serial steps
// (norms, rotary, the cache write, attention's merge, SiLU, quantizing the next GEMM's rows). Each operation as a
// parallel region of its own started and joined the threads some 150 times a token, each with tensors to allocate;
// here one OpenMP team runs all layers over buffers allocated once a step: thread 0 alone where one thread serves
// (then all meet at a barrier), every thread on a GEMM's panels (stealing_parallel.h's ranges) and on attention's
// work items. The arithmetic is the layer loop's, operation for operation, so are the results, bit for bit.
std::tuple<at::Tensor, at::Tensor> DecoderStack::forward_team(const at::Tensor& embeddings, const at::Tensor& cos,
                                                              const at::Tensor& sin,
                                                              const std::vector<at::Tensor>& key_caches,
                                                              const std::vector<at::Tensor>& value_caches,
                                                              const at::Tensor& table, const at::Tensor& lens,
                                                              const at::Tensor& slot_mapping, int threads) const {
  const int64_t L = static_cast<int64_t>(layers_.size()), T = embeddings.size(0), H = embeddings.size(1);
  const int64_t D = head_dim_, q_size = num_heads_ * D, kv_size = num_kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
  const int64_t I = layers_[0].gate_up.out_features / 2;
  TORCH_CHECK(embeddings.scalar_type() == at::kFloat && cos.size(0) == T && cos.size(1) == D &&
                  sin.sizes() == cos.sizes(),
              "decoder stack: float32 embeddings and cos, sin [T, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "decoder stack: int64 slot_mapping [T]");
  const at::Tensor slot_c = slot_mapping.contiguous(), cos_c = cos.contiguous(), sin_c = sin.contiguous();
  const int64_t* slots = slot_c.data_ptr<int64_t>();
  // every buffer below holds what each layer's linears take and give
  auto fits = [](const StackLinear& linear, int64_t in, int64_t out) {
    return linear.int8_weights->in_features() == in && linear.int8_weights->out_features() == out;
  };
  for (int64_t l = 0; l < L; ++l) {
    const StackLayer& layer = layers_[l];
    TORCH_CHECK(fits(layer.qkv, H, qkv_size) && fits(layer.o, q_size, H) && fits(layer.gate_up, H, 2 * I) &&
                    fits(layer.down, I, H) && layer.input_norm.numel() == H && layer.post_norm.numel() == H,
                "decoder stack: layer ", l, "'s shapes disagree with the first layer's and the heads'");
    const at::Tensor& kc = key_caches[l];
    TORCH_CHECK(kc.is_contiguous() && value_caches[l].is_contiguous() && kc.sizes() == value_caches[l].sizes() &&
                    kc.dim() == 4 && kc.size(2) * kc.size(3) == kv_size && kc.scalar_type() == at::kFloat,
                "decoder stack: contiguous float32 caches [blocks, block_size, kv_heads, head_dim]");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(slots[t] < kc.size(0) * kc.size(1), "decoder stack: slot ", slots[t], " is outside the cache");
  }
  const auto opts = embeddings.options();
  at::Tensor residual = embeddings.contiguous().clone(), h = at::empty({T, H}, opts), y = at::empty({T, H}, opts);
  at::Tensor qkv = at::empty({T, qkv_size}, opts), attended = at::empty({T, q_size}, opts);
  at::Tensor gate_up = at::empty({T, 2 * I}, opts), act = at::empty({T, I}, opts);
  float *rp = residual.data_ptr<float>(), *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  float *qkvp = qkv.data_ptr<float>(), *ap = attended.data_ptr<float>(), *gp = gate_up.data_ptr<float>();
  float* actp = act.data_ptr<float>();
  const float *cp = cos_c.data_ptr<float>(), *sp = sin_c.data_ptr<float>();
  DecodeAttention attention(T, num_heads_, num_kv_heads_, D, key_caches.empty() ? 1 : key_caches[0].size(1),
                            table.data_ptr<int32_t>(), table.size(1), lens.data_ptr<int32_t>(), scale_, threads);
  Int8Rows rows;  // the next GEMM's input, quantized by thread 0
  const Int8DotWeights* weights = nullptr;
  float* out = nullptr;
  std::vector<stealing::Range> ranges(threads);
  std::atomic<int64_t> next_item{0};
  std::exception_ptr error;
  bool failed = false;  // written by thread 0 alone, read by all after a barrier
  // the next GEMM: x [T, K] quantized, its panels split into one range a thread
  auto prepare = [&](const float* x, int64_t K, const StackLinear& linear, float* y_out) {
    rows.quantize(x, T, K, K);
    weights = &*linear.int8_weights;
    out = y_out;
    stealing::split(ranges.data(), threads, weights->panels());
  };
  // residual += x (x null: left as it is); h = rms_norm(residual) * weight, row by row
  auto add_norm = [&](const float* x, const at::Tensor& weight, double eps) {
    for (int64_t t = 0; t < T; ++t) {
      if (x != nullptr) fused::add(x + t * H, rp + t * H, H, rp + t * H);
      fused::rms_norm_row(rp + t * H, weight.data_ptr<float>(), H, static_cast<float>(eps), hp + t * H);
    }
  };
#pragma omp parallel num_threads(threads)
  {
    const int self = omp_get_thread_num();
    std::vector<float> scratch;
    // fn on thread 0 alone, then all meet; false (on every thread) once it failed
    auto lead = [&](auto&& fn) {
      if (self == 0) {
        try {
          fn();
        } catch (...) {
          error = std::current_exception();
          failed = true;
        }
      }
#pragma omp barrier
      return !failed;
    };
    auto panels = [&](int64_t begin, int64_t end) { weights->run(rows, out, begin, end); };
    auto run_gemm = [&] {
      stealing::work(ranges.data(), threads, self, weights->chunk(), panels);
#pragma omp barrier
    };
    for (int64_t l = 0; l < L; ++l) {
      const StackLayer& layer = layers_[l];
      if (!lead([&] {
            add_norm(l == 0 ? nullptr : yp, layer.input_norm, layer.eps);
            prepare(hp, H, layer.qkv, qkvp);
          }))
        break;
      run_gemm();
      if (!lead([&] {
            float* kc = key_caches[l].data_ptr<float>();
            float* vc = value_caches[l].data_ptr<float>();
            for (int64_t t = 0; t < T; ++t) {
              float* row = qkvp + t * qkv_size;
              for (int64_t head = 0; head < num_heads_ + num_kv_heads_; ++head)
                fused::rotate_head(row + head * D, cp + t * D, sp + t * D, D / 2);
              if (slots[t] < 0) continue;
              std::memcpy(kc + slots[t] * kv_size, row + q_size, kv_size * sizeof(float));
              std::memcpy(vc + slots[t] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
            }
            attention.set(qkvp, qkv_size, kc, vc, ap);
            next_item.store(0, std::memory_order_relaxed);
          }))
        break;
      for (int64_t i = next_item.fetch_add(1, std::memory_order_relaxed); i < attention.items();
           i = next_item.fetch_add(1, std::memory_order_relaxed))
        attention.run(i, scratch);
#pragma omp barrier
      if (!lead([&] {
            attention.finish();
            prepare(ap, q_size, layer.o, yp);
          }))
        break;
      run_gemm();
      if (!lead([&] {
            add_norm(yp, layer.post_norm, layer.eps);
            prepare(hp, H, layer.gate_up, gp);
          }))
        break;
      run_gemm();
      if (!lead([&] {
            for (int64_t t = 0; t < T; ++t)
              fused::silu_and_mul_row(gp + t * 2 * I, gp + t * 2 * I + I, I, actp + t * I);
            prepare(actp, I, layer.down, yp);
          }))
        break;
      run_gemm();
    }
  }
  if (error) std::rethrow_exception(error);
  return {L == 0 ? embeddings : y, L == 0 ? embeddings : residual};
}
#endif
