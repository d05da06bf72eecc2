#include "coll/shared_memory.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <new>

namespace stellar::coll::detail {

namespace {

constexpr uint64_t segment_magic = 0x324d48535254534cull;  // "LSTRSHM2" (2: adverts, owner pid and probe address)
constexpr const char* name_prefix = "/stellar-coll-";

struct SegmentHeader {
  uint64_t magic;
  uint64_t token;
  uint32_t world;
  uint32_t slots;
  uint64_t chunk_bytes;
  uint64_t total_bytes;
  // For the single-copy probe: the owner's process id and where `token`
  // is in the owner's address space (its own mapping of this header).
  int32_t owner_pid;
  uint64_t probe_address;
  alignas(64) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> sleeping;  // owner threads asleep on the doorbell
};
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<uint64_t>::is_always_lock_free,
              "the shared words must be lock-free to work across processes");

constexpr size_t round_up(size_t v, size_t to) { return (v + to - 1) / to * to; }
constexpr size_t blocks_offset = round_up(sizeof(SegmentHeader), 64);
constexpr size_t meta_offset = 2 * 64 + sizeof(RingAdvertLines);
static_assert(sizeof(RingAdvertLines) % 64 == 0, "the advert lines end on a cache line");
size_t block_bytes(uint32_t slots) { return meta_offset + round_up(8 * size_t(slots), 64); }
size_t header_bytes(const SegmentShape& s) { return round_up(blocks_offset + size_t(s.world) * block_bytes(s.slots), 4096); }

Status os_error(const std::string& what) { return Status(Errc::io_error, what + ": " + std::strerror(errno)); }

uint64_t random64() {
  uint64_t v = 0;
  if (::getrandom(&v, sizeof v, 0) != ssize_t(sizeof v)) {
    // No entropy source: the name only has to be unique on this host.
    v = uint64_t(::getpid()) << 32 ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  }
  return v;
}

// A write lock on the segment's first byte, owned by the open file
// description: the kernel drops it when the owner's last descriptor closes,
// that is when the process exits, however it exits.
flock first_byte(short type) {
  flock l{};
  l.l_type = type;
  l.l_whence = SEEK_SET;
  l.l_start = 0;
  l.l_len = 1;
  l.l_pid = 0;
  return l;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

SegmentHeader& header_of(uint8_t* base) { return *reinterpret_cast<SegmentHeader*>(base); }

// Whether this process may write into process `pid`'s memory: the token
// read at `address` there must be the one the hello named (so `pid` is the
// segment's owner, not whoever has that number in this PID namespace), and
// writing the same value back must succeed (a seccomp profile may allow
// one direction only). Nothing is written to a process that fails the read.
bool probe_direct_write(int pid, uint64_t address, uint64_t token) {
  if (pid <= 0) return false;
  uint64_t seen = 0;
  iovec local{&seen, sizeof seen};
  iovec remote{reinterpret_cast<void*>(address), sizeof seen};
  if (::process_vm_readv(pid, &local, 1, &remote, 1, 0) != ssize_t(sizeof seen) || seen != token) return false;
  local.iov_base = &token;
  return ::process_vm_writev(pid, &local, 1, &remote, 1, 0) == ssize_t(sizeof token);
}

// Segments whose owner died before it removed the name (killed during the
// rendezvous, where the name must exist): this user's, with the liveness
// lock free, and untouched for a minute (a segment being created has no
// lock yet for a moment). Without this each killed job would leave its
// reserved pages in /dev/shm until reboot.
void remove_stale_segments() {
  DIR* dir = ::opendir("/dev/shm");
  if (!dir) return;
  const time_t now = ::time(nullptr);
  while (const dirent* entry = ::readdir(dir)) {
    const std::string name = std::string("/") + entry->d_name;
    if (!valid_segment_name(name)) continue;
    const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
    if (fd < 0) continue;
    struct stat st {};
    flock probe = first_byte(F_WRLCK);
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && st.st_uid == ::geteuid() && now - st.st_mtime > 60 &&
        ::fcntl(fd, F_OFD_GETLK, &probe) == 0 && probe.l_type == F_UNLCK)
      ::shm_unlink(name.c_str());
    ::close(fd);
  }
  ::closedir(dir);
}

}  // namespace

