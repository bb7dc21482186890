// A decode step of a few rows on one OpenMP team (DecoderStack::forward_team), where every linear layer multiplies
// int8 activations.
//
// At a few rows a step streams its weights from memory, and between its GEMMs run small serial steps (norms,
// rotary, the cache write, attention's merge, SiLU, quantizing the next GEMM's rows). As a parallel region an
// operation, the threads were started and joined some 150 times a token, each GEMM with tensors to allocate and a
// cold stream. Here one team runs the step as a sequence of phases, 10 a layer: a lead (one thread's small steps,
// run by whichever thread claims it first) before each GEMM and before attention, then the GEMM's panels (each
// thread its stealing_parallel.h range, then the other's) or attention's work items.
//
// No thread waits for another at a barrier. On this machine the gateway and the load clients take the executor's
// cores for 0.1-0.6 ms at a time, about once a token; a thread preempted in the middle of its last chunk of panels
// held the whole step until it ran again. Instead a thread that finds a phase's work all claimed but not all done
// waits about 20 us, then does the missing panels or items itself, marks the phase complete and goes on; the
// preempted thread, once it runs again, finishes what it held and skips to the phase the step has reached.
//
// Work may so be done twice, and no thread writes where another may read: every chunk of panels and every
// attention item is computed into a buffer of the computing thread's own, then kept by whichever thread takes it
// first (one bit a panel or item, DoneBits::take), which copies it into the layer's buffer and only then marks it
// done. Whoever comes second, the late thread among them, drops its copy. Leads run once, by their claimant, after
// the phase before them is complete. An exception on any thread ends every thread's loop and is raised after the
// parallel region.
//
// ThreadSanitizer does not run on the team itself: it is built only where the CPU has AVX-512 VNNI (the test
// machines have AVX2), and the OpenMP runtime torch loads (libgomp) is not instrumented, so a TSan build would
// report every hand-over across its fork and join as a race. It runs on the keeping rule (team_done_bits.h) in a
// small workload of std::threads with a stalled thread (tests/kernels/test_team_done_bits.py); the team's tests
// force the rescue and a stall (set_team_wait_us, set_team_stall) and compare every bit with the layer loop's.
//
// The arithmetic is the layer loop's, operation for operation, so are the results, bit for bit.
#include <ATen/ATen.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>
#include <tuple>
#include <vector>

#include "decode_attention_cpu.h"
#include "decoder_stack_cpu.h"
#include "fused_rows.h"
#include "quantized_gemm_cpu.h"
#include "region_error.h"
#include "stealing_parallel.h"
#include "team_done_bits.h"

#if defined(KVSERVE_INT8_DOT)
namespace {

constexpr int64_t kPanelCols = int8_dot::kCols;  // output columns a GEMM panel holds

// a layer's phases in order; the GEMMs' index among the layer's four is their order
enum Step : int64_t { kNormQkv, kQkv, kRotary, kAttention, kMergeO, kO, kNormGateUp, kGateUp, kSiluDown, kDown };
constexpr int64_t kSteps = 10;
constexpr int64_t kLeads = 5, kGemms = 4;

int64_t lead_index(int64_t step) { return step / 2; }  // the leads are the even steps
int64_t gemm_index(int64_t step) {  // kQkv, kO, kGateUp, kDown: 0, 1, 2, 3
  return step == kQkv ? 0 : step == kO ? 1 : step == kGateUp ? 2 : 3;
}

}  // namespace

// what forward_team keeps between steps, so that a step allocates little: each GEMM's int8 rows, each phase's done
// bits, ranges and claims
struct TeamWorkspace {
  explicit TeamWorkspace(int64_t layers, int threads)
      : threads(threads),
        rows(layers * kGemms),
        done(layers * (kGemms + 1)),
        ranges(layers * kGemms * threads),
        next_item(new std::atomic<int64_t>[layers]),
        claimed(new std::atomic<bool>[layers * kLeads]) {}

  int threads;
  std::vector<Int8Rows> rows;            // [layer, gemm]
  std::vector<DoneBits> done;            // [layer, gemm or attention]
  std::vector<stealing::Range> ranges;   // [layer, gemm, thread]
  std::unique_ptr<std::atomic<int64_t>[]> next_item;  // attention's, a layer
  std::unique_ptr<std::atomic<bool>[]> claimed;       // [layer, lead]
};

