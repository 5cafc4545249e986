"""Per-device memory (`sharding.memory.DeviceMemory`) as text and Markdown tables beside the group summary."""

from __future__ import annotations

from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import activations


def _cells(row) -> list[str]:
  hb = summary_lib.human_bytes
  return [hb(row.params), hb(row.optimizer), hb(row.gradients), hb(row.total)]


def _heading(memory, plan) -> str:
  train = (f"training with {memory.optimizer}" + (f", mu in {memory.mu_dtype}" if memory.mu_dtype else "")
           if memory.optimizer else "parameters only (add --train adamw for optimizer state and gradients)")
  return f"Per-device memory on {plan.mesh.devices} devices ({plan.mesh.describe()}), {train}:"


def _verdict(memory) -> list[str]:
  hb = summary_lib.human_bytes
  out = [f"Largest device: {hb(memory.total.total)} ({int(memory.total.total)} B) exact; every device holds the "
         "same (shards divide evenly)."]
  if memory.activations is not None:
    out.append(f"Plus {activations.describe(memory.activations)} = {hb(memory.needed)} needed per device:")
    out += [f"  {hb(b):>10s}  {part}" for part, b in memory.activations.parts if b]
    if memory.grid_point is not None:
      out.append(f"Against XLA at the nearest grid point: {memory.grid_point.describe()}.")
  else:
    out.append("Not counted: activations (add --train for the training step's estimate), XLA temporaries.")
  if memory.limit is not None:
    out.append(f"{memory.limit_source}: {hb(memory.limit)}: " + ("fits" if memory.fits else "DOES NOT FIT"))
  if memory.advice is not None:
    out += memory.advice.report_lines()
  return out


def memory_lines(memory, plan) -> list[str]:
  """Text table: one row per group and part, bytes per device for parameters, optimizer state, gradients."""
  rows = [("group", "params", "optimizer", "gradients", "total")]
  for r in memory.rows:
    rows.append((f"  {r.part}" if r.part else r.group, *_cells(r)))
  rows.append(("total", *_cells(memory.total)))
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  out = ["", _heading(memory, plan)]
  for row in rows:
    out.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))))
  return out + _verdict(memory)


def memory_markdown(memory, plan) -> list[str]:
  out = ["", "## Per-device memory", "", _heading(memory, plan), "",
         "| group | part | params | optimizer | gradients | total |", "|---|---|---:|---:|---:|---:|"]
  out += [f"| {r.group} | {r.part or '(all)'} | " + " | ".join(_cells(r)) + " |" for r in memory.rows]
  out += ["| total | | " + " | ".join(_cells(memory.total)) + " |", ""]
  return out + _verdict(memory)
