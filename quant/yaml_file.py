"""Reads a user's YAML file (rule files here, model files in the tool) with one-line errors.

Hostile files are refused before they can cost time or memory: only regular files (a FIFO would block the
read), at most `MAX_BYTES`, UTF-8 text; the document is composed into nodes first and checked without
recursion: nesting at most `MAX_DEPTH`, at most `MAX_NODES` nodes once aliases are expanded (a "billion
laughs" bomb expands to 10^9), and mapping keys that are strings (`1: 2` or `null: x` name no key).
"""

from __future__ import annotations

import os
import stat

import yaml

MAX_BYTES = 128 << 10  # model and rule files are a few KiB; PyYAML composes ~100 KiB/s
MAX_DEPTH = 64
MAX_NODES = 100_000
_STR_TAG = "tag:yaml.org,2002:str"


def read_regular_file(path, where: str, error: type[Exception], max_bytes: int) -> bytes:
  """The bytes of `path`, refusing missing, non-regular, unreadable and oversized files with one line."""
  try:
    info = os.stat(path)
  except FileNotFoundError:
    raise error(f"{where} does not exist") from None
  except OSError as e:
    raise error(f"{where} cannot be read: {e.strerror or e}") from None
  if stat.S_ISDIR(info.st_mode):
    raise error(f"{where} is a directory, not a file")
  if not stat.S_ISREG(info.st_mode):
    raise error(f"{where} is not a regular file")
  if info.st_size > max_bytes:
    raise error(f"{where} is {info.st_size} bytes; files over {max_bytes} bytes are refused")
  try:
    with open(path, "rb") as f:
      data = f.read(max_bytes + 1)
  except OSError as e:
    raise error(f"{where} cannot be read: {e.strerror or e}") from None
  if len(data) > max_bytes:
    raise error(f"{where} is over {max_bytes} bytes; larger files are refused")
  return data


def _check_nodes(root, where: str, error: type[Exception]) -> None:
  """Depth, expanded size and key types of a composed YAML node graph, iteratively (aliases share nodes;
  a recursive alias runs into MAX_DEPTH)."""
  sizes: dict[int, int] = {}  # id(node) -> nodes once expanded
  stack = [(root, 1, False)]
  while stack:
    node, depth, done = stack.pop()
    if depth > MAX_DEPTH:
      raise error(f"{where} nests deeper than {MAX_DEPTH} levels (line {node.start_mark.line + 1})")
    children = []
    if isinstance(node, yaml.SequenceNode):
      children = list(node.value)
    elif isinstance(node, yaml.MappingNode):
      for key, value in node.value:
        if not (isinstance(key, yaml.ScalarNode) and key.tag == _STR_TAG):
          shown = key.value if isinstance(key, yaml.ScalarNode) else type(key).__name__
          raise error(f"{where}: key {shown!r} at line {key.start_mark.line + 1} is not a string; "
                      "keys must be names")
        children.append(value)
    if done:
      total = 1 + sum(sizes[id(c)] for c in children)
      if total > MAX_NODES:
        raise error(f"{where} expands to over {MAX_NODES} values (YAML aliases repeated); refused")
      sizes[id(node)] = total
      continue
    if id(node) in sizes:
      continue
    stack.append((node, depth, True))
    stack.extend((c, depth + 1, False) for c in children if id(c) not in sizes)


def load(path, where: str, error: type[Exception]):
  """The parsed YAML document of `path`; any problem with the file raises `error` naming `where`."""
  data = read_regular_file(path, where, error, MAX_BYTES)
  try:
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise error(f"{where} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1]!r})") from None
  return loads(text, where, error)


def loads(text: str, where: str, error: type[Exception], invalid: type[Exception] | None = None):
  """The parsed YAML document in `text` (a file's, or a value given on the command line), within the same
  bounds as a file: `MAX_BYTES`, `MAX_DEPTH`, `MAX_NODES`. Text that is not YAML raises `invalid` (default
  `error`) naming `where`; a bound exceeded raises `error`."""
  invalid = invalid or error
  if len(text) > MAX_BYTES:
    raise error(f"{where} is {len(text)} characters; over {MAX_BYTES} are refused")
  loader = yaml.SafeLoader(text)
  try:
    try:
      node = loader.get_single_node()
    except RecursionError:
      raise error(f"{where} nests deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as e:
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise invalid(f"{where} is not valid YAML: {first}") from None
    if node is None:
      return None
    _check_nodes(node, where, error)
    try:
      return loader.construct_document(node)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an integer of over 4300 digits
      first = str(e).splitlines()[0] if str(e) else type(e).__name__
      raise invalid(f"{where} is not valid YAML: {first[:200]}") from None
  finally:
    loader.dispose()
