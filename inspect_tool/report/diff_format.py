"""Formats a model ↔ checkpoint `DiffResult` as text, JSON or Markdown."""

from __future__ import annotations

import json

SCHEMA_VERSION = 1


def to_dict(result, *, source: str, path: str) -> dict:
  return {"schema_version": SCHEMA_VERSION, "model": source, "checkpoint": path, **result.to_dict()}


def _sections(result):
  yield "missing from checkpoint", [f"{l.dotted} {tuple(l.shape)} {l.dtype}" for l in result.missing]
  yield "in checkpoint, not in model", [f"{l.dotted} {tuple(l.shape)} {l.dtype}" for l in result.unexpected]
  yield "shape mismatches", [f"{p.model.dotted}: model {tuple(p.model.shape)} vs checkpoint {tuple(p.checkpoint.shape)}"
                             for p in result.shape_mismatches]
  yield "dtype mismatches", [f"{p.model.dotted}: model {p.model.dtype} vs checkpoint {p.checkpoint.dtype}"
                             for p in result.dtype_mismatches]
  yield "keys that compute differently from the checkpoint's config.json", list(result.conflicts)
  yield "likely causes", [c.message + (f" → {c.suggestion}" if c.suggestion else "") for c in result.causes]


def format_text(result, *, source: str, path: str) -> str:
  lines = [f"model:      {source}", f"checkpoint: {path}"]
  if result.aliased:
    lines.append(f"note: {len(result.aliased)} weight(s) found under the other collection "
                 "(gate bias in params vs nnx_aux), which MaxText accepts")
  for title, rows in _sections(result):
    if rows:
      lines.append(f"{title} ({len(rows)}):")
      lines.extend(f"  {row}" for row in rows)
  verdict = "AGREE" if result.agree else "DISAGREE"
  lines.append(f"{verdict}: {result.summary()}")
  if result.fix:
    lines.append(f"try: {result.fix}")
  return "\n".join(lines) + "\n"


def format_json(result, *, source: str, path: str) -> str:
  return json.dumps(to_dict(result, source=source, path=path), indent=2) + "\n"


def format_markdown(result, *, source: str, path: str) -> str:
  lines = [f"# Model `{source}` vs checkpoint `{path}`", "", f"**{'Agree' if result.agree else 'Disagree'}**: "
           f"{result.summary()}", ""] + ([f"try: `{result.fix}`", ""] if result.fix else [])
  for title, rows in _sections(result):
    if rows:
      lines += [f"## {title.capitalize()} ({len(rows)})", ""] + [f"- `{row}`" for row in rows] + [""]
  return "\n".join(lines)


FORMATTERS = {"text": format_text, "json": format_json, "markdown": format_markdown}
