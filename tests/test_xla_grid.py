"""The plan (`maxtext KEYS --topology T --train OPT`, instant, no compile) against XLA's own figures for MaxText
0.2.5's `train_compile` of the same keys (`tests/data/xla_ref/*.json`: how they were made is in its README), on the
DeepSeek family's presets, v5e, v5p and v6e slices, three optimizers, every remat policy:

- the training state the plan sizes in TPU tiles is XLA's `argument_size_in_bytes` (within 0.1 %: the rest is the
  batch and the step counter);
- the plan's peak per device (state, gradients and the estimate of `inspect_tool/sharding/activations.py`) is
  within 15 % of XLA's (code + arguments + outputs - aliases + temporaries), on the points held out of the estimate's
  fit (`xla_grid.held_out`, at least a third of the grid) as on the others; where XLA refused the step (its
  compile-time HBM OOM), the plan does not fit either and is within 15 % of XLA's own figure;
- the package's table (`inspect_tool/sharding/xla_grid.json`, which `--summary` names its nearest point from) and
  docs/xla-grid.md hold these XLA figures and our estimate as it is now.
"""

import json
import os

import pytest

from inspect_tool import cli
from inspect_tool.configuration import config
from inspect_tool.configuration import remat_policies
from inspect_tool.listings import grid_plan
from inspect_tool.listings import grid_table
from inspect_tool.paramtree import summary as summary_lib
from inspect_tool.sharding import activations
from inspect_tool.sharding import mesh as mesh_lib
from inspect_tool.sharding import xla_grid

from conftest import DATA as DATA_DIR
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(DATA_DIR, "xla_ref")
OURS = os.path.join(DATA_DIR, "xla_ours")
FAMILY = os.path.join(DATA_DIR, "xla_family")  # the family grid: tabled beside this one, not held to 15 % (yet)
TOLERANCE = 0.15
RESULTS = grid_plan.results(DATA)
COMPILED = sorted(name for name, d in RESULTS.items() if d["ok"])
REFUSED = sorted(name for name, d in RESULTS.items() if not d["ok"] and d.get("oom"))
HELD_OUT = [name for name in COMPILED if xla_grid.held_out(name)]
FITTED = [name for name in COMPILED if not xla_grid.held_out(name)]
_plan = grid_plan.plan


def _keys(name):
  return dict(k.split("=", 1) for k in RESULTS[name]["keys"])


def test_the_grid_spans_the_family_chips_optimizers_batches_lengths_policies_and_a_refusal():
  tabled = grid_plan.results(DATA, FAMILY)
  keys = [dict(k.split("=", 1) for k in d["keys"]) for d in tabled.values() if d["ok"]]
  assert {k["model_name"] for k in keys} >= {"deepseek2-16b", "deepseek3-tiny", "deepseek3-test", "deepseek3-671b",
                                             "deepseek3.2-671b", "deepseek4-tiny", "deepseek-custom"}
  assert {mesh_lib.topology_chip(k["compile_topology"]).name for k in keys} >= {"v5e", "v5p", "v6e"}
  assert {k.get("opt_type", "adamw") for k in keys} >= {"adamw", "adam_pax", "sgd"}
  assert {int(k.get("per_device_batch_size", 12)) for k in keys} >= {1, 16}
  assert {int(k.get("max_target_length", 2048)) for k in keys} >= {256, 8192}
  assert {k.get("remat_policy", "full") for k in keys} >= set(remat_policies.POLICIES) - {"none", "minimal_flash",
                                                                                          "custom"}
  assert REFUSED, "no grid point where XLA refused the step"


def test_at_least_a_third_of_the_grid_is_held_out_of_the_fit():
  assert 3 * len(HELD_OUT) >= len(COMPILED), (len(HELD_OUT), len(COMPILED))


@pytest.mark.parametrize("name", COMPILED)
def test_the_state_sized_in_tpu_tiles_is_xlas_arguments(name):
  mem = _plan(RESULTS[name]["keys"])
  state = mem.total.params + mem.total.optimizer + mem.activations.layout.state_padding
  xla = RESULTS[name]["memory_analysis"]["argument_size_in_bytes"]
  assert abs(state / xla - 1) < 0.001, (state, xla)


def _within(name):
  d = RESULTS[name]
  m = d["memory_analysis"]
  xla = (m["generated_code_size_in_bytes"] + m["argument_size_in_bytes"] + m["output_size_in_bytes"]
         - m["alias_size_in_bytes"] + m["temp_size_in_bytes"])
  assert xla == d["peak_bytes"]
  ours = _plan(d["keys"]).needed
  assert abs(ours / xla - 1) <= TOLERANCE, (name, ours / 2**30, xla / 2**30, ours / xla)


