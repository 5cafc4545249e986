"""The house rules of docs/architecture.md, checked on the source: packages per flow, small modules, rooms on
floors that only import the floors below them, own imports at module top below the CLI, no import circles, `quant`
apart from `inspect_tool`, and the public API the docs name."""

import ast
import pathlib
import subprocess
import sys

import pytest

import maxtext_listings

from conftest import REPO
ROOT = pathlib.Path(REPO)
PACKAGES = ("inspect_tool", "quant")
MAX_LINES = 450

# The house, bottom floor first (docs/architecture.md draws it): a module may import its own room and the rooms on
# the floors below, never a room beside it or above it. A room is a package of inspect_tool (or a module at its top),
# `quant` or `quant.gmm`; `inspect_tool` itself (its lazy public API and `__main__`) is the roof.
FLOORS = (
    ("inspect_tool.process_state",),
    ("inspect_tool.errors", "inspect_tool.progress", "inspect_tool.host", "quant"),
    ("inspect_tool.configuration", "inspect_tool.storage", "quant.gmm"),
    ("inspect_tool.model", "inspect_tool.output"),
    ("inspect_tool.paramtree", "inspect_tool.distributed"),
    ("inspect_tool.sharding",),
    ("inspect_tool.report",),
    ("inspect_tool.coverage",),
    ("inspect_tool.checkpoint",),
    ("inspect_tool.hf",),
    ("inspect_tool.run", "inspect_tool.streaming", "inspect_tool.listings", "inspect_tool.fitting"),
    ("inspect_tool.manifest", "inspect_tool.xla_compile"),
    ("inspect_tool.fp8_export", "inspect_tool.hf_import"),
    ("inspect_tool.cli",),
    ("inspect_tool",),
)
FLOOR = {room: floor for floor, rooms in enumerate(FLOORS) for room in rooms}
# Below the CLI, a function may import only a third-party package, with the reason on the line above it.
LAZY_REASON = "# lazy:"


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for package in PACKAGES:
    for path in (ROOT / package).rglob("*.py"):
      parts = path.relative_to(ROOT).with_suffix("").parts
      found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


