/*
 * disagg transfer engine — public API.
 *
 * Moves bytes between registered memory of two processes with one-sided READ
 * and WRITE, in the model of Mooncake's transfer engine.  An engine is named by
 * its segment name "ip:port" (the handshake/RPC port; IPv6 as "[ip]:port").
 * A peer opens a segment by that name (P2P handshake, no metadata server) and
 * receives its descriptor: registered buffers, data addresses, host identity
 * and protocol versions.  Requests name remote memory by its absolute virtual
 * address in the target process; the target accepts a request only if the
 * whole range lies inside one of its registered buffers.
 *
 * Transports: "tcp" (persistent pipelined connections, striped over lanes and
 * over the interfaces named by device_name; device memory through pinned
 * staging buffers), "shm" (same host: one copy with process_vm_writev/readv,
 * no socket; chosen automatically for same-host peers and falling back to tcp
 * when the kernel refuses it), "cuda_ipc" (same host, device memory on both
 * sides, through the device-memory ops) and "rdma" (RC queue pairs over the
 * NICs named by device_name; tcp when there is none).  The engine picks one
 * per peer and, where the memory rules it out, per request
 * (docs/transfer.md).
 *
 * This library depends on nothing above src/base and never prints to stdout.
 * Every function returns 0 or a negative transfer_error; transfer_strerror()
 * names it.  All functions are thread-safe.
 */
#ifndef DISAGG_TRANSFER_H
#define DISAGG_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The library is built with -fvisibility=hidden: only what this header
 * declares is exported (tests/integration/test_transfer_visibility.py). */
#pragma GCC visibility push(default)

/* ---- errors ------------------------------------------------------------- */

typedef enum transfer_error {
    TRANSFER_OK = 0,
    TRANSFER_EINVAL = -1,     /* invalid argument (message in the log names it) */
    TRANSFER_ENOMEM = -2,     /* out of memory */
    TRANSFER_EOVERLAP = -3,   /* registration overlaps an existing one */
    TRANSFER_ENOTREG = -4,    /* local address range is not registered */
    TRANSFER_EREMOTEADDR = -5,/* target rejected the remote address range */
    TRANSFER_ETIMEDOUT = -6,  /* a deadline passed */
    TRANSFER_ECONN = -7,      /* peer unreachable, connection refused, reset or closed */
    TRANSFER_EPROTO = -8,     /* malformed or unexpected frame from the peer */
    TRANSFER_ESTALE = -9,     /* batch or segment handle is stale or unknown */
    TRANSFER_EBUSY = -10,     /* batch still has requests in flight */
    TRANSFER_ECANCELED = -11, /* request was cancelled */
    TRANSFER_ENOSEG = -12,    /* segment name cannot be resolved / opened */
    TRANSFER_EVERSION = -13,  /* peer speaks an incompatible protocol version */
    TRANSFER_ESYS = -14,      /* unexpected system error (errno in the log) */
    TRANSFER_ENOSPACE = -15,  /* batch capacity exceeded */
    TRANSFER_EPERM = -16,     /* operation not permitted (e.g. shm refused by the kernel) */
    TRANSFER_EAUTH = -17,     /* shared-secret authentication failed or was refused */
} transfer_error;

const char *transfer_strerror(int err);

/* ---- engine ------------------------------------------------------------- */

typedef struct transfer_engine transfer_engine;

/* Which transport a segment uses. */
typedef enum transfer_protocol {
    TRANSFER_PROTO_AUTO = 0, /* shm for same-host peers when permitted, else tcp */
    TRANSFER_PROTO_TCP = 1,
    TRANSFER_PROTO_SHM = 2, /* same host only; opening a remote host's segment fails */
    /* RDMA (RC queue pairs, one-sided WRITE/READ) over the NICs named by
     * device_name (all when empty).  No NIC: tcp with a warning.  A peer
     * without rdma: tcp.  With an auth_secret the queue-pair handshake is
     * authenticated (docs/transfer.md). */
    TRANSFER_PROTO_RDMA = 3,
    /* Reported by transfer_segment_get_info only: never the preferred
     * transport of a segment (device memory of a same-host peer uses it). */
    TRANSFER_PROTO_CUDA_IPC = 4,
} transfer_protocol;

