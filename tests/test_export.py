"""`export` on MaxText's tiny checkpoint: which weights become FP8 and how, the round trip through `orbax`, `diff`
and `forward`, parity with MaxText's fp8_full golden outputs, the report, safe writes and sharding."""

import errno
import json
import os
import shutil
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import qwix
import tensorstore as ts

from inspect_tool import errors
from inspect_tool.fp8_export import pipeline as export
from inspect_tool.coverage import plan as export_plan
from inspect_tool.fp8_export import validate as export_validate
from quant import metrics
from inspect_tool.checkpoint import orbax_metadata

import golden_parity

from conftest import REPO
from conftest import DATA
from conftest import run_cli
CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
TINY = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024"]
MOE = "params.params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0"
MTP = "params.params.mtp_block.mtp_layer_1"
MTP_MOE = MTP + ".mtp_1_transformer_layer.DeepSeekMoeBlock_0.MoeBlock_0"


def _tokens(quantize_mtp):
  return TINY + ["quantization=fp8_full", f"quantize_mtp={str(quantize_mtp).lower()}"]


def _one_device_mesh():
  return jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
  root = tmp_path_factory.mktemp("exports")
  return {mtp: export.export(_tokens(mtp), str(root / f"mtp_{mtp}"), source=CKPT, command="pytest export",
                             mesh=_one_device_mesh()) for mtp in (False, True)}


def _leaves(path):
  return {l.dotted: l for l in orbax_metadata.read_leaves(path)}


def _read(path, dotted):
  """An array of an Orbax checkpoint read with tensorstore alone (independent of our restore code)."""
  listing = orbax_metadata.read_listing(path)
  raw = listing.raw_keys[tuple(dotted.split("."))]
  items = os.path.abspath(listing.resolved.items_dir)
  spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{items}/"},
          "path": ".".join(map(str, raw)) + "/"}
  return ts.open(spec).result().read().result()


_rel = golden_parity.rel



# What becomes FP8 ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quantize_mtp", [False, True])
def test_expected_weights_are_fp8_and_everything_else_is_copied(exports, quantize_mtp):
  leaves = _leaves(exports[quantize_mtp].dst)
  fp8 = {k for k, l in leaves.items() if l.dtype == "float8_e4m3fn"}
  for name in ("wi_0", "wi_1", "wo", "gate.kernel"):  # decoder experts and router, always
    assert f"{MOE}.{name}.array.qvalue" in fp8 and f"{MOE}.{name}.array.scale" in leaves
  mtp_weights = [f"{MTP_MOE}.wi_0", f"{MTP_MOE}.wo", f"{MTP}.mtp_1_projection.kernel"]
  for name in mtp_weights:
    assert (f"{name}.array.qvalue" in fp8) == quantize_mtp
    assert (name in leaves) == (not quantize_mtp)
    if not quantize_mtp:
      assert leaves[name].dtype == "float32"
  for copied in ("params.params.decoder.logits_dense.kernel", "params.params.token_embedder.embedding",
                 "params.params.decoder.decoder_norm.scale", f"{MOE}.gate.bias", f"{MTP}.mtp_1_final_norm.scale"):
    assert leaves[copied].dtype == "float32"
  assert len(fp8) == (33 if quantize_mtp else 20)
  assert all(not k.endswith("qvalue") or l.dtype == "float8_e4m3fn" for k, l in leaves.items())


def test_scales_have_the_forward_pass_granularity(exports):
  leaves = _leaves(exports[True].dst)

  def scale(name):
    leaf = leaves[name + ".array.scale"]
    return leaf.shape, leaf.dtype

  assert scale(f"{MOE}.wi_0") == ((1, 3, 1, 64), "bfloat16")  # per output column, per layer, shared by experts
  assert scale(f"{MTP_MOE}.wo") == ((1, 1, 64), "bfloat16")
  assert scale("params.params.decoder.moe_layers.self_attention.wq_b.kernel") == ((1, 3, 4, 192), "bfloat16")
  assert scale("params.params.decoder.moe_layers.self_attention.out.kernel") == ((1, 3, 1, 64), "bfloat16")
  assert scale(f"{MTP}.mtp_1_projection.kernel") == ((1, 64), "bfloat16")
  assert leaves[f"{MOE}.wi_0.array.qvalue"].shape == (16, 3, 64, 64)  # scanned stacks stay scanned


