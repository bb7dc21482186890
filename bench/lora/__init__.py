"""LoRA adapters beside the base model (issue 50): `python -m bench.lora` (bench/lora/__main__.py says what it
measures), and random PEFT adapters to measure with (bench/lora/adapters.py)."""
