"""A fuzz test per input surface (issue 18, item 9): CLI numbers, YAML (model files and command-line values), JSON
metadata (Orbax `_METADATA`, zarr `zarr.json`), safetensors headers, `config.json`, multi-process flags.

Generated inputs come from a seeded generator (the same cases every run): a valid document with one node replaced
by a hostile JSON value, deleted or renamed; YAML text built from YAML's own syntax characters. Each run must
either succeed (exit 0, or 1 for findings) or be refused with exit 2 and one stderr line, never a traceback.
Tables list values every reader must refuse. A hang aborts the run (faulthandler) instead of blocking the suite.
`slow` cases run many more seeds (`pytest -m slow`; CI runs them with the rest).
"""

import copy
import json
import os
import random
import shutil
import struct

import pytest

from inspect_tool import errors

from hostile import REF_CKPT, TINY_CKPT_MODEL, check_one_line
from test_fuzz_inputs import _run
from test_hostile_hf import fp8_dir  # noqa: F401  (a fixture: an FP8 export of the L4 checkpoint)
from conftest import REPO

SEED = 18
FAST, SLOW = 6, 60  # seeds per surface in the quick and the `slow` runs
ITEMS = os.path.join("0", "items")
TINY_MODEL_FILE = os.path.join(REPO, "inspect_tool",
                               "configuration", "maxtext_data", "models", "deepseek3-tiny.yml")
DEEP = json.loads("[" * 50 + "]" * 50)
HOSTILE_JSON = [None, True, False, -1, 0, 2**64, -2**63 - 1, 1e308, -1e308, 0.5, "", "x" * 5000, "float99",
                 "F8_E4M3", [], {}, [[]], {"a": None}, [-1], [2**63], ["x"], [0, 2**62], DEEP, [1.5, 2]]
YAML_ALPHABET = list("[]{}:,&*!|>-?'\"#%@` \n\t") + ["a", "b", "x", "1", "0", ".nan", "&a ", "*a", "- ", ": ",
                                                        "!!python/object ", "<<: ", "fsdp", "embed", "~"]


def _one_line_or_success(capsys, argv) -> int:
  """Runs `argv`: a success (0, or 1 for findings) or one refusal line with exit 2; never a traceback."""
  code, out, err = _run(capsys, argv)
  assert "Traceback" not in err, err[-3000:]
  if code == 2:
    check_one_line(code, out, err)
    assert len(err) <= errors.MAX_LINE + 200, len(err)
  else:
    assert code in (0, 1), (code, err[-2000:])
  return code


def _seeds(surface: str):
  rng = random.Random(f"{SEED}-{surface}")
  fast = [pytest.param(rng.randrange(2**31), id=f"{surface}-{i}") for i in range(FAST)]
  slow = [pytest.param(rng.randrange(2**31), id=f"{surface}-slow-{i}", marks=pytest.mark.slow) for i in range(SLOW)]
  return fast + slow


# JSON documents ------------------------------------------------------------------------------------------------


def _nodes(doc) -> list[tuple]:
  """Paths (tuples of keys and indices) of every node under the root, without recursion."""
  paths, stack = [], [((), doc)]
  while stack:
    path, node = stack.pop()
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
      paths.append(path + (key,))
      stack.append((path + (key,), child))
  return paths


def mutate_json(doc, rng: random.Random):
  """`doc` with one node replaced by a hostile value (most often), deleted, or its key renamed to ''."""
  doc = copy.deepcopy(doc)
  path = rng.choice(_nodes(doc))
  parent = doc
  for key in path[:-1]:
    parent = parent[key]
  how = rng.random()
  if how < 0.75:
    parent[path[-1]] = copy.deepcopy(rng.choice(HOSTILE_JSON))
  elif how < 0.9 or not isinstance(parent, dict):
    del parent[path[-1]]
  else:
    parent[""] = parent.pop(path[-1])
  return doc


def _copy_checkpoint(tmp_path) -> str:
  ckpt = str(tmp_path / "ckpt")
  shutil.copytree(REF_CKPT, ckpt)
  return ckpt


