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
# The lent H100 sets CXX to a /opt/gcc build whose libstdc++ pieces end up inside
# _C.so: every TORCH_CHECK message with a number then segfaults in std::ostream
# (seen 2026-11-23).  The distribution's g++ links libstdc++ dynamically, as torch does.
export CXX=${TORCHSP_CXX:-g++} CC=${TORCHSP_CC:-gcc}
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

stage_build() {
  local t=$SECONDS
  if python3 setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    note "build: ok in $((SECONDS - t)) s"
    mv "$OUT/build.log" /tmp/build.log  # only a failed build's log comes back (8 files at most)
  else
    tail -40 "$OUT/build.log"; note "build: FAILED"; exit 1
  fi
}

stage_test() {
  # One pytest per file, four at a time, so that a crash in one file cannot hide
  # the others.  TEST_K (default: the CUDA cases; the CPU half and the CPU float64
  # gradchecks, 2-6 min here, run in CI) selects.
  # pytest-timeout (carried wheel) turns a hung test into a traceback naming it.
  local t=$SECONDS
  python3 -c "import pytest_timeout" 2>/dev/null || pip install -q --no-index --find-links "${WHEELS:-.gl/wheels}" pytest-timeout > /dev/null 2>&1
  python3 -c "import pytest_timeout" 2>/dev/null && export TSP_PYTEST_TIMEOUT="--timeout ${TEST_TIMEOUT:-150}"
  mkdir -p /tmp/tlogs && rm -f /tmp/tlogs/*
  ls ${TEST_FILES:-tests/test_*.py} | grep -v "${TEST_SKIP_FILES:-test_examples}" | xargs -P ${TEST_JOBS:-4} -I{} sh -c \
    'python3 -X faulthandler -m pytest -q -rf -p no:cacheprovider --durations=3 ${TSP_PYTEST_TIMEOUT:-} -k "${TEST_K:-not cpu and not gradcheck}" "{}" > /tmp/tlogs/$(basename "{}").log 2>&1; echo "rc=$?" >> /tmp/tlogs/$(basename "{}").log'
  : > "$OUT/tests.log"
  for f in /tmp/tlogs/*.log; do
    cat "$f" >> "$OUT/tests.log"
    note "  $(basename "$f" .log): $(tail -1 "$f") $(tail -2 "$f" | head -1 | cut -c1-110)"
  done
  note "tests: $((SECONDS - t)) s"
  grep -E "^(FAILED|ERROR)|Fatal Python|Timeout|^[0-9.]+s (call|setup)" "$OUT/tests.log" | head -40 | tee -a "$summary"
}

stage_testx() {
  # The same CUDA cases as stage_test in one pytest spread over CPU cores (pytest-xdist;
  # the machine has no network: wheels carried in $WHEELS, default .gl/wheels).
  local t=$SECONDS
  python3 -c "import xdist" 2>/dev/null || pip install -q --no-index --find-links "${WHEELS:-.gl/wheels}" pytest-xdist > /dev/null 2>&1
  if ! python3 -c "import xdist" 2>/dev/null; then note "testx: no pytest-xdist, running stage_test"; stage_test; return; fi
  timeout ${TESTX_TIMEOUT:-600} python3 -m pytest -q -rf -p no:cacheprovider -n ${TEST_WORKERS:-14} -k "${TEST_K:-not cpu and not gradcheck}" \
    --ignore=tests/test_examples.py ${TEST_FILES:-tests} > "$OUT/tests.log" 2>&1
  note "testx: rc=$? $(tail -1 "$OUT/tests.log" | cut -c1-150) ($((SECONDS - t)) s)"
  grep -E "^(FAILED|ERROR)|Fatal Python" "$OUT/tests.log" | head -30 | tee -a "$summary"
}

stage_selftest() {
  # Standalone kernel-map check and timings (tools/cuda_selftest_kmap.cu, no torch).
  local t=$SECONDS
  nvcc -O3 -arch=sm_90 -std=c++17 -Icsrc tools/cuda_selftest_kmap.cu csrc/cuda/keys.cu csrc/cuda/kmap.cu \
    csrc/cuda/errors.cu -o /tmp/selftest > "$OUT/selftest.log" 2>&1 && /tmp/selftest >> "$OUT/selftest.log" 2>&1
  note "selftest kmap: rc=$? ($((SECONDS - t)) s)"; tail -25 "$OUT/selftest.log" >> "$summary"
  compute-sanitizer --tool memcheck --error-exitcode 9 /tmp/selftest --small > /tmp/st_mem.log 2>&1
  note "selftest kmap memcheck: rc=$? $(grep 'ERROR SUMMARY' /tmp/st_mem.log)"
  compute-sanitizer --tool racecheck --error-exitcode 9 /tmp/selftest --small > /tmp/st_race.log 2>&1
  note "selftest kmap racecheck: rc=$? $(grep 'RACECHECK SUMMARY\|ERROR SUMMARY' /tmp/st_race.log | tail -1)"
}

stage_sanitize() {
  local t=$SECONDS
  for tool in memcheck racecheck; do
    TORCHSP_SANITIZE=1 compute-sanitizer --tool $tool --error-exitcode 9 \
      python3 -m pytest -q -x -p no:cacheprovider -k "${SANITIZE_K:-not nothing}" tests/test_sanitize.py > "$OUT/sanitize_$tool.log" 2>&1
    note "sanitize $tool: rc=$? $(grep -E 'ERROR SUMMARY|passed|failed' "$OUT/sanitize_$tool.log" | tail -2 | tr '\n' ' ')"
  done
  cat "$OUT"/sanitize_*.log > "$OUT/sanitize.log"; rm -f "$OUT"/sanitize_*.log
  note "sanitize: $((SECONDS - t)) s"
}

stage_models() {
  # Issue 6: MinkUNet and SparseResNet21D on the real scan, fp16 and bf16, maps rebuilt per call.
  local dt
  for dt in float16 bfloat16; do
    PYTHONPATH=$PWD python3 examples/infer.py --device cuda --dtype $dt --voxel-size 0.05 --cr 1.0 \
      --repeats 10 >> "$OUT/models.log" 2>&1
    note "models $dt: rc=$?"; tail -3 "$OUT/models.log" | tee -a "$summary"
  done
  TORCHSP_TUNE=off PYTHONPATH=$PWD python3 examples/infer.py --device cuda --dtype float16 --voxel-size 0.05 \
    --cr 1.0 --repeats 10 >> "$OUT/models.log" 2>&1
  note "models float16, tuner off (fixed: mask-sorted output-stationary): rc=$?"; tail -2 "$OUT/models.log" | tee -a "$summary"
  for amp in fp16 bf16; do
    PYTHONPATH=$PWD python3 examples/train_minkunet.py --device cuda --voxel-size 0.05 --cr 1.0 --amp $amp \
      --steps 60 >> "$OUT/models.log" 2>&1
    note "train amp $amp: rc=$?"; tail -2 "$OUT/models.log" | tee -a "$summary"
  done
}

stage_tuner() {
  # Issue 5: the tuner against every fixed single dataflow, MinkUNet and SparseResNet21D.
  local t=$SECONDS
  timeout ${TUNER_TIMEOUT:-200} python3 tools/bench_models.py --device cuda --dtype float16 --voxel-size 0.05 \
    --repeats ${TUNER_REPEATS:-10} > "$OUT/bench_models.log" 2>&1
  note "bench_models: rc=$? ($((SECONDS - t)) s)"; tail -25 "$OUT/bench_models.log" >> "$summary"
}

stage_sass() {
  # Which tensor-core instructions the build holds (HMMA: mma.sync, HGMMA: wgmma) and spills.
  local so; so=$(ls torchsp/_C*.so | head -1)
  note "sass: HMMA $(cuobjdump -sass "$so" | grep -c HMMA) HGMMA $(cuobjdump -sass "$so" | grep -c HGMMA) in $so"
}

stage_profile() {
  # Nsight Compute over one forward of the wide layers (PROFILE_LAYERS, PROFILE_ALGOS).
  local l a
  for l in ${PROFILE_LAYERS:-subm3_c256}; do
    for a in ${PROFILE_ALGOS:-0,0,0,0}; do
      timeout 120 ncu --clock-control none --kernel-name regex:${PROFILE_KERNEL:-igemm} --launch-skip 2 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis ${PROFILE_EXTRA:-} \
        python3 tools/profile_conv.py $l --algo $a >> "$OUT/profile.log" 2>&1
      note "profile $l $a: rc=$?"
    done
  done
  [ -n "${PROFILE_EXTRA:-}" ] && grep -E "stalled|pipe_tensor|lts__t_bytes|bank_conflicts|igemm_os_kernel|wgmma_os_kernel" "$OUT/profile.log" | grep -v "^==" | awk '$NF+0 > 0.5 || /kernel/' >> "$summary"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occ|Stall|Issue Slots Busy|L2 Hit|Block Limit" "$OUT/profile.log" | head -60 >> "$summary"
}

stage_peers() {
  # Untracked peer builds (.peers/, carried, never committed): see .peers/README_*.txt.
  local f
  for f in .peers/BUILD_*.sh; do
    [ -f "$f" ] || continue
    bash "$f" > "$OUT/peers_build.log" 2>&1
    note "peer build $f: rc=$?"; tail -3 "$OUT/peers_build.log" | tee -a "$summary"
  done
  [ -f .peers/env.sh ] && . .peers/env.sh
  return 0
}

stage_bench() {
  if [ "${BENCH_KMAP:-1}" = 1 ]; then
    timeout 120 python3 tools/bench_kmap.py --json "$OUT/bench_kmap.json" > "$OUT/bench_kmap.log" 2>&1
    note "bench_kmap: rc=$?"; tail -30 "$OUT/bench_kmap.log" >> "$summary"
  fi
  timeout ${BENCH_TIMEOUT:-480} python3 tools/bench.py --json "$OUT/bench.json" --plot "$OUT/bench.png" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1
  note "bench: rc=$?"; tail -45 "$OUT/bench.log" >> "$summary"
}

stage_ktimes() {
  # Device time per kernel of each op call (tools/kernel_times.py, torch.profiler).
  timeout ${KTIMES_TIMEOUT:-240} python3 tools/kernel_times.py ${KTIMES_ARGS:-} > "$OUT/ktimes.log" 2>&1
  note "ktimes: rc=$?"; sed -n '/^# layer/,$p' "$OUT/ktimes.log" >> "$summary"
}

nvidia-smi -L | tee -a "$summary"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$summary"
for s in "$@"; do "stage_$s"; done
echo "=================== summary"
cat "$summary"
