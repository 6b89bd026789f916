/*
 * json_schema — a JSON Schema as GBNF text, the subset vLLM's xgrammar backend accepts:
 * type (also a list), enum, const, anyOf/oneOf, allOf of one schema, $ref to #, #/$defs/..
 * and #/definitions/.. (recursion allowed), object properties / required /
 * additionalProperties (unspecified = false, xgrammar's strict mode), array items /
 * prefixItems / minItems / maxItems, string minLength / maxLength / pattern / format
 * (date, time, date-time, uuid, ipv4, email; others are plain strings), integer minimum /
 * maximum / exclusiveMinimum / exclusiveMaximum.  Properties come in the schema's order,
 * as xgrammar writes them.  Keywords that restrict values in ways a grammar cannot
 * (not, if/then/else, uniqueItems, multipleOf, patternProperties, ...) are refused by
 * name.
 */
#include "base/err.h"
#include "grammar/grammar_ir.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_REFS 256

typedef struct conv {
    sb out;
    json_t *root;
    int any_ws;
    int n;
    int depth;
    char *refs[MAX_REFS];
    char *ref_rule[MAX_REFS];
    int n_refs;
    char *err;
    size_t errlen;
    int failed;
} conv;

static const char *WS_ANY = "[ \\n\\r\\t]*";

static int cfail(conv *c, const char *fmt, const char *a) {
    if (!c->failed) {
        char msg[300];
        snprintf(msg, sizeof msg, fmt, a ? a : "");
        err_set(c->err, c->errlen, "json_schema: %s", msg);
    }
    c->failed = 1;
    return -EINVAL;
}

static void new_name(conv *c, char *name, size_t cap) {
    snprintf(name, cap, "s%d", c->n++);
}

/* sep strings */
static const char *comma(conv *c) {
    return c->any_ws ? "ws \",\" ws" : "\", \"";
}
static const char *colon(conv *c) {
    return c->any_ws ? "ws \":\" ws" : "\": \"";
}
static const char *ows(conv *c) {
    return c->any_ws ? "ws" : "";
}

/* The compact JSON text of v as a GBNF literal. */
static void lit_json(sb *b, json_t *v) {
    char *s = json_dumps(v, JSON_ENCODE_ANY | JSON_COMPACT);
    gir_sb_puts(b, "\"");
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p >= 0x80)
            gir_sb_add(b, (const char *)p, 1);
        else
            gir_esc_byte(b, *p);
    gir_sb_puts(b, "\"");
    free(s);
}

static int gen(conv *c, json_t *s, char *name, size_t cap);

/* ---- integers in a range ---- */

/* [a, b], equal-length digit strings, as GBNF into b. */
static void digits_range(sb *o, const char *a, const char *b, int n) {
    if (n == 0) return;
    if (n == 1) {
        gir_sb_printf(o, "[%c-%c]", a[0], b[0]);
        return;
    }
    if (a[0] == b[0]) {
        gir_sb_printf(o, "\"%c\" ", a[0]);
        digits_range(o, a + 1, b + 1, n - 1);
        return;
    }
    char nines[24], zeros[24];
    memset(nines, '9', (size_t)n - 1);
    memset(zeros, '0', (size_t)n - 1);
    gir_sb_puts(o, "(");
    gir_sb_printf(o, "\"%c\" (", a[0]);
    digits_range(o, a + 1, nines, n - 1);
    gir_sb_puts(o, ")");
    if (a[0] + 1 <= b[0] - 1) gir_sb_printf(o, " | [%c-%c] [0-9]{%d}", a[0] + 1, b[0] - 1, n - 1);
    gir_sb_printf(o, " | \"%c\" (", b[0]);
    digits_range(o, zeros, b + 1, n - 1);
    gir_sb_puts(o, "))");
}

