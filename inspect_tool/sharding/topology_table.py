"""The `--topology` table as rows for `inspect_checkpoint topologies`: name, devices per slice, chip, its memory."""

from __future__ import annotations

from inspect_tool.sharding import mesh

GPU_CHIPS = ("h100", "h200", "b200")


def rows() -> list[dict]:
  """One dict per `--topology` name, in the file's order: `name`, `devices` (None for a chip's name alone, which
  takes the count from --devices), `platform`, `chip` and `hbm_per_device` (the memory one device has)."""
  out = []
  for name, devices in mesh.topologies().items():
    chip = mesh.topology_chip(name)
    out.append({"name": name, "devices": devices, "platform": "gpu" if chip.name in GPU_CHIPS else "tpu",
                "chip": chip.name, "hbm_per_device": chip.memory_text})
  return out
