"""The verdicts at a glance on one chip: how each group's quantized matmuls run on its matrix units, and the advice.

`build(chip, verdicts)` takes the groups of `coverage_verdict.build` and, for each quantized (weight, activation)
type pair, asks `sharding.matrix_units.speed` whether the chip runs it natively and at what rate against bf16, or
widens it to bf16 (memory saved, no speed); `advice` names MaxText's mode that runs faster there, when one does.
"""

from __future__ import annotations

import dataclasses

from inspect_tool.sharding import matrix_units


@dataclasses.dataclass(frozen=True)
class ChipFit:
  """Per verdict group (by name): its speeds on `chip`; `advice`: one line over them all."""

  chip: str
  groups: tuple[tuple[str, tuple[matrix_units.Speed, ...]], ...]
  advice: str

  def text_of(self, name: str) -> str:
    """"on v5p: int8 units, 2x bf16" for a quantized group, "" for the others."""
    speeds = dict(self.groups).get(name, ())
    return f"on {self.chip}: " + " / ".join(s.text for s in speeds) if speeds else ""

  def to_dict(self) -> dict:
    return {"chip": self.chip, "advice": self.advice,
            "groups": [{"name": name, "speeds": [s.to_dict() for s in speeds]} for name, speeds in self.groups]}


def build(chip: str, verdicts) -> ChipFit:
  """The chip's verdicts for `verdicts` (`coverage_verdict.Verdict`s; their `qtypes` pairs)."""
  on = matrix_units.chip(chip)
  groups = tuple((v.name, tuple(matrix_units.speed(on, w, a) for w, a in v.qtypes)) for v in verdicts if v.qtypes)
  in_use = [s for _, speeds in groups for s in speeds]
  return ChipFit(chip, groups, matrix_units.advice(on, in_use))
