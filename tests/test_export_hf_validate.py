"""`export --layout deepseek-fp8` is validated like with like: the export read back against the source run with the
layout's own numerics (128×128 e4m3 weights, 1×128 e4m3 activations), gated on KL (`--max-kl`, 0.015 nats), and
against the unquantized source (information); `--tokens`, `quantization_report.json` in DST; `forward --compare`
says what it compares and refuses to compare a model with itself.

References are test-side: the unquantized source is MaxText's own golden logits of the L4 checkpoint (our
unquantized forward equals them bit for bit, `tests/test_model_forward.py`); the export side is the model run on
weights that the numpy reference of DeepSeek's 128×128 format (`deepseek_fp8_reference`) quantized and dequantized,
each FP8 matrix taken from the source by MaxText's own contraction (`test_export_hf._reference_fp8`), with the
activations quantized 1×128 (`quant.act_tiles`, itself held against numpy in `test_act_tiles.py`); the figures are
computed here with numpy.
"""

import json
import os

import ml_dtypes
import numpy as np
import pytest

import deepseek_fp8_reference
import test_export_hf as hf_ref
import test_hf_restore as hf_rt
from test_hf_restore import batch_files, golden  # noqa: F401  (fixtures: MaxText's golden batch as .npy files)
from conftest import run_cli
from inspect_tool import cli, model
from inspect_tool.paramtree import params

L4, CKPT = hf_rt.L4, hf_rt.CKPT


@pytest.fixture(scope="module")
def validated(tmp_path_factory, batch_files):
  dst = tmp_path_factory.mktemp("export") / "fp8"
  code = cli.main(["export", *L4, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
                   "--tokens", batch_files[0], "--targets", batch_files[1]])
  assert code == 0
  with open(dst / "quantization_report.json", encoding="utf-8") as f:
    return str(dst), json.load(f)


def _dequantized_reference_arrays(cfg, source, files):
  """Model leaf key -> the export's weights: every FP8 matrix of `files` (the export's tensors, read by the
  `safetensors` library) dequantized by the numpy reference and put where MaxText's contraction takes it from; every
  other weight the source rounded to bf16, as the export stores it (the gate bias float32: test_hf_restore)."""
  keys = sorted(source)
  offsets, start = {}, 0
  for key in keys:
    offsets[key] = start
    start += source[key].size
  flat = np.concatenate([source[k].reshape(-1).astype(np.float32) for k in keys])
  # Each source element's global index + 1, mapped through MaxText's contraction: which element lands where.
  index = {k: (np.arange(source[k].size, dtype=np.float64) + offsets[k] + 1).reshape(source[k].shape) for k in keys}
  out = flat.astype(ml_dtypes.bfloat16).astype(np.float32)
  covered = []
  for name, matrix in hf_ref._reference_fp8(cfg, index).items():  # pylint: disable=protected-access
    where = matrix.astype(np.int64) - 1
    assert np.array_equal(where + 1, matrix)
    out[where] = deepseek_fp8_reference.block_dequantize(files[name], files[name + "_scale_inv"])
    covered.append(where.reshape(-1))
  # Each FP8 element once: attention 80,896 per layer × 5 (4 + MTP), the dense MLP 12,288, each MoE layer's
  # experts 196,608 and shared expert 12,288 × 4 (3 + MTP).
  covered = np.concatenate(covered)
  assert covered.size == len(np.unique(covered)) == 80_896 * 5 + 12_288 + (196_608 + 12_288) * 4
  arrays = {}
  for leaf in params.param_leaves(model.build_model(cfg, abstract=True), include_non_params=True):
    src_key = leaf.key if leaf.key in source else hf_rt.tree.param_key(leaf.key[2:])
    value = out[offsets[src_key]:offsets[src_key] + source[src_key].size].reshape(source[src_key].shape)
    arrays[leaf.key] = source[src_key] if leaf.key[-4:] == hf_rt.BIAS else value
  return arrays


def _figures(reference, candidate):
  """cosine (mean over positions), top-1 agreement, KL(ref || cand) (mean, nats), relative error: numpy."""
  r = np.asarray(reference, np.float64).reshape(-1, reference.shape[-1])
  c = np.asarray(candidate, np.float64).reshape(-1, candidate.shape[-1])
  cos = np.mean(np.sum(r * c, -1) / (np.linalg.norm(r, axis=-1) * np.linalg.norm(c, axis=-1)))
  lp = r - r.max(-1, keepdims=True)
  lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
  lq = c - c.max(-1, keepdims=True)
  lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
  kl = np.mean(np.sum(np.exp(lp) * (lp - lq), -1))
  return {"cosine": cos, "top1_agreement": np.mean(r.argmax(-1) == c.argmax(-1)), "kl": kl,
          "rel_error": np.linalg.norm(c - r) / np.linalg.norm(r)}


