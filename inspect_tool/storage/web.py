"""Read-only checkpoint sources named by URL: safetensors directories over HTTP(S) and on the Hugging Face Hub.

`https://HOST/DIR` (and `http://`, for mirrors and local servers) and `hf://ORG/REPO[@REVISION][/DIR]`
(`storage.web_hub`). A directory cannot be listed over HTTP: it is read through `model.safetensors.index.json`,
else a single `model.safetensors` (`list_suffix`), with `config.json` beside; a URL ending in `.safetensors` or
`.json` names that file. Safetensors files are read by byte ranges (`read_range`; the first `PROBE` bytes, the
header's length, are kept with the file's size), so that a header-only listing moves the headers alone; JSON files
whole, at most `MAX_JSON` bytes, kept for the process (several readers ask for `config.json`), as are headers. A file whose size
changes between two reads is refused. Every GET goes through `storage.web_http`.
"""

from __future__ import annotations

import queue
import threading
import time

from inspect_tool import process_state
from inspect_tool import errors
from inspect_tool.storage import paths
from inspect_tool.storage import web_http
from inspect_tool.storage import web_hub

MAX_JSON = 64 << 20
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
WELL_KNOWN = {".safetensors.index.json": INDEX, ".safetensors": SINGLE}
PROBE = 8  # bytes asked by the first read of a safetensors file: its header's length
REDIRECT_TTL_S = 600.0  # a redirect's target is asked directly this long (the Hub's signed URLs last an hour)

_lock = threading.Lock()
_whole_files: dict[str, tuple[int | None, bytes | None]] = {}  # path -> (size, bytes); (None, None): no such file
_probes: dict[str, tuple[int | None, bytes]] = {}  # path -> (size, its first bytes); (None, b""): no such file
_redirects: dict[str, tuple[str, float]] = {}  # path -> (where its URL redirected to, when)
_kept: dict[tuple[str, int, int], bytes] = {}  # (path, start, length) -> bytes: the ranges read with `keep`


def _forget() -> None:
  with _lock:
    for cache in (_whole_files, _probes, _redirects, _kept):
      cache.clear()


process_state.declare(f"{__name__}:_whole_files,_probes,_redirects,_kept", process_state.CACHE,
                      lambda: len(_whole_files) + len(_probes) + len(_redirects) + len(_kept), _forget)


def _get(path: str, **kwargs) -> web_http.Answer:
  """GETs the file `path`; a missing file comes back with status 404, any other refusal is one line. Where a
  redirect led (the Hub's CDN, a mirror's object store: signed URLs) is asked directly for `REDIRECT_TTL_S`, without
  the token (a refusal there goes back to the start): one round trip a read, and the Hub's resolve rate limit is
  spent once a file."""
  with _lock:
    moved, since = _redirects.get(path, (None, 0.0))
  if moved and time.monotonic() - since < REDIRECT_TTL_S:
    answer = web_http.get(moved, path, **kwargs)
    if answer.status < 300 or answer.status == 416:
      return answer
  if path.lower().startswith(web_hub.SCHEME):
    url, headers = web_hub.request(path)
  else:
    url, headers = path, {}
  answer = web_http.get(url, path, headers=headers, **kwargs)
  status = answer.status
  if status < 300 or status == 416:
    with _lock:
      if answer.moved_to:
        _redirects[path] = (answer.moved_to, time.monotonic())
      else:
        _redirects.pop(path, None)
    return answer
  if path.lower().startswith(web_hub.SCHEME):
    refused = web_hub.error(path, status, answer.headers, "authorization" in {k.lower() for k in headers})
    if refused is not None:
      raise refused
  if status in (404, 410):
    return web_http.Answer(404, answer.headers, None)
  where = web_http.host(url)
  if status in (401, 403):
    raise errors.CheckpointError(f"{path}: permission denied by {where} (HTTP {status}); accepted: a URL this "
                                 "machine may read (credentials for a host go in ~/.netrc)")
  raise errors.CheckpointError(f"{path}: {where} answered HTTP {status}" +
                               (f" after {web_http.RETRIES + 1} tries" if status in web_http.RETRY_STATUS else ""))


def _whole(path: str) -> tuple[int | None, bytes | None]:
  """(size, bytes) of the small file `path`, read once for the process; bytes None when over `MAX_JSON`."""
  with _lock:
    if path in _whole_files:
      return _whole_files[path]
  answer = _get(path, max_bytes=MAX_JSON)
  found = (None, None) if answer.status == 404 else (
      answer.total, bytes(answer.data) if answer.data is not None and answer.total <= MAX_JSON else None)
  with _lock:
    _whole_files[path] = found
  return found


