"""The `fp8` size column: what each leaf weighs once the quantization rules have made it FP8 (or int8, under
quantization=int8's rules: the note under the column names the qtype).

A weight the rules quantize (the export plan's selection, `coverage.plan`: every weight a quantizing op consumes)
counts its values at the rule's weight qtype (1 byte for FP8) plus its scales (scale shape × compute dtype, as
`export` writes them); every other leaf (norms, embedding, router bias, weights no rule reaches) stays at its stored
dtype. A checkpoint that already holds FP8 weights and scales is counted as stored. Without rules (a float
checkpoint listed without a config) the column is unknown.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping

from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.paramtree import tree


@dataclasses.dataclass(frozen=True)
class Fp8Sizing:
  """Bytes per leaf in FP8 form; `quantized`: leaf key -> (bytes per value, bytes of its scales)."""

  quantized: Mapping[tuple[str, ...], tuple[float, float]]
  basis: str  # for the reader: which rules decided, e.g. "quantization=fp8_full rules: 20 weights"

  def bytes_of(self, leaf: tree.Leaf) -> float:
    entry = self.quantized.get(leaf.key)
    if entry is None:
      return leaf.size * summary_lib.dtype_bytes(leaf.dtype)
    per_value, scale_bytes = entry
    return leaf.size * per_value + scale_bytes


def as_stored(scales: int) -> Fp8Sizing:
  """A checkpoint already in FP8 form (an export, FP8 safetensors): every leaf, scales included, as stored."""
  return Fp8Sizing({}, f"as stored (already FP8: {scales} scale arrays beside their weights)")


def from_plan(plan, basis: str) -> Fp8Sizing:
  """The weights of a `coverage.plan.ExportPlan` at their qtype plus their scales."""
  dtype_bytes = summary_lib.dtype_bytes
  quantized = {key: (dtype_bytes(wq.qtype), math.prod(wq.scale_shape) * dtype_bytes(wq.compute_dtype))
               for key, wq in plan.weights.items()}
  qtypes = ", ".join(sorted({wq.qtype for wq in plan.weights.values()}))
  return Fp8Sizing(quantized, f"{basis}: the {len(quantized)} weights they quantize at their qtype ({qtypes}) plus "
                   "their scales, every other array at its stored dtype")
