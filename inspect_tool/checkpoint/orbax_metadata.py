"""Lists an Orbax checkpoint's arrays (key, shape, dtype) from its metadata alone, never its array data.

Orbax's `_METADATA` JSON holds the pytree (key paths and value types); each array's global shape and dtype
live in its small zarr header (`<param name>/zarr.json`, or `.zarray` for zarr2) inside the checkpoint's
key-value store (OCDBT or plain files). Both are read with tensorstore's key-value API only: no jax, no
orbax import, and the cost grows with the number of arrays, not their size.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.checkpoint import locate
from inspect_tool.paramtree import tree
from inspect_tool.storage import paths
from inspect_tool.storage import remote

_SEQUENCE_KEY = 1
_STRING_TYPE = "string"


@dataclasses.dataclass(frozen=True)
class Entry:
  """One stored leaf: its raw pytree path (`str` for dict keys, `int` for sequence indices) and kind."""

  raw_key: tuple[str | int, ...]
  value_type: str

  @property
  def param_name(self) -> str:
    """Orbax's storage name: the path's parts joined with '.'."""
    return ".".join(str(k) for k in self.raw_key)


@dataclasses.dataclass(frozen=True)
class Listing:
  """A checkpoint's metadata: its location, its leaves and each leaf's raw Orbax path."""

  resolved: locate.ResolvedPath
  leaves: list[tree.Leaf]
  raw_keys: dict[tuple[str, ...], tuple[str | int, ...]]
  use_ocdbt: bool
  use_zarr3: bool

  def items(self) -> dict[str, list[tree.Leaf]]:
    """Leaves grouped by top-level checkpoint item (`params`, `nnx_aux`, `opt_state`, `step`, ...)."""
    groups: dict[str, list[tree.Leaf]] = {}
    for leaf in self.leaves:
      groups.setdefault(str(self.raw_keys[leaf.key][0]), []).append(leaf)
    return groups


def fold_key(parts) -> tuple[str, ...]:
  """MaxText's key rule: an integer/digit part joins the previous one (`layers`,`0` -> `layers_0`); a trailing
  `value` part is dropped."""
  out: list[str] = []
  for part in parts:
    text = str(part)
    if (isinstance(part, int) or text.isdigit()) and out:
      out[-1] = f"{out[-1]}_{text}"
    else:
      out.append(text)
  if len(out) > 1 and out[-1] == "value":
    out.pop()
  return tuple(out)


def _bad_metadata(items_dir: str, why: str) -> errors.CheckpointError:
  return errors.CheckpointError(f"{os.path.join(items_dir, locate.TREE_METADATA)}: corrupt Orbax metadata ({why})")


MAX_METADATA_BYTES = 256 << 20  # generous: one entry of a few hundred bytes per stored array


def read_tree_metadata(items_dir: str) -> tuple[list[Entry], dict[str, Any]]:
  """Parses `_METADATA`: the stored leaves (empty nodes skipped) and the file's other fields."""
  meta_path = paths.join(items_dir, locate.TREE_METADATA)
  raw = files.read_bytes(meta_path, MAX_METADATA_BYTES)
  if not raw.strip():
    raise _bad_metadata(items_dir, "empty file")
  doc = files.parse_json(raw, lambda why: _bad_metadata(items_dir, why))
  if not isinstance(doc, dict) or not isinstance(doc.get("tree_metadata"), dict):
    raise _bad_metadata(items_dir, "no 'tree_metadata' object")
  entries = []
  for name, node in doc["tree_metadata"].items():
    try:
      key_meta = node["key_metadata"]
      value_meta = node["value_metadata"]
    except (KeyError, TypeError) as e:
      raise _bad_metadata(items_dir, f"entry {name} lacks {e}") from None
    entry = _entry(key_meta, value_meta)
    if entry is None:
      raise _bad_metadata(items_dir, f"entry {name[:120]} has ill-typed key_metadata or value_metadata "
                          "(expected a list of {key, key_type} objects and a {value_type} object)")
    if not value_meta.get("skip_deserialize", False):
      entries.append(entry)
  return entries, {k: v for k, v in doc.items() if k != "tree_metadata"}


def _entry(key_meta: Any, value_meta: Any) -> Entry | None:
  """The entry of one `tree_metadata` node, or None when a field has the wrong type."""
  if not (isinstance(key_meta, list) and key_meta and isinstance(value_meta, dict)
          and isinstance(value_meta.get("value_type"), str)):
    return None
  raw_key: list[str | int] = []
  for part in key_meta:
    if not isinstance(part, dict) or not isinstance(part.get("key"), (str, int)) or isinstance(part["key"], bool):
      return None
    if part.get("key_type") == _SEQUENCE_KEY:
      if not str(part["key"]).isdigit():
        return None
      raw_key.append(int(part["key"]))
    else:
      raw_key.append(str(part["key"]))
  return Entry(tuple(raw_key), value_meta["value_type"])


