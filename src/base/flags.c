/* flags — see flags.h. */
#include "base/flags.h"

#include "base/bytesize.h"
#include "base/log.h"
#include "base/text.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LIST_MAX_DEFAULT 64
#define NAME_MAX_LEN     128

struct flags_parser {
    const flags_spec *s;
    int argc, i; /* argv[i] is the word being handled */
    char **argv;
    char spelled[NAME_MAX_LEN];
    int negated, inl;
    const char *env; /* the value comes from this environment variable */
};

/* ---- small helpers ----------------------------------------------------------------------- */

const char *flags_cmd(const flags_parser *p) {
    return p->s->cmd;
}
void *flags_arg(const flags_parser *p) {
    return p->s->arg;
}
const char *flags_spelled(const flags_parser *p) {
    return p->spelled;
}
int flags_negated(const flags_parser *p) {
    return p->negated;
}
int flags_inline(const flags_parser *p) {
    return p->inl;
}

const char *flags_peek(const flags_parser *p) {
    return p->i + 1 < p->argc ? p->argv[p->i + 1] : NULL;
}

const char *flags_take(flags_parser *p) {
    return p->i + 1 < p->argc ? p->argv[++p->i] : NULL;
}

static FILE *errf(const flags_parser *p) {
    return p->s->err ? p->s->err : stderr;
}

void flags_error(flags_parser *p, const char *fmt, ...) {
    FILE *f = errf(p);
    va_list ap;
    fprintf(f, "disagg %s: ", p->s->cmd);
    va_start(ap, fmt);
    vfprintf(f, fmt, ap);
    va_end(ap);
    fputc('\n', f);
}

int flags_one_of(const char *s, const char *const *words) {
    for (; words && *words; words++)
        if (!strcmp(s, *words)) return 1;
    return 0;
}

int flags_is_switch(const flag_def *d) {
    return d->type == FLAG_BOOL ||
           ((d->type == FLAG_CUSTOM || d->type == FLAG_NO_EFFECT) && (d->opts & FLAG_SWITCH));
}

/* What the message names: the flag, or the environment variable standing for it. */
static void who(const flags_parser *p, const flag_def *d, char *out, size_t cap) {
    if (p->env)
        snprintf(out, cap, "%s (for %s)", p->env, d->name);
    else
        snprintf(out, cap, "%s", d->name);
}

/* A range error: "FLAG 'V' is not accepted; accepted: KIND", or with a unit "FLAG expects UNIT,
 * KIND, got 'V'" (the environment variable named when the value came from it). */
static void range_error(flags_parser *p, const flag_def *d, const char *v, const char *kind) {
    if (d->unit) {
        char w[NAME_MAX_LEN + 64];
        who(p, d, w, sizeof w);
        flags_error(p, "%s expects %s, %s, got '%s'", w, d->unit, kind, v);
    } else if (p->env)
        flags_error(p, "%s='%s' (for %s) is not accepted; accepted: %s", p->env, v, d->name, kind);
    else
        flags_error(p, "%s '%s' is not accepted; accepted: %s", d->name, v, kind);
}

int flags_int(flags_parser *p, const flag_def *d, const char *v, long long *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < d->min || x > d->max) {
        char kind[96];
        snprintf(kind, sizeof kind, "an integer in [%lld, %lld]", d->min, d->max);
        range_error(p, d, v, kind);
        return -1;
    }
    *out = x;
    return 0;
}

int flags_double(flags_parser *p, const flag_def *d, const char *v, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    int lo_ok = (d->opts & FLAG_OPEN_LO) ? x > d->lo : x >= d->lo;
    if (errno || end == v || *end || isnan(x) || !lo_ok || x > d->hi) {
        char kind[96];
        snprintf(kind, sizeof kind, "a number in %c%g, %g]", (d->opts & FLAG_OPEN_LO) ? '(' : '[',
                 d->lo, d->hi);
        range_error(p, d, v, kind);
        return -1;
    }
    *out = x;
    return 0;
}

