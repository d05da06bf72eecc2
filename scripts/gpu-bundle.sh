#!/bin/bash
# Builds the GPU checks here (nvcc, -DSTELLAR_CUDA=ON) and packs them into a
# self-contained folder for a GPU machine that cannot install packages (no
# package registry there, so scripts/gpu-check.sh cannot run): the stripped
# test and tool binaries, the shared libraries they need that a bare
# machine may lack (everything ldd finds outside glibc and the GCC runtime,
# plus libcudart), and run.sh, which runs what gpu-check.sh runs and more
# (soft_gpu_rdma at four sizes, READ/WRITE bandwidth, doctor) and writes its
# log to $OUT/log (or ./gpu-log).
#
# Usage: scripts/gpu-bundle.sh [BUNDLE_DIR] (default build-gpu-bundle)
# Then, on the GPU machine, from the repository root: bash BUNDLE_DIR/run.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
bundle=${1:-build-gpu-bundle}
build=build-gpu
release=build-test-release
nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc /usr/local/cuda-*/bin/nvcc 2>/dev/null | head -n1)
[[ -n $nvcc ]] && nvcc=$(readlink -f "$nvcc")  # one spelling: a changed CMAKE_CUDA_COMPILER resets the cache
[[ -n $nvcc ]] || { echo "gpu-bundle: nvcc not found (install the CUDA toolkit)" >&2; exit 2; }

bash scripts/install-deps.sh
# Twice: if the cache named another nvcc, CMake resets it on the first run and drops the -D options.
for pass in 1 2; do
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTELLAR_BUILD_BENCH=OFF \
    -DSTELLAR_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" >/dev/null
done
ninja -C "$build" stellar_cuda_tests stellar_gpu_tests fake_libcuda stellar_cli soft_gpu_rdma
cmake -S . -B "$release" -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
ninja -C "$release" stellar_read_bw stellar_write_bw

rm -rf "$bundle"
mkdir -p "$bundle/bin" "$bundle/lib"
binaries=("$build/tests/stellar_cuda_tests" "$build/tests/stellar_gpu_tests" "$build/tests/soft_gpu_rdma"
          "$build/tests/libfake_libcuda.so" "$build/tools/stellar" "$release/bench/stellar_read_bw" "$release/bench/stellar_write_bw")
for b in "${binaries[@]}"; do
  cp "$b" "$bundle/bin/"
  strip "$bundle/bin/$(basename "$b")"
done
# Libraries a bare machine may lack: all but glibc's and the GCC runtime.
for b in "${binaries[@]}"; do
  ldd "$b" | awk '$3 ~ /^\// {print $3}'
done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libdl.so.*|librt.so.*|libpthread.so.*|libgcc_s.so.*|libstdc++.so.*|ld-linux*) ;;
    *) cp -L "$lib" "$bundle/lib/" ;;
  esac
done
cudart=$(ls "$(dirname "$nvcc")"/../lib64/libcudart.so.[0-9]* "$(dirname "$nvcc")"/../lib/libcudart.so.[0-9]* 2>/dev/null | grep -E 'libcudart\.so\.[0-9]+$' | head -n1 || true)
[[ -n $cudart ]] && cp -L "$cudart" "$bundle/lib/"
# stellar_gpu_tests dlopens the fake driver by the absolute path it was built with.
echo "$root/$build/tests/libfake_libcuda.so" > "$bundle/fake_libcuda_path"

cat > "$bundle/run.sh" <<'EOF'
#!/bin/bash
# Runs on the GPU machine, from the repository root: bash <bundle>/run.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-$(pwd)/gpu-log}
mkdir -p "$out"
export LD_LIBRARY_PATH=$here/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fake=$(cat "$here/fake_libcuda_path")
mkdir -p "$(dirname "$fake")" && cp "$here/bin/libfake_libcuda.so" "$fake"
b=$here/bin
{
  echo "== host"; uname -r; nproc; nvidia-smi -L
  nvidia-smi --query-gpu=driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv,noheader
  echo "== stellar_cuda_tests"; timeout 120 "$b/stellar_cuda_tests"; echo "rc=$?"
  echo "== stellar_gpu_tests"; timeout 120 "$b/stellar_gpu_tests" --gtest_filter='CudaDriver.*:RealGpu.*:SoftProviderGpu.*'; echo "rc=$?"
  for size in $((1 << 20)) $((16 << 20)) $((64 << 20)) $((256 << 20)); do
    echo "== soft_gpu_rdma $size"; timeout 120 "$b/soft_gpu_rdma" "$size" 20; echo "rc=$?"
  done
  for t in read write; do
    for mode in stellar roce; do
      echo "== stellar_${t}_bw 64 MiB $mode"
      "$b/stellar_${t}_bw" -s 67108864 -n 20 -t 2 -p 18700 --mode "$mode" > /tmp/stellar-bw-server.txt 2>&1 &
      server=$!
      sleep 0.5
      timeout 60 "$b/stellar_${t}_bw" -s 67108864 -n 20 -t 2 -p 18700 --mode "$mode" 127.0.0.1 2>&1 | tail -3
      echo "rc=${PIPESTATUS[0]}"
      kill "$server" 2>/dev/null; wait "$server" 2>/dev/null
    done
  done
  echo "== stellar doctor"; timeout 60 "$b/stellar" doctor; echo "rc=$?"
} 2>&1 | tee "$out/log"
EOF
chmod +x "$bundle/run.sh"
du -sh "$bundle"
echo "gpu-bundle: $bundle is ready; on the GPU machine run: bash $bundle/run.sh"
