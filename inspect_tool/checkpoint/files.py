"""Reading checkpoint metadata files safely: regular files only, bounded sizes, strict JSON, checked shapes.

A FIFO or device in place of a metadata file would block the read, deeply nested JSON exhausts Python's
recursion limit, and `Infinity`, `NaN` or `1e400` are not sizes: each becomes one `CheckpointError` line
naming the file.
"""

from __future__ import annotations

import glob
import json
import os
import re
import stat
from typing import Any, Callable, Iterator

from inspect_tool import errors
from inspect_tool.storage import paths
from inspect_tool.storage import remote
from inspect_tool.storage import web
from quant import yaml_file

MAX_DIM = 2**63 - 1
MAX_JSON_DEPTH = 200


def kind(path: str) -> str:
  """'file', 'dir', 'missing' or 'other' (FIFO, socket, device); permission problems raise one line.
  A gs:// path is asked of Cloud Storage (`storage.remote.kind`), a URL of its server (`storage.web.kind`)."""
  if paths.is_remote(path):
    return remote.kind(path)
  if paths.is_web(path):
    return web.kind(path)
  try:
    mode = os.stat(path).st_mode
  except FileNotFoundError:
    return "missing"
  except NotADirectoryError:
    return "missing"
  except PermissionError:
    raise errors.CheckpointError(f"{path}: permission denied") from None
  except OSError as e:
    raise errors.CheckpointError(f"{path}: cannot be examined ({e.strerror or e})") from None
  if stat.S_ISREG(mode):
    return "file"
  return "dir" if stat.S_ISDIR(mode) else "other"


def read_bytes(path: str, max_bytes: int, what: str = "") -> bytes:
  """The bytes of a regular file (or gs:// object) of at most `max_bytes`; anything else is a one-line
  `CheckpointError`."""
  if paths.is_remote(path):
    return remote.read_bytes(path, max_bytes, what)
  if paths.is_web(path):
    return web.read_bytes(path, max_bytes, what)
  return yaml_file.read_regular_file(path, f"{what} {path}".strip(), errors.CheckpointError, max_bytes)


def list_suffix(directory: str, suffix: str) -> list[str]:
  """The entries directly in `directory` whose names end with `suffix` (dot-files left out, as `glob` does), sorted;
  in a gs:// prefix, its objects; at a URL, the well-known file of `suffix` (`storage.web.list_suffix`)."""
  if paths.is_web(directory):
    return web.list_suffix(directory, suffix)
  if paths.is_remote(directory):
    return [p for p in remote.glob(directory, suffix) if not paths.basename(p).startswith(".")]
  return sorted(glob.glob(os.path.join(glob.escape(directory), "*" + suffix)))


def _no_constant(name: str) -> Any:
  raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
  value = float(text)
  if value in (float("inf"), float("-inf")):
    raise ValueError(f"{text} overflows a float")
  return value


