/*
 * gbnf — the GBNF / EBNF parser (llama.cpp's GBNF, xgrammar's EBNF dialect): rules
 * `name ::= alternatives`, string literals "..." / '...', character classes [...] and
 * [^...] with ranges and escapes, `.`, groups, rule references, the postfix operators
 * * + ? {m} {m,} {m,n}, comments from #.  A rule ends where the next `name ::=` starts.
 * Repetitions become right-recursive helper rules called in tail position.
 */
#include "grammar/grammar_ir.h"

#include "base/err.h"

#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REPEAT 10000

typedef struct seq {
    gelem *v;
    int n, cap;
} seq;

typedef struct parser {
    gir *ir;
    const char *s, *end;
    const char *start;
    char *err;
    size_t errlen;
    int failed;
    int depth;
} parser;

static void *grow(void *p, int *cap, int need, size_t elsz) {
    if (need <= *cap) return p;
    int nc = *cap ? *cap * 2 : 16;
    while (nc < need)
        nc *= 2;
    void *q = realloc(p, (size_t)nc * elsz);
    if (!q) abort();
    *cap = nc;
    return q;
}

static void seq_push(seq *q, gelem e) {
    q->v = grow(q->v, &q->cap, q->n + 1, sizeof *q->v);
    q->v[q->n++] = e;
}

static int fail(parser *p, const char *fmt, const char *what) {
    if (!p->failed) {
        int line = 1, col = 1;
        for (const char *c = p->start; c < p->s && c < p->end; c++) {
            if (*c == '\n') {
                line++;
                col = 1;
            } else
                col++;
        }
        char msg[256];
        snprintf(msg, sizeof msg, fmt, what ? what : "");
        err_set(p->err, p->errlen, "grammar: %s at line %d column %d", msg, line, col);
    }
    p->failed = 1;
    return -EINVAL;
}

static int rule_id(gir *ir, const char *name, size_t n) {
    for (int i = 0; i < ir->n_rules; i++)
        if (strlen(ir->rules[i].name) == n && !memcmp(ir->rules[i].name, name, n)) return i;
    ir->rules = grow(ir->rules, &ir->cap_rules, ir->n_rules + 1, sizeof *ir->rules);
    grule *r = &ir->rules[ir->n_rules];
    memset(r, 0, sizeof *r);
    r->name = malloc(n + 1);
    if (!r->name) abort();
    memcpy(r->name, name, n);
    r->name[n] = 0;
    return ir->n_rules++;
}

static int new_rule(gir *ir, const char *base) {
    char name[96];
    snprintf(name, sizeof name, "%s_%d", base, ir->n_rules);
    int id = rule_id(ir, name, strlen(name));
    ir->rules[id].defined = 1;
    return id;
}

static void add_alt(gir *ir, int rule, const gelem *v, int n) {
    grule *r = &ir->rules[rule];
    r->alts = grow(r->alts, &r->cap_alts, r->n_alts + 1, sizeof *r->alts);
    r->alts[r->n_alts++] = ir->n_elems;
    ir->elems = grow(ir->elems, &ir->cap_elems, ir->n_elems + n + 1, sizeof *ir->elems);
    if (n) memcpy(ir->elems + ir->n_elems, v, (size_t)n * sizeof *v);
    ir->n_elems += n;
    ir->elems[ir->n_elems++] = (gelem){.kind = GE_END};
}

static gelem class1(gir *ir, uint32_t lo, uint32_t hi, int neg) {
    ir->ranges = grow(ir->ranges, &ir->cap_ranges, ir->n_ranges + 2, sizeof *ir->ranges);
    ir->ranges[ir->n_ranges] = lo;
    ir->ranges[ir->n_ranges + 1] = hi;
    gelem e = {.kind = GE_CLASS, .neg = (uint8_t)neg, .a = (uint32_t)ir->n_ranges, .n = 1};
    ir->n_ranges += 2;
    return e;
}

static void skip_ws(parser *p, int newlines) {
    while (p->s < p->end) {
        char c = *p->s;
        if (c == '#') {
            while (p->s < p->end && *p->s != '\n')
                p->s++;
        } else if (c == ' ' || c == '\t' || c == '\r' || (newlines && c == '\n'))
            p->s++;
        else
            break;
    }
}

