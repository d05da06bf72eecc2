#include "host/fault_filter.hpp"

#include <algorithm>
#include <cstring>

namespace stellar::host {

FaultFilter::FaultFilter(const FaultOptions& options, int batch, uint32_t datagram_capacity)
    : options_(options), batch_(std::max(batch, 2)), out_(size_t(batch_) + 1), held_(datagram_capacity) {
  random_.seed(options_.seed ? options_.seed : std::random_device{}());
  active_ = options_.drop > 0 || options_.duplicate > 0 || options_.reorder > 0;
}

uint64_t FaultFilter::flush(UdpSocket& socket, int count) {
  int error = 0;
  const int sent = socket.send_batch(out_.data(), count, error);
  return sent < count ? uint64_t(count - sent) : 0;
}

uint64_t FaultFilter::send(UdpSocket& socket, const Datagram* datagrams, int count) {
  uint64_t errors = 0;
  if (!active_) {
    // Straight to the socket, in the same batches as with faults on.
    for (int done = 0; done < count;) {
      const int n = std::min(count - done, batch_ - 1);
      int error = 0;
      const int sent = socket.send_batch(const_cast<Datagram*>(datagrams + done), n, error);
      if (sent < n) errors += uint64_t(n - sent);
      done += n;
    }
    return errors;
  }
  int queued = 0;
  bool released_held = false;
  for (int i = 0; i < count; ++i) {
    const Datagram& d = datagrams[i];
    if (uniform() < options_.drop) {
      ++counters_.dropped;
      continue;
    }
    if (held_length_ == 0 && !released_held && uniform() < options_.reorder) {
      // A copy goes out after the next datagram.
      held_length_ = 0;
      if (d.length <= held_.size()) {
        if (d.part_count) {
          uint8_t* p = held_.data();
          for (uint32_t j = 0; j < d.part_count; ++j) {
            std::memcpy(p, d.parts[j].iov_base, d.parts[j].iov_len);
            p += d.parts[j].iov_len;
          }
        } else {
          std::memcpy(held_.data(), d.data, d.length);
        }
        held_length_ = d.length;
      }
      held_peer_ = d.peer;
      held_tos_ = d.tos;
      held_socket_ = &socket;
      ++counters_.reordered;
      continue;
    }
    out_[size_t(queued++)] = d;
    if (uniform() < options_.duplicate && queued < batch_) {
      out_[size_t(queued++)] = d;
      ++counters_.duplicated;
    }
    if (held_length_ && queued < batch_) {
      // held_ stays referenced by out_ until the batch is sent: hold nothing else in this call.
      out_[size_t(queued++)] = Datagram{held_.data(), uint32_t(held_.size()), held_length_, held_peer_, 0};
      out_[size_t(queued - 1)].tos = held_tos_;
      held_length_ = 0;
      released_held = true;
    }
    if (queued >= batch_ - 1) {
      errors += flush(socket, queued);
      queued = 0;
    }
  }
  if (queued) errors += flush(socket, queued);
  return errors;
}

uint64_t FaultFilter::release_held() {
  if (!held_length_) return 0;
  Datagram d{held_.data(), uint32_t(held_.size()), held_length_, held_peer_, 0};
  d.tos = held_tos_;
  int error = 0;
  held_length_ = 0;
  return held_socket_->send_batch(&d, 1, error) != 1 ? 1 : 0;
}

}  // namespace stellar::host
