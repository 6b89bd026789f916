/*
 * http_msg — incremental HTTP/1.1 message parsing shared by the server side
 * (http_server.c, client requests) and the client side (http_client.c,
 * upstream responses): the head (request or status line plus
 * headers, bounded in bytes and count) and the body framing (Content-Length,
 * chunked, or until the connection closes), read from a libevent evbuffer.
 * Nothing here owns a socket; values must agree with RFC 9112.
 */
#ifndef DISAGG_BASE_HTTP_MSG_H
#define DISAGG_BASE_HTTP_MSG_H

#include <stddef.h>
#include <stdint.h>

struct evbuffer;

typedef struct http_header {
    char *name;  /* as received (case kept); compare with strcasecmp */
    char *value; /* leading/trailing blanks stripped */
} http_header;

typedef struct http_head {
    int is_request;         /* 1: request line parsed; 0: status line */
    char method[16];        /* request: "GET", "POST", ... */
    char *target;           /* request: the request-target ("/v1/models?x") */
    int status;             /* response: 3-digit status code */
    int minor;              /* HTTP/1.<minor> */
    http_header *headers;   /* (nheaders) in arrival order */
    int nheaders;           /* number of headers */
    int64_t content_length; /* -1 when absent */
    int chunked;            /* Transfer-Encoding ends in "chunked" */
    int keep_alive;         /* connection may be reused after this message */
    char *raw;              /* (head bytes + 1) storage the pointers above live in */
} http_head;

typedef struct http_limits {
    size_t max_head_bytes; /* request/status line + headers, e.g. 64 KiB */
    int max_headers;       /* header lines, e.g. 100 */
} http_limits;

/* Error codes of http_head_parse (negative). */
#define HTTP_EHEAD_TOO_LARGE   (-1000) /* head over max_head_bytes (431) */
#define HTTP_ETOO_MANY_HEADERS (-1001) /* more than max_headers (431) */
#define HTTP_EBAD_MESSAGE      (-1002) /* malformed line, bad version, bad length (400) */

/* Parses one head from the front of `in`.  Returns 1 and fills *h (and
 * drains the head bytes) when complete, 0 when more bytes are needed, or a
 * negative HTTP_E* code.  is_request selects request vs status line.
 * Heads end with CRLF CRLF; a bare LF line end is accepted too. */
int http_head_parse(struct evbuffer *in, int is_request, const http_limits *lim, http_head *h);
void http_head_free(http_head *h);
/* Value of the first header named `name` (case-insensitive), or NULL. */
const char *http_head_get(const http_head *h, const char *name);
/* Count of headers named `name`. */
int http_head_count(const http_head *h, const char *name);

/* Body framing decoder. */
typedef enum http_body_mode {
    HTTP_BODY_NONE = 0,   /* no body (HEAD, 204, 304, Content-Length 0) */
    HTTP_BODY_LENGTH,     /* Content-Length bytes */
    HTTP_BODY_CHUNKED,    /* chunked transfer coding */
    HTTP_BODY_UNTIL_CLOSE /* response without length: until EOF */
} http_body_mode;

typedef struct http_body_reader {
    http_body_mode mode; /* framing */
    int64_t remaining;   /* LENGTH: bytes left; CHUNKED: bytes left in this chunk */
    int state;           /* CHUNKED: 0 size line, 1 data, 2 CRLF after data, 3 trailers */
    uint64_t total;      /* decoded bytes delivered so far */
} http_body_reader;

/* Prepares r for the body that follows head h (is_head_request: response to
 * a HEAD request has no body). */
void http_body_init(http_body_reader *r, const http_head *h, int is_head_request);
/* Moves decoded body bytes from `in` to `out`.  Returns 1 when the body is
 * complete, 0 when more input is needed, HTTP_EBAD_MESSAGE on bad chunk
 * framing.  UNTIL_CLOSE never completes here (the caller ends it at EOF). */
int http_body_read(http_body_reader *r, struct evbuffer *in, struct evbuffer *out);

/* Reason phrase of a status code ("OK", "Bad Gateway", ...). */
const char *http_reason(int status);
/* The OpenAI-style error type of an error status, as the server and the
 * proxy name it in their bodies: "BadRequestError" (400 and other 4xx),
 * "AuthenticationError" (401), "NotFoundError" (404), ..., "BadGatewayError"
 * (502), "InternalServerError" (500 and other 5xx). */
const char *http_error_type(int status);

#endif
