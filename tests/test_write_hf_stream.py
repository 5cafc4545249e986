"""Tests for inspect_tool.streaming.safetensors_writer: streamed shards (reserved, space-padded header region)
read back by the `safetensors` library, shards closed early when the header reserve is full, regions filled after
later shards were started, permissions, and write errors as one line naming the file."""

import json
import os
import struct
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from inspect_tool import errors
from inspect_tool.output import atomic
from inspect_tool.fp8_export import hf_matrices
from inspect_tool.streaming import safetensors_writer

import test_export_hf

from conftest import REPO
NP_DTYPES = test_export_hf.NP_DTYPES


def _tensors(seed=0):
  """A mix of the three dtypes the export writes, odd shapes included (name -> numpy array)."""
  rng = np.random.default_rng(seed)
  return {
      "a.weight": rng.standard_normal((37, 11)).astype(ml_dtypes.float8_e4m3fn),
      "a.weight_scale_inv": rng.standard_normal((1, 1)).astype(np.float32),
      "b.bias": rng.standard_normal((5,)).astype(np.float32),
      "c.embed": rng.standard_normal((100, 24)).astype(ml_dtypes.bfloat16),
      "d.norm": np.ones((24,), ml_dtypes.bfloat16),
      "e.scalar": np.float32(3.5).reshape(()),
  }


def _read_with_safetensors(path):
  """name -> array of one file, through the `safetensors` library (`deserialize` validates header and offsets)."""
  import safetensors  # pylint: disable=import-outside-toplevel

  with safetensors.safe_open(path, framework="np") as f:
    assert f.metadata() == {"format": "pt"}
    names = set(f.keys())
  with open(path, "rb") as f:
    out = {n: np.frombuffer(e["data"], NP_DTYPES[e["dtype"]]).reshape(e["shape"])
           for n, e in safetensors.deserialize(f.read())}
  assert set(out) == names
  return out


def _read_dir(directory):
  out = {}
  for name in sorted(os.listdir(directory)):
    out.update({(name, k): v for k, v in _read_with_safetensors(os.path.join(directory, name)).items()})
  return out


def test_streamed_shard_reads_back_with_safetensors_and_its_header_is_space_padded(tmp_path):
  tensors = _tensors()
  with safetensors_writer.ShardedWriter(str(tmp_path), 10**9) as writer:
    rows = writer.reserve("c.embed", ml_dtypes.bfloat16, (100, 24))
    for name, array in tensors.items():
      if name != "c.embed":
        writer.add(name, array)
    for start in range(0, 100, 7):  # filled last, 7 rows at a time
      rows.write(tensors["c.embed"][start:start + 7])
    weight_map = writer.close()
  assert weight_map == {name: "model-00001-of-00001.safetensors" for name in sorted(tensors)}
  assert os.listdir(tmp_path) == ["model-00001-of-00001.safetensors"]
  path = tmp_path / "model-00001-of-00001.safetensors"
  read = _read_with_safetensors(str(path))
  assert set(read) == set(tensors)
  for name, array in tensors.items():
    assert read[name].dtype == array.dtype and read[name].shape == array.shape
    assert read[name].tobytes() == array.tobytes(), name
  raw = path.read_bytes()
  (length,) = struct.unpack("<Q", raw[:8])
  reserve = safetensors_writer.DEFAULT_HEADER_RESERVE
  assert 8 + length == reserve and len(raw) == reserve + sum(a.nbytes for a in tensors.values())
  header = raw[8:reserve]
  text = header.rstrip(b" ")
  assert len(text) < len(header) and json.loads(text)["__metadata__"] == {"format": "pt"}
  assert (path.stat().st_mode & 0o777) == atomic.new_file_mode()


def test_a_full_header_reserve_closes_the_shard_early(tmp_path):
  tensors = {f"model.layers.{i}.mlp.experts.{j}.weight": np.full((2, 3), i + j / 8, np.float32)
             for i in range(4) for j in range(8)}
  reserve = 512  # room for 5 entries of about 90 bytes beside the metadata
  with safetensors_writer.ShardedWriter(str(tmp_path), 10**9, header_reserve=reserve) as writer:
    for name, array in tensors.items():
      writer.add(name, array)
    weight_map = writer.close()
  files = sorted(os.listdir(tmp_path))
  assert len(files) >= 6 and files == sorted(set(weight_map.values()))
  read = {}
  for name in files:
    raw = (tmp_path / name).read_bytes()
    assert struct.unpack("<Q", raw[:8])[0] == reserve - 8  # every header fits its reserve
    used = len(raw[8:reserve].rstrip(b" "))
    assert used <= reserve - 8 and (used > reserve - 8 - 92 or name == files[-1])  # no room for one more entry
    part = _read_with_safetensors(str(tmp_path / name))
    assert all(weight_map[k] == name for k in part)
    read.update(part)
  assert set(read) == set(tensors)
  for name, array in tensors.items():
    np.testing.assert_array_equal(read[name], array)
  (tmp_path / "x").mkdir()
  with safetensors_writer.ShardedWriter(str(tmp_path / "x"), 10**9, header_reserve=64) as writer:
    with pytest.raises(ValueError, match="cannot hold the header entry"):
      writer.reserve("a" * 100, np.float32, (1,))


