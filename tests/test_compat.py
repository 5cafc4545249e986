"""The one compatibility module: private APIs are reached only through it, and a missing one is one clear error."""

import dataclasses
import pathlib
import re

import pytest

from quant import compat, errors

from conftest import REPO
ROOT = pathlib.Path(REPO)


def test_no_module_but_compat_names_a_private_module_of_a_dependency():
  private = re.compile(r"\b(qwix|orbax[\w.]*|jax)\._src\b|jax\.core\.Tracer|\.in_tracers\b"
                       r"|_get_current_rule_and_op_id\(|\._rule_matches\b"
                       r"|\b\w+\._src\b|\bre\._(parser|constants)\b|^\s*from [\w.]+ import _[a-z]")
  offenders = [f"{path.relative_to(ROOT)}:{number}" for folder in ("quant", "inspect_tool")
               for path in sorted((ROOT / folder).rglob("*.py")) if path.name != "compat.py"
               for number, line in enumerate(path.read_text().splitlines(), 1) if private.search(line)]
  assert not offenders


def test_every_private_api_used_exists_in_the_installed_versions():
  assert compat.disable_interceptions(lambda x: x + 1)(1) == 2
  assert compat.get_current_rule_intercept_key() == compat.GET_CURRENT_RULE
  assert "weight_sparsity_n" in {f.name for f in dataclasses.fields(compat.sparsity_rule_class())}
  assert compat.dot_general_qt_config_class().__name__ == "DotGeneralQtConfig"
  assert callable(compat.megablox_kernels().gmm) and callable(compat.megablox_kernels().tgmm)
  handler = compat.ORBAX_PYTREE_HANDLER.rsplit(".", 1)
  assert compat.private(handler[0], handler[1], package="orbax-checkpoint") is not None


def test_a_missing_private_api_is_one_line_naming_installed_and_tested_versions():
  with pytest.raises(compat.CompatError) as info:
    compat.private("qwix._src.no_such_module", "thing", package="qwix")
  message = str(info.value)
  assert isinstance(info.value, errors.QuantError) and info.value.exit_code == 2 and "\n" not in message
  assert message.startswith(f"qwix {compat.installed_version('qwix')} has no qwix._src.no_such_module.thing")
  assert message.endswith(f"accepted: qwix {compat.TESTED['qwix']} (tested)")
  with pytest.raises(compat.CompatError, match="provider"):
    compat.provider_rule(object(), "dot_general")


def test_numpy_huge_page_advice_is_set_through_numpys_switch():
  """The switch returns its previous setting: what `numpy_huge_page_advice` left is read back that way."""
  switch = compat.private("numpy._core.multiarray", "_set_madvise_hugepage", package="numpy")
  before = switch(True)
  try:
    compat.numpy_huge_page_advice(False)
    assert switch(True) is False
    compat.numpy_huge_page_advice(True)
    assert switch(False) is True
  finally:
    switch(before)