@pytest.mark.parametrize("name", HELD_OUT)
def test_the_planned_peak_is_within_15_percent_of_xlas_where_it_was_not_fitted(name):
  _within(name)


@pytest.mark.parametrize("name", FITTED)
def test_the_planned_peak_is_within_15_percent_of_xlas_where_it_was_fitted(name):
  _within(name)


NO_LOSS = sorted(n for n, d in grid_plan.results(FAMILY).items()
                 if d["ok"] and not activations.has_loss(config.resolve_config(
                     [k for k in d["keys"] if not k.startswith("compile_topology")])))


@pytest.mark.parametrize("name", NO_LOSS)
def test_a_step_without_a_loss_is_planned_as_xla_compiles_it(name):
  """deepseek-custom in its indexer's dense warm-up, without MTP (tests/data/xla_family): no loss term, and XLA keeps
  no forward, no backward and no gradients; the plan says so, within 1 % of XLA's peak (0.994-1.005 measured)."""
  d = grid_plan.results(FAMILY)[name]
  mem = _plan(d["keys"])
  assert mem.activations.phase == "step without a loss"
  assert abs(mem.needed / d["peak_bytes"] - 1) <= 0.01, (name, mem.needed / d["peak_bytes"])


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
  tabled = grid_plan.results(DATA, FAMILY)
  assert set(points) == {name for name, d in tabled.items() if d["ok"] or d.get("oom")} >= set(COMPILED) | set(REFUSED)
  for name, point in points.items():
    d = tabled[name]
    assert list(point.keys) == d["keys"]
    assert point.xla_peak == (d["peak_bytes"] if d["ok"] else None)
    assert point.oom_temp == (None if d["ok"] else d["oom_figures"].get("temp_bytes"))
    assert point.ours == int(_plan(d["keys"]).needed), f"{name}: rerun scripts/xla_grid_table.py --write"
    assert point.held_out == xla_grid.held_out(name)


def test_the_docs_table_is_the_scripts_output_on_these_figures():
  """docs/xla-grid.md is what scripts/xla_grid_table.py --write makes of tests/data/xla_ref, xla_family and xla_ours
  now."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  spec = importlib.util.spec_from_file_location("xla_grid_table", os.path.join(ROOT, "scripts", "xla_grid_table.py"))
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  with open(os.path.join(ROOT, "docs", "xla-grid.md"), encoding="utf-8") as f:
    written = f.read()
  assert written == grid_table.markdown(grid_table.rows([DATA, FAMILY], OURS), script.INTRO), (
      "rerun xla_grid_table.py --write")


def test_summary_names_the_nearest_grid_point_and_the_ratio_there(capsys):
  keys = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "per_device_batch_size=1", "max_target_length=300"]
  assert cli.main(["maxtext", *keys, "--topology", "v5p-8", "--summary", "--train", "adamw"]) == 0
  out = capsys.readouterr().out
  point = xla_grid.nearest(keys, "v5p-8")
  assert point.name == "tiny_v5p-8_b1_s256_mtp1"  # same model, topology, batch, policy; 256 the closest length
  ratio = point.ours / point.xla_peak
  fit = "held out of the plan's fit" if point.held_out else "a point the plan was fitted on"
  assert (f"Against XLA at the nearest grid point: tiny_v5p-8_b1_s256_mtp1 (MaxText 0.2.5 train_compile on "
          f"v5p-8): the plan there ") in out and f"(ours/XLA {ratio:.2f}; {fit})" in out
  assert cli.main(["maxtext", *keys, "--topology", "v5p-8", "--summary", "--train", "adamw", "--format", "json"]) == 0
  grid = json.loads(capsys.readouterr().out)["device_memory"]["xla_grid_point"]
  assert grid["name"] == "tiny_v5p-8_b1_s256_mtp1" and grid["xla_peak_bytes"] == point.xla_peak


def test_summary_at_a_refused_point_says_xla_refused_it_with_its_figure(capsys):
  keys = ["model_name=deepseek2-16b", "per_device_batch_size=24", "max_target_length=4096"]
  assert cli.main(["maxtext", *keys, "--topology", "v5p-8", "--summary", "--train", "adamw"]) == 1
  out = capsys.readouterr().out
  point = xla_grid.nearest(keys, "v5p-8")
  fit = "held out of the plan's fit" if point.held_out else "a point the plan was fitted on"
  assert (f"Against XLA at the nearest grid point: ds2-16b_v5p-8_b32_s4096 (MaxText 0.2.5 train_compile on "
          f"v5p-8): the plan there {summary_lib.human_bytes(point.ours)}; XLA refused it (HBM OOM: 105.82 GiB of "
          f"temporaries alone; {fit}).") in out
