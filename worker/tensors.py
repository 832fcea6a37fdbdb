"""Tensors on the wire: raw little-endian bytes with a dtype name and a shape."""

from __future__ import annotations

import math

import torch

from kvservice import errors
from kvservice.common.settings import echo
from kvservice.v1 import worker_pb2 as pb

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


def decode(t: pb.Tensor, name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tensor of a request field, checked against the pool's dtype; InvalidArgument
    names the field and the offending value."""
    if t.dtype not in DTYPES:
        raise errors.InvalidArgument(f"{name}: unknown dtype {echo(t.dtype)} (float32, float16 or bfloat16)")
    if DTYPES[t.dtype] != dtype:
        raise errors.InvalidArgument(f"{name}: dtype {t.dtype}, the pool holds {NAMES[dtype]}")
    shape = tuple(t.shape)
    if any(d < 0 for d in shape):
        raise errors.InvalidArgument(f"{name}: negative dimension in shape {list(shape)}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    expected = math.prod(shape) * itemsize
    if len(t.data) != expected:
        raise errors.InvalidArgument(f"{name}: {len(t.data)} bytes of data, shape {list(shape)} of "
                                     f"{t.dtype} takes {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    host = torch.frombuffer(bytearray(t.data), dtype=dtype).reshape(shape)
    return host.to(device) if device.type != "cpu" else host


def encode(x: torch.Tensor) -> pb.Tensor:
    """A tensor as raw bytes (copied to the host if needed)."""
    x = x.detach().to("cpu").contiguous()
    return pb.Tensor(dtype=NAMES[x.dtype], shape=list(x.shape), data=x.view(torch.uint8).numpy().tobytes())
