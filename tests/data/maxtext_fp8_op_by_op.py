"""How the MaxText fp8_full op-by-op references were made (see README.md). Needs MaxText 0.2.5 (not the test env):
  JAX_PLATFORMS=cpu python maxtext_fp8_op_by_op.py v32|v4 OUT.npz
"""
import os, sys, numpy as np, jax, jax.numpy as jnp
from flax import nnx
from maxtext.configs import pyconfig
from maxtext.utils.globals import MAXTEXT_PKG_DIR
from maxtext.utils import model_creation_utils
which, out = sys.argv[1], sys.argv[2]
tiles=[f"{a}_tile_{b}_{c}=32" for a in ("wi","wo") for b in ("fwd","dlhs","drhs") for c in ("batch_seq","embed_dim","mlp_dim")]
if which == "v32":
  R='/work/shared/reference/ckpt_v32-small'; gold='golden_v32_a_noquant.npz'
  keys='model_name=deepseek3.2-671b override_model_config=true mtp_num_layers=1 base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=4 base_mlp_dim=128 base_moe_mlp_dim=32 base_num_decoder_layers=3 first_num_dense_layers=1 vocab_size=512 num_experts=8 num_experts_per_tok=2 q_lora_rank=32 kv_lora_rank=16 qk_nope_head_dim=32 qk_rope_head_dim=16 v_head_dim=32 indexer_n_heads=4 indexer_head_dim=32 indexer_topk=8'.split()
  keys+=["quantization=fp8_full","quantize_mtp=true"]
else:
  R='/work/shared/reference/ckpt_v4-small'; gold='golden_v4_a_noquant.npz'
  keys=["model_name=deepseek4-tiny","override_model_config=true","vocab_size=512","quantization=fp8_full"]
argv=[None, os.path.join(MAXTEXT_PKG_DIR,"configs","base.yml")]+keys+tiles+[f"load_parameters_path={R}/0/items","use_qwix_quantization=true","attention=dot_product","skip_jax_distributed_system=true","per_device_batch_size=2","max_target_length=16","base_output_directory=/tmp/w10/mtf/out","run_name=x","enable_checkpointing=false"]
config=pyconfig.initialize(argv)
model,_=model_creation_utils.from_pretrained(config)
g=dict(np.load(os.path.join(R,gold)))
kw={}
if config.mtp_num_layers>0:
  kw=dict(decoder_target_tokens=jnp.asarray(g['targets']), decoder_target_mask=jnp.asarray(g['target_mask']))
call = lambda m, a, b, c: m(a, b, c, enable_dropout=False, **kw)
if os.environ.get("JIT"):  # JIT=1: the call under nnx.jit (golden/v4_fp8full_maxtext_jit.npz)
  call = nnx.jit(call)
logits=call(model, jnp.asarray(g['tokens']), jnp.asarray(g['positions']), jnp.asarray(g['segment_ids']))
inter=nnx.pop(model, nnx.Intermediate)
flat={'/'.join(str(p) for p in k): v for k, v in nnx.to_flat_state(inter)}
print([k for k in flat])
res=dict(logits=np.asarray(logits,np.float32))
for k,v in flat.items():
  if 'mtp_logits' in k or 'logits' in k.split('/')[-1]:
    vv=v.value if hasattr(v,'value') else v
    res['mtp_logits']=np.asarray(vv[0] if isinstance(vv,(tuple,list)) else vv, np.float32)
np.savez_compressed(out, tokens=g['tokens'], positions=g['positions'], segment_ids=g['segment_ids'], targets=g['targets'], target_mask=g['target_mask'], **res)
print({k: v.shape for k,v in res.items()})
