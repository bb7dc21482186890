"""Where no CUDA device exists, Triton runs in its interpreter, and that is chosen before anything imports triton
(kvkernels/triton_mode.py says why): here, before pytest imports any module of these tests, whichever it collects
first (the model tests import triton through transformers)."""

import torch

from tests.triton_interpreter import interpret_on_cpu_only_machines

interpret_on_cpu_only_machines(torch.cuda.is_available())
