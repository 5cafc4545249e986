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


def test_qwix_quantizes_through_quant_rounding_with_qwix_s_own_codes(monkeypatch):
  """Where a TPU would run it (the emulation forced on this CPU), Qwix's quantization takes its scale and quotient from
  `quant.rounding` (calls counted) and gives the codes and scales Qwix's own code gives on a CPU, bit for bit."""
  import functools

  import jax
  import jax.numpy as jnp
  import numpy as np

  from quant import rounding

  compat.exact_qwix_quantization(rounding.quotient, rounding.by_constant)
  scale_fn, quantize_fn = compat._EXACT_QWIX  # pylint: disable=protected-access  # Qwix's originals
  rng = np.random.default_rng(0)
  x = (rng.normal(size=(64, 256)) * np.exp2(rng.integers(-8, 8, (64, 1)))).astype(np.float32)
  qarray = compat.private("qwix._src.core.qarray", package="qwix")
  cases = [(dtype, qtype, axes, tiles) for dtype in (jnp.float32, jnp.bfloat16)
           for qtype in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8)
           for axes, tiles in (((0,), None), ((), None), ((0,), {1: 64}))]

  @functools.partial(jax.jit, static_argnums=(1, 2, 3))  # traced, as the tool runs it (eager divisions round otherwise)
  def quantize(array, qtype, axes, tiles):
    got = qarray.quantize_api(array, qtype, channelwise_axes=axes, tiled_axes=dict(tiles))
    return got.qvalue.astype(jnp.float32), got.scale.astype(jnp.float32)

  def quantized(array, qtype, axes, tiles):
    jax.clear_caches()
    return [np.asarray(a) for a in quantize(array, qtype, axes, tuple((tiles or {}).items()))]

  for dtype, qtype, axes, tiles in cases:
    array = jnp.asarray(x, dtype)
    monkeypatch.setattr(qarray, "compute_scale_zero_point", scale_fn)
    monkeypatch.setattr(qarray, "quantize_with_scale_zero_point", quantize_fn)
    want = quantized(array, qtype, axes, tiles)
    monkeypatch.undo()
    calls = []
    for name in ("emulated_quotient", "emulated_by_constant"):  # what rounding.quotient / by_constant call
      original = getattr(rounding, name)
      monkeypatch.setattr(rounding, name, lambda *a, _f=original, _n=name: (calls.append(_n), _f(*a))[1])
    monkeypatch.setattr(rounding, "_on_cpu", lambda: False)
    got = quantized(array, qtype, axes, tiles)
    monkeypatch.undo()
    assert {"emulated_quotient", "emulated_by_constant"} <= set(calls), (dtype, qtype)
    for w, g in zip(want, got, strict=True):
      np.testing.assert_array_equal(g, w, err_msg=f"{dtype} {qtype} {axes} {tiles}")
