"""Click types for numbers on the command line: finite, in range, and quoted briefly when refused."""

from __future__ import annotations

import math

import click

from inspect_tool import errors


class Bounded(click.ParamType):
  """A finite int or float in [`low`, `high`]: `nan`, `inf` and out-of-range values are refused in one line
  that quotes at most `errors.MAX_SHOWN` characters of the value."""

  def __init__(self, kind: type, low: float, high: float):
    self.kind, self.low, self.high = kind, low, high
    self.name = "integer" if kind is int else "float"

  def get_metavar(self, param, ctx=None):  # pylint: disable=unused-argument
    return f"{self.name.upper()} {self.low}..{self.high}"

  def convert(self, value, param, ctx):
    if isinstance(value, self.kind) and not isinstance(value, bool):
      number = value
    else:
      text = str(value)
      try:
        number = self.kind(text) if len(text) <= 64 else None
      except ValueError:
        number = None
    accepted = f"accepted: {'an integer' if self.kind is int else 'a number'} from {self.low} to {self.high}"
    if number is None:
      self.fail(f"{errors.shown(str(value))} is not {'an integer' if self.kind is int else 'a number'}; {accepted}",
                param, ctx)
    if not (math.isfinite(number) and self.low <= number <= self.high):
      self.fail(f"{errors.shown(str(value))} is out of range; {accepted}", param, ctx)
    return number
