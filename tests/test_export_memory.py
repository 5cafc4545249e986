"""`export --max-memory`: an export whose largest array is over twice the memory it may use, run under a memory
cgroup of that size (going over kills it), gives byte for byte the arrays of an unbounded export, and Orbax's own
`PyTreeCheckpointer` restores it; a budget below the smallest slice is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import numpy as np
import pytest

import export_sources
from inspect_tool.host import memory as host_memory
from inspect_tool.streaming import budget

pytestmark = pytest.mark.slow  # memory cgroups: run once, on the primary stack (.ci/run)

from conftest import REPO
CGROUP_ROOT = "/sys/fs/cgroup/memory"
LIMIT = 600 * 10**6
# The tied embedding (614400 x 512 float32, 1.26 GB) is the largest array: over 2x LIMIT. Routed experts (64, 3,
# 512, 256) are 100 MB each, chunked along the experts (an axis their scales share): read whole, once, and
# quantized in slices cut in memory (a tighter budget quantizes them in two passes: tests/test_export_two_pass.py).
MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=512",
         "vocab_size=614400", "logits_via_embedding=true", "base_moe_mlp_dim=256", "base_mlp_dim=1024",
         "num_experts=64", "base_num_decoder_layers=4", "first_num_dense_layers=1"]
QUANT = ["quantization=fp8_full"]


def _cgroup_available() -> bool:
  return os.path.isdir(CGROUP_ROOT) and os.access(CGROUP_ROOT, os.W_OK)


def _export(source: str, dst: str, *extra: str, cgroup: str | None = None, env: dict | None = None):
  def enter():  # runs in the child before exec: join the cgroup, so its limit applies to the export alone
    if cgroup:
      with open(os.path.join(cgroup, "cgroup.procs"), "w", encoding="ascii") as f:
        f.write(str(os.getpid()))

  out = subprocess.run(["/usr/bin/time", "-f", "PEAK_RSS_KB %M", sys.executable, "-m", "inspect_tool", "export",
                        *MODEL, *QUANT, "--checkpoint", source, "--output", dst, "--format", "json", *extra],
                       capture_output=True, text=True, cwd=REPO, preexec_fn=enter,
                       env=dict(os.environ, JAX_PLATFORMS="cpu", **(env or {})), check=False, timeout=900)
  lines = out.stderr.strip().splitlines()
  peak = int(lines[-1].split()[1]) * 1024 if lines and lines[-1].startswith("PEAK_RSS_KB") else None
  return out, peak


def _arrays(path: str) -> dict[str, tuple]:
  """name -> tensorstore handle of every array in the export's root OCDBT database (read independently)."""
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  items = os.path.join(path, "0", "items")
  kv = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file", "path": items + "/"}}).result()
  names = sorted({k.decode().rsplit("/zarr.json", 1)[0] for k in kv.list().result() if k.endswith(b"/zarr.json")})
  return {n: ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": {"driver": "file",
                                                                                 "path": items + "/"},
                                                     "path": n + "/"}}, open=True).result() for n in names}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  step = tmp_path_factory.mktemp("big") / "0"
  total, largest = export_sources.write_source(str(step), MODEL)
  assert largest >= 2 * LIMIT, largest
  return str(step), total


