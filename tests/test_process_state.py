"""Process-wide state in one place (`inspect_tool.process_state`): every module-level container and `global` of the
tool is declared there, and the commands, run one after another in one process, leave none of it behind."""

import ast
import importlib
import os
import pathlib

import pytest

from inspect_tool import process_state
from inspect_tool import progress
from inspect_tool.storage import commit

from conftest import DATA
from conftest import REPO
from conftest import run_cli

CKPT = os.path.join(DATA, "ckpt_deepseek3-tiny-L4-V1024")
L4 = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
      "first_num_dense_layers=1", "vocab_size=1024"]
_CONTAINERS = {"set", "dict", "list", "OrderedDict", "defaultdict", "deque", "local"}  # calls that make one


def state_names(source: str) -> set[str]:
  """The module's process-wide state: module-level containers under a lower-case name (constants are upper case)
  and every name a function rebinds with `global`."""
  tree = ast.parse(source)
  found = set()
  for node in tree.body:
    if isinstance(node, ast.Assign):
      targets, value = node.targets, node.value
    elif isinstance(node, ast.AnnAssign) and node.value is not None:
      targets, value = [node.target], node.value
    else:
      continue
    func = value.func if isinstance(value, ast.Call) else None
    call = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if isinstance(value, (ast.List, ast.Dict, ast.Set)) or call in _CONTAINERS:
      found |= {t.id for t in targets if isinstance(t, ast.Name) and t.id.upper() != t.id}
  for node in ast.walk(tree):
    if isinstance(node, ast.Global):
      found.update(node.names)
  return found


def _declared_names() -> set[str]:
  names = set()
  for declared in process_state.declared():
    module, attributes = declared.name.split(":")
    names |= {f"{module}:{a}" for a in attributes.split(",")}
  return names


def test_every_piece_of_process_wide_state_is_declared():
  modules = {}
  for path in sorted(pathlib.Path(REPO, "inspect_tool").rglob("*.py")):
    parts = path.relative_to(REPO).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    if name != process_state.__name__:  # the registry itself
      modules[name] = state_names(path.read_text())
  for name, found in modules.items():
    if found:
      importlib.import_module(name)  # a module declares its state when imported
  kept = {f"{name}:{attribute}" for name, found in modules.items() for attribute in found}
  assert kept == _declared_names()
  assert len(kept) >= 20  # 23 now: a scan that finds nothing cannot pass


def test_the_scan_sees_containers_and_globals_not_constants():
  source = ("_cache = {}\n_seen: set[str] = set()\n_LIMITS = {'a': 1}\nMAX = 3\n_pool = threading.local()\n"
            "def f():\n  global _flag\n  _flag = True\n")
  assert state_names(source) == {"_cache", "_seen", "_pool", "_flag"}


def test_leftovers_show_a_run_s_state_and_end_command_resets_settings_but_not_runs():
  assert process_state.leftovers() == {}
  progress.set_quiet(True)
  commit._own.add("gs://bucket/left-behind")  # pylint: disable=protected-access
  try:
    assert process_state.leftovers() == {"inspect_tool.progress:_QUIET": True,
                                         "inspect_tool.storage.commit:_own": ["gs://bucket/left-behind"]}
    process_state.end_command()
    assert process_state.leftovers() == {"inspect_tool.storage.commit:_own": ["gs://bucket/left-behind"]}
  finally:
    commit._own.discard("gs://bucket/left-behind")  # pylint: disable=protected-access
  assert process_state.leftovers() == {}


@pytest.mark.parametrize("mistake", ["kind", "reset"])
def test_a_declaration_needs_a_kind_and_a_reset_for_what_end_command_empties(mistake):
  with pytest.raises(ValueError, match="process state test:x"):
    if mistake == "kind":
      process_state.declare("test:x", "forever", lambda: None, lambda: None)
    else:
      process_state.declare("test:x", process_state.CACHE, lambda: None)


def test_the_commands_one_after_another_in_one_process_leave_nothing_behind(tmp_path, capsys):
  exported = tmp_path / "fp8"
  steps = [
      ["maxtext", *L4, "--summary"],
      ["forward", *L4, "--checkpoint", CKPT, "--quiet"],
      ["export", *L4, "quantization=fp8_full", "--checkpoint", CKPT, "--output", exported, "--quiet",
       "--no-validate"],
      ["verify", exported],
      ["diff", *L4, "quantization=fp8_full", "--path", exported],
      ["orbax", "--path", exported],
      ["import", "--path", os.path.join(DATA, "import", "hf_small"), "--output", tmp_path / "imported", "--quiet"],
      ["export", *L4, "quantization=fp8_full", "--checkpoint", CKPT, "--output", exported],  # exists: exit 2
      ["forward", "model_name=deepseek3-tiny", "gmm_backend=fast"],  # a bad key: exit 2
  ]
  codes = []
  for argv in steps:
    code, _, err = run_cli(capsys, *argv)
    codes.append(code)
    assert process_state.leftovers() == {}, (argv[0], err)
  assert codes == [0, 0, 0, 0, 0, 0, 0, 2, 2]