/* Non-negative integers in [lo, hi] (hi < 0: unbounded) as alternatives. */
static void nonneg_range(sb *o, long long lo, long long hi) {
    int first = 1;
    char a[24], b[24];
    for (int len = 1; len <= 19; len++) {
        long long pmin = len == 1 ? 0 : 1, pmax = 9;
        for (int k = 1; k < len; k++)
            pmin *= 10, pmax = pmax * 10 + 9;
        long long x = lo > pmin ? lo : pmin, y = hi >= 0 && hi < pmax ? hi : pmax;
        if (hi >= 0 && x > hi) break;
        if (x > y) continue;
        if (hi < 0 && x == pmin && len > 1) { /* everything from here up */
            gir_sb_printf(o, "%s[1-9] [0-9]{%d,}", first ? "" : " | ", len - 1);
            first = 0;
            break;
        }
        snprintf(a, sizeof a, "%lld", x);
        snprintf(b, sizeof b, "%lld", y);
        gir_sb_puts(o, first ? "(" : " | (");
        digits_range(o, a, b, len);
        gir_sb_puts(o, ")");
        first = 0;
        if (hi < 0 && len == 19) break;
    }
    if (first) gir_sb_puts(o, "[0-9]"); /* unreachable for lo <= hi */
}

static void int_range(sb *o, int has_lo, long long lo, int has_hi, long long hi) {
    gir_sb_puts(o, "(");
    int any = 0;
    /* negatives: -n with n in [max(1, -hi), -lo] */
    if (!has_lo || lo < 0) {
        long long nlo = has_hi && hi < 0 ? -hi : 1, nhi = has_lo ? -lo : -1;
        gir_sb_puts(o, "\"-\" (");
        nonneg_range(o, nlo, nhi);
        gir_sb_puts(o, ")");
        any = 1;
    }
    if (!has_hi || hi >= 0) {
        if (any) gir_sb_puts(o, " | ");
        nonneg_range(o, has_lo && lo > 0 ? lo : 0, has_hi ? hi : -1);
    }
    gir_sb_puts(o, ")");
}

/* ---- strings ---- */

static const char *format_gbnf(const char *f) {
    static const char date[] =
        "[0-9]{4} \"-\" (\"0\" [1-9] | \"1\" [0-2]) \"-\" (\"0\" [1-9] | [12] [0-9] | \"3\" [01])";
    static const char time[] =
        "([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9] \":\" ([0-5] [0-9] | \"60\") (\".\" [0-9]+)? "
        "(\"Z\" | [+\\-] ([01] [0-9] | \"2\" [0-3]) \":\" [0-5] [0-9])";
    static char datetime[512];
    if (!strcmp(f, "date")) return date;
    if (!strcmp(f, "time")) return time;
    if (!strcmp(f, "date-time")) {
        snprintf(datetime, sizeof datetime, "%s \"T\" %s", date, time);
        return datetime;
    }
    if (!strcmp(f, "uuid"))
        return "[0-9a-fA-F]{8} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} \"-\" [0-9a-fA-F]{4} "
               "\"-\" "
               "[0-9a-fA-F]{12}";
    if (!strcmp(f, "ipv4"))
        return "(\"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | [0-9]) "
               "(\".\" (\"25\" [0-5] | \"2\" [0-4] [0-9] | \"1\" [0-9] [0-9] | [1-9] [0-9] | "
               "[0-9])){3}";
    if (!strcmp(f, "email"))
        return "[a-zA-Z0-9_%+\\-]+ (\".\" [a-zA-Z0-9_%+\\-]+)* \"@\" [a-zA-Z0-9\\-]+ (\".\" "
               "[a-zA-Z0-9\\-]+)* \".\" [a-zA-Z]{2,}";
    return NULL;
}

