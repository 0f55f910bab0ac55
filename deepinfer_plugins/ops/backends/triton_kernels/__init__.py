"""Triton kernels for the op registry, one module per concept, each kernel next to its launcher.

Launchers take and return the same tensors as the references in ``deepinfer_plugins.ops`` and must match them
(bit-exact for quantisers and cache records, stated tolerances elsewhere). They run on CUDA tensors, and on CPU
tensors when Triton's interpreter is on (``TRITON_INTERPRET=1`` set before this package is imported).
"""
