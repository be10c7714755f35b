#!/usr/bin/env bash
# One call on the GPU machine: build torchsp for sm_90, then the named stages.
#   bash tools/gpu_session.sh build test sanitize selftest bench peers
# Logs go to $OUT (the device tool brings back at most 8 files); a short
# summary is printed last.
set -uo pipefail
OUT=${OUT:-/tmp/torchsp_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=${MAX_JOBS:-16}
export TORCHSP_CACHE_DIR=${TORCHSP_CACHE_DIR:-/tmp/torchsp_cache}
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

stage_build() {
  local t=$SECONDS
  if python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    note "build: ok in $((SECONDS - t)) s"
  else
    tail -40 "$OUT/build.log"; note "build: FAILED"; exit 1
  fi
}

stage_test() {
  local t=$SECONDS
  python3 -m pytest -q -x -p no:cacheprovider tests ${TEST_ARGS:-} > "$OUT/tests.log" 2>&1
  note "tests: $(tail -1 "$OUT/tests.log") ($((SECONDS - t)) s)"
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -20 | tee -a "$summary"
}

stage_sanitize() {
  local t=$SECONDS
  for tool in memcheck racecheck; do
    TORCHSP_SANITIZE=1 compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest -q -x -p no:cacheprovider tests/test_sanitize.py > "$OUT/sanitize_$tool.log" 2>&1
    note "sanitize $tool: rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize_$tool.log" | tail -2 | tr '\n' ' ')"
  done
  cat "$OUT"/sanitize_*.log > "$OUT/sanitize.log"; rm -f "$OUT"/sanitize_*.log
  note "sanitize: $((SECONDS - t)) s"
}

stage_bench() {
  python3 tools/bench_kmap.py --json "$OUT/bench_kmap.json" > "$OUT/bench_kmap.log" 2>&1
  note "bench_kmap: rc=$?"; tail -30 "$OUT/bench_kmap.log" >> "$summary"
  python3 tools/bench.py --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  note "bench: rc=$?"; tail -45 "$OUT/bench.log" >> "$summary"
}

nvidia-smi -L | tee -a "$summary"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$summary"
for s in "$@"; do "stage_$s"; done
echo "=================== summary"
cat "$summary"
