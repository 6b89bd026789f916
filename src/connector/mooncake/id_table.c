/* id_table — see id_table.h. */
#include "connector/mooncake/id_table.h"

#include "base/auth.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

struct id_node {
    id_node *next;   /* chain */
    uint64_t hash;   /* of key */
    const char *key; /* borrowed */
    void *value;
};

#define INITIAL_BUCKETS 64

static uint64_t hash_of(const id_table *t, const char *key) {
    return XXH3_64bits_withSeed(key, strlen(key), t->seed);
}

int id_table_init(id_table *t) {
    memset(t, 0, sizeof *t);
    t->buckets = calloc(INITIAL_BUCKETS, sizeof *t->buckets);
    if (!t->buckets) return -ENOMEM;
    t->n_buckets = INITIAL_BUCKETS;
    if (auth_random(&t->seed, sizeof t->seed) != 0) /* still correct, only guessable */
        t->seed = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)t;
    return 0;
}

void *id_table_get(const id_table *t, const char *key) {
    uint64_t h = hash_of(t, key);
    for (id_node *n = t->buckets[h & (t->n_buckets - 1)]; n; n = n->next)
        if (n->hash == h && strcmp(n->key, key) == 0) return n->value;
    return NULL;
}

static void grow(id_table *t) {
    size_t nb = t->n_buckets * 2;
    id_node **b = calloc(nb, sizeof *b);
    if (!b) return; /* longer chains, still correct */
    for (size_t i = 0; i < t->n_buckets; i++)
        for (id_node *n = t->buckets[i], *next; n; n = next) {
            next = n->next;
            n->next = b[n->hash & (nb - 1)];
            b[n->hash & (nb - 1)] = n;
        }
    free(t->buckets);
    t->buckets = b;
    t->n_buckets = nb;
}

int id_table_put(id_table *t, const char *key, void *value) {
    id_node *n = malloc(sizeof *n);
    if (!n) return -ENOMEM;
    n->hash = hash_of(t, key);
    n->key = key;
    n->value = value;
    id_node **b = &t->buckets[n->hash & (t->n_buckets - 1)];
    n->next = *b;
    *b = n;
    if (++t->count > t->n_buckets) grow(t);
    return 0;
}

void *id_table_del(id_table *t, const char *key) {
    uint64_t h = hash_of(t, key);
    for (id_node **pp = &t->buckets[h & (t->n_buckets - 1)]; *pp; pp = &(*pp)->next) {
        id_node *n = *pp;
        if (n->hash == h && strcmp(n->key, key) == 0) {
            void *v = n->value;
            *pp = n->next;
            free(n);
            t->count--;
            return v;
        }
    }
    return NULL;
}

void id_table_free(id_table *t) {
    if (!t->buckets) return;
    for (size_t i = 0; i < t->n_buckets; i++)
        for (id_node *n = t->buckets[i], *next; n; n = next) {
            next = n->next;
            free(n);
        }
    free(t->buckets);
    memset(t, 0, sizeof *t);
}

size_t id_table_longest_chain(const id_table *t) {
    size_t longest = 0;
    for (size_t b = 0; b < t->n_buckets; b++) {
        size_t len = 0;
        for (const id_node *n = t->buckets[b]; n; n = n->next)
            len++;
        if (len > longest) longest = len;
    }
    return longest;
}
