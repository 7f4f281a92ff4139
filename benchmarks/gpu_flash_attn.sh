#!/usr/bin/env bash
# Build flash-attn on a CUDA machine that cannot download (the lent device), for the GPU bench's
# flash-attention-2 path. PyPI has flash-attn as a source distribution only, and the device has nvcc.
#   here:        bash benchmarks/gpu_flash_attn.sh fetch      # the sdist into .fa/ (git-ignored), ~8 MB
#   on the GPU:  bash benchmarks/gpu_flash_attn.sh build      # carry .fa; builds in the background
#                bash benchmarks/gpu_flash_attn.sh wait       # a later call: waits, then says if it imports
# The build runs under setsid so it outlives the call that starts it (the device keeps such a process
# while the machine is held), and it compiles for this GPU's architecture alone: flash-attn's default builds
# four (sm_80, 90, 100 and 120), each compiled in turn for every kernel. Then: PYTHONPATH=/tmp/fa-site:$PWD bash benchmarks/run_gpu_bench.sh
# FA_HDIM=64 (the default) builds what the bench runs and no more, since a device loan is 30 minutes and the
# whole build did not finish in the part of one left for it: forward kernels of head dim 64 (the GPU pair's
# 2048/32) only, via flash-attn's own FLASHATTENTION_DISABLE_BACKWARD and a one-size HEADDIM_SWITCH that refuses
# other head dims by name (benchmarks/fa_trim.py): 12 of its 72 kernel files, the 4 backward ones empty. FA_HDIM=all
# builds the release as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
version=${FLASH_ATTN_VERSION:-2.8.3.post2}
site=/tmp/fa-site log=/tmp/fa-build.log
case "${1:-}" in
  fetch)
    ex=$(git rev-parse --git-path info/exclude); mkdir -p .fa "$(dirname "$ex")"
    grep -qx '/.fa/' "$ex" 2>/dev/null || echo /.fa/ >> "$ex"
    url=$(curl -fsS https://pypi.org/simple/flash-attn/ | grep -o "https://[^\"#]*flash_attn-$version.tar.gz" | head -1)
    curl -fsS -o ".fa/flash_attn-$version.tar.gz" "$url" && ls -l .fa ;;
  build)
    arch=$(python3 -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')")
    hdim=${FA_HDIM:-64} src=/tmp/fa-src/flash_attn-$version
    rm -rf /tmp/fa-src && mkdir -p /tmp/fa-src && tar xzf ".fa/flash_attn-$version.tar.gz" -C /tmp/fa-src
    [ "$hdim" = all ] || python3 benchmarks/fa_trim.py "$src" "$hdim"
    echo "building flash-attn $version (head dims: $hdim) for sm_$arch into $site; log: $log"
    FLASH_ATTN_CUDA_ARCHS=$arch FLASH_ATTENTION_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-$(nproc)} NVCC_THREADS=1 \
      setsid bash -c "python3 -m pip install -v --no-index --no-deps --no-build-isolation --target $site \
        $src > $log 2>&1; echo \"exit \$?\" >> $log" < /dev/null & disown
    sleep "${WAIT_S:-5}"; tail -3 "$log" ;;
  wait)
    [ -f "$log" ] || { echo "no build was started on this machine (a fresh one is bare): run build first" >&2; exit 1; }
    until grep -q '^exit ' "$log"; do sleep 10; done
    tail -5 "$log"
    PYTHONPATH=$site python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" ;;
  *) echo "usage: $0 fetch|build|wait" >&2; exit 2 ;;
esac
