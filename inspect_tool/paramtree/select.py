"""Which leaves a listing shows (`--filter REGEX` over the dotted keys) and which of them are FP8 scales.

A filter is checked before any work (`quant.safe_regex`: invalid or catastrophically backtracking patterns are
refused in one line) and searched (`re.search`) in each key as printed (`params.params.decoder...`,
`model.layers.3...`) and '/'-joined (`decoder/moe_layers/...`, as `rules` names module paths). Scales are the `array/scale` beside an `array/qvalue` (an Orbax FP8 export) and the
`weight_scale_inv` beside a `weight` (Hugging Face FP8 safetensors): a listing counts them apart from parameters.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Iterable, Sequence

from inspect_tool import errors
from inspect_tool.paramtree import tree
from quant import safe_regex


@dataclasses.dataclass(frozen=True)
class KeyFilter:
  """A checked `--filter` pattern; `shown` of `total` leaves matched it (set by `apply`)."""

  pattern: re.Pattern
  shown: int = 0
  total: int = 0

  @property
  def text(self) -> str:
    return self.pattern.pattern

  def finds(self, leaf: tree.Leaf) -> bool:
    """Whether the pattern occurs in the key, dotted as printed or '/'-joined as module paths are written."""
    return bool(self.pattern.search(leaf.dotted) or self.pattern.search("/".join(leaf.key)))

  def describe(self) -> str:
    return f"filtered by --filter '{self.text}': {self.shown} of {self.total} arrays"

  def to_dict(self) -> dict:
    return {"regex": self.text, "arrays_shown": self.shown, "arrays_total": self.total}


def compile_filter(pattern: str | None) -> KeyFilter | None:
  """The checked filter (None for none); `InputError` naming the pattern when it is refused."""
  if pattern is None:
    return None

  if not pattern:
    raise errors.InputError("--filter '' matches every key; give a regex over the dotted keys "
                            "(e.g. --filter 'moe_layers.*wi_0')")
  try:
    return KeyFilter(safe_regex.check(pattern))
  except ValueError as e:
    raise errors.InputError(f"--filter '{pattern}': {e}; accepted: a Python regex searched in each dotted key") \
        from None


def apply(key_filter: KeyFilter | None, leaves: Sequence[tree.Leaf]) -> tuple[list[tree.Leaf], KeyFilter | None]:
  """The leaves whose dotted key the filter finds, and the filter with its counts."""
  if key_filter is None:
    return list(leaves), None
  shown = [leaf for leaf in leaves if key_filter.finds(leaf)]
  return shown, dataclasses.replace(key_filter, shown=len(shown), total=len(leaves))


ORBAX_SCALE, ORBAX_QVALUE = ("array", "scale"), ("array", "qvalue")
HF_SCALE, HF_WEIGHT, HF_V4_SCALE = "weight_scale_inv", "weight", "scale"


def scale_keys(leaves: Iterable[tree.Leaf]) -> frozenset[tuple[str, ...]]:
  """Keys of the FP8 (and FP4) scales among `leaves`: `<w>/array/scale` beside `<w>/array/qvalue`,
  `<m>.weight_scale_inv` or `<m>.scale` beside `<m>.weight`."""
  keys = {leaf.key for leaf in leaves}
  out = set()
  for key in keys:
    if key[-2:] == ORBAX_SCALE and key[:-2] + ORBAX_QVALUE in keys:
      out.add(key)
    elif key[-1:] == (HF_SCALE,) and key[:-1] + (HF_WEIGHT,) in keys:
      out.add(key)
    elif key[-1:] == (HF_V4_SCALE,) and key[:-1] + (HF_WEIGHT,) in keys:  # DeepSeek-V4's release: `<m>.scale`
      out.add(key)
  return frozenset(out)
