/* segment_desc — see segment_desc.h. */
#include "transfer/segment_desc.h"

#include "disagg/transfer.h"
#include "transfer/transport.h"

#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* Bit k of registry_entry.reach is REACH_NAMES[k] (transport.h). */
static const char *const REACH_NAMES[] = {"tcp", "shm", "rdma", "cuda_ipc"};

void segment_desc_init(segment_desc *d) {
    memset(d, 0, sizeof *d);
    registry_init(&d->buffers);
    snprintf(d->protocol, sizeof d->protocol, "tcp");
    d->tcp_proto_version = SEGMENT_TCP_PROTO_VERSION;
}

void segment_desc_free(segment_desc *d) {
    registry_free(&d->buffers);
}

char *segment_desc_encode(const segment_desc *d) {
    json_t *o = json_object();
    json_object_set_new(o, "name", json_string(d->name));
    json_object_set_new(o, "protocol", json_string(d->protocol));
    json_object_set_new(o, "tcp_data_port", json_integer(d->tcp_data_port));
    json_object_set_new(o, "tcp_proto_version", json_integer(d->tcp_proto_version));
    json_t *bufs = json_array();
    for (size_t i = 0; i < d->buffers.n; i++) {
        const registry_entry *e = &d->buffers.v[i];
        json_t *b = json_object();
        json_object_set_new(b, "name", json_string(e->location));
        /* u64 addresses: jansson integers are signed 64-bit; user-space
         * addresses on Linux fit (< 2^63). */
        json_object_set_new(b, "addr", json_integer((json_int_t)e->addr));
        json_object_set_new(b, "length", json_integer((json_int_t)e->length));
        /* Extension (Mooncake ignores unknown buffer fields): the transports
         * that reach this buffer. */
        if (e->nkeys) { /* Mooncake's rdma buffer field: one remote key per NIC */
            json_t *rk = json_array();
            for (uint32_t k = 0; k < e->nkeys; k++)
                json_array_append_new(rk, json_integer(e->rkey[k]));
            json_object_set_new(b, "rkey", rk);
        }
        if (e->ipc_len) { /* extension: the cuda_ipc handle (hex) and offset */
            char hx[2 * REGISTRY_IPC_MAX + 1];
            for (uint32_t k = 0; k < e->ipc_len; k++)
                snprintf(hx + 2 * k, 3, "%02x", e->ipc[k]);
            json_object_set_new(b, "ipc_handle", json_string(hx));
            json_object_set_new(b, "ipc_offset", json_integer((json_int_t)e->ipc_off));
        }
        if (e->reach) {
            json_t *tr = json_array();
            for (size_t k = 0; k < sizeof REACH_NAMES / sizeof REACH_NAMES[0]; k++)
                if (e->reach & (1u << k)) json_array_append_new(tr, json_string(REACH_NAMES[k]));
            json_object_set_new(b, "transports", tr);
        }
        json_array_append_new(bufs, b);
    }
    json_object_set_new(o, "buffers", bufs);
    if (d->num_devices) {
        json_t *dv = json_array();
        for (size_t i = 0; i < d->num_devices; i++)
            json_array_append_new(dv, json_pack("{s:s,s:i,s:s}", "name", d->devices[i].name, "lid",
                                                (int)d->devices[i].lid, "gid", d->devices[i].gid));
        json_object_set_new(o, "devices", dv);
    }
    char ts[32];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%SZ", &tm);
    json_object_set_new(o, "timestamp", json_string(ts));
    json_t *x = json_object();
    json_object_set_new(x, "version", json_integer(d->disagg_version));
    json_object_set_new(x, "host_id", json_string(d->host_id));
    json_object_set_new(x, "pid", json_integer(d->pid));
    json_t *da = json_array();
    for (size_t i = 0; i < d->num_data_addrs; i++)
        json_array_append_new(da, json_string(d->data_addrs[i]));
    json_object_set_new(x, "data_addrs", da);
    if (d->rdma_mtu) json_object_set_new(x, "rdma_mtu", json_integer(d->rdma_mtu));
    json_object_set_new(o, "disagg", x);
    char *s = json_dumps(o, JSON_COMPACT);
    json_decref(o);
    return s;
}

static int fail(char *err, size_t cap, const char *msg, const char *key) {
    if (err && cap)
        snprintf(err, cap, "segment descriptor: %s%s%s", msg, key ? " " : "", key ? key : "");
    return TRANSFER_EPROTO;
}

