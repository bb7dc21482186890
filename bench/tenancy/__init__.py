"""What tenants do to each other: hostile inputs and a noisy neighbour, each on a `kvserve up` with a key per
tenant (tenant_stack.py)."""
