/* curl_glue — see curl_glue.h. */
#include "base/curl_glue.h"

#include <pthread.h>

static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_once(void) {
    curl_global_init(CURL_GLOBAL_DEFAULT);
}

void curl_glue_init(void) {
    pthread_once(&g_once, init_once);
}

CURL *curl_glue_easy(const char *url, long connect_timeout_ms, long timeout_ms) {
    curl_glue_init();
    CURL *h = curl_easy_init();
    if (!h) return NULL;
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    if (connect_timeout_ms > 0) curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, connect_timeout_ms);
    if (timeout_ms > 0) curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
    return h;
}