static void store_int(void *dst, size_t size, long long x) {
    switch (size) {
    case 1:
        *(int8_t *)dst = (int8_t)x;
        break;
    case 2:
        *(int16_t *)dst = (int16_t)x;
        break;
    case 4:
        *(int32_t *)dst = (int32_t)x;
        break;
    default:
        *(int64_t *)dst = (int64_t)x;
        break;
    }
}

void flag_list_free(flag_list *l) {
    json_decref(l->json);
    free(l->v);
    memset(l, 0, sizeof *l);
}

static const char *metavar_of(const flag_def *d) {
    if (d->metavar) return d->metavar;
    switch (d->type) {
    case FLAG_INT:
        return "N";
    case FLAG_DOUBLE:
        return "X";
    case FLAG_BYTES:
        return "BYTES";
    case FLAG_LIST:
        return "VALUE [VALUE ...]";
    case FLAG_JSON:
        return "JSON";
    default:
        return "VALUE";
    }
}

static void choices_text(const flag_def *d, char *out, size_t cap) {
    size_t n = 0;
    out[0] = 0;
    for (const char *const *c = d->choices; c && *c && n < cap; c++)
        n += (size_t)snprintf(out + n, cap - n, "%s%s", c == d->choices ? "" : ", ", *c);
}

/* ---- one value --------------------------------------------------------------------------- */

static int set_list(flags_parser *p, const flag_def *d, const char *v) {
    flag_list *l = d->dst;
    int most = d->hi > 0 ? (int)d->hi : LIST_MAX_DEFAULT;
    flag_list_free(l);
    l->v = calloc((size_t)most, sizeof *l->v);
    if (!l->v) {
        flags_error(p, "%s: out of memory", d->name);
        return -1;
    }
    if (v[0] == '[') { /* a JSON list (a --config file's YAML list) is the whole list */
        json_t *j = json_loads(v, 0, NULL), *x;
        size_t k;
        int ok = json_is_array(j) && json_array_size(j) > 0 && json_array_size(j) <= (size_t)most;
        if (ok) json_array_foreach(j, k, x) ok &= json_is_string(x);
        if (!ok) {
            json_decref(j);
            flags_error(p, "%s '%s': a list must be a non-empty JSON list of at most %d strings",
                        d->name, v, most);
            return -1;
        }
        l->json = j;
        json_array_foreach(j, k, x) l->v[l->n++] = json_string_value(x);
    } else {
        l->v[l->n++] = v;
        const char *w;
        while (!p->inl && !p->env && (w = flags_peek(p)) && w[0] != '-') {
            if (l->n == most) {
                flags_error(p, "%s: at most %d %ss, got '%s' too", d->name, most,
                            d->unit ? d->unit : "value", w);
                return -1;
            }
            l->v[l->n++] = flags_take(p);
        }
    }
    for (int k = 0; k < l->n; k++)
        if (!*l->v[k]) {
            flags_error(p, "%s: a %s is empty; accepted: non-empty words", d->name,
                        d->unit ? d->unit : "value");
            return -1;
        }
    return 0;
}

static int set_json(flags_parser *p, const flag_def *d, const char *v) {
    json_error_t je;
    json_t *j = json_loads(v, JSON_DECODE_ANY, &je), *x;
    int ok = j != NULL;
    if (ok && d->json_type >= 0) ok = (int)json_typeof(j) == d->json_type;
    if (ok && (d->opts & FLAG_STRINGS)) {
        size_t k;
        ok = json_is_array(j);
        if (ok) json_array_foreach(j, k, x) ok &= json_is_string(x);
    }
    if (!ok) {
        const char *kind = (d->opts & FLAG_STRINGS)     ? "a JSON list of strings such as '[\"*\"]'"
                           : d->json_type == JSON_ARRAY ? "a JSON list"
                           : d->json_type == JSON_OBJECT ? "a JSON object such as '{\"key\": 1}'"
                                                         : "JSON text";
        char w[NAME_MAX_LEN + 64];
        who(p, d, w, sizeof w);
        if (!j)
            flags_error(p, "%s expects %s, got '%s' (line %d column %d: %s)", w, kind, v, je.line,
                        je.column, je.text);
        else
            flags_error(p, "%s expects %s, got '%s' (%s)", w, kind, v, text_json_kind(j));
        json_decref(j);
        return -1;
    }
    if (d->dst) {
        json_decref(*(json_t **)d->dst);
        *(json_t **)d->dst = j;
    } else
        json_decref(j);
    return 0;
}

