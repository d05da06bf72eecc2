// Finishes every packet the QP sends, requests and responses alike: in
// stellar mode it piggy-backs this side's acknowledgement (the responder's
// cumulative ACK, SACK and ACK delay) and tells the responder an ACK went
// out, puts a response or ACK on its reply path and echoes the path of the
// latest packet received (ReplyPaths); then it encodes (gathering zero-copy
// pieces) and counts.
//
// May call: the Responder's acknowledgement interface (fill_acknowledgement,
// acknowledgement_sent) and the wire codecs. The requester reaches the
// responder only through here, and only for that.
#pragma once

#include "common.hpp"

namespace stellar::offload::detail {

class Responder;
class ReplyPaths;

class PacketWriter {
 public:
  PacketWriter(Context& ctx, Responder& responder, ReplyPaths& replies) : ctx_(ctx), responder_(responder), replies_(replies) {}

  // transmit() is building packets at `now` (the ACK delay is measured to it).
  void set_now(uint64_t now) { now_ = now; }
  // Encodes h (payload already in b: copied after the header, or as pieces)
  // into b; returns the datagram's length, 0 if it did not fit.
  uint32_t finish(Header& h, TxBuffer& b);

 private:
  Context& ctx_;
  Responder& responder_;
  ReplyPaths& replies_;
  uint64_t now_ = 0;
};

}  // namespace stellar::offload::detail
