/* api_error — see api_error.h. */
#include "proxy/api_error.h"

#include "base/http_msg.h"

#include <jansson.h>

char *api_error_json(int status, const char *message) {
    return api_error_json_param(status, NULL, message);
}

char *api_error_json_param(int status, const char *param, const char *message) {
    json_t *j = json_pack("{s:{s:s, s:s, s:o, s:i}}", "error", "message", message, "type",
                          http_error_type(status), "param",
                          param && param[0] ? json_string(param) : json_null(), "code", status);
    if (!j) return NULL;
    char *s = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    return s;
}
