"""Sources named by URL (`inspect_tool.storage.web`): tests/data/import/hf_small served over http:// by a local
server that honours byte ranges and counts what it sends (tests/web_server.py). Listings, keys and `diff` equal the
local directory's, reading the safetensors headers alone (every byte of them counted); `import` writes MaxText's own
converter's arrays (tests/data/import/maxtext_converted) reading by ranges no larger than a tensor; each failure is
one line and exit 2. hf:// sources: tests/test_web_hub.py."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys

import pytest

from test_gcs_read_hf import test_hf_listing_and_keys_are_the_local_ones as same_listing_as_local
from test_gcs_read_hf import test_one_shard_and_the_index_list_as_locally as same_files_as_local
from test_gcs_read_hf import test_import_from_gcs_writes_maxtexts_converter_arrays as same_import_as_maxtexts_converter
from test_gcs_read_hf import test_forward_from_gcs_equals_transformers as same_forward_as_transformers
from test_hf_keys import KEYS
from test_import_memory import LIMIT, WI_0, _import, hf_dir  # pylint: disable=unused-import
from web_server import WebServer
import memory_cgroup
from inspect_tool import errors
from inspect_tool.storage import paths
from inspect_tool.storage import web

from conftest import REPO
from conftest import DATA as DATA_DIR
from conftest import run_cli
DATA = os.path.join(DATA_DIR, "import")
HF = os.path.join(DATA, "hf_small")
SHARDS = sorted(n for n in os.listdir(HF) if n.endswith(".safetensors"))


@pytest.fixture
def server():
  """A fresh server (and so fresh URLs: what the tool keeps for the process is per URL) serving tests/data/import."""
  with WebServer(DATA) as running:
    yield running



def _header_bytes(name: str) -> int:
  with open(os.path.join(HF, name), "rb") as f:
    return 8 + struct.unpack("<Q", f.read(8))[0]


def _one_line(code, err, *needles):
  lines = err.strip().splitlines()
  assert code == 2 and len(lines) == 1, err
  assert "Traceback" not in err and all(n in lines[0] for n in needles), lines[0]
  return lines[0]


@pytest.mark.parametrize("extra", [[], ["--summary"], ["--format", "json"], ["--keys"]])
def test_hf_listing_and_keys_over_http_are_the_local_ones(server, capsys, extra):
  same_listing_as_local(f"{server.url}/hf_small", capsys, extra)  # the checks of the gs:// source


@pytest.mark.parametrize("command", [["hf", "--summary"], ["hf", "--keys"], ["diff", *KEYS.split()]])
def test_header_only_commands_read_the_headers_alone(server, capsys, command):
  code, out, err = run_cli(capsys, *command, "--path", f"{server.url}/hf_small")
  assert code == 0, err
  if command[0] == "diff":
    assert "AGREE" in out
  sizes = {f"/hf_small/{n}": os.path.getsize(os.path.join(HF, n)) for n in SHARDS}
  for request in server.log:  # safetensors only by byte ranges; the tool named in each request
    assert request.path not in sizes or request.range, request
    assert request.user_agent.startswith("inspect_checkpoint/"), request
  for name in SHARDS:  # each shard: its 8-byte length and its header, once
    assert server.sent[f"/hf_small/{name}"] == _header_bytes(name), name
  total = sum(server.sent.values())  # config.json and the index whole, besides
  assert total < 0.01 * sum(sizes.values()), (total, sum(sizes.values()))


def test_one_shard_and_the_index_by_url_list_as_locally(server, capsys):
  same_files_as_local(f"{server.url}/hf_small", capsys)  # the checks of the gs:// source


def test_a_single_model_safetensors_is_read_without_an_index(server, capsys, tmp_path):
  one = tmp_path / "one"
  one.mkdir()
  shutil.copy(os.path.join(HF, SHARDS[1]), one / "model.safetensors")
  with WebServer(str(tmp_path)) as single:
    there = run_cli(capsys, "hf", "--path", f"{single.url}/one", "--format", "json")
  local = run_cli(capsys, "hf", "--path", os.path.join(HF, SHARDS[1]), "--format", "json")
  assert local[0] == there[0] == 0, there[2]
  assert json.loads(there[1])["parameters"] == json.loads(local[1])["parameters"]


def test_import_over_http_writes_maxtexts_converter_arrays(server, capsys, tmp_path):
  same_import_as_maxtexts_converter(f"{server.url}/hf_small", capsys, tmp_path)  # the checks of the gs:// source
  largest = max(e["data_offsets"][1] - e["data_offsets"][0] for n in SHARDS
                for k, e in _header(n).items() if k != "__metadata__")
  ranges = [r.range for r in server.log if r.path.endswith(".safetensors")]
  assert all(ranges)  # never a whole shard: each read is a tensor (or rows of one) at most
  spans = [int(b) - int(a) + 1 for a, b in (r[len("bytes="):].split("-") for r in ranges)]
  assert max(spans) <= largest < os.path.getsize(os.path.join(HF, SHARDS[0])), (max(spans), largest)


def test_forward_over_http_equals_transformers(server, capsys, tmp_path):
  same_forward_as_transformers(f"{server.url}/hf_small", capsys, tmp_path)  # the checks of the gs:// source


def test_a_file_whose_size_changes_between_reads_is_refused(tmp_path):
  (tmp_path / "d").mkdir()
  shutil.copy(os.path.join(HF, SHARDS[0]), tmp_path / "d" / "model.safetensors")
  with WebServer(str(tmp_path)) as changing:
    url = f"{changing.url}/d/model.safetensors"
    assert web.size(url) == os.path.getsize(os.path.join(HF, SHARDS[0]))
    shutil.copy(os.path.join(HF, SHARDS[1]), tmp_path / "d" / "model.safetensors")  # replaced on the server
    with pytest.raises(errors.CheckpointError, match="its size changed from 2538048 to 2248344 bytes"):
      web.read_range(url, 8, 100)


def _header(name: str) -> dict:
  with open(os.path.join(HF, name), "rb") as f:
    return json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))


# Failures: one line, exit 2 ---------------------------------------------------------------------------------------

def test_a_directory_without_the_well_known_files_is_one_line(server, capsys):
  _one_line(*run_cli(capsys, "hf", "--path", f"{server.url}/nothing", "--summary")[::2],
            "neither model.safetensors.index.json nor model.safetensors is there")
  _one_line(*run_cli(capsys, "diff", *KEYS.split(), "--path", f"{server.url}/nothing")[::2], "neither")
  _one_line(*run_cli(capsys, "hf", "--path", f"{server.url}/hf_small/absent.safetensors")[::2],
            "does not exist", "absent.safetensors")


def test_a_shard_the_index_names_that_the_server_lacks_is_one_line(server, capsys, tmp_path):
  shutil.copytree(HF, tmp_path / "hf")
  os.remove(tmp_path / "hf" / SHARDS[1])
  with WebServer(str(tmp_path)) as partial:
    _one_line(*run_cli(capsys, "hf", "--path", f"{partial.url}/hf")[::2], "1 shard file(s) missing", SHARDS[1])


@pytest.mark.parametrize("status", [401, 403])
def test_a_refusal_is_one_line(server, capsys, status):
  server.refuse["/hf_small/model-"] = status
  _one_line(*run_cli(capsys, "hf", "--path", f"{server.url}/hf_small")[::2],
            f"permission denied by 127.0.0.1:{server.server_address[1]} (HTTP {status})")


def test_a_closed_port_is_one_line_after_bounded_tries(capsys):
  with socket.socket() as sock:  # a port nobody listens on
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  line = _one_line(*run_cli(capsys, "hf", "--path", f"http://127.0.0.1:{port}/hf_small", "--summary")[::2],
                   f"cannot reach 127.0.0.1:{port}", "gave up after 4 tries")
  assert "refused" in line.lower()


def test_a_server_without_range_support_is_refused_at_the_first_range(server, capsys):
  server.ranges = False
  _one_line(*run_cli(capsys, "hf", "--path", f"{server.url}/hf_small", "--summary")[::2],
            "does not honour byte ranges", "HTTP 200")
  asked = [r for r in server.log if r.path.endswith(".safetensors")]
  assert len(asked) <= len(SHARDS) and all(r.range == "bytes=0-7" for r in asked)  # each asked once, not again


def test_a_body_cut_short_is_one_line_after_bounded_tries(server, capsys):
  server.cut.add(f"/hf_small/{SHARDS[0]}")
  _one_line(*run_cli(capsys, "hf", "--path", f"{server.url}/hf_small/{SHARDS[0]}")[::2], "gave up after 4 tries")
  assert sum(r.path.endswith(SHARDS[0]) for r in server.log) == 4


def test_a_busy_server_is_asked_four_times_then_one_line(server, capsys):
  server.busy = 100
  _one_line(*run_cli(capsys, "hf", "--path", f"{server.url}/hf_small")[::2], "answered HTTP 503 after 4 tries")
  assert len(server.log) == 4


def test_a_server_that_does_not_answer_times_out(capsys, monkeypatch):
  monkeypatch.setenv("INSPECT_HTTP_TIMEOUT", "0.3")
  with socket.socket() as sock:  # accepts connections (the kernel does) and never answers
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    port = sock.getsockname()[1]
    _one_line(*run_cli(capsys, "hf", "--path", f"http://127.0.0.1:{port}/x/config.json")[::2],
              "did not answer within 0.3 s", "INSPECT_HTTP_TIMEOUT")


def _lying(tmp_path, header: dict, data: bytes, claimed: int | None = None) -> str:
  raw = json.dumps(header).encode()
  (tmp_path / "lies").mkdir(exist_ok=True)
  with open(tmp_path / "lies" / "model.safetensors", "wb") as f:
    f.write(struct.pack("<Q", claimed if claimed is not None else len(raw)) + raw + data)
  return str(tmp_path)


@pytest.mark.parametrize("case", ["length", "offsets"])
def test_a_truncated_or_lying_header_is_one_line(capsys, tmp_path, case):
  entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
  root = _lying(tmp_path, {"w": entry}, b"\0" * 8) if case == "offsets" else _lying(tmp_path, {"w": entry}, b"",
                                                                                      claimed=10**9)
  with WebServer(root) as lies:
    line = _one_line(*run_cli(capsys, "hf", "--path", f"{lies.url}/lies")[::2], "not a valid safetensors file")
    assert sum(lies.sent.values()) < 200  # a lying length is checked against the size before it is read
  assert ("exceed the 8 data bytes" if case == "offsets" else "exceeds the file's") in line


def test_a_failure_from_the_command_line_is_one_line_and_exit_2():
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  done = subprocess.run([sys.executable, "-m", "inspect_tool", "hf", "--path", f"http://127.0.0.1:{port}/d",
                         "--summary"], capture_output=True, text=True, cwd=REPO, check=False, timeout=120)
  assert done.returncode == 2 and done.stdout == ""
  assert len(done.stderr.strip().splitlines()) == 1 and "cannot reach" in done.stderr, done.stderr


def test_url_paths_share_the_vocabulary_of_gs_paths():
  assert paths.normalize("https://h:8/a//b/../c/") == "https://h:8/a/c"
  assert paths.join("http://h/d/", "config.json") == "http://h/d/config.json"
  assert paths.parent("hf://org/repo@v1/sub/model.safetensors") == "hf://org/repo@v1/sub"
  assert paths.basename("https://h/d/model.safetensors.index.json") == "model.safetensors.index.json"
  assert paths.absolute("HTTPS://h/d") == "https://h/d" and paths.is_web("hf://o/r") and not paths.is_remote("hf://o/r")
  assert paths.normalize("gs://b/x/../y") == "gs://b/y" and paths.parent("gs://b/x/y") == "gs://b/x"


def _digests(path: str) -> dict[str, str]:
  """sha256 of every array of the Orbax checkpoint at `path` (DST/0/items), read one at a time with tensorstore."""
  import hashlib  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  base = paths.kvstore_spec(paths.join(path, "0", "items"))
  kv = ts.KvStore.open({"driver": "ocdbt", "base": base}).result()
  names = sorted({k.decode().rsplit("/zarr.json", 1)[0] for k in kv.list().result() if k.endswith(b"/zarr.json")})
  return {n: hashlib.sha256(np.asarray(ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base,
                                                                                  "path": n + "/"}},
                                               open=True).result().read().result()).tobytes()).hexdigest()
          for n in names}


@pytest.mark.slow  # a memory cgroup and a 1.3 GB directory: run once, on the primary stack (.ci/run)
@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_import_over_http_stays_within_a_memory_cgroup_smaller_than_each_expert_stack(hf_dir, tmp_path):
  """tests/test_import_memory.py's bound, the directory served over http:// (with the index a directory over HTTP
  is read through): peak RSS under --max-memory, and the arrays of a local import."""
  weight_map = {}
  for name in sorted(os.listdir(hf_dir)):
    if name.endswith(".safetensors"):
      with open(os.path.join(hf_dir, name), "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
      weight_map.update({key: name for key in header if key != "__metadata__"})
  with open(os.path.join(hf_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with WebServer(os.path.dirname(hf_dir)) as served, memory_cgroup.limited(LIMIT, "import_web") as cgroup:
    done, peak = _import(f"{served.url}/{os.path.basename(hf_dir)}", str(tmp_path / "web"), "--max-memory",
                         str(LIMIT), cgroup=cgroup)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 100 * 10**6 < cgroup.charged <= LIMIT and peak is not None and peak <= LIMIT, (cgroup.charged, peak)
  assert json.loads(done.stdout)["arrays"][WI_0]["shape"][0] * 2 * 1024 * 1536 * 4 > LIMIT
  local, _ = _import(hf_dir, str(tmp_path / "local"), "--max-memory", str(LIMIT))
  assert local.returncode == 0, local.stderr[-3000:]
  assert _digests(str(tmp_path / "web")) == _digests(str(tmp_path / "local"))
