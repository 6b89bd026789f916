/* api_error — see api_error.h. */
#include "proxy/api_error.h"

#include "base/http_msg.h"

#include <jansson.h>

char *api_error_json(int status, const char *message) {
    json_t *j = json_pack("{s:{s:s, s:s, s:n, s:i}}", "error", "message", message, "type",
                          http_error_type(status), "param", "code", status);
    if (!j) return NULL;
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}
