"""Text and JSON of the catalog commands: `presets`, `keys`, `topologies`."""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

from inspect_tool.configuration import catalog
from inspect_tool.paramtree import summary

SCHEMA_VERSION = 1


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
  """Columns padded to their widest cell (those in `right` right-aligned), no trailing blanks."""
  widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
  lines = []
  for row in [header, *rows]:
    cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
    lines.append("  ".join(cells).rstrip())
  return "\n".join(lines) + "\n"


def _json(kind: str, rows: list[dict], **extra) -> str:
  return json.dumps({"schema_version": SCHEMA_VERSION, **extra, kind: rows}, indent=1) + "\n"


def presets_text(rows) -> str:
  body = [(r.name, f"{r.decoder_block}/{r.attention_type}",
           "-" if r.parameters is None else f"{summary.human(r.parameters)}", "yes" if r.mtp else "no",
           r.description or r.note) for r in rows]
  notes = [f"{r.name}: {r.note}" for r in rows if r.note and r.description]
  text = table(("preset", "decoder/attention", "params", "MTP", "architecture"), body, right=(2,))
  return text + ("\n" + "\n".join(notes) + "\n" if notes else "")


def presets_json(rows) -> str:
  return _json("presets", [dataclasses.asdict(r) for r in rows])


def keys_text(rows, legend: dict[str, str]) -> str:
  body = [(r.key, catalog.show(r.default), r.affects, r.note) for r in rows]
  used = [kind for kind in legend if any(r.affects == kind for r in rows)]
  return (table(("key", "default", "affects", "note"), body)
          + "\n" + "\n".join(f"{kind}: {legend[kind]}" for kind in used) + "\n")


def keys_json(rows, legend: dict[str, str]) -> str:
  return _json("keys", [dataclasses.asdict(r) for r in rows], affects=legend)


def topologies_text(rows) -> str:
  columns = ("name", "devices", "platform", "chip", "hbm_per_device")
  titles = {"name": "topology", "devices": "devices/slice", "platform": "platform", "chip": "chip",
            "hbm_per_device": "memory/device"}
  body = [["-" if r.get(c) is None else str(r[c]) for c in columns] for r in rows]
  return table([titles[c] for c in columns], body, right=(1,))


def topologies_json(rows) -> str:
  return _json("topologies", rows)
