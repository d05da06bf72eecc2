// The requester's sent window: one Slot per PSN in [una, max_sent), and the
// packets counted in flight. The Requester owns it and is the only one to
// send (record), retire (advance una) and mark packets done; LossRecovery
// reads it and takes packets it declares lost out of flight. Nothing else
// sees it: the responder has its own PSN space.
#pragma once

#include <vector>

#include "common.hpp"
#include "paths.hpp"

namespace stellar::offload::detail {

struct SentWindow {
  PsnSpace psn;
  uint32_t mask = 0;              // window - 1
  std::vector<Slot> slots;        // indexed by PSN & mask, valid in [una, max_sent)
  uint32_t una = 0;               // oldest PSN not done
  uint32_t max_sent = 0;          // one past the highest PSN ever transmitted
  uint32_t inflight_packets = 0;  // slots with slot_in_flight
  PathSet& paths;                 // counts each path's packets in flight

  SentWindow(const Context& ctx, PathSet& p) : psn(ctx.psn), mask(ctx.window_mask), slots(ctx.config.window_packets), paths(p) {
    una = max_sent = ctx.config.send_psn & psn.mask;
  }

  Slot& slot(uint32_t p) { return slots[p & mask]; }
  const Slot& slot(uint32_t p) const { return slots[p & mask]; }
  bool outstanding(uint32_t p) const { return psn.diff(p, una) >= 0 && psn.diff(p, max_sent) < 0; }
  bool idle() const { return una == max_sent; }  // nothing sent is outstanding

  // The packet no longer counts as in flight (lost, done or to be sent again).
  void leave_flight(Slot& s) {
    if (s.flags & slot_in_flight) {
      s.flags &= uint8_t(~slot_in_flight);
      --inflight_packets;
      paths.on_left_flight(s.path);
    }
  }
};

}  // namespace stellar::offload::detail
