// The decoder layers of a decode step as one object holding each layer's weights (decoder_stack_cpu.cpp).
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Optional.h>

#include <array>
#include <atomic>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "lora_cpu.h"
#include "quantized_gemm_cpu.h"

// (weight, scales, offsets, bias, out_features, bits, zero_point, activation_planes): bits 0 is a float weight in
// small_gemm's panels; 4 or 8, quantized_gemm's panels with their scales and offsets
using LinearArgs = std::tuple<at::Tensor, c10::optional<at::Tensor>, c10::optional<at::Tensor>,
                              c10::optional<at::Tensor>, int64_t, int64_t, int64_t, int64_t>;

struct StackLinear {
  explicit StackLinear(LinearArgs args);
  at::Tensor operator()(const at::Tensor& x) const;

  at::Tensor weight;
  c10::optional<at::Tensor> scales, offsets, bias;
  int64_t out_features = 0, bits = 0, zero_point = 0;
  int64_t activation_planes = 0;  // quantized_gemm's: 0 float32, 1 int8, 2 int16
#if defined(KVSERVE_INT8_DOT)
  std::optional<Int8DotWeights> int8_weights;  // where the layer multiplies int8 activations (one plane or two)
#endif
};

struct StackLayer {
  at::Tensor input_norm, post_norm;
  double eps;
  StackLinear qkv, o, gate_up, down;
};

struct TeamWorkspace;  // decoder_stack_team.cpp

// A LoRA adapter's share of one projection in one layer (executor/lora/adapter_files.py's ProjectionLoRA): the
// stacked A and its parts as lora_cpu.h takes them, and the view of them lora_add reads
using LoRAProjectionArgs = std::tuple<int64_t, at::Tensor, std::vector<LoRAPartArgs>>;  // (projection 0-3, A, parts)
struct LoRAProjection {
  at::Tensor a;
  std::vector<LoRAPartArgs> parts;  // holds the B^T tensors view points into
  LoRAView view;
};
// per layer: qkv, o, gate_up, down; a projection the adapter leaves alone has no A
using LoRALayer = std::array<std::optional<LoRAProjection>, 4>;
// a step's rows [first, last) that run under the adapter registered as id
using LoRAGroupArgs = std::tuple<int64_t, int64_t, int64_t>;

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);
  ~DecoderStack();

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, double eps, LinearArgs qkv, LinearArgs o,
                 LinearArgs gate_up, LinearArgs down);

  // the most sequences a step may hold to run on one team of threads (forward_team), 0 where it never does
  int64_t team_rows() const;
  // phases of team steps whose missing work a thread did as well, so far
  int64_t team_rescues() const { return team_rescues_.load(); }
  // how long a team thread waits for work another holds before doing it as well (tests set 0)
  void set_team_wait_us(int64_t us) { team_wait_us_ = us; }
  // tests: the team's last thread sleeps us microseconds between computing every every-th piece of work it
  // claimed and keeping it (0: never), as a thread preempted by another process does
  void set_team_stall(int64_t every, int64_t us) { team_stall_every_ = every, team_stall_us_ = us; }
  // tests: the team's last thread throws at the at-th piece of work it computes (0: never)
  void set_team_throw(int64_t at) { team_throw_at_ = at; }

  // a LoRA adapter's weights under an id, per layer its projections' (executor/lora/): steps name it by the id
  void add_adapter(int64_t id, const std::vector<std::vector<LoRAProjectionArgs>>& layers);
  void drop_adapter(int64_t id) { adapters_.erase(id); }

  // (the last layer's addition, the residual stream before it), as the Python loop leaves them; lora: groups of
  // rows whose adapter's update is added after each projection, as the Python loop adds it (no team then)
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& embeddings, const at::Tensor& cos, const at::Tensor& sin,
                                             const std::vector<at::Tensor>& key_caches,
                                             const std::vector<at::Tensor>& value_caches,
                                             const at::Tensor& block_table, const at::Tensor& seq_lens,
                                             const at::Tensor& slot_mapping,
                                             const std::vector<LoRAGroupArgs>& lora = {}) const;

 private:
  // forward's layers on one OpenMP team (decoder_stack_team.cpp), where every linear layer multiplies int8
  // activations and the rows fit one kernel call
  std::tuple<at::Tensor, at::Tensor> forward_team(const at::Tensor& embeddings, const at::Tensor& cos,
                                                  const at::Tensor& sin, const std::vector<at::Tensor>& key_caches,
                                                  const std::vector<at::Tensor>& value_caches,
                                                  const at::Tensor& table, const at::Tensor& lens,
                                                  const at::Tensor& slot_mapping, int threads) const;

  // out += each group's update of its rows of x, for projection p (0 qkv, 1 o, 2 gate_up, 3 down) of layer l
  void add_lora(const std::vector<LoRAGroupArgs>& lora, int64_t l, int p, const at::Tensor& x, at::Tensor& out) const;

  std::vector<StackLayer> layers_;
  std::map<int64_t, std::vector<LoRALayer>> adapters_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  // every layer so far has int8_weights for all its linears, of the heads' and the first layer's shapes
  bool team_fits_ = true;
  mutable std::unique_ptr<TeamWorkspace> team_;  // what forward_team keeps from one step to the next
  mutable std::atomic<bool> team_busy_{false};     // one team step at a time; taken before team_ may change
  mutable std::atomic<int64_t> team_rescues_{0};
  // a thread preempted by another process loses its core for 0.1 ms or more; a chunk of panels takes 1-2 us
  int64_t team_wait_us_ = 20;
  int64_t team_stall_every_ = 0, team_stall_us_ = 0, team_throw_at_ = 0;
};
