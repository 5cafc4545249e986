"""Which quantized matmuls a chip's matrix units run natively, and how fast against bf16 (`matrix_units.txt`).

A matmul runs on a chip's int8, fp8 or fp4 units only when both operands are of that kind (weights and
activations); otherwise, or where the chip has no units of that kind, XLA widens the operands to bf16: the
quantization then saves memory, not time. `speed(chip, weight, act)` says which, from the table's published
peak rates; `advice(chip, in_use)` names the MaxText quantization mode that runs faster on the chip, when one does.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Sequence

from inspect_tool import errors

TABLE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "matrix_units.txt")
BF16 = "bf16"
# The MaxText 0.2.5 modes the advice weighs, by the kind of their weights and activations (the broader reach first,
# so that it wins a tie), and what their rules reach. (fp4 is left out: its per-channel e2m1 is not the block-scaled
# FP4 that B200's units take.)
MODES = (("fp8_full", "fp8"), ("int8", "int8"))
REACH = {"int8": ("on the dense matmuls only: its rule names dot_general over decoder/.*layers.*, so the routed "
                  "experts and the MTP block stay bf16"),
         "fp8_full": "routed experts (gmm) included, the MTP block with quantize_mtp=true"}
UNPUBLISHED, ABSENT = "?", "-"


@dataclasses.dataclass(frozen=True)
class Chip:
  """A chip's peak dense rate per operand kind: a float, `ABSENT` (no units) or `UNPUBLISHED`."""

  name: str
  rates: dict

  def ratio(self, kind: str) -> float | None:
    """The kind's rate over bf16's (1.0 where it has no units of its own); None where no rate is published."""
    rate = self.rates.get(kind, UNPUBLISHED)
    if rate == ABSENT:
      return 1.0
    return None if rate == UNPUBLISHED else rate / self.rates[BF16]


@functools.lru_cache(maxsize=None)
def chips() -> dict[str, Chip]:
  """Every chip of the table, by name (v4, v5e, v5p, v6e, tpu7x, h100, h200, b200)."""
  out, kinds = {}, None
  with open(TABLE_FILE, encoding="utf-8") as f:
    for line in f:
      fields = line.lstrip("# ").split()
      if line.startswith("# chip "):
        kinds = fields[1:]
      elif fields and not line.startswith("#"):
        out[fields[0]] = Chip(fields[0], {k: v if v in (ABSENT, UNPUBLISHED) else float(v)
                                          for k, v in zip(kinds, fields[1:])})
  return out


def chip(name: str) -> Chip:
  """The chip `name` names; an unknown name is one line (exit 2) naming the closest."""
  table = chips()
  if name not in table:
    raise errors.InputError(f"unknown chip {errors.shown(name)}; accepted: {', '.join(table)} (or a --topology "
                            "slice of one of them)")
  return table[name]


def kind(qtype: str | None) -> str | None:
  """The matrix-unit kind of a Qwix qtype name: `int8`, `fp8` (e4m3, e5m2, mxfp8), `fp4` (the block-scaled mxfp4 and
  nvfp4, whose rate B200's sheet gives), `bf16` for no quantization (None or a float dtype); None for a type no
  vendor publishes a rate for (int4, nf4, e2m1 with per-channel scales, ...)."""
  if qtype is None or qtype in ("bfloat16", "float16", "float32", "float64"):
    return BF16
  if qtype == "int8":
    return "int8"
  if re.fullmatch(r"float8_.*|mxfp8", qtype):
    return "fp8"
  if qtype in ("mxfp4", "nvfp4"):
    return "fp4"
  return None


def _times(ratio: float) -> str:
  return f"{ratio:.1f}".rstrip("0").rstrip(".") + "x"


@dataclasses.dataclass(frozen=True)
class Speed:
  """How one (weight, activation) type pair runs on a chip: the unit `kind`, its `ratio` to bf16 (None: unknown)."""

  kind: str | None
  ratio: float | None
  text: str

  def to_dict(self) -> dict:
    return {"unit": self.kind, "rate_vs_bf16": self.ratio, "text": self.text}


def speed(on: Chip, weight: str | None, act: str | None) -> Speed:
  """How a matmul with `weight` and `act` qtypes (names; None: not quantized) runs on the chip `on`."""
  w, a = kind(weight), kind(act)
  if w is None or a is None:
    name = weight if w is None else act
    return Speed(None, None, f"{name}: no published rate")
  if w == BF16:
    return Speed(BF16, 1.0, "not quantized: bf16")
  if a == BF16:
    return Speed(BF16, 1.0, f"{w} weights only: bf16 rate (no speed-up)")
  if w != a:
    return Speed(BF16, 1.0, f"{w} x {a}: widened to bf16 (no speed-up)")
  rate, ratio = on.rates.get(w, UNPUBLISHED), on.ratio(w)
  if ratio is None:
    return Speed(w, None, f"{w} rate not published")
  if rate == ABSENT:
    return Speed(BF16, 1.0, f"no {w} units: bf16 rate (no speed-up)")
  if ratio <= 1.0:
    return Speed(w, ratio, f"{w} at the bf16 rate (no speed-up)")
  return Speed(w, ratio, f"{w} units, {_times(ratio)} bf16")


def _rate_text(on: Chip, kind_: str) -> str:
  unit = "TOPS" if kind_.startswith("int") else "TFLOPS"
  return f"{on.rates[kind_]:g} {unit} vs {on.rates[BF16]:g} TFLOPS bf16"


def advice(on: Chip, in_use: Sequence[Speed]) -> str:
  """One line: how the quantization in use (`in_use`: the speeds of its quantized groups) runs on the chip, and the
  MaxText mode that runs faster there when one does."""
  current = max((s.ratio for s in in_use if s.ratio is not None), default=1.0)
  best = max(((on.ratio(k), mode, k) for mode, k in MODES if on.ratio(k) is not None), key=lambda t: t[0])
  now = "; ".join(dict.fromkeys(s.text for s in in_use)) or "no quantization"
  if in_use and all(s.ratio is not None and s.ratio <= 1.0 for s in in_use):
    now += ": it saves memory, not time"
  if best[0] > current:
    ratio, mode, kind_ = best
    return (f"On {on.name}: {now}. MaxText's quantization={mode} runs at {_times(ratio)} ({_rate_text(on, kind_)}), "
            f"{REACH[mode]}.")
  if current > 1.0:
    return f"On {on.name}: {now}: the fastest rate {on.name} publishes for MaxText's modes."
  return f"On {on.name}: {now}; no type runs faster than bf16 on its matrix units."
