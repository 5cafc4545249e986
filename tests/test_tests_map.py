"""tests/README.md's map from each package to the test files that import it, kept true: a test file that starts
importing a package, or a new package or test file, changes the map, and this test says what to write there.

`python tests/test_tests_map.py` prints the map as it should read."""

from __future__ import annotations

import ast
import os
import re
import sys

from conftest import REPO

README = os.path.join(REPO, "tests", "README.md")
BEGIN, END = "<!-- tests map: begin -->", "<!-- tests map: end -->"


def packages() -> list[str]:
  """Every package of the tool, `inspect_tool/X` and `quant` with `quant/gmm`, in order."""
  found = [f"inspect_tool/{d}" for d in sorted(os.listdir(os.path.join(REPO, "inspect_tool")))
           if os.path.isfile(os.path.join(REPO, "inspect_tool", d, "__init__.py"))]
  return found + ["quant", "quant/gmm"]


def _imported(path: str) -> set[str]:
  """The packages the file at `path` imports anything from (`from inspect_tool.run import x`: inspect_tool/run)."""
  names = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      names.update(alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
      names.add(node.module)
      names.update(f"{node.module}.{alias.name}" for alias in node.names)
  out = set()
  for name in names:
    parts = name.split(".")
    if parts[0] == "quant":
      out.add("quant/gmm" if parts[1:2] == ["gmm"] else "quant")
    elif parts[0] == "inspect_tool" and len(parts) > 1 and \
        os.path.isfile(os.path.join(REPO, "inspect_tool", parts[1], "__init__.py")):
      out.add(f"inspect_tool/{parts[1]}")
  return out


def _test_files() -> list[str]:
  return sorted(n for n in os.listdir(os.path.join(REPO, "tests")) if n.startswith("test_") and n.endswith(".py"))


def computed() -> str:
  """The map's Markdown: a line per package, then the files that import none (they run the commands)."""
  by_package = {package: [] for package in packages()}
  whole = []
  for name in _test_files():
    found = _imported(os.path.join(REPO, "tests", name))
    for package in found:
      by_package[package].append(name)
    if not found:
      whole.append(name)
  lines = ["| package | test files that import it |", "|---|---|"]
  lines += [f"| `{package}/` | {', '.join(f'`{n}`' for n in names) or '(none)'} |"
            for package, names in by_package.items()]
  lines += ["", "Whole commands only (they import none of the packages): " + ", ".join(f"`{n}`" for n in whole) + "."]
  return "\n".join(lines)


def written() -> str:
  text = open(README, encoding="utf-8").read()
  match = re.search(re.escape(BEGIN) + r"\n(.*?)\n" + re.escape(END), text, re.S)
  assert match, f"tests/README.md lacks the map between {BEGIN} and {END}"
  return match.group(1)


def test_the_readme_map_is_the_one_the_imports_draw():
  assert written() == computed(), "tests/README.md's map is out of date; `python tests/test_tests_map.py` prints it"


def test_every_package_and_every_test_file_is_in_the_map():
  text = written()
  assert [p for p in packages() if f"| `{p}/` |" not in text] == []
  assert [n for n in _test_files() if f"`{n}`" not in text] == []


if __name__ == "__main__":
  sys.stdout.write(computed() + "\n")