def _probe(path: str) -> tuple[int | None, bytes]:
  """(size, first `PROBE` bytes) of the file `path`, asked once for the process; size None: no such file."""
  with _lock:
    if path in _probes:
      return _probes[path]
  answer = _get(path, start=0, stop=PROBE)
  if answer.status == 404:
    found = (None, b"")
  elif answer.total is None:
    raise errors.CheckpointError(f"{path}: the server does not tell the file's size (Content-Range "
                                 f"{errors.shown(answer.headers.get('content-range'))}); a safetensors header is "
                                 "checked against it")
  else:
    found = (answer.total, bytes(answer.data))
  with _lock:
    _probes[path] = found
  return found


def kind(path: str) -> str:
  """'file' or 'missing' for a URL ending in `.json` or `.safetensors` (asked of the server), else 'dir'."""
  name = paths.basename(path)
  if name.endswith(".json"):
    return "missing" if _whole(path)[0] is None else "file"
  if name.endswith(".safetensors"):
    return "missing" if _probe(path)[0] is None else "file"
  if path.lower().startswith(web_hub.SCHEME):
    web_hub.parse(path)
    web_hub.check_online(path)
  return "dir"


def size(path: str) -> int:
  """The byte size of the file `path`."""
  found = _probe(path)[0]
  if found is None:
    raise errors.CheckpointError(f"{path}: no such file (HTTP 404)")
  return found


def read_range(path: str, start: int, length: int, keep: bool = False) -> bytes | bytearray:
  """`length` bytes of the file `path` from byte `start` (fewer at its end), by one ranged GET; with `keep`, kept for
  the process (a safetensors header: the listing, the keys and the tensor table of one command each read it)."""
  if length <= 0:
    return b""
  with _lock:
    if (path, start, length) in _kept:
      return _kept[path, start, length]
  known, first = _probe(path)
  if known is None:
    raise errors.CheckpointError(f"{path}: no such file (HTTP 404)")
  if start + length <= len(first):
    return first[start:start + length]
  answer = _get(path, start=start, stop=start + length)
  if answer.status == 404:
    raise errors.CheckpointError(f"{path}: no such file (HTTP 404); it was there when first read")
  if answer.total is not None and answer.total != known:
    raise errors.CheckpointError(f"{path}: its size changed from {known} to {answer.total} bytes while it was read "
                                 "(replaced on the server?); read it again")
  if keep:
    with _lock:
      _kept[path, start, length] = bytes(answer.data)
  return answer.data


def read_bytes(path: str, max_bytes: int, what: str = "") -> bytes:
  """The whole file `path` of at most `max_bytes`; otherwise one line naming it (worded as for a local file)."""
  label = f"{what} {path}".strip()
  total, data = _whole(path)
  if total is None:
    raise errors.CheckpointError(f"{label} does not exist (HTTP 404)")
  if total > max_bytes or data is None:
    raise errors.CheckpointError(f"{label} is {total} bytes; files over {max_bytes} bytes are refused")
  return data


def list_suffix(directory: str, suffix: str) -> list[str]:
  """The well-known file of `suffix` in `directory` (`WELL_KNOWN`), when the server has it: a directory over HTTP
  cannot be listed."""
  name = WELL_KNOWN.get(suffix)
  if name is None:
    return []
  path = paths.join(directory, name)
  return [path] if kind(path) == "file" else []


def not_found(directory: str) -> errors.CheckpointError:
  """The line for a directory URL that holds neither well-known file."""
  return errors.CheckpointError(f"{directory}: neither {INDEX} nor {SINGLE} is there (HTTP 404 for both); a directory "
                                "over HTTP is read through these names: name another index or .safetensors file in "
                                "the URL")


def each(function, items: list, workers: int) -> list:
  """`function` of each item, in order, `workers` at a time in daemon threads. The first failure is raised as soon as
  it comes, without waiting on reads still in flight: a server that never answers one of them holds neither the
  error line, nor a stop, nor the process's exit (a thread pool's workers are joined at exit)."""
  results, done, lock, todo = [None] * len(items), queue.Queue(), threading.Lock(), iter(enumerate(items))
  failed = threading.Event()

  def work():
    while not failed.is_set():
      with lock:
        index, item = next(todo, (None, None))
      if index is None:
        return
      try:
        done.put((index, function(item), None))
      except BaseException as e:  # pylint: disable=broad-except  (raised in the caller's thread)
        failed.set()
        done.put((index, None, e))

  for _ in range(min(workers, len(items))):
    threading.Thread(target=work, name="web-read", daemon=True).start()
  for _ in items:
    index, value, error = done.get()
    if error is not None:
      raise error
    results[index] = value
  return results