std::tuple<at::Tensor, at::Tensor> DecoderStack::forward_team(const at::Tensor& embeddings, const at::Tensor& cos,
                                                              const at::Tensor& sin,
                                                              const std::vector<at::Tensor>& key_caches,
                                                              const std::vector<at::Tensor>& value_caches,
                                                              const at::Tensor& table, const at::Tensor& lens,
                                                              const at::Tensor& slot_mapping, int threads) const {
  const int64_t L = static_cast<int64_t>(layers_.size()), T = embeddings.size(0), H = embeddings.size(1);
  const int64_t D = head_dim_, q_size = num_heads_ * D, kv_size = num_kv_heads_ * D, qkv_size = q_size + 2 * kv_size;
  const int64_t I = layers_[0].gate_up.out_features / 2;
  TORCH_CHECK(embeddings.scalar_type() == at::kFloat && H == layers_[0].input_norm.numel() && cos.size(0) == T &&
                  cos.size(1) == D && sin.sizes() == cos.sizes(),
              "decoder stack: float32 embeddings [T, hidden] and cos, sin [T, head_dim]");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T,
              "decoder stack: int64 slot_mapping [T]");
  const at::Tensor slot_c = slot_mapping.contiguous();
  const int64_t* slots = slot_c.data_ptr<int64_t>();
  // each layer's linears take and give the buffers' shapes (add_layer saw to it); the caches are checked here
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor& kc = key_caches[l];
    TORCH_CHECK(kc.is_contiguous() && value_caches[l].is_contiguous() && kc.sizes() == value_caches[l].sizes() &&
                    kc.dim() == 4 && kc.size(2) * kc.size(3) == kv_size && kc.scalar_type() == at::kFloat,
                "decoder stack: contiguous float32 caches [blocks, block_size, kv_heads, head_dim]");
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(slots[t] < kc.size(0) * kc.size(1), "decoder stack: slot ", slots[t], " is outside the cache");
  }
  // the guard before the workspace: a second step at once must not replace or reset what the first one runs on
  TORCH_CHECK(!team_busy_.exchange(true, std::memory_order_acquire), "decoder stack: one step at a time");
  struct Release {
    std::atomic<bool>& busy;
    ~Release() { busy.store(false, std::memory_order_release); }
  } release{team_busy_};
  if (!team_ || team_->threads != threads) team_ = std::make_unique<TeamWorkspace>(L, threads);
  TeamWorkspace& ws = *team_;

  // each layer's buffers, [T, width] each: qkv, rotated queries, attention's output, o, gate_up, down
  const int64_t widths[] = {qkv_size, q_size, q_size, H, 2 * I, H};
  int64_t per_layer = 0;
  for (int64_t w : widths) per_layer += T * w;
  const auto opts = embeddings.options();
  at::Tensor work = at::empty({L * per_layer}, opts);
  auto buffer = [&](int64_t l, int which) {
    float* p = work.data_ptr<float>() + l * per_layer;
    for (int i = 0; i < which; ++i) p += T * widths[i];
    return p;
  };
  enum { kQkvOut, kQueries, kAttended, kOOut, kGateUpOut, kDownOut };
  // the leads' own: the residual stream, the norms' output, SiLU's, a token's rotated keys
  at::Tensor residual = embeddings.contiguous().clone(), h = at::empty({T, H}, opts), act = at::empty({T, I}, opts);
  std::vector<float> keys(kv_size);
  float *rp = residual.data_ptr<float>(), *hp = h.data_ptr<float>(), *actp = act.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();  // forward made them contiguous

  auto stack_linear = [&](int64_t l, int64_t g) -> const StackLinear& {
    const StackLayer& layer = layers_[l];
    const StackLinear* linear[] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    return *linear[g];
  };
  auto linear_of = [&](int64_t l, int64_t g) -> const Int8DotWeights& { return *stack_linear(l, g).int8_weights; };
  std::vector<DecodeAttention> attention;
  attention.reserve(L);
  for (int64_t l = 0; l < L; ++l) {
    attention.emplace_back(T, num_heads_, num_kv_heads_, D, key_caches[l].size(1), table.data_ptr<int32_t>(),
                           table.size(1), lens.data_ptr<int32_t>(), scale_, threads);
    for (int64_t g = 0; g < kGemms; ++g) ws.done[l * (kGemms + 1) + g].reset(linear_of(l, g).panels());
    ws.done[l * (kGemms + 1) + kGemms].reset(attention.back().items());
    ws.next_item[l].store(0, std::memory_order_relaxed);
    for (int64_t i = 0; i < kLeads; ++i) ws.claimed[l * kLeads + i].store(false, std::memory_order_relaxed);
  }

  auto gemm_out = [&](int64_t l, int64_t g) {
    const int which[] = {kQkvOut, kOOut, kGateUpOut, kDownOut};
    return buffer(l, which[g]);
  };
  // GEMM g of layer l takes x [T, K]: quantized (in its planes), and its panels split into one range a thread
  auto prepare = [&](int64_t l, int64_t g, const float* x, int64_t K) {
    ws.rows[l * kGemms + g].quantize(x, T, K, K, stack_linear(l, g).activation_planes);
    stealing::split(ws.ranges.data() + (l * kGemms + g) * threads, threads, linear_of(l, g).panels());
  };
  // residual += x (x null: left as it is); h = rms_norm(residual) * weight, row by row
  auto add_norm = [&](const float* x, const at::Tensor& weight, double eps) {
    for (int64_t t = 0; t < T; ++t) {
      if (x != nullptr) fused::add(x + t * H, rp + t * H, H, rp + t * H);
      fused::rms_norm_row(rp + t * H, weight.data_ptr<float>(), H, static_cast<float>(eps), hp + t * H);
    }
  };
  auto run_lead = [&](int64_t l, int64_t step) {
    const StackLayer& layer = layers_[l];
    switch (step) {
      case kNormQkv:
        add_norm(l == 0 ? nullptr : buffer(l - 1, kDownOut), layer.input_norm, layer.eps);
        prepare(l, 0, hp, H);
        break;
      case kRotary: {
        float* kc = key_caches[l].data_ptr<float>();
        float* vc = value_caches[l].data_ptr<float>();
        for (int64_t t = 0; t < T; ++t) {
          const float* row = buffer(l, kQkvOut) + t * qkv_size;
          float* q = buffer(l, kQueries) + t * q_size;
          std::memcpy(q, row, q_size * sizeof(float));
          std::memcpy(keys.data(), row + q_size, kv_size * sizeof(float));
          for (int64_t head = 0; head < num_heads_; ++head)
            fused::rotate_head(q + head * D, cp + t * D, sp + t * D, D / 2);
          for (int64_t head = 0; head < num_kv_heads_; ++head)
            fused::rotate_head(keys.data() + head * D, cp + t * D, sp + t * D, D / 2);
          if (slots[t] < 0) continue;
          std::memcpy(kc + slots[t] * kv_size, keys.data(), kv_size * sizeof(float));
          std::memcpy(vc + slots[t] * kv_size, row + q_size + kv_size, kv_size * sizeof(float));
        }
        attention[l].set(buffer(l, kQueries), q_size, kc, vc, buffer(l, kAttended));
        break;
      }
      case kMergeO:
        attention[l].finish();
        prepare(l, 1, buffer(l, kAttended), q_size);
        break;
      case kNormGateUp:
        add_norm(buffer(l, kOOut), layer.post_norm, layer.eps);
        prepare(l, 2, hp, H);
        break;
      case kSiluDown: {
        const float* gu = buffer(l, kGateUpOut);
        for (int64_t t = 0; t < T; ++t) fused::silu_and_mul_row(gu + t * 2 * I, gu + t * 2 * I + I, I, actp + t * I);
        prepare(l, 3, actp, I);
        break;
      }
    }
  };

  const int64_t phases = L * kSteps;
  std::atomic<int64_t> completed{0};  // phases done, in order
  RegionError error;
  auto complete = [&](int64_t p) {
    int64_t now = completed.load(std::memory_order_relaxed);
    while (now <= p && !completed.compare_exchange_weak(now, p + 1, std::memory_order_acq_rel)) {
    }
  };
  const auto wait = std::chrono::microseconds(team_wait_us_);
  const int64_t stall_every = team_stall_every_;
  const auto stall = std::chrono::microseconds(team_stall_us_);
  const int64_t throw_at = team_throw_at_;
