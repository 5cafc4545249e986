#!/usr/bin/env bash
# Run MaxText 0.2.5's train_compile for each case of a list, one at a time, skipping cases already written.
# A case line: NAME KEYS...   (blank lines and '#' comments skipped). Outputs: DIR/NAME.json, DIR/logs/NAME.log.
# Usage: scripts/maxtext_compile_cases.sh CASES.txt DIR [MAXTEXT_PYTHON]
# With DUMP=1, XLA's dump of the compiled step is kept, gzipped, in DIR/dumps/NAME/: the optimized HLO, the buffer
# assignment, the live ranges (with XLA's live set at the peak) and the memory-usage report (it does not change the
# figures: checked on deepseek3-tiny, v5p-8).
set -u
cases=$1 dir=$2 py=${3:-/work/venvs/maxtext/bin/python}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$dir/logs"
export ALLOW_MULTIPLE_LIBTPU_LOAD=1
grep -v '^\s*\(#\|$\)' "$cases" | while read -r name keys; do
  [ -e "$dir/$name.json" ] && continue
  echo "$(date +%T) $name: $keys" >&2
  flags=${XLA_FLAGS:-}
  if [ "${DUMP:-0}" = 1 ]; then
    rm -rf "$dir/dumps/$name" && mkdir -p "$dir/dumps/$name"
    flags="$flags --xla_dump_to=$dir/dumps/$name --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"
  fi
  # shellcheck disable=SC2086
  XLA_FLAGS="$flags" timeout 3600 "$py" "$here/maxtext_compile_memory.py" "$dir/$name.json" $keys \
    >"$dir/logs/$name.log" 2>&1 </dev/null
  if [ "${DUMP:-0}" = 1 ]; then
    find "$dir/dumps/$name" -type f ! \( -name '*after_optimizations.txt' -o -name '*buffer-assignment.txt' \
      -o -name '*live-range.txt' -o -name '*memory-usage-report.txt' \) -delete
    find "$dir/dumps/$name" -type f ! -name "*.gz" -exec gzip -f {} +
  fi
  tail -1 "$dir/logs/$name.log" >&2
done
