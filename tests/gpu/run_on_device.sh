#!/usr/bin/env bash
# GPU tests and the GPU sweep, in one call on a GPU machine (one GPU is enough:
# ranks share it through CUDA IPC).  Results go to $OUT (default benchmarks/out/gpu).
#
#   tests/gpu/run_on_device.sh [all|smoke|test|train|sweep|copies|goals]
#
# smoke: environment report and a 2-rank allreduce; test: every test in tests/gpu at
# n = 1 (no launcher) and at n = 2, 3, 4 (the tests marked mpi, under mpiexec), then
# train: examples/train_dp.py --device cuda at n = 1, 2, 4 against one process;
# sweep: benchmarks/gpu_sweep.py at n = 2 and 4 plus a markdown table, then copies:
# benchmarks/gpu_copies.py (pinned copy latency with 1, 2, 4 processes on the GPU);
# goals: the device-return, torch-busbw and DDP measurements of benchmarks/RESULTS.md
# ("The GPU goals"), GOAL_RUNS times the return at n = 2 (default 3).
# Knobs: PYTHON, MPIEXEC, TESTS (a path under tests/gpu), TEST_NS, TRAIN_NS, SWEEP_ARGS,
# SWEEP_NS, COPY_NS.
set -uo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
MODE=${1:-all}
# NVLink multicast stays off, also for programs started with their own environment.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export OUT=${OUT:-$ROOT/benchmarks/out/gpu}
mkdir -p "$OUT"
# an absolute path: mpiexec would otherwise find another python3 on its own PATH
PY=${PYTHON:-$(command -v python3)}
# Open MPI as root in a container: allow root, oversubscribe, shared memory without CMA.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_rmaps_base_oversubscribe=1
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || command -v mpirun || echo mpiexec)}
MPIFLAGS=()
if "$MPIEXEC" --version 2>&1 | grep -qi "open mpi\|open-rte\|openrte"; then
    MPIFLAGS=(--allow-run-as-root --oversubscribe --bind-to none)
fi
# (local ranks inherit this environment; no -x needed)
run_n() { local n=$1; shift; timeout "${STEP_TIMEOUT:-420}" "$MPIEXEC" -n "$n" "${MPIFLAGS[@]}" "$@"; }
status=0

env_report() {
    {
        echo "== $(date -u) $(uname -a)"
        nvidia-smi -L 2>&1 | head -8
        "$MPIEXEC" --version 2>&1 | head -2
        "$PY" - <<'PY'
import importlib
for m in ("numpy", "ml_dtypes", "mpi4py", "cupy", "torch", "cuda.bindings", "pytest", "pytest_timeout", "pytest_mpi", "tqdm"):
    try:
        mod = importlib.import_module(m)
        print(f"{m:15} {getattr(mod, '__version__', 'ok')}")
    except Exception as exc:
        print(f"{m:15} MISSING ({type(exc).__name__}: {exc})")
import cupy
print("cuda devices", cupy.cuda.runtime.getDeviceCount(), "runtime", cupy.cuda.runtime.runtimeGetVersion(), "driver", cupy.cuda.runtime.driverGetVersion())
PY
        df -h /dev/shm | tail -1
    } 2>&1 | tee "$OUT/env.txt"
}

smoke() {
    cat > /tmp/pycoll_smoke.py <<'PY'
import cupy as cp, numpy as np, pycoll
from mpi4py import MPI
r = MPI.COMM_WORLD.Get_rank()
cp.cuda.Device(0).use()
with pycoll.init(timeout=60) as c:
    x = cp.full(1 << 20, r + 1, cp.float32)
    c.allreduce(x)
    routes = [c.transport_of(p, device=True) for p in range(c.size)]
    ok = float(x[0]) == c.size * (c.size + 1) / 2 and float(x[-1]) == float(x[0])
    print(f"rank {r}: routes {routes} allreduce ok={ok}", flush=True)
    assert ok
PY
    echo "== smoke n=2" | tee -a "$OUT/tests.log"
    run_n 2 "$PY" -m mpi4py /tmp/pycoll_smoke.py 2>&1 | tee -a "$OUT/tests.log" || status=1
}

