"""Accelerator backends of the op registry, loaded through the ``deepinfer.op_backends`` entry points.

Importing this package imports nothing heavy; each backend module imports its toolchain (Triton, the compiled
CUDA extension, torch_npu) only when the registry discovers it, and torch_npu only on first use.
"""
