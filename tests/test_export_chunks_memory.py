"""The budget is kept on every chunking Orbax writes, in both layouts: sources saved by Orbax itself with one chunk per
array (a default local save, like MaxText's), with chunks capped by `chunk_byte_size` (what a save to GCS gets: 400
MiB, scaled down here) and with small chunks. For each, a budget clearly below the floor the refusal names is one
line, exit 2; the export at that floor (plus 16 MiB of room for slices), its quantizers missing the compilation
cache, runs inside a memory cgroup of the budget plus `ALLOWANCE`, with peak RSS under the budget, each source chunk
decoded at most twice, and writes the bytes of the unbounded export. A source whose routed experts are each one 134
MB chunk exports, in both layouts, within a quarter of that chunk beside the process: each chunk is decoded from its
stored bytes front to back into small boxes (`streaming/chunk_stream.py`), at most twice; in the Orbax layout, 64
MiB above that floor, with the two-pass experts' first pass in a stream of its own (`absmax_ahead.py`); and just
above one chunk beside the process, in one pass, each chunk decoded once."""

from __future__ import annotations

import filecmp
import json
import math
import os
import re

import numpy as np
import pytest

import memory_cgroup
import orbax_sources
from test_export_memory import _arrays

pytestmark = pytest.mark.slow  # memory cgroups: run once, on the primary stack (.ci/run)

MIB = 2**20
ALLOWANCE = 32 * MIB  # the cgroup also charges the page cache of the files written (reclaimable)
ROOM = 16 * MIB  # above the floor, so that slices are not single rows
# Routed experts (32, 2, 256, 512) float32 = 33.5 MB each, embedding and head (32768 x 256) 33.5 MB each.
MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=256",
         "vocab_size=32768", "base_moe_mlp_dim=512", "base_mlp_dim=1024", "num_experts=32",
         "base_num_decoder_layers=3", "first_num_dense_layers=1"]
QUANT = ["quantization=fp8_full"]
CHUNKINGS = {"one-chunk-per-array": None, "chunks-of-4MiB": 4 * MIB, "chunks-of-256KiB": 256 * 2**10}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
  root = tmp_path_factory.mktemp("chunkings")
  out = {}
  for name, cap in CHUNKINGS.items():
    out[name] = (str(root / name / "0"), orbax_sources.write_source(str(root / name / "0"), MODEL,
                                                                      chunk_byte_size=cap))
  return out


@pytest.fixture(scope="module")
def unbounded(sources, tmp_path_factory):
  """layout -> the export without --max-memory (the default budget) of the one-chunk source."""
  made = {}

  def get(layout: str) -> str:
    if layout not in made:
      dst = str(tmp_path_factory.mktemp("unbounded") / layout)
      out, _ = _export(sources["one-chunk-per-array"][0], dst, layout, "--no-validate")
      assert out.returncode == 0, out.stderr[-3000:]
      made[layout] = dst
    return made[layout]
  return get


def _export(source: str, dst: str, layout: str, *extra: str, cgroup=None, env=None):
  return memory_cgroup.run_tool(["export", *MODEL, *(QUANT if layout == "orbax" else []), "--layout", layout,
                                 "--checkpoint", source, "--output", dst, "--format", "json", *extra], cgroup,
                                timeout=600, env=env)


