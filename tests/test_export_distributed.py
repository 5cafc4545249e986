"""`export` under jax.distributed: 2 processes x 2 CPU devices on 127.0.0.1 write one Orbax checkpoint with the
same arrays, byte for byte, as one process, and its manifest hashes every array; `diff` runs the same way."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
CKPT = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full", "quantize_mtp=true"]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _env(devices: int):
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")


def _run_processes(command: list[str], n: int = 2, timeout: int = 240, envs: list[dict] | None = None):
  """Runs `command` as the `n` processes of a job (`envs`: variables of each process's own)."""
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-m", "inspect_tool", *command, "--coordinator", f"127.0.0.1:{port}",
                             "--num-processes", str(n), "--process-id", str(i)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(_env(2), **(envs or [{}] * n)[i]))
           for i in range(n)]
  return finish(procs, timeout)


def finish(procs, timeout: int = 240) -> list[tuple[int, str, str]]:
  """(exit code, stdout, stderr) of every process of a job, waited for; any still running afterwards is killed."""
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=timeout)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outs


def _arrays(path: str) -> dict:
  """Every array of the Orbax checkpoint at `path` (DST/0/items; local or gs://), read with tensorstore alone."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel
  from inspect_tool.storage import paths  # pylint: disable=import-outside-toplevel

  base = paths.kvstore_spec(paths.join(path, "0", "items"))
  context = ts.Context()  # one database: its manifest and B-tree nodes fetched once, not once per array
  kv = ts.KvStore.open({"driver": "ocdbt", "base": base}, context=context).result()
  names = sorted({k.decode().rsplit("/zarr.json", 1)[0] for k in kv.list().result() if k.endswith(b"/zarr.json")})
  opened = [ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": base, "path": n + "/"}}, open=True,
                    context=context) for n in names]
  reads = [future.result().read() for future in opened]  # all arrays in flight at once
  return {n: np.asarray(read.result()) for n, read in zip(names, reads)}


@pytest.mark.slow  # stress: a multi-process job (.ci/run: once, on the primary stack)
def test_two_processes_write_the_same_checkpoint_as_one(tmp_path):
  one, two = tmp_path / "one", tmp_path / "two"
  single = subprocess.run([sys.executable, "-m", "inspect_tool", "export", *TOKENS, "--checkpoint", CKPT,
                           "--output", str(one), "--no-validate", "--quiet"], capture_output=True, text=True,
                          cwd=REPO, env=_env(2), check=False, timeout=240)
  assert single.returncode == 0, single.stderr[-2000:]
  outs = _run_processes(["export", *TOKENS, "--checkpoint", CKPT, "--output", str(two), "--no-validate"])
  for code, _, err in outs:
    assert code == 0, err[-3000:]
  assert "\nwrote " in outs[0][1] and outs[1][1] == ""  # process 0 reports for the job; stdout is data only
  a, b = _arrays(str(one)), _arrays(str(two))
  assert sorted(a) == sorted(b) and len(a) == 86
  for name in a:
    assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name
  processes = sorted(d for d in os.listdir(two / "0" / "items") if d.startswith("ocdbt.process_"))
  assert processes == ["ocdbt.process_0", "ocdbt.process_1"]  # each process wrote its own slices
  # Each process hashed what it wrote; process 0's manifest has every array's hash of its C-order bytes.
  manifest = json.loads((two / "export_manifest.json").read_text())
  assert {e["name"]: e["sha256"] for e in manifest["tensors"]} == {
      name: hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest() for name, value in b.items()}
  assert sorted(os.listdir(tmp_path)) == ["one", "two"]

  diffs = _run_processes(["diff", *TOKENS, "--path", str(two)])
  assert [code for code, _, _ in diffs] == [0, 0], diffs[0][2][-2000:]


@pytest.mark.slow  # stress: a multi-process job (.ci/run: once, on the primary stack)
def test_forward_over_two_processes_prints_what_one_process_with_four_devices_prints():
  model = [t for t in TOKENS if not t.startswith("quantiz")]
  one = subprocess.run([sys.executable, "-m", "inspect_tool", "forward", *model, "--checkpoint", CKPT],
                       capture_output=True, text=True, cwd=REPO, env=_env(4), check=False, timeout=240)
  assert one.returncode == 0, one.stderr[-2000:]
  outs = _run_processes(["forward", *model, "--checkpoint", CKPT])
  assert [code for code, _, _ in outs] == [0, 0], outs[0][2][-2000:]
  assert outs[0][1] == one.stdout and "main loss" in one.stdout  # the same shards, the same reductions
  assert outs[1][1] == ""
