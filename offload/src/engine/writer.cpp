// See writer.hpp.
#include "writer.hpp"

#include "paths.hpp"
#include "responder.hpp"

namespace stellar::offload::detail {

uint32_t PacketWriter::finish(Header& h, TxBuffer& b) {
  const EngineConfig& config = ctx_.config;
  if (config.mode == Mode::stellar) {
    responder_.fill_acknowledgement(h, now_);
    responder_.acknowledgement_sent();
    if (!opcode_is_request(h.opcode)) h.path = replies_.choose();  // requests carry the requester's choice
    h.echo_path = replies_.echo(h.ce_count);
    h.unchecked = config.loopback_unchecked && is_loopback(config.tx_addresses);
  }
  if (b.piece_count) {
    b.header_length = uint32_t(encode_scattered(config.mode, h, b.data, b.capacity, b.pieces, b.piece_count, b.trailer,
                                                b.trailer_length, config.tx_addresses));
    b.length = b.header_length ? b.header_length + h.payload_length + b.trailer_length : 0;
  } else {
    b.length = uint32_t(encode(config.mode, h, b.data, b.capacity, config.tx_addresses));
  }
  b.path = h.path;
  if (b.length) {
    ++ctx_.counters.tx_packets;
    ctx_.counters.tx_bytes += b.length;
  }
  return b.length;
}

}  // namespace stellar::offload::detail