static int gen_string(conv *c, json_t *s, const char *name) {
    sb *o = &c->out;
    json_t *fmt = json_object_get(s, "format"), *pat = json_object_get(s, "pattern");
    json_t *mn = json_object_get(s, "minLength"), *mx = json_object_get(s, "maxLength");
    if (pat) {
        if (!json_is_string(pat)) return cfail(c, "'pattern' must be a string%s", NULL);
        char *g = regex_to_gbnf(json_string_value(pat), json_string_length(pat), c->err, c->errlen);
        if (!g) {
            c->failed = 1;
            return -EINVAL;
        }
        /* "root ::= (...)\n" -> our own rule */
        gir_sb_printf(o, "%s-pat ::= %s", name, g + strlen("root ::= "));
        free(g);
        gir_sb_printf(o, "%s ::= \"\\\"\" %s-pat \"\\\"\"\n", name, name);
        return 0;
    }
    if (fmt && json_is_string(fmt) && format_gbnf(json_string_value(fmt))) {
        gir_sb_printf(o, "%s ::= \"\\\"\" %s \"\\\"\"\n", name,
                      format_gbnf(json_string_value(fmt)));
        return 0;
    }
    if (mn || mx) {
        long long lo = mn ? json_integer_value(mn) : 0, hi = mx ? json_integer_value(mx) : -1;
        if ((mn && (!json_is_integer(mn) || lo < 0)) || (mx && (!json_is_integer(mx) || hi < 0)))
            return cfail(c, "minLength/maxLength must be non-negative integers%s", NULL);
        if (mx && hi < lo) return cfail(c, "maxLength is below minLength%s", NULL);
        if (lo > 10000 || hi > 10000)
            return cfail(c, "minLength/maxLength above 10000 are not supported%s", NULL);
        if (mx)
            gir_sb_printf(o, "%s ::= \"\\\"\" json-char{%lld,%lld} \"\\\"\"\n", name, lo, hi);
        else
            gir_sb_printf(o, "%s ::= \"\\\"\" json-char{%lld,} \"\\\"\"\n", name, lo);
        return 0;
    }
    gir_sb_printf(o, "%s ::= json-string\n", name);
    return 0;
}

/* ---- objects and arrays ---- */

static int gen_object(conv *c, json_t *s, const char *name) {
    json_t *props = json_object_get(s, "properties"), *req = json_object_get(s, "required");
    json_t *addl = json_object_get(s, "additionalProperties");
    if (props && !json_is_object(props)) return cfail(c, "'properties' must be an object%s", NULL);
    if (req && !json_is_array(req)) return cfail(c, "'required' must be a list of names%s", NULL);
    size_t np = props ? json_object_size(props) : 0;
    char(*pn)[32] = calloc(np + 1, sizeof *pn);
    const char **keys = calloc(np + 1, sizeof *keys);
    int *required = calloc(np + 1, sizeof *required);
    if (!pn || !keys || !required) abort();
    size_t k = 0;
    const char *key;
    json_t *sub;
    int rc = 0;
    json_object_foreach(props, key, sub) {
        keys[k] = key;
        for (size_t r = 0; req && r < json_array_size(req); r++)
            if (json_is_string(json_array_get(req, r)) &&
                !strcmp(json_string_value(json_array_get(req, r)), key))
                required[k] = 1;
        if ((rc = gen(c, sub, pn[k], sizeof pn[k]))) goto out;
        k++;
    }
    for (size_t r = 0; req && r < json_array_size(req); r++) {
        json_t *rn = json_array_get(req, r);
        if (!json_is_string(rn) || !props || !json_object_get(props, json_string_value(rn))) {
            if (json_is_string(rn) && (!addl || json_is_false(addl))) {
                rc = cfail(c,
                           "required property '%s' is not in 'properties' (and "
                           "additionalProperties is not allowed)",
                           json_string_value(rn));
                goto out;
            }
        }
    }
    /* additional properties: false (or unspecified: strict) / true / a schema */
    char aname[32] = "";
    if (addl && !json_is_false(addl)) {
        if (json_is_true(addl) || (json_is_object(addl) && json_object_size(addl) == 0))
            snprintf(aname, sizeof aname, "json-value");
        else if ((rc = gen(c, addl, aname, sizeof aname)))
            goto out;
    }
    sb *o = &c->out;
    /* name-p<i>-<c>: the properties from i on, c = 1 when one was written before */
    for (size_t i = np + 1; i-- > 0;) {
        for (int had = 0; had < 2; had++) {
            gir_sb_printf(o, "%s-p%zu-%d ::= ", name, i, had);
            if (i == np) {
                if (aname[0])
                    gir_sb_printf(o, "\"\" | %s json-string %s %s %s-p%zu-1\n", had ? comma(c) : "",
                                  colon(c), aname, name, np);
                else
                    gir_sb_puts(o, "\"\"\n");
                continue;
            }
            gir_sb_printf(o, "%s ", had ? comma(c) : "");
            json_t *ks = json_string(keys[i]);
            lit_json(o, ks);
            json_decref(ks);
            gir_sb_printf(o, " %s %s %s-p%zu-1", colon(c), pn[i], name, i + 1);
            if (!required[i]) gir_sb_printf(o, " | %s-p%zu-%d", name, i + 1, had);
            gir_sb_puts(o, "\n");
        }
    }
    gir_sb_printf(o, "%s ::= \"{\" %s %s-p0-0 %s \"}\"\n", name, ows(c), name, ows(c));
out:
    free(pn);
    free(keys);
    free(required);
    return rc;
}

