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

static void set_common(CURL *h, const char *url, long connect_timeout_ms, long timeout_ms) {
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    if (connect_timeout_ms > 0) curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, connect_timeout_ms);
    if (timeout_ms > 0) curl_easy_setopt(h, CURLOPT_TIMEOUT_MS, timeout_ms);
}

CURL *curl_glue_easy(const char *url, long connect_timeout_ms, long timeout_ms) {
    curl_glue_init();
    CURL *h = curl_easy_init();
    if (!h) return NULL;
    set_common(h, url, connect_timeout_ms, timeout_ms);
    return h;
}

/* Handles given back, newest last.  libcurl keeps a handle's idle connections in the
 * handle (its connection cache, up to CURLOPT_MAXCONNECTS), and curl_easy_reset keeps
 * them: a handle taken again reuses one to the same server.  A share object cannot do
 * this across threads (CURL_LOCK_DATA_CONNECT: "not supported to share connections
 * between multiple concurrent threads"), a pool of whole handles can. */
#define KEPT_MAX 16
static pthread_mutex_t g_kept_mu = PTHREAD_MUTEX_INITIALIZER;
static CURL *g_kept[KEPT_MAX];
static int g_n_kept;

CURL *curl_glue_take(const char *url, long connect_timeout_ms, long timeout_ms) {
    curl_glue_init();
    CURL *h = NULL;
    pthread_mutex_lock(&g_kept_mu);
    if (g_n_kept > 0) h = g_kept[--g_n_kept];
    pthread_mutex_unlock(&g_kept_mu);
    if (h)
        curl_easy_reset(h);
    else
        h = curl_easy_init();
    if (!h) return NULL;
    set_common(h, url, connect_timeout_ms, timeout_ms);
    return h;
}

void curl_glue_drop_kept(void) {
    pthread_mutex_lock(&g_kept_mu);
    while (g_n_kept > 0)
        curl_easy_cleanup(g_kept[--g_n_kept]);
    pthread_mutex_unlock(&g_kept_mu);
}

void curl_glue_give(CURL *h) {
    if (!h) return;
    pthread_mutex_lock(&g_kept_mu);
    if (g_n_kept < KEPT_MAX) {
        g_kept[g_n_kept++] = h;
        h = NULL;
    }
    pthread_mutex_unlock(&g_kept_mu);
    if (h) curl_easy_cleanup(h);
}
