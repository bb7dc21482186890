"""KV tiers below the block pool: host memory, disk and peers, each indexed by a BlockPool of slots."""