#pragma omp parallel num_threads(threads)
  try {
    const int self = omp_get_thread_num();
    std::vector<float> scratch, kept;  // a thread's own: attention's, and the panels it computed
    int64_t pieces = 0;                 // of work this thread computed, for set_team_stall
    auto before_keeping = [&] {
      if (self != threads - 1) return;
      ++pieces;
      TORCH_CHECK(pieces != throw_at, "decoder stack: the fault a test asked for (set_team_throw)");
      if (stall_every > 0 && pieces % stall_every == 0) std::this_thread::sleep_for(stall);
    };
    auto over = [&](int64_t p) {
      return completed.load(std::memory_order_acquire) > p || error.failed();
    };
    // until phase p's work is all done (then it is marked complete), someone else marked it complete or a thread
    // failed; after wait, whatever no thread took is done here too, chunk at most at a time
    auto settle = [&](int64_t p, DoneBits& done, int64_t chunk, auto&& attempt) {
      const auto start = std::chrono::steady_clock::now();
      bool rescued = false;
      for (int spins = 0; !done.all(); ++spins) {
        if (over(p)) return;
        if (wait.count() > 0 && (spins % 64 != 63 || std::chrono::steady_clock::now() - start < wait)) {
          _mm_pause();
          continue;
        }
        int64_t begin, end;
        if (done.untaken(begin, end)) {
          if (!rescued) team_rescues_.fetch_add(1, std::memory_order_relaxed);
          rescued = true;
          do attempt(begin, std::min(end, begin + chunk));
          while (!over(p) && done.untaken(begin, end));
        } else {
          _mm_pause();  // taken, being copied by the thread that took it
        }
      }
      complete(p);
    };
    for (int64_t p = 0; p < phases && !error.failed();) {
      const int64_t reached = completed.load(std::memory_order_acquire);
      if (reached > p) {
        p = reached;
        continue;
      }
      const int64_t l = p / kSteps, step = p % kSteps;
      if (step % 2 == 0) {
        if (!ws.claimed[l * kLeads + lead_index(step)].exchange(true, std::memory_order_acq_rel)) {
          run_lead(l, step);
          complete(p);
        } else {
          while (!over(p)) _mm_pause();
        }
      } else if (step == kAttention) {
        DoneBits& done = ws.done[l * (kGemms + 1) + kGemms];
        DecodeAttention& layer_attention = attention[l];
        auto attempt = [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end && !over(p); ++i) {
            layer_attention.compute(i, scratch);
            before_keeping();
            done.take(i, i + 1, [&](int64_t, int64_t) { layer_attention.store(i, scratch); });
          }
        };
        for (int64_t i = ws.next_item[l].fetch_add(1, std::memory_order_relaxed); i < layer_attention.items();
             i = ws.next_item[l].fetch_add(1, std::memory_order_relaxed))
          attempt(i, i + 1);
        settle(p, done, 1, attempt);
      } else {
        const int64_t g = gemm_index(step);
        const Int8DotWeights& weights = linear_of(l, g);
        const int64_t N = weights.out_features();
        const Int8Rows& rows = ws.rows[l * kGemms + g];
        float* out = gemm_out(l, g);
        DoneBits& done = ws.done[l * (kGemms + 1) + g];
        // panels [begin, end) into kept, [T, width]; those this thread takes first copied into out
        auto attempt = [&](int64_t begin, int64_t end) {
          if (over(p)) return;
          const int64_t width = (end - begin) * kPanelCols;
          kept.resize(T * width);
          weights.run(rows, kept.data(), width, begin, end);
          before_keeping();
          done.take(begin, end, [&](int64_t from, int64_t to) {
            const int64_t first = from * kPanelCols, count = std::min(to * kPanelCols, N) - first;
            for (int64_t t = 0; t < T; ++t)
              std::memcpy(out + t * N + first, kept.data() + t * width + (first - begin * kPanelCols),
                          count * sizeof(float));
          });
        };
        stealing::work(ws.ranges.data() + (l * kGemms + g) * threads, threads, self, weights.chunk(), attempt);
        settle(p, done, weights.chunk(), attempt);
      }
      ++p;
    }
  } catch (...) {
    error.capture();
  }
  error.rethrow();
  return {at::from_blob(buffer(L - 1, kDownOut), {T, H}, opts).clone(), residual};
}
#else
struct TeamWorkspace {};
#endif

DecoderStack::DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale) {}

DecoderStack::~DecoderStack() = default;