@pytest.fixture(scope="module")
def source():
  return hf_rt.source.__wrapped__()


def _reference_run(cfg, source, dst, golden):
  """The forward pass of the model holding the numpy-dequantized export, activations quantized 1x128 before every
  FP8 Linear, on the golden batch."""
  from inspect_tool.fp8_export import layout_numerics  # pylint: disable=import-outside-toplevel
  from inspect_tool.run import forward  # pylint: disable=import-outside-toplevel

  reference = model.build_model(cfg)
  files = hf_ref._read_tensors(dst)  # pylint: disable=protected-access
  params.assign_arrays(reference, _dequantized_reference_arrays(cfg, source, files))
  reference = layout_numerics.under_layout(reference, cfg)
  return forward.run_forward(reference, golden["tokens"], targets=golden["targets"],
                             target_mask=golden["target_mask"], positions=golden["positions"],
                             segment_ids=golden["segment_ids"])


def _assert_rows(rows, want_main, want_mtp, ref, rel=1e-9):
  rows = {r["head"]: r for r in rows}
  assert sorted(rows) == ["main", "mtp_1"]
  for head, want_logits, got_logits in (("main", want_main, ref.logits), ("mtp_1", want_mtp, ref.mtp_logits[0])):
    want = _figures(want_logits, np.asarray(got_logits))
    got = rows[head]
    assert got["positions"] == 32
    assert got["top1_agreement"] == want["top1_agreement"], head
    for figure in ("cosine", "rel_error", "kl"):  # the same weights: equal up to float64 summation order
      assert got[figure] == pytest.approx(want[figure], rel=rel, abs=0), (head, figure)
  return rows


def test_report_figures_equal_the_numpy_reference_against_maxtexts_golden(validated, golden, source):
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(L4)
  dst, report = validated
  ref = _reference_run(cfg, source, dst, golden)
  v = report["validation"]
  assert report["format"]["layout"] == "deepseek-fp8" and report["producer"]["name"] == "inspect_checkpoint"
  assert v["passed"] and v["max_kl"] == 0.015 and v["batch_shape"] == [2, 16] and v["tokens"].endswith("tokens.npy")
  assert v["gate"].startswith("kl of every head") and "1x128" in v["numerics"] and report["num_fp8"] == 232
  # Against its own numerics an exact write reads back exactly: measured KL 0, relative error 0.
  for row in v["vs_quantized_source"]:
    assert row["kl"] <= 1e-6 and row["rel_error"] <= 1e-6 and row["top1_agreement"] == 1.0, row
  rows = _assert_rows(v["vs_unquantized_source"], golden["logits"], golden["mtp_logits"], ref)
  # What block FP8 of the weights and 1x128 FP8 activations cost against MaxText's golden.
  assert rows["main"]["kl"] < 0.015 and rows["mtp_1"]["kl"] < 0.015


def test_the_configs_quantization_does_not_enter_the_layouts_validation(tmp_path, batch_files, validated):
  """quantization=fp8_full quantize_mtp=true: the export is DeepSeek's layout either way, validated under the
  layout's numerics, not the config's Qwix rules (which would quantize its weights a second time, per channel)."""
  keys = L4 + ["quantization=fp8_full", "quantize_mtp=true"]
  dst = tmp_path / "fp8"
  assert cli.main(["export", *keys, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
                   "--tokens", batch_files[0], "--targets", batch_files[1]]) == 0
  v = json.loads((dst / "quantization_report.json").read_text())["validation"]
  want = validated[1]["validation"]
  assert v["passed"] and v["vs_quantized_source"] == want["vs_quantized_source"]
  assert v["vs_unquantized_source"] == want["vs_unquantized_source"]


