"""The models kvserve serves: llama.py, the Llama family as one decoder; loader.py, which HF architectures it
serves and how a checkpoint becomes one."""
