"""The KV cache: its blocks (block pool), who holds them (cache manager), its layout, size and bills."""
