#!/usr/bin/env bash
# Everything a lent GPU machine should run, in one call (docs/results.md, "On a
# GPU"): the CUDA engine tests, the same under compute-sanitizer, and the
# CUDA benchmark. Binaries built here (make build/cuda_engine_test
# build/cuda_bench) are used when they start; otherwise they are rebuilt with
# the machine's nvcc. EXTRAS=0 skips the copy-lane and step-by-step tools
# (at most 8 files come back from a lent machine). Logs and the benchmark's
# JSON go to ${OUT:-out/gpu}.
set -u
out=${OUT:-out/gpu}
mkdir -p "$out"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,clocks.sm,clocks.mem --format=csv
  nproc; free -g | head -2
} 2>&1 | tee "$out/machine.txt"
tools="cuda_engine_test cuda_bench"
[ "${EXTRAS:-1}" = 1 ] && tools="$tools cuda_steps cuda_copy_lanes"
for b in $tools; do
  [ -x build/$b ] || make -s build/$b NVCC_ARCH=-arch=sm_90 || exit 1
done
echo "== CUDA engine tests"
timeout 180 build/cuda_engine_test 2>&1 | tee "$out/cuda_engine_test.txt"
test_rc=${PIPESTATUS[0]}
if command -v compute-sanitizer >/dev/null && [ "${SANITIZE:-1}" = 1 ]; then
  echo "== CUDA engine tests under compute-sanitizer (memcheck)"
  timeout 240 compute-sanitizer --tool memcheck --print-limit 20 build/cuda_engine_test >"$out/memcheck.txt" 2>&1
  echo "memcheck exit $?"; tail -15 "$out/memcheck.txt"
fi
echo "== CUDA benchmark"
timeout 300 build/cuda_bench --sections "${SECTIONS:-1234567}" "$out/cuda_bench.json" 2>&1 | tee "$out/cuda_bench.txt"
bench_rc=${PIPESTATUS[0]}
if [ "${EXTRAS:-1}" = 1 ]; then
  echo "== An urgent copy behind a long one, by stream and by feeding (bench/cuda_copy_lanes.cu)"
  timeout 60 build/cuda_copy_lanes "$out/copy_lanes.json" 2>&1 | tee "$out/copy_lanes.txt"
  echo "== Step by step (balanced workload at 3x, 32 steps, prefetch and on demand)"
  { timeout 60 build/cuda_steps --label prefetch; timeout 60 build/cuda_steps --on-demand --label ondemand; } >"$out/steps.txt" 2>&1
  tail -3 "$out/steps.txt"
fi
# A baseline binary (the same benchmark over an earlier engine, built by
# hand into build/cuda_bench_base) runs the workload tables beside it.
if [ -x build/cuda_bench_base ]; then
  echo "== CUDA benchmark, baseline engine (workload tables)"
  timeout 240 build/cuda_bench_base --sections 56 "$out/cuda_bench_base.json" 2>&1 | tee "$out/cuda_bench_base.txt"
fi
echo "tests exit $test_rc, bench exit $bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
