"""LoRA adapters beside one base model: read from PEFT directories, held in host memory, applied per row group."""
