/*
 * id_table — a string-keyed hash table (transfer id -> entry) for the
 * producer's pending pulls: O(1) expected get, put and
 * delete however many entries a flood of bogus pulls creates.  The hash is
 * XXH3 with a per-table random seed, so that a peer cannot choose ids that
 * collide (hash flooding).  Chained buckets; the table doubles when the load
 * passes 1.  Not thread-safe: the owner locks.
 */
#ifndef DISAGG_CONNECTOR_MOONCAKE_ID_TABLE_H
#define DISAGG_CONNECTOR_MOONCAKE_ID_TABLE_H

#include <stddef.h>
#include <stdint.h>

typedef struct id_node id_node;

typedef struct id_table {
    id_node **buckets; /* (n_buckets) chains */
    size_t n_buckets;  /* a power of two */
    size_t count;      /* entries */
    uint64_t seed;     /* random hash seed */
} id_table;

/* Returns 0 or -ENOMEM. */
int id_table_init(id_table *t);
/* The value stored under key, NULL when absent. */
void *id_table_get(const id_table *t, const char *key);
/* Store value under key (which must not be present).  key is not copied: it
 * must stay valid and unchanged while the entry is in the table (e.g. a field
 * of value).  Returns 0 or -ENOMEM. */
int id_table_put(id_table *t, const char *key, void *value);
/* Remove key; returns its value, NULL when absent. */
void *id_table_del(id_table *t, const char *key);
void id_table_free(id_table *t);
/* Entries in the longest chain (for tests: the hash spreads the keys). */
size_t id_table_longest_chain(const id_table *t);

#endif
