"""The kernels a model is built with (kvkernels/backend.py chooses them for --attention-backend): paged attention and
cache writes over the paged KV cache (torch_paged.py on the CPU or without Triton, triton_*.py on CUDA), the
per-layer operations (layer_ops.py, triton_norm_rope.py), packed linear weights on the CPU (cpu_linear.py),
quantized ones (quantized.py, weight_quantization.py), and the torch twins that define what each computes (torch_twins.py)."""
