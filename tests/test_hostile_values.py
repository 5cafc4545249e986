"""Values checked where they are read (issue 18, item 5): sizes, floats, dtype keys, mesh keys and rules, V4 sizes,
YAML given on the command line; every error line quotes at most about `errors.MAX_SHOWN` characters of a value."""

import pytest

from inspect_tool import errors
from inspect_tool.streaming import budget
from inspect_tool.sharding import memory
from quant import yaml_file

from hostile import refused, refused_in_subprocess

TINY = ["model_name=deepseek3-tiny"]
SHARDED = ["maxtext", *TINY, "--devices", "4"]
# Flow-style billion laughs for one command-line value: 10 x 10^8 names once expanded.
LAUGHS = "[" + ", ".join([f"&a [{', '.join(['x'] * 10)}]"] + [
    f"&{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8)]) + "]"


@pytest.mark.parametrize("text, accepted", [
    ("600MB", 600 * 10**6), ("2GiB", 2 * 2**30), ("1.5G", 15 * 10**8), ("1000000", 10**6), ("600 MB", 600 * 10**6),
])
def test_sizes_that_are_accepted(text, accepted):
  assert budget.parse_size(text) == accepted


@pytest.mark.parametrize("text, why", [
    (" 600 MB ", "is not a size"), ("600MB ", "is not a size"), ("600  MB", "is not a size"),
    ("9" * 400, "is not a size"), ("1e9", "is not a size"), ("nan", "is not a size"), ("inf", "is not a size"),
    ("-1GB", "is not a size"), ("0", "is under 1 byte"), ("0.0001", "is under 1 byte"),
    ("9999999999TiB", "is over 1 EiB"), ("5XB", "is not a size"),
])
def test_sizes_that_are_refused(text, why):
  with pytest.raises(errors.InputError) as info:
    budget.parse_size(text)
  line = str(info.value)
  assert line.startswith("--max-memory ") and why in line and len(line) < 2 * errors.MAX_SHOWN + 150, line
  with pytest.raises(errors.InputError, match="--device-memory"):
    memory.parse_bytes(text)


def test_a_device_memory_bare_unit_is_binary():
  assert memory.parse_bytes("16G") == 16 * 2**30 and memory.parse_bytes("80GB") == 80 * 10**9


def test_400_digit_sizes_through_the_cli_are_one_line(capsys, tmp_path):
  line = refused(capsys, [*SHARDED, "--device-memory", "9" * 400], "--device-memory '999", "(400 characters)")
  assert len(line) < 400
  refused(capsys, ["export", *TINY, "--random-init", "--output", tmp_path / "d", "--max-memory", "9" * 400],
          "--max-memory '999", "is not a size")
  refused(capsys, ["export", *TINY, "--random-init", "--output", tmp_path / "d", "--max-memory", " 600 MB "],
          "--max-memory ' 600 MB ' is not a size")
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["nan", "-nan", "inf", "-inf", "100.5", "-0.1", "1e400", "x" * 5000])
def test_max_kl_is_finite_and_in_range(capsys, tmp_path, value):
  line = refused(capsys, ["export", *TINY, "--random-init", "--output", tmp_path / "d", "--max-kl", value],
                 "--max-kl", "accepted: a number from 0.0 to 100.0")
  assert len(line) < 600
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("value", ["0", "-3", "1" + "0" * 400, "nan", "4.5"])
def test_devices_is_a_bounded_integer(capsys, value):
  line = refused(capsys, ["maxtext", *TINY, "--devices", value], "--devices")
  assert len(line) < 600


@pytest.mark.parametrize("value", ["bogus", "int8", "float64", "'bfloat16 '"])
def test_mu_dtype_from_the_accepted_list(capsys, value):
  refused(capsys, [*SHARDED, "--train", "adamw", f"mu_dtype={value}"], "mu_dtype=",
          "accepted: '' (the weight dtype), float32, bfloat16, float16")


def test_mu_dtype_sets_the_optimizer_bytes(capsys):
  """An accepted mu_dtype is counted at its size (bfloat16: 2 bytes), not as 4 bytes."""
  from inspect_tool.cli import main  # pylint: disable=import-outside-toplevel
  import json  # pylint: disable=import-outside-toplevel

  sizes = {}
  for dtype in ("float32", "bfloat16"):
    assert main([*SHARDED, "--train", "adamw", f"mu_dtype={dtype}", "--format", "json"]) == 0
    sizes[dtype] = json.loads(capsys.readouterr().out)["device_memory"]["total"]
  params = sizes["float32"]["params_bytes"]  # float32 weights: 4 bytes each; adamw's nu at 4, mu at mu_dtype
  assert sizes["float32"]["optimizer_bytes"] == pytest.approx(params * (4 + 4) / 4)
  assert sizes["bfloat16"]["optimizer_bytes"] == pytest.approx(params * (2 + 4) / 4)


