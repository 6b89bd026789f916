/*
 * http_client — HTTP/1.1 client requests on libevent bufferevents (the proxy's
 * to its upstreams: prefill and decode instances, bootstrap servers): a pool of
 * keep-alive connections per upstream address, the response head delivered
 * once, the body delivered as it arrives (de-chunked, bounded: reading stops
 * while the caller pauses), cancellation that closes the connection (so the
 * upstream sees the client go), and errors that say whether anything was
 * sent (a refused connection can be retried elsewhere safely).
 * Used instead of evhttp's client because evhttp 2.1 cannot tell "connection
 * refused" from "reset after the request was sent" (docs/proxy.md).
 */
#ifndef DISAGG_BASE_HTTP_CLIENT_H
#define DISAGG_BASE_HTTP_CLIENT_H

#include "base/http_msg.h"

#include <stddef.h>
#include <stdint.h>

struct event_base;
struct evbuffer;

typedef struct hc_pool hc_pool;
typedef struct hc_req hc_req;

/* Failure classes passed to on_done (0 = success). */
#define HC_ECONNECT                                                                                \
    (-2001) /* could not connect (refused, unreachable, connect timeout): nothing sent */
#define HC_ERESET   (-2002) /* connection closed/reset after the request was sent */
#define HC_ETIMEOUT (-2003) /* no response bytes within the idle timeout */
#define HC_EPROTO   (-2004) /* malformed response */
#define HC_ERESOLVE (-2005) /* host name did not resolve */
const char *hc_strerror(int err);

typedef struct hc_callbacks {
    /* The response head arrived. */
    void (*on_head)(hc_req *r, const http_head *head, void *arg);
    /* Body bytes arrived; the callee takes (drains) what it wants from data. */
    void (*on_data)(hc_req *r, struct evbuffer *data, void *arg);
    /* The exchange is over: err 0 (whole response received) or HC_E*.  r is
     * freed right after this returns. */
    void (*on_done)(hc_req *r, int err, void *arg);
} hc_callbacks;

typedef struct hc_timeouts {
    double connect_s; /* TCP connect */
    double idle_s;    /* longest silence while waiting for response bytes */
} hc_timeouts;

/* A pool for host:port (name resolved once, at creation). */
hc_pool *hc_pool_new(struct event_base *base, const char *host, uint16_t port, int max_idle);
void hc_pool_free(hc_pool *p); /* cancels nothing: free requests first */
/* Idle pooled connections are closed after this many seconds (0: kept until
 * the upstream closes them).  Keep it below the upstream's own keep-alive
 * timeout so that a request never races the upstream's close. */
void hc_pool_set_keepalive(hc_pool *p, double idle_s);
int hc_pool_idle(const hc_pool *p);

/* Starts a request.  headers: "Name: value\r\n" lines (Host and
 * Content-Length are added).  Returns NULL only on allocation failure; every
 * other failure is reported through on_done (never from inside this call). */
hc_req *hc_request(hc_pool *p, const char *method, const char *target, const char *headers,
                   const void *body, size_t body_len, const hc_timeouts *t, const hc_callbacks *cb,
                   void *arg);
/* Closes the request's connection; no callback runs afterwards. */
void hc_cancel(hc_req *r);
/* Stops (1) or resumes (0) reading the response (backpressure). */
void hc_pause(hc_req *r, int paused);
/* 1 once any response byte was received. */
int hc_got_response(const hc_req *r);

#endif
