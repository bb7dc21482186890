// The CPU kernels as one Python module (kvkernels/cpu_extension.py builds it).
#include <torch/extension.h>

#include "cpu_kernels.h"
#include "decoder_stack_cpu.h"
#include "lora_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (float32, CPU)");
  m.def("argmax_rows", &argmax_rows, "torch's argmax over each row of [rows, vocab] float32 logits");
  m.def("prefill_attention_", &prefill_attention_,
        "paged causal attention of the chunks of two or more tokens, into out (float32, CPU)");
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight over the last dimension, as torch computes it");
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
        "x W^T (+ b) with W from pack_quantized_weight's panels, x float32 (CPU); activation_planes 1: x "
        "quantized to int8 in blocks of 32 and multiplied as integers, 2: and each block's rounding error as a "
        "second int8 plane (int16), 0: float32 (1 and 2 need int8_dot_available())");
  m.def("int8_dot_available", &int8_dot_available,
        "whether quantized_gemm takes activation_planes 1 and 2 here (AVX-512 VNNI and VBMI)");
  m.def("lora_add_", &lora_add_,
        "out[rows, columns] += (x[rows] A^T)[:, part's rows] B^T for each group (first row, last + 1, A [parts x "
        "rank, in], [(first column, last + 1, B^T scaled [rank, columns], first row of its A)]), float32");
  pybind11::class_<DecoderStack>(m, "DecoderStack", "a decode step's decoder layers in one call")
      .def(pybind11::init<int64_t, int64_t, int64_t, double>(), "num_heads, num_kv_heads, head_dim, scale")
      .def("add_layer", &DecoderStack::add_layer,
           "input_norm, post_norm, eps, then qkv, o, gate_up and down as (weight, scales, offsets, bias, "
           "out_features, bits, zero_point, activation_planes), bits 0 for small_gemm's float panels")
      .def("team_rows", &DecoderStack::team_rows,
           "the most sequences a step may hold to run on one team of threads (0: it never does)")
      .def("team_rescues", &DecoderStack::team_rescues,
           "phases of team steps whose missing work a thread did as well (another held it), so far")
      .def("set_team_wait_us", &DecoderStack::set_team_wait_us,
           "how long a team thread waits for work another holds before doing it as well (tests: 0)")
      .def("set_team_stall", &DecoderStack::set_team_stall,
           "tests: the team's last thread sleeps us microseconds between computing every every-th piece of work "
           "it claimed and keeping it (every 0: never)",
           pybind11::arg("every"), pybind11::arg("us"))
      .def("set_team_throw", &DecoderStack::set_team_throw,
           "tests: the team's last thread throws at the at-th piece of work it computes (0: never)")
      .def("add_adapter", &DecoderStack::add_adapter,
           "id, per layer [(projection 0-3: qkv o gate_up down, A [parts x rank, in], [(first column, last + 1, "
           "B^T scaled [rank, columns], first row of its A)])]: a LoRA adapter steps name by id")
      .def("drop_adapter", &DecoderStack::drop_adapter, "forget the adapter registered as id")
      .def("forward", &DecoderStack::forward,
           "(the last layer's addition, the residual before it) of a step of decodes, one token per sequence; "
           "lora: [(first row, last + 1, adapter id)] whose update follows each projection",
           pybind11::arg("embeddings"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("key_caches"),
           pybind11::arg("value_caches"), pybind11::arg("block_table"), pybind11::arg("seq_lens"),
           pybind11::arg("slot_mapping"), pybind11::arg("lora") = std::vector<LoRAGroupArgs>{});
}
