"""The manifest's figures taken while the export writes: every sha256 against hashlib over the array's C-order bytes
however the boxes come (in order, out of order, in two passes, shared by two processes), the scale counts against
numpy, and the quantizer's error figures against numpy in float64 on the source."""

from __future__ import annotations

import hashlib
import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import export_sources
from inspect_tool.configuration import config
from inspect_tool.coverage import plan as plan_lib
from inspect_tool.fp8_export import quantize
from inspect_tool.manifest import build
from inspect_tool.manifest import digests as digests_lib
from inspect_tool.manifest import stored
from inspect_tool.manifest import tally as tally_lib
from inspect_tool.paramtree import params
from inspect_tool.streaming import budget
from inspect_tool.streaming import read
from inspect_tool.streaming import read_plan
from inspect_tool.streaming import write_orbax
from quant import dequant_error
from quant import fp8
from quant import microscaling
from quant import microscaling_quantize
from test_export_memory import _arrays

E4M3_MAX = 448.0


def _sha(value: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()


def _boxes(shape, block, rng) -> list[tuple[slice, ...]]:
  return [tuple(box) for box in rng.permutation(np.array(read_plan.boxes(shape, block), dtype=object))]


@pytest.mark.parametrize("shape, block, dtype", [
    ((16, 3, 8, 64), (16, 1, 8, 64), ml_dtypes.float8_e4m3fn),  # experts cut along layers: no box is a run
    ((16, 3, 8, 64), (4, 3, 2, 16), np.float32),  # two-pass boxes, every axis cut
    ((7, 5, 3), (2, 5, 3), ml_dtypes.bfloat16),  # runs, shuffled
    ((1000,), (7,), np.int8),
    ((), (), np.float32),
])
@pytest.mark.parametrize("memory", [0, 1 << 30])  # the boxes out of order kept in a scratch file, or in memory
def test_boxes_in_any_order_hash_as_the_c_order_bytes(tmp_path, shape, block, dtype, memory):
  rng = np.random.default_rng(0)
  value = rng.standard_normal(shape).astype(np.float32).astype(dtype)
  digests = digests_lib.Digests(str(tmp_path))
  digests.track("x", shape, dtype, memory)
  for box in _boxes(shape, block, rng) if shape else [()]:
    digests.add("x", box, value[box])
  assert digests.found() == {"x": [_sha(value), 0, 0, 0]}
  assert os.listdir(tmp_path) == [] and digests.held_bytes == 0  # the scratch file had no name, and is gone


def test_boxes_in_order_are_hashed_as_they_come_and_never_assembled(tmp_path):
  value = np.arange(6 * 4 * 5, dtype=np.float32).reshape(6, 4, 5)
  digests = digests_lib.Digests(str(tmp_path / "missing"))  # assembling it in a scratch file would fail
  digests.track("x", value.shape, value.dtype)
  for box in read_plan.boxes(value.shape, (1, 2, 5)):
    digests.add("x", box, value[box]).result()
  assert digests.found() == {"x": [_sha(value), 0, 0, 0]}


def test_the_gathered_windows_are_small_and_still_give_the_hash(tmp_path, monkeypatch):
  monkeypatch.setattr(digests_lib, "WINDOW_BYTES", 40)  # windows of 10 float32 values, cutting the last axis too
  rng = np.random.default_rng(1)
  value = rng.standard_normal((5, 4, 23)).astype(np.float32)
  digests = digests_lib.Digests(str(tmp_path))  # no memory: a scratch file
  digests.track("x", value.shape, value.dtype)
  boxes = read_plan.boxes(value.shape, (5, 1, 23))
  digests.add("x", boxes[0], value[boxes[0]])  # the first box starts the stream, the others do not continue it
  for box in boxes[1:][::-1]:
    digests.add("x", box, value[box])
  assert digests.found() == {"x": [_sha(value), 0, 0, 0]}


@pytest.mark.parametrize("memory", [0, 1 << 20])
def test_tensors_out_of_order_one_after_another_use_one_buffer_or_scratch_file_again(tmp_path, memory):
  rng = np.random.default_rng(5)
  values = {name: rng.standard_normal((8, 3, 16)).astype(np.float32) for name in "abc"}
  digests = digests_lib.Digests(str(tmp_path))
  futures = []
  for name, value in values.items():
    digests.track(name, value.shape, value.dtype, memory)
    futures += [digests.add(name, box, value[box]) for box in read_plan.boxes(value.shape, (8, 1, 16))[::-1]]
  for future in futures:
    future.result()
  assert digests.held_bytes == (values["a"].nbytes if memory else 0)  # one buffer, used by each in turn
  assert digests.found() == {name: [_sha(value), 0, 0, 0] for name, value in values.items()}
  assert digests.held_bytes == 0 and os.listdir(tmp_path) == []


def test_without_scratch_files_a_tensor_out_of_order_beyond_memory_is_left_to_be_read_back(tmp_path):
  value = np.arange(4 * 6, dtype=np.float32).reshape(4, 6)
  digests = digests_lib.Digests(str(tmp_path), scratch=False)  # gs://: nothing on local disk
  digests.track("in order", value.shape, value.dtype)
  digests.track("reversed", value.shape, value.dtype, memory=value.nbytes - 1)
  digests.track("held", value.shape, value.dtype, memory=value.nbytes)
  for name in ("in order", "reversed", "held"):
    for box in read_plan.boxes(value.shape, (1, 6))[::1 if name == "in order" else -1]:
      digests.add(name, box, value[box])
  assert digests.found() == {"in order": [_sha(value), 0, 0, 0], "held": [_sha(value), 0, 0, 0]}
  assert os.listdir(tmp_path) == []


def test_appended_values_and_scale_counts():
  scales = np.array([0.0, 1.5, np.nan, np.inf, -np.inf, 0.0, 2.0], np.float32)
  digests = digests_lib.Digests(counted=lambda name: name.endswith("_scale_inv"), background=False)
  digests.track("w_scale_inv", scales.shape, scales.dtype)
  digests.track("w", (3,), np.float32)
  digests.add("w_scale_inv", None, scales[:4])
  digests.add("w_scale_inv", None, scales[4:])
  digests.add("w", None, np.ones(3, np.float32))
  found = digests.found()
  assert found["w_scale_inv"] == [_sha(scales), 2, 1, 2] and found["w"] == [_sha(np.ones(3, np.float32)), 0, 0, 0]


def test_a_box_after_appended_values_out_of_order_is_refused():
  digest = digests_lib.ArrayHash((4, 4), np.float32)
  digest.add((slice(2, 4), slice(0, 4)), np.zeros((2, 4), np.float32))
  with pytest.raises(ValueError, match="out of C order"):
    digest.add(None, np.zeros((2, 4), np.float32))


def _numpy_figures(source, dequantized, blocks):
  """(largest, sum) of |dequantized - source| per block, each error in float32 as numpy computes it, summed in
  float64 (`blocks`: the block index of each element, as an array of the source's shape)."""
  error = np.abs(np.asarray(dequantized, np.float32) - np.asarray(source, np.float32)).reshape(-1)
  ids = blocks.reshape(-1)
  largest = np.zeros(ids.max() + 1, np.float32)
  np.maximum.at(largest, ids, error)
  return largest, np.bincount(ids, error.astype(np.float64))


@pytest.mark.parametrize("channels", [(1, 3), (0, 2)])  # the first axis shared by the scales, or not
@pytest.mark.parametrize("chunk", [16 << 20, 2 * 2 * 40 * 24 * 4])  # one run of the first axis, or three
@pytest.mark.parametrize("in_loop", [False, True])  # figures of a given qvalue, or quantized run by run with them
def test_channel_figures_are_numpys_on_the_float32_source(monkeypatch, channels, chunk, in_loop):
  monkeypatch.setattr(dequant_error, "CHUNK_BYTES", chunk)
  x = np.random.default_rng(2).standard_normal((6, 2, 40, 24)).astype(np.float32)
  x[:, 1, :, 3] = 0.0  # an all-zero channel (of the first scales): scale 1, no error
  qvalue, scale = fp8.quantize(jnp.asarray(x).astype(jnp.bfloat16), "float8_e4m3fn", channels)
  if in_loop:
    quantize = lambda run, s: fp8.quantize_with_scale(run.astype(jnp.bfloat16), "float8_e4m3fn", s)  # noqa: E731
    bits, (largest, total) = jax.jit(lambda x, s: dequant_error.quantized_with_figures(x, s, quantize))(x, scale)
    np.testing.assert_array_equal(np.asarray(bits).reshape(x.shape), np.asarray(qvalue).view(np.uint8))
  else:
    largest, total = jax.jit(dequant_error.channel_figures)(x, qvalue, scale)
  assert largest.shape == total.shape == scale.shape
  dequantized = np.asarray(qvalue).astype(np.float32) * np.asarray(scale).astype(np.float32)
  blocks = np.broadcast_to(np.arange(scale.size).reshape(scale.shape), x.shape)
  want_max, want_sum = _numpy_figures(x, dequantized, blocks)
  np.testing.assert_array_equal(np.asarray(largest).reshape(-1), want_max)
  np.testing.assert_allclose(np.asarray(total, np.float64).reshape(-1), want_sum, rtol=2e-6)
  if channels == (1, 3):
    assert float(np.asarray(largest)[0, 1, 0, 3]) == 0.0


@pytest.mark.parametrize("power_of_two", [False, True])
def test_block_figures_are_numpys_on_edge_tiles(power_of_two):
  w = np.random.default_rng(3).standard_normal((300, 200)).astype(np.float32)
  w[:128, :128] = 0.0
  qvalue, scale = fp8.block_quantize(jnp.asarray(w), (128, 128), "float8_e4m3fn", power_of_two=power_of_two)
  largest, total = jax.jit(dequant_error.block_figures, static_argnums=3)(w, qvalue, scale, (128, 128))
  assert largest.shape == total.shape == (3, 2)
  rows, cols = np.indices(w.shape)
  blocks = (rows // 128) * 2 + cols // 128
  full = np.repeat(np.repeat(np.asarray(scale), 128, axis=0), 128, axis=1)[:300, :200]
  dequantized = np.asarray(qvalue).astype(np.float32) * full
  want_max, want_sum = _numpy_figures(w, dequantized, blocks)
  np.testing.assert_array_equal(np.asarray(largest).reshape(-1), want_max)
  np.testing.assert_allclose(np.asarray(total, np.float64).reshape(-1), want_sum, rtol=2e-6)
  assert float(np.asarray(largest)[0, 0]) == 0.0


def test_group_figures_are_numpys_on_fp4_groups():
  w = np.random.default_rng(4).standard_normal((8, 96)).astype(np.float32) * 0.02
  packed, codes = microscaling_quantize.fp4_quantize(jnp.asarray(w))
  largest, total = jax.jit(dequant_error.group_figures, static_argnums=3)(w, packed, codes, 32)
  assert largest.shape == total.shape == (8, 3)
  dequantized = microscaling.fp4_dequantize(np.asarray(packed), np.asarray(codes))
  blocks = np.indices(w.shape)[0] * 3 + np.indices(w.shape)[1] // 32
  want_max, want_sum = _numpy_figures(w, dequantized, blocks)
  np.testing.assert_array_equal(np.asarray(largest).reshape(-1), want_max)
  np.testing.assert_allclose(np.asarray(total, np.float64).reshape(-1), want_sum, rtol=2e-6)


def test_the_tally_takes_the_relative_error_per_block():
  tally = tally_lib.Tally()
  tally.add("w", np.array([0.5, 0.0, 0.25], np.float32), np.array([1.0, 0.0, 0.5]), 12,
            np.array([0.01, 0.0, 0.0], np.float32), E4M3_MAX)  # a zero scale with errors: inf; without: ignored
  tally.add("w", np.array([0.75], np.float32), np.array([2.0]), 4, np.array([0.02], np.float32), E4M3_MAX)
  assert tally.error("w") == {"max_abs": 0.75, "mean_abs": 3.5 / 16, "elements": 16,
                              "max_over_block_absmax": math.inf}
  tally.add("v", np.array([0.5, np.nan], np.float32), np.array([1.0, np.nan]), 8, np.ones(2, np.float32), E4M3_MAX)
  assert math.isnan(tally.error("v")["max_abs"]) and math.isnan(tally.error("v")["max_over_block_absmax"])


# A source whose routed experts are chunked along the experts, an axis their scales share: under a tight budget
# they are quantized in two passes, their qvalue written by channels, never in C order (tests/test_export_two_pass).
TOKENS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
          "first_num_dense_layers=1", "vocab_size=1024", "quantization=fp8_full"]
CHUNK = 64 << 10


@pytest.fixture(scope="module")
def written(tmp_path_factory):
  """(the export's directory, its arrays (name -> handle), the source's arrays, the plan, each process's found
  hashes, the tally of both) of an export written by two processes."""
  root = tmp_path_factory.mktemp("digests")
  step, dst = str(root / "src" / "0"), root / "dst"
  export_sources.write_source(step, TOKENS, chunk_bytes=CHUNK)
  cfg = config.resolve_config(TOKENS)
  src = read.open_source(cfg, step, params.model_leaves(cfg))
  max_memory = budget.reserve_bytes(True) + write_orbax.DECODING_CHUNKS * CHUNK + budget.SLICE_FACTOR * (64 << 10)
  jobs = write_orbax.plan_jobs(plan_lib.plan_export(cfg), src, max_memory, held=0)
  items = dst / "0" / "items"
  items.mkdir(parents=True)
  found, tally = [], tally_lib.Tally()
  scales = {name for name, about in build.orbax_described(jobs).items() if about.scale_of is not None}
  for index in (0, 1):
    digests = digests_lib.Digests(str(dst), scales.__contains__)
    writer, _ = write_orbax.write_arrays(jobs, src, str(items), process_index=index, process_count=2,
                                         quantizers=quantize.Quantizers, tally=tally, digests=digests)
    found.append(digests.found())
    if index == 1:
      writer.finalize(str(items.parent), "items", process_count=2)
  return str(dst), _arrays(str(dst)), _arrays(str(root / "src")), jobs, found, tally


def test_two_processes_hash_what_each_wrote_whole_and_the_rest_is_read_back(written):
  dst, arrays, _, jobs, found, _ = written
  experts = [job for job in jobs if "moe_layers" in job.leaf.key and job.leaf.key[-1] in ("wi_0", "wi_1", "wo")]
  assert len(experts) == 3 and all(job.two_pass for job in experts)
  for job in experts:  # pass 2 writes the boxes back to front: the qvalue reaches the hash through the scratch file
    written_order = [box[0].start for unit in job.units() for box in job.second_pass(unit)]
    assert written_order == sorted(written_order, reverse=True) and len(written_order) > 1
  assert not set(found[0]) & set(found[1])  # each array hashed by the one process that wrote all of it
  catalogue = build.orbax_catalogue(jobs)
  assert list(catalogue) == sorted(arrays)
  split = [name for name in catalogue if name not in found[0] and name not in found[1]]
  assert split and len(split) < len(catalogue) and any(name in found[0] for name in catalogue)
  described = build.orbax_described(jobs)
  read_back = build.hashes(stored.StoredTensors(dst), described, 1 << 20, split)
  doc = build.manifest(catalogue, {**found[0], **found[1], **read_back}, described, tally_lib.Tally(), "orbax")
  for entry in doc["tensors"]:
    value = arrays[entry["name"]].read().result()
    assert entry["sha256"] == _sha(value), entry["name"]
    if "scale_of" in entry:
      assert [entry["zero"], entry["nan"], entry["inf"]] == [int((value == 0).sum()), int(np.isnan(value).sum()),
                                                             int(np.isinf(value).sum())]


def test_the_two_pass_errors_are_numpys_on_the_source(written):
  _, arrays, source, jobs, _, tally = written
  for job in jobs:
    if job.quant is None:
      continue
    name = ".".join(job.quant.qvalue_key)
    qvalue = arrays[name].read().result().astype(np.float32)
    scale = arrays[".".join(job.quant.scale_key)].read().result().astype(np.float32)
    original = source[".".join(job.out_key)].read().result()
    error = np.abs(qvalue.astype(np.float64) * scale - original)
    got = tally.error(name)
    assert got["elements"] == original.size, name
    assert got["max_abs"] == pytest.approx(error.max(), rel=2e-6), name
    assert got["mean_abs"] == pytest.approx(error.mean(), rel=2e-6), name
    assert got["max_over_block_absmax"] == pytest.approx((error / (np.abs(scale) * E4M3_MAX)).max(), rel=2e-6), name
