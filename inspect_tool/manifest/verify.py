"""`verify DST`: re-reads an export (local or gs://) and checks it against its `export_manifest.json`.

Every tensor the manifest lists must be stored with its shape, dtype and sha256, and no other; a scale tensor's
zero / NaN / inf counts must be those the manifest gives. The first difference, in manifest order, is the finding.
A manifest that is missing or malformed is a bad input (`errors.CheckpointError`), not a finding.
"""

from __future__ import annotations

import dataclasses
import re

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.manifest import build
from inspect_tool.manifest import stored as stored_lib
from inspect_tool.storage import paths

MAX_MANIFEST_BYTES = 512 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")
_KINDS = {"dir": "a directory", "other": "not a regular file (a FIFO, socket or device)"}


@dataclasses.dataclass(frozen=True)
class Verified:
  path: str
  tensors: int
  nbytes: int
  finding: str | None  # the first difference; None: the export is what its manifest says

  @property
  def passed(self) -> bool:
    return self.finding is None


def read_manifest(path: str) -> dict:
  """The manifest of the export at `path`, its structure and every entry's fields checked (one line naming the
  manifest, the entry and what is wrong: a malformed manifest is a bad input, never a tensor that differs)."""
  where = paths.join(path, build.NAME)
  found = files.kind(where)
  if found != "file":
    if found in _KINDS:
      raise errors.CheckpointError(f"{where}: is {_KINDS[found]}; accepted: the {build.NAME} file that "
                                   "inspect_checkpoint export writes")
    raise errors.CheckpointError(f"{path}: no {build.NAME}; accepted: a directory written by inspect_checkpoint "
                                 "export (version 2026.12 or later)")
  doc = files.parse_json(files.read_bytes(where, MAX_MANIFEST_BYTES, "export manifest"),
                         lambda why: errors.CheckpointError(f"{where}: {why}"))
  if not isinstance(doc, dict) or doc.get("kind") != build.KIND or not isinstance(doc.get("tensors"), list):
    raise errors.CheckpointError(f"{where}: not an export manifest (kind {build.KIND!r} with a tensors list)")
  if doc.get("version") != build.VERSION:
    raise errors.CheckpointError(f"{where}: manifest version {str(doc.get('version'))[:20]}; accepted: "
                                 f"{build.VERSION}")
  seen = set()
  for i, entry in enumerate(doc["tensors"]):
    why = _malformed(entry)
    if why:
      named = f" ({entry['name']!r})" if isinstance(entry, dict) and isinstance(entry.get("name"), str) else ""
      raise errors.CheckpointError(f"{where}: tensors[{i}]{named} {why}")
    if entry["name"] in seen:
      raise errors.CheckpointError(f"{where}: tensor {entry['name']!r} is listed twice")
    seen.add(entry["name"])
  return doc


def _count(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _malformed(entry) -> str | None:
  """What is wrong with one entry of the manifest's tensors (None: nothing)."""
  if not isinstance(entry, dict):
    return f"is {type(entry).__name__}, not an object with name, shape, dtype and sha256"
  accepted = {"name": "a tensor name", "shape": "a list of sizes (integers >= 0)", "dtype": "a dtype name",
              "sha256": "64 lowercase hex digits"}
  valid = {"name": lambda v: isinstance(v, str) and v != "",
           "shape": lambda v: isinstance(v, list) and all(_count(d) for d in v),
           "dtype": lambda v: isinstance(v, str) and v != "",
           "sha256": lambda v: isinstance(v, str) and _SHA256.fullmatch(v) is not None}
  if "scale_of" in entry:
    accepted.update(zero="a count (an integer >= 0)", nan="a count (an integer >= 0)", inf="a count (an integer >= 0)")
    valid.update(zero=_count, nan=_count, inf=_count)
  for field, check in valid.items():
    if field not in entry:
      return f"lacks {field!r} (each entry has name, shape, dtype, sha256; a scale tensor's zero, nan, inf)"
    if not check(entry[field]):
      value = entry[field]
      if field == "sha256" and isinstance(value, str):
        hex_only = "" if len(value) != 64 else ", not all lowercase hex"
        return f"has a sha256 of {len(value)} characters{hex_only}; accepted: {accepted[field]}"
      return f"has {field} {errors.shown(value)}; accepted: {accepted[field]}"
  return None


def verify(path: str, piece_bytes: int) -> Verified:
  """Checks the export at `path` against its manifest, reading at most `piece_bytes` of a tensor at once."""
  doc = read_manifest(path)
  tensors = stored_lib.StoredTensors(path)
  listed = [entry["name"] for entry in doc["tensors"]]
  total = sum(tensors.nbytes(n) for n in tensors.names())
  result = lambda finding: Verified(path, len(listed), total, finding)  # noqa: E731
  names = set(tensors.names())
  extra = sorted(names - set(listed))
  for entry in doc["tensors"]:
    name = entry["name"]
    if name not in names:
      return result(f"tensor {name} of the manifest is not stored in {path}")
    shape, dtype = list(tensors.shape(name)), tensors.dtype(name).name
    if [shape, dtype] != [entry["shape"], entry["dtype"]]:
      return result(f"tensor {name} is stored as {dtype} {shape}; the manifest says {entry['dtype']} "
                    f"{entry['shape']}")
    if "scale_of" in entry:
      digest, found = build.scale_digest(tensors, name, piece_bytes)
    else:
      digest, found = tensors.digest(name, piece_bytes), None
    if digest != entry["sha256"]:
      return result(f"tensor {name} differs from the manifest: sha256 {digest[:16]}... stored, "
                    f"{entry['sha256'][:16]}... listed")
    if found is not None and found != [entry.get("zero"), entry.get("nan"), entry.get("inf")]:
      return result(f"scale tensor {name} has {found[0]} zero, {found[1]} NaN, {found[2]} inf scales; the "
                    f"manifest says {entry.get('zero')}, {entry.get('nan')}, {entry.get('inf')}")
  if extra:
    return result(f"{path} stores tensor {extra[0]}, which the manifest does not list")
  return result(None)
