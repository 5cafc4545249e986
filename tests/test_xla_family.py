"""Our `maxtext KEYS --topology T --compile --train OPT` is MaxText 0.2.5's program, family-wide: XLA's per-device
peak within 5 % of MaxText's own `train_compile` of the same keys and the arguments within 1 %
(tests/data/xla_family/NAME.json and tests/data/xla_ref/NAME.json, made in MaxText's venv: tests/data/README.md).

- Every point of the grid our side was compiled for (tests/data/xla_ours/NAME.json, scripts/ours_compile_cases.py:
  DeepSeek-V2, V3, V3.2, V4 and deepseek-custom presets on v5e, v5p and v6e slices, three optimizers, every remat
  policy) is held to those bounds.
- Where our program is not yet MaxText's (`APART`), the ratio measured is pinned (within half a percent), so that
  the gap is stated, and any change to it is seen.
- Two cheap points of it (batch 1 × 256 tokens on v5e-8: deepseek3-tiny and deepseek-custom) are
  compiled here again, now, through the installed command: the program as it is, not as it was when the files were
  written.
"""

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest

from inspect_tool.listings import grid_plan
from inspect_tool.listings import grid_table

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAXTEXT = grid_plan.results(*(os.path.join(ROOT, "tests", "data", d) for d in ("xla_ref", "xla_family")))
OURS = grid_plan.results(os.path.join(ROOT, "tests", "data", "xla_ours"))
COMPARED = sorted(name for name, d in OURS.items() if MAXTEXT.get(name, {}).get("ok") and d.get("ok"))
# Two live points keep the suite within its 15 minutes; the rest are stored (v5p: tests/test_xla_compile.py).
LIVE = ["tiny_v5e-8_b1_s256_mtp1", "custom_v5e-8_b1_s256"]
# Points where our peak is not within 5 % of MaxText's: ours / MaxText as measured (docs/xla-grid.md). Open: on v6e-8
# the same buffers placed otherwise by XLA's heap (at batch 2 x 1024 with custom remat, the bytes live at XLA's peak
# are within 1.2 % of MaxText's, the peak 1.11 x); on v5p-8, JAX's Megablox's backward beside MaxText's own kernel;
# V4 tiny on v5e-8 at 1 x 256: temporaries and arguments equal, XLA's generated code 75.2 MiB against 94.4; at
# 1 x 2048 (dot-product attention) temporaries of 933 MiB against 858 (our step's outputs leave V4's hash-routing
# tables out of the donated state: 65.2 MiB against 71.2).
APART = {"tiny_v6e-8_b16_s256_mtp1": 1.052, "tiny_v6e-8_b16_s256_mtp1_sgd": 1.053,
         "tiny_v6e-8_b2_s1024_mtp1_minimal_with_context": 1.057,
         "tiny_v6e-8_b2_s1024_mtp1_save_dot_except_mlpwi": 1.068, "tiny_v6e-8_b2_s1024_mtp1_save_qkv_proj": 1.078,
         "tiny_v6e-8_b2_s1024_mtp1_custom_out_proj": 1.111, "tiny_v5p-8_b1_s256_mtp1_minimal": 1.125,
         "v4tiny_v5e-8_b1_s256": 0.940, "v4tiny_v5e-8_b1_s2048": 1.052}
PINNED = 0.005


def _assert_maxtexts(name, xla):
  theirs = MAXTEXT[name]
  args = xla["argument_size_in_bytes"] / theirs["memory_analysis"]["argument_size_in_bytes"]
  peak = xla["peak_bytes"] / theirs["peak_bytes"]
  assert abs(args - 1) <= grid_table.ARGS_TOLERANCE, (name, "arguments", args)
  if name in APART:
    assert abs(peak - APART[name]) <= PINNED, (name, "peak, pinned", peak, APART[name])
  else:
    assert abs(peak - 1) <= grid_table.PEAK_TOLERANCE, (name, "peak", peak, xla["peak_bytes"], theirs["peak_bytes"])


def test_the_compared_points_span_the_family_chips_optimizers_and_policies():
  keys = [dict(k.split("=", 1) for k in MAXTEXT[n]["keys"]) for n in COMPARED]
  assert {k["model_name"] for k in keys} >= {"deepseek2-16b", "deepseek3-tiny", "deepseek3.2-671b", "deepseek4-tiny",
                                             "deepseek-custom"}
  assert {k["compile_topology"].split("-")[0] for k in keys} >= {"v5e", "v5p", "v6e"}
  assert {k.get("opt_type", "adamw") for k in keys} >= {"adamw", "sgd", "adam_pax"}
  assert len({k.get("remat_policy", "full") for k in keys}) >= 7  # 11 compared now; every policy: test_xla_grid
  assert set(LIVE) <= set(COMPARED) and not set(LIVE) & set(APART)
  assert 5 * len(APART) < len(COMPARED)  # the exceptions stay few


@pytest.mark.parametrize("name", COMPARED)
def test_our_compiled_step_is_maxtexts_at_every_compared_point(name):
  _assert_maxtexts(name, OURS[name]["xla"])


@pytest.mark.parametrize("name", LIVE)
def test_our_compiled_step_is_maxtexts_compiled_now(name):
  """With MaxText's compiler (the libtpu its figures were made with), the peak and the arguments as at every point;
  with another (the Python 3.11 stack's libtpu 0.0.42.1, whose buffer assignment differs: 0.73-1.48 x MaxText's
  0.0.50.1 peaks at these points) the arguments, which are the state and do not depend on it."""
  keys = MAXTEXT[name]["keys"]
  topology = grid_plan.topology_of(keys)
  own = [k for k in keys if not k.startswith(("compile_topology", "opt_type="))]
  result = subprocess.run([sys.executable, "-m", "inspect_tool", "maxtext", *own, "--topology", topology, "--compile",
                           "--train", grid_plan.optimizer_of(keys), "--format", "json"], capture_output=True,
                          text=True, cwd=ROOT, timeout=1800, check=False)
  assert result.returncode == 0, result.stderr
  xla = json.loads(result.stdout)["xla"]["train"]
  if importlib.metadata.version("libtpu") == MAXTEXT[name]["versions"]["libtpu"]:
    _assert_maxtexts(name, xla)
  else:
    args = xla["argument_size_in_bytes"] / MAXTEXT[name]["memory_analysis"]["argument_size_in_bytes"]
    assert abs(args - 1) <= grid_table.ARGS_TOLERANCE, (name, "arguments", args)