def _floor(source: str, layout: str, tmp_path, env=None) -> int:
  """The smallest budget the refusal line names for `source` (asked with a budget far below it)."""
  out, _ = _export(source, str(tmp_path / "probe"), layout, "--max-memory", "50MB", env=env)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
  assert lines[0].startswith("error: --max-memory 47.7 MiB is smaller than the smallest slice of ")
  number, unit = lines[0].rsplit("accepted: at least ", 1)[1].split()[:2]
  assert unit == "MiB" and not (tmp_path / "probe").exists()
  return math.ceil(float(number)) * MIB


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8"])
@pytest.mark.parametrize("chunking", list(CHUNKINGS))
def test_the_floor_named_holds_in_a_memory_cgroup_on_every_chunking(chunking, layout, sources, unbounded, tmp_path):
  source, chunks = sources[chunking]
  # A compilation cache of this test's own: the steps before the plan are in it once the first probe has run (the
  # floor named is then the tightest), the quantizers at this budget are not, as at any budget not met before.
  env = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax-cache")}
  _floor(source, layout, tmp_path, env)
  floor = _floor(source, layout, tmp_path, env)
  below, _ = _export(source, str(tmp_path / "below"), layout, "--max-memory", str(floor * 9 // 10), env=env)
  assert below.returncode == 2 and len(below.stderr.strip().splitlines()) == 1, below.stderr[-2000:]
  assert "accepted: at least " in below.stderr and not (tmp_path / "below").exists()

  budget = floor + ROOM
  with memory_cgroup.limited(budget + ALLOWANCE, f"export_{chunking}") as cgroup:
    out, peak = _export(source, str(tmp_path / "bounded"), layout, "--max-memory", str(budget), cgroup=cgroup,
                        env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 100 * 10**6 < cgroup.charged <= budget + ALLOWANCE, cgroup.charged  # it ran inside the cgroup
  assert peak is not None and peak <= budget, (peak, budget)
  if layout == "deepseek-fp8":  # the release layout: every chunk decoded once, the same files
    decoding = json.loads(out.stdout)["decoding"]
    assert decoding["decoded_per_stored"] == 1 and decoding["bytes_stored"] > 100 * 10**6, decoding
    names = sorted(n for n in os.listdir(unbounded(layout)) if n != "quantization_report.json")
    assert sorted(n for n in os.listdir(tmp_path / "bounded") if n != "quantization_report.json") == names
    _check_same(layout, unbounded(layout), tmp_path / "bounded")
    return
  memory = json.loads(out.stdout)["memory"]
  decoding = memory["decoding"]
  assert decoding["most_decoded_array"]["decoded_per_stored"] <= 2, decoding
  if CHUNKINGS[chunking] is None:  # one chunk per array: the largest streamed at the floor, in boxes
    assert memory["streamed_arrays"] > 0 and memory["slices"] > len(chunks), memory
  else:
    assert memory["streamed_arrays"] == 0, memory
  largest_chunk = max(math.prod(c) for c in chunks.values()) * 4
  assert memory["read_ahead_arrays"] < len(chunks) or budget > 4 * largest_chunk
  _check_same(layout, unbounded(layout), tmp_path / "bounded")


# Routed experts (64, 2, 256, 1024) float32: 134 MB, each one chunk (Orbax's local save); values of bf16 precision.
BIG_MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=256",
             "vocab_size=8192", "base_moe_mlp_dim=1024", "base_mlp_dim=1024", "num_experts=64",
             "base_num_decoder_layers=3", "first_num_dense_layers=1"]
EXPERTS = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"


@pytest.fixture(scope="module")
def big_source(tmp_path_factory):
  step = tmp_path_factory.mktemp("one_big_chunk") / "0"
  chunks = orbax_sources.write_source(str(step), BIG_MODEL, bf16_values=True)
  assert chunks[EXPERTS] == (64, 2, 256, 1024)  # (experts, layers, emb, mlp): one chunk
  return str(step)


def _export_big(source: str, dst: str, layout: str, *extra: str, cgroup=None):
  return memory_cgroup.run_tool(["export", *BIG_MODEL, *(QUANT if layout == "orbax" else []), "--layout", layout,
                                 "--checkpoint", source, "--output", dst, "--format", "json", *extra], cgroup,
                                timeout=600)


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8"])
def test_one_chunk_arrays_export_beside_less_than_one_chunk(layout, big_source, tmp_path):
  chunk = 256 * 2 * 64 * 1024 * 4
  probe, _ = _export_big(big_source, str(tmp_path / "probe"), layout, "--max-memory", "50MB")
  line = probe.stderr.strip().splitlines()[-1]
  assert probe.returncode == 2 and "routed" not in line, probe.stderr[-2000:]
  held, floor = (float(x) * MIB for x in re.search(r"with the ([0-9.]+) MiB the process holds.*accepted: at least "
                                                   r"([0-9.]+) MiB", line).groups())
  assert floor < held + chunk / 4, line  # streamed boxes of the chunk, never the chunk (nor its stored bytes)
  whole, _ = _export_big(big_source, str(tmp_path / "unbounded"), layout, "--no-validate")
  assert whole.returncode == 0, whole.stderr[-3000:]
  # At the floor: the experts in two passes in the Orbax layout (their scales span the expert axis, which a
  # streamed box cannot cut first); 64 MiB above it, their pass 1 runs ahead in a stream of its own (about 46 MiB:
  # 4 MiB windows and runs); just above one chunk, one pass.
  budgets = {"floor": math.ceil(floor / MIB) * MIB + ROOM}
  if layout == "orbax":
    budgets["ahead"] = budgets["floor"] + 64 * MIB
    budgets["one chunk"] = math.ceil((held + 1.1 * chunk) / MIB) * MIB + ROOM
  for name, budget in budgets.items():
    dst = tmp_path / name.replace(" ", "_")
    with memory_cgroup.limited(budget + ALLOWANCE, f"export_big_{layout}") as cgroup:
      out, peak = _export_big(big_source, str(dst), layout, "--max-memory", str(budget), "--no-validate",
                              cgroup=cgroup)
    assert out.returncode == 0, out.stderr[-3000:]
    assert peak is not None and peak <= budget, (name, peak, budget)
    assert 100 * 10**6 < cgroup.charged <= budget + ALLOWANCE, (name, cgroup.charged)
    result = json.loads(out.stdout)
    decoding = result["decoding"] if layout == "deepseek-fp8" else result["memory"]["decoding"]
    assert decoding["bytes_stored"] > 3 * chunk, decoding
    if layout == "orbax" and name in ("floor", "ahead"):
      memory = result["memory"]
      assert decoding["most_decoded_array"]["decoded_per_stored"] == 2 and memory["two_pass_arrays"] > 0
      assert memory["streamed_arrays"] > 0
      assert memory["absmax_ahead_arrays"] == (memory["two_pass_arrays"] if name == "ahead" else 0), memory
    else:
      assert decoding["decoded_per_stored"] == 1, (name, decoding)
    _check_same(layout, tmp_path / "unbounded", dst)


def _check_same(layout: str, expected, found) -> None:
  if layout == "deepseek-fp8":
    names = sorted(n for n in os.listdir(expected) if n != "quantization_report.json")
    assert filecmp.cmpfiles(expected, found, names, shallow=False)[0] == names
    return
  a, b = _arrays(str(found)), _arrays(str(expected))
  assert sorted(a) == sorted(b) and any(n.endswith("array.qvalue") for n in a)
  for name in a:
    x, y = np.asarray(a[name].read().result()), np.asarray(b[name].read().result())
    assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name
