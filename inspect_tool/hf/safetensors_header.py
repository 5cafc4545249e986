"""Lists safetensors tensors (name, shape, dtype) from file headers alone, never reading tensor data.

A safetensors file starts with an 8-byte little-endian header length and that many bytes of JSON mapping
each tensor name to `{"dtype", "shape", "data_offsets"}`. Accepted inputs: one file, a directory of
`*.safetensors` files, or a sharded set described by `*.safetensors.index.json` (file or its directory).
Keys are the Hugging Face names split on '.'.
"""

from __future__ import annotations

import math
import os
import struct

from inspect_tool import errors
from inspect_tool.checkpoint import files
from inspect_tool.paramtree import tree
from inspect_tool.storage import commit
from inspect_tool.storage import paths
from inspect_tool.storage import remote
from inspect_tool.storage import web

# safetensors dtype tags -> numpy / ml_dtypes names.
DTYPES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "U16": "uint16", "I16": "int16", "U32": "uint32",
    "I32": "int32", "U64": "uint64", "I64": "int64", "F16": "float16", "BF16": "bfloat16", "F32": "float32",
    "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
    "F8_E8M0": "float8_e8m0fnu", "F6_E2M3": "float6_e2m3fn", "F6_E3M2": "float6_e3m2fn", "F4": "float4_e2m1fn",
}
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "U16": 16, "I16": 16, "U32": 32, "I32": 32, "U64": 64, "I64": 64, "F16": 16,
         "BF16": 16, "F32": 32, "F64": 64, "C64": 64, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F6_E2M3": 6,
         "F6_E3M2": 6, "F4": 4}
_FIELDS = frozenset({"dtype", "shape", "data_offsets"})
MAX_HEADER = 100 * 1024 * 1024  # the safetensors library's own limit
MAX_INDEX_BYTES = 64 << 20
INDEX_SUFFIX = ".safetensors.index.json"
WEB_READERS = 8  # shards whose headers are read at once over HTTP


def _bad(path: str, why: str) -> errors.CheckpointError:
  return errors.CheckpointError(f"{path}: not a valid safetensors file ({why})")


def _read_prefix(path: str) -> tuple[int, int, bytes]:
  """(file size, header length, header bytes) of a regular file (or gs:// object), without reading tensor data."""
  found = files.kind(path)
  if found == "missing":
    raise errors.CheckpointError(f"safetensors file does not exist: {path}")
  if found != "file":
    raise errors.CheckpointError(f"{path}: is not a regular file" + (" (a directory)" if found == "dir" else ""))
  if paths.is_remote(path):
    return _parse_prefix(path, remote.size(path), lambda start, count: remote.read_range(path, start, count))
  if paths.is_web(path):
    return _parse_prefix(path, web.size(path), lambda start, count: web.read_range(path, start, count, keep=True))
  try:
    with open(path, "rb") as f:

      def read(start: int, count: int) -> bytes:
        f.seek(start)
        return f.read(count)

      return _parse_prefix(path, os.fstat(f.fileno()).st_size, read)
  except OSError as e:
    raise errors.CheckpointError(f"cannot read {path}: {e.strerror or e}") from None


def _parse_prefix(path: str, size: int, read) -> tuple[int, int, bytes]:
  """The header of the file `path` of `size` bytes, `read(start, count)` giving its bytes."""
  prefix = read(0, 8) if size >= 8 else b""
  if len(prefix) < 8:
    raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
  (length,) = struct.unpack("<Q", prefix)
  if length > size - 8:
    raise _bad(path, f"header length {length} exceeds the file's {size - 8} remaining bytes (truncated file?)")
  if length > MAX_HEADER:
    raise _bad(path, f"header length {length} is over the {MAX_HEADER}-byte limit of safetensors headers")
  return size, length, read(8, length) if length else b""


