"""The parameter-tree record every command reports: one `Leaf` per array, keyed as MaxText keys it.

Keys are tuples in MaxText's on-disk convention: `('params', 'params', <module path...>, <name>)` for
`nnx.Param` weights, `('nnx_aux', 'model', <module path...>)` for other model state (the DeepSeek-V3 gate
bias), and whatever an Orbax checkpoint holds for other items (`opt_state`, `step`). The dotted form
(`params.params.decoder.decoder_norm.scale`) is what `inspect_checkpoint` prints.
"""

from __future__ import annotations

import dataclasses
import math
import re

PARAMS_PREFIX = ("params", "params")
AUX_PREFIX = ("nnx_aux", "model")


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One array: its key, shape and dtype name (`float32`, `bfloat16`, `float8_e4m3fn`, ...)."""

  key: tuple[str, ...]
  shape: tuple[int, ...]
  dtype: str

  @property
  def dotted(self) -> str:
    return ".".join(self.key)

  @property
  def is_param(self) -> bool:
    return self.key[:2] == PARAMS_PREFIX

  @property
  def item(self) -> str:
    """The checkpoint item the leaf belongs to (`params`, `nnx_aux`, `opt_state`, `step`, ...).

    A list item is folded by MaxText's key rule (`opt_state`, 0 → `opt_state_0`); the index is dropped here.
    """
    return re.sub(r"_\d+$", "", self.key[0])

  @property
  def module_path(self) -> tuple[str, ...]:
    """The model path without the collection prefix: `('decoder', 'decoder_norm', 'scale')`."""
    if self.key[:2] in (PARAMS_PREFIX, AUX_PREFIX):
      return self.key[2:]
    return self.key

  @property
  def size(self) -> int:
    return math.prod(self.shape)


def param_key(module_path: tuple[str, ...]) -> tuple[str, ...]:
  return PARAMS_PREFIX + tuple(module_path)


def aux_key(module_path: tuple[str, ...]) -> tuple[str, ...]:
  return AUX_PREFIX + tuple(module_path)


_NATURAL = re.compile(r"(\d+)")


def natural_key(text: str) -> list:
  """Sort key that orders `moe_layers_2` before `moe_layers_10`."""
  return [int(part) if part.isdigit() else part for part in _NATURAL.split(text)]


def sort_leaves(leaves) -> list[Leaf]:
  return sorted(leaves, key=lambda leaf: natural_key(leaf.dotted))