/* Applies row d with value v (NULL for a switch). */
static int apply(flags_parser *p, const flag_def *d, const char *v) {
    long long x;
    double f;
    char w[NAME_MAX_LEN + 64];
    switch (d->type) {
    case FLAG_BOOL:
        if (p->env) { /* an environment switch: an integer, 0 off (as vLLM reads its envs) */
            char *end;
            errno = 0;
            long e = strtol(v, &end, 10);
            if (end == v || *end || errno) {
                flags_error(p,
                            "%s='%s' is not an integer (accepted: 0 = off, 1 = on, as vLLM reads "
                            "it; or %s%s%s)",
                            p->env, v, d->name, (d->opts & FLAG_NEGATABLE) ? " / --no-" : "",
                            (d->opts & FLAG_NEGATABLE) ? d->name + 2 : "");
                return -1;
            }
            store_int(d->dst, d->dst_size, (e != 0) ^ !!(d->opts & FLAG_STORE_FALSE));
        } else if (d->dst)
            store_int(d->dst, d->dst_size, !p->negated ^ !!(d->opts & FLAG_STORE_FALSE));
        break;
    case FLAG_INT:
        if (flags_int(p, d, v, &x)) return -1;
        if (d->dst) store_int(d->dst, d->dst_size, x);
        break;
    case FLAG_DOUBLE:
        if (flags_double(p, d, v, &f)) return -1;
        if (d->dst) *(double *)d->dst = f;
        break;
    case FLAG_STRING:
        if (d->dst) *(const char **)d->dst = v;
        break;
    case FLAG_BYTES: {
        char err[512];
        uint64_t b;
        who(p, d, w, sizeof w);
        char what[NAME_MAX_LEN + 96];
        snprintf(what, sizeof what, "disagg %s: %s", p->s->cmd, w);
        if (bytesize_parse_range(what, v, (uint64_t)d->lo, (uint64_t)d->hi, &b, err, sizeof err)) {
            fprintf(errf(p), "%s\n", err);
            return -1;
        }
        if (d->dst) store_int(d->dst, d->dst_size, (long long)b);
        break;
    }
    case FLAG_CHOICE: {
        int k = 0;
        while (d->choices[k] && strcmp(d->choices[k], v))
            k++;
        if (!d->choices[k]) {
            char acc[512];
            choices_text(d, acc, sizeof acc);
            who(p, d, w, sizeof w);
            flags_error(p, "%s '%s' is not accepted; accepted: %s", w, v, acc);
            return -1;
        }
        if (d->dst) *(int *)d->dst = k;
        break;
    }
    case FLAG_LIST:
        if (set_list(p, d, v)) return -1;
        break;
    case FLAG_JSON:
        if (set_json(p, d, v)) return -1;
        break;
    case FLAG_CUSTOM:
        return d->fn ? d->fn(p, d, v) : 0;
    case FLAG_NO_EFFECT:
        LOG_I(p->s->cmd, "%s%s%s: accepted, no effect (%s)", p->spelled, v ? " " : "", v ? v : "",
              d->why ? d->why : "disagg has no counterpart");
        return 0;
    case FLAG_REFUSED:
        flags_error(p, "%s: %s (see disagg %s --help)", p->spelled, d->why, p->s->cmd);
        return -1;
    default:
        return 0;
    }
    return d->fn ? d->fn(p, d, v) : 0;
}

/* ---- lookup ------------------------------------------------------------------------------ */

static int spelled_as(const char *flag, const char *name, const char *aliases) {
    if (name && !strcmp(flag, name)) return 1;
    size_t fl = strlen(flag);
    for (const char *a = aliases; a && *a;) {
        while (*a == ' ')
            a++;
        size_t n = strcspn(a, " ");
        if (n && n == fl && !strncmp(a, flag, n)) return 1;
        a += n;
    }
    return 0;
}

