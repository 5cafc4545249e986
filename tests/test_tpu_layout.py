"""TPU array sizes (`inspect_tool/sharding/tpu_layout.py`) against XLA's own: the parameter allocations of its
buffer assignment for MaxText 0.2.5's training step on v5p (`train_compile` with `--xla_dump_to`, see
tests/data/xla/README.md). Each row: dtype bytes, shape, the allocation's size XLA printed, and the grid point whose
dump it comes from. XLA chose the layouts (e.g. `f32[129280,16]{0,1:T(8,128)}`: 129280 minor, so 16 is not padded
to 128; `f32[16,58,16,64]{3,2,1,0:T(8,128)}`: 64 minor, padded to 128)."""

import pytest

from inspect_tool.sharding import tpu_layout

XLA_ALLOCATIONS = [
    (4, (32, 58, 224, 2048), 3405774848),  # 671b v5p-512: routed experts wi_0 shard, no padding
    (4, (32, 58, 2048, 224), 3405774848),  # wo shard: 224 is the second-minor, a multiple of 8
    (4, (64, 26, 1408, 256), 2399141888),  # deepseek2-16b v5p-16
    (4, (129280, 16), 8273920),  # tiny: the embedding shard, laid out with 129280 minor
    (4, (16, 129280), 8273920),  # tiny: the head shard
    (4, (16, 58, 16, 64), 7602176),  # tiny: 64 minor, padded to 128
    (4, (16, 58, 64, 16), 7602176),  # tiny: 64 minor again (the last two dimensions swapped)
    (4, (8, 58, 4, 192), 1900544),  # tiny: 192 -> 256 lanes, 4 rows in a (4, 128) tile
    (4, (16, 58, 80), 475136),  # tiny: 80 -> 128 lanes, 16 rows, 58 major
    (4, (4, 58, 4, 256), 950272),
    (4, (64, 58, 8), 237568),
    (4, (128, 5, 128, 224), 73400320),
    (4, (5, 256), 8192),  # 5 rows in an (8, 128) tile
    (4, (1536,), 8192),  # 1-D: tiles of 1024
    (4, (7168,), 28672),
    (4, (256,), 1024),  # 1-D below 1024: its own power of two
    (4, (64,), 512),
    (4, (), 512),  # a scalar takes 512 bytes
]


@pytest.mark.parametrize("itemsize, shape, xla", XLA_ALLOCATIONS)
def test_padded_bytes_is_what_xla_allocates_on_tpu(itemsize, shape, xla):
  assert tpu_layout.padded_bytes(shape, itemsize) == xla


def test_sixteen_bit_arrays_tile_like_thirty_two_bit_ones_down_to_two_rows():
  """bf16 values of the same buffer assignments (temporaries, laid out by XLA with their last dimension minor)."""
  assert tpu_layout.padded_bytes((5, 7168), 2) == 114688  # bf16[5,7168]{1,0:T(8,128)(2,1)}: 8 rows
  assert tpu_layout.padded_bytes((3, 16), 2) == 1024  # bf16[3,16]{1,0:T(4,128)(2,1)}: 4 rows
  assert tpu_layout.padded_bytes((3, 4, 4, 256), 2) == 24576  # bf16[3,4,4,256]{3,2,0,1:T(4,128)(2,1)}