def test_a_wrong_write_fails_the_kl_gate_and_keeps_the_export_with_its_report(batch_files, tmp_path, capsys,
                                                                             monkeypatch):
  """Every weight_scale_inv written 1.5 times too large: KL far above 0.015 against the layout's numerics."""
  from inspect_tool.fp8_export import hf_matrices  # pylint: disable=import-outside-toplevel

  right = hf_matrices._block_quantize_transposed  # pylint: disable=protected-access
  monkeypatch.setattr(hf_matrices, "_block_quantize_transposed",
                      lambda w: (lambda q, scale, error: (q, scale * 1.5, error))(*right(w)))
  dst = tmp_path / "fp8"
  code, out, _ = run_cli(capsys, "export", *L4, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
                     "--tokens", batch_files[0], "--targets", batch_files[1])
  assert code == 1 and out.startswith("weights: ") and f"\nwrote {dst}: " in out
  assert out.rstrip().split("\n")[-1].startswith("FAILED: KL above 0.015 nats (")
  report = json.loads((dst / "quantization_report.json").read_text())
  assert report["validation"]["passed"] is False and report["validation"]["max_kl"] == 0.015
  assert min(row["kl"] for row in report["validation"]["vs_quantized_source"]) > 0.015
  assert {"config.json", "model.safetensors.index.json", "model-00001-of-00001.safetensors"} <= set(os.listdir(dst))
  assert [n for n in os.listdir(tmp_path) if n.startswith(".")] == []


def test_no_validate_is_recorded_and_the_export_reads_back_unchanged(tmp_path, capsys):
  dst = tmp_path / "fp8"
  code, out, _ = run_cli(capsys, "export", *L4, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
                     "--no-validate", "--format", "json")
  assert code == 0
  printed = json.loads(out)
  assert printed["validation"] == {"skipped": True, "reason": "--no-validate"}
  assert json.loads((dst / "quantization_report.json").read_text())["validation"] == printed["validation"]


def test_validation_that_does_not_fit_is_skipped_with_a_command_that_runs_it_as_printed(tmp_path, capsys,
                                                                                         monkeypatch, batch_files):
  import shlex  # pylint: disable=import-outside-toplevel
  from inspect_tool.streaming import budget  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import validate  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(validate, "memory_needed", lambda source_bytes: 3 * 10**9)  # more than the budget leaves
  held = budget.current_rss()  # this process's memory grows with the tests run before this one
  small = f"{(held + 15 * 10**8) // 10**6}MB"
  dst = tmp_path / "fp8"
  batch = ["--tokens", batch_files[0], "--targets", batch_files[1]]
  code, _, err = run_cli(capsys, "export", *L4, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8",
                     *batch, "--max-kl", "0.02", "--max-memory", small, "--format", "json")
  assert code == 0, err
  record = json.loads((dst / "quantization_report.json").read_text())["validation"]
  assert record["skipped"] and record["reason"].startswith("validation needs about 2.8 GiB")
  assert "validation skipped" in err and record["run_elsewhere"] in err
  printed = shlex.split(record["run_elsewhere"])
  assert printed[:2] == ["inspect_checkpoint", "export"] and printed[-3:-1] == ["--overwrite", "--max-memory"]
  assert printed[2:-3] == [*L4, "--checkpoint", CKPT, "--output", str(dst), "--layout", "deepseek-fp8", *batch,
                           "--max-kl", "0.02"]
  suggested = int(printed[-1].removesuffix("GB")) * 10**9  # the need beside what the process holds, rounded up
  assert 3 * 10**9 < suggested < 3 * 10**9 + budget.current_rss() + 10**9 + 2**28, printed[-1]
  code, out, err = run_cli(capsys, *printed[1:], "--format", "json")  # the suggestion, as printed: validation runs
  assert code == 0, out[-3000:] + err
  record = json.loads((dst / "quantization_report.json").read_text())["validation"]
  assert "skipped" not in record and record["passed"], record


def test_forward_compare_says_what_it_compares_and_refuses_a_model_with_itself(validated, batch_files, capsys):
  dst, _ = validated
  code, out, err = run_cli(capsys, "forward", *L4, "--checkpoint", dst, "--tokens", batch_files[0], "--compare")
  assert code == 2 and out == "" and len(err.strip().splitlines()) == 1
  assert "both sides would be the same model" in err and "quantization=''" in err
  code, out, err = run_cli(capsys, "forward", *L4, "quantization=fp8_full", "--checkpoint", dst, "--tokens",
                       batch_files[0], "--compare")
  assert code == 0, err
  compared = [line for line in out.splitlines() if line.startswith("compared: ")]
  assert compared == [f"compared: the Hugging Face checkpoint {dst} (FP8 weights dequantized) under "
                      "quantization=fp8_full (Qwix QT) vs the same weights unquantized"]
