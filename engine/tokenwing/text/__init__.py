"""Text: the tokenizer built from a model's own GGUF vocabulary, and sandboxed chat templates."""