static int gen_array(conv *c, json_t *s, const char *name) {
    json_t *items = json_object_get(s, "items"), *prefix = json_object_get(s, "prefixItems");
    json_t *mn = json_object_get(s, "minItems"), *mx = json_object_get(s, "maxItems");
    long long lo = mn ? json_integer_value(mn) : 0, hi = mx ? json_integer_value(mx) : -1;
    if ((mn && (!json_is_integer(mn) || lo < 0)) || (mx && (!json_is_integer(mx) || hi < 0)))
        return cfail(c, "minItems/maxItems must be non-negative integers%s", NULL);
    if (mx && hi < lo) return cfail(c, "maxItems is below minItems%s", NULL);
    if (lo > 1000 || hi > 1000)
        return cfail(c, "minItems/maxItems above 1000 are not supported%s", NULL);
    char iname[32];
    if (items && json_is_false(items)) {
        if (!prefix) hi = 0;
        snprintf(iname, sizeof iname, "json-value");
    } else if (!items || json_is_true(items))
        snprintf(iname, sizeof iname, "json-value");
    else if (gen(c, items, iname, sizeof iname))
        return -EINVAL;
    sb *o = &c->out;
    if (prefix) {
        if (!json_is_array(prefix))
            return cfail(c, "'prefixItems' must be a list of schemas%s", NULL);
        size_t n = json_array_size(prefix);
        char(*pn)[32] = calloc(n + 1, sizeof *pn);
        if (!pn) abort();
        for (size_t i = 0; i < n; i++)
            if (gen(c, json_array_get(prefix, i), pn[i], sizeof pn[i])) {
                free(pn);
                return -EINVAL;
            }
        /* a prefix of the prefixItems (none required), then more items if allowed:
         * "[" (p0 ("," p1 ("," ... ("," item)*)?)?)? "]" */
        gir_sb_printf(o, "%s ::= \"[\" %s ", name, ows(c));
        for (size_t i = 0; i < n; i++)
            gir_sb_printf(o, "(%s %s ", i ? comma(c) : "", pn[i]);
        if (!(items && json_is_false(items))) gir_sb_printf(o, "(%s %s)* ", comma(c), iname);
        for (size_t i = 0; i < n; i++)
            gir_sb_puts(o, ")? ");
        gir_sb_printf(o, "%s \"]\"\n", ows(c));
        free(pn);
        return 0;
    }
    gir_sb_printf(o, "%s ::= \"[\" %s ", name, ows(c));
    if (hi == 0) {
        gir_sb_printf(o, "\"]\"\n");
        return 0;
    }
    if (lo == 0) gir_sb_puts(o, "(");
    gir_sb_printf(o, "%s (%s %s)", iname, comma(c), iname);
    long long rlo = lo > 0 ? lo - 1 : 0;
    if (hi < 0)
        gir_sb_printf(o, "{%lld,}", rlo);
    else
        gir_sb_printf(o, "{%lld,%lld}", rlo, hi - 1);
    if (lo == 0) gir_sb_puts(o, ")?");
    gir_sb_printf(o, " %s \"]\"\n", ows(c));
    return 0;
}

