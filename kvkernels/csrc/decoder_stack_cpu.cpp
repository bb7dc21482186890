// A decode step's decoder layers in one call from Python. Called one by one from Python (modules, views, checks,
// a dozen calls a layer), the kernels left the host walking between them for about 30% of a token's time at one
// stream: 11 ms a token against 7.5 ms through this one call (the default model's Q4_1 weights, 2 threads). Here
// the same kernels run in the same order on the same tensors, so the results are the Python loop's bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Optional.h>

#include <tuple>
#include <utility>
#include <vector>

#include "cpu_kernels.h"
#include "decoder_stack_cpu.h"
#include "fused_rows.h"
#include "quantized_gemm_cpu.h"

StackLinear::StackLinear(LinearArgs args) {
  std::tie(weight, scales, offsets, bias, out_features, bits, zero_point, activation_planes) = std::move(args);
  TORCH_CHECK(bits == 0 || scales.has_value(), "decoder stack: a quantized linear needs its scales");
  TORCH_CHECK(activation_planes >= 0 && activation_planes <= 2, "decoder stack: activation_planes 0, 1 or 2");
#if defined(KVSERVE_INT8_DOT)
  if (bits != 0 && activation_planes > 0)
    int8_weights.emplace(weight.size(1), weight, *scales, offsets, out_features, bits, zero_point, bias);
#endif
}

at::Tensor StackLinear::operator()(const at::Tensor& x) const {
  if (bits == 0) return small_gemm(x, weight, out_features, bias);
  return quantized_gemm(x, weight, *scales, offsets, out_features, bits, zero_point, bias, activation_planes);
}

void DecoderStack::add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps, LinearArgs qkv, LinearArgs o,
                             LinearArgs gate_up, LinearArgs down) {
  layers_.push_back(StackLayer{std::move(input_norm), std::move(post_norm), eps, StackLinear(std::move(qkv)),
                               StackLinear(std::move(o)), StackLinear(std::move(gate_up)),
                               StackLinear(std::move(down))});
#if defined(KVSERVE_INT8_DOT)
  // the team's buffers are sized by the heads and the first layer: each layer's linears must take and give those
  const StackLayer &layer = layers_.back(), &first = layers_.front();
  const int64_t H = first.input_norm.numel(), I = first.gate_up.out_features / 2, q_size = num_heads_ * head_dim_;
  auto fits = [](const StackLinear& linear, int64_t in, int64_t out) {
    return linear.int8_weights.has_value() && linear.int8_weights->in_features() == in &&
           linear.int8_weights->out_features() == out;
  };
  team_fits_ = team_fits_ && fits(layer.qkv, H, q_size + 2 * num_kv_heads_ * head_dim_) &&
               fits(layer.o, q_size, H) && fits(layer.gate_up, H, 2 * I) && fits(layer.down, I, H) &&
               layer.input_norm.numel() == H && layer.post_norm.numel() == H;
#else
  team_fits_ = false;
#endif
}

void DecoderStack::add_adapter(int64_t id, const std::vector<std::vector<LoRAProjectionArgs>>& layers) {
  TORCH_CHECK(layers.size() == layers_.size(), "decoder stack: an adapter of ", layers.size(), " layers for ",
              layers_.size());
  std::vector<LoRALayer> adapter(layers.size());
  for (size_t l = 0; l < layers.size(); ++l) {
    for (const auto& [p, a, parts] : layers[l]) {
      TORCH_CHECK(p >= 0 && p < 4, "decoder stack: projection ", p, " is not 0-3");
      adapter[l][p] = LoRAProjection{a, parts, lora_view(a, parts)};
    }
  }
  adapters_[id] = std::move(adapter);
}

void DecoderStack::add_lora(const std::vector<LoRAGroupArgs>& lora, int64_t l, int p, const at::Tensor& x,
                            at::Tensor& out) const {
  std::vector<LoRARows> groups;
  for (const auto& [first, last, id] : lora) {
    const auto& projection = adapters_.at(id)[l][p];
    if (projection) groups.push_back({first, last, &projection->view});
  }
  // the kernel the Python loop calls (executor/lora/lora_batch.py), so the same bits
  if (!groups.empty()) lora_add(x, out, groups);
}

int64_t DecoderStack::team_rows() const {
#if defined(KVSERVE_INT8_DOT)
  if (team_fits_ && !layers_.empty() && fused::norm_in_torch_order(layers_[0].input_norm.numel()))
    return int8_dot::kRows;
#endif
  return 0;
}

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward(const at::Tensor& embeddings, const at::Tensor& cos,
                                                         const at::Tensor& sin, const std::vector<at::Tensor>& key_caches,
                                                         const std::vector<at::Tensor>& value_caches,
                                                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                                                         const at::Tensor& slot_mapping,
                                                         const std::vector<LoRAGroupArgs>& lora) const {
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
  if (lora.empty() && T <= team_rows() && threads > 1 && !at::in_parallel_region())
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
    auto qkv = layer.qkv(h);
    add_lora(lora, l, 0, h, qkv);
    auto parts = qkv.split_with_sizes({q_size, kv_size, kv_size}, -1);
    auto q = parts[0].view({T, num_heads_, head_dim_});
    auto k = parts[1].view({T, num_kv_heads_, head_dim_});
    auto v = parts[2].view({T, num_kv_heads_, head_dim_});
    rotary_embedding_(q, k, cos_c, sin_c);
    reshape_and_cache(k, v, key_caches[l], value_caches[l], slot_mapping);
    auto o = decode_attention(q, key_caches[l], value_caches[l], table, lens, scale_);
    const auto attended = o.reshape({T, -1});
    h = layer.o(attended);
    add_lora(lora, l, 1, attended, h);
    std::tie(h, residual) = add_rms_norm(h, residual, layer.post_norm, layer.eps);
    auto gate_up = layer.gate_up(h);
    add_lora(lora, l, 2, h, gate_up);
    const auto act = silu_and_mul(gate_up);
    x = layer.down(act);
    add_lora(lora, l, 3, act, x);
  }
  return {x, residual};
}
