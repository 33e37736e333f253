"""The TokenWing model file: GGUF v3 laid out for direct expert reads (spec: docs/model-format.md)."""
