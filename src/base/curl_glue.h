/*
 * curl_glue — the one libcurl setup of the program: curl_global_init once per process
 * (thread-safe, on first use) and an easy handle with the options every caller wants
 * (no signals, http/https only, the two timeouts).  The etcd client, the bootstrap
 * client and `disagg demo` take their handles here.
 */
#ifndef DISAGG_BASE_CURL_GLUE_H
#define DISAGG_BASE_CURL_GLUE_H

#include <curl/curl.h>

/* curl_global_init(CURL_GLOBAL_DEFAULT), once; every other call returns at once.  The
 * process never calls curl_global_cleanup (libcurl's advice for libraries: the OS frees). */
void curl_glue_init(void);

/* curl_glue_init(), then a fresh easy handle on url with CURLOPT_NOSIGNAL, http and https
 * only, the connect timeout and the whole-transfer timeout (ms; 0 = libcurl's default /
 * none).  NULL when libcurl is out of memory. */
CURL *curl_glue_easy(const char *url, long connect_timeout_ms, long timeout_ms);

/* curl_glue_easy, but from the handles given back (curl_easy_reset, then the same
 * options) when there is one: its idle kept-alive connections come with it, so a request
 * to a server asked before skips the TCP handshake.  Give it back with curl_glue_give
 * (not curl_easy_cleanup) after the transfer; one thread uses a handle at a time. */
CURL *curl_glue_take(const char *url, long connect_timeout_ms, long timeout_ms);
/* A handle from curl_glue_take or curl_glue_easy, kept for the next curl_glue_take (a few
 * are kept; past them it is cleaned up).  NULL is ignored. */
void curl_glue_give(CURL *h);
/* Clean up every kept handle and so close their idle connections (a test counting its
 * file descriptors; nothing else needs it: the kept ones are few and bounded). */
void curl_glue_drop_kept(void);

#endif
