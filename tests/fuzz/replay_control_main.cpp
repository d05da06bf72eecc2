// Without libFuzzer (gcc builds): replays every file of the control-plane
// corpus folder, then 20000 deterministic mutations of them (bytes flipped,
// cut, repeated, type-confused values spliced in), so CI exercises the
// control-plane fuzz target on every run. A crash or abort fails the test.
#include <dirent.h>

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  std::vector<std::string> corpus;
  if (argc > 1) {
    if (DIR* d = opendir(argv[1])) {
      while (dirent* e = readdir(d)) {
        if (e->d_name[0] == '.') continue;
        std::ifstream in(std::string(argv[1]) + "/" + e->d_name, std::ios::binary);
        corpus.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      }
      closedir(d);
    }
  }
  if (corpus.empty()) {
    std::fprintf(stderr, "no corpus in %s\n", argc > 1 ? argv[1] : "(none given)");
    return 1;
  }
  for (const std::string& c : corpus) LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(c.data()), c.size());
  // Values a hostile peer would put where numbers, strings or lists belong.
  const char* splices[] = {"null", "5", "-5", "1e300", "70000", "1099511627783", "\"x\"", "[]", "{}", "true", "\"0.0.0.0\"", "18446744073709551616"};
  std::mt19937_64 random(12345);
  size_t runs = 0;
  for (int i = 0; i < 20000; ++i) {
    std::string s = corpus[random() % corpus.size()];
    const int edits = 1 + int(random() % 4);
    for (int e = 0; e < edits && s.size() > 1; ++e) {
      const size_t at = 1 + random() % (s.size() - 1);
      switch (random() % 4) {
        case 0: s[at] = char(random()); break;
        case 1: s.resize(at); break;
        case 2: s.insert(at, s.substr(at, random() % 64)); break;
        case 3: {
          // Replace the value after a ':' with a confusing one.
          const size_t colon = s.find(':', at);
          if (colon == std::string::npos) break;
          size_t end = colon + 1;
          while (end < s.size() && s[end] != ',' && s[end] != '}') ++end;
          s.replace(colon + 1, end - colon - 1, splices[random() % (sizeof splices / sizeof *splices)]);
          break;
        }
      }
    }
    LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
    ++runs;
  }
  std::printf("replayed %zu corpus files and %zu mutations\n", corpus.size(), runs);
  return 0;
}