@pytest.mark.parametrize("seed", _seeds("metadata"))
def test_orbax_metadata(capsys, tmp_path, seed):
  ckpt = _copy_checkpoint(tmp_path)
  path = os.path.join(ckpt, ITEMS, "_METADATA")
  with open(path, encoding="utf-8") as f:
    doc = json.load(f)
  with open(path, "w", encoding="utf-8") as f:
    json.dump(mutate_json(doc, random.Random(seed)), f)
  _one_line_or_success(capsys, ["orbax", "--path", ckpt])
  _one_line_or_success(capsys, ["diff", *TINY_CKPT_MODEL, "--path", ckpt])


@pytest.mark.parametrize("seed", _seeds("zarr"))
def test_zarr_headers(capsys, tmp_path, seed):
  import tensorstore as ts  # pylint: disable=import-outside-toplevel

  ckpt = _copy_checkpoint(tmp_path)
  store = ts.KvStore.open({"driver": "ocdbt", "base": {"driver": "file",
                                                       "path": os.path.join(ckpt, ITEMS) + "/"}}).result()
  keys = sorted(k for k in store.list().result() if k.endswith(b"/zarr.json"))
  rng = random.Random(seed)
  key = rng.choice(keys)
  doc = json.loads(store.read(key).result().value)
  store.write(key, json.dumps(mutate_json(doc, rng)).encode()).result()
  _one_line_or_success(capsys, ["orbax", "--path", ckpt])


def _safetensors(path, header: dict, data: bytes) -> None:
  text = json.dumps(header).encode()
  path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _small_safetensors() -> tuple[dict, bytes]:
  header, data = {"__metadata__": {"format": "pt"}}, b""
  for name, dtype, shape, size in (("model.embed_tokens.weight", "F32", [8, 4], 4),
                                   ("model.layers.0.mlp.gate.weight", "BF16", [4, 4], 2),
                                   ("model.layers.0.mlp.down_proj.weight", "F8_E4M3", [4, 8], 1),
                                   ("model.layers.0.mlp.down_proj.weight_scale_inv", "F32", [1, 1], 4)):
    count = 1
    for d in shape:
      count *= d
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + count * size]}
    data += bytes(range(count * size % 256)) * (count * size // 256) + bytes(range(count * size % 256))
    data = data[:header[name]["data_offsets"][1]]
  return header, data


@pytest.mark.parametrize("seed", _seeds("safetensors"))
def test_safetensors_headers(capsys, tmp_path, fp8_dir, seed):
  header, data = _small_safetensors()
  path = tmp_path / "model.safetensors"
  _safetensors(path, mutate_json(header, random.Random(seed)), data)
  shutil.copy(os.path.join(fp8_dir, "config.json"), tmp_path)
  _one_line_or_success(capsys, ["hf", "--path", path])
  _one_line_or_success(capsys, ["diff", *TINY_CKPT_MODEL, "--path", tmp_path])


@pytest.mark.parametrize("seed", _seeds("config_json"))
def test_config_json(capsys, tmp_path, fp8_dir, seed):
  path = tmp_path / "hf"
  shutil.copytree(fp8_dir, path)
  with open(path / "config.json", encoding="utf-8") as f:
    doc = json.load(f)
  (path / "config.json").write_text(json.dumps(mutate_json(doc, random.Random(seed))))
  _one_line_or_success(capsys, ["hf", "--path", path, "--keys"])
  _one_line_or_success(capsys, ["diff", *TINY_CKPT_MODEL, "--path", path])  # reads it as forward and import do


def test_the_unmutated_documents_are_accepted(capsys, tmp_path, fp8_dir):
  """The control: every surface above, intact, succeeds; failures come from the mutations."""
  assert _one_line_or_success(capsys, ["orbax", "--path", REF_CKPT]) == 0
  assert _one_line_or_success(capsys, ["diff", *TINY_CKPT_MODEL, "--path", REF_CKPT]) == 0
  header, data = _small_safetensors()
  _safetensors(tmp_path / "model.safetensors", header, data)
  assert _one_line_or_success(capsys, ["hf", "--path", tmp_path / "model.safetensors"]) == 0
  assert _one_line_or_success(capsys, ["hf", "--path", fp8_dir, "--keys"]) == 0
  assert _one_line_or_success(capsys, ["diff", *TINY_CKPT_MODEL, "--path", fp8_dir]) == 0


# YAML -----------------------------------------------------------------------------------------------------------


def _yaml_soup(rng: random.Random) -> str:
  return "".join(rng.choice(YAML_ALPHABET) for _ in range(rng.randrange(1, 200)))


@pytest.mark.parametrize("seed", _seeds("yaml_file"))
def test_model_files(capsys, tmp_path, seed):
  rng = random.Random(seed)
  with open(TINY_MODEL_FILE, encoding="utf-8") as f:
    lines = f.read().splitlines()
  spot = rng.randrange(len(lines) + 1)
  lines.insert(spot, _yaml_soup(rng))  # garbage somewhere in a valid model file
  path = tmp_path / "m.yml"
  path.write_text("\n".join(lines) + "\n")
  _one_line_or_success(capsys, ["maxtext", f"model_file={path}"])


@pytest.mark.parametrize("seed", _seeds("yaml_value"))
def test_command_line_yaml_values(capsys, seed):
  rng = random.Random(seed)
  key = rng.choice(["logical_axis_rules", "mesh_axes", "data_sharding", "mu_dtype", "opt_type"])
  _one_line_or_success(capsys, ["maxtext", "model_name=deepseek3-tiny", "--devices", "4", f"{key}={_yaml_soup(rng)}"])


# Tables ---------------------------------------------------------------------------------------------------------

# Values no number option accepts: every one must be refused in one line before any work starts.
BAD_NUMBERS = ["", " ", "nan", "-nan", "inf", "-inf", "1e400", "9" * 400, "-1", "0x10", "1.5.5", "\x00", "1" * 5000,
               "--", "1,5"]
NUMBER_OPTIONS = {
    "--max-memory": ["export", "model_name=deepseek3-tiny", "--random-init", "--output", "{dst}", "--max-memory"],
    "--max-kl": ["export", "model_name=deepseek3-tiny", "--random-init", "--output", "{dst}", "--max-kl"],
    "--device-memory": ["maxtext", "model_name=deepseek3-tiny", "--devices", "4", "--device-memory"],
    "--devices": ["maxtext", "model_name=deepseek3-tiny", "--devices"],
    "import --max-memory": ["import", "--path", REF_CKPT, "--output", "{dst}", "--max-memory"],
}


@pytest.mark.parametrize("option", list(NUMBER_OPTIONS))
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=[repr(v[:12]) for v in BAD_NUMBERS])
def test_cli_numbers(capsys, tmp_path, option, value):
  argv = [a.replace("{dst}", str(tmp_path / "dst")) for a in NUMBER_OPTIONS[option]] + [value]
  code, out, err = _run(capsys, argv)
  line = check_one_line(code, out, err)
  assert len(line) <= 3 * errors.MAX_SHOWN + 300, len(line)
  assert not list(tmp_path.iterdir())


