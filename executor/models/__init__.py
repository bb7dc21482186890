"""The models kvserve serves: llama.py, the Llama family as one decoder; loader.py, which HF architectures it
serves and how a checkpoint becomes one; model_files.py, where a model's files come from (pulled, or converted
from a GGUF by gguf_convert.py, whose quantized blocks gguf_quantized.py and quantized.py keep)."""
