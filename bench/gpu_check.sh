#!/usr/bin/env bash
# GPU check: the CUDA tests, then the benchmark harness on CUDA state (pinned D2H
# limit measured first), on a machine with CUDA. Uses the machine's own torch (no
# install); writes results under $OUT (or bench/results/ when OUT is unset). Sized
# so that the CUDA tests (at most 90 s) and the harness (at most 170 s: the quick
# sweep of 64 and 256 MiB, the GPT-2-small + AdamW state, the 10,000-tensor replay
# buffer, a 2 GiB save under a heartbeat, RSS over many saves and the budget sweep, medians of 2) fit in
# about 4 minutes on one H200 (the many-tensor rows add at most 2.5); the Megatron
# variant below adds at most 4 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-bench/results}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu_nvidia_smi.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$out/gpu_nvidia_smi.txt"
# trio and tensordict may be missing on the GPU image: the CUDA tests need neither,
# and the harness skips peers whose library is missing (and says so in its JSON).
timeout 90 python3 -m pytest tests/test_cuda.py -q -p no:cacheprovider -k "not trio" -o addopts="" 2>&1 | tee "$out/gpu_pytest.txt"
rc=${PIPESTATUS[0]}
mkdir -p "$out/gpu"
timeout 170 python3 bench/harness.py --device cuda --quick --repeats 2 --many-tensors none --out "$out/gpu" 2>&1 | tee "$out/gpu_harness.txt"
rc=$(( rc || PIPESTATUS[0] ))
# Many small CUDA tensors (device gather into <= 512 KiB of scratch, one
# D2H copy per batch): the CUDA test, then the rows of 1,000 and 10,000 tensors
# (blocked vs a copy_ loop to host, heartbeat, durable, load), at most 90 s.
timeout 60 python3 -m pytest tests/test_many_tensors.py -q -p no:cacheprovider -k "cuda and not trio" -o addopts="" 2>&1 | tee -a "$out/gpu_pytest.txt"
rc=$(( rc || PIPESTATUS[0] ))
timeout 90 python3 bench/many_tensors.py --device cuda --counts 1000,10000 --repeats 2 --out "$out/gpu" 2>&1 | tee "$out/gpu_many_tensors.txt"
rc=$(( rc || PIPESTATUS[0] ))
# asyncsave.megatron with CUDA tensors: megatron-core's real request, staged by
# asyncsave's pool (pinned buffers, side stream) instead of its CUDA preload.
if python3 -c "import megatron.core, psutil" 2>/dev/null; then
  timeout 240 python3 -m pytest tests/test_megatron.py -q -p no:cacheprovider -o addopts="" \
    -k cuda 2>&1 | tee "$out/gpu_megatron.txt"
  rc=$(( rc || PIPESTATUS[0] ))
else
  echo "megatron-core or psutil not installed on this image: Megatron GPU variant not run" \
    | tee "$out/gpu_megatron.txt"
fi
exit $rc
