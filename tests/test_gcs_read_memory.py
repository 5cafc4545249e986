"""`export --max-memory` from a gs:// source (the local GCS emulator, tests/gcs_emulator.py) reads by slices as from
disk: a source whose embedding is several times the slice budget exports within the budget (peak RSS from
/usr/bin/time; inside a memory cgroup of that size when one is available, tests/memory_cgroup.py), cut into more
slices than it has arrays, and gives byte for byte the arrays of the same export from the local copy."""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest

import export_sources
import memory_cgroup
from gcs_emulator import BUCKET
from test_export_distributed import _arrays

pytestmark = pytest.mark.slow  # a memory cgroup: run once, on the primary stack (.ci/run)

# A float source of ~40 MB whose tied embedding (32768 x 256 float32, 32 MiB) is several times the slice budget that
# 40 MiB above the floor leaves (about 40 MiB / SLICE_FACTOR 8), stored in 1 MiB chunks as sharded writes store it.
MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=256",
         "vocab_size=32768", "logits_via_embedding=true", "base_num_decoder_layers=2", "first_num_dense_layers=1"]
QUANT = ["quantization=fp8_full"]


@pytest.fixture(scope="module")
def sources(gcs, tmp_path_factory):
  step = tmp_path_factory.mktemp("gcs-export-source") / "0"
  _, largest = export_sources.write_source(str(step), MODEL, chunk_bytes=1 << 20)
  assert largest == 32768 * 256 * 4
  return str(step), gcs.upload(step, f"gs://{BUCKET}/read/export-source/0")


def _export(source: str, dst, *extra, cgroup=None):
  return memory_cgroup.run_tool(["export", *MODEL, *QUANT, "--checkpoint", source, "--output", str(dst),
                                 "--no-validate", "--format", "json", *extra], cgroup=cgroup)


def _budget(source: str, tmp_path) -> int:
  """40 MiB above the smallest budget this process accepts (named by the refusal of 1 KB), in bytes."""
  out, _ = _export(source, tmp_path / "refused", "--max-memory", "1KB")
  return memory_cgroup.accepted_floor(out) + 40 * 2**20


def test_export_from_gcs_under_max_memory_matches_the_local_export(sources, tmp_path):
  local, remote = sources
  budget = _budget(remote, tmp_path)
  limit = memory_cgroup.limited(budget, "gcs_export") if memory_cgroup.available() else contextlib.nullcontext()
  with limit as cgroup:
    bounded, peak = _export(remote, tmp_path / "from-gcs", "--max-memory", str(budget), cgroup=cgroup)
  assert bounded.returncode == 0, bounded.stderr[-3000:]
  assert peak is not None and peak <= budget, (peak, budget)
  report = json.loads(bounded.stdout)
  assert report["memory"]["max_memory"] == budget
  # The embedding was read in slices (measured: 4 MiB on Python 3.12, 8 MiB on 3.11, where the process holds more).
  assert report["memory"]["largest_slice_bytes"] * 2 <= 32768 * 256 * 4
  from_disk, _ = _export(local, tmp_path / "from-disk", "--max-memory", str(budget))
  assert from_disk.returncode == 0, from_disk.stderr[-3000:]
  a, b = _arrays(str(tmp_path / "from-gcs")), _arrays(str(tmp_path / "from-disk"))
  assert sorted(a) == sorted(b) and any(n.endswith("array.qvalue") for n in a)
  for name, value in a.items():
    assert value.dtype == b[name].dtype and np.asarray(value).tobytes() == np.asarray(b[name]).tobytes(), name
