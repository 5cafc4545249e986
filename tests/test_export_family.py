"""FP8 export of DeepSeek-V3.2, DeepSeek-V4 and deepseek-custom: the export, loaded back into the quantized model,
gives the source's quantized (Qwix QT) logits bit for bit, every head (the validation's own comparison), and stands
clearly away from the unquantized model.

The QT forward of V3.2 and V4 on these checkpoints equals MaxText's quantized forward bit for bit (tests/test_v32.py,
tests/test_v4.py), so an export equal to it reproduces MaxText's fp8_full logits. Measured on both stacks: 0.0
relative error and top-1 1.0 against the QT source; 0.19-0.26 from the unquantized model.
"""

import pathlib

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

import golden_parity
import test_custom
import test_v32
import test_v4

from inspect_tool.checkpoint import orbax_metadata
from inspect_tool.fp8_export import pipeline as export

from conftest import DATA as DATA_DIR
DATA = pathlib.Path(DATA_DIR)


def _v4_checkpoint(root: pathlib.Path) -> str:
  """MaxText's ckpt_v4-small (tests/data/ckpt_v4-small.npz) written back as an Orbax checkpoint (converter layout)."""
  data = np.load(DATA / "ckpt_v4-small.npz")
  bf16 = set(data["__bfloat16_keys__"].tolist())
  nested: dict = {}
  for key in data.files:
    if key == "__bfloat16_keys__":
      continue
    value = data[key].view(ml_dtypes.bfloat16).astype(np.float32) if key in bf16 else data[key]
    node = nested.setdefault("params", {})
    *parents, leaf = key.split("/")
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  items = root / "0" / "items"
  with ocp.StandardCheckpointer() as checkpointer:  # its save is asynchronous: wait on the same checkpointer
    checkpointer.save(str(items), nested)
    checkpointer.wait_until_finished()
  return str(root / "0")


V32_INDEXER = "decoder.moe_layers.self_attention.indexer"
CASES = {  # tokens, source, {leaf: (shape, dtype)} that the export must hold
    "deepseek3.2": (test_v32.SMALL + ["quantization=fp8_full", "quantize_mtp=true"], lambda tmp: str(test_v32.CKPT), {
        f"{V32_INDEXER}.wq_b.kernel.array.qvalue": ((32, 2, 4, 32), "float8_e4m3fn"),
        f"{V32_INDEXER}.wq_b.kernel.array.scale": ((1, 2, 4, 32), "bfloat16"),
        f"{V32_INDEXER}.wk.kernel.array.qvalue": ((64, 2, 32), "float8_e4m3fn"),
        f"{V32_INDEXER}.weights_proj.kernel.array.qvalue": ((64, 2, 4), "float8_e4m3fn"),
        f"{V32_INDEXER}.weights_proj.kernel.array.scale": ((1, 2, 4), "float32"),  # its float32 compute
        f"{V32_INDEXER}.k_norm.scale": ((32, 2), "float32"),  # norms are copied unchanged
    }),
    "deepseek4": (test_v4.SMALL + ["quantization=fp8_full"], _v4_checkpoint, {
        "decoder.scanned_blocks.layers_1.self_attention.csa_compressor.indexer.q_proj.kernel.array.qvalue":
            ((16, 20, 128), "float8_e4m3fn"),
        "decoder.scanned_blocks.layers_1.self_attention.csa_compressor.indexer.q_proj.kernel.array.scale":
            ((1, 20, 128), "bfloat16"),
    }),
    # deepseek-custom at its own widths (2 layers, vocab 512): random init as the source
    "deepseek-custom": (test_custom.CUSTOM + ["base_num_decoder_layers=2", "vocab_size=512", "max_target_length=16",
                                              "quantization=fp8_full"], lambda tmp: None, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_export_reproduces_the_quantized_source_bit_for_bit(name, tmp_path):
  tokens, source, expected = CASES[name]
  result = export.export(tokens, str(tmp_path / "fp8"), source=source(tmp_path / "src"), command="pytest")
  heads = result.validation.vs_quantized
  assert len(heads) == (2 if name == "deepseek3.2" else 1)
  for row in heads:
    assert row.rel_error == 0.0 and row.top1_agreement == 1.0
  for row in result.validation.vs_unquantized:
    assert row.rel_error >= golden_parity.AWAY
  leaves = {leaf.dotted: (leaf.shape, leaf.dtype) for leaf in orbax_metadata.read_leaves(result.dst)}
  for key, want in expected.items():
    assert leaves[f"params.params.{key}"] == want, key
  mhc = [k for k in leaves if ".mhc_" in k]
  assert (name == "deepseek3.2") == (not mhc) and all(not k.endswith(".qvalue") for k in mhc)  # mHC: copied
