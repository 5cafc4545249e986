"""`import --max-memory` of DeepSeek-V4's release layout: under a memory cgroup smaller than each of the MaxText
expert arrays it writes, the import of a directory of FP4 routed experts completes with peak RSS under the budget and
writes the unbounded import's bytes; the floor a refusal names imports in a cgroup of that size (the V3 import's
tests/test_import_memory.py, on V4's per-expert FP4 reads: one expert's e2m1 bytes and e8m0 scales at a time)."""

from __future__ import annotations

import json

import pytest

from test_export_distributed import _arrays
import memory_cgroup
import hf_sources

pytestmark = pytest.mark.slow  # memory cgroups: run once, on the primary stack (.ci/run)

LIMIT = 450 * 10**6
PAGE_CACHE = 128 * 2**20
E, FM, X, V = 1024, 1536, 80, 1024  # routed experts wi_0/wi_1/wo: (80, 1024, 1536) float32 = 503 MB each
WI_0 = "params.params.decoder.layers_0.mlp.MoeBlock_0.wi_0"


@pytest.fixture(scope="module")
def v4_dir(tmp_path_factory):
  root = tmp_path_factory.mktemp("v4big")
  hf_sources.write_v4_release_dir(str(root), E, FM, X, V)
  return str(root)


def _import(source: str, dst: str, *extra: str, cgroup=None):
  return memory_cgroup.run_tool(["import", "--path", source, "--output", dst, "--format", "json", *extra], cgroup)


def _refused(v4_dir, tmp_path, ask: str) -> float:
  """The MiB the one-line refusal of `--max-memory ask` accepts."""
  out, _ = _import(v4_dir, str(tmp_path / "dst"), "--max-memory", ask)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr
  assert "is smaller than the smallest slice of" in lines[0] and not (tmp_path / "dst").exists()
  return float(lines[0].rsplit("accepted: at least ", 1)[1].split()[0])


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_v4_import_stays_within_a_memory_cgroup_smaller_than_each_expert_stack(v4_dir, tmp_path):
  with memory_cgroup.limited(LIMIT, "v4_import_test") as cgroup:
    bounded, peak = _import(v4_dir, str(tmp_path / "bounded"), "--max-memory", str(LIMIT), cgroup=cgroup)
  assert bounded.returncode == 0, bounded.stderr[-3000:]
  assert 100 * 10**6 < cgroup.charged <= LIMIT, cgroup.charged
  assert peak is not None and peak <= LIMIT, peak
  report = json.loads(bounded.stdout)
  assert report["arrays"][WI_0]["shape"] == [X, E, FM] and X * E * FM * 4 > LIMIT
  unbounded, _ = _import(v4_dir, str(tmp_path / "unbounded"))
  assert unbounded.returncode == 0, unbounded.stderr[-3000:]
  a, b = _arrays(str(tmp_path / "bounded")), _arrays(str(tmp_path / "unbounded"))
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].tobytes() == b[name].tobytes(), name


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_the_v4_floor_named_holds_in_a_memory_cgroup(v4_dir, tmp_path):
  floor = _refused(v4_dir, tmp_path, "200MB")
  budget = (int(floor) + 1 + 64) * 2**20
  _refused(v4_dir, tmp_path, str(int(floor * 0.9 * 2**20)))
  with memory_cgroup.limited(budget + PAGE_CACHE, "v4_import_floor_test") as cgroup:
    out, peak = _import(v4_dir, str(tmp_path / "bounded"), "--max-memory", str(budget), cgroup=cgroup)
  assert out.returncode == 0, out.stderr[-3000:]
  assert peak is not None and peak <= budget, (peak, budget)
