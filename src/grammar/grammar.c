/*
 * grammar — the matcher: hash-consed parse stacks, interned states (sets of stacks),
 * their lazily computed byte transitions and token masks (see grammar.h).
 */
#include "grammar/grammar.h"

#include "base/err.h"
#include "grammar/grammar_ir.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- vocabulary ---------------------------------------------------------------- */

struct grammar_vocab {
    int n;
    int n_sorted;
    uint8_t **bytes;
    size_t *lens;
    uint8_t *special;
    int32_t *ord;   /* non-special, non-empty tokens sorted by bytes */
    int32_t *lcp;   /* common prefix with the previous token in ord */
    int32_t *nse;   /* next index in ord whose lcp is smaller than this one's (n_sorted: none) */
    uint8_t *blob;  /* the sorted tokens' bytes back to back: the walk reads memory in order */
    uint32_t *soff; /* (n_sorted + 1) offsets into blob */
};

static const grammar_vocab *sort_vocab;

static int cmp_tok(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    size_t lx = sort_vocab->lens[x], ly = sort_vocab->lens[y];
    int c = memcmp(sort_vocab->bytes[x], sort_vocab->bytes[y], lx < ly ? lx : ly);
    if (c) return c;
    if (lx != ly) return lx < ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

static pthread_mutex_t sort_mu = PTHREAD_MUTEX_INITIALIZER;

grammar_vocab *grammar_vocab_new(int n, const uint8_t *const *bytes, const size_t *lens,
                                 const uint8_t *is_special) {
    grammar_vocab *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    v->n = n;
    v->bytes = calloc((size_t)n + 1, sizeof *v->bytes);
    v->lens = calloc((size_t)n + 1, sizeof *v->lens);
    v->special = calloc((size_t)n + 1, 1);
    v->ord = calloc((size_t)n + 1, sizeof *v->ord);
    v->lcp = calloc((size_t)n + 1, sizeof *v->lcp);
    v->nse = calloc((size_t)n + 1, sizeof *v->nse);
    if (!v->bytes || !v->lens || !v->special || !v->ord || !v->lcp || !v->nse) {
        grammar_vocab_free(v);
        return NULL;
    }
    for (int i = 0; i < n; i++) {
        v->lens[i] = bytes[i] ? lens[i] : 0;
        v->bytes[i] = malloc(v->lens[i] + 1);
        if (!v->bytes[i]) {
            grammar_vocab_free(v);
            return NULL;
        }
        if (v->lens[i]) memcpy(v->bytes[i], bytes[i], v->lens[i]);
        v->special[i] = (is_special && is_special[i]) || !v->lens[i];
        if (!v->special[i]) v->ord[v->n_sorted++] = i;
    }
    pthread_mutex_lock(&sort_mu);
    sort_vocab = v;
    qsort(v->ord, (size_t)v->n_sorted, sizeof *v->ord, cmp_tok);
    sort_vocab = NULL;
    pthread_mutex_unlock(&sort_mu);
    for (int k = 1; k < v->n_sorted; k++) {
        int32_t a = v->ord[k - 1], b = v->ord[k];
        size_t m = v->lens[a] < v->lens[b] ? v->lens[a] : v->lens[b], l = 0;
        while (l < m && v->bytes[a][l] == v->bytes[b][l])
            l++;
        v->lcp[k] = (int32_t)l;
    }
    /* next smaller element of lcp, by a stack: a rejected prefix skips its subtree */
    int32_t *st = malloc(sizeof *st * ((size_t)v->n_sorted + 1));
    if (!st) {
        grammar_vocab_free(v);
        return NULL;
    }
    int sp = 0;
    for (int k = v->n_sorted - 1; k >= 0; k--) {
        while (sp && v->lcp[st[sp - 1]] >= v->lcp[k])
            sp--;
        v->nse[k] = sp ? st[sp - 1] : v->n_sorted;
        st[sp++] = k;
    }
    free(st);
    size_t total = 0;
    for (int k = 0; k < v->n_sorted; k++)
        total += v->lens[v->ord[k]];
    v->blob = malloc(total + 1);
    v->soff = malloc(sizeof *v->soff * ((size_t)v->n_sorted + 1));
    if (!v->blob || !v->soff || total >= UINT32_MAX) {
        grammar_vocab_free(v);
        return NULL;
    }
    size_t off = 0;
    for (int k = 0; k < v->n_sorted; k++) {
        v->soff[k] = (uint32_t)off;
        memcpy(v->blob + off, v->bytes[v->ord[k]], v->lens[v->ord[k]]);
        off += v->lens[v->ord[k]];
    }
    v->soff[v->n_sorted] = (uint32_t)off;
    return v;
}

void grammar_vocab_free(grammar_vocab *v) {
    if (!v) return;
    if (v->bytes)
        for (int i = 0; i < v->n; i++)
            free(v->bytes[i]);
    free(v->bytes);
    free(v->lens);
    free(v->special);
    free(v->ord);
    free(v->lcp);
    free(v->nse);
    free(v->blob);
    free(v->soff);
    free(v);
}

int grammar_vocab_size(const grammar_vocab *v) {
    return v->n;
}

/* ---- the grammar --------------------------------------------------------------- */

/* A stack node: the element pos to match next at this level (a CLASS, or the REF
 * being called when the node is a parent), the partial UTF-8 character so far (rem
 * continuation bytes to come << 24 | code point bits), the caller's node. */
typedef struct gnode {
    int32_t parent; /* -1: bottom */
    int32_t pos;
    uint32_t u8;
} gnode;

#define NODE_ACCEPT 0 /* the empty stack: the sentence is complete */

typedef struct gstate {
    int32_t first, n; /* its nodes: snodes[first .. first + n) */
    int32_t *trans;   /* [256] next state per byte, -1 = not computed yet */
    uint32_t *mask;   /* allowed tokens, NULL until asked */
    uint8_t accepting, terminated;
} gstate;

struct grammar {
    atomic_int refs;
    pthread_mutex_t mu;
    gir ir;
    const grammar_vocab *vocab;
    int words; /* mask words */
    /* nodes, hash-consed */
    gnode *nodes;
    int n_nodes, cap_nodes;
    int32_t *nh; /* open addressing: node ids, -1 empty */
    size_t nh_cap;
    /* states, interned */
    gstate *states;
    int n_states, cap_states;
    int32_t *snodes;
    int n_snodes, cap_snodes;
    int32_t *sh;
    size_t sh_cap;
    int n_masks;
    int32_t start;
    /* scratch */
    int32_t *buf;
    int n_buf, cap_buf;
};

static void *xgrow(void *p, int *cap, int need, size_t elsz) {
    if (need <= *cap) return p;
    int nc = *cap ? *cap * 2 : 64;
    while (nc < need)
        nc *= 2;
    void *q = realloc(p, (size_t)nc * elsz);
    if (!q) abort();
    *cap = nc;
    return q;
}

static inline uint64_t mix(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static uint64_t node_hash(int32_t parent, int32_t pos, uint32_t u8) {
    return mix(((uint64_t)(uint32_t)parent << 32) ^ (uint64_t)(uint32_t)pos ^
               ((uint64_t)u8 * 0x9E3779B97F4A7C15ULL));
}

static void nh_rehash(grammar *g) {
    size_t cap = g->nh_cap ? g->nh_cap * 2 : 1024;
    int32_t *t = malloc(cap * sizeof *t);
    if (!t) abort();
    memset(t, 0xff, cap * sizeof *t);
    for (int i = 1; i < g->n_nodes; i++) {
        size_t h = node_hash(g->nodes[i].parent, g->nodes[i].pos, g->nodes[i].u8) & (cap - 1);
        while (t[h] >= 0)
            h = (h + 1) & (cap - 1);
        t[h] = i;
    }
    free(g->nh);
    g->nh = t;
    g->nh_cap = cap;
}

static int32_t node_intern(grammar *g, int32_t parent, int32_t pos, uint32_t u8) {
    if ((size_t)g->n_nodes * 2 >= g->nh_cap) nh_rehash(g);
    size_t h = node_hash(parent, pos, u8) & (g->nh_cap - 1);
    for (; g->nh[h] >= 0; h = (h + 1) & (g->nh_cap - 1)) {
        const gnode *n = &g->nodes[g->nh[h]];
        if (n->parent == parent && n->pos == pos && n->u8 == u8) return g->nh[h];
    }
    g->nodes = xgrow(g->nodes, &g->cap_nodes, g->n_nodes + 1, sizeof *g->nodes);
    g->nodes[g->n_nodes] = (gnode){.parent = parent, .pos = pos, .u8 = u8};
    g->nh[h] = g->n_nodes;
    return g->n_nodes++;
}

static void buf_push(grammar *g, int32_t v) {
    g->buf = xgrow(g->buf, &g->cap_buf, g->n_buf + 1, sizeof *g->buf);
    g->buf[g->n_buf++] = v;
}

/* The stacks (tops at a CLASS, or NODE_ACCEPT) reachable without a byte from "match
 * elems[pos] with caller parent", into g->buf. */
static void expand(grammar *g, int32_t parent, int32_t pos) {
    for (;;) {
        const gelem *e = &g->ir.elems[pos];
        if (e->kind == GE_CLASS) {
            buf_push(g, node_intern(g, parent, pos, 0));
            return;
        }
        if (e->kind == GE_END) {
            if (parent < 0) {
                buf_push(g, NODE_ACCEPT);
                return;
            }
            const gnode *p = &g->nodes[parent];
            pos = p->pos + 1;
            parent = p->parent;
            continue;
        }
        /* REF: a call in tail position returns straight to our caller */
        const grule *r = &g->ir.rules[e->a];
        int32_t np = g->ir.elems[pos + 1].kind == GE_END ? parent : node_intern(g, parent, pos, 0);
        for (int a = 0; a < r->n_alts; a++)
            expand(g, np, r->alts[a]);
        return;
    }
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t set_hash(const int32_t *v, int n) {
    uint64_t h = 0x12345678ULL + (uint64_t)n;
    for (int i = 0; i < n; i++)
        h = mix(h ^ (uint64_t)(uint32_t)v[i]) + 0x9E3779B97F4A7C15ULL;
    return h;
}

static void sh_rehash(grammar *g) {
    size_t cap = g->sh_cap ? g->sh_cap * 2 : 256;
    int32_t *t = malloc(cap * sizeof *t);
    if (!t) abort();
    memset(t, 0xff, cap * sizeof *t);
    for (int i = 1; i < g->n_states; i++) {
        size_t h = set_hash(g->snodes + g->states[i].first, g->states[i].n) & (cap - 1);
        while (t[h] >= 0)
            h = (h + 1) & (cap - 1);
        t[h] = i;
    }
    free(g->sh);
    g->sh = t;
    g->sh_cap = cap;
}

/* Interns the node set in g->buf[from..] (sorted, unique) as a state. */
static int32_t state_intern(grammar *g, int from) {
    int32_t *v = g->buf + from;
    int n = g->n_buf - from;
    qsort(v, (size_t)n, sizeof *v, cmp_i32);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (!m || v[i] != v[m - 1]) v[m++] = v[i];
    g->n_buf = from + m;
    if (!m) return GRAMMAR_DEAD;
    if ((size_t)g->n_states * 2 >= g->sh_cap) sh_rehash(g);
    size_t h = set_hash(v, m) & (g->sh_cap - 1);
    for (; g->sh[h] >= 0; h = (h + 1) & (g->sh_cap - 1)) {
        const gstate *s = &g->states[g->sh[h]];
        if (s->n == m && !memcmp(g->snodes + s->first, v, (size_t)m * sizeof *v)) return g->sh[h];
    }
    g->snodes = xgrow(g->snodes, &g->cap_snodes, g->n_snodes + m, sizeof *g->snodes);
    memcpy(g->snodes + g->n_snodes, v, (size_t)m * sizeof *v);
    g->states = xgrow(g->states, &g->cap_states, g->n_states + 1, sizeof *g->states);
    gstate *s = &g->states[g->n_states];
    memset(s, 0, sizeof *s);
    s->first = g->n_snodes;
    s->n = m;
    s->accepting = v[0] == NODE_ACCEPT;
    s->terminated = m == 1 && v[0] == NODE_ACCEPT;
    g->n_snodes += m;
    g->sh[h] = g->n_states;
    return g->n_states++;
}

static int32_t step_byte(grammar *g, int32_t sid, uint8_t b) {
    gstate *s = &g->states[sid];
    if (!s->trans) {
        s->trans = malloc(256 * sizeof *s->trans);
        if (!s->trans) abort();
        memset(s->trans, 0xff, 256 * sizeof *s->trans);
    }
    if (s->trans[b] >= 0) return s->trans[b];
    int from = g->n_buf;
    int32_t first = s->first, n = s->n;
    for (int i = 0; i < n; i++) {
        int32_t id = g->snodes[first + i];
        if (id == NODE_ACCEPT) continue;
        gnode nd = g->nodes[id];
        const gelem *e = &g->ir.elems[nd.pos];
        /* u8: code point bits so far, continuation bytes to come << 24, length << 28 */
        uint32_t rem = nd.u8 >> 24 & 7u, len = nd.u8 >> 28, cp = nd.u8 & 0xFFFFFFu;
        if (rem == 0) {
            if (b < 0x80) {
                cp = b, len = 1;
            } else if (b >= 0xC2 && b < 0xE0) {
                rem = 1, len = 2, cp = b & 0x1Fu;
            } else if (b >= 0xE0 && b < 0xF0) {
                rem = 2, len = 3, cp = b & 0x0Fu;
            } else if (b >= 0xF0 && b < 0xF5) {
                rem = 3, len = 4, cp = b & 0x07u;
            } else
                continue;
        } else {
            if ((b & 0xC0) != 0x80) continue;
            cp = (cp << 6) | (b & 0x3Fu);
            rem--;
        }
        /* the smallest code point of a sequence this long (shorter ones are overlong) */
        uint32_t least = len == 4 ? 0x10000u : len == 3 ? 0x800u : len == 2 ? 0x80u : 0;
        if (rem) {
            uint32_t lo = cp << (6 * rem), hi = lo | ((1u << (6 * rem)) - 1);
            if (hi > 0x10FFFF) hi = 0x10FFFF;
            if (lo < least) lo = least;
            if (lo > hi || !gir_class_meets(&g->ir, e, lo, hi)) continue;
            buf_push(g, node_intern(g, nd.parent, nd.pos, len << 28 | rem << 24 | cp));
        } else {
            if (cp < least || (cp >= 0xD800 && cp <= 0xDFFF) || !gir_class_has(&g->ir, e, cp))
                continue;
            expand(g, nd.parent, nd.pos + 1);
        }
    }
    int32_t ns = state_intern(g, from);
    g->n_buf = from;
    g->states[sid].trans[b] = ns; /* states may have moved */
    return ns;
}

static const uint32_t *state_mask(grammar *g, int32_t sid) {
    if (g->states[sid].mask) return g->states[sid].mask;
    uint32_t *m = calloc((size_t)g->words, sizeof *m);
    if (!m) abort();
    const grammar_vocab *v = g->vocab;
    int32_t st[1024];
    st[0] = sid;
    int valid = 1; /* st[0 .. valid) hold the states after the current prefix's bytes */
    for (int k = 0; k < v->n_sorted;) {
        int l = v->lcp[k];
        if (valid > l + 1) valid = l + 1;
        int d = valid - 1;
        const uint8_t *b = v->blob + v->soff[k];
        int len = (int)(v->soff[k + 1] - v->soff[k]);
        if (len > 1023) {
            k++;
            continue;
        }
        int32_t cur = st[d];
        while (cur != GRAMMAR_DEAD && d < len) {
            const int32_t *tr = g->states[cur].trans; /* the memoised transition, else compute */
            int32_t nx = tr ? tr[b[d]] : -1;
            cur = nx >= 0 ? nx : step_byte(g, cur, b[d]);
            st[++d] = cur;
        }
        valid = d + 1;
        if (cur != GRAMMAR_DEAD) {
            int32_t t = v->ord[k];
            m[t >> 5] |= 1u << (t & 31);
            k++;
            continue;
        }
        /* the first d bytes are dead: skip every later token sharing them (lcp >= d) */
        int j = k + 1;
        while (j < v->n_sorted && v->lcp[j] >= d)
            j = v->nse[j];
        k = j;
    }
    g->states[sid].mask = m;
    g->n_masks++;
    return m;
}

/* ---- public -------------------------------------------------------------------- */

grammar *grammar_compile(grammar_kind kind, const char *text, size_t len,
                         const grammar_options *opt, const grammar_vocab *vocab, char *err,
                         size_t errlen) {
    char *gbnf = NULL;
    if (kind != GRAMMAR_GBNF) {
        gbnf = grammar_to_gbnf(kind, text, len, opt, err, errlen);
        if (!gbnf) return NULL;
        text = gbnf;
        len = strlen(gbnf);
    }
    grammar *g = calloc(1, sizeof *g);
    if (!g) abort();
    if (gir_parse(&g->ir, text, len, err, errlen)) {
        free(gbnf);
        free(g);
        return NULL;
    }
    free(gbnf);
    atomic_init(&g->refs, 1);
    pthread_mutex_init(&g->mu, NULL);
    g->vocab = vocab;
    g->words = (vocab->n + 31) / 32;
    /* node 0: the accept sentinel; state 0: dead */
    g->nodes = xgrow(g->nodes, &g->cap_nodes, 1, sizeof *g->nodes);
    g->nodes[0] = (gnode){.parent = -1, .pos = -1, .u8 = 0};
    g->n_nodes = 1;
    nh_rehash(g);
    g->states = xgrow(g->states, &g->cap_states, 1, sizeof *g->states);
    memset(&g->states[0], 0, sizeof g->states[0]);
    g->n_states = 1;
    sh_rehash(g);
    const grule *root = &g->ir.rules[g->ir.root];
    for (int a = 0; a < root->n_alts; a++)
        expand(g, -1, root->alts[a]);
    g->start = state_intern(g, 0);
    g->n_buf = 0;
    if (g->start == GRAMMAR_DEAD) {
        err_set(err, errlen, "grammar: the grammar matches nothing");
        grammar_unref(g);
        return NULL;
    }
    return g;
}

char *grammar_to_gbnf(grammar_kind kind, const char *text, size_t len, const grammar_options *opt,
                      char *err, size_t errlen) {
    int ws = opt ? opt->any_whitespace : 1;
    switch (kind) {
    case GRAMMAR_GBNF: {
        char *s = malloc(len + 1);
        if (!s) abort();
        memcpy(s, text, len);
        s[len] = 0;
        return s;
    }
    case GRAMMAR_JSON_SCHEMA:
        return json_schema_to_gbnf(text, len, ws, err, errlen);
    case GRAMMAR_JSON_OBJECT: {
        static const char any_object[] = "{\"type\":\"object\",\"additionalProperties\":true}";
        return json_schema_to_gbnf(any_object, sizeof any_object - 1, ws, err, errlen);
    }
    case GRAMMAR_REGEX:
        return regex_to_gbnf(text, len, err, errlen);
    case GRAMMAR_CHOICE:
        return regex_choice_to_gbnf(text, len, err, errlen);
    }
    err_set(err, errlen, "grammar: unknown kind %d", (int)kind);
    return NULL;
}

char *grammar_json_schema_rules(const char *schema, size_t len, int any_whitespace,
                                const char *root_name, int helpers, int first, int *next, char *err,
                                size_t errlen) {
    return json_schema_to_gbnf_ex(schema, len, any_whitespace, root_name, helpers, first, next, err,
                                  errlen);
}

grammar *grammar_ref(grammar *g) {
    if (g) atomic_fetch_add(&g->refs, 1);
    return g;
}

void grammar_unref(grammar *g) {
    if (!g || atomic_fetch_sub(&g->refs, 1) != 1) return;
    for (int i = 0; i < g->n_states; i++) {
        free(g->states[i].trans);
        free(g->states[i].mask);
    }
    free(g->states);
    free(g->snodes);
    free(g->sh);
    free(g->nodes);
    free(g->nh);
    free(g->buf);
    gir_free(&g->ir);
    pthread_mutex_destroy(&g->mu);
    free(g);
}

void grammar_stats(grammar *g, int *n_states, int *n_masks, int *n_nodes) {
    pthread_mutex_lock(&g->mu);
    if (n_states) *n_states = g->n_states;
    if (n_masks) *n_masks = g->n_masks;
    if (n_nodes) *n_nodes = g->n_nodes;
    pthread_mutex_unlock(&g->mu);
}

grammar_state grammar_start(grammar *g) {
    return g->start;
}

grammar_state grammar_advance_bytes(grammar *g, grammar_state s, const uint8_t *b, size_t n) {
    pthread_mutex_lock(&g->mu);
    for (size_t i = 0; i < n && s != GRAMMAR_DEAD; i++)
        s = step_byte(g, s, b[i]);
    pthread_mutex_unlock(&g->mu);
    return s;
}

grammar_state grammar_advance_token(grammar *g, grammar_state s, int32_t token) {
    const grammar_vocab *v = g->vocab;
    if (token < 0 || token >= v->n || v->special[token]) return GRAMMAR_DEAD;
    return grammar_advance_bytes(g, s, v->bytes[token], v->lens[token]);
}

int grammar_state_accepting(grammar *g, grammar_state s) {
    pthread_mutex_lock(&g->mu);
    int r = s > 0 && s < g->n_states && g->states[s].accepting;
    pthread_mutex_unlock(&g->mu);
    return r;
}

int grammar_state_terminated(grammar *g, grammar_state s) {
    pthread_mutex_lock(&g->mu);
    int r = s > 0 && s < g->n_states && g->states[s].terminated;
    pthread_mutex_unlock(&g->mu);
    return r;
}

const uint32_t *grammar_state_mask(grammar *g, grammar_state s) {
    pthread_mutex_lock(&g->mu);
    const uint32_t *m = NULL;
    if (s == GRAMMAR_DEAD || s >= g->n_states) {
        if (!g->states[0].mask) {
            g->states[0].mask = calloc((size_t)g->words, sizeof(uint32_t));
            if (!g->states[0].mask) abort();
        }
        m = g->states[0].mask;
    } else
        m = state_mask(g, s);
    pthread_mutex_unlock(&g->mu);
    return m;
}