def read_header(path: str) -> dict[str, dict]:
  """The tensor entries of one file's header (`__metadata__` left out), validated against the file size.

  Each entry is `{"dtype", "shape", "start"}`, `start` the file offset of the tensor's first data byte.

  Refused: unknown dtypes, shapes that are not lists of integers in [0, 2^63), offsets that are not
  integers, lie outside the data, overlap, or hold a different byte count than dtype × shape. The entries are
  parsed and checked one by one (`files.object_members`): a bad one is refused before the rest is parsed.
  """
  size, length, raw = _read_prefix(path)
  data_size = size - 8 - length
  entries, spans, last_end, ordered = {}, [], 0, True
  for name, entry in files.object_members(raw, lambda why: _bad(path, f"header is {why}")):
    if name == "__metadata__":
      continue
    if not (isinstance(entry, dict) and _FIELDS <= entry.keys()):
      raise _bad(path, f"entry {name!r} lacks dtype/shape/data_offsets")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in _BITS:
      raise _bad(path, f"tensor {name!r} has unknown dtype {str(dtype)[:40]!r}; known: {', '.join(_BITS)}")
    shape = entry["shape"]
    if type(shape) is not list or not all(type(d) is int and 0 <= d <= files.MAX_DIM for d in shape):
      shape = files.dims(shape, lambda why, n=name: _bad(path, f"tensor {n!r}: {why}"))  # names what is wrong
    offsets = entry["data_offsets"]
    if not (type(offsets) is list and len(offsets) == 2 and type(offsets[0]) is int and type(offsets[1]) is int):
      raise _bad(path, f"tensor {name!r} data_offsets {str(offsets)[:60]} is not a pair of integers")
    begin, end = offsets
    if not 0 <= begin <= end <= data_size:
      raise _bad(path, f"tensor {name!r} data_offsets [{begin}, {end}] exceed the {data_size} data bytes "
                       "(truncated file?)")
    expected = -(-math.prod(shape) * _BITS[dtype] // 8)
    if end - begin != expected:
      raise _bad(path, f"tensor {name!r} holds {end - begin} bytes; {dtype} {list(shape)} needs {expected}")
    spans.append((begin, end, name))
    ordered, last_end = ordered and begin >= last_end, max(last_end, end)  # in order: no overlap, no sort
    entries[name] = {"dtype": dtype, "shape": list(shape), "start": 8 + length + begin}  # start: file offset
  if not ordered:
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
      if begin < end:
        raise _bad(path, f"tensors {first!r} and {second!r} overlap in the data (offsets {begin} < {end})")
  return entries


def dtype_name(tag: str) -> str:
  """`F8_E4M3` -> `float8_e4m3fn`; an unknown tag is returned lower-cased."""
  return DTYPES.get(tag, tag.lower())


def _leaf(name: str, entry: dict) -> tree.Leaf:
  return tree.Leaf(tuple(name.split(".")), tuple(entry["shape"]), dtype_name(entry["dtype"]))


def _shard_path(index_path: str, directory: str, shard: object) -> str:
  """The shard file an index names: a file name inside the index's own directory, nothing else."""
  if not isinstance(shard, str) or not shard or os.path.isabs(shard) or ".." in shard.replace("\\", "/").split("/"):
    raise errors.CheckpointError(f"{index_path}: shard {str(shard)[:80]!r} is not a file name inside "
                                 f"{directory or '.'}; refused")
  path = paths.join(directory, shard)
  if paths.is_url(directory):  # objects or files served, no symbolic links
    return path
  real_dir = os.path.realpath(directory or ".")
  if os.path.commonpath([real_dir, os.path.realpath(path)]) != real_dir:
    raise errors.CheckpointError(f"{index_path}: shard {shard!r} leads outside {directory or '.'} "
                                 "(a symbolic link); refused")
  return path


def _read_index(index_path: str) -> list[tuple[str, str, dict]]:
  raw = files.read_bytes(index_path, MAX_INDEX_BYTES, "safetensors index")
  doc = files.parse_json(raw, lambda why: errors.CheckpointError(f"{index_path}: {why}"))
  weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
  if not isinstance(weight_map, dict) or not weight_map:
    raise errors.CheckpointError(f"{index_path}: no 'weight_map' object naming tensors and their shard files")
  directory = paths.parent(index_path) if paths.is_url(index_path) else os.path.dirname(index_path)
  shards: dict[str, list[str]] = {}
  checked: dict = {}  # shard name -> its path: checked once a name, not once a tensor (91,000 in DeepSeek-V3's index)
  for name, shard in weight_map.items():
    if not isinstance(shard, str) or shard not in checked:
      checked[shard] = _shard_path(index_path, directory, shard)  # raises for anything but a file name
    shards.setdefault(checked[shard], []).append(name)
  ordered = sorted(shards)
  missing = sorted(_relative(s, directory) for s, found in zip(ordered, _each(files.kind, ordered)) if found == "missing")
  if missing:
    shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
    raise errors.CheckpointError(f"{index_path}: {len(missing)} shard file(s) missing: {shown}")
  found, held = [], {}
  for shard_path, header in zip(ordered, _each(read_header, ordered)):
    names = shards[shard_path]
    absent = [n for n in names if n not in header]
    if absent:
      raise errors.CheckpointError(
          f"{shard_path}: lacks {len(absent)} tensor(s) the index assigns to it, e.g. {absent[0]!r}")
    _held_once(held, header, shard_path, weight_map, checked)
    found.extend((n, shard_path, header[n]) for n in names)
  known = {paths.normalize(shard) for shard in shards}  # and the files beside them that the index does not name
  others = [] if paths.is_web(index_path) else [
      f for f in files.list_suffix(directory or ".", ".safetensors") if paths.normalize(f) not in known]
  for other, header in zip(others, _each(read_header, others)):
    _held_once(held, header, other, weight_map, checked)
  return found


def _held_once(held: dict[str, str], header: dict, path: str, weight_map: dict, shard_paths: dict) -> None:
  """Records the tensors of `path`'s header in `held` (name -> file); a name another file holds too is refused,
  whatever the index says: which copy a reader takes would be up to the reader."""
  for name in header:
    first = held.setdefault(name, path)
    if first != path:
      named = shard_paths.get(weight_map.get(name))
      says = f"; the index names {named}" if named else "; the index names neither"
      raise errors.CheckpointError(f"tensor {name!r} is stored twice: in {first} and {path}{says}")


def _each(function, shard_paths: list[str]) -> list:
  """`function` of each shard, in order; over HTTP `WEB_READERS` at a time (each a round trip or two)."""
  if not shard_paths or not paths.is_web(shard_paths[0]):
    return [function(p) for p in shard_paths]
  return web.each(function, shard_paths, WEB_READERS)


def _relative(path: str, directory: str) -> str:
  if paths.is_url(path):
    return path[len(directory) + 1:]
  return os.path.relpath(path, directory or ".")


def _read_files(paths: list[str]) -> list[tuple[str, str, dict]]:
  seen: dict[str, str] = {}
  found = []
  for path in paths:
    for name, entry in read_header(path).items():
      if name in seen:
        raise errors.CheckpointError(f"tensor {name!r} is stored twice: in {seen[name]} and {path}")
      seen[name] = path
      found.append((name, path, entry))
  return found


def read_leaves(path: str) -> list[tree.Leaf]:
  """Every tensor of a safetensors file, directory or index, sorted by key.

  Raises:
    errors.CheckpointError: missing path or shard, no safetensors files, or a corrupt header.
  """
  return tree.sort_leaves(_leaf(name, entry) for name, _, entry in _tensor_entries(path))


def read_tensor_table(path: str) -> dict[str, tuple[str, dict]]:
  """Tensor name -> (file holding it, its `read_header` entry) for a safetensors file, directory or index.

  Raises:
    errors.CheckpointError: as `read_leaves`.
  """
  return {name: (file, entry) for name, file, entry in _tensor_entries(path)}


def _tensor_entries(path: str) -> list[tuple[str, str, dict]]:
  path = os.fspath(path)
  found = files.kind(path)
  if found == "missing":
    raise errors.CheckpointError(f"safetensors path does not exist: {path}")
  if found == "other":
    raise errors.CheckpointError(f"{path}: is not a regular file (FIFO, socket or device)")
  if found == "file":
    return _read_index(path) if path.endswith(".json") else _read_files([path])
  commit.check_published(path)  # gs://: a DST this tool is publishing is not read half written
  indexes = files.list_suffix(path, INDEX_SUFFIX)
  if len(indexes) > 1:
    names = ", ".join(paths.basename(i) for i in indexes)
    raise errors.CheckpointError(f"{path}: several safetensors indexes ({names}); pass one of them")
  if indexes:
    return _read_index(indexes[0])
  found_files = files.list_suffix(path, ".safetensors")
  if not found_files and paths.is_web(path):
    raise web.not_found(path)
  if not found_files:
    raise errors.CheckpointError(f"no *.safetensors files or {INDEX_SUFFIX} in {path}")
  return _read_files(found_files)
