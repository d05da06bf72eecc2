// mpi_allreduce: MPI_Allreduce (float, sum, in place) under mpirun, in
// stellar_allreduce's output format. Which Open MPI transport carries it is
// mpirun's choice: bench/allreduce_compare.sh runs it with
// `--mca btl self,tcp` (TCP) and `--mca btl self,vader` (shared memory).
#include <mpi.h>

#include <chrono>
#include <vector>

#include "peer_common.hpp"

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  peer::Sweep sweep = peer::parse_sweep(argc, argv);
  sweep.ranks = size;
  if (rank == 0) peer::print_header("mpi_allreduce (MPI_Allreduce)", size);
  for (size_t bytes = sweep.min_bytes; bytes <= sweep.max_bytes; bytes = size_t(double(bytes) * sweep.factor)) {
    const size_t count = bytes / sizeof(float);
    std::vector<float> data(count);
    for (size_t i = 0; i < count; ++i) data[i] = float((rank * 7 + i * 3) % 5 + 1);
    MPI_Allreduce(MPI_IN_PLACE, data.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    long wrong = 0;
    for (size_t i = 0; i < count; ++i) {
      float want = 0;
      for (int r = 0; r < size; ++r) want += float((r * 7 + i * 3) % 5 + 1);
      wrong += data[i] != want;
    }
    for (int i = 0; i < sweep.warmup; ++i) MPI_Allreduce(MPI_IN_PLACE, data.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    MPI_Barrier(MPI_COMM_WORLD);
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < sweep.iterations; ++i) MPI_Allreduce(MPI_IN_PLACE, data.data(), int(count), MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() / sweep.iterations;
    double total = 0;
    long wrong_total = 0;
    MPI_Allreduce(&us, &total, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    MPI_Allreduce(&wrong, &wrong_total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) peer::print_row(count * sizeof(float), total / size, size, wrong_total);
    if (count == 0) break;
  }
  MPI_Finalize();
  return 0;
}
