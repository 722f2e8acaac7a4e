"""Fused Triton kernels (imported lazily, only on CUDA)."""
