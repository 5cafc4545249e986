"""The plan (`maxtext KEYS --topology T --train adamw`, instant, no compile) against XLA's own figures for MaxText
0.2.5's `train_compile` of the same keys on v5p (`tests/data/xla_ref/*.json`: how they were made is in its README):

- the training state the plan sizes in TPU tiles is XLA's `argument_size_in_bytes` (within 0.1 %: the rest is the
  batch and the step counter);
- the plan's peak per device (state, gradients and the estimate of `inspect_tool/sharding/activations.py`) is
  within 15 % of XLA's (code + arguments + outputs - aliases + temporaries) on every grid point; where XLA refused
  the step (its compile-time HBM OOM), the plan does not fit either and is within 15 % of XLA's own figure;
- the package's table (`inspect_tool/sharding/xla_grid.json`, which `--summary` names its nearest point from)
  holds these XLA figures and our estimate as it is now.
"""

import json
import os

import pytest

from inspect_tool import cli
from inspect_tool.listings import grid_plan
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import xla_grid

from conftest import DATA as DATA_DIR
DATA = os.path.join(DATA_DIR, "xla_ref")
TOLERANCE = 0.15
RESULTS = grid_plan.results(DATA)
COMPILED = sorted(name for name, d in RESULTS.items() if d["ok"])
REFUSED = sorted(name for name, d in RESULTS.items() if not d["ok"] and d.get("oom"))
_plan = grid_plan.plan


def test_the_grid_spans_models_batches_lengths_policies_and_a_refusal():
  keys = [dict(k.split("=", 1) for k in RESULTS[n]["keys"]) for n in COMPILED]
  assert {k["model_name"] for k in keys} >= {"deepseek3-tiny", "deepseek2-16b", "deepseek3-671b"}
  assert len({k.get("per_device_batch_size") for k in keys}) >= 3
  assert len({k.get("max_target_length") for k in keys}) >= 4
  assert {k.get("remat_policy", "full") for k in keys} >= {"full", "minimal", "save_qkv_proj"}
  assert REFUSED, "no grid point where XLA refused the step"


@pytest.mark.parametrize("name", COMPILED)
def test_the_state_sized_in_tpu_tiles_is_xlas_arguments(name):
  mem = _plan(RESULTS[name]["keys"])
  state = mem.total.params + mem.total.optimizer + mem.activations.layout.state_padding
  xla = RESULTS[name]["memory_analysis"]["argument_size_in_bytes"]
  assert abs(state / xla - 1) < 0.001, (state, xla)


@pytest.mark.parametrize("name", COMPILED)
def test_the_planned_peak_is_within_15_percent_of_xlas(name):
  d = RESULTS[name]
  m = d["memory_analysis"]
  xla = (m["generated_code_size_in_bytes"] + m["argument_size_in_bytes"] + m["output_size_in_bytes"]
         - m["alias_size_in_bytes"] + m["temp_size_in_bytes"])
  assert xla == d["peak_bytes"]
  ours = _plan(d["keys"]).needed
  assert abs(ours / xla - 1) <= TOLERANCE, (name, ours / 2**30, xla / 2**30, ours / xla)


@pytest.mark.parametrize("name", REFUSED)
def test_where_xla_refuses_the_step_the_plan_does_not_fit_either(name):
  """XLA's figure is what its message gives: all it needed ("Used X of Y hbm"), or its temporaries alone (libtpu
  0.0.50's CompileTimeHbmOom): the plan's temporaries are then its gradients and estimate, less the state's
  padding and the code (those XLA counts apart)."""
  d = RESULTS[name]
  mem = _plan(d["keys"])
  assert mem.needed > mesh_lib.topology_chip(grid_plan.topology_of(d["keys"])).memory
  figures = d["oom_figures"]
  assert figures.get("used_bytes") or figures.get("temp_bytes"), "no figure in XLA's message"
  if figures.get("used_bytes"):
    assert abs(mem.needed / figures["used_bytes"] - 1) <= TOLERANCE, (name, mem.needed / 2**30)
  else:
    est = mem.activations
    temps = mem.total.gradients + est.total - est.layout.state_padding - dict(est.parts)["generated code"]
    assert abs(temps / figures["temp_bytes"] - 1) <= TOLERANCE, (name, temps / 2**30, figures["temp_bytes"] / 2**30)


def test_the_package_table_holds_these_figures_and_the_current_estimate():
  points = {p.name: p for p in xla_grid.points()}
  assert set(points) == set(COMPILED) | set(REFUSED)
  for name, point in points.items():
    d = RESULTS[name]
    assert list(point.keys) == d["keys"]
    assert point.xla_peak == (d["peak_bytes"] if d["ok"] else None)
    assert point.oom_temp == (None if d["ok"] else d["oom_figures"].get("temp_bytes"))
    assert point.ours == int(_plan(d["keys"]).needed), f"{name}: rerun scripts/xla_grid_table.py --write"


def test_summary_names_the_nearest_grid_point_and_the_ratio_there(capsys):
  keys = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1", "max_target_length=300"]
  assert cli.main(["maxtext", *keys, "--topology", "v5p-8", "--summary", "--train", "adamw"]) == 0
  out = capsys.readouterr().out
  point = xla_grid.nearest(keys, "v5p-8")
  assert point.name == "tiny_v5p-8_b1_s256_mtp1"  # same model, topology, batch, policy; 256 the closest length
  ratio = point.ours / point.xla_peak
  assert (f"Against XLA at the nearest calibration point: tiny_v5p-8_b1_s256_mtp1 (MaxText 0.2.5 train_compile on "
          f"v5p-8): the plan there ") in out and f"(ours/XLA {ratio:.2f})" in out
  assert cli.main(["maxtext", *keys, "--topology", "v5p-8", "--summary", "--train", "adamw", "--format", "json"]) == 0
  grid = json.loads(capsys.readouterr().out)["device_memory"]["xla_grid_point"]
  assert grid["name"] == "tiny_v5p-8_b1_s256_mtp1" and grid["xla_peak_bytes"] == point.xla_peak


def test_summary_at_a_refused_point_says_xla_refused_it_with_its_figure(capsys):
  keys = ["model_name=deepseek2-16b", "per_device_batch_size=24", "max_target_length=4096"]
  assert cli.main(["maxtext", *keys, "--topology", "v5p-8", "--summary", "--train", "adamw"]) == 1
  out = capsys.readouterr().out
  assert ("Against XLA at the nearest calibration point: ds2-16b_v5p-8_b32_s4096 (MaxText 0.2.5 train_compile on "
          "v5p-8): the plan there 140.25 GiB; XLA refused it (HBM OOM: 105.82 GiB of temporaries alone).") in out
