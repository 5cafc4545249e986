"""The `--topology` table as rows for `inspect_checkpoint topologies`: every column `topologies.txt` holds."""

from __future__ import annotations

from inspect_tool.sharding import mesh

# The columns of topologies.txt after the name, in order; a file without the last ones simply lacks them.
COLUMNS = ("devices", "platform", "hbm_per_device")


def rows() -> list[dict]:
  """One dict per topology, in the file's order: `name`, `devices` (int) and whichever other columns it has."""
  out = []
  with open(mesh.TOPOLOGY_FILE, encoding="utf-8") as f:
    for line in f:
      if not line.strip() or line.startswith("#"):
        continue
      name, *values = line.split()
      row = {"name": name, **dict(zip(COLUMNS, values))}
      row["devices"] = int(row["devices"])
      out.append(row)
  return out
