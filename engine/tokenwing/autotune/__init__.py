"""Autotune: probe the machine (memory and its limit, cores and ISA, GPUs, the drive) and choose settings."""