def test_stored_values_are_qwix_quantization_of_the_bf16_source_and_copies_are_exact(exports):
  """Against Qwix's own `quantize` of the source weight cast to the compute dtype (bf16), absmax, with the scale
  axes the test names, on a CPU: bit for bit (measured), also when the export quantized on a TPU."""
  dst = exports[True].dst
  for name, axes in ((f"{MOE}.wo", [1, 3]), ("params.params.decoder.dense_layers.self_attention.wkv_b.kernel",
                                              [1, 2, 3])):
    with jax.default_device(jax.devices("cpu")[0]):  # Qwix as it computes on a CPU (a TPU host exports those bytes)
      source = jnp.asarray(_read(CKPT, name)).astype(jnp.bfloat16)
      expected = qwix.quantize(source, jnp.float8_e4m3fn, channelwise_axes=axes, calibration_method="absmax")
    np.testing.assert_array_equal(_read(dst, name + ".array.qvalue").view(np.uint8),
                                  np.asarray(expected.qvalue).view(np.uint8))
    np.testing.assert_array_equal(_read(dst, name + ".array.scale"), np.asarray(expected.scale))
  for name in ("params.params.token_embedder.embedding", f"{MOE}.gate.bias"):
    np.testing.assert_array_equal(_read(dst, name), _read(CKPT, name))


# Parity and the round trip -------------------------------------------------------------------------------------


def _assert_reproduces_fp8_golden(logits, mtp, quantize_mtp):
  """Measured (tests/README.md): bit for bit on MaxText's stack; 0.1107 (main), 0.0997 / 0.1249 (MTP) from the
  unquantized golden; MTP 0.0775 from the other quantize_mtp golden."""
  golden, other, plain = (golden_parity.load(golden_parity.FP8[quantize_mtp]),
                          golden_parity.load(golden_parity.FP8[not quantize_mtp]),
                          golden_parity.load(golden_parity.UNQUANTIZED))
  golden_parity.assert_fp8_reproduces(logits, golden["logits"], "main")
  golden_parity.assert_top1(np.asarray(logits).argmax(-1), golden["top1"], "fp8", "main")
  golden_parity.assert_fp8_reproduces(mtp, golden["mtp_logits"], "mtp")
  golden_parity.assert_top1(np.asarray(mtp).argmax(-1), golden["mtp_top1"], "fp8", "mtp")
  away = golden_parity.AWAY
  assert _rel(logits, plain["logits"]) >= away and _rel(mtp, plain["mtp_logits"]) >= away
  if not golden_parity.ON_TPU:
    assert _rel(mtp, golden["mtp_logits"]) < _rel(mtp, other["mtp_logits"])


def test_exported_model_without_mtp_quantization_reproduces_maxtext_golden(exports):
  result = exports[False].validation.result
  _assert_reproduces_fp8_golden(result.logits, result.mtp_logits[0], quantize_mtp=False)


def test_forward_loads_the_export_into_the_quantized_model_and_reproduces_maxtext_golden(exports, capsys, tmp_path):
  logits = tmp_path / "logits.npz"
  code, out, err = run_cli(capsys, "forward", *_tokens(True), "--checkpoint", exports[True].dst, "--save-logits",
                        str(logits))
  assert code == 0, err
  assert "mtp depth 1" in out and f"weights: FP8 export {os.path.abspath(exports[True].dst)}" in out.splitlines()
  saved = np.load(logits)
  _assert_reproduces_fp8_golden(saved["logits"], saved["mtp_logits"][0], quantize_mtp=True)
  code, _, err = run_cli(capsys, "forward", *TINY, "--checkpoint", exports[True].dst)
  assert code == 2 and "quantization=fp8_full quantize_mtp=true" in err and len(err.splitlines()) == 1


def test_megablox_false_export_reproduces_maxtexts_megablox_false_forward(tmp_path):
  """The export run through Qwix's quantized ragged_dot equals its source under the same rules (measured 0) and
  MaxText's own megablox=false forward (golden d, measured bit for bit)."""
  result = export.export(_tokens(True) + ["megablox=false"], str(tmp_path / "out"), source=CKPT)
  assert len(result.report.weights) == 33
  for row in result.validation.vs_quantized:
    if golden_parity.ON_TPU:  # measured on a TPU v5e: main 0.0322 (top-1 31 of 32, KL 5.1e-4)
      assert row.kl <= result.validation.max_kl and row.rel_error <= golden_parity.TPU_BOUND[
          ("fp8", "main" if row.head == "main" else "mtp")], row
      continue
    assert row.top1_agreement == 1.0 and row.rel_error == 0.0
  golden = golden_parity.load(golden_parity.MEGABLOX_FALSE)
  golden_parity.assert_fp8_reproduces(result.validation.result.logits, golden["logits"], "main", exact=True)
  golden_parity.assert_fp8_reproduces(result.validation.result.mtp_logits[0], golden["mtp_logits"], "mtp", exact=True)


