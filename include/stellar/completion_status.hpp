// The status of a work completion, defined once for the whole project: the
// public API's WorkCompletion::status (verbs.hpp) and the offload engine's
// Completion::status (offload/include/stellar/offload/engine.hpp, which names
// it offload::CompletionStatus) are this one enum, so the soft provider
// passes engine statuses through unchanged.
//
// Mirrors ibv_wc_status's meanings; the verbs provider maps the NIC's codes
// onto it (several fold into one) and keeps the exact code in
// WorkCompletion::provider_status. Header-only (the engine library links
// nothing of libstellar); no state, safe from any thread.
#pragma once

namespace stellar {

enum class WcStatus {
  success,
  local_length_error,        // a receive too small for the message, or a length over the limits
  local_qp_operation_error,  // the local QP could not carry out the request (e.g. GPU staging failed)
  local_protection_error,    // a local key, bound or access right failed (e.g. deregistered memory)
  work_request_flushed,      // the QP went to ERROR before this request ran
  bad_response,              // the responder's answer made no sense
  remote_invalid_request,    // the responder refused the request as malformed
  remote_access_error,       // the responder refused the rkey, bounds or rights
  remote_operation_error,    // the responder failed to carry out a valid request
  retry_exceeded,            // no acknowledgement within the retry count: the peer is gone or the path dead
  rnr_retry_exceeded,        // the peer had no receive posted within its RNR retries
};

// Human-readable, as ibv_wc_status_str words it.
constexpr const char* to_string(WcStatus s) noexcept {
  switch (s) {
    case WcStatus::success: return "success";
    case WcStatus::local_length_error: return "local length error";
    case WcStatus::local_qp_operation_error: return "local QP operation error";
    case WcStatus::local_protection_error: return "local protection error";
    case WcStatus::work_request_flushed: return "work request flushed";
    case WcStatus::bad_response: return "bad response";
    case WcStatus::remote_invalid_request: return "remote invalid request";
    case WcStatus::remote_access_error: return "remote access error";
    case WcStatus::remote_operation_error: return "remote operation error";
    case WcStatus::retry_exceeded: return "transport retry counter exceeded";
    case WcStatus::rnr_retry_exceeded: return "RNR retry counter exceeded";
  }
  return "?";
}

}  // namespace stellar