static int gen_ref(conv *c, const char *ref, char *name, size_t cap) {
    for (int i = 0; i < c->n_refs; i++)
        if (!strcmp(c->refs[i], ref)) {
            snprintf(name, cap, "%s", c->ref_rule[i]);
            return 0;
        }
    json_t *t = NULL;
    if (!strcmp(ref, "#"))
        t = c->root;
    else if (!strncmp(ref, "#/$defs/", 8))
        t = json_object_get(json_object_get(c->root, "$defs"), ref + 8);
    else if (!strncmp(ref, "#/definitions/", 14))
        t = json_object_get(json_object_get(c->root, "definitions"), ref + 14);
    else
        return cfail(
            c, "$ref '%s' is not supported (accepted: #, #/$defs/NAME, #/definitions/NAME)", ref);
    if (!t) return cfail(c, "$ref '%s' points to nothing", ref);
    if (c->n_refs == MAX_REFS) return cfail(c, "too many $refs%s", NULL);
    char rn[32];
    new_name(c, rn, sizeof rn);
    c->refs[c->n_refs] = strdup(ref);
    c->ref_rule[c->n_refs] = strdup(rn);
    c->n_refs++;
    snprintf(name, cap, "%s", rn);
    char inner[32];
    if (gen(c, t, inner, sizeof inner)) return -EINVAL;
    gir_sb_printf(&c->out, "%s ::= %s\n", rn, inner);
    return 0;
}

static const char *const unsupported[] = {"not",
                                          "if",
                                          "then",
                                          "else",
                                          "uniqueItems",
                                          "multipleOf",
                                          "patternProperties",
                                          "propertyNames",
                                          "dependentRequired",
                                          "dependentSchemas",
                                          "contains",
                                          "minProperties",
                                          "maxProperties",
                                          "unevaluatedProperties",
                                          "unevaluatedItems",
                                          NULL};

static int gen_type(conv *c, json_t *s, const char *t, const char *name) {
    sb *o = &c->out;
    if (!strcmp(t, "string")) return gen_string(c, s, name);
    if (!strcmp(t, "boolean")) {
        gir_sb_printf(o, "%s ::= \"true\" | \"false\"\n", name);
        return 0;
    }
    if (!strcmp(t, "null")) {
        gir_sb_printf(o, "%s ::= \"null\"\n", name);
        return 0;
    }
    if (!strcmp(t, "integer")) {
        json_t *mn = json_object_get(s, "minimum"), *mx = json_object_get(s, "maximum");
        json_t *xmn = json_object_get(s, "exclusiveMinimum"),
               *xmx = json_object_get(s, "exclusiveMaximum");
        int has_lo = 0, has_hi = 0;
        long long lo = 0, hi = 0;
        if (mn && json_is_number(mn)) has_lo = 1, lo = (long long)ceil(json_number_value(mn));
        if (xmn && json_is_number(xmn)) {
            long long v = (long long)floor(json_number_value(xmn)) + 1;
            if (!has_lo || v > lo) lo = v;
            has_lo = 1;
        }
        if (mx && json_is_number(mx)) has_hi = 1, hi = (long long)floor(json_number_value(mx));
        if (xmx && json_is_number(xmx)) {
            long long v = (long long)ceil(json_number_value(xmx)) - 1;
            if (!has_hi || v < hi) hi = v;
            has_hi = 1;
        }
        if (has_lo && has_hi && hi < lo)
            return cfail(c, "integer range is empty (maximum below minimum)%s", NULL);
        if (!has_lo && !has_hi) {
            gir_sb_printf(o, "%s ::= json-int\n", name);
            return 0;
        }
        gir_sb_printf(o, "%s ::= ", name);
        int_range(o, has_lo, lo, has_hi, hi);
        gir_sb_puts(o, "\n");
        return 0;
    }
    if (!strcmp(t, "number")) {
        /* bounds: a minimum >= 0 drops the sign and, as xgrammar's, the exponent; other bounds
         * are not enforced */
        json_t *mn = json_object_get(s, "minimum"), *xmn = json_object_get(s, "exclusiveMinimum");
        int nonneg = (mn && json_is_number(mn) && json_number_value(mn) >= 0) ||
                     (xmn && json_is_number(xmn) && json_number_value(xmn) >= 0);
        gir_sb_printf(o, "%s ::= %s(\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)?%s\n", name,
                      nonneg ? "" : "\"-\"? ", nonneg ? "" : " ([eE] [+\\-]? [0-9]+)?");
        return 0;
    }
    if (!strcmp(t, "object")) return gen_object(c, s, name);
    if (!strcmp(t, "array")) return gen_array(c, s, name);
    return cfail(
        c, "unknown type '%s' (accepted: string, number, integer, boolean, null, object, array)",
        t);
}

