#!/usr/bin/env bash
# One run on a TPU host, steps in the order given, each to its own log under $LOGS (default /tmp/tpu-run), packed into
# $OUT/tpu-run.tgz at the end when OUT is set:
#   setup     a virtual environment (default /tmp/ic-venv) that sees the host's own JAX and libtpu
#             (--system-site-packages; PYTHONPATH kept) and installs the tool's other dependencies beside them;
#             PIP_INSTALL_ARGS are pip's index options (e.g. a local index and a folder of wheels)
#   recon     the host: TPU variables, devices, versions
#   commands  every command of the tool once on the chip, exit status and last lines
#   numerics  scripts/tpu_numerics.py as is, and with XLA's excess precision off
#   sweep     bench/bench_gmm.py --sweep (our kernel's tilings)
#   gmm       bench/bench_gmm.py forward, then --grad (MaxText's kernel from MAXTEXT_MEGABLOX when set; GMM_ARGS
#             added, e.g. --masked)
#   export    the same export on the chip and on the host's CPU: wall times, tensors that differ
#   lane      make test-tpu's tests: tests/test_tpu_commands.py, then tests/tpu_lane.txt in one process
#   lane-commands, lane-files, lane-chip   tests/test_tpu_commands.py (about 230 s on a v5e), the files of
#             tests/tpu_lane.txt (over 570 s), tests/test_tpu_chip.py alone
#   lane-a, lane-b   the first four files of tests/tpu_lane.txt, and the rest: a call's 600 s holds one of them
# Usage: scripts/tpu_run.sh STEP...   (each step has a time limit: STEP_LIMIT seconds, default 400); exit 1 when
# any step failed
set -uo pipefail
cd "$(dirname "$0")/.."
PACK=${OUT:-}
OUT=${LOGS:-/tmp/tpu-run}
VENV=${VENV:-/tmp/ic-venv}
PY=$VENV/bin/python
LIMIT=${STEP_LIMIT:-400}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the tool from this tree (scripts import it), the host's JAX kept
L4=(model_name=deepseek3-tiny mtp_num_layers=1 override_model_config=true base_num_decoder_layers=4
    first_num_dense_layers=1 vocab_size=1024)
CKPT=tests/data/ckpt_deepseek3-tiny-L4-V1024

setup() {
  [ -x "$PY" ] || python3 -m venv --system-site-packages "$VENV"
  local wanted
  wanted=$(python3 - <<'EOF'
import configparser
c = configparser.ConfigParser(); c.read("setup.cfg")
lines = [l.strip() for l in c["options"]["install_requires"].splitlines() if l.strip() and not l.startswith("#")]
print(" ".join(l.split(";")[0].replace(" ", "") for l in lines if not l.startswith(("jax", "jaxlib"))))
EOF
)
  # shellcheck disable=SC2086
  if ! "$PY" -m pip install -q ${PIP_INSTALL_ARGS:-} $wanted packaging; then
    for requirement in $wanted packaging; do  # one by one: what the index lacks is named, the rest installed
      "$PY" -m pip install -q ${PIP_INSTALL_ARGS:-} "$requirement" || echo "NOT INSTALLED: $requirement"
    done
  fi
  "$PY" -c "import jax, flax, qwix, orbax.checkpoint, treescope; print('jax', jax.__version__, jax.__file__)"
}

recon() {
  env | grep -E '^(TPU|JAX|XLA|MEGASCALE)' | sort
  "$PY" -c "import jax, importlib.metadata as m; print(jax.devices(), jax.devices()[0].device_kind);
print({p: m.version(p) for p in ('jax', 'jaxlib', 'libtpu', 'flax', 'qwix', 'orbax-checkpoint', 'numpy')});
print(jax.devices()[0].memory_stats())"
  nproc; free -g
}

run_cmd() {  # NAME ARGS...: one command of the tool, its exit status and the last lines of its output
  local name=$1; shift
  local start=$SECONDS
  "$PY" -m inspect_tool "$@" > "$OUT/cmd-$name.out" 2> "$OUT/cmd-$name.err"
  echo "== $name: exit $? in $((SECONDS - start)) s"
  tail -n 4 "$OUT/cmd-$name.out"; tail -n 6 "$OUT/cmd-$name.err"
}