bool valid_segment_name(const std::string& name) {
  const size_t prefix = std::strlen(name_prefix);
  if (name.size() <= prefix || name.size() > 96 || name.compare(0, prefix, name_prefix) != 0) return false;
  for (size_t i = prefix; i < name.size(); ++i) {
    const char c = name[i];
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || c == '-')) return false;
  }
  return true;
}

Result<std::unique_ptr<SharedSegment>> SharedSegment::create(const SegmentShape& shape, const std::string& tag) {
  if (shape.world < 2 || shape.slots == 0 || shape.chunk_bytes == 0) return Status(Errc::invalid_argument, "shared memory: empty segment shape");
  remove_stale_segments();
  std::unique_ptr<SharedSegment> s(new SharedSegment());
  s->shape_ = shape;
  s->owner_ = true;
  s->token_ = random64();
  std::string clean;
  for (char c : tag)
    if (clean.size() < 32 && ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z'))) clean.push_back(c);
  char suffix[17];
  std::snprintf(suffix, sizeof suffix, "%016llx", (unsigned long long)random64());
  s->name_ = std::string(name_prefix) + (clean.empty() ? "" : clean + "-") + suffix;
  s->fd_ = ::shm_open(s->name_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (s->fd_ < 0) return os_error("shared memory: shm_open " + s->name_);
  s->linked_ = true;
  s->header_bytes_ = header_bytes(shape);
  s->block_bytes_ = block_bytes(shape.slots);
  s->mapped_bytes_ = s->header_bytes_ + shape.landing_bytes();
  // Reserve the pages now: a /dev/shm too small for them (a container's
  // 64 MB default) fails here, with a message, instead of SIGBUS later.
  if (const int e = ::posix_fallocate(s->fd_, 0, off_t(s->mapped_bytes_)); e != 0) {
    errno = e;
    return os_error("shared memory: cannot reserve " + std::to_string(s->mapped_bytes_) + " bytes in /dev/shm");
  }
  void* base = ::mmap(nullptr, s->mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd_, 0);
  if (base == MAP_FAILED) return os_error("shared memory: mmap");
  s->base_ = static_cast<uint8_t*>(base);
  flock lock = first_byte(F_WRLCK);
  if (::fcntl(s->fd_, F_OFD_SETLK, &lock) != 0) return os_error("shared memory: liveness lock");
  // The file is zeroed: every counter starts at 0. The header says what it is.
  SegmentHeader& h = *new (s->base_) SegmentHeader{};
  h.token = s->token_;
  h.world = shape.world;
  h.slots = shape.slots;
  h.chunk_bytes = shape.chunk_bytes;
  h.total_bytes = s->mapped_bytes_;
  h.owner_pid = int32_t(::getpid());
  h.probe_address = reinterpret_cast<uint64_t>(&h.token);
  s->owner_pid_ = h.owner_pid;
  std::atomic_thread_fence(std::memory_order_release);
  h.magic = segment_magic;
  return s;
}

Result<std::unique_ptr<SharedSegment>> SharedSegment::open(const std::string& name, uint64_t token, const SegmentShape& shape, bool probe_direct) {
  if (!valid_segment_name(name)) return Status(Errc::invalid_argument, "shared memory: not a segment name");
  std::unique_ptr<SharedSegment> s(new SharedSegment());
  s->shape_ = shape;
  s->name_ = name;
  s->token_ = token;
  s->header_bytes_ = header_bytes(shape);
  s->block_bytes_ = block_bytes(shape.slots);
  s->mapped_bytes_ = s->header_bytes_ + shape.landing_bytes();
  s->fd_ = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW, 0);
  if (s->fd_ < 0) return os_error("shared memory: shm_open " + name);
  struct stat st {};
  if (::fstat(s->fd_, &st) != 0) return os_error("shared memory: fstat");
  if (!S_ISREG(st.st_mode) || uint64_t(st.st_size) != s->mapped_bytes_ || st.st_uid != ::geteuid())
    return Status(Errc::invalid_argument, "shared memory: " + name + " is not a segment of this job (size or owner differ)");
  void* base = ::mmap(nullptr, s->mapped_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, s->fd_, 0);
  if (base == MAP_FAILED) return os_error("shared memory: mmap");
  s->base_ = static_cast<uint8_t*>(base);
  const SegmentHeader& h = header_of(s->base_);
  if (h.magic != segment_magic || h.token != token || h.world != shape.world || h.slots != shape.slots || h.chunk_bytes != shape.chunk_bytes ||
      h.total_bytes != s->mapped_bytes_)
    return Status(Errc::invalid_argument, "shared memory: " + name + "'s header does not match the peer's hello");
  s->owner_pid_ = h.owner_pid;
  s->direct_writable_ = probe_direct && probe_direct_write(h.owner_pid, h.probe_address, token);
  return s;
}

SharedSegment::~SharedSegment() {
  if (base_) ::munmap(base_, mapped_bytes_);
  if (owner_) unlink();
  if (fd_ >= 0) ::close(fd_);  // drops the liveness lock
}

void SharedSegment::unlink() {
  if (owner_ && linked_) ::shm_unlink(name_.c_str());
  linked_ = false;
}

uint8_t* SharedSegment::block(int sender) const { return base_ + blocks_offset + size_t(sender) * block_bytes_; }
RingSenderLine& SharedSegment::sender_line(int sender) const { return *reinterpret_cast<RingSenderLine*>(block(sender)); }
RingReceiverLine& SharedSegment::receiver_line(int sender) const { return *reinterpret_cast<RingReceiverLine*>(block(sender) + 64); }
RingAdvertLines& SharedSegment::advert_lines(int sender) const { return *reinterpret_cast<RingAdvertLines*>(block(sender) + 128); }
std::atomic<uint64_t>& SharedSegment::meta(int sender, uint64_t message) const {
  return reinterpret_cast<std::atomic<uint64_t>*>(block(sender) + meta_offset)[message % shape_.slots];
}

uint32_t SharedSegment::doorbell() const { return header_of(base_).doorbell.load(std::memory_order_seq_cst); }

void SharedSegment::ring_doorbell() const {
  SegmentHeader& h = header_of(base_);
  h.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (h.sleeping.load(std::memory_order_seq_cst) != 0) futex(&h.doorbell, FUTEX_WAKE, INT_MAX, nullptr);
}

void SharedSegment::sleep_on_doorbell(uint32_t seen, std::chrono::microseconds timeout) const {
  SegmentHeader& h = header_of(base_);
  h.sleeping.fetch_add(1, std::memory_order_seq_cst);
  // A ring after `seen` was read changed the word: the kernel returns at once.
  const timespec ts{time_t(timeout.count() / 1'000'000), long(timeout.count() % 1'000'000) * 1000};
  futex(&h.doorbell, FUTEX_WAIT, seen, &ts);
  h.sleeping.fetch_sub(1, std::memory_order_seq_cst);
}

bool SharedSegment::owner_alive() const {
  flock probe = first_byte(F_WRLCK);
  if (::fcntl(fd_, F_OFD_GETLK, &probe) != 0) return true;  // cannot tell: the timeout decides
  return probe.l_type != F_UNLCK;
}

Status SharedSegment::write_into_owner(uint64_t address, const void* source, size_t bytes) const {
  if (!direct_writable_) return Status(Errc::wrong_state, "shared memory: this process may not write into the owner's memory");
  // One call moves it all unless a page of the range is not the owner's
  // (or the owner is gone); a short count is that case too.
  iovec local{const_cast<void*>(source), bytes};
  iovec remote{reinterpret_cast<void*>(address), bytes};
  const ssize_t n = ::process_vm_writev(owner_pid_, &local, 1, &remote, 1, 0);
  if (n == ssize_t(bytes)) return {};
  if (n >= 0 || errno == EFAULT)
    return Status(Errc::invalid_argument, "shared memory: the " + std::to_string(bytes) + " bytes the peer advertised for its output are not its writable memory");
  // Allowed at bootstrap, refused now (a seccomp filter or a ptrace policy
  // applied since): the caller can still use the slots.
  if (errno == EPERM || errno == EACCES || errno == ENOSYS)
    return Status(Errc::permission_denied, "shared memory: process_vm_writev into rank's process " + std::to_string(owner_pid_) + " refused: " + std::strerror(errno));
  return os_error("shared memory: process_vm_writev into rank's process " + std::to_string(owner_pid_));
}

}  // namespace stellar::coll::detail
