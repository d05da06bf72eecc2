#!/bin/bash
# Builds and runs the whole test suite twice: a normal build and an
# AddressSanitizer + UndefinedBehaviorSanitizer build. Needs root (packages).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
jobs=$(nproc)
for variant in release asan; do
  dir=build-test-$variant
  flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
  [[ $variant == asan ]] && flags=(-DCMAKE_BUILD_TYPE=Debug -DSTELLAR_SANITIZE=ON -DSTELLAR_BUILD_BENCH=OFF)
  echo "=== $variant build ==="
  cmake -S . -B "$dir" -G Ninja "${flags[@]}" > /dev/null
  ninja -C "$dir" -j"$jobs"
  echo "=== $variant tests ==="
  (cd "$dir" && ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 ctest --output-on-failure -j1 --timeout 600)
done
echo "=== libFuzzer: 60 s on the decoders and the engine's receive path ==="
mkdir -p build-fuzz
clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Ioffload/include \
  tests/fuzz/fuzz_receive.cpp offload/src/wire.cpp offload/src/engine.cpp offload/src/cc.cpp -lz -o build-fuzz/fuzz_receive
rm -rf build-fuzz/corpus && cp -r tests/fuzz/corpus build-fuzz/corpus  # new inputs stay out of the source tree
build-fuzz/fuzz_receive -max_total_time=60 -print_final_stats=1 build-fuzz/corpus 2>&1 | tail -4

echo "=== install check ==="
prefix=$(mktemp -d)
cmake --install build-test-release --prefix "$prefix" > /dev/null
test -f "$prefix/include/stellar/stellar.hpp" && test -f "$prefix/lib/pkgconfig/stellar.pc" && test -f "$prefix/lib/cmake/Stellar/StellarConfig.cmake"
consumer=$(mktemp -d)
cat > "$consumer/CMakeLists.txt" <<'CM'
cmake_minimum_required(VERSION 3.25)
project(consumer CXX)
set(CMAKE_CXX_STANDARD 20)
find_package(Stellar REQUIRED)
add_executable(consumer main.cpp)
target_link_libraries(consumer Stellar::stellar)
CM
cat > "$consumer/main.cpp" <<'CPP'
#include <stellar/stellar.hpp>
int main() { auto c = stellar::Context::open(); return c.ok() ? 0 : 1; }
CPP
cmake -S "$consumer" -B "$consumer/build" -DCMAKE_PREFIX_PATH="$prefix" > /dev/null
cmake --build "$consumer/build" > /dev/null
"$consumer/build/consumer"
rm -rf "$prefix" "$consumer"
echo "installed package builds and runs a consumer: ok"