tests() {
    echo "== pytest tests/gpu (n=1)" | tee -a "$OUT/tests.log"
    timeout "${STEP_TIMEOUT:-420}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" ${TESTS:-tests/gpu} -rfs 2>&1 | tee -a "$OUT/tests.log" | tail -25 || status=1
    for n in ${TEST_NS:-2 3 4}; do
        echo "== pytest -m mpi tests/gpu under mpiexec -n $n" | tee -a "$OUT/tests.log"
        run_n "$n" "$PY" -m mpi4py -m pytest -q -x -p no:cacheprovider -o addopts="" -m mpi ${TESTS:-tests/gpu} -rf 2>&1 | tee -a "$OUT/tests.log" | tail -25 || status=1
    done
    train
}

train() {
    for n in ${TRAIN_NS:-1 2 4}; do
        echo "== examples/train_dp.py --device cuda, n=$n" | tee -a "$OUT/tests.log"
        run_n "$n" "$PY" -m mpi4py examples/train_dp.py --device cuda --steps 30 --check-single \
            --no-progress --json "$OUT/train_dp_cuda_n$n.json" 2>&1 | tee -a "$OUT/tests.log" | tail -8 || status=1
    done
}

sweep() {
    for n in ${SWEEP_NS:-2 4}; do
        echo "== gpu_sweep n=$n" | tee -a "$OUT/sweep.log"
        run_n "$n" "$PY" benchmarks/gpu_sweep.py --out "$OUT/sweep_n$n.json" ${SWEEP_ARGS:-} 2>&1 | tee -a "$OUT/sweep.log" || status=1
    done
    "$PY" benchmarks/gpu_table.py "$OUT"/sweep_n*.json > "$OUT/gpu_sweep.md" 2>&1 || status=1
}

copies() {
    for n in ${COPY_NS:-1 2 4}; do
        run_n "$n" "$PY" benchmarks/gpu_copies.py -b 8 -e 256K -f 4 2>&1 | tee "$OUT/copies_n$n.txt" || status=1
    done
}

goals() {
    {
        for i in $(seq "${GOAL_RUNS:-3}"); do
            echo "== $(date -u +%T) gpu_return n=2 ($i)"
            run_n 2 "$PY" benchmarks/gpu_return.py --reps 12 --sizes 1M,256M --skip-torch || status=1
        done
        for q in "" --queued; do
            echo "== $(date -u +%T) gpu_phases n=2 1M $q"
            run_n 2 "$PY" benchmarks/gpu_phases.py --bytes 1M $q || status=1
        done
        for n in 2 4; do
            echo "== $(date -u +%T) gpu_return n=$n, with torch's 256 MiB allreduce"
            run_n "$n" "$PY" benchmarks/gpu_return.py --reps 12 --sizes 1M,256M || status=1
        done
        for n in 2 2 2 4 4; do
            echo "== $(date -u +%T) bench_ddp n=$n"
            run_n "$n" "$PY" -m mpi4py examples/bench_ddp.py --device cuda --steps 80 \
                --modes ddp-gloo,ddp-pycoll || status=1
        done
        echo "== $(date -u +%T) bench_ddp n=2, 25M parameters"
        run_n 2 "$PY" -m mpi4py examples/bench_ddp.py --device cuda --steps 20 --hidden 2048 \
            --layers 7 --bucket-mb 25 --modes ddp-gloo,ddp-pycoll || status=1
    } > >(tee "$OUT/goals.log") 2>&1  # not a pipe: status must stay in this shell
}

case "$MODE" in
    smoke) env_report; smoke ;;
    train) env_report; train ;;
    test) env_report; smoke; tests ;;
    sweep) env_report; sweep; copies ;;
    copies) copies ;;
    goals) env_report; goals ;;
    all) env_report; smoke; tests; sweep; copies ;;
    *) echo "usage: $0 [all|smoke|test|train|sweep|copies|goals]"; exit 2 ;;
esac
ls /dev/shm | grep '^pycoll-' && { echo "leftover /dev/shm segments"; status=1; }
exit $status