def open_kvstore(items_dir: str, use_ocdbt: bool):
  """The key-value store holding the arrays of `items_dir` (tensorstore `KvStore`)."""
  # lazy: tensorstore, ~0.1 s to import: `diff` of an HF directory load this module without it
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  base = paths.kvstore_spec(items_dir)
  spec = {"driver": "ocdbt", "base": base} if use_ocdbt else base
  try:
    if not paths.is_remote(items_dir):
      return ts.KvStore.open(spec).result()
    return ts.KvStore.open(spec, context=remote.context()).result()
  except Exception as e:  # tensorstore raises ValueError/OSError subclasses with long messages
    if paths.is_remote(items_dir):
      raise remote.error(items_dir, e, tensorstore=True) from None
    raise errors.CheckpointError(f"{items_dir}: cannot open the Orbax array store ({errors.first_line(e)})") from None


def _dtype_name(header: dict[str, Any], zarr3: bool) -> str:
  if zarr3:
    dtype = header["data_type"]
    if isinstance(dtype, dict):
      dtype = dtype.get("name")
  else:
    dtype = header["dtype"]
    if isinstance(dtype, str) and dtype[:1] in "<>|=":
      return np.dtype(dtype).name
  if not isinstance(dtype, str):
    raise TypeError(f"data type {str(dtype)[:60]} is not a name")
  # lazy: tensorstore, ~0.1 s to import: `diff` of an HF directory load this module without it
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  try:
    ts.dtype(dtype)  # the names TensorStore can read (numpy's, bfloat16, float8_*, int4)
  except (ValueError, TypeError):
    raise ValueError(f"unknown data type {dtype[:60]!r}; accepted: a TensorStore data type such as float32, "
                     "bfloat16 or float8_e4m3fn") from None
  return dtype


def _array_headers(items_dir: str, entries: list[Entry], use_ocdbt: bool,
                   use_zarr3: bool) -> list[tuple[tuple[int, ...], str]]:
  """Reads every entry's zarr header concurrently: (shape, dtype name) per entry."""
  store = open_kvstore(items_dir, use_ocdbt)
  suffix = "/zarr.json" if use_zarr3 else "/.zarray"
  futures = [store.read((e.param_name + suffix).encode()) for e in entries]
  headers = []
  for entry, future in zip(entries, futures):
    try:
      result = future.result()
    except Exception as e:  # pylint: disable=broad-except
      if paths.is_remote(items_dir):
        raise remote.error(items_dir, e, tensorstore=True) from None
      raise errors.CheckpointError(
          f"{items_dir}: cannot read the array metadata of {entry.param_name} ({errors.first_line(e)})") from None
    if result.state != "value":
      raise errors.CheckpointError(
          f"{items_dir}: array metadata missing for {entry.param_name} (listed in {locate.TREE_METADATA}); "
          "the checkpoint is incomplete")

    def bad(why: str, name: str = entry.param_name) -> errors.CheckpointError:
      return errors.CheckpointError(f"{items_dir}: corrupt array metadata for {name}{suffix} ({why})")

    header = files.parse_json(bytes(result.value), bad)
    try:
      headers.append((files.dims(header["shape"], bad), _dtype_name(header, use_zarr3)))
    except (ValueError, KeyError, TypeError) as e:
      raise bad(errors.first_line(e) if not isinstance(e, KeyError) else f"no {e} field") from None
  return headers


def read_listing(path: str | locate.ResolvedPath) -> Listing:
  """Lists every stored leaf of the pytree of `path` (resolved here unless it already is), sorted by key."""
  resolved = path if isinstance(path, locate.ResolvedPath) else locate.resolve_orbax_path(path)
  items_dir = resolved.items_dir
  entries, info = read_tree_metadata(items_dir)
  manifest = files.kind(paths.join(items_dir, locate.OCDBT_MANIFEST))
  use_ocdbt = bool(info.get("use_ocdbt", manifest == "file"))
  use_zarr3 = bool(info.get("use_zarr3", False))
  files.check_tree(items_dir)  # a FIFO among the array files would block tensorstore's reads
  if use_ocdbt and manifest != "file":
    raise errors.CheckpointError(
        f"{items_dir}: {locate.OCDBT_MANIFEST} is missing (the metadata says OCDBT); the checkpoint is incomplete")
  headers = _array_headers(items_dir, [e for e in entries if e.value_type != _STRING_TYPE], use_ocdbt, use_zarr3)
  leaves, raw_keys = [], {}
  header_iter = iter(headers)
  for entry in entries:
    key = fold_key(entry.raw_key)
    if entry.value_type == _STRING_TYPE:
      leaf = tree.Leaf(key, (), "string")
    else:
      shape, dtype = next(header_iter)
      leaf = tree.Leaf(key, shape, dtype)
    leaves.append(leaf)
    raw_keys[key] = entry.raw_key
  return Listing(resolved, tree.sort_leaves(leaves), raw_keys, use_ocdbt, use_zarr3)


def read_leaves(path: str) -> list[tree.Leaf]:
  """Every leaf of the checkpoint at `path` (all items; filter with `leaf.item` / `leaf.is_param`)."""
  return read_listing(path).leaves
