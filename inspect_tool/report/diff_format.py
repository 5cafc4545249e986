"""Formats a model ↔ checkpoint `DiffResult` as text, JSON or Markdown.

With `--filter` (`paramtree.select.KeyFilter`) only the differences whose key it finds are listed; the verdict
(and the exit code) stay the whole model's, and the output says so.
"""

from __future__ import annotations

import dataclasses
import json

SCHEMA_VERSION = 1


def shown(result, key_filter):
  """The result with only the rows whose model or checkpoint key `key_filter` finds (all of them without one)."""
  if key_filter is None:
    return result
  find = key_filter.finds
  pairs = lambda rows: [p for p in rows if find(p.model) or find(p.checkpoint)]  # pylint: disable=unnecessary-lambda-assignment
  return dataclasses.replace(result, matched=pairs(result.matched), aliased=pairs(result.aliased),
                             missing=[l for l in result.missing if find(l)],
                             unexpected=[l for l in result.unexpected if find(l)],
                             shape_mismatches=pairs(result.shape_mismatches),
                             dtype_mismatches=pairs(result.dtype_mismatches))


def _differences(result) -> int:
  return len(result.missing) + len(result.unexpected) + len(result.shape_mismatches) + len(result.dtype_mismatches)


def _filter_note(result, key_filter) -> str:
  return (f"shown: the {_differences(shown(result, key_filter))} of {_differences(result)} differences whose key "
          f"matches --filter '{key_filter.text}'; the verdict is the whole model's")


def to_dict(result, *, source: str, path: str, key_filter=None) -> dict:
  out = {"schema_version": SCHEMA_VERSION, "model": source, "checkpoint": path,
         **shown(result, key_filter).to_dict()}
  if key_filter is not None:
    out.update(agree=result.agree, loadable=result.loadable, matched=len(result.matched),
               filter={"regex": key_filter.text, "differences_shown": _differences(shown(result, key_filter)),
                       "differences_total": _differences(result)})
  return out


def _sections(result):
  yield "missing from checkpoint", [f"{l.dotted} {tuple(l.shape)} {l.dtype}" for l in result.missing]
  yield "in checkpoint, not in model", [f"{l.dotted} {tuple(l.shape)} {l.dtype}" for l in result.unexpected]
  yield "shape mismatches", [f"{p.model.dotted}: model {tuple(p.model.shape)} vs checkpoint {tuple(p.checkpoint.shape)}"
                             for p in result.shape_mismatches]
  yield "dtype mismatches", [f"{p.model.dotted}: model {p.model.dtype} vs checkpoint {p.checkpoint.dtype}"
                             for p in result.dtype_mismatches]
  yield "keys that compute differently from the checkpoint's config.json", list(result.conflicts)
  yield "likely causes", [c.message + (f" → {c.suggestion}" if c.suggestion else "") for c in result.causes]


def format_text(result, *, source: str, path: str, key_filter=None) -> str:
  lines = [f"model:      {source}", f"checkpoint: {path}"]
  if result.aliased:
    lines.append(f"note: {len(result.aliased)} weight(s) found under the other collection "
                 "(gate bias in params vs nnx_aux), which MaxText accepts")
  if key_filter is not None:
    lines.append(_filter_note(result, key_filter))
  for title, rows in _sections(shown(result, key_filter)):
    if rows:
      lines.append(f"{title} ({len(rows)}):")
      lines.extend(f"  {row}" for row in rows)
  verdict = "AGREE" if result.agree else "DISAGREE"
  lines.append(f"{verdict}: {result.summary()}")
  if result.fix:
    lines.append(f"try: {result.fix}")
  return "\n".join(lines) + "\n"


def format_json(result, *, source: str, path: str, key_filter=None) -> str:
  return json.dumps(to_dict(result, source=source, path=path, key_filter=key_filter), indent=2) + "\n"


def format_markdown(result, *, source: str, path: str, key_filter=None) -> str:
  lines = [f"# Model `{source}` vs checkpoint `{path}`", "", f"**{'Agree' if result.agree else 'Disagree'}**: "
           f"{result.summary()}", ""] + ([f"try: `{result.fix}`", ""] if result.fix else [])
  lines += [f"> {_filter_note(result, key_filter)}", ""] if key_filter is not None else []
  for title, rows in _sections(shown(result, key_filter)):
    if rows:
      lines += [f"## {title.capitalize()} ({len(rows)})", ""] + [f"- `{row}`" for row in rows] + [""]
  return "\n".join(lines)


FORMATTERS = {"text": format_text, "json": format_json, "markdown": format_markdown}
