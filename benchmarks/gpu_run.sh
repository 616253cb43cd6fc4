#!/usr/bin/env bash
# The one prepared GPU measurement, for a lent accelerator machine (JAX with CUDA and
# orbax-checkpoint preinstalled, no network). Run from the repository root:
#   OUT=/some/dir bash benchmarks/gpu_run.sh
# Writes $OUT/results_gpu.json and $OUT/bench_gpu.txt. Missing pure dependencies can be
# supplied as wheels in benchmarks/out/wheels (pip download ... here, carried along).
# Defaults fit a 10-minute call on one H200: SIZE_GB=8, REPS=2, BENCH_TIMEOUT=480 s.
set -uo pipefail
out=${OUT:-benchmarks/out}
mkdir -p "$out"
py=${PYTHON:-python3}
if [ -d benchmarks/out/wheels ]; then
  $py -m pip install -q --no-index --find-links benchmarks/out/wheels \
    msgpack crc32c cloudpickle etils gcsfs google-cloud-storage 2>&1 | tail -3
fi
$py - <<'PY' || exit 3
import importlib.util, sys
need = ['jax', 'orbax', 'tensorstore', 'msgpack', 'crc32c', 'etils', 'cloudpickle', 'gcsfs',
        'google.cloud.storage', 'psutil']
missing = [m for m in need if importlib.util.find_spec(m.split('.')[0]) is None]
if missing:
  sys.exit(f'missing modules: {missing}; put their wheels in benchmarks/out/wheels')
import jax
print('devices:', jax.devices(), 'memories:', jax.devices()[0].addressable_memories())
PY
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | tee "$out/gpu.txt"
PYTHONPATH=. timeout "${BENCH_TIMEOUT:-480}" $py benchmarks/bench.py --mode gpu \
  --size-gb "${SIZE_GB:-8}" --reps "${REPS:-2}" --warmup 1 --json-out "$out/results_gpu.json" \
  2>&1 | tee "$out/bench_gpu.txt"
exit "${PIPESTATUS[0]}"
