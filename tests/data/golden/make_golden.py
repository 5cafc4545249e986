"""How the goldens made for these tests were made: MaxText 0.2.5's own forward pass on the reference checkpoint.

Run with MaxText 0.2.5 (PyPI wheel) on its pinned stack (../shared/reference/maxtext_0.2.5_pins.txt), on CPU, the
output's name first, then MaxText keys:

    JAX_PLATFORMS=cpu python make_golden.py d_fp8full_mtptrue_megablox_false.npz quantization=fp8_full \
        quantize_mtp=true megablox=false use_qwix_quantization=true
    JAX_PLATFORMS=cpu python make_golden.py e_int8.npz quantization=int8 use_qwix_quantization=true

MaxText loads the reference checkpoint itself (`from_pretrained`, `load_parameters_path`), quantizes with Qwix (its
`maybe_quantize_model`) and runs the model under `nnx.jit` on the inputs of golden/README (batch (2, 16)). MaxText does
not return the MTP logits; they are taken where its MTP block hands them to its cross-entropy. With no quantization
keys the same script reproduces a_noquant.npz bit for bit (main and MTP logits), which checks the capture.
"""

import os
import sys

from flax import nnx
import jax.numpy as jnp
import maxtext
from maxtext.configs import pyconfig
from maxtext.layers import multi_token_prediction
from maxtext.utils import model_creation_utils
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
CKPT = os.path.join(HERE, "..", "ckpt_deepseek3-tiny-L4-V1024", "0", "items")
KEYS = ["model_name=deepseek3-tiny", "mtp_num_layers=1", "override_model_config=true", "base_num_decoder_layers=4",
        "first_num_dense_layers=1", "vocab_size=1024", "per_device_batch_size=2", "max_target_length=16",
        "attention=dot_product", "skip_jax_distributed_system=true", "enable_checkpointing=false", "run_name=golden",
        "base_output_directory=/tmp/golden_d", "dataset_type=synthetic", "enable_dropout=false"]


def main(out, extra):
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  config = pyconfig.initialize(["golden", base, *KEYS, f"load_parameters_path={os.path.abspath(CKPT)}", *extra])
  seen = []
  cross_entropy = multi_token_prediction._cross_entropy_with_integer_labels  # pylint: disable=protected-access

  def recording(logits, *args, **kwargs):
    seen.append(logits)
    return cross_entropy(logits, *args, **kwargs)

  multi_token_prediction._cross_entropy_with_integer_labels = recording  # pylint: disable=protected-access
  model, _ = model_creation_utils.from_pretrained(config)

  @nnx.jit
  def forward(model, tokens, positions, segments, targets):
    logits = model(tokens, positions, segments, enable_dropout=False, decoder_target_tokens=targets,
                   decoder_target_mask=segments)
    return logits, seen[-1]

  tokens = ((np.arange(32).reshape(2, 16) * 37 + 11) % 1024).astype(np.int32)
  positions = np.tile(np.arange(16, dtype=np.int32), (2, 1))
  ones = np.ones((2, 16), np.int32)
  targets = np.roll(tokens, -1, axis=1)
  logits, mtp_logits = forward(model, *(jnp.asarray(a) for a in (tokens, positions, ones, targets)))
  logits, mtp_logits = np.asarray(logits, np.float32), np.asarray(mtp_logits, np.float32)
  np.savez_compressed(os.path.join(HERE, out), tokens=tokens,
                      positions=positions, segment_ids=ones, targets=targets, target_mask=ones, logits=logits,
                      top1=logits.argmax(-1).astype(np.int32), mtp_logits=mtp_logits,
                      mtp_top1=mtp_logits.argmax(-1).astype(np.int32))


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2:])
