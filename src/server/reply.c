/*
 * reply — how the server's handlers answer (internal to src/server): JSON
 * bodies with the X-Request-Id header, OpenAI-style errors, plain bodies,
 * and the request body as a C string; on base/http_server (which adds the
 * reason phrase, Content-Length and the connection headers).  Also the
 * token namers of logprobs.  Used by http.c (router, info endpoints), gen.c
 * and the endpoints; it calls neither.
 */
#include "server/server_ctx.h"

#include "base/http_server.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void server_reply_text(hs_req *req, int status, const char *content_type, const char *body,
                       size_t len) {
    hs_reply(req, status, content_type, NULL, body ? body : "", body ? len : 0);
}

void server_reply_json(hs_req *req, int status, json_t *body, const char *req_id) {
    static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                              "\"InternalServerError\",\"param\":null,\"code\":500}}";
    char *s = body ? json_dumps(body, JSON_COMPACT) : NULL;
    json_decref(body);
    if (req_id) hs_req_add_header(req, "X-Request-Id", req_id);
    if (s)
        server_reply_text(req, status, "application/json", s, strlen(s));
    else
        server_reply_text(req, status, "application/json", oom, sizeof oom - 1);
    free(s);
}

void server_reply_json_text(hs_req *req, int status, char *text) {
    if (!text) {
        server_reply_json(req, status, NULL, NULL);
        return;
    }
    server_reply_text(req, status, "application/json", text, strlen(text));
    free(text);
}

void server_reply_error(hs_req *req, const oai_error *e, const char *req_id) {
    char *s = oai_error_json(e);
    json_t *body = s ? json_loads(s, 0, NULL) : NULL;
    free(s);
    server_reply_json(req, e->status, body, req_id);
}

void server_reply_errorf(hs_req *req, int status, const char *type, const char *param,
                         const char *fmt, ...) {
    oai_error e;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    oai_error_set(&e, status, type, param, "%s", msg);
    server_reply_error(req, &e, NULL);
}

char *server_read_body(hs_req *req, size_t *len) {
    size_t n = 0;
    const char *b = hs_req_body(req, &n);
    char *p = malloc(n + 1);
    if (!p) return NULL;
    memcpy(p, b, n);
    p[n] = 0;
    *len = n;
    return p;
}

int server_token_namer(void *ctx, int32_t id, sbuf *out) {
    char *text = NULL;
    size_t len = 0;
    if (id >= 0 && !tokenizer_token_bytes(ctx, id, &len)) { /* padded vocabulary tail: "" */
        sbuf_reset(out);
        return sbuf_append(out, "", 0);
    }
    int rc = tokenizer_decode(ctx, &id, 1, false, &text, &len, NULL, 0);
    if (rc) return rc;
    sbuf_reset(out);
    rc = sbuf_append(out, text, len);
    free(text);
    return rc;
}

int server_token_namer_ids(void *ctx, int32_t id, sbuf *out) {
    (void)ctx;
    sbuf_reset(out);
    return sbuf_appendf(out, "token_id:%d", id);
}
