"""What the quantizer did, per stored tensor, and the check of a copy against it.

`tally` gathers the dequantization error of every quantized tensor while the export quantizes it; `stored` reads an
export's stored tensors back (Orbax or safetensors, local or gs://) and hashes them in bounded memory; `build`
writes `DST/export_manifest.json`; `verify` re-reads an export and checks it against its manifest.
"""