static int get_str(json_t *o, const char *key, char *dst, size_t cap, int required, char *err,
                   size_t ecap) {
    json_t *v = json_object_get(o, key);
    if (!v) return required ? fail(err, ecap, "missing string field", key) : 0;
    if (!json_is_string(v)) return fail(err, ecap, "field must be a string:", key);
    if (json_string_length(v) >= cap) return fail(err, ecap, "string too long:", key);
    memcpy(dst, json_string_value(v), json_string_length(v) + 1);
    return 0;
}

static int get_uint(json_t *o, const char *key, uint64_t max, uint64_t *dst, int required,
                    char *err, size_t ecap) {
    json_t *v = json_object_get(o, key);
    if (!v) return required ? fail(err, ecap, "missing integer field", key) : 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || (uint64_t)json_integer_value(v) > max)
        return fail(err, ecap, "field must be a non-negative integer in range:", key);
    *dst = (uint64_t)json_integer_value(v);
    return 0;
}

int segment_desc_decode(const char *json, size_t len, segment_desc *out, char *err, size_t cap) {
    segment_desc_init(out);
    json_error_t je;
    json_t *o = json_loadb(json, len, JSON_REJECT_DUPLICATES, &je);
    if (!o) {
        if (err && cap) snprintf(err, cap, "segment descriptor: invalid JSON: %s", je.text);
        return TRANSFER_EPROTO;
    }
    int rc = TRANSFER_EPROTO;
    uint64_t u = 0;
    if (!json_is_object(o)) {
        fail(err, cap, "not a JSON object", NULL);
        goto done;
    }
    if (get_str(o, "name", out->name, sizeof out->name, 1, err, cap)) goto done;
    if (get_str(o, "protocol", out->protocol, sizeof out->protocol, 0, err, cap)) goto done;
    if (get_uint(o, "tcp_data_port", 65535, &u, 0, err, cap)) goto done;
    out->tcp_data_port = (uint16_t)u;
    u = 1;
    if (get_uint(o, "tcp_proto_version", 1000, &u, 0, err, cap)) goto done;
    out->tcp_proto_version = (int)u;
    json_t *bufs = json_object_get(o, "buffers");
    if (bufs && !json_is_array(bufs)) {
        fail(err, cap, "field must be an array:", "buffers");
        goto done;
    }
    size_t i;
    json_t *b;
    json_array_foreach(bufs, i, b) {
        char loc[32] = "cpu:0";
        uint64_t addr = 0, length = 0;
        if (!json_is_object(b)) {
            fail(err, cap, "buffer entry is not an object", NULL);
            goto done;
        }
        /* Mooncake names a tcp buffer after its segment ("ip:port"): kept
         * when it fits, else the default location (it is informative). */
        json_t *bn = json_object_get(b, "name");
        if (bn && !json_is_string(bn)) {
            fail(err, cap, "field must be a string:", "buffers[].name");
            goto done;
        }
        if (bn && json_string_length(bn) < sizeof loc)
            memcpy(loc, json_string_value(bn), json_string_length(bn) + 1);
        if (get_uint(b, "addr", UINT64_MAX, &addr, 1, err, cap) ||
            get_uint(b, "length", UINT64_MAX, &length, 1, err, cap))
            goto done;
        unsigned reach = 0;
        json_t *tr = json_object_get(b, "transports");
        if (tr && !json_is_array(tr)) {
            fail(err, cap, "field must be an array:", "buffers[].transports");
            goto done;
        }
        size_t ti;
        json_t *tn;
        json_array_foreach(tr, ti, tn) {
            if (!json_is_string(tn)) {
                fail(err, cap, "bad entry in", "buffers[].transports");
                goto done;
            }
            for (size_t k = 0; k < sizeof REACH_NAMES / sizeof REACH_NAMES[0]; k++)
                if (strcmp(json_string_value(tn), REACH_NAMES[k]) == 0) reach |= 1u << k;
            /* unknown names (a newer peer's transports) are skipped */
        }
        uint32_t rkeys[REGISTRY_MAX_KEYS], nkeys = 0;
        json_t *rk = json_object_get(b, "rkey");
        if (rk && !json_is_array(rk)) {
            fail(err, cap, "field must be an array:", "buffers[].rkey");
            goto done;
        }
        json_array_foreach(rk, ti, tn) {
            if (!json_is_integer(tn) || json_integer_value(tn) < 0 ||
                json_integer_value(tn) > UINT32_MAX) {
                fail(err, cap, "bad entry in", "buffers[].rkey");
                goto done;
            }
            if (nkeys < REGISTRY_MAX_KEYS) rkeys[nkeys++] = (uint32_t)json_integer_value(tn);
        }
        uint8_t ipc[REGISTRY_IPC_MAX];
        uint32_t ipc_len = 0;
        uint64_t ipc_off = 0;
        json_t *ih = json_object_get(b, "ipc_handle");
        if (ih) {
            const char *h = json_string_value(ih);
            size_t hl = h ? strlen(h) : 0;
            if (!h || hl % 2 || hl / 2 > REGISTRY_IPC_MAX || hl == 0) {
                fail(err, cap, "bad hex string in", "buffers[].ipc_handle");
                goto done;
            }
            for (size_t k = 0; k < hl / 2; k++) {
                unsigned x;
                if (!isxdigit((unsigned char)h[2 * k]) || !isxdigit((unsigned char)h[2 * k + 1]) ||
                    sscanf(h + 2 * k, "%2x", &x) != 1) {
                    fail(err, cap, "bad hex string in", "buffers[].ipc_handle");
                    goto done;
                }
                ipc[k] = (uint8_t)x;
            }
            ipc_len = (uint32_t)(hl / 2);
            if (get_uint(b, "ipc_offset", UINT64_MAX, &ipc_off, 0, err, cap)) goto done;
        }
        int r = registry_add(&out->buffers, addr, length, loc);
        if (r == 0) {
            registry_entry *re = (registry_entry *)registry_find(&out->buffers, addr, 1);
            re->reach = reach;
            re->nkeys = nkeys;
            re->ipc_len = ipc_len;
            re->ipc_off = ipc_off;
            memcpy(re->ipc, ipc, ipc_len);
            memcpy(re->rkey, rkeys, nkeys * sizeof rkeys[0]);
        }
        if (r == TRANSFER_ENOMEM) {
            rc = r;
            goto done;
        }
        if (r) {
            fail(err, cap, "buffers are empty or overlap", NULL);
            goto done;
        }
    }
    json_t *devs = json_object_get(o, "devices");
    if (devs && !json_is_array(devs)) {
        fail(err, cap, "field must be an array:", "devices");
        goto done;
    }
    json_array_foreach(devs, i, b) {
        if (out->num_devices == SEGMENT_MAX_DEVICES) break;
        segment_device *sd = &out->devices[out->num_devices];
        if (!json_is_object(b)) {
            fail(err, cap, "device entry is not an object", NULL);
            goto done;
        }
        u = 0;
        if (get_str(b, "name", sd->name, sizeof sd->name, 1, err, cap) ||
            get_str(b, "gid", sd->gid, sizeof sd->gid, 0, err, cap) ||
            get_uint(b, "lid", 65535, &u, 0, err, cap))
            goto done;
        sd->lid = (uint16_t)u;
        u = 0;
        out->num_devices++;
    }
    json_t *x = json_object_get(o, "disagg");
    if (x && json_is_object(x)) {
        u = 0;
        if (get_uint(x, "version", 1000000, &u, 0, err, cap)) goto done;
        out->disagg_version = (int)u;
        if (get_str(x, "host_id", out->host_id, sizeof out->host_id, 0, err, cap)) goto done;
        u = 0;
        if (get_uint(x, "pid", INT32_MAX, &u, 0, err, cap)) goto done;
        out->pid = (int)u;
        u = 0;
        if (get_uint(x, "rdma_mtu", 1 << 16, &u, 0, err, cap)) goto done;
        out->rdma_mtu = (int)u;
        json_t *da = json_object_get(x, "data_addrs");
        if (da && !json_is_array(da)) {
            fail(err, cap, "field must be an array:", "disagg.data_addrs");
            goto done;
        }
        json_t *a;
        json_array_foreach(da, i, a) {
            if (out->num_data_addrs == SEGMENT_MAX_DATA_ADDRS) break;
            if (!json_is_string(a) || json_string_length(a) >= sizeof out->data_addrs[0]) {
                fail(err, cap, "bad entry in", "disagg.data_addrs");
                goto done;
            }
            memcpy(out->data_addrs[out->num_data_addrs++], json_string_value(a),
                   json_string_length(a) + 1);
        }
    }
    rc = 0;
done:
    json_decref(o);
    if (rc) segment_desc_free(out);
    return rc;
}

void segment_host_id(char *buf, size_t cap) {
    char boot[64] = "unknown";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (fgets(boot, sizeof boot, f)) boot[strcspn(boot, "\n")] = 0;
        fclose(f);
    }
    struct stat st;
    unsigned long ns = stat("/proc/self/ns/pid", &st) == 0 ? (unsigned long)st.st_ino : 0;
    snprintf(buf, cap, "%s/%lu", boot, ns);
}