static int gen(conv *c, json_t *s, char *name, size_t cap) {
    if (c->failed) return -EINVAL;
    if (++c->depth > 64) return cfail(c, "schema nested deeper than 64 levels%s", NULL);
    int rc = 0;
    sb *o = &c->out;
    if (json_is_true(s) || (json_is_object(s) && json_object_size(s) == 0)) {
        snprintf(name, cap, "json-value");
        goto out;
    }
    if (!json_is_object(s)) {
        rc = cfail(c, "a schema must be an object or true (got %s)",
                   json_is_false(s) ? "false" : "another value");
        goto out;
    }
    for (int i = 0; unsupported[i]; i++)
        if (json_object_get(s, unsupported[i])) {
            rc = cfail(c, "the keyword '%s' is not supported", unsupported[i]);
            goto out;
        }
    json_t *ref = json_object_get(s, "$ref");
    if (ref) {
        if (!json_is_string(ref)) {
            rc = cfail(c, "'$ref' must be a string%s", NULL);
            goto out;
        }
        rc = gen_ref(c, json_string_value(ref), name, cap);
        goto out;
    }
    new_name(c, name, cap);
    json_t *cst = json_object_get(s, "const"), *en = json_object_get(s, "enum");
    json_t *any = json_object_get(s, "anyOf");
    if (!any) any = json_object_get(s, "oneOf");
    json_t *all = json_object_get(s, "allOf");
    if (cst) {
        gir_sb_printf(o, "%s ::= ", name);
        lit_json(o, cst);
        gir_sb_puts(o, "\n");
    } else if (en) {
        if (!json_is_array(en) || !json_array_size(en)) {
            rc = cfail(c, "'enum' must be a non-empty list%s", NULL);
            goto out;
        }
        gir_sb_printf(o, "%s ::= ", name);
        for (size_t i = 0; i < json_array_size(en); i++) {
            if (i) gir_sb_puts(o, " | ");
            lit_json(o, json_array_get(en, i));
        }
        gir_sb_puts(o, "\n");
    } else if (any) {
        if (!json_is_array(any) || !json_array_size(any)) {
            rc = cfail(c, "'anyOf'/'oneOf' must be a non-empty list of schemas%s", NULL);
            goto out;
        }
        size_t n = json_array_size(any);
        char(*sn)[32] = calloc(n, sizeof *sn);
        if (!sn) abort();
        for (size_t i = 0; i < n && !rc; i++)
            rc = gen(c, json_array_get(any, i), sn[i], sizeof sn[i]);
        if (!rc) {
            gir_sb_printf(o, "%s ::= ", name);
            for (size_t i = 0; i < n; i++)
                gir_sb_printf(o, "%s%s", i ? " | " : "", sn[i]);
            gir_sb_puts(o, "\n");
        }
        free(sn);
    } else if (all) {
        if (!json_is_array(all) || json_array_size(all) != 1) {
            rc = cfail(c, "'allOf' is supported with exactly one schema%s", NULL);
            goto out;
        }
        char in[32];
        rc = gen(c, json_array_get(all, 0), in, sizeof in);
        if (!rc) gir_sb_printf(o, "%s ::= %s\n", name, in);
    } else {
        json_t *type = json_object_get(s, "type");
        if (!type) {
            if (json_object_get(s, "properties") || json_object_get(s, "additionalProperties"))
                rc = gen_type(c, s, "object", name);
            else if (json_object_get(s, "items") || json_object_get(s, "prefixItems"))
                rc = gen_type(c, s, "array", name);
            else
                gir_sb_printf(o, "%s ::= json-value\n", name);
        } else if (json_is_string(type)) {
            rc = gen_type(c, s, json_string_value(type), name);
        } else if (json_is_array(type) && json_array_size(type)) {
            size_t n = json_array_size(type);
            char(*sn)[32] = calloc(n, sizeof *sn);
            if (!sn) abort();
            for (size_t i = 0; i < n && !rc; i++) {
                json_t *t = json_array_get(type, i);
                if (!json_is_string(t)) {
                    rc = cfail(c, "'type' entries must be strings%s", NULL);
                    break;
                }
                new_name(c, sn[i], sizeof sn[i]);
                rc = gen_type(c, s, json_string_value(t), sn[i]);
            }
            if (!rc) {
                gir_sb_printf(o, "%s ::= ", name);
                for (size_t i = 0; i < n; i++)
                    gir_sb_printf(o, "%s%s", i ? " | " : "", sn[i]);
                gir_sb_puts(o, "\n");
            }
            free(sn);
        } else
            rc = cfail(c, "'type' must be a string or a list of strings%s", NULL);
    }
out:
    c->depth--;
    return rc;
}

