"""Validation keeps the budget too: an export whose `--max-memory` leaves less than validation needs skips it and
says how much it needs; with that much more (and the compilation cache off, the worst case) validation runs
inside a memory cgroup of the budget plus `ALLOWANCE`, with peak RSS under the budget, in both layouts."""

from __future__ import annotations

import json

import pytest

import memory_cgroup
import orbax_sources
from inspect_tool.streaming import budget as budget_lib

pytestmark = pytest.mark.slow  # memory cgroups: run once, on the primary stack (.ci/run)

MIB = 2**20
ALLOWANCE = 32 * MIB  # the cgroup also charges the page cache of the files written (reclaimable)
# A 68 MB float model (embedding and head 16.8 MB each, routed experts 8.4 MB each), one chunk per array.
MODEL = ["model_name=deepseek3-tiny", "override_model_config=true", "mtp_num_layers=0", "base_emb_dim=256",
         "vocab_size=16384", "base_moe_mlp_dim=512", "base_mlp_dim=1024", "num_experts=8",
         "base_num_decoder_layers=3", "first_num_dense_layers=1"]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  step = tmp_path_factory.mktemp("validate_src") / "0"
  orbax_sources.write_source(str(step), MODEL)
  return str(step)


def _export(source: str, dst: str, layout: str, *extra: str, cgroup=None):
  quant = ["quantization=fp8_full"] if layout == "orbax" else []
  return memory_cgroup.run_tool(["export", *MODEL, *quant, "--layout", layout, "--checkpoint", source, "--output",
                                 dst, "--format", "json", "--no-compile-cache", *extra], cgroup, timeout=600)


def _size(text: str) -> int:
  number, unit = text.split()[:2]
  return int(float(number) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit])


@pytest.mark.skipif(not memory_cgroup.available(), reason="needs a writable memory cgroup v1 hierarchy (root)")
@pytest.mark.parametrize("layout", ["orbax", "deepseek-fp8"])
def test_validation_runs_within_the_budget_it_asks_for(source, layout, tmp_path):
  # 40 MiB above the smallest budget this machine accepts (what the process holds at start differs between machines)
  first = memory_cgroup.accepted_floor(_export(source, str(tmp_path / "refused"), layout, "--max-memory", "1KB")[0])
  first += 40 * MIB
  out, _ = _export(source, str(tmp_path / "skipped"), layout, "--max-memory", str(first))
  assert out.returncode == 0, out.stderr[-3000:]
  validation = json.loads(out.stdout)["validation"]
  assert validation["skipped"] is True, validation
  reason = validation["reason"]  # "validation needs about N MiB (...) and --max-memory leaves M MiB"
  need, left = _size(reason.split("needs about ")[1]), _size(reason.split("--max-memory leaves ")[1])
  budget = first + need - left + 16 * MIB  # what it asked for, with room for the rounding of the figures

  with memory_cgroup.limited(budget + ALLOWANCE, f"validate_{layout}") as cgroup:
    out, peak = _export(source, str(tmp_path / "validated"), layout, "--max-memory", str(budget), cgroup=cgroup)
  assert out.returncode == 0, out.stderr[-3000:]
  report = json.loads(out.stdout)
  assert report["validation"].get("skipped") is not True and report["validation"]["passed"] is True, report
  assert report["validation"]["vs_quantized_source"], report  # it compared the heads
  assert peak is not None and peak <= budget, (budget_lib.format_size(peak), budget_lib.format_size(budget))
  assert 100 * 10**6 < cgroup.charged <= budget + ALLOWANCE, cgroup.charged
