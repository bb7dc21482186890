"""The KV tiers side by side (issue 48): `python -m bench.kv_tiers` (bench/kv_tiers/__main__.py says what each
part measures)."""