static int is_name_char(char c) {
    return isalnum((unsigned char)c) || c == '_' || c == '-';
}

static size_t name_len(const char *s, const char *end) {
    size_t n = 0;
    while (s + n < end && is_name_char(s[n]))
        n++;
    return n;
}

/* Is the text at s `name ::=`? */
static int at_rule_start(const char *s, const char *end) {
    size_t n = name_len(s, end);
    if (!n || isdigit((unsigned char)s[0])) return 0;
    s += n;
    while (s < end && (*s == ' ' || *s == '\t'))
        s++;
    return end - s >= 3 && !memcmp(s, "::=", 3);
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* One (possibly escaped) character of a literal or class, as a code point. */
static int read_char(parser *p, uint32_t *cp) {
    if (p->s >= p->end) return fail(p, "unexpected end of input%s", NULL);
    unsigned char c = (unsigned char)*p->s;
    if (c == '\\') {
        p->s++;
        if (p->s >= p->end) return fail(p, "unexpected end after '\\'%s", NULL);
        char e = *p->s++;
        int nhex = 0;
        switch (e) {
        case 'n':
            *cp = '\n';
            return 0;
        case 't':
            *cp = '\t';
            return 0;
        case 'r':
            *cp = '\r';
            return 0;
        case 'f':
            *cp = '\f';
            return 0;
        case 'v':
            *cp = '\v';
            return 0;
        case 'a':
            *cp = '\a';
            return 0;
        case 'b':
            *cp = '\b';
            return 0;
        case '0':
            *cp = 0;
            return 0;
        case 'e':
            *cp = 27;
            return 0;
        case 'x':
            nhex = 2;
            break;
        case 'u':
            nhex = 4;
            break;
        case 'U':
            nhex = 8;
            break;
        default:
            *cp = (unsigned char)e;
            return 0;
        }
        uint32_t v = 0;
        for (int i = 0; i < nhex; i++) {
            int h = p->s < p->end ? hexval(*p->s) : -1;
            if (h < 0) return fail(p, "bad hex escape%s (\\xHH, \\uHHHH, \\UHHHHHHHH)", NULL);
            v = v * 16 + (uint32_t)h;
            p->s++;
        }
        if (v > 0x10FFFF) return fail(p, "code point beyond U+10FFFF%s", NULL);
        *cp = v;
        return 0;
    }
    /* UTF-8 */
    int n = c < 0x80 ? 0 : c < 0xE0 ? 1 : c < 0xF0 ? 2 : 3;
    uint32_t v = n == 0 ? c : n == 1 ? (c & 0x1Fu) : n == 2 ? (c & 0x0Fu) : (c & 0x07u);
    p->s++;
    for (int i = 0; i < n; i++) {
        if (p->s >= p->end || ((unsigned char)*p->s & 0xC0) != 0x80)
            return fail(p, "invalid UTF-8 in the grammar text%s", NULL);
        v = (v << 6) | ((unsigned char)*p->s & 0x3Fu);
        p->s++;
    }
    *cp = v;
    return 0;
}

static int parse_alts(parser *p, int rule);

/* Appends element e repeated per the postfix operator at p->s (if any) to q. */
static int apply_postfix(parser *p, seq *q, gelem e) {
    gir *ir = p->ir;
    if (p->s >= p->end) {
        seq_push(q, e);
        return 0;
    }
    char c = *p->s;
    long lo = 1, hi = 1; /* hi < 0: unbounded */
    if (c == '*')
        lo = 0, hi = -1, p->s++;
    else if (c == '+')
        lo = 1, hi = -1, p->s++;
    else if (c == '?')
        lo = 0, hi = 1, p->s++;
    else if (c == '{') {
        p->s++;
        skip_ws(p, 0);
        char *endp;
        lo = strtol(p->s, &endp, 10);
        if (endp == p->s) return fail(p, "expected a count after '{'%s", NULL);
        p->s = endp;
        skip_ws(p, 0);
        hi = lo;
        if (p->s < p->end && *p->s == ',') {
            p->s++;
            skip_ws(p, 0);
            if (p->s < p->end && *p->s == '}')
                hi = -1;
            else {
                hi = strtol(p->s, &endp, 10);
                if (endp == p->s) return fail(p, "expected a count after ','%s", NULL);
                p->s = endp;
                skip_ws(p, 0);
            }
        }
        if (p->s >= p->end || *p->s != '}') return fail(p, "expected '}'%s", NULL);
        p->s++;
        if (lo < 0 || (hi >= 0 && hi < lo) || lo > MAX_REPEAT || hi > MAX_REPEAT)
            return fail(p, "bad repetition count%s (accepted: 0 <= m <= n <= 10000)", NULL);
    }
    for (long i = 0; i < lo; i++)
        seq_push(q, e);
    if (hi < 0) { /* R ::= e R | "" */
        int r = new_rule(ir, "star");
        gelem body[2] = {e, {.kind = GE_REF, .a = (uint32_t)r}};
        add_alt(ir, r, body, 2);
        add_alt(ir, r, NULL, 0);
        seq_push(q, (gelem){.kind = GE_REF, .a = (uint32_t)r});
    } else if (hi > lo) { /* O_k ::= e O_{k-1} | "" */
        int prev = -1;
        for (long k = 0; k < hi - lo; k++) {
            int r = new_rule(ir, "opt");
            gelem body[2] = {e, {.kind = GE_REF, .a = (uint32_t)prev}};
            add_alt(ir, r, body, prev < 0 ? 1 : 2);
            add_alt(ir, r, NULL, 0);
            prev = r;
        }
        seq_push(q, (gelem){.kind = GE_REF, .a = (uint32_t)prev});
    }
    return 0;
}

static int parse_class(parser *p, gelem *out) {
    gir *ir = p->ir;
    p->s++; /* [ */
    int neg = 0;
    if (p->s < p->end && *p->s == '^') {
        neg = 1;
        p->s++;
    }
    int first = ir->n_ranges, n = 0;
    while (p->s < p->end && *p->s != ']') {
        uint32_t lo, hi;
        if (read_char(p, &lo)) return -EINVAL;
        hi = lo;
        if (p->s + 1 < p->end && *p->s == '-' && p->s[1] != ']') {
            p->s++;
            if (read_char(p, &hi)) return -EINVAL;
            if (hi < lo) return fail(p, "character range out of order%s", NULL);
        }
        ir->ranges = grow(ir->ranges, &ir->cap_ranges, ir->n_ranges + 2, sizeof *ir->ranges);
        ir->ranges[ir->n_ranges++] = lo;
        ir->ranges[ir->n_ranges++] = hi;
        n++;
    }
    if (p->s >= p->end) return fail(p, "unterminated character class%s", NULL);
    p->s++;
    *out = (gelem){.kind = GE_CLASS, .neg = (uint8_t)neg, .a = (uint32_t)first, .n = (uint32_t)n};
    return 0;
}

/* One sequence (an alternative) into q; stops at '|', ')', end or the next rule. */
static int parse_seq(parser *p, seq *q, int nested) {
    gir *ir = p->ir;
    for (;;) {
        skip_ws(p, 1);
        if (!nested && (p->s >= p->end || at_rule_start(p->s, p->end))) return 0;
        if (p->s >= p->end) return 0;
        char c = *p->s;
        if (c == '|' || c == ')') return 0;
        gelem e;
        if (c == '"' || c == '\'') {
            char qch = c;
            p->s++;
            seq lit = {0};
            while (p->s < p->end && *p->s != qch) {
                uint32_t cp;
                if (read_char(p, &cp)) {
                    free(lit.v);
                    return -EINVAL;
                }
                seq_push(&lit, class1(ir, cp, cp, 0));
            }
            if (p->s >= p->end) {
                free(lit.v);
                return fail(p, "unterminated string literal%s", NULL);
            }
            p->s++;
            int has_post = p->s < p->end && strchr("*+?{", *p->s);
            if (lit.n == 1)
                e = lit.v[0];
            else if (lit.n == 0 || has_post) {
                int r = new_rule(ir, "lit");
                add_alt(ir, r, lit.v, lit.n);
                e = (gelem){.kind = GE_REF, .a = (uint32_t)r};
            } else {
                for (int i = 0; i < lit.n; i++)
                    seq_push(q, lit.v[i]);
                free(lit.v);
                continue;
            }
            free(lit.v);
        } else if (c == '[') {
            if (parse_class(p, &e)) return -EINVAL;
        } else if (c == '.') {
            p->s++;
            e = class1(ir, 0, 0x10FFFF, 0); /* any character */
        } else if (c == '(') {
            p->s++;
            if (++p->depth > 200) return fail(p, "groups nested too deep%s", NULL);
            int r = new_rule(ir, "group");
            if (parse_alts(p, r)) return -EINVAL;
            p->depth--;
            skip_ws(p, 1);
            if (p->s >= p->end || *p->s != ')') return fail(p, "expected ')'%s", NULL);
            p->s++;
            e = (gelem){.kind = GE_REF, .a = (uint32_t)r};
        } else if (is_name_char(c)) {
            size_t n = name_len(p->s, p->end);
            e = (gelem){.kind = GE_REF, .a = (uint32_t)rule_id(ir, p->s, n)};
            p->s += n;
        } else {
            char what[8];
            snprintf(what, sizeof what, "'%c'", c);
            return fail(p, "unexpected %s", what);
        }
        if (apply_postfix(p, q, e)) return -EINVAL;
    }
}

static int parse_alts(parser *p, int rule) {
    int nested = p->depth > 0;
    for (;;) {
        seq q = {0};
        if (parse_seq(p, &q, nested)) {
            free(q.v);
            return -EINVAL;
        }
        add_alt(p->ir, rule, q.v, q.n);
        free(q.v);
        skip_ws(p, nested);
        if (p->s < p->end && *p->s == '|') {
            p->s++;
            continue;
        }
        if (!nested && p->s < p->end && *p->s == '\n') { /* '|' on the next line */
            const char *t = p->s;
            while (t < p->end && (*t == '\n' || *t == ' ' || *t == '\t' || *t == '\r'))
                t++;
            if (t < p->end && *t == '|') {
                p->s = t + 1;
                continue;
            }
        }
        return 0;
    }
}

void gir_free(gir *ir) {
    for (int i = 0; i < ir->n_rules; i++) {
        free(ir->rules[i].name);
        free(ir->rules[i].alts);
    }
    free(ir->rules);
    free(ir->elems);
    free(ir->ranges);
    memset(ir, 0, sizeof *ir);
}

/* Rules that can match the empty string. */
static void nullable_rules(const gir *ir, uint8_t *nul) {
    memset(nul, 0, (size_t)ir->n_rules);
    for (int changed = 1; changed;) {
        changed = 0;
        for (int r = 0; r < ir->n_rules; r++) {
            if (nul[r]) continue;
            for (int a = 0; a < ir->rules[r].n_alts && !nul[r]; a++) {
                int ok = 1;
                for (const gelem *e = ir->elems + ir->rules[r].alts[a]; e->kind != GE_END; e++)
                    if (e->kind == GE_CLASS || !nul[e->a]) {
                        ok = 0;
                        break;
                    }
                if (ok) nul[r] = 1, changed = 1;
            }
        }
    }
}

/* Left recursion (a rule reaching itself before consuming a byte) loops the matcher. */
static int left_recursive(const gir *ir, const uint8_t *nul, char *err, size_t errlen) {
    int n = ir->n_rules;
    uint8_t *adj = calloc((size_t)n * (size_t)n, 1);
    uint8_t *color = calloc((size_t)n, 1);
    int *stack = malloc(sizeof(int) * (size_t)n * 2);
    if (!adj || !color || !stack) abort();
    for (int r = 0; r < n; r++)
        for (int a = 0; a < ir->rules[r].n_alts; a++)
            for (const gelem *e = ir->elems + ir->rules[r].alts[a]; e->kind != GE_END; e++) {
                if (e->kind == GE_CLASS) break;
                adj[(size_t)r * (size_t)n + e->a] = 1;
                if (!nul[e->a]) break;
            }
    int bad = -1;
    for (int s = 0; s < n && bad < 0; s++) {
        if (color[s]) continue;
        int sp = 0;
        stack[sp++] = s;
        stack[sp++] = 0;
        color[s] = 1;
        while (sp && bad < 0) {
            int u = stack[sp - 2], *next = &stack[sp - 1];
            if (*next >= n) {
                color[u] = 2;
                sp -= 2;
                continue;
            }
            int v = (*next)++;
            if (!adj[(size_t)u * (size_t)n + v]) continue;
            if (color[v] == 1)
                bad = v;
            else if (!color[v]) {
                color[v] = 1;
                stack[sp++] = v;
                stack[sp++] = 0;
            }
        }
    }
    if (bad >= 0)
        err_set(err, errlen,
                "grammar: rule '%s' is left-recursive (reaches itself before any character; "
                "rewrite it right-recursively, or a repetition of something that may be empty)",
                ir->rules[bad].name);
    free(adj);
    free(color);
    free(stack);
    return bad >= 0 ? -EINVAL : 0;
}

int gir_parse(gir *ir, const char *text, size_t len, char *err, size_t errlen) {
    memset(ir, 0, sizeof *ir);
    parser p = {
        .ir = ir, .s = text, .end = text + len, .start = text, .err = err, .errlen = errlen};
    for (;;) {
        skip_ws(&p, 1);
        if (p.s >= p.end) break;
        size_t n = name_len(p.s, p.end);
        if (!n || !at_rule_start(p.s, p.end)) {
            fail(&p, "expected a rule 'name ::= ...'%s", NULL);
            goto bad;
        }
        int r = rule_id(ir, p.s, n);
        if (ir->rules[r].defined) {
            fail(&p, "rule '%s' is defined twice", ir->rules[r].name);
            goto bad;
        }
        ir->rules[r].defined = 1;
        p.s += n;
        skip_ws(&p, 0);
        p.s += 3; /* ::= */
        if (parse_alts(&p, r)) goto bad;
    }
    ir->root = -1;
    for (int i = 0; i < ir->n_rules; i++) {
        if (!ir->rules[i].defined) {
            err_set(err, errlen, "grammar: rule '%s' is used but not defined", ir->rules[i].name);
            goto bad;
        }
        if (!strcmp(ir->rules[i].name, "root")) ir->root = i;
    }
    if (ir->root < 0) {
        err_set(err, errlen, "grammar: no 'root' rule (the start rule is named root)");
        goto bad;
    }
    uint8_t *nul = malloc((size_t)ir->n_rules + 1);
    if (!nul) abort();
    nullable_rules(ir, nul);
    int rc = left_recursive(ir, nul, err, errlen);
    free(nul);
    if (rc) goto bad;
    return 0;
bad:
    gir_free(ir);
    return -EINVAL;
}

int gir_class_has(const gir *ir, const gelem *e, uint32_t cp) {
    const uint32_t *r = ir->ranges + e->a;
    int in = 0;
    for (uint32_t i = 0; i < e->n; i++)
        if (cp >= r[2 * i] && cp <= r[2 * i + 1]) {
            in = 1;
            break;
        }
    return in != e->neg;
}

int gir_class_meets(const gir *ir, const gelem *e, uint32_t lo, uint32_t hi) {
    const uint32_t *r = ir->ranges + e->a;
    if (!e->neg) {
        for (uint32_t i = 0; i < e->n; i++)
            if (r[2 * i] <= hi && r[2 * i + 1] >= lo) return 1;
        return 0;
    }
    /* negated: some point of [lo, hi] outside every range */
    uint32_t c = lo;
    for (int moved = 1; moved && c <= hi;) {
        moved = 0;
        for (uint32_t i = 0; i < e->n; i++)
            if (c >= r[2 * i] && c <= r[2 * i + 1]) {
                if (r[2 * i + 1] >= hi) return 0;
                c = r[2 * i + 1] + 1;
                moved = 1;
            }
    }
    return c <= hi;
}
