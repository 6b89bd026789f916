/* http_msg — see http_msg.h. */
#include "base/http_msg.h"

#include <ctype.h>
#include <errno.h>
#include <event2/buffer.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Offset just past the blank line that ends the head in p[0..n), or 0. */
static size_t head_end(const char *p, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (p[i] != '\n') continue;
        if (p[i + 1] == '\n') return i + 2;
        if (p[i + 1] == '\r' && i + 2 < n && p[i + 2] == '\n') return i + 3;
    }
    return 0;
}

/* Splits the next line off *cur (NUL-terminates it, strips CR). */
static char *next_line(char **cur) {
    char *s = *cur, *nl = strchr(s, '\n');
    if (!nl) return NULL;
    *nl = 0;
    if (nl > s && nl[-1] == '\r') nl[-1] = 0;
    *cur = nl + 1;
    return s;
}

static int parse_version(const char *v, int *minor) {
    if (strncmp(v, "HTTP/1.", 7) || !isdigit((unsigned char)v[7]) || v[8]) return HTTP_EBAD_MESSAGE;
    *minor = v[7] - '0';
    return 0;
}

static int parse_start_line(char *line, int is_request, http_head *h) {
    h->is_request = is_request;
    if (is_request) {
        char *sp1 = strchr(line, ' ');
        char *sp2 = sp1 ? strchr(sp1 + 1, ' ') : NULL;
        if (!sp1 || !sp2 || (size_t)(sp1 - line) >= sizeof h->method || sp1 == line)
            return HTTP_EBAD_MESSAGE;
        memcpy(h->method, line, (size_t)(sp1 - line));
        h->method[sp1 - line] = 0;
        for (char *c = h->method; *c; c++)
            if (!isupper((unsigned char)*c)) return HTTP_EBAD_MESSAGE;
        *sp2 = 0;
        h->target = sp1 + 1;
        if (!*h->target) return HTTP_EBAD_MESSAGE;
        return parse_version(sp2 + 1, &h->minor);
    }
    char *sp1 = strchr(line, ' ');
    if (!sp1) return HTTP_EBAD_MESSAGE;
    *sp1 = 0;
    if (parse_version(line, &h->minor)) return HTTP_EBAD_MESSAGE;
    const char *code = sp1 + 1;
    if (!isdigit((unsigned char)code[0]) || !isdigit((unsigned char)code[1]) ||
        !isdigit((unsigned char)code[2]) || (code[3] && code[3] != ' '))
        return HTTP_EBAD_MESSAGE;
    h->status = (code[0] - '0') * 100 + (code[1] - '0') * 10 + (code[2] - '0');
    return 0;
}

static int has_token(const char *value, const char *token) {
    size_t n = strlen(token);
    for (const char *p = value; *p;) {
        while (*p == ' ' || *p == '\t' || *p == ',')
            p++;
        const char *e = p;
        while (*e && *e != ',')
            e++;
        const char *t = e;
        while (t > p && (t[-1] == ' ' || t[-1] == '\t'))
            t--;
        if ((size_t)(t - p) == n && !strncasecmp(p, token, n)) return 1;
        p = e;
    }
    return 0;
}

/* Fills content_length / chunked / keep_alive from the headers. */
static int derive_framing(http_head *h) {
    int te_present = 0;
    h->content_length = -1;
    h->keep_alive = h->minor >= 1;
    for (int i = 0; i < h->nheaders; i++) {
        const char *n = h->headers[i].name, *v = h->headers[i].value;
        if (!strcasecmp(n, "Content-Length")) {
            char *end;
            errno = 0;
            long long len = strtoll(v, &end, 10);
            if (!isdigit((unsigned char)*v) || *end || errno || len < 0) return HTTP_EBAD_MESSAGE;
            if (h->content_length >= 0 && h->content_length != len) return HTTP_EBAD_MESSAGE;
            h->content_length = len;
        } else if (!strcasecmp(n, "Transfer-Encoding")) {
            te_present = 1;
            const char *last = strrchr(v, ',');
            last = last ? last + 1 : v;
            while (*last == ' ')
                last++;
            h->chunked = !strncasecmp(last, "chunked", 7);
            if (!h->chunked && h->is_request) return HTTP_EBAD_MESSAGE; /* RFC 9112 6.3 */
        } else if (!strcasecmp(n, "Connection")) {
            if (has_token(v, "close"))
                h->keep_alive = 0;
            else if (has_token(v, "keep-alive"))
                h->keep_alive = 1;
        }
    }
    if (te_present) h->content_length = -1; /* Transfer-Encoding overrides */
    return 0;
}

