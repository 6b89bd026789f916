/*
 * metadata_etcd — the engine's segment in etcd in the key layout of
 * Mooncake's metadata server (transfer_config.metadata_server =
 * "etcd://host:port[,host:port...]"):
 *
 *   mooncake/ram/<segment name>       the segment descriptor (segment_desc's JSON,
 *                                     the same text the handshake port serves)
 *   mooncake/rpc_meta/<segment name>  {"ip_or_host_name": HOST, "rpc_port": PORT}
 *
 * so that a Mooncake engine initialised with the same etcd as its metadata
 * server finds a disagg segment by name.  The descriptor is re-put after
 * every (un)registration and both keys are deleted when the engine goes
 * (no lease, as Mooncake: a crashed process leaves them behind).  Over
 * base/etcd; one mutex serialises the puts.
 */
#ifndef DISAGG_TRANSFER_METADATA_ETCD_H
#define DISAGG_TRANSFER_METADATA_ETCD_H

#include <stdint.h>

typedef struct metadata_etcd metadata_etcd;

/* Connects (the rpc_meta key is put now: etcd must answer).  NULL on
 * failure, logged with the reason. */
metadata_etcd *metadata_etcd_open(const char *url, const char *segment_name, const char *host,
                                  uint16_t rpc_port);
/* Puts the descriptor JSON (0, or a negative errno, logged). */
int metadata_etcd_publish(metadata_etcd *m, const char *desc_json);
/* Deletes both keys and frees m. */
void metadata_etcd_close(metadata_etcd *m);

#endif
