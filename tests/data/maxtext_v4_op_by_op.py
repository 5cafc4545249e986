"""How `golden/v4_a_noquant_maxtext_op_by_op.npz` was made: MaxText 0.2.5 loads ckpt_v4-small and runs its model
once without jit (op by op) on the golden inputs. Needs a MaxText 0.2.5 install (not the test environment):
  JAX_PLATFORMS=cpu python maxtext_v4_op_by_op.py /work/shared/reference/ckpt_v4-small OUT.npz
"""
import os
import sys

import jax.numpy as jnp
import numpy as np
from maxtext.configs import pyconfig
from maxtext.utils import model_creation_utils
from maxtext.utils.globals import MAXTEXT_PKG_DIR

ckpt, out = sys.argv[1], sys.argv[2]
config = pyconfig.initialize([None, os.path.join(MAXTEXT_PKG_DIR, "configs", "base.yml"), "model_name=deepseek4-tiny",
                              "override_model_config=true", "vocab_size=512", f"load_parameters_path={ckpt}/0/items",
                              "attention=dot_product", "skip_jax_distributed_system=true", "per_device_batch_size=2",
                              "max_target_length=16", "base_output_directory=/tmp/maxtext_out", "run_name=golden",
                              "enable_checkpointing=false"])
model, _ = model_creation_utils.from_pretrained(config)
g = dict(np.load(os.path.join(ckpt, "golden_v4_a_noquant.npz")))
logits = model(jnp.asarray(g["tokens"]), jnp.asarray(g["positions"]), jnp.asarray(g["segment_ids"]), enable_dropout=False)
np.savez_compressed(out, logits=np.asarray(logits, np.float32), tokens=g["tokens"], positions=g["positions"],
                    segment_ids=g["segment_ids"])