def test_orbax_listing_shows_fp8_and_diff_understands_the_export(exports, capsys):
  dst = exports[True].dst
  code, out, _ = run_cli(capsys, "orbax", "--path", dst, "--check_dtype=true")
  assert code == 0
  assert f"key: {MOE}.wi_0.array.qvalue | shape: (16, 3, 64, 64) | dtype: float8_e4m3fn" in out
  code, out, _ = run_cli(capsys, "diff", *_tokens(True), "--path", dst)
  assert code == 0 and "AGREE" in out
  code, out, _ = run_cli(capsys, "diff", *_tokens(False), "--path", dst)
  assert code == 1 and "quantize_mtp=true" in out
  code, out, _ = run_cli(capsys, "diff", *TINY, "--path", dst)
  assert code == 1 and "quantization=fp8_full quantize_mtp=true" in out


# The report ----------------------------------------------------------------------------------------------------


def test_report_records_rules_coverage_weights_validation_and_provenance(exports):
  with open(os.path.join(exports[True].dst, "quantization_report.json"), encoding="utf-8") as f:
    report = json.load(f)
  assert report["producer"]["name"] == "inspect_checkpoint" and report["producer"]["version"]
  assert report["source"]["checkpoint"] == os.path.abspath(CKPT) and report["command"] == "pytest export"
  assert report["config"]["overrides"] == _tokens(True)
  assert report["rules"][0]["module_path"] == "(decoder/.*layers.*|mtp_block/.*)"
  assert {g["group"]: g["quantized_weights"] for g in report["coverage"]["groups"]} == {
      "decoder": 20, "mtp": 13, "head": 0}
  weights = {w["key"]: w for w in report["weights"]}
  wi_0 = weights["params/params/decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0/wi_0"]
  assert wi_0["qtype"] == "float8_e4m3fn" and wi_0["scale_shape"] == [1, 3, 1, 64] and wi_0["kind"] == "grouped"
  assert len(weights) == 33 and len(report["copied"]) == 20
  validation = report["validation"]
  assert validation["passed"] and validation["max_kl"] == 0.015 and validation["batch_shape"] == [2, 16]
  assert [r["head"] for r in validation["vs_quantized_source"]] == ["main", "mtp_1"]
  for row in validation["vs_quantized_source"]:  # the export reproduces the quantization-applied model: measured 0
    if golden_parity.ON_TPU:  # there the source's dense layers are quantized by Qwix inside the compiled forward,
      # whose division rounds as the TPU does (the export's bytes are the CPU's): measured 0.0949 / 0.1150, KL 0.0044 /
      # 0.0066 on a TPU v5e (docs/benchmarks.md), as far as any two fp8 results on the chip (`TPU_BOUND`)
      assert row["kl"] <= validation["max_kl"] and row["rel_error"] <= golden_parity.TPU_BOUND[
          ("fp8", "main" if row["head"] == "main" else "mtp")], row
      continue
    assert row["top1_agreement"] == 1.0 and row["rel_error"] == 0.0 and row["kl"] == 0.0
  # The cost of quantizing, as MaxText's own goldens show it (measured rel_error 0.1107 main, 0.1249 MTP).
  for row, want in zip(validation["vs_unquantized_source"], golden_parity.maxtext_fp8_cost(), strict=True):
    golden_parity.assert_same_cost(row, want)