const flag_def *flags_find(const flags_spec *s, const char *flag, int *negated) {
    char norm[NAME_MAX_LEN];
    snprintf(norm, sizeof norm, "%s", flag);
    if (s->underscores)
        for (char *c = norm; *c; c++)
            if (*c == '_') *c = '-';
    if (negated) *negated = 0;
    for (const flag_def *const *t = s->tables; t && *t; t++)
        for (const flag_def *d = *t; d->type != FLAG_END; d++)
            if (d->type != FLAG_TEXT && spelled_as(norm, d->name, d->aliases)) return d;
    if (!strncmp(norm, "--no-", 5)) {
        char pos[NAME_MAX_LEN + 2];
        snprintf(pos, sizeof pos, "--%s", norm + 5);
        for (const flag_def *const *t = s->tables; t && *t; t++)
            for (const flag_def *d = *t; d->type != FLAG_END; d++)
                if ((d->opts & FLAG_NEGATABLE) && d->name && !strcmp(pos, d->name)) {
                    if (negated) *negated = 1;
                    return d;
                }
    }
    return NULL;
}

static void consider(const char *f, const char *cand, const char *show, const char **best,
                     int *bd) {
    int d;
    if (text_close_name(f, cand, &d) && d < *bd) *bd = d, *best = show;
}

static void unknown(flags_parser *p, const char *f) {
    const char *best = NULL;
    int bd = INT_MAX;
    for (const flag_def *const *t = p->s->tables; t && *t; t++)
        for (const flag_def *d = *t; d->type != FLAG_END; d++) {
            if (!d->name) continue;
            consider(f, d->name, d->name, &best, &bd);
            if (d->opts & FLAG_NEGATABLE) {
                char no[NAME_MAX_LEN + 4];
                snprintf(no, sizeof no, "--no-%s", d->name + 2);
                consider(f, no, d->name, &best, &bd);
            }
        }
    FILE *e = errf(p);
    fprintf(e, "disagg %s: unknown option '%s'", p->s->cmd, f);
    if (best) fprintf(e, "; did you mean %s?", best);
    if (p->s->list_on_unknown) {
        int k = 0;
        fprintf(e, "; accepted:");
        for (const flag_def *const *t = p->s->tables; t && *t; t++)
            for (const flag_def *d = *t; d->type != FLAG_END; d++)
                if (d->name && !(d->opts & FLAG_HIDDEN) && d->type != FLAG_REFUSED)
                    fprintf(e, "%s %s", k++ ? "," : "", d->name);
    }
    fprintf(e, " (see disagg %s --help)\n", p->s->cmd);
}

/* ---- the parse --------------------------------------------------------------------------- */

static int apply_env(flags_parser *p) {
    for (const flag_def *const *t = p->s->tables; t && *t; t++)
        for (const flag_def *d = *t; d->type != FLAG_END; d++) {
            const char *v = d->env ? getenv(d->env) : NULL;
            if (!v || !*v) continue;
            p->env = d->env;
            snprintf(p->spelled, sizeof p->spelled, "%s", d->name);
            p->negated = 0;
            int rc = apply(p, d, v);
            p->env = NULL;
            if (rc) return -1;
        }
    return 0;
}

