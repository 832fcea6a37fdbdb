"""Paged KV-cache kernels: CUDA sources beside CuPy launchers, and a torch backend.

``get_backend(device)`` picks the implementation: the CuPy kernels on a CUDA device, the
vectorised torch implementation (the same online-softmax algorithm) otherwise. Both take
and return torch tensors in the layout of ``kernels.backend``.
"""

from kernels.backend import KVBackend, get_backend

__all__ = ["KVBackend", "get_backend"]
