"""A pool's geometry, checked, and its one conversion to and from ``pb.PoolGeometry``."""

from __future__ import annotations

from dataclasses import dataclass

from kvservice import errors
from kvservice.common.settings import check_block_size, check_in_range, echo
from kvservice.v1 import allocator_pb2 as pb

DTYPES = ("float32", "float16", "bfloat16")
MAX_NUM_BLOCKS = 1 << 24
MAX_DIM = 4096


@dataclass(frozen=True, slots=True)
class Geometry:
    """A pool's shape: ``num_blocks`` blocks of ``block_size`` slots in every layer."""

    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def check(self) -> None:
        """Raises InvalidArgument naming the first bad field."""
        try:
            check_in_range("num_blocks", self.num_blocks, 1, MAX_NUM_BLOCKS)
            check_block_size(self.block_size)
            check_dims(self.num_layers, self.num_kv_heads, self.head_dim)
        except ValueError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        if self.dtype not in DTYPES:
            raise errors.InvalidArgument(f"dtype must be one of {', '.join(DTYPES)}, got {echo(self.dtype)}")

    @property
    def bytes_per_block(self) -> int:
        size = 4 if self.dtype == "float32" else 2
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * size

    def to_pb(self) -> pb.PoolGeometry:
        return pb.PoolGeometry(num_blocks=self.num_blocks, block_size=self.block_size, num_layers=self.num_layers,
                               num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    @classmethod
    def from_pb(cls, g: pb.PoolGeometry) -> "Geometry":
        return cls(g.num_blocks, g.block_size, g.num_layers, g.num_kv_heads, g.head_dim, g.dtype)


def check_dims(num_layers: int, num_kv_heads: int, head_dim: int) -> None:
    """Each in 1..4096; ValueError names the first that is not."""
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        check_in_range(name, value, 1, MAX_DIM)
