"""Compute: ggml kernels behind one module."""