char *json_schema_to_gbnf(const char *schema, size_t len, int any_ws, char *err, size_t errlen) {
    return json_schema_to_gbnf_ex(schema, len, any_ws, "root", 1, 0, NULL, err, errlen);
}

char *json_schema_to_gbnf_ex(const char *schema, size_t len, int any_ws, const char *root_name,
                             int helpers, int first, int *next, char *err, size_t errlen) {
    json_error_t je;
    json_t *root = json_loadb(schema, len, JSON_DECODE_ANY, &je);
    if (!root) {
        err_set(err, errlen, "json_schema: not valid JSON (%s at line %d column %d)", je.text,
                je.line, je.column);
        return NULL;
    }
    conv c = {.root = root, .any_ws = any_ws, .err = err, .errlen = errlen, .n = first};
    char top[32];
    int rc = gen(&c, root, top, sizeof top);
    for (int i = 0; i < c.n_refs; i++) {
        free(c.refs[i]);
        free(c.ref_rule[i]);
    }
    json_decref(root);
    if (rc) {
        free(c.out.p);
        return NULL;
    }
    sb *o = &c.out;
    if (next) *next = c.n;
    gir_sb_printf(o, "%s ::= %s\n", root_name, top);
    if (!helpers) return o->p;
    gir_sb_printf(o, "ws ::= %s\n", any_ws ? WS_ANY : "\"\"");
    gir_sb_puts(
        o,
        "json-char ::= [^\"\\\\\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" [A-Fa-f0-9]{4})\n");
    gir_sb_puts(o, "json-string ::= \"\\\"\" json-char* \"\\\"\"\n");
    gir_sb_puts(o, "json-int ::= \"0\" | \"-\"? [1-9] [0-9]*\n");
    gir_sb_puts(
        o,
        "json-number ::= \"-\"? (\"0\" | [1-9] [0-9]*) (\".\" [0-9]+)? ([eE] [+\\-]? [0-9]+)?\n");
    gir_sb_printf(
        o, "json-value ::= json-object | json-array | json-string | json-number | \"true\" | "
           "\"false\" | \"null\"\n");
    gir_sb_printf(o,
                  "json-object ::= \"{\" %s (json-string %s json-value (%s json-string %s "
                  "json-value)*)? %s \"}\"\n",
                  ows(&c), colon(&c), comma(&c), colon(&c), ows(&c));
    gir_sb_printf(o, "json-array ::= \"[\" %s (json-value (%s json-value)*)? %s \"]\"\n", ows(&c),
                  comma(&c), ows(&c));
    return o->p;
}
