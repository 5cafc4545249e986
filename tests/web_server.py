"""A local HTTP server for the tests of sources named by URL (`inspect_tool.storage.web`), started by the tests.

`WebServer(root)` serves the files under `root` at `url`, answering single byte ranges (`Range: bytes=A-B`,
`bytes=A-`) with 206 and `Content-Range` as RFC 9110 has it (416 past the end), and counts what it sends: `sent`
(body bytes per served path), `log` (one `Request` per GET: path, Range, status, Authorization, User-Agent). It can
be made to misbehave: `ranges = False` (whole files, 200, as `python -m http.server` does), `refuse[path prefix] =
status`, `cut` (paths whose bodies end half-way, the connection closed), `busy` (answers 503 this many times),
`stall` ("ranges": no byte range is ever answered; "data": no range into a safetensors file's tensor data, past
its header): the request waits, unanswered, until the server closes; `stalled` is set once one waits.

As a Hub (`hub = {repo id: Repo}`, for `HF_ENDPOINT`): `/{ORG}/{REPO}/resolve/{REVISION}/{PATH}` as the Hub answers
it (URLs as huggingface_hub's `hf_hub_url` makes them, refusals as its `hf_raise_for_status` reads them): revisions
map to directories; a `.safetensors` file is redirected (302) to the same server under another host name
(`localhost` for 127.0.0.1), as the Hub sends large files to its CDN; `X-Error-Code` RepoNotFound (401, as the Hub
answers an unknown or private repository), RevisionNotFound and EntryNotFound (404), GatedRepo (403); a repository
with a `token` wants `Authorization: Bearer TOKEN`.
"""

from __future__ import annotations

import collections
import dataclasses
import http.server
import os
import re
import threading
import urllib.parse


@dataclasses.dataclass
class Repo:
  revisions: dict  # revision -> local directory
  token: str | None = None  # the bearer token it wants (None: public)
  gated: bool = False


@dataclasses.dataclass
class Request:
  host: str
  path: str
  range: str | None
  status: int
  authorization: str | None
  user_agent: str | None


class WebServer(http.server.ThreadingHTTPServer):
  daemon_threads = True

  def __init__(self, root: str | None = None):
    super().__init__(("127.0.0.1", 0), _Handler)
    self.root, self.hub = root, {}
    self.ranges, self.refuse, self.cut, self.busy = True, {}, set(), 0
    self.stall, self.stalled, self.closing = None, threading.Event(), threading.Event()
    self.sent, self.log, self.lock = collections.Counter(), [], threading.Lock()
    self._thread = threading.Thread(target=self.serve_forever, daemon=True)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}"

  def __enter__(self):
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self.closing.set()
    self.shutdown()
    self.server_close()

  def reset(self) -> None:
    with self.lock:
      self.sent.clear()
      self.log.clear()

  def handle_error(self, request, client_address):
    pass  # a client that hangs up early (a refused range, a cut body) is expected here


_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  disable_nagle_algorithm = True

  def log_message(self, *args):  # quiet
    pass

  def _record(self, path: str, status: int) -> None:
    with self.server.lock:
      self.server.log.append(Request(self.headers.get("Host", ""), path, self.headers.get("Range"), status,
                                     self.headers.get("Authorization"), self.headers.get("User-Agent")))

  def _plain(self, path: str, status: int, headers: dict | None = None) -> None:
    self._record(path, status)
    self.send_response(status)
    for name, value in (headers or {}).items():
      self.send_header(name, value)
    self.send_header("Content-Length", "0")
    self.end_headers()

  def do_GET(self):  # pylint: disable=invalid-name
    path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
    server = self.server
    with server.lock:
      busy = server.busy > 0
      server.busy -= busy
    if busy:
      return self._plain(path, 503)
    for prefix, status in server.refuse.items():
      if path.startswith(prefix):
        return self._plain(path, status)
    if path.startswith("/cdn/"):
      repo_id, revision, name = urllib.parse.urlsplit(self.path).path[len("/cdn/"):].split("/", 2)
      repo = server.hub[urllib.parse.unquote(repo_id)]
      return self._file(path, os.path.join(repo.revisions[urllib.parse.unquote(revision)], urllib.parse.unquote(name)))
    if server.hub:
      return self._resolve(path)
    return self._file(path, os.path.join(server.root, path.lstrip("/")))

  def _resolve(self, path: str):
    """The Hub's `resolve` endpoint."""
    match = _RESOLVE.match(urllib.parse.urlsplit(self.path).path)
    repo = self.server.hub.get(urllib.parse.unquote(match.group(1))) if match else None
    if repo is None or (repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}" and
                        not repo.gated):
      return self._plain(path, 401, {"X-Error-Code": "RepoNotFound"})
    if repo.gated and self.headers.get("Authorization") != f"Bearer {repo.token}":
      return self._plain(path, 403, {"X-Error-Code": "GatedRepo"})
    revision, name = urllib.parse.unquote(match.group(2)), urllib.parse.unquote(match.group(3))
    if revision not in repo.revisions:
      return self._plain(path, 404, {"X-Error-Code": "RevisionNotFound"})
    local = os.path.join(repo.revisions[revision], name)
    if not os.path.isfile(local):
      return self._plain(path, 404, {"X-Error-Code": "EntryNotFound"})
    if name.endswith(".safetensors"):
      cdn = (f"http://localhost:{self.server.server_address[1]}/cdn/{urllib.parse.quote(match.group(1), safe='')}/"
             f"{match.group(2)}/{match.group(3)}")
      return self._plain(path, 302, {"Location": cdn, "X-Linked-Size": str(os.path.getsize(local))})
    return self._file(path, local)

  def _stalls(self, local: str, first: int) -> bool:
    if self.server.stall == "ranges":
      return True
    if self.server.stall != "data" or not local.endswith(".safetensors"):
      return False
    with open(local, "rb") as f:
      header = int.from_bytes(f.read(8), "little")
    return first >= 8 + header

  def _file(self, path: str, local: str):
    if not os.path.isfile(local):
      return self._plain(path, 404)
    size = os.path.getsize(local)
    asked = _RANGE.match((self.headers.get("Range") or "").strip()) if self.server.ranges else None
    if asked and self._stalls(local, int(asked.group(1))):
      self._record(path, 0)
      self.server.stalled.set()
      self.server.closing.wait()  # never answered while the server runs
      self.close_connection = True
      return None
    if asked:
      first = int(asked.group(1))
      last = min(int(asked.group(2)) if asked.group(2) else size - 1, size - 1)
      if first >= size:
        return self._plain(path, 416, {"Content-Range": f"bytes */{size}"})
      status, headers = 206, {"Content-Range": f"bytes {first}-{last}/{size}"}
    else:
      first, last, status, headers = 0, size - 1, 200, {}
    count = last - first + 1
    self._record(path, status)
    self.send_response(status)
    for name, value in headers.items():
      self.send_header(name, value)
    self.send_header("Content-Length", str(count))
    self.send_header("Accept-Ranges", "bytes" if self.server.ranges else "none")
    self.end_headers()
    sending = count // 2 if path in self.server.cut else count
    with open(local, "rb") as f:
      f.seek(first)
      while sending > 0:
        piece = f.read(min(sending, 1 << 16))
        try:
          self.wfile.write(piece)
        except (BrokenPipeError, ConnectionResetError):
          return None
        sending -= len(piece)
        with self.server.lock:
          self.server.sent[path] += len(piece)
    if path in self.server.cut:
      self.close_connection = True
    return None