def test_regions_of_a_closed_shard_are_filled_after_later_shards_start(tmp_path):
  """As for the MTP copies of the embedding, or an expert leaf read across layers: places are taken in release
  order, bytes come later in another order, and the first shard is completed last."""
  first = np.arange(40, dtype=np.float32).reshape(10, 4).astype(ml_dtypes.bfloat16)
  copy_b = np.arange(8, dtype=np.float32)
  with safetensors_writer.ShardedWriter(str(tmp_path), 100) as writer:
    a = writer.reserve("a", ml_dtypes.bfloat16, (10, 4))  # 80 bytes: shard 1
    b = writer.reserve("b", np.float32, (8,))  # 32 more would pass 100: shard 2
    c = writer.reserve("c", np.float32, (8,))
    for region, array in ((c, copy_b), (b, copy_b)):
      region.write(array)
    for start in (0, 5):
      a.write(first[start:start + 5])
    weight_map = writer.close()
  assert weight_map == {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors",
                        "c": "model-00002-of-00002.safetensors"}
  read = _read_dir(str(tmp_path))
  assert read[("model-00001-of-00002.safetensors", "a")].tobytes() == first.tobytes()
  for name in "bc":
    np.testing.assert_array_equal(read[("model-00002-of-00002.safetensors", name)], copy_b)


class _Recording:
  """An array-like that records the shape of every block read from it."""

  def __init__(self, array, reads):
    self.array, self.shape, self.dtype, self.reads = array, array.shape, array.dtype, reads

  def __getitem__(self, index):
    self.reads.append(np.asarray(self.array[index]).shape)
    return self.array[index]


def _recording(arrays):
  reads = []
  return {key: _Recording(value, reads) for key, value in arrays.items()}, reads


def test_tiny_export_was_cut_into_blocks_and_closed_shards_early(tmp_path):
  """The `tiny` fixture of test_export_hf (whose values are checked against references there) ran with a small
  work memory and header reserve: check that both did something, on the same arrays."""
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(test_export_hf.TINY)
  arrays = test_export_hf._random_arrays(cfg)  # pylint: disable=protected-access
  lazy, reads = _recording(arrays)
  write_hf.write_deepseek_fp8(lazy, cfg, str(tmp_path), max_shard_bytes=300_000,
                              work_bytes=test_export_hf.TINY_WORK_BYTES,
                              header_reserve=test_export_hf.TINY_HEADER_RESERVE)
  assert (1, 3, 64, 64) in reads and (16, 3, 64, 64) not in reads  # routed experts: one of 16, every layer
  rows = test_export_hf.TINY_WORK_BYTES // 10 // (64 * 4)  # a tenth of the work memory: 117 float32 rows of 64
  assert (1024, 64) not in reads and (rows, 64) in reads  # embedding rows
  with open(tmp_path / write_hf.INDEX_NAME) as f:
    weight_map = json.load(f)["weight_map"]
  sizes = {}
  for name, shard in weight_map.items():
    with open(tmp_path / shard, "rb") as f:
      (length,) = struct.unpack("<Q", f.read(8))
      entry = json.loads(f.read(length))[name]
    sizes[shard] = sizes.get(shard, 0) + entry["data_offsets"][1] - entry["data_offsets"][0]
  assert any(size < 150_000 for shard, size in sizes.items() if not shard.startswith(f"model-{len(sizes):05d}"))


