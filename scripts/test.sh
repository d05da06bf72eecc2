#!/bin/bash
# Builds and runs the whole test suite twice: a normal build and an
# AddressSanitizer + UndefinedBehaviorSanitizer build. Needs root (packages).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
for variant in release asan; do
  dir=build-test-$variant
  # The torch backend is required, not optional, in the release build: a
  # missing libtorch must fail here rather than skip its tests.
  flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTELLAR_TORCH=ON)
  [[ $variant == asan ]] && flags=(-DCMAKE_BUILD_TYPE=Debug -DSTELLAR_SANITIZE=ON -DSTELLAR_BUILD_BENCH=OFF)
  echo "=== $variant build ==="
  cmake -S . -B "$dir" -G Ninja "${flags[@]}" > /dev/null
  ninja -C "$dir" -j"$jobs"
  echo "=== $variant tests ==="
  (cd "$dir" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j1 --timeout 600)
done
echo "=== aarch64 (SmartNIC cores): offload/ cross-built, the engine's unit tests under qemu-user ==="
cmake -S . -B build-test-aarch64 -G Ninja -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSTELLAR_OFFLOAD_ONLY=ON > /dev/null
ninja -C build-test-aarch64 -j"$jobs"
(cd build-test-aarch64 && ctest --output-on-failure -j1 --timeout 600)
echo "=== aarch64 stellar-engined under qemu-user serving the x86-64 stellar_pingpong ==="
tests/integration/engined_aarch64_test.sh build-test-aarch64/stellar-engined build-test-release/examples/stellar_pingpong
echo "=== libFuzzer: 45 s on the packet decoders and the engine's receive path ==="
mkdir -p build-fuzz
# Every engine source (the glob keeps up with the engine's units).
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Ioffload/include -Iinclude \
  tests/fuzz/fuzz_receive.cpp offload/src/wire.cpp offload/src/engine.cpp offload/src/engine/*.cpp offload/src/cc.cpp -lz \
  -o build-fuzz/fuzz_receive
rm -rf build-fuzz/corpus && cp -r tests/fuzz/corpus build-fuzz/corpus  # new inputs stay out of the source tree
build-fuzz/fuzz_receive -max_total_time=45 -print_final_stats=1 build-fuzz/corpus 2>&1 | tail -4

echo "=== libFuzzer: 45 s on the control plane's message handlers (connection manager, rendezvous) ==="
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iinclude -Isrc -Ibuild-test-release/include \
  tests/fuzz/fuzz_control.cpp src/core/control_messages.cpp src/core/names.cpp src/coll/rendezvous.cpp src/coll/shared_memory.cpp -o build-fuzz/fuzz_control
rm -rf build-fuzz/corpus_control && cp -r tests/fuzz/corpus_control build-fuzz/corpus_control
build-fuzz/fuzz_control -max_total_time=45 -max_len=65536 -print_final_stats=1 build-fuzz/corpus_control 2>&1 | tail -4

echo "=== install check ==="
# Shared libraries with SONAMEs, the programs, and two consumers of libstellar
# and the collectives: one through pkg-config, one through find_package.
# Then the static option (library only) with the same two consumers.
check_dir=$(mktemp -d)
repo=$(pwd)
trap 'rm -rf "$check_dir"' EXIT
mkdir -p "$check_dir/consumer"
cat > "$check_dir/consumer/main.cpp" <<'CPP'
#include <stellar/coll.hpp>
#include <stellar/stellar.hpp>
#include <cstdio>
#include <cstdlib>
int main() {
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  auto options = stellar::coll::CommunicatorOptions::from_environment();  // libstellar_coll
  if (!options.ok() || options->world_size != 1) return 1;
  auto context = stellar::Context::open();  // libstellar
  if (!context.ok()) return 2;
  std::printf("consumer of stellar %s: ok\n", STELLAR_VERSION_STRING);
  return 0;
}
CPP
cat > "$check_dir/consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(Stellar 0.1 REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer Stellar::stellar_coll Stellar::stellar)
CM
# consumers <prefix> <name> [--static]: builds and runs both consumers of the
# package installed under <prefix>.
consumers() {
  local prefix=$1 name=$2 static=${3:-}
  test -f "$prefix/include/stellar/stellar.hpp" && test -f "$prefix/lib/pkgconfig/stellar.pc" &&
    test -f "$prefix/lib/pkgconfig/stellar_coll.pc" && test -f "$prefix/lib/cmake/Stellar/StellarConfig.cmake"
  # pkg-config: its flags, plus an explicit rpath to the prefix's lib (the
  # .pc files give none); a static link has no libstellar*.so to find.
  local flags
  flags=$(PKG_CONFIG_PATH="$prefix/lib/pkgconfig" pkg-config $static --cflags --libs stellar_coll stellar)
  echo "pkg-config $static --cflags --libs stellar_coll stellar: $flags"
  # shellcheck disable=SC2086
  g++ -O1 "$check_dir/consumer/main.cpp" -o "$check_dir/pc-$name" $flags -Wl,-rpath,"$prefix/lib"
  "$check_dir/pc-$name"
  # find_package: CMake's build RPATH points at the imported libraries.
  cmake -S "$check_dir/consumer" -B "$check_dir/cmake-$name" -G Ninja -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
  cmake --build "$check_dir/cmake-$name" > /dev/null
  "$check_dir/cmake-$name/consumer"
}
prefix="$check_dir/shared"
cmake --install build-test-release --prefix "$prefix" > /dev/null
readelf -d "$prefix/lib/libstellar.so.0" | grep -q 'Library soname: \[libstellar.so.0\]'
readelf -d "$prefix/lib/libstellar_coll.so.0" | grep -q 'Library soname: \[libstellar_coll.so.0\]'
test ! -e "$prefix/lib/libstellar_offload.a"  # linked into libstellar.so, not needed by its users
for program in stellar stellar_pingpong stellar_allreduce stellar_atomic_lat stellar_stream \
    stellar_{write,read,send}_{lat,bw}; do
  test -x "$prefix/bin/$program"
done
"$prefix/bin/stellar_pingpong" --help > /dev/null  # the installed RUNPATH finds libstellar.so.0
"$prefix/bin/stellar_allreduce" --help > /dev/null
"$prefix/bin/stellar_stream" --help > /dev/null
consumers "$prefix" shared
# The torch backend from the prefix's dist-packages: imported by Debian's
# python3, its RUNPATH finding the prefix's libstellar_coll, one rank reducing.
(cd "$check_dir" && PYTHONPATH="$prefix/lib/python3.11/dist-packages" /usr/bin/python3 -c '
import socket, stellar_torch, torch, torch.distributed as dist
assert stellar_torch.__file__.startswith("'"$prefix"'"), stellar_torch.__file__
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("stellar", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
t = torch.arange(4.0); dist.all_reduce(t); assert t.tolist() == [0.0, 1.0, 2.0, 3.0], t
dist.destroy_process_group()
print("import stellar_torch from the prefix, one-rank all_reduce: ok")')
# The NCCL net plugin from the prefix's lib, found as NCCL finds it
# (NCCL_NET_PLUGIN=stellar -> libnccl-net-stellar.so on the loader's path),
# exporting the ncclNetPlugin_vN tables and nothing else of its own.
exports=$(nm -D --defined-only "$prefix/lib/libnccl-net-stellar.so" | awk '{print $3}' | grep -v '^_' | sort | tr '\n' ' ')
test "$exports" = "ncclNetPlugin_v10 ncclNetPlugin_v11 ncclNetPlugin_v12 ncclNetPlugin_v8 ncclNetPlugin_v9 " || { echo "plugin exports: $exports"; exit 1; }
(cd "$check_dir" && env -u LD_LIBRARY_PATH LD_LIBRARY_PATH="$prefix/lib" NCCL_NET_PLUGIN=stellar STELLAR_NCCL_ADDRESS=127.0.0.1 \
  "$repo/build-test-release/plugins/nccl/stellar_nccl_harness" exchange | tail -1)
echo "shared install (SONAME libstellar.so.0, programs, pkg-config and find_package consumers, stellar_torch, the NCCL plugin): ok"
# The static option: the libraries alone (no tests, examples, bench or tools).
cmake -S . -B build-test-static -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DSTELLAR_SHARED=OFF \
  -DSTELLAR_BUILD_TESTS=OFF -DSTELLAR_BUILD_EXAMPLES=OFF -DSTELLAR_BUILD_BENCH=OFF -DSTELLAR_BUILD_TOOLS=OFF > /dev/null
ninja -C build-test-static -j"$jobs" > /dev/null
prefix="$check_dir/static"
cmake --install build-test-static --prefix "$prefix" > /dev/null
test -f "$prefix/lib/libstellar.a" && test -f "$prefix/lib/libstellar_offload.a" && test ! -e "$prefix/lib/libstellar.so"
consumers "$prefix" static --static
echo "static install (pkg-config --static and find_package consumers): ok"