@pytest.mark.parametrize("value, expected", [
    ("[[embed, [fsdp, fsdp]]]", "names mesh axis 'fsdp' twice; JAX refuses"),
    ("[['', fsdp]]", "has an empty logical axis name"),
    ("[['  ', fsdp]]", "has an empty logical axis name"),
    ("[[embed, 5]]", "the mesh axes must be a mesh axis name or a list of them"),
    ("[[embed, [fsdp, '']]]", "the mesh axes must be a mesh axis name or a list of them"),
    ("[[embed, [[fsdp]]]]", "the mesh axes must be a mesh axis name or a list of them"),
    ("[[embed]]", "is not [logical_name, mesh_axes]"),
    ("[[5, fsdp]]", "is not [logical_name, mesh_axes]"),
    ("{embed: fsdp}", "is not a list"),
    ("[" * 990 + "]" * 990, f"nests deeper than {yaml_file.MAX_DEPTH} levels"),
])
def test_logical_axis_rules_are_validated(capsys, value, expected):
  refused(capsys, [*SHARDED, f"logical_axis_rules={value}"], "logical_axis_rules", expected)


@pytest.mark.parametrize("value, expected", [
    ("[fsdp, fsdp]", "names an axis twice"),
    ("[fsdp, [expert]]", "is not a list of mesh axis names"),
    ("[fsdp, 5]", "is not a list of mesh axis names"),
    ("[" * 990 + "]" * 990, f"nests deeper than {yaml_file.MAX_DEPTH} levels"),
    ("[" + "x" * 100_000 + "]", "unknown axis 'xxx"),
])
def test_mesh_axes_are_validated(capsys, value, expected):
  line = refused(capsys, [*SHARDED, f"mesh_axes={value}"], "mesh_axes", expected)
  assert len(line) < 3 * errors.MAX_SHOWN + 400


@pytest.mark.parametrize("key", ["logical_axis_rules", "mesh_axes", "data_sharding"])
def test_yaml_alias_bombs_on_the_command_line_are_refused_at_once(key):
  refused_in_subprocess([*SHARDED, f"{key}={LAUGHS}"], f"expands to over {yaml_file.MAX_NODES} values", timeout=60)


def test_oversized_command_line_yaml_is_refused(capsys):
  value = "[" + ", ".join(["fsdp"] * 40_000) + "]"
  refused(capsys, [*SHARDED, f"mesh_axes={value}"], f"over {yaml_file.MAX_BYTES} are refused")


@pytest.mark.parametrize("keys, expected", [
    (["sliding_window_size=-1"], "sliding_window_size=-1 must be >= 0"),
    (["compressed_rope_max_timescale=0"], "compressed_rope_max_timescale=0 must be a positive integer"),
])
def test_v4_sizes(capsys, keys, expected):
  refused(capsys, ["maxtext", "model_name=deepseek4-tiny", "override_model_config=true", *keys], expected)


@pytest.mark.parametrize("key", ["normalization_layer_epsilon=-1", "rope_factor=0", "rope_factor=-2", "beta_fast=0",
                                 "beta_slow=-1", "original_max_position_embeddings=0", "rope_max_timescale=0"])
def test_numbers_rope_and_norms_divide_by_are_positive(capsys, key):
  """Each of these ran to a `math domain error` / ZeroDivisionError traceback or `loss nan` before."""
  refused(capsys, ["forward", *TINY, "override_model_config=true", key], f"{key.split('=')[0]}=", "must be > 0")


def test_recall_target_is_a_fraction(capsys):
  refused(capsys, ["maxtext", *TINY, "override_model_config=true", "indexer_approx_top_k_recall=5"],
          "indexer_approx_top_k_recall=5.0 must be in (0, 1]")


@pytest.mark.parametrize("argv, quoted", [
    (["maxtext", *TINY, "override_model_config=true", "base_emb_dim=" + "7" * 4000], "base_emb_dim="),
    (["maxtext", *TINY, "override_model_config=true", "dtype=" + "x" * 100_000], "dtype="),
    (["maxtext", *TINY, "x" * 100_000 + "=1"], "unknown config key 'xxx"),
    (["maxtext", *TINY, "x" * 100_000], "argument 'xxx"),
    (["maxtext", *TINY, "logical_axis_rules=" + "7" * 100_000], "logical_axis_rules='777"),
    (["maxtext", *TINY, "scan_layers=" + "y" * 100_000], "scan_layers='yyy"),
    (["maxtext", *TINY, "mesh_axes=[" + "x" * 100_000 + "]", "--devices", "4"], "unknown axis 'xxx"),
])
def test_error_lines_quote_a_value_briefly(capsys, argv, quoted):
  line = refused(capsys, argv, quoted)
  assert len(line) <= errors.MAX_LINE + 100, len(line)
  longest_run = max(len(run) for run in line.replace("x", "\0").replace("7", "\0").replace("y", "\0").split(" "))
  assert longest_run <= errors.MAX_SHOWN + 50, line[:500]


def test_shown_abbreviates_long_values():
  assert errors.shown("abc") == "'abc'"
  long = errors.shown("x" * 1000)
  assert long.startswith("'xxx") and long.endswith("… (1000 characters)") and len(long) < errors.MAX_SHOWN + 30
