"""The KV cache: its blocks (the block pool), who holds which (the cache manager), the tensor's layout and size, and what a request's blocks cost."""