int http_head_parse(struct evbuffer *in, int is_request, const http_limits *lim, http_head *h) {
    size_t avail = evbuffer_get_length(in);
    size_t scan = avail < lim->max_head_bytes + 4 ? avail : lim->max_head_bytes + 4;
    if (scan == 0) return 0;
    const char *p = (const char *)evbuffer_pullup(in, (ssize_t)scan);
    /* Leading empty lines before a request are ignored (RFC 9112 2.2). */
    size_t skip = 0;
    while (is_request && skip < scan && (p[skip] == '\r' || p[skip] == '\n'))
        skip++;
    if (skip) {
        evbuffer_drain(in, skip);
        return http_head_parse(in, is_request, lim, h);
    }
    size_t end = head_end(p, scan);
    /* A head may take max_head_bytes plus its final line end (end <= max + 2):
     * only when max + 2 bytes hold no end is it too large, however the bytes
     * were split into reads. */
    if (!end) return scan >= lim->max_head_bytes + 2 ? HTTP_EHEAD_TOO_LARGE : 0;
    if (end > lim->max_head_bytes + 2) return HTTP_EHEAD_TOO_LARGE;
    /* A NUL byte would end a line early here and hide the headers after it
     * (e.g. a Content-Length): reject it (RFC 9110 5.5). */
    if (memchr(p, 0, end)) return HTTP_EBAD_MESSAGE;

    memset(h, 0, sizeof *h);
    h->raw = malloc(end + 1);
    if (!h->raw) return -ENOMEM;
    memcpy(h->raw, p, end);
    h->raw[end] = 0;
    evbuffer_drain(in, end);

    char *cur = h->raw, *line = next_line(&cur);
    int rc = line ? parse_start_line(line, is_request, h) : HTTP_EBAD_MESSAGE;
    if (rc) goto fail;
    int cap = 16;
    h->headers = malloc(sizeof *h->headers * (size_t)cap);
    if (!h->headers) {
        rc = -ENOMEM;
        goto fail;
    }
    while ((line = next_line(&cur)) && *line) {
        if (*line == ' ' || *line == '\t') { /* obsolete line folding: reject (RFC 9112 5.2) */
            rc = HTTP_EBAD_MESSAGE;
            goto fail;
        }
        char *colon = strchr(line, ':');
        if (!colon || colon == line) {
            rc = HTTP_EBAD_MESSAGE;
            goto fail;
        }
        for (char *c = line; c < colon; c++)
            if (*c == ' ' || *c == '\t') {
                rc = HTTP_EBAD_MESSAGE;
                goto fail;
            }
        if (h->nheaders >= lim->max_headers) {
            rc = HTTP_ETOO_MANY_HEADERS;
            goto fail;
        }
        if (h->nheaders == cap) {
            cap *= 2;
            http_header *nh = realloc(h->headers, sizeof *nh * (size_t)cap);
            if (!nh) {
                rc = -ENOMEM;
                goto fail;
            }
            h->headers = nh;
        }
        *colon = 0;
        char *v = colon + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        char *ve = v + strlen(v);
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
            *--ve = 0;
        h->headers[h->nheaders].name = line;
        h->headers[h->nheaders].value = v;
        h->nheaders++;
    }
    rc = derive_framing(h);
    if (rc) goto fail;
    return 1;
fail:
    http_head_free(h);
    return rc;
}

void http_head_free(http_head *h) {
    free(h->headers);
    free(h->raw);
    memset(h, 0, sizeof *h);
}

const char *http_head_get(const http_head *h, const char *name) {
    for (int i = 0; i < h->nheaders; i++)
        if (!strcasecmp(h->headers[i].name, name)) return h->headers[i].value;
    return NULL;
}

int http_head_count(const http_head *h, const char *name) {
    int n = 0;
    for (int i = 0; i < h->nheaders; i++)
        n += !strcasecmp(h->headers[i].name, name);
    return n;
}

