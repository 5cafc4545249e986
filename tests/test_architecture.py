"""The house rules of docs/architecture.md, checked on the source: packages per flow, small modules, no import
circles, `quant` apart from `inspect_tool`, and the public API the docs name."""

import ast
import pathlib

import pytest

import maxtext_listings

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("inspect_tool", "quant")
MAX_LINES = 450


def _modules() -> dict[str, pathlib.Path]:
  found = {}
  for package in PACKAGES:
    for path in (ROOT / package).rglob("*.py"):
      parts = path.relative_to(ROOT).with_suffix("").parts
      found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
  return found


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
  """The project modules `name` imports anywhere in its body (lazy imports in functions included)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      targets = [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      subs = [f"{node.module}.{alias.name}" for alias in node.names if f"{node.module}.{alias.name}" in modules]
      targets = subs or [node.module]
    else:
      continue
    out |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
  return out


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
