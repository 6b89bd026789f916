/*
 * segment_desc — the descriptor a transfer engine publishes for its segment
 * and its JSON encoding (docs/transfer.md): name, protocol, tcp data port and
 * version, registered buffers, and our "disagg" extension (host identity, pid,
 * per-interface data endpoints).  Must agree with Mooncake's P2P metadata
 * (PROTOCOL.md section 5) so that Mooncake peers can read ours.
 */
#ifndef DISAGG_TRANSFER_SEGMENT_DESC_H
#define DISAGG_TRANSFER_SEGMENT_DESC_H

#include "transfer/registry.h"

#include <stddef.h>
#include <stdint.h>

#define SEGMENT_MAX_DATA_ADDRS 16
#define SEGMENT_MAX_DEVICES    REGISTRY_MAX_KEYS

/* An RDMA NIC as Mooncake's descriptor lists it ("devices"). */
typedef struct segment_device {
    char name[64];
    uint16_t lid;
    char gid[48]; /* "xx:xx:...": 16 bytes, hex, colon-separated */
} segment_device;
#define SEGMENT_TCP_PROTO_VERSION 2
#define SEGMENT_DISAGG_VERSION    1

typedef struct segment_desc {
    char name[96];     /* "ip:port" of the handshake port */
    char protocol[16]; /* "tcp" */
    uint16_t tcp_data_port;
    int tcp_proto_version;
    registry buffers; /* the peer's registered buffers */
    /* disagg extension; absent for a Mooncake peer (version 0, pid 0) */
    int disagg_version;
    char host_id[96]; /* "<boot id>/<pid namespace inode>" */
    int pid;
    size_t num_data_addrs;
    char data_addrs[SEGMENT_MAX_DATA_ADDRS][64]; /* "ip:port" / "[ip6]:port" */
    /* rdma (Mooncake's fields): its NICs; each buffer's rkeys follow this
     * order (registry_entry.rkey), and "lkey" is published alongside. */
    size_t num_devices;
    segment_device devices[SEGMENT_MAX_DEVICES];
    int rdma_mtu; /* disagg extension: the path MTU it uses (bytes), 0 = unknown */
} segment_desc;

void segment_desc_init(segment_desc *d);
void segment_desc_free(segment_desc *d);
/* JSON text (malloc'd, caller frees) or NULL on out-of-memory. */
char *segment_desc_encode(const segment_desc *d);
/* Parse JSON text of length len.  Errors (TRANSFER_EPROTO) fill err (cap bytes)
 * with what was wrong: not an object, missing/ill-typed field, bad buffer. */
int segment_desc_decode(const char *json, size_t len, segment_desc *out, char *err, size_t cap);

/* This host's identity: boot id and pid namespace ("<boot_id>/<ns inode>"). */
void segment_host_id(char *buf, size_t cap);

#endif
