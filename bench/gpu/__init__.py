"""The GPU session (session.sh: env, model, check, e2e, report) and what prepares it on a machine without a GPU:
the GPU image's packages (image.py, image_triton.py) and every Triton launch compiled for sm_90
(triton_compile_check.py)."""