def test_write_errors_are_one_input_error_naming_the_file(tmp_path):
  missing = tmp_path / "missing"
  with pytest.raises(errors.InputError, match=r"^cannot write '.*missing/\.shard-00001\.safetensors\.tmp': "):
    with safetensors_writer.ShardedWriter(str(missing), 10**9) as writer:
      writer.add("a", np.zeros(4, np.float32))
  # A full disk: writes past a 1 MB file size limit fail (SIGXFSZ ignored, so write() returns EFBIG).
  code = (
      "import resource, signal, sys\n"
      "import numpy as np\n"
      "from inspect_tool import errors\n"
      "from inspect_tool.streaming import safetensors_writer\n"
      "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
      "resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))\n"
      "try:\n"
      "  with safetensors_writer.ShardedWriter(sys.argv[1], 10**9) as w:\n"
      "    w.add('big', np.zeros(1 << 19, np.float32))\n"
      "except errors.InputError as e:\n"
      "  print(e)\n")
  out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, cwd=REPO,
                       check=True, timeout=120)
  assert out.stdout.strip() == f"cannot write {str(tmp_path / '.shard-00001.safetensors.tmp')!r}: File too large"


def test_blocks_of_fp8_leaves_align_to_the_source_chunks(tmp_path):
  """With the source chunked by 5 experts, blocks of experts are 10 and 6 (not the 8 an unaligned cut takes),
  and every FP8 tensor is still DeepSeek's 128 x 128 scheme of the MaxText matrix (numpy reference)."""
  import deepseek_fp8_reference  # pylint: disable=import-outside-toplevel

  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(test_export_hf.TINY)
  arrays = test_export_hf._random_arrays(cfg)  # pylint: disable=protected-access
  experts = {key for key, value in arrays.items() if key[-1] in ("wi_0", "wi_1", "wo") and value.ndim == 4}
  work = 8 * 131072 + 2 * 5 * 3 * 64 * 64 * 4  # two blocks of 5 experts beside the largest matrix's work
  lazy, reads = _recording(arrays)
  write_hf.write_deepseek_fp8(lazy, cfg, str(tmp_path),
                              work_bytes=work, chunk_shape=lambda key: (5, 3, 64, 64) if key in experts else None)
  assert (10, 3, 64, 64) in reads and (6, 3, 64, 64) in reads and (8, 3, 64, 64) not in reads
  tensors = test_export_hf._read_tensors(str(tmp_path))  # pylint: disable=protected-access
  refs = test_export_hf._reference_fp8(cfg, arrays)  # pylint: disable=protected-access
  assert set(refs) == {k[:-len("_scale_inv")] for k in tensors if k.endswith("_scale_inv")}
  for name, w_ref in refs.items():
    q_ref, s_ref = deepseek_fp8_reference.block_quantize(w_ref)
    assert deepseek_fp8_reference.ulp_distance(tensors[name + "_scale_inv"], s_ref).max() <= 1, name
    assert deepseek_fp8_reference.fp8_step_distance(tensors[name], q_ref).max() <= 1, name


def test_regions_filled_from_several_threads_read_back_with_safetensors(tmp_path):
  """Regions of shards being retired are completed from four threads at once, in shuffled order: every shard gets
  its header once all its regions are done, and every tensor reads back (the pending count is kept under a lock)."""
  import concurrent.futures  # pylint: disable=import-outside-toplevel

  rng = np.random.default_rng(7)
  tensors = {f"t{i}": rng.standard_normal((64, 33)).astype(np.float32) for i in range(120)}
  with safetensors_writer.ShardedWriter(str(tmp_path), 5 * 64 * 33 * 4) as writer:  # 5 tensors per shard
    regions = [(writer.reserve(name, np.float32, array.shape), array) for name, array in tensors.items()]
    order = rng.permutation(len(regions))
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
      for future in [pool.submit(regions[k][0].write, regions[k][1]) for k in order]:
        future.result()
    weight_map = writer.close()
  assert len(set(weight_map.values())) == 24
  read = {name: array for (_, name), array in _read_dir(str(tmp_path)).items()}
  assert set(read) == set(tensors)
  for name, array in tensors.items():
    np.testing.assert_array_equal(read[name], array)


def _converter_threads(monkeypatch, arrays):
  """Records (thread, start, end) of every conversion of a routed expert's matrix (a view of one of the `arrays`'
  routed-expert leaves); the first 60 take 20 ms more, so that two converters at work overlap."""
  import threading  # pylint: disable=import-outside-toplevel
  import time  # pylint: disable=import-outside-toplevel

  calls, quantize = [], hf_matrices._block_quantize_transposed  # pylint: disable=protected-access
  experts = [value for key, value in arrays.items() if key[-1] in ("wi_0", "wi_1", "wo") and value.ndim >= 3
             and value.shape[0] == 16]

  def recorded(w_io):
    if not any(np.shares_memory(w_io, leaf) for leaf in experts):
      return quantize(w_io)
    start = time.perf_counter()
    if len(calls) < 60:
      time.sleep(0.02)
    out = quantize(w_io)
    calls.append((threading.current_thread().name, start, time.perf_counter()))
    return out

  monkeypatch.setattr(hf_matrices, "_block_quantize_transposed", recorded)
  return calls