int flags_parse(const flags_spec *s, int argc, char **argv) {
    flags_parser p = {.s = s, .argc = argc, .argv = argv};
    for (int i = 1; i < argc; i++) /* --help first: it wins over any error */
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            flags_help(s, stdout);
            return FLAGS_HELP;
        } else if (!strcmp(argv[i], "--"))
            break;
    if (apply_env(&p)) return -1;
    int rest = 0; /* after "--" */
    for (p.i = 1; p.i < argc; p.i++) {
        const char *a = argv[p.i];
        if (!rest && !strcmp(a, "--")) {
            rest = 1;
            continue;
        }
        if (rest || a[0] != '-' || a[1] == 0) {
            if (s->positional ? s->positional(&p, a)
                              : (flags_error(&p,
                                             "unexpected argument '%s' "
                                             "(see disagg %s --help)",
                                             a, s->cmd),
                                 -1))
                return -1;
            continue;
        }
        const char *eq = strchr(a, '=');
        size_t fl = eq ? (size_t)(eq - a) : strlen(a);
        if (fl >= sizeof p.spelled) fl = sizeof p.spelled - 1;
        memcpy(p.spelled, a, fl);
        p.spelled[fl] = 0;
        if (s->underscores)
            for (char *c = p.spelled; *c; c++)
                if (*c == '_') *c = '-';
        const flag_def *d = flags_find(s, p.spelled, &p.negated);
        if (!d) {
            unknown(&p, p.spelled);
            return -1;
        }
        p.inl = eq != NULL;
        const char *v = NULL;
        if (d->type == FLAG_REFUSED) {
            /* refused by name, whatever follows */
        } else if (d->type == FLAG_CUSTOM && (d->opts & FLAG_VARARGS)) {
            v = eq ? eq + 1 : NULL;
        } else if (flags_is_switch(d) || p.negated) {
            if (eq) {
                flags_error(&p, "%s takes no value (got '%s')", p.spelled, eq + 1);
                return -1;
            }
        } else if (eq)
            v = eq + 1;
        else if (p.i + 1 < argc)
            v = argv[++p.i];
        else {
            flags_error(&p, "%s needs a value (see disagg %s --help)", p.spelled, s->cmd);
            return -1;
        }
        if (apply(&p, d, v)) return -1;
    }
    return 0;
}

/* ---- help -------------------------------------------------------------------------------- */

static void synopsis(const flag_def *d, char *out, size_t cap) {
    if (d->synopsis) {
        snprintf(out, cap, "%s", d->synopsis);
        return;
    }
    size_t n = 0;
    out[0] = 0;
    for (const char *a = d->aliases; a && *a && n < cap;) { /* short spellings first */
        while (*a == ' ')
            a++;
        size_t k = strcspn(a, " ");
        if (k) n += (size_t)snprintf(out + n, cap - n, "%.*s, ", (int)k, a);
        a += k;
    }
    if (n >= cap) return;
    n += (size_t)snprintf(out + n, cap - n, "%s", d->name);
    if (n >= cap) return;
    if ((d->opts & FLAG_NEGATABLE) && n < cap)
        n += (size_t)snprintf(out + n, cap - n, ", --no-%s", d->name + 2);
    if (!flags_is_switch(d) &&
        !(d->type == FLAG_CUSTOM && (d->opts & FLAG_VARARGS) && !d->metavar) && n < cap)
        snprintf(out + n, cap - n, " %s", metavar_of(d));
}

/* Prints text wrapped at width, each line after the first indented to col. */
static void wrapped(FILE *f, const char *text, int col, int at, int width) {
    const char *t = text;
    while (*t) {
        /* one line: up to '\n', or the last space that fits */
        size_t room = width > at + 20 ? (size_t)(width - at) : 20;
        size_t nl = strcspn(t, "\n");
        size_t n = nl;
        if (n > room) {
            n = room;
            while (n > 0 && t[n] != ' ')
                n--;
            if (n == 0) { /* one long word: up to the next space */
                n = strcspn(t, " \n");
            }
        }
        fprintf(f, "%.*s\n", (int)n, t);
        t += n;
        if (*t == '\n' || *t == ' ') t++;
        if (*t) fprintf(f, "%*s", col, "");
        at = col;
    }
}

void flags_help(const flags_spec *s, FILE *f) {
    enum { WIDTH = 100 };
    int col = s->help_col > 0 ? s->help_col : 30;
    if (s->usage) fputs(s->usage, f);
    for (const flag_def *const *t = s->tables; t && *t; t++)
        for (const flag_def *d = *t; d->type != FLAG_END; d++) {
            if ((d->opts & FLAG_HIDDEN) || d->type == FLAG_REFUSED) continue;
            if (!d->name && !d->synopsis) continue;
            char syn[256];
            synopsis(d, syn, sizeof syn);
            int at = fprintf(f, "  %s", syn);
            if (!d->help || !*d->help) {
                fputc('\n', f);
                continue;
            }
            if (at + 2 <= col)
                at += fprintf(f, "%*s", col - at, "");
            else
                at += fprintf(f, "  ");
            wrapped(f, d->help, col, at, WIDTH);
        }
    if (s->epilog) fputs(s->epilog, f);
}
