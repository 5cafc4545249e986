"""A local Google Cloud Storage emulator (the `gcp-storage-emulator` test dependency) for gs:// tests.

`emulator()` starts one on 127.0.0.1 on a free port with an empty data directory and yields a `GcsEmulator`: its
`env` holds the variables Google's clients honour (`STORAGE_EMULATOR_HOST`) plus what tensorstore needs from it
(`TENSORSTORE_GCS_HTTP_URL`, a fake token), `upload(local_dir, "gs://bucket/prefix")` copies a directory tree in,
`listing("gs://bucket/prefix")` names the objects under a prefix. The `gcs` fixture (tests/conftest.py) is one
emulator per test session with the variables set in os.environ, so the tool, run in-process or as a subprocess with
`os.environ`, reads and writes gs:// paths against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

BUCKET = "inspect-tests"


def _free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@dataclasses.dataclass(frozen=True)
class GcsEmulator:
  url: str
  data_dir: Path

  @property
  def env(self) -> dict[str, str]:
    return {"STORAGE_EMULATOR_HOST": self.url, "TENSORSTORE_GCS_HTTP_URL": self.url,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator", "GOOGLE_CLOUD_PROJECT": "inspect-tests"}

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
def emulator(data_dir: Path):
  """Start an emulator storing under `data_dir`; stop it on exit."""
  port = _free_port()
  url = f"http://127.0.0.1:{port}"
  command = [sys.executable, "-m", "gcp_storage_emulator", "-d", str(data_dir), "start", "--host", "127.0.0.1",
             "--port", str(port), "--default-bucket", BUCKET, "-q"]
  if not _has_main():
    command = [str(Path(sys.executable).with_name("gcp-storage-emulator")), *command[3:]]
  proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  try:
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{url}/storage/v1/b/{BUCKET}", timeout=2).read()
        break
      except (urllib.error.URLError, ConnectionError) as error:
        if proc.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"the GCS emulator did not start: {proc.stderr.read().decode()[-2000:]}") from error
        time.sleep(0.1)
    yield GcsEmulator(url, data_dir)
  finally:
    proc.terminate()
    try:
      proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _has_main() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return importlib.util.find_spec("gcp_storage_emulator.__main__") is not None