def _most_at_once(calls) -> int:
  events = sorted([(start, 1) for _, start, _ in calls] + [(end, -1) for _, _, end in calls])
  most = now = 0
  for _, step in events:
    now += step
    most = max(most, now)
  return most


def test_fp8_matrices_are_converted_two_at_a_time_where_the_budget_holds_their_work(tmp_path, monkeypatch):
  """With room for two matrices' work beside the blocks, two converter threads work at once, and the tensors are
  still DeepSeek's 128 x 128 scheme of the MaxText matrices (numpy reference)."""
  import deepseek_fp8_reference  # pylint: disable=import-outside-toplevel

  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(test_export_hf.TINY)
  arrays = test_export_hf._random_arrays(cfg)  # pylint: disable=protected-access
  calls = _converter_threads(monkeypatch, arrays)
  write_hf.write_deepseek_fp8(arrays, cfg, str(tmp_path), work_bytes=64 * 2**20)
  assert _most_at_once(calls) == hf_matrices.CONVERTERS == 2
  assert len({name for name, _, _ in calls}) == 2 and all(name.startswith("fp8-convert") for name, _, _ in calls)
  tensors = test_export_hf._read_tensors(str(tmp_path))  # pylint: disable=protected-access
  for name, w_ref in test_export_hf._reference_fp8(cfg, arrays).items():  # pylint: disable=protected-access
    q_ref, s_ref = deepseek_fp8_reference.block_quantize(w_ref)
    assert deepseek_fp8_reference.ulp_distance(tensors[name + "_scale_inv"], s_ref).max() <= 1, name
    assert deepseek_fp8_reference.fp8_step_distance(tensors[name], q_ref).max() <= 1, name


def test_fp8_matrices_are_converted_one_at_a_time_on_a_budget_for_one(tmp_path, monkeypatch):
  """`TINY_WORK_BYTES` holds one matrix's work beside the routed experts' blocks, not two: one conversion at once."""
  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(test_export_hf.TINY)
  arrays = test_export_hf._random_arrays(cfg)  # pylint: disable=protected-access
  calls = _converter_threads(monkeypatch, arrays)
  write_hf.write_deepseek_fp8(arrays, cfg, str(tmp_path), work_bytes=test_export_hf.TINY_WORK_BYTES)
  assert len(calls) == 4 * 16 * 3 and _most_at_once(calls) == 1


def test_source_chunks_over_the_read_cap_are_read_ahead_when_two_fit(tmp_path, monkeypatch):
  """A leaf whose smallest chunk-aligned block is over `MAX_READ_BYTES` is read a block ahead (in the read-ahead
  thread) when the work memory holds two such blocks, and without reading ahead when it holds one."""
  import threading  # pylint: disable=import-outside-toplevel

  from inspect_tool.configuration import config  # pylint: disable=import-outside-toplevel
  from inspect_tool.fp8_export import write_hf  # pylint: disable=import-outside-toplevel

  cfg = config.resolve_config(test_export_hf.TINY)
  arrays = test_export_hf._random_arrays(cfg)  # pylint: disable=protected-access
  experts = {key for key, value in arrays.items() if key[-1] in ("wi_0", "wi_1", "wo") and value.ndim == 4}
  block = 8 * 3 * 64 * 64 * 4  # two blocks of 8 experts per leaf (16 experts, 3 layers)
  monkeypatch.setattr(hf_matrices, "MAX_READ_BYTES", block // 4)
  for work, ahead in ((131072 + 2 * block + 1000, True), (131072 + block + 1000, False)):  # experts' spare: 2, 1
    threads = []

    class Threaded(np.ndarray):  # records which thread reads each expert block
      def __getitem__(self, index):
        if self.ndim == 4 and isinstance(index, tuple):
          threads.append(threading.current_thread().name)
        return super().__getitem__(index)

    lazy = {key: (value.view(Threaded) if key in experts else value) for key, value in arrays.items()}
    dst = tmp_path / str(ahead)
    dst.mkdir()
    write_hf.write_deepseek_fp8(lazy, cfg, str(dst), work_bytes=work,
                                chunk_shape=lambda key: (8, 3, 64, 64) if key in experts else None)
    assert len(threads) == 2 * len(experts), threads
    assert any(t.startswith("read-ahead") for t in threads) == ahead, threads