typedef struct transfer_config {
    /* Address advertised in the segment name.  NULL/"" = VLLM_HOST_IP if set,
     * else the first address of an allowed interface, else 127.0.0.1. */
    const char *local_hostname;
    /* Handshake (RPC) port; 0 = an ephemeral port. */
    uint16_t rpc_port;
    /* Data port for incoming tcp data connections; 0 = ephemeral. */
    uint16_t data_port;
    transfer_protocol protocol;
    /* Comma-separated whitelist of local interfaces ("eth0,eth1"); NULL/"" = all
     * non-loopback interfaces that are up (loopback if nothing else).  With
     * protocol rdma: the RDMA NICs ("mlx5_0,mlx5_1", as Mooncake), and tcp
     * uses every interface. */
    const char *device_name;
    /* tcp: connections (lanes) per peer and per path; 0 = default (2). */
    int lanes;
    /* tcp: requests larger than this are striped across lanes; 0 = 1 MiB. */
    size_t stripe_bytes;
    /* Deadline of one request: timeout_base_ns + timeout_per_byte_ns * length.
     * 0 = Mooncake's defaults (30 s, 1 ns per byte). */
    uint64_t timeout_base_ns;
    double timeout_per_byte_ns;
    /* Deadline of connect and handshake; 0 = 5 s. */
    uint64_t connect_timeout_ns;
    /* tcp data port: open connections accepted from one peer address at
     * once (1..1024); 0 = $DISAGG_KV_MAX_CONNS_PER_PEER, else 64.  Beyond it
     * the peer's longest-idle connection is closed to make room (a new one is
     * refused only when all of them are busy), and a connection that sends
     * no request within 2 s of connecting is closed (docs/security.md). */
    int max_conns_per_peer;
    /* Shared secret (copied).  NULL/"" = none: the handshake and data ports
     * speak Mooncake's frames unchanged.  Set: every handshake and every data
     * connection, in both directions, is an HMAC-SHA256 challenge-response
     * (docs/transfer.md, Security); peers without it are refused.  Callers
     * resolve it with auth_secret_resolve() (config, else $DISAGG_KV_SECRET). */
    const char *auth_secret;
    /* Mooncake's metadata server: "etcd://host:port[,host:port...]" publishes
     * the segment under mooncake/ram/<name> and mooncake/rpc_meta/<name> (and
     * deletes them at destroy), so that Mooncake engines configured with the
     * same etcd find it.  NULL/"" = none (the handshake port only).  etcd
     * must answer at create. */
    const char *metadata_server;
} transfer_config;

/* How many active RDMA NICs this host has (0 also for a build without
 * libibverbs): what protocol rdma would use.  For callers that decide the
 * protocol themselves (the connector's "rdma" default falls back to tcp
 * when this is 0). */
int transfer_rdma_device_count(void);

/* Fill *cfg with defaults. */
void transfer_config_init(transfer_config *cfg);

int transfer_engine_create(const transfer_config *cfg, transfer_engine **out);
/* Stops all threads, fails pending requests with TRANSFER_ECANCELED, frees all. */
void transfer_engine_destroy(transfer_engine *engine);

/* "ip:port" of this engine's handshake port; valid until destroy. */
const char *transfer_engine_segment_name(const transfer_engine *engine);
/* The port of this engine's tcp data listener(s). */
uint16_t transfer_engine_data_port(const transfer_engine *engine);

/* ---- memory registration ------------------------------------------------ */

/* location: "cpu:N" (NUMA node, or "cpu:0" / "cpu" for any) or "cuda:N"
 * (device memory of GPU N: needs transfer_engine_set_device_ops() first, and
 * is rejected without it).  The segment descriptor lists each buffer's
 * location and the transports that reach it.  Zero-length and overlapping
 * registrations are rejected. */
int transfer_register(transfer_engine *engine, void *addr, size_t length, const char *location);
/* addr must be the start of a registration. */
int transfer_unregister(transfer_engine *engine, void *addr);

/* ---- device memory ------------------------------------------------------- */

/* How the transfer layer touches device memory without linking CUDA: the
 * layer that owns the GPU (the engine, through the dlopen'ed CUDA module)
 * installs this table.  tcp moves device memory through pinned host staging
 * buffers: device->host copy, send / receive, host->device copy, pipelined
 * over several buffers and streams.  Copies are asynchronous on a stream:
 * they may happen at any time until sync() on that stream returns.  Every
 * function returns 0 or a negative value (logged by the caller). */
