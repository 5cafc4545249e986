"""The verdicts at a glance as text: one row per group of matmul weights, and, on a chip (`chip_fit.ChipFit`), how
each quantized group runs on its matrix units and the advice. No JAX: the listings print it too."""

from __future__ import annotations

import textwrap

WIDTH = 100  # the verdict block's lines fit in this many columns


def glance_text(verdicts, chip=None) -> list[str]:
  """The verdict block (`coverage_verdict.Verdict`s), wrapped to `WIDTH` columns; with `chip`, each quantized group
  says how it runs on that chip, and the advice closes the block."""
  on = f"; on {chip.chip}" if chip is not None else ""
  lines = [f"At a glance (matmul weights quantized / all; types: weights · activations · gradients{on}):"]
  name_width = max(len(v.name) for v in verdicts)
  count_width = max(len(v.count) for v in verdicts)
  for v in verdicts:
    head = f"  {v.name.ljust(name_width)}  {v.count.ljust(count_width)}  "
    status = "; ".join(filter(None, (v.status, chip.text_of(v.name) if chip is not None else "")))
    lines += textwrap.wrap(status, WIDTH, initial_indent=head, subsequent_indent=" " * len(head),
                           break_on_hyphens=False) or [head.rstrip()]
  if chip is not None:
    lines += advice_text(chip)
  return lines


def advice_text(chip) -> list[str]:
  """The chip's advice, wrapped to `WIDTH` columns."""
  return textwrap.wrap(chip.advice, WIDTH, break_on_hyphens=False)