def test_validation_above_max_kl_exits_1_and_keeps_the_report(tmp_path, capsys, monkeypatch):
  def failing(cfg, source, exported, data, *, max_kl, mesh=None, tokens="fixed"):
    del cfg, source, exported, mesh
    row = metrics.HeadComparison("main", 0.9, 0.5, 0.1, 0.3, 32)
    return export_validate.Validation((row,), (row,), max_kl, tuple(data.tokens.shape), tokens)

  monkeypatch.setattr(export_validate, "validate", failing)
  tokens = tmp_path / "tokens.npy"
  np.save(tokens, (np.arange(24).reshape(2, 12) * 7 % 1024).astype(np.int32))
  dst = tmp_path / "out"
  code, out, _ = run_cli(capsys, "export", *_tokens(False), "--checkpoint", CKPT, "--output", str(dst), "--tokens",
                      str(tokens), "--max-kl", "0.05")
  assert code == 1 and out.rstrip().endswith("FAILED: KL above 0.05 nats (main 0.1)")
  report = json.loads((dst / "quantization_report.json").read_text())
  assert report["validation"]["passed"] is False and report["validation"]["batch_shape"] == [2, 12]
  assert report["validation"]["tokens"] == str(tokens)


def test_validation_names_its_three_forward_passes_off_a_terminal_when_they_take_long(tmp_path, capsys, monkeypatch):
  from inspect_tool import progress  # pylint: disable=import-outside-toplevel

  code, _, err = run_cli(capsys, "export", *_tokens(False), "--checkpoint", CKPT, "--output", str(tmp_path / "quick"))
  assert code == 0 and err == "", err  # seconds each: nothing but the result in a pipe
  monkeypatch.setattr(progress, "PLAIN_AFTER_SECONDS", 0.0)  # as passes of a large model take
  code, _, err = run_cli(capsys, "export", *_tokens(False), "--checkpoint", CKPT, "--output", str(tmp_path / "out"))
  assert code == 0, err
  stages = [line.split("… ")[0] for line in err.splitlines() if "… " in line]  # capsys: stderr is no terminal
  assert stages == ["validation 1/3: source under the export's numerics", "validation 2/3: source unquantized",
                    "loading the exported checkpoint", "validation 3/3: the export read back"], err


def test_export_with_random_init_exports_the_seeded_init_and_says_so(tmp_path, capsys):
  from inspect_tool import model  # pylint: disable=import-outside-toplevel
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel

  dst = tmp_path / "init"
  code, out, err = run_cli(capsys, "export", *_tokens(False), "--random-init", "--output", str(dst),
                         "--no-validate")
  assert code == 0, err
  assert "validation skipped" in out and out.splitlines()[0] == "weights: random init, seed 0"
  report = json.loads((dst / "quantization_report.json").read_text())
  assert report["source"] == {"checkpoint": None, "init": "random (seed 0)"} and report["validation"] == {
      "skipped": True, "reason": "--no-validate"}
  init = model.build_model(config.resolve_config(_tokens(False)), abstract=False)
  np.testing.assert_array_equal(_read(str(dst), "params.params.token_embedder.embedding"),
                                np.asarray(init.token_embedder.embedding.get_value()))


def test_layout_deepseek_fp8_writes_hugging_face_safetensors(tmp_path, capsys):
  dst = tmp_path / "hf"
  code, out, err = run_cli(capsys, "export", *TINY, "--checkpoint", CKPT, "--output", str(dst), "--layout",
                        "deepseek-fp8", "--no-validate")
  assert code == 0, err
  assert out.startswith(f"weights: Orbax checkpoint {CKPT}") and f"\nwrote {dst}: " in out
  assert "128x128 block scales" in out
  assert {"config.json", "model.safetensors.index.json"} <= set(os.listdir(dst))
  assert _leftovers(tmp_path) == []


# Safe writes and errors ----------------------------------------------------------------------------------------


def _previous(tmp_path):
  """An earlier export at DST (only such a directory, or an Orbax checkpoint, may be replaced by --overwrite)."""
  dst = tmp_path / "dst"
  dst.mkdir()
  (dst / "marker").write_text("previous")
  (dst / "quantization_report.json").write_text(json.dumps({"producer": {"name": "inspect_checkpoint"}}))
  return dst


def _leftovers(parent):
  return [n for n in os.listdir(parent) if n.startswith(".")]


def test_existing_output_is_refused_without_overwrite_before_any_work(tmp_path, capsys):
  dst = _previous(tmp_path)
  code, _, err = run_cli(capsys, "export", *_tokens(False), "--checkpoint", CKPT, "--output", str(dst))
  assert code == 2 and "already exists; pass --overwrite" in err and len(err.splitlines()) == 1
  assert (dst / "marker").read_text() == "previous"


