"""Tile sizes of the grouped matmul: MaxText's 18 tile keys when they are given, else the pick measured on the chip.

A routed-expert block runs two grouped matmuls per direction: `wi` ([M, E] x [G, E, F], the up projections
`wi_0`, `wi_1`) and `wo` ([M, F] x [G, F, E]). MaxText 0.2.5 tiles each of the three kernels of each (forward; dlhs,
the gradient of the rows; drhs, the gradient of the weight) with three keys, `{wi,wo}_tile_{fwd,dlhs,drhs}_
{batch_seq,embed_dim,mlp_dim}`, and maps them onto the kernel's (m, k, n) as its `moe.py` does: batch_seq is the
row tile (the contracted one for drhs), embed_dim and mlp_dim are k or n by the direction of the product.
`from_keys` reads them; `Tiles` holds the three `kernel.Tiling`s of one matmul.

Without the keys, `auto(m, k, n)` gives the tiling measured fastest on a TPU v5e chip (bench/bench_gmm.py --sweep,
docs/benchmarks.md): 512 rows, the smaller of K and N whole when it is at most 2048 and the other at 1024. At
DeepSeek-V3's expert shapes (8192 tokens x top-8, 32 experts) that ran at 152-154 TFLOP/s against 134-142 at
MaxText's (512, 1024, 1024). The same rule serves the other TPU generations until they are measured.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from quant.gmm import kernel

DIRECTIONS = ("fwd", "dlhs", "drhs")
DIMS = ("batch_seq", "embed_dim", "mlp_dim")
KEYS = tuple(f"{mm}_tile_{d}_{dim}" for mm in ("wi", "wo") for d in DIRECTIONS for dim in DIMS)
MAXTEXT_DEFAULT = kernel.Tiling(512, 1024, 1024)  # every one of the 18 keys in MaxText 0.2.5's base.yml
WHOLE = 2048  # a contracted or output axis up to this size is one tile (`auto`)


def auto(m: int, k: int, n: int, *, vmem: int | None = None, dtypes=(jnp.bfloat16,) * 3) -> kernel.Tiling:
  """The tiling measured fastest for a [m, k] x [k, n] grouped matmul (for tgmm: k and n of its [k, n] output) whose
  tiles fill at most half of `vmem` bytes (operand and output `dtypes`; Mosaic's own temporaries take more: an fp8
  tiling estimated at 12 MiB used 18 MiB); where it does not fit (v4's 16 MiB), MaxText's default, then half of
  it."""
  del m  # 512 rows won at every row count measured
  if n <= k and n <= WHOLE:
    measured = kernel.Tiling(512, min(k, 1024), n)
  elif k <= WHOLE:
    measured = kernel.Tiling(512, k, min(n, 1024))
  else:
    measured = MAXTEXT_DEFAULT
  for tiling in (measured, MAXTEXT_DEFAULT, kernel.Tiling(256, 512, 512)):
    if vmem is None or kernel.footprint(tiling, *dtypes) * 2 <= vmem:
      return tiling
  return kernel.Tiling(128, 256, 256)


@dataclasses.dataclass(frozen=True)
class Tiles:
  """The tilings of one grouped matmul's three kernels: forward, dlhs (rows' gradient), drhs (weight's gradient);
  None: `auto` for the shape met (our kernel) or MaxText's default (JAX's Megablox)."""

  fwd: kernel.Tiling | None = None
  dlhs: kernel.Tiling | None = None
  drhs: kernel.Tiling | None = None


# (m, k, n) of each direction of each matmul, as MaxText 0.2.5's moe.py names them.
_ORDER = {
    ("wi", "fwd"): ("batch_seq", "embed_dim", "mlp_dim"), ("wi", "dlhs"): ("batch_seq", "mlp_dim", "embed_dim"),
    ("wi", "drhs"): ("batch_seq", "embed_dim", "mlp_dim"), ("wo", "fwd"): ("batch_seq", "mlp_dim", "embed_dim"),
    ("wo", "dlhs"): ("batch_seq", "embed_dim", "mlp_dim"), ("wo", "drhs"): ("batch_seq", "mlp_dim", "embed_dim"),
}


def from_keys(get: Callable[[str], int], matmul: str) -> Tiles:
  """The tiles of `matmul` ("wi" or "wo") from MaxText's keys, `get(key)` giving each key's value."""
  def tiling(direction: str) -> kernel.Tiling:
    m, k, n = (int(get(f"{matmul}_tile_{direction}_{dim}")) for dim in _ORDER[(matmul, direction)])
    return kernel.Tiling(m, k, n)
  return Tiles(*(tiling(d) for d in DIRECTIONS))


def check(value, key: str) -> int:
  """A tile size: a positive multiple of 8, else ValueError naming the key and what is accepted."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 8 or value % 8:
    raise ValueError(f"{key}={value!r} is not a tile size; accepted: a positive multiple of 8 (MaxText's default "
                     f"{MAXTEXT_DEFAULT.tm} or {MAXTEXT_DEFAULT.tk})")
  return value