commands() {
  local tmp=/tmp/ic-cmds; rm -rf "$tmp"; mkdir -p "$tmp"
  run_cmd forward forward "${L4[@]}" --checkpoint "$CKPT"
  run_cmd forward-highest forward "${L4[@]}" matmul_precision=highest --checkpoint "$CKPT"
  JAX_DEFAULT_MATMUL_PRECISION=highest run_cmd forward-jax-highest forward "${L4[@]}" quantization=fp8_full \
    --checkpoint "$CKPT"
  run_cmd export export "${L4[@]}" quantization=fp8_full quantize_mtp=true --checkpoint "$CKPT" \
    --output "$tmp/fp8" --overwrite
  run_cmd forward-export forward "${L4[@]}" quantization=fp8_full quantize_mtp=true --checkpoint "$tmp/fp8"
  run_cmd verify verify "$tmp/fp8"
  run_cmd export-deepseek export "${L4[@]}" quantization=fp8_full --checkpoint "$CKPT" --output "$tmp/ds" \
    --layout deepseek-fp8 --overwrite
  run_cmd export-ue8m0 export "${L4[@]}" quantization=fp8_full --checkpoint "$CKPT" --output "$tmp/ue" \
    --layout deepseek-fp8 --scale-fmt ue8m0 --overwrite
  run_cmd export-v4 export model_name=deepseek4-tiny override_model_config=true vocab_size=512 \
    quantization=fp8_full --random-init --output "$tmp/v4" --layout deepseek-v4 --overwrite
  run_cmd import import --path tests/data/import/hf_small --output "$tmp/imported" --overwrite
  run_cmd diff diff "${L4[@]}" --path "$CKPT"
  run_cmd rules rules "${L4[@]}" quantization=fp8_full quantize_mtp=true
  run_cmd maxtext maxtext "${L4[@]}" --summary
  run_cmd compile maxtext "${L4[@]}" per_device_batch_size=1 max_target_length=256 --topology v5e-1 --compile \
    --train adamw --summary
}

numerics() {
  "$PY" scripts/tpu_numerics.py
  XLA_FLAGS="${XLA_FLAGS:-} --xla_allow_excess_precision=false" "$PY" scripts/tpu_numerics.py
}

sweep() {
  # shellcheck disable=SC2086
  "$PY" bench/bench_gmm.py --sweep --tokens 8192 --workers 12 --repeats 5 ${SWEEP_ARGS:-}
}

gmm() {
  # shellcheck disable=SC2086
  "$PY" bench/bench_gmm.py --workers 12 ${GMM_ARGS:-}
  # shellcheck disable=SC2086
  "$PY" bench/bench_gmm.py --workers 12 --grad ${GMM_ARGS:-}
}

export_step() {
  local tmp=/tmp/ic-export; rm -rf "$tmp"; mkdir -p "$tmp"
  for where in tpu cpu tpu cpu; do
    local start=$SECONDS
    if [ "$where" = cpu ]; then export JAX_PLATFORMS=cpu; else unset JAX_PLATFORMS; fi
    "$PY" -m inspect_tool export "${L4[@]}" quantization=fp8_full quantize_mtp=true --checkpoint "$CKPT" \
      --output "$tmp/$where" --overwrite --quiet > /dev/null 2> "$OUT/export-$where.err"
    echo "export on $where: exit $? in $((SECONDS - start)) s"
  done
  unset JAX_PLATFORMS
  JAX_PLATFORMS=cpu "$PY" scripts/compare_exports.py "$tmp/cpu" "$tmp/tpu"
}

lane-commands() {
  "$PY" -m pytest -v -p no:cacheprovider -p no:xdist -o addopts="" -rfE --tb=short tests/test_tpu_commands.py \
    --junitxml="$OUT/lane-commands.xml"
}

lane-chip() {
  "$PY" -m pytest -v -p no:cacheprovider -p no:xdist -o addopts="" -rfE --tb=short tests/test_tpu_chip.py \
    --junitxml="$OUT/lane-chip.xml"
}

lane-part() {  # NAME FILE...: the lane's tests in these files, one process
  local name=$1; shift
  "$PY" -m pytest -v -p no:cacheprovider -p no:xdist -o addopts="" -rfE --tb=short "$@" --junitxml="$OUT/$name.xml"
}

lane-files() {
  # shellcheck disable=SC2046
  lane-part lane $(cat tests/tpu_lane.txt)
}

lane-a() {
  # shellcheck disable=SC2046
  lane-part lane-a $(head -n 4 tests/tpu_lane.txt)
}

lane-b() {
  # shellcheck disable=SC2046
  lane-part lane-b $(tail -n +5 tests/tpu_lane.txt)
}

lane() {
  lane-commands
  lane-files
}

failed=0
for step in "$@"; do
  fn=$step; [ "$step" = export ] && fn=export_step
  echo "### $step $(date +%T)" | tee -a "$OUT/steps.log"
  timeout -k 10 "$LIMIT" bash -c "$(declare -f); $(declare -p L4 CKPT OUT PY VENV); $fn" > "$OUT/$step.log" 2>&1
  status=$?
  [ "$status" -ne 0 ] && failed=1
  echo "### $step: exit $status $(date +%T)" | tee -a "$OUT/steps.log"
  tail -n 40 "$OUT/$step.log"
  if [ -n "$PACK" ]; then  # after every step: what ran comes back even if a later step outlasts the call
    tar czf "$PACK/tpu-run.tgz" -C "$OUT" .
  fi
done
exit $failed  # 1 when any step failed (each step's own status is in steps.log)
