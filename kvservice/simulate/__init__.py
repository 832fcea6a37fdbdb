"""A trace-driven simulator of a serving engine's KV memory (``kvservice simulate``).

It measures the share of KV memory that holds real token state under contiguous
reservations (``max``, ``pow2``, ``oracle``, placed by a buddy allocator) and under
paging (``paged``, ``paged-shared``: this project's allocator itself, through the SDK).

- ``workload``: request traces (``generate``, ``PRESETS``, ``SimRequest``);
- ``buddy``: the buddy allocator of the contiguous baselines (``Buddy``);
- ``contiguous`` / ``paged``: the memory models (``local_allocator`` starts an allocator);
- ``runner``: the continuous-batching step loop and the accounting (``simulate``);
- ``sharing``: parallel sampling on the real allocator (``parallel_sampling``);
- ``cli``: ``kvservice simulate``.

The names above are importable from this package too; they load on first use, so that
``kvservice``'s command line does not import gRPC for commands that do not need it::

    from kvservice.simulate import generate, local_allocator, simulate

    reqs = generate("sharegpt", 200, seed=0, rate=1.0)
    print(simulate(reqs, "oracle", capacity_tokens=32768)["token_utilization"])
    with local_allocator() as target:
        print(simulate(reqs, "paged", capacity_tokens=32768, target=target)["token_utilization"])
"""

from __future__ import annotations

import importlib

#: Public name -> the module that defines it.
_EXPORTS = {
    "SimRequest": "workload", "Preset": "workload", "PRESETS": "workload", "generate": "workload",
    "summary": "workload", "Buddy": "buddy", "reservation": "contiguous", "local_allocator": "paged",
    "simulate": "runner", "POLICIES": "runner", "parallel_sampling": "sharing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
