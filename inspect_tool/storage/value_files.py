"""Where a stored value lies on a local disk: the data file and byte offset of one key of a `file` kvstore, or of an
OCDBT database on one (found through its B-tree, `tensorstore.ocdbt.dump`), so that a reader can map the file
itself instead of asking tensorstore for it window by window. Anything else (an object store, an inline value, a
location not in the form expected) is None, and the caller reads through the kvstore as before.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import NamedTuple

import tensorstore as ts

from inspect_tool import process_state

MAX_DEPTH = 16  # B-tree levels walked at most (Orbax's databases have one: 100 MB nodes)
CACHED_NODES = 4  # B-tree nodes kept, decoded, for the next lookup (a node's location names immutable bytes)

_nodes: collections.OrderedDict = collections.OrderedDict()  # (database directory, location) -> decoded node
_nodes_lock = threading.Lock()


def _forget_nodes() -> None:
  with _nodes_lock:
    _nodes.clear()


process_state.declare(f"{__name__}:_nodes", process_state.CACHE, lambda: len(_nodes), _forget_nodes)


class Located(NamedTuple):
  """A value's bytes: `nbytes` of them from byte `offset` of the local file `path`."""

  path: str
  offset: int
  nbytes: int


def locate(kvstore, key: str) -> Located | None:
  """Where the value of `key` in `kvstore` (a tensorstore KvStore) lies in a local file; None when it is not in one
  (see the module) or cannot be told."""
  try:
    spec = kvstore.spec().to_json()
    if spec.get("driver") == "file":
      path = spec["path"] + key
      return Located(path, 0, os.path.getsize(path))
    base = kvstore.base
    if spec.get("driver") != "ocdbt" or base is None:
      return None
    root = base.spec().to_json()
    if root.get("driver") != "file":
      return None
    found = _leaf_entry(base, root["path"], (kvstore.path + key).encode())
  except Exception:  # pylint: disable=broad-except
    return None
  return _parse_value(root["path"], found) if found else None


def _leaf_entry(base, directory: str, key: bytes) -> dict | None:
  """The leaf entry of `key` in the OCDBT database on `base` (in `directory`): from the root of its manifest's
  latest version down, at each level the child whose first key is the last not after `key` (keys in a node are
  relative to the prefix of the path taken)."""
  versions = ts.ocdbt.dump(base).result().get("versions") or []
  location = versions[-1].get("root", {}).get("location") if versions else None
  prefix = b""
  for _ in range(MAX_DEPTH):
    if not location:
      return None
    node = _node(base, directory, location)
    entries = node.get("entries") or []
    if node.get("height") == 0:
      return next((e for e in entries if prefix + e.get("key", b"") == key), None)
    below = [e for e in entries if prefix + e.get("key", b"") <= key]
    if not below:
      return None
    prefix += below[-1].get("subtree_common_prefix") or b""
    location = below[-1].get("location")
  return None


def _node(base, directory: str, location: str) -> dict:
  """The decoded B-tree node at `location`, from the last `CACHED_NODES` looked up when there (the arrays of one
  checkpoint share their nodes)."""
  with _nodes_lock:
    node = _nodes.get((directory, location))
    if node is not None:
      _nodes.move_to_end((directory, location))
      return node
  node = ts.ocdbt.dump(base, location).result()
  with _nodes_lock:
    _nodes[(directory, location)] = node
    while len(_nodes) > CACHED_NODES:
      _nodes.popitem(last=False)
  return node


def _parse_value(root: str, entry: dict) -> Located | None:
  """`value:BASE_PATH:RELATIVE_PATH:OFFSET:LENGTH` (an indirect value) under the database's directory `root`."""
  ref = entry.get("indirect_value")
  if not isinstance(ref, str) or not ref.startswith("value:"):
    return None
  where, offset, nbytes = ref[len("value:"):].rsplit(":", 2)
  base_path, _, relative = where.partition(":")
  if not relative or not offset.isdigit() or not nbytes.isdigit():
    return None
  return Located(os.path.join(root, base_path, relative), int(offset), int(nbytes))
