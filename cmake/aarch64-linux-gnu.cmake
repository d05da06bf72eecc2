# Cross-build for aarch64 Linux: the SmartNIC / DPU cores (BlueField's are
# Arm). Debian's crossbuild-essential-arm64 provides the compilers, and
# multiarch packages (zlib1g-dev:arm64, libgtest-dev:arm64) the libraries.
# Programs built here run on x86-64 under qemu-user (CMAKE_CROSSCOMPILING_EMULATOR),
# which is how ctest and gtest_discover_tests run the engine's unit tests.
#   cmake -B build-aarch64 -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DSTELLAR_OFFLOAD_ONLY=ON
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
# Multiarch: aarch64 libraries live in /usr/lib/aarch64-linux-gnu beside the
# host's; with the architecture set, find_* look there and not in the host's.
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64 -L /usr/aarch64-linux-gnu)