typedef struct transfer_device_ops {
    void *ctx; /* passed to every function */
    /* A stream (copy queue) on device `device`. */
    int (*stream_create)(void *ctx, int device, void **stream);
    void (*stream_destroy)(void *ctx, void *stream);
    int (*copy_to_host)(void *ctx, void *stream, void *host, const void *dev, size_t len);
    int (*copy_from_host)(void *ctx, void *stream, void *dev, const void *host, size_t len);
    /* Wait until every copy queued on stream has completed. */
    int (*sync)(void *ctx, void *stream);
    /* Page-locked host memory for staging (NULL on failure). */
    void *(*alloc_pinned)(void *ctx, size_t len);
    void (*free_pinned)(void *ctx, void *p);
    /* Optional (NULL = none): a DMA-BUF file descriptor covering device
     * memory [dev, +len) and dev's offset in it (the CUDA module wraps
     * cuMemGetHandleForAddressRange); rdma registers GPU memory with it when
     * WITH_NVIDIA_PEERMEM=0.  The caller closes *fd. */
    int (*get_dmabuf)(void *ctx, const void *dev, size_t len, int *fd, uint64_t *offset);
    /* Optional (all four or none), for the cuda_ipc transport (same host,
     * device memory on both sides): ipc_export gives a handle (CUDA IPC or a
     * VMM shareable handle, at most TRANSFER_IPC_HANDLE_MAX bytes) for the
     * allocation holding [dev, +len) and dev's offset from that
     * allocation's base; ipc_open maps a peer's handle on `device` once
     * (*base = the allocation's base here); ipc_close unmaps it;
     * copy_device queues a device-to-device copy on stream. */
    int (*ipc_export)(void *ctx, const void *dev, size_t len, void *handle, size_t *handle_len,
                      uint64_t *offset);
    int (*ipc_open)(void *ctx, int device, const void *handle, size_t handle_len, void **base);
    void (*ipc_close)(void *ctx, void *base);
    int (*copy_device)(void *ctx, void *stream, void *dst, const void *src, size_t len);
    /* Optional (NULL = copy_device per copy): queue n device-to-device copies
     * (dst[i] <- src[i], len[i] bytes; none overlapping) on stream as one
     * operation -- the CUDA module launches one gather/scatter copy kernel
     * over the list (docs/transfer.md "cuda_ipc"). */
    int (*copy_device_batch)(void *ctx, void *stream, void *const *dst, const void *const *src,
                             const size_t *len, size_t n);
} transfer_device_ops;

#define TRANSFER_IPC_HANDLE_MAX 64

/* Install (copied) or, with NULL, remove the device-memory table.  Refused
 * (TRANSFER_EBUSY) while device memory is registered; TRANSFER_EINVAL when a
 * function is missing. */
int transfer_engine_set_device_ops(transfer_engine *engine, const transfer_device_ops *ops);

typedef struct transfer_device_stats {
    uint64_t staged_bytes_out; /* device->host bytes staged (initiator WRITE, target READ) */
    uint64_t staged_bytes_in;  /* host->device bytes staged (initiator READ, target WRITE) */
} transfer_device_stats;
void transfer_engine_get_device_stats(transfer_engine *engine, transfer_device_stats *out);

/* ---- segments ------------------------------------------------------------ */

typedef int64_t transfer_segment;

/* Open a peer by segment name (P2P handshake).  Opening the same name twice
 * returns the same handle.  Returns the handle in *out. */
int transfer_open_segment(transfer_engine *engine, const char *name, transfer_segment *out);
int transfer_close_segment(transfer_engine *engine, transfer_segment seg);
/* Re-fetch the peer's descriptor (e.g. after it registered more memory). */
int transfer_refresh_segment(transfer_engine *engine, transfer_segment seg);

typedef struct transfer_buffer_info {
    uint64_t addr;
    uint64_t length;
    char location[32];
} transfer_buffer_info;

typedef struct transfer_segment_info {
    char name[96];        /* "ip:port" */
    char host_id[96];     /* boot id + pid namespace: equal means same host */
    int pid;              /* peer process id */
    transfer_protocol protocol; /* the transport this engine uses for it */
    int tcp_proto_version;
    size_t num_buffers;
    size_t num_data_addrs; /* tcp data endpoints advertised (one per interface) */
} transfer_segment_info;

int transfer_segment_get_info(transfer_engine *engine, transfer_segment seg,
                              transfer_segment_info *info);
/* Copies up to max buffers into out; returns the number copied (>= 0). */
int transfer_segment_get_buffers(transfer_engine *engine, transfer_segment seg,
                                 transfer_buffer_info *out, size_t max);

/* ---- batches -------------------------------------------------------------- */

typedef uint64_t transfer_batch; /* generation-tagged; 0 is never valid */

typedef enum transfer_opcode { TRANSFER_READ = 0, TRANSFER_WRITE = 1 } transfer_opcode;

