"""DeepSeek's FP8 inference numerics for activations: e4m3 per token, in tiles of 128 along the contraction.

A Linear whose weight is stored FP8 with 128×128 block scales (DeepSeek-V3's release layout) runs, in DeepSeek's
inference code (`act_quant`), vLLM and transformers' fine-grained FP8, on activations quantized dynamically: each
token's row, cut into tiles of 128 along the contracted axis, gets one float32 scale `absmax(tile) / 448` and is cast
to float8_e4m3fn (saturating). `fake_quantize` returns those activations dequantized (fp8 × scale): a matmul of fp8
operands with float32 accumulation equals the float matmul of the dequantized ones, up to summation order.

`ActTileRule` is a `qwix.QtRule` that asks for this (weights are used as given: the layout's dequantized weights),
and `ActTileProvider` runs the `dot_general` and `ragged_dot` its rules match on tile-quantized activations; the
routed experts' `gmm` reads the rule itself (`quant.gmm.fp8.config_from_rule`). An edge tile shorter than 128 (a
contraction that is not a multiple of 128, toy models) is one tile of what is left.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import qwix

from quant import compat
from quant import fp8

TILE = 128
QTYPE = "float8_e4m3fn"


def fake_quantize(x, axes: Sequence[int], tile: int = TILE, qtype=QTYPE):
  """`x` quantized to `qtype` in tiles of `tile` along its `axes` (flattened in the order given), one float32
  absmax scale per tile and per position of every other axis, and dequantized back to x's dtype."""
  x = jnp.asarray(x)
  axes = [a % x.ndim for a in axes]
  rest = [a for a in range(x.ndim) if a not in axes]
  moved = jnp.transpose(x, rest + axes).astype(jnp.float32)
  lead, width = moved.shape[:len(rest)], math.prod(moved.shape[len(rest):])
  count = -(-width // tile)
  flat = jnp.pad(moved.reshape(lead + (width,)), [(0, 0)] * len(lead) + [(0, count * tile - width)])
  tiles = flat.reshape(lead + (count, tile))
  scale = fp8.compute_scale(tiles, qtype, channelwise_axes=tuple(range(tiles.ndim - 1)))
  values = fp8.dequantize(fp8.quantize_with_scale(tiles, qtype, scale), scale)
  values = values.reshape(lead + (count * tile,))[..., :width].reshape(moved.shape)
  return jnp.transpose(values, [(rest + axes).index(a) for a in range(x.ndim)]).astype(x.dtype)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActTileRule(qwix.QtRule):
  """A rule whose ops run on activations quantized to `act_qtype` in tiles of `act_tile_size` (weights as given)."""

  act_tile_size: int = TILE


def act_tile(rule) -> tuple[str, int] | None:
  """(qtype name, tile) of a rule that asks for tile-quantized activations, else None."""
  if isinstance(rule, ActTileRule) and rule.act_qtype is not None:
    return fp8.resolve_qtype(rule.act_qtype).name, int(rule.act_tile_size)
  return None


class ActTileProvider(qwix.QtProvider):
  """Runs the dot_general / ragged_dot an `ActTileRule` matches on tile-quantized activations (the lhs, as every
  Linear and grouped matmul of the model passes them); other ops run plain."""

  def dot_general(self, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **kwargs):
    wanted = act_tile(compat.provider_rule(self, "dot_general"))
    if wanted is not None:
      lhs = fake_quantize(lhs, dimension_numbers[0][0], wanted[1], wanted[0])
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                               preferred_element_type=preferred_element_type, **kwargs)

  def einsum(self, equation, *operands, **kwargs):
    return jnp.einsum(equation, *operands, **kwargs)

  def ragged_dot(self, lhs, rhs, group_sizes, precision=None, preferred_element_type=None, group_offset=None):
    wanted = act_tile(compat.provider_rule(self, "ragged_dot"))
    if wanted is not None:
      lhs = fake_quantize(lhs, (1,), wanted[1], wanted[0])
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, precision=precision,
                              preferred_element_type=preferred_element_type, group_offset=group_offset)
