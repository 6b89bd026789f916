/* transfer_error — names of the transfer engine's error codes (transfer.h). */
#include "disagg/transfer.h"

const char *transfer_strerror(int err) {
    switch (err) {
    case TRANSFER_OK:
        return "success";
    case TRANSFER_EINVAL:
        return "invalid argument";
    case TRANSFER_ENOMEM:
        return "out of memory";
    case TRANSFER_EOVERLAP:
        return "registration overlaps an existing registration";
    case TRANSFER_ENOTREG:
        return "local memory range is not registered";
    case TRANSFER_EREMOTEADDR:
        return "target rejected the remote address range (not inside a registered buffer)";
    case TRANSFER_ETIMEDOUT:
        return "deadline exceeded";
    case TRANSFER_ECONN:
        return "peer unreachable or connection lost";
    case TRANSFER_EPROTO:
        return "protocol error (malformed or unexpected frame)";
    case TRANSFER_ESTALE:
        return "stale or unknown handle";
    case TRANSFER_EBUSY:
        return "requests still in flight";
    case TRANSFER_ECANCELED:
        return "cancelled";
    case TRANSFER_ENOSEG:
        return "segment cannot be opened";
    case TRANSFER_EVERSION:
        return "incompatible protocol version";
    case TRANSFER_ESYS:
        return "system error";
    case TRANSFER_ENOSPACE:
        return "batch capacity exceeded";
    case TRANSFER_EPERM:
        return "operation not permitted";
    case TRANSFER_EAUTH:
        return "peer authentication failed (shared secret missing or different)";
    default:
        return "unknown transfer error";
    }
}