void http_body_init(http_body_reader *r, const http_head *h, int is_head_request) {
    memset(r, 0, sizeof *r);
    if (!h->is_request &&
        (is_head_request || h->status / 100 == 1 || h->status == 204 || h->status == 304)) {
        r->mode = HTTP_BODY_NONE;
    } else if (h->chunked) {
        r->mode = HTTP_BODY_CHUNKED;
    } else if (h->content_length > 0) {
        r->mode = HTTP_BODY_LENGTH;
        r->remaining = h->content_length;
    } else if (h->content_length == 0 || h->is_request) {
        r->mode = HTTP_BODY_NONE; /* a request without length has no body */
    } else {
        r->mode = HTTP_BODY_UNTIL_CLOSE;
    }
}

int http_body_read(http_body_reader *r, struct evbuffer *in, struct evbuffer *out) {
    switch (r->mode) {
    case HTTP_BODY_NONE:
        return 1;
    case HTTP_BODY_UNTIL_CLOSE: {
        size_t n = evbuffer_get_length(in);
        r->total += n;
        evbuffer_remove_buffer(in, out, n);
        return 0;
    }
    case HTTP_BODY_LENGTH: {
        size_t n = evbuffer_get_length(in);
        if ((int64_t)n > r->remaining) n = (size_t)r->remaining;
        evbuffer_remove_buffer(in, out, n);
        r->remaining -= (int64_t)n;
        r->total += n;
        return r->remaining == 0;
    }
    case HTTP_BODY_CHUNKED:
        for (;;) {
            if (r->state == 1) { /* chunk data */
                size_t n = evbuffer_get_length(in);
                if (n == 0) return 0;
                if ((int64_t)n > r->remaining) n = (size_t)r->remaining;
                evbuffer_remove_buffer(in, out, n);
                r->remaining -= (int64_t)n;
                r->total += n;
                if (r->remaining) return 0;
                r->state = 2;
                continue;
            }
            if (r->state == 2) { /* exactly CRLF after chunk data */
                unsigned char crlf[2];
                ssize_t got = evbuffer_copyout(in, crlf, 2);
                if (got >= 1 && crlf[0] != '\r') return HTTP_EBAD_MESSAGE;
                if (got < 2) return 0;
                if (crlf[1] != '\n') return HTTP_EBAD_MESSAGE;
                evbuffer_drain(in, 2);
                r->state = 0;
                continue;
            }
            size_t len;
            char *line = evbuffer_readln(in, &len, EVBUFFER_EOL_CRLF);
            if (!line) return evbuffer_get_length(in) > 4096 ? HTTP_EBAD_MESSAGE : 0;
            if (r->state == 0) { /* size line: hex [; ext] */
                char *end;
                errno = 0;
                long long sz = strtoll(line, &end, 16);
                int bad = !isxdigit((unsigned char)line[0]) || errno || sz < 0 ||
                          (*end && *end != ';' && *end != ' ' && *end != '\t');
                free(line);
                if (bad) return HTTP_EBAD_MESSAGE;
                r->remaining = sz;
                r->state = sz ? 1 : 3;
            } else { /* trailers until the empty line */
                free(line);
                if (len == 0) return 1;
            }
        }
    }
    return HTTP_EBAD_MESSAGE;
}

const char *http_reason(int status) {
    switch (status) {
    case 200:
        return "OK";
    case 201:
        return "Created";
    case 204:
        return "No Content";
    case 400:
        return "Bad Request";
    case 401:
        return "Unauthorized";
    case 403:
        return "Forbidden";
    case 404:
        return "Not Found";
    case 405:
        return "Method Not Allowed";
    case 408:
        return "Request Timeout";
    case 411:
        return "Length Required";
    case 413:
        return "Content Too Large";
    case 422:
        return "Unprocessable Content";
    case 429:
        return "Too Many Requests";
    case 431:
        return "Request Header Fields Too Large";
    case 500:
        return "Internal Server Error";
    case 501:
        return "Not Implemented";
    case 502:
        return "Bad Gateway";
    case 503:
        return "Service Unavailable";
    case 504:
        return "Gateway Timeout";
    case 505:
        return "HTTP Version Not Supported";
    default:
        return "Unknown";
    }
}

const char *http_error_type(int status) {
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