def test_disk_full_is_one_line_exit_2_and_the_previous_output_survives(tmp_path, capsys, monkeypatch):
  from inspect_tool.streaming import orbax_writer  # pylint: disable=import-outside-toplevel

  class _Full:  # a destination array (and its kvstore) whose every write fails as a full disk makes tensorstore fail
    kvstore = property(lambda self: self)

    def __getitem__(self, index):
      return self

    def write(self, *value):
      raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(orbax_writer.OrbaxArrayWriter, "create_many", lambda self, arrays: [_Full() for _ in arrays])
  dst = _previous(tmp_path)
  code, _, err = run_cli(capsys, "export", *_tokens(False), "--checkpoint", CKPT, "--output", str(dst),
                      "--overwrite", "--no-validate")
  assert code == 2 and err.startswith("error: cannot write") and "no space left on device" in err
  assert len(err.splitlines()) == 1
  assert sorted(os.listdir(dst)) == ["marker", "quantization_report.json"] and _leftovers(tmp_path) == []


def test_deepseek_fp8_disk_full_is_one_line_naming_the_destination(tmp_path, capsys, monkeypatch):
  from inspect_tool.output import destination  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import safetensors_writer  # pylint: disable=import-outside-toplevel

  def full(*args):
    raise OSError(errno.ENOSPC, "No space left on device")

  monkeypatch.setattr(safetensors_writer.os, "pwrite", full)
  dst = _previous(tmp_path)
  code, _, err = run_cli(capsys, "export", *TINY, "--checkpoint", CKPT, "--output", str(dst), "--layout",
                      "deepseek-fp8", "--overwrite", "--no-validate")
  assert code == 2 and len(err.splitlines()) == 1, err
  assert err.startswith(f"error: cannot write '{dst}{os.sep}") and "No space left on device" in err
  assert destination.temp_prefix(str(dst)) not in err  # not the temporary directory it was written in
  assert sorted(os.listdir(dst)) == ["marker", "quantization_report.json"] and _leftovers(tmp_path) == []


def test_permission_denied_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
  def denied(*args, **kwargs):
    raise PermissionError(errno.EACCES, "Permission denied")

  monkeypatch.setattr(tempfile, "mkdtemp", denied)
  code, _, err = run_cli(capsys, "export", *_tokens(False), "--checkpoint", CKPT, "--output", str(tmp_path / "out"),
                      "--no-validate")
  assert code == 2 and "permission denied" in err and len(err.splitlines()) == 1
  assert not (tmp_path / "out").exists()


def test_corrupt_source_is_one_line_exit_2(tmp_path, capsys):
  source = tmp_path / "ckpt"
  shutil.copytree(CKPT, source)
  data_dir = source / "0" / "items" / "d"
  for name in os.listdir(data_dir):
    (data_dir / name).write_bytes(b"\0garbage")
  code, _, err = run_cli(capsys, "export", *_tokens(False), "--checkpoint", str(source), "--output",
                      str(tmp_path / "out"), "--no-validate")
  assert code == 2 and err.startswith("error: ") and len(err.splitlines()) == 1
  assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_an_export_is_not_accepted_as_source_and_quantization_is_required(exports, tmp_path):
  with pytest.raises(errors.InputError, match="already an FP8 export"):
    export.export(_tokens(True), str(tmp_path / "again"), source=exports[True].dst)
  with pytest.raises(errors.ConfigError, match="quantization=fp8_full"):
    export_plan.plan_export(export.config_lib.resolve_config(TINY))


# Sharding ------------------------------------------------------------------------------------------------------

_SHARDED = """
import json, sys
import jax
from inspect_tool.fp8_export import pipeline
assert jax.device_count() == 4, jax.devices()
result = pipeline.export(sys.argv[2:], sys.argv[1], source=%r, run_validation=False)
print(json.dumps(result.report.to_dict()["mesh"]))
""" % CKPT


def test_export_sharded_over_four_devices_writes_the_same_bytes(exports, tmp_path):
  dst = tmp_path / "four"
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, "-c", _SHARDED, str(dst)] + _tokens(False), capture_output=True, text=True,
                       env=env, cwd=REPO, check=False)
  assert out.returncode == 0, out.stderr[-2000:]
  assert json.loads(out.stdout.strip().splitlines()[-1]) == {"devices": 4}
  assert exports[False].report.to_dict()["mesh"] == {"devices": 1}
  one, four = _leaves(exports[False].dst), _leaves(str(dst))
  assert one == four
  for name, leaf in one.items():
    a, b = _read(exports[False].dst, name), _read(str(dst), name)
    assert a.tobytes() == b.tobytes(), name
