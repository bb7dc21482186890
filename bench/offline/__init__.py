"""Benchmarks in one process, no server: the engine (throughput, prefix cache, one stream, a step's time, sampling
state, speculative decoding, structured outputs, parallel sampling), the CPU attention kernels and CURVE's cost."""