def _targets(node, modules) -> list[str]:
  if isinstance(node, ast.Import):
    return [alias.name for alias in node.names]
  if isinstance(node, ast.ImportFrom) and node.module:
    subs = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules]
    return subs or [node.module]
  return []


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The project modules `name` imports anywhere in its body (lazy imports in functions included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    out |= {t for t in _targets(node, modules) if t in modules and t != name and not name.startswith(t + ".")}
  return out


def room_of(module: str) -> str:
  """The room a module lives in: its package under inspect_tool (or itself, at the top), quant or quant.gmm."""
  parts = module.split(".")
  if parts[0] == "quant":
    return "quant.gmm" if parts[1:2] == ["gmm"] else "quant"
  if len(parts) == 1 or parts[1] == "__main__":
    return "inspect_tool"
  return ".".join(parts[:2])


def upward_imports(modules) -> list[str]:
  """'a -> b' for every import of a module in a room on the same floor or above (or in a room the house lacks)."""
  bad = []
  for name, path in sorted(modules.items()):
    for target in sorted(_imports(name, path, modules)):
      here, there = room_of(name), room_of(target)
      if here != there and not FLOOR.get(there, len(FLOORS)) < FLOOR.get(here, -1):
        bad.append(f"{name} (floor {FLOOR.get(here)}) -> {target} (floor {FLOOR.get(there)})")
  return bad


def _is_import(line: str) -> bool:
  return line.startswith("import ") or line.startswith("from ") and " import " in line


def function_imports(path: pathlib.Path):
  """(line, top-level package, has its reason) of every import inside a function of the file at `path`."""
  lines = path.read_text().splitlines()
  for node in ast.walk(ast.parse("\n".join(lines))):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    for inner in ast.walk(node):
      if isinstance(inner, ast.Import):
        top = inner.names[0].name.split(".")[0]
      elif isinstance(inner, ast.ImportFrom) and inner.module:
        top = inner.module.split(".")[0]
      else:
        continue
      above = (lines[i].strip() for i in range(inner.lineno - 2, -1, -1))
      reason = next((line for line in above if not _is_import(line)), "")  # above the imports grouped with it
      yield inner.lineno, top, reason.startswith(LAZY_REASON)


def test_every_room_stands_on_a_floor():
  rooms = {room_of(name) for name in _modules()}
  assert rooms == set(FLOOR), (sorted(rooms - set(FLOOR)), sorted(set(FLOOR) - rooms))


def test_every_room_imports_only_the_floors_below_it():
  assert not upward_imports(_modules())


def test_the_floor_check_sees_an_import_that_runs_up_or_across(tmp_path):
  """The check above can fail: storage importing the CLI (up), run importing streaming (across), both found."""
  modules = {"inspect_tool.storage.paths": tmp_path / "paths.py", "inspect_tool.cli.options": tmp_path / "options.py",
             "inspect_tool.run.runner": tmp_path / "runner.py", "inspect_tool.streaming.read": tmp_path / "read.py",
             "inspect_tool.errors": tmp_path / "errors.py"}
  modules["inspect_tool.storage.paths"].write_text(
      "from inspect_tool import errors\ndef f():\n  from inspect_tool.cli import options\n")
  modules["inspect_tool.run.runner"].write_text("from inspect_tool.streaming import read\n")
  for name in ("inspect_tool.cli.options", "inspect_tool.streaming.read", "inspect_tool.errors"):
    modules[name].write_text("")
  assert upward_imports(modules) == [
      "inspect_tool.run.runner (floor 10) -> inspect_tool.streaming.read (floor 10)",
      "inspect_tool.storage.paths (floor 2) -> inspect_tool.cli.options (floor 13)"]


def test_below_the_cli_own_modules_and_the_standard_library_are_imported_at_module_top():
  lazy = [f"{name}:{line} {top}" for name, path in _modules().items() if room_of(name) not in ("inspect_tool.cli",
          "inspect_tool") for line, top, _ in function_imports(path)
          if top in ("inspect_tool", "quant") or top in sys.stdlib_module_names]
  assert not lazy


def test_every_lazy_third_party_import_says_why():
  unexplained = [f"{name}:{line} {top}" for name, path in _modules().items()
                 if room_of(name) not in ("inspect_tool.cli", "inspect_tool")
                 for line, top, explained in function_imports(path) if not explained]
  assert not unexplained


def test_the_lazy_import_checks_see_an_unexplained_and_an_own_lazy_import(tmp_path):
  path = tmp_path / "m.py"
  path.write_text("def f():\n  # lazy: JAX is heavy\n  import jax\n  import jax.numpy as jnp\n\n"
                  "def g():\n  import numpy as np\n  from inspect_tool import errors\n")
  assert list(function_imports(path)) == [(3, "jax", True), (4, "jax", True), (7, "numpy", False),
                                          (8, "inspect_tool", False)]


# What the fast commands load (`--help`, the Orbax and HF listings, `keys`, `topologies`, import's input checks): the
# house is cut so that none of these imports JAX or Flax, with every own import at module top.
LIGHT_MODULES = ("inspect_tool", "inspect_tool.cli", "inspect_tool.listings.orbax_listing",
                 "inspect_tool.listings.hf_listing", "inspect_tool.checkpoint.exports", "inspect_tool.report.listing",
                 "inspect_tool.report.catalog_format", "inspect_tool.configuration.catalog",
                 "inspect_tool.sharding.topology_table", "inspect_tool.hf_import.inputs", "quant")


def test_the_modules_of_the_fast_commands_import_neither_jax_nor_flax():
  code = (f"import sys, importlib; [importlib.import_module(m) for m in {LIGHT_MODULES!r}]; "
          "print(sorted(m for m in ('jax', 'flax', 'qwix', 'orbax') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, cwd=ROOT)
  assert out.stdout.strip() == "[]"


def test_inspect_tool_keeps_at_most_four_modules_at_its_top():
  top = sorted(p.name for p in (ROOT / "inspect_tool").glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
  assert len(top) <= 4, top


def test_the_grouped_matmul_lives_in_one_package():
  assert not list((ROOT / "quant").glob("gmm_*.py"))
  assert {p.stem for p in (ROOT / "quant" / "gmm").glob("*.py")} >= {"op", "fp8", "backends", "tiled", "pallas", "ragged"}


def test_no_module_is_over_450_lines():
  long = {name: n for name, path in _modules().items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
  assert not long


def test_no_circle_of_imports_and_quant_never_imports_inspect_tool():
  modules = _modules()
  graph = {name: _imports(name, path, modules) for name, path in modules.items()}
  assert not [name for name in graph if name.startswith("quant") and any(t.startswith("inspect_tool") for t in graph[name])]
  state, circles = {}, []

  def visit(node, trail):
    state[node] = "open"
    for nxt in sorted(graph[node]):
      if state.get(nxt) == "open":
        circles.append(trail[trail.index(nxt):] + [nxt])
      elif nxt not in state:
        visit(nxt, trail + [nxt])
    state[node] = "done"

  for name in sorted(graph):
    if name not in state:
      visit(name, [name])
  assert not circles


def test_the_cycle_check_sees_a_circle(tmp_path, monkeypatch):
  """The check above can fail: two modules importing each other are found."""
  modules = {"quant.a": tmp_path / "a.py", "quant.b": tmp_path / "b.py"}
  modules["quant.a"].write_text("def f():\n  from quant import b\n")
  modules["quant.b"].write_text("from quant import a\n")
  assert _imports("quant.a", modules["quant.a"], modules) == {"quant.b"}
  assert _imports("quant.b", modules["quant.b"], modules) == {"quant.a"}


def test_the_public_api_named_in_the_docs_builds_maxtexts_tree():
  import inspect_tool  # pylint: disable=import-outside-toplevel

  names = inspect_tool.__all__
  documented = (ROOT / "docs" / "architecture.md").read_text()
  assert all(f"`{name}" in documented for name in names)
  cfg = inspect_tool.resolve_config(["model_name=deepseek3-tiny", "mtp_num_layers=1"])
  leaves = inspect_tool.param_leaves(inspect_tool.build_model(cfg, abstract=True))
  report = inspect_tool.build_report("deepseek3-tiny", leaves, include_all=False)
  expected = maxtext_listings.entries("deepseek3-tiny_scan_mtp1.txt")
  assert {(".".join(leaf.key), tuple(leaf.shape), leaf.dtype) for leaf in report.leaves} == expected
  assert sum(leaf.size for leaf in report.leaves) == 34004896  # MaxText's printed total for this model
  assert callable(inspect_tool.export) and callable(inspect_tool.export_deepseek_fp8)
  with pytest.raises(AttributeError):
    inspect_tool.no_such_name  # pylint: disable=pointless-statement
