"""`export quantization=int8` on MaxText's tiny checkpoint: MaxText 0.2.5's int8 rules (one Qwix QT rule, int8
weights and activations, `dot_general` over `decoder/.*layers.*`: the routed experts and the MTP block stay float),
written in Qwix's PTQ layout, held against Qwix's own PTQ of the same weights and MaxText's own int8 forward
(tests/data/golden/e_int8.npz, made by golden/make_golden.py)."""

import json
import os

from flax import nnx
import jax.numpy as jnp
import numpy as np
import pytest
import qwix

from inspect_tool import model as model_lib
from inspect_tool.configuration import config
from inspect_tool.coverage import trace
from inspect_tool.fp8_export import pipeline as export
from inspect_tool.run import runner
from quant import metrics

import golden_parity
from conftest import run_cli
from test_export import CKPT, TINY, _read

TOKENS = TINY + ["quantization=int8"]
INT8_GOLDEN = "e_int8.npz"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  return export.export(TOKENS, str(tmp_path_factory.mktemp("int8") / "out"), source=CKPT, command="pytest int8")


@pytest.fixture(scope="module")
def qwix_ptq():
  """Qwix's own PTQ of the checkpoint's float weights: the restored model wrapped by `qwix.quantize_model` with a
  `PtqProvider` over MaxText's int8 rules, whose one forward call quantizes every weight a rule reaches. Returns
  dotted weight key -> (qvalue, scale)."""
  cfg = config.resolve_config(TOKENS)
  args, kwargs = model_lib.qwix_init_inputs(cfg)
  model = qwix.quantize_model(runner.load_model(cfg, CKPT), qwix.PtqProvider(trace.config_rules(cfg)), *args,
                              **kwargs)
  arrays = {}
  for path, value in nnx.to_flat_state(nnx.state(model)):
    if path[-2:] in (("array", "qvalue"), ("array", "scale")):
      arrays.setdefault(".".join(("params", "params") + path[:-2]), {})[path[-1]] = np.asarray(value[...])
  return {key: (parts["qvalue"], parts["scale"]) for key, parts in arrays.items()}


def test_the_export_stores_what_qwix_ptq_makes_of_the_same_weights_bit_for_bit(exported, qwix_ptq):
  """The same 17 weights (attention, dense MLP, router, shared experts; no routed expert, no MTP weight), every
  int8 value and bfloat16 scale equal to Qwix PTQ's (measured: bit for bit)."""
  quantized = {w.to_dict()["key"].replace("/", ".") for w in exported.report.weights}
  assert quantized == set(qwix_ptq) and len(quantized) == 17
  assert not any("MoeBlock_0.wi_" in k or "MoeBlock_0.wo" in k or "mtp_block" in k for k in quantized)
  for key, (qvalue, scale) in qwix_ptq.items():
    stored_q, stored_s = _read(exported.dst, key + ".array.qvalue"), _read(exported.dst, key + ".array.scale")
    assert stored_q.dtype == np.int8 and qvalue.dtype == np.int8, key
    np.testing.assert_array_equal(stored_q, qvalue, err_msg=key)
    assert stored_s.dtype == scale.dtype == jnp.bfloat16, key
    np.testing.assert_array_equal(stored_s.view(np.uint16), scale.view(np.uint16), err_msg=key)
  for name in ("params.params.token_embedder.embedding", "params.params.decoder.moe_layers.DeepSeekMoeBlock_0."
               "MoeBlock_0.wi_0", "params.params.mtp_block.mtp_layer_1.mtp_1_projection.kernel"):
    np.testing.assert_array_equal(_read(exported.dst, name), _read(CKPT, name))  # copied as stored


def test_the_manifest_records_int8_and_the_error_of_qwixs_values(exported, qwix_ptq):
  """Every quantized entry is int8 with its layout naming it; its error figures are those of Qwix PTQ's values
  against the float32 source (numpy here)."""
  doc = json.load(open(os.path.join(exported.dst, "export_manifest.json"), encoding="utf-8"))
  entries = {e["name"]: e for e in doc["tensors"]}
  assert doc["totals"]["quantized"] == 17
  for key, (qvalue, scale) in qwix_ptq.items():
    entry = entries[key + ".array.qvalue"]
    assert entry["quantized"] and entry["dtype"] == "int8" and "int8" in entry["scale"]["layout"]
    error = np.abs(qvalue.astype(np.float32) * scale.astype(np.float32) - _read(CKPT, key).astype(np.float32))
    assert entry["error"]["elements"] == error.size
    assert entry["error"]["max_abs"] == pytest.approx(float(error.max()), rel=1e-6)
    assert entry["error"]["mean_abs"] == pytest.approx(float(error.mean(dtype=np.float64)), rel=1e-6)
  assert exported.report.manifest["quantized"] == 17