# (--coordinator, --num-processes, --process-id): each set is refused before any process joins a job.
BAD_PROCESS_FLAGS = [
    (None, "2", "0"), ("h:1", None, "0"), ("h:1", "2", None), ("h:1", "0", "0"), ("h:1", "-1", "0"), ("h:1", "2", "2"),
    ("h:1", "2", "-1"), ("h:1", "2", "9" * 400), ("nocolon", "2", "0"), ("x" * 10_000, "2", "1"), ("h:1", "nan", "0"),
    ("h:1", "2", "1.5"), ("h:1", "9" * 400, "9" * 401), ("h:1", "", "0"), ("h:1", "2", "0x1"),
]


@pytest.mark.parametrize("coordinator, num_processes, process_id", BAD_PROCESS_FLAGS,
                         ids=[f"{str(c)[:8]}-{str(n)[:8]}-{str(p)[:8]}" for c, n, p in BAD_PROCESS_FLAGS])
def test_multi_process_flags(capsys, tmp_path, coordinator, num_processes, process_id):
  argv = ["export", "model_name=deepseek3-tiny", "--random-init", "--output", tmp_path / "dst"]
  for flag, value in (("--coordinator", coordinator), ("--num-processes", num_processes),
                      ("--process-id", process_id)):
    if value is not None:
      argv += [flag, value]
  code, out, err = _run(capsys, argv)
  check_one_line(code, out, err)
  assert len(err) <= errors.MAX_LINE + 200
  assert not list(tmp_path.iterdir())
