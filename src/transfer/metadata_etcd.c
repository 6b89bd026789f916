/* metadata_etcd — see metadata_etcd.h. */
#include "transfer/metadata_etcd.h"

#include "base/etcd.h"
#include "base/log.h"

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#define MOD "transfer"

struct metadata_etcd {
    etcd_client *c;     /* its client */
    pthread_mutex_t mu; /* one request at a time */
    char ram_key[160];  /* mooncake/ram/<name> */
    char rpc_key[160];  /* mooncake/rpc_meta/<name> */
};

metadata_etcd *metadata_etcd_open(const char *url, const char *segment_name, const char *host,
                                  uint16_t rpc_port) {
    const char *eps = url;
    if (!strncasecmp(eps, "etcd://", 7)) eps += 7;
    char tmp[1024];
    snprintf(tmp, sizeof tmp, "%.*s", (int)strcspn(eps, "/"), eps);
    if (eps[strcspn(eps, "/")] && strcmp(eps + strcspn(eps, "/"), "/")) {
        LOG_E(MOD, "metadata server '%s': Mooncake's keys have no prefix; give etcd://HOST:PORT",
              url);
        return NULL;
    }
    metadata_etcd *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    etcd_options o = {.endpoints = tmp};
    char err[400];
    if (etcd_client_new(&o, &m->c, err, sizeof err)) {
        LOG_E(MOD, "metadata server '%s': %s; accepted: etcd://HOST:PORT[,HOST:PORT...]", url, err);
        free(m);
        return NULL;
    }
    pthread_mutex_init(&m->mu, NULL);
    snprintf(m->ram_key, sizeof m->ram_key, "mooncake/ram/%s", segment_name);
    snprintf(m->rpc_key, sizeof m->rpc_key, "mooncake/rpc_meta/%s", segment_name);
    json_t *j = json_pack("{s:s,s:i}", "ip_or_host_name", host, "rpc_port", (int)rpc_port);
    char *v = j ? json_dumps(j, JSON_COMPACT) : NULL;
    json_decref(j);
    int rc = v ? etcd_put(m->c, m->rpc_key, v, strlen(v), 0) : -ENOMEM;
    free(v);
    if (rc) {
        LOG_E(MOD, "metadata server %s: cannot put %s: %s", url, m->rpc_key,
              etcd_client_error(m->c));
        etcd_client_free(m->c);
        pthread_mutex_destroy(&m->mu);
        free(m);
        return NULL;
    }
    LOG_I(MOD, "segment %s published in etcd (%s) as %s", segment_name, tmp, m->ram_key);
    return m;
}

int metadata_etcd_publish(metadata_etcd *m, const char *desc_json) {
    pthread_mutex_lock(&m->mu);
    int rc = etcd_put(m->c, m->ram_key, desc_json, strlen(desc_json), 0);
    if (rc) LOG_E(MOD, "cannot put %s in etcd: %s", m->ram_key, etcd_client_error(m->c));
    pthread_mutex_unlock(&m->mu);
    return rc;
}

void metadata_etcd_close(metadata_etcd *m) {
    if (!m) return;
    pthread_mutex_lock(&m->mu);
    if (etcd_delete(m->c, m->ram_key, 0, NULL) || etcd_delete(m->c, m->rpc_key, 0, NULL))
        LOG_W(MOD, "cannot delete %s from etcd: %s", m->ram_key, etcd_client_error(m->c));
    pthread_mutex_unlock(&m->mu);
    etcd_client_free(m->c);
    pthread_mutex_destroy(&m->mu);
    free(m);
}