def test_the_export_runs_as_maxtexts_own_int8_forward(exported, capsys, tmp_path):
  """`forward quantization=int8` on the export reproduces MaxText 0.2.5's int8 forward of the source checkpoint
  (golden e; measured bit for bit on MaxText's stack, main and MTP), which stands 0.0336 / 0.0329 from the
  unquantized golden a."""
  logits = tmp_path / "logits.npz"
  code, out, err = run_cli(capsys, "forward", *TOKENS, "--checkpoint", exported.dst, "--save-logits", str(logits))
  assert code == 0, err
  assert f"weights: int8 export {os.path.abspath(exported.dst)}" in out.splitlines()
  saved, golden = np.load(logits), golden_parity.load(INT8_GOLDEN)
  plain = golden_parity.load(golden_parity.UNQUANTIZED)
  for head, ours, want, unquantized in (("main", saved["logits"], golden["logits"], plain["logits"]),
                                        ("mtp", saved["mtp_logits"][0], golden["mtp_logits"], plain["mtp_logits"])):
    golden_parity.assert_fp8_reproduces(ours, want, head)
    np.testing.assert_array_equal(ours.argmax(-1), want.argmax(-1))
    assert golden_parity.rel(ours, unquantized) >= 0.03  # quantized at all (measured 0.0336 / 0.0329)
  code, _, err = run_cli(capsys, "forward", *TINY, "--checkpoint", exported.dst)
  assert code == 2 and len(err.splitlines()) == 1
  assert "is an int8 export" in err and "quantization=int8" in err


def test_listing_diff_and_verify_take_the_int8_export(exported, capsys):
  code, out, err = run_cli(capsys, "orbax", "--path", exported.dst, "--check_dtype")
  assert code == 0 and "an int8 export (" in err
  assert ("key: params.params.decoder.moe_layers.self_attention.wq_a.kernel.array.qvalue | shape: (64, 3, 32) | "
          "dtype: int8") in out.splitlines()
  code, out, _ = run_cli(capsys, "diff", *TOKENS, "--path", exported.dst)
  assert code == 0 and "AGREE: model and checkpoint agree (70 weights)" in out
  code, out, _ = run_cli(capsys, "diff", *TINY, "--path", exported.dst)
  assert code == 1 and "the checkpoint is an int8 export but the model has no quantization → quantization=int8" in out
  code, out, _ = run_cli(capsys, "verify", exported.dst)
  assert code == 0 and out.startswith(f"verified {exported.dst}: 70 tensors")


def test_validation_is_gated_on_kl_and_costs_what_int8_costs_in_maxtext(exported):
  """Against the source under the same rules (Qwix QT): KL 0, exact; against the unquantized source: the figures of
  MaxText's own int8 golden against its unquantized one (cosine, top-1, KL, relative error)."""
  validation = exported.validation
  assert validation.passed and exported.report.to_dict()["validation"]["passed"]
  for row in validation.vs_quantized:
    assert row.kl == 0.0 and row.rel_error == 0.0 and row.top1_agreement == 1.0
  plain, golden = golden_parity.load(golden_parity.UNQUANTIZED), golden_parity.load(INT8_GOLDEN)
  want = [metrics.compare_logits("main", plain["logits"], golden["logits"]),
          metrics.compare_logits("mtp_1", plain["mtp_logits"], golden["mtp_logits"])]
  for row, expected in zip(validation.vs_unquantized, want):
    assert row.head == expected.head and row.top1_agreement == expected.top1_agreement
    for field in ("cosine", "kl", "rel_error"):
      assert getattr(row, field) == pytest.approx(getattr(expected, field), rel=1e-5, abs=0), field


@pytest.mark.parametrize("layout", [["--layout", "deepseek-fp8"], ["--layout", "deepseek-fp8", "--scale-fmt", "ue8m0"],
                                    ["--layout", "deepseek-v4"]])
def test_int8_with_a_deepseek_fp8_layout_is_one_line_exit_2(layout, capsys, tmp_path):
  dst = tmp_path / "out"
  code, out, err = run_cli(capsys, "export", *TOKENS, "--checkpoint", CKPT, "--output", str(dst), *layout)
  assert code == 2 and not out and len(err.splitlines()) == 1
  assert f"quantization=int8 with {' '.join(layout)}" in err and "--layout orbax" in err
  assert not dst.exists() and os.listdir(tmp_path) == []


def test_other_integer_types_are_refused_naming_what_exports(capsys, tmp_path):
  code, _, err = run_cli(capsys, "export", *TINY, "quantization=int4", "--checkpoint", CKPT, "--output",
                      str(tmp_path / "out"))
  assert code == 2 and len(err.splitlines()) == 1
  assert "unsupported quantization type 'int4'; accepted: float8_e4m3fn, float8_e5m2, int8" in err
