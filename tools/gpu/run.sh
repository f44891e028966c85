#!/bin/bash
# GPU checks (issues 26 and 21) in one command on the device machine; each section a process with its own time
# limit, results under $OUT (at most 8 files). Usage: bash tools/gpu/run.sh SECTION... (env pytest cudagrads casts
# bench bench8k benchffn bench4k overhead graphs compile blocks profile hostprof diagcompile blockgemm compilebench);
# PYTEST_ARGS overrides the pytest selection, T some sections' time limit. Starting a machine can take minutes of the
# session's device time: prefer one call with every section over several. Next GPU session (docs/performance.md, "GPU",
# what is left):
#   bash tools/gpu/run.sh env pytest overhead hostprof blockgemm bench4k compile
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/log.txt") 2>&1
PY=python3
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PWD:/tmp/site
fi
sec() { echo; echo "=== $1 ($(date +%T)) ==="; }
for s in "$@"; do
  case $s in
  env)
    sec env; nvidia-smi; $PY -c "import torch, triton, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__); print(torch.cuda.get_device_name(), torch.cuda.get_device_capability())"
    lscpu | grep -E "Model name|^CPU\(s\)|Flags" | cut -c1-400
    $PY -c "import torchao; print('torchao', torchao.__version__)" 2>&1 | tail -1 ;;
  pytest)
    sec pytest; timeout 150 $PY -m pytest ${PYTEST_ARGS:--m cuda tests/} -q -p no:cacheprovider -n 8 --timeout 100 \
      -rfE --tb=short --durations=10 2>&1 | tee "$OUT/pytest.txt" | tail -60 ;;
  casts)
    sec casts; timeout 60 $PY tools/gpu/check_casts.py --device cuda --budget 40 --out "$OUT/casts.json" ;;
  bench)
    sec bench; timeout 100 $PY -m fp8kit bench --device cuda --rounds 5 --shape 4096x4096x4096 \
      --shape 8192x8192x8192 --json "$OUT/bench.json" ;;
  bench8k)
    sec bench8k; timeout ${T:-70} $PY -m fp8kit bench --device cuda --rounds 5 --shape 8192x8192x8192 --json "$OUT/bench8k.json" ;;
  benchffn)
    sec benchffn; timeout ${T:-70} $PY -m fp8kit bench --device cuda --rounds 5 --shape 8192x4096x11008 \
      --shape 8192x11008x4096 --json "$OUT/benchffn.json" ;;
  bench4k)
    sec bench4k; timeout ${T:-45} $PY -m fp8kit bench --device cuda --rounds 5 --shape 4096x4096x4096 --json "$OUT/bench4k.json" ;;
  compile)
    sec compile; timeout 90 $PY tools/gpu/check_graphs_compile.py --device cuda --budget 75 \
      --only compile_current,compile_delayed,compile_bf16_reference --out "$OUT/graphs_compile.json" ;;
  overhead)
    sec overhead; timeout 75 $PY tools/gpu/overhead.py --device cuda --out "$OUT/overhead.json" ;;
  graphs)
    sec graphs+compile; timeout 170 $PY tools/gpu/check_graphs_compile.py --device cuda --budget 150 \
      --out "$OUT/graphs_compile.json" ;;
  blocks)
    sec blocks+fsdp; timeout 100 $PY tools/gpu/check_blocks_fsdp.py --device cuda --budget 80 \
      --out "$OUT/blocks_fsdp.json" ;;
  profile)
    sec profile; timeout 90 $PY tools/gpu/profile_linear.py --shape 8192x8192x8192 --shape 4096x4096x4096 \
      --out "$OUT/profile.txt" ;;
  cudagrads)
    sec cudagrads; timeout 120 $PY -m pytest tests/test_cuda_grads.py -q -p no:cacheprovider -rfE --tb=short \
      2>&1 | tee "$OUT/cuda_grads.txt" | tail -30 ;;
  diagcompile)
    sec diagcompile; TORCH_LOGS=aot_graphs timeout 150 $PY tools/gpu/diag_compile.py --out "$OUT/diag_compile.json" \
      2> "$OUT/aot_graphs.txt" ;;
  hostprof)
    sec hostprof; timeout 60 $PY tools/gpu/host_profile.py --out "$OUT/host_profile.txt" | tail -5 ;;
  blockgemm)  # the block GEMM kernel's float64 variants, timed and checked bit for bit (bench_block_gemm.py)
    sec blockgemm; timeout ${T:-150} $PY tools/gpu/bench_block_gemm.py --shape 4096 4096 4096 \
      --out "$OUT/bench_block_gemm.json" ;;
  compilebench)
    sec compilebench; timeout 150 $PY -m fp8kit bench --compile --device cuda --quick --json "$OUT/compile_bench.json" ;;
  esac
done
sec done
