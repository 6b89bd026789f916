/* api_error — see api_error.h. */
#include "proxy/api_error.h"

#include <jansson.h>

const char *api_error_type(int status) {
    switch (status) {
    case 400:
        return "BadRequestError";
    case 401:
        return "AuthenticationError";
    case 404:
        return "NotFoundError";
    case 405:
        return "MethodNotAllowedError";
    case 408:
        return "RequestTimeoutError";
    case 413:
        return "RequestEntityTooLargeError";
    case 431:
        return "RequestHeaderFieldsTooLargeError";
    case 502:
        return "BadGatewayError";
    case 503:
        return "ServiceUnavailableError";
    case 504:
        return "GatewayTimeoutError";
    default:
        return status >= 500 ? "InternalServerError" : "BadRequestError";
    }
}

char *api_error_json(int status, const char *message) {
    json_t *j = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", message, "type",
                          api_error_type(status), "param", "code", status);
    if (!j) return NULL;
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}