class _DuplicateKey(ValueError):
  """A JSON object names a key twice (which value counts is up to the reader: refused)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
  doc = dict(pairs)
  if len(doc) != len(pairs):
    seen = set()
    for key, _ in pairs:
      if key in seen:
        raise _DuplicateKey(key)
      seen.add(key)
  return doc


def _decoder() -> json.JSONDecoder:
  return json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)


def _refusal(e: Exception, raw: bytes | str, bad: Callable[[str], Exception]) -> Exception:
  """`bad(why)` for what the strict parser raised."""
  if isinstance(e, _DuplicateKey):
    return bad(f"ambiguous JSON: key {e.args[0][:200]!r} appears twice in one object")
  if isinstance(e, RecursionError):
    return bad("JSON nested too deeply")
  if isinstance(e, UnicodeDecodeError):
    return bad("not UTF-8 JSON")
  if isinstance(e, json.JSONDecodeError):
    truncated = e.pos >= len(e.doc.rstrip()) - 1 or e.msg.startswith("Unterminated")
    why = "truncated JSON" if truncated else "not valid JSON"
    return bad(f"{why}: {e.msg} at byte {e.pos} of {len(raw)}")
  return bad(f"not valid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}")


def parse_json(raw: bytes | str, bad: Callable[[str], Exception]) -> Any:
  """Strict JSON (no NaN/Infinity, finite floats, nesting <= MAX_JSON_DEPTH, no key twice in one object); `bad(why)`
  is raised otherwise."""
  try:
    doc = json.loads(raw, parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)
  except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, _DuplicateKey are ValueErrors
    raise _refusal(e, raw, bad) from None
  if _depth(doc) > MAX_JSON_DEPTH:
    raise bad(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
  return doc


_SPACE = re.compile(r"[ \t\n\r]*")
_SPACES = " \t\n\r"


def _skip(text: str, i: int) -> int:
  """The index of the first character at or after `i` that is not JSON whitespace."""
  return _SPACE.match(text, i).end() if text[i:i + 1] in _SPACES and i < len(text) else i


def object_members(raw: bytes | bytearray | str, bad: Callable[[str], Exception]) -> Iterator[tuple[str, Any]]:
  """The members (key, value) of the JSON object `raw`, parsed as `parse_json` parses (strict numbers, no key twice)
  one at a time, so that a reader refuses the first bad member without parsing the rest (a safetensors header of
  100 MiB holds 1.5 million). `bad(why)` is raised for bad JSON, and "not a JSON object" for another value. The
  values are not measured for depth: a reader keeps only the fields it checks."""
  try:
    text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
    i = _skip(text, 0)
    if text[i:i + 1] != "{":
      parse_json(raw, bad)  # bad JSON is named as such; valid JSON that starts otherwise is no object
      raise bad("not a JSON object")
    value_at, key_at, seen = _decoder().scan_once, json.decoder.scanstring, set()
    i = _skip(text, i + 1)
    if text[i:i + 1] == "}":
      i += 1
    else:
      while True:  # compact JSON (as the safetensors library writes it) takes no `_skip` call below
        if text[i:i + 1] != '"':
          raise json.JSONDecodeError("Expecting property name enclosed in double quotes", text, i)
        key, i = key_at(text, i + 1)
        if text[i:i + 1] != ":":
          i = _skip(text, i)
          if text[i:i + 1] != ":":
            raise json.JSONDecodeError("Expecting ':' delimiter", text, i)
        i += 1
        if text[i:i + 1] in _SPACES:
          i = _skip(text, i)
        try:
          value, i = value_at(text, i)
        except StopIteration as e:
          raise json.JSONDecodeError("Expecting value", text, e.value) from None
        if key in seen:
          raise _DuplicateKey(key)
        seen.add(key)
        yield key, value
        if text[i:i + 1] not in ",}":
          i = _skip(text, i)
        if text[i:i + 1] == "}":
          i += 1
          break
        if text[i:i + 1] != ",":
          raise json.JSONDecodeError("Expecting ',' delimiter", text, i)
        i = _skip(text, i + 1)
    if _skip(text, i) != len(text):
      raise json.JSONDecodeError("Extra data", text, _skip(text, i))
  except (ValueError, RecursionError) as e:
    raise _refusal(e, raw, bad) from None


def _depth(doc: Any) -> int:
  deepest, stack = 0, [(doc, 1)]
  while stack:
    node, depth = stack.pop()
    deepest = max(deepest, depth)
    if depth > MAX_JSON_DEPTH:
      break
    children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
    stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
  return deepest


def dims(value: Any, bad: Callable[[str], Exception]) -> tuple[int, ...]:
  """A shape: a list of integers in [0, 2^63); anything else raises `bad(why)` naming the value."""
  if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
    raise bad(f"shape {str(value)[:80]} is not a list of integers")
  outside = [d for d in value if not 0 <= d <= MAX_DIM]
  if outside:
    raise bad(f"shape {str(value)[:80]} has dimension {str(outside[0])[:24]} outside [0, 2^63)")
  return tuple(value)


def check_tree(root: str, max_entries: int = 1_000_000) -> None:
  """Every entry under `root` is a directory or a regular file (a FIFO would block a reader), readable.
  An object store holds objects only: a gs:// `root` passes."""
  if paths.is_remote(root):
    return
  stack, seen = [root], 0
  while stack:
    directory = stack.pop()
    try:
      entries = list(os.scandir(directory))
    except PermissionError:
      raise errors.CheckpointError(f"{directory}: permission denied") from None
    except OSError as e:
      raise errors.CheckpointError(f"{directory}: cannot be listed ({e.strerror or e})") from None
    for entry in entries:
      seen += 1
      if seen > max_entries:
        raise errors.CheckpointError(f"{root}: over {max_entries} files; not an Orbax checkpoint directory")
      found = kind(entry.path)
      if found == "dir" and not entry.is_symlink():
        stack.append(entry.path)
      elif found == "other":
        raise errors.CheckpointError(f"{entry.path}: is not a regular file (FIFO, socket or device)")
