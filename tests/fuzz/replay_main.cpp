// Without libFuzzer (gcc builds): replays every file of the corpus folder,
// then 20000 deterministic mutations of valid packets of both modes, so CI
// exercises the fuzz target on every run. A crash or abort fails the test.
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "stellar/offload/wire.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

using namespace stellar::offload;

int main(int argc, char** argv) {
  size_t files = 0;
  if (argc > 1) {
    if (DIR* d = opendir(argv[1])) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        std::ifstream in(std::string(argv[1]) + "/" + e->d_name, std::ios::binary);
        std::vector<uint8_t> bytes((std::istreambuf_iterator<char>(in)), {});
        LLVMFuzzerTestOneInput(bytes.data(), bytes.size());
        ++files;
      }
      closedir(d);
    }
  }
  std::mt19937 random(12345);
  size_t runs = 0;
  for (int i = 0; i < 20000; ++i) {
    const Mode mode = i & 1 ? Mode::roce : Mode::stellar;
    Header h;
    h.opcode = uint8_t(random() % (opcode::last_valid + 1));
    h.dest_qpn = random() % 4 ? 7 : random();
    h.psn = random() % 2 ? uint32_t(random() % 2048) : random();
    h.rkey = random() % 2 ? 0x1234 : random();
    h.remote_addr = random();
    h.dma_length = random() % 10000;
    h.syndrome = uint8_t(random());
    h.has_ack = random() % 2;
    h.ack_psn = 100 + random() % 20;
    h.sack_bitmap = random();
    const bool payload = opcode_is_send(h.opcode) || opcode_is_write(h.opcode) || opcode_is_read_response(h.opcode);
    h.payload_length = payload ? random() % 5000 : 0;
    h.message_length = h.payload_length + (random() % 3) * 4096;
    h.message_offset = uint32_t(random() % (h.message_length - h.payload_length + 1));
    std::vector<uint8_t> buf(1 + 10000);
    const size_t n = encode(mode, h, buf.data() + 1, buf.size() - 1, IcrcAddresses{});
    buf[0] = mode == Mode::roce ? 1 : 0;
    size_t length = n + 1;
    // Mutate a few bytes or cut the datagram in a third of the cases.
    if (random() % 3 == 0) buf[1 + random() % n] ^= uint8_t(1 + random() % 255);
    if (random() % 3 == 0) length = 1 + random() % n;
    LLVMFuzzerTestOneInput(buf.data(), length);
    ++runs;
  }
  std::printf("fuzz replay: %zu corpus files, %zu generated inputs, no crash\n", files, runs);
  return 0;
}
