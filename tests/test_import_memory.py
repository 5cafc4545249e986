"""`import --max-memory`: under a memory cgroup smaller than each of the MaxText arrays it writes (going over kills
it), the import completes with peak RSS under the budget and writes the same bytes as an unbounded import; the
release's per-expert tensors are read one at a time into slices of the stacked arrays."""

from __future__ import annotations

import json

import pytest

from test_export_distributed import _arrays
import memory_cgroup
import hf_sources

pytestmark = pytest.mark.slow  # memory cgroups: run once, on the primary stack (.ci/run)

LIMIT = 450 * 10**6
PAGE_CACHE = 128 * 2**20  # cgroup room beside the budget for the page cache of the files written
E, FM, X, F, V = 1024, 1536, 40, 2048, 1024  # routed experts wi_0/wi_1/wo: (40, 2, 1024, 1536) float32 = 503 MB each
WI_0 = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.wi_0"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
  """A DeepSeek-V3-shaped HF directory (float16, one shard per layer) whose stacked experts exceed LIMIT."""
  root = tmp_path_factory.mktemp("hfbig")
  hf_sources.write_hf_dir(str(root), E, FM, F, X, 3, V)
  return str(root)


def _import(source: str, dst: str, *extra: str, cgroup=None):
  return memory_cgroup.run_tool(["import", "--path", source, "--output", dst, "--format", "json", *extra], cgroup)


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_import_stays_within_a_memory_cgroup_smaller_than_each_expert_stack(hf_dir, tmp_path):
  with memory_cgroup.limited(LIMIT, "import_test") as cgroup:
    bounded, peak = _import(hf_dir, str(tmp_path / "bounded"), "--max-memory", str(LIMIT), cgroup=cgroup)
  assert bounded.returncode == 0, bounded.stderr[-3000:]
  assert 100 * 10**6 < cgroup.charged <= LIMIT, cgroup.charged  # the import ran inside the cgroup
  assert peak is not None and peak <= LIMIT, peak
  report = json.loads(bounded.stdout)
  assert report["arrays"][WI_0]["shape"] == [X, 2, E, FM]
  assert X * 2 * E * FM * 4 > LIMIT and report["memory"]["largest_slice_bytes"] < LIMIT // 4

  unbounded, free_peak = _import(hf_dir, str(tmp_path / "unbounded"))
  assert unbounded.returncode == 0, unbounded.stderr[-3000:]
  a, b = _arrays(str(tmp_path / "bounded")), _arrays(str(tmp_path / "unbounded"))
  assert sorted(a) == sorted(b)
  for name in a:
    assert a[name].tobytes() == b[name].tobytes(), name
  assert free_peak > peak  # the default budget reads bigger slices


def _refused(hf_dir, tmp_path, ask: str) -> tuple[float, float]:
  """(MiB the process holds, MiB the line accepts) of the one-line refusal of `--max-memory ask`."""
  out, _ = _import(hf_dir, str(tmp_path / "dst"), "--max-memory", ask)
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr
  assert not (tmp_path / "dst").exists()
  held = float(lines[0].split("with the ")[1].split(" MiB")[0])
  return held, float(lines[0].rsplit("accepted: at least ", 1)[1].split()[0])


def test_a_budget_below_the_smallest_read_is_one_line_naming_what_works(hf_dir, tmp_path):
  out, _ = _import(hf_dir, str(tmp_path / "dst"), "--max-memory", "200MB")
  lines = out.stderr.strip().splitlines()
  assert out.returncode == 2 and len(lines) == 1, out.stderr
  # The floor named is the array whose one read is largest: a dense layer's (2048, 1024) float32 MLP matrix (8 MiB),
  # held once read and, while it is read, as raw, float32 and MaxText-layout copies (24 MiB), beside what the
  # process holds (slices of it are cut in memory, down to a few bytes).
  assert lines[0].startswith("error: --max-memory 190.7 MiB is smaller than the smallest slice of "
                             "params/params/decoder/dense_layers/mlp/wi_0/kernel (1024, 1, 2048) needs")
  assert "decoded source chunks of 24.0 MiB" in lines[0]
  held, floor = _refused(hf_dir, tmp_path, "200MB")
  assert floor == pytest.approx(held + 32.0, abs=0.2)


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
def test_the_floor_named_holds_in_a_memory_cgroup(hf_dir, tmp_path):
  """The budget the refusal names (plus 64 MiB of room for slices: at the floor itself the slices are so thin that
  the import takes minutes) imports inside a memory cgroup of that size plus `PAGE_CACHE` (the cgroup charges the
  page cache of the 1.5 GB written, dirty until written back: with less the import crawls through reclaim); a
  budget 10% below it is refused."""
  _, floor = _refused(hf_dir, tmp_path, "200MB")
  budget = (int(floor) + 1 + 64) * 2**20
  _refused(hf_dir, tmp_path, str(int(floor * 0.9 * 2**20)))
  with memory_cgroup.limited(budget + PAGE_CACHE, "import_floor_test") as cgroup:
    out, peak = _import(hf_dir, str(tmp_path / "bounded"), "--max-memory", str(budget), cgroup=cgroup)
  assert out.returncode == 0, out.stderr[-3000:]
  assert 100 * 10**6 < cgroup.charged <= budget + PAGE_CACHE, cgroup.charged
  assert peak is not None and peak <= budget, (peak, budget)