@pytest.mark.skipif(not _cgroup_available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_export_under_a_memory_cgroup_matches_the_unbounded_export_byte_for_byte(source, tmp_path):
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel

  path, _ = source
  cgroup = os.path.join(CGROUP_ROOT, f"inspect_export_test_{uuid.uuid4().hex[:8]}")
  os.mkdir(cgroup)
  try:
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w", encoding="ascii") as f:
      f.write(str(LIMIT))
    bounded, peak = _export(path, str(tmp_path / "bounded"), "--max-memory", "600MB", cgroup=cgroup)
    with open(os.path.join(cgroup, "memory.failcnt"), encoding="ascii") as f:
      hits = int(f.read())
  finally:
    os.rmdir(cgroup)
  assert bounded.returncode == 0, bounded.stderr[-3000:]
  assert peak is not None and peak <= LIMIT, peak  # resident memory (the cgroup also counts page cache)
  report = json.loads(bounded.stdout)
  assert report["validation"]["skipped"] is True and "--max-memory" in report["validation"]["reason"]
  assert report["validation"]["run_elsewhere"].endswith(f"--checkpoint {tmp_path / 'bounded'} --compare")
  assert "validation skipped" in bounded.stderr and "forward" in bounded.stderr
  assert report["memory"]["max_memory"] == LIMIT and report["memory"]["slices"] > 53
  assert report["memory"]["largest_slice_bytes"] * 8 < LIMIT
  # The routed experts, chunked along the experts (an axis their scales share), fit in one box spanning them beside
  # the budget's slices: each is read once and cut in memory, every source chunk decoded once.
  assert report["memory"]["two_pass_arrays"] == 0 and report["memory"]["decoding"]["decoded_per_stored"] == 1
  del hits  # the limit may be touched by page cache, which the kernel reclaims instead of killing

  # Unbounded: 5 GB (accepted on a smaller host too), over 4 GiB of room, so freed blocks are kept for reuse
  # (`budget.streaming_allocations`): the same bytes either way.
  unbounded, _ = _export(path, str(tmp_path / "unbounded"), "--no-validate", "--max-memory", "5000000000",
                         env={host_memory.SKIP_ENV: "1"})
  assert unbounded.returncode == 0, unbounded.stderr[-3000:]
  a, b = _arrays(str(tmp_path / "bounded")), _arrays(str(tmp_path / "unbounded"))
  assert sorted(a) == sorted(b) and any(n.endswith("array.qvalue") for n in a)
  for name in a:
    assert a[name].shape == b[name].shape and a[name].dtype == b[name].dtype, name
    rows = a[name].shape[0] if a[name].shape else 1
    step = max(1, rows // 16)
    for start in range(0, rows, step):
      index = (slice(start, start + step),) if a[name].shape else ()
      x = np.asarray(a[name][index].read().result() if index else a[name].read().result())
      y = np.asarray(b[name][index].read().result() if index else b[name].read().result())
      assert x.tobytes() == y.tobytes(), (name, start)

  # Orbax's own reader restores the bounded export (every array but the 1.26 GB embedding, to keep this small).
  items = str(tmp_path / "bounded" / "0" / "items")
  with ocp.PyTreeCheckpointer() as checkpointer:
    metadata = checkpointer.metadata(items)
    tree = metadata.item_metadata.tree if hasattr(metadata, "item_metadata") else metadata.tree
    target = _restore_target(tree)
    restored = checkpointer.restore(items, args=ocp.args.PyTreeRestore(
        item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target), partial_restore=True))
  moe = restored["params"]["params"]["decoder"]["moe_layers"]["DeepSeekMoeBlock_0"]["MoeBlock_0"]
  qvalue = moe["wi_0"]["array"]["qvalue"]
  assert qvalue.dtype == np.dtype("float8_e4m3fn") and qvalue.shape == (64, 3, 512, 256)
  name = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0.array.qvalue"
  assert np.asarray(qvalue).tobytes() == np.asarray(b[name].read().result()).tobytes()



@pytest.mark.skipif(not _cgroup_available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_freed_blocks_kept_for_reuse_stay_within_the_budget(source, tmp_path):
  """A budget with over 4 GiB of room beside the process: the allocator keeps freed blocks of up to 1/256 of the
  room for reuse (`budget.streaming_allocations`), the plan sets memory aside for them, and the export stays under
  a memory cgroup of the budget's size (the same bytes: the unbounded export above)."""
  path, _ = source
  limit = 5 * 10**9  # accepted on a smaller host too: the export itself peaks near 2 GB
  cgroup = os.path.join(CGROUP_ROOT, f"inspect_export_test_{uuid.uuid4().hex[:8]}")
  os.mkdir(cgroup)
  try:
    with open(os.path.join(cgroup, "memory.limit_in_bytes"), "w", encoding="ascii") as f:
      f.write(str(limit))
    out, peak = _export(path, str(tmp_path / "kept"), "--max-memory", str(limit), "--no-validate", cgroup=cgroup,
                        env={host_memory.SKIP_ENV: "1"})
  finally:
    os.rmdir(cgroup)
  assert out.returncode == 0, out.stderr[-3000:]
  assert peak is not None and peak <= limit, peak
  memory = json.loads(out.stdout)["memory"]
  block = memory["kept_freed_bytes"] // budget.KEPT_FACTOR
  assert budget.KEPT_BLOCK_MIN <= block <= budget.KEPT_BLOCK_MAX, memory  # kept: 1/256 of the room
  assert memory["two_pass_arrays"] == 0, memory


def _restore_target(tree):
  """ShapeDtypeStructs (one CPU device) for every array in the metadata tree except the token embedding."""
  import jax  # pylint: disable=import-outside-toplevel

  sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  out = {}
  for key, value in tree.items():
    if key == "token_embedder":
      continue
    if isinstance(value, dict):
      out[key] = _restore_target(value)
    else:
      out[key] = jax.ShapeDtypeStruct(value.shape, value.dtype, sharding=sharding)
  return out


def test_max_memory_below_the_smallest_slice_is_one_line(tmp_path):
  ckpt = os.path.join(REPO, "tests", "data", "ckpt_deepseek3-tiny-L4-V1024")
  tiny = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true",
          "base_num_decoder_layers=4", "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]
  out = subprocess.run([sys.executable, "-m", "inspect_tool", "export", *tiny, "--checkpoint", ckpt, "--output",
                        str(tmp_path / "dst"), "--max-memory", "1MB"], capture_output=True, text=True, cwd=REPO,
                       check=False, timeout=300)
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
  assert out.stderr.startswith("error: --max-memory 976.6 KiB is smaller than the smallest slice of ")
  assert "accepted: at least " in out.stderr and not (tmp_path / "dst").exists()
  assert os.listdir(tmp_path) == []
  bad = subprocess.run([sys.executable, "-m", "inspect_tool", "export", *tiny, "--random-init", "--output",
                        str(tmp_path / "d"), "--max-memory", "lots"], capture_output=True, text=True, cwd=REPO,
                       check=False, timeout=300)
  assert bad.returncode == 2 and bad.stderr.strip() == (
      "error: --max-memory 'lots' is not a size; accepted: a positive number with an optional unit, e.g. 600MB, "
      "2GiB, 1.5G")


def test_max_memory_over_what_the_machine_has_is_one_line(tmp_path):
  """More than MemAvailable (plus what the process holds) or the cgroup limit: refused before anything is made."""
  ceiling, _ = budget.memory_ceiling()
  ask = f"{int(ceiling * 2 / 10**9) + 1}GB"
  out = subprocess.run([sys.executable, "-m", "inspect_tool", "export", "model_name=deepseek3-tiny",
                        "quantization=fp8_full", "--random-init", "--output", str(tmp_path / "dst"),
                        "--max-memory", ask],
                       capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
  assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr[-2000:]
  assert out.stderr.startswith(f"error: --max-memory {budget.format_size(budget.parse_size(ask))} is more than this "
                               "process can get: ") and "accepted: a size up to " in out.stderr
  assert os.listdir(tmp_path) == []
