#!/bin/bash
# Installs every Debian 12 package Stellar needs to build, test and run its
# demo and benchmarks. Idempotent; needs root.
set -euo pipefail
packages=(
  build-essential cmake ninja-build pkg-config
  zlib1g-dev libibverbs-dev librdmacm-dev ibverbs-providers
  libasio-dev nlohmann-json3-dev libcli11-dev libspdlog-dev libfmt-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  sockperf ucx-utils libgloo-dev openmpi-bin libopenmpi-dev python3
  iproute2 nftables ethtool iperf3 gnuplot-nox
  clang libclang-rt-14-dev
  # The torch.distributed backend (plugins/torch): Debian's torch 1.13 for
  # its python3, the C++ headers and libraries, pybind11.
  python3-torch libtorch-dev pybind11-dev python3-dev
  # aarch64 (SmartNIC / DPU cores): cross compilers, the engine's libraries
  # for arm64 (multiarch), and qemu-user to run its unit tests here.
  crossbuild-essential-arm64 qemu-user zlib1g-dev:arm64 libgtest-dev:arm64
)
dpkg --print-foreign-architectures | grep -qx arm64 || dpkg --add-architecture arm64
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