typedef struct transfer_request {
    transfer_opcode opcode;
    void *local;          /* must lie inside a local registration */
    transfer_segment target;
    uint64_t remote_addr; /* absolute address in the target process */
    size_t length;
} transfer_request;

typedef enum transfer_state {
    TRANSFER_STATE_WAITING = 0, /* slot allocated, not submitted */
    TRANSFER_STATE_PENDING = 1,
    TRANSFER_STATE_COMPLETED = 2,
    TRANSFER_STATE_FAILED = 3,
    TRANSFER_STATE_CANCELED = 4,
    TRANSFER_STATE_TIMEOUT = 5,
} transfer_state;

typedef struct transfer_status {
    transfer_state state;
    int error;                /* transfer_error when FAILED/TIMEOUT/CANCELED */
    size_t transferred_bytes;
    /* Which transports carried it: bit (1u << transfer_protocol) per transport
     * its chunks were given to (TRANSFER_PROTO_TCP, _SHM, _RDMA, _CUDA_IPC);
     * in the overall status, the union over the batch. */
    unsigned transports;
} transfer_status;

/* "tcp", "shm", "rdma", "cuda_ipc" ("auto" for TRANSFER_PROTO_AUTO, "?"
 * for anything else). */
const char *transfer_protocol_name(transfer_protocol p);

/* A batch holds up to max_requests requests over its lifetime. */
int transfer_batch_alloc(transfer_engine *engine, size_t max_requests, transfer_batch *out);
/* Submit n more requests; returns immediately.  Invalid requests (bad local
 * range, unknown segment) fail the whole call before anything is sent. */
int transfer_batch_submit(transfer_engine *engine, transfer_batch batch,
                          const transfer_request *reqs, size_t n);
/* Block (no busy spin) until every submitted request has ended or timeout_ns
 * passed.  Returns 0 when all completed successfully, the first request's
 * error when one failed, TRANSFER_ETIMEDOUT if still pending at the timeout. */
int transfer_batch_wait(transfer_engine *engine, transfer_batch batch, uint64_t timeout_ns);
int transfer_batch_get_status(transfer_engine *engine, transfer_batch batch, size_t index,
                              transfer_status *status);
/* Aggregate: PENDING while any is pending, else FAILED/TIMEOUT/CANCELED if any
 * ended so, else COMPLETED; transferred_bytes summed. */
int transfer_batch_get_overall(transfer_engine *engine, transfer_batch batch,
                               transfer_status *status);
/* Requests not yet on the wire end as CANCELED; those on the wire finish.
 * Wait before reusing the local memory. */
int transfer_batch_cancel(transfer_engine *engine, transfer_batch batch);
/* TRANSFER_EBUSY while requests are in flight (cancel + wait first). */
int transfer_batch_free(transfer_engine *engine, transfer_batch batch);

/* Convenience: open target by name, WRITE src[i] -> dst[i] (len[i] bytes) for
 * i < n, wait for all with the default deadlines.  The form the KV connector
 * calls. */
int transfer_sync_write(transfer_engine *engine, const char *target_name, void *const src[],
                        const uint64_t dst[], const size_t len[], size_t n);
int transfer_sync_read(transfer_engine *engine, const char *target_name, void *const dst[],
                       const uint64_t src[], const size_t len[], size_t n);
/* transfer_sync_write that also says which transports carried the requests
 * (*transports: the transfer_status.transports bits of the batch; NULL = not
 * wanted), whether it succeeded or not. */
int transfer_sync_write_via(transfer_engine *engine, const char *target_name, void *const src[],
                            const uint64_t dst[], const size_t len[], size_t n,
                            unsigned *transports);

/* ---- statistics ------------------------------------------------------------ */

typedef struct transfer_stats {
    uint64_t bytes_written, bytes_read;    /* as initiator, completed */
    uint64_t requests_ok, requests_failed; /* as initiator */
    uint64_t bytes_served;                 /* as target (tcp) */
    uint64_t requests_rejected;            /* as target: address rejected */
    uint64_t path_retries;                 /* tcp chunks retried on another path */
    uint64_t shm_fallbacks;                /* shm refused, used tcp */
    uint64_t auth_refused;                 /* as target: handshakes + data connections refused */
} transfer_stats;

void transfer_engine_get_stats(transfer_engine *engine, transfer_stats *out);

#pragma GCC visibility pop

#ifdef __cplusplus
}
#endif
#endif /* DISAGG_TRANSFER_H */
