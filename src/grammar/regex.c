/*
 * regex — a regular expression (the subset vLLM's backends accept: literals, escapes,
 * classes with \d \w \s, '.', groups (also (?:...) and named), alternation, the
 * quantifiers * + ? {m} {m,} {m,n}, lazy/possessive suffixes ignored, ^ and $ at the
 * ends) as GBNF text (`root ::= ...`), and a list of choices as GBNF.  Matched whole,
 * as re.fullmatch.
 */
#include "base/err.h"
#include "grammar/grammar_ir.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void gir_sb_add(sb *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap * 2 : 256;
        while (nc < b->n + n + 1)
            nc *= 2;
        char *q = realloc(b->p, nc);
        if (!q) abort();
        b->p = q;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

void gir_sb_puts(sb *b, const char *s) {
    gir_sb_add(b, s, strlen(s));
}

void gir_sb_printf(sb *b, const char *fmt, ...) {
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0) gir_sb_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

/* A byte of a literal or class, escaped for GBNF. */
void gir_esc_byte(sb *b, unsigned char c) {
    if (c < 0x20 || c == '"' || c == '\\' || c == ']' || c == '[' || c == '-' || c == '^' ||
        c == 0x7f)
        gir_sb_printf(b, "\\x%02X", c);
    else
        gir_sb_add(b, (const char *)&c, 1);
}

static const char *class_escape(char c) {
    switch (c) {
    case 'd':
        return "0-9";
    case 'w':
        return "a-zA-Z0-9_";
    case 's':
        return " \\t\\n\\r\\x0C\\x0B";
    default:
        return NULL;
    }
}

char *regex_to_gbnf(const char *re, size_t len, char *err, size_t errlen) {
    sb b = {0};
    gir_sb_puts(&b, "root ::= (");
    size_t i = 0;
    int depth = 0;
    if (i < len && re[i] == '^') i++;
    while (i < len) {
        unsigned char c = (unsigned char)re[i];
        if (c == '$' && i + 1 == len) {
            i++;
            continue;
        }
        if (c == '\\') {
            if (i + 1 >= len) goto trailing;
            char e = re[i + 1];
            i += 2;
            const char *cls = class_escape(e);
            if (cls) {
                gir_sb_printf(&b, "[%s]", cls);
            } else if (e == 'D' || e == 'W' || e == 'S') {
                gir_sb_printf(&b, "[^%s]", class_escape((char)(e + 32)));
            } else if (e == 'n')
                gir_sb_puts(&b, "\"\\n\"");
            else if (e == 't')
                gir_sb_puts(&b, "\"\\t\"");
            else if (e == 'r')
                gir_sb_puts(&b, "\"\\r\"");
            else if (e == 'f')
                gir_sb_puts(&b, "\"\\x0C\"");
            else if (e == 'v')
                gir_sb_puts(&b, "\"\\x0B\"");
            else if (e == 'x' || e == 'u') {
                int nh = e == 'x' ? 2 : 4;
                if (i + (size_t)nh > len) goto bad_escape;
                gir_sb_printf(&b, "\"\\%c%.*s\"", e, nh, re + i);
                i += (size_t)nh;
            } else if ((e >= '1' && e <= '9') || e == 'b' || e == 'B' || e == 'A' || e == 'Z' ||
                       e == 'z' || e == 'k' || e == 'p' || e == 'P') {
                err_set(err, errlen,
                        "regex: '\\%c' is not supported (accepted: literals, classes, \\d \\w \\s "
                        "and their negations, groups, |, * + ? {m,n})",
                        e);
                free(b.p);
                return NULL;
            } else {
                gir_sb_puts(&b, "\"");
                gir_esc_byte(&b, (unsigned char)e);
                gir_sb_puts(&b, "\"");
            }
            continue;
        }
        if (c == '[') {
            i++;
            gir_sb_puts(&b, "[");
            if (i < len && re[i] == '^') {
                gir_sb_puts(&b, "^");
                i++;
            }
            int first = 1;
            while (i < len && (re[i] != ']' || first)) {
                first = 0;
                unsigned char d = (unsigned char)re[i];
                if (d == '\\' && i + 1 < len) {
                    char e = re[i + 1];
                    const char *cls = class_escape(e);
                    if (cls)
                        gir_sb_puts(&b, cls);
                    else if (e == 'n')
                        gir_sb_puts(&b, "\\n");
                    else if (e == 't')
                        gir_sb_puts(&b, "\\t");
                    else if (e == 'r')
                        gir_sb_puts(&b, "\\r");
                    else if (e == 'D' || e == 'W' || e == 'S') {
                        err_set(err, errlen,
                                "regex: '\\%c' inside a character class is not supported", e);
                        free(b.p);
                        return NULL;
                    } else
                        gir_esc_byte(&b, (unsigned char)e);
                    i += 2;
                } else if (d == '-' && i + 1 < len && re[i + 1] != ']' && b.p[b.n - 1] != '[' &&
                           b.p[b.n - 1] != '^') {
                    gir_sb_puts(&b, "-");
                    i++;
                } else if (d == '[' && i + 1 < len && re[i + 1] == ':') {
                    err_set(err, errlen, "regex: POSIX classes [:name:] are not supported");
                    free(b.p);
                    return NULL;
                } else {
                    /* copy a whole UTF-8 character */
                    int n = d < 0x80 ? 1 : d < 0xE0 ? 2 : d < 0xF0 ? 3 : 4;
                    if (n == 1)
                        gir_esc_byte(&b, d);
                    else
                        gir_sb_add(&b, re + i, (size_t)n <= len - i ? (size_t)n : len - i);
                    i += (size_t)n;
                }
            }
            if (i >= len) {
                err_set(err, errlen, "regex: unterminated character class");
                free(b.p);
                return NULL;
            }
            i++;
            gir_sb_puts(&b, "]");
            continue;
        }
        if (c == '(') {
            i++;
            if (i < len && re[i] == '?') {
                if (i + 1 < len && re[i + 1] == ':')
                    i += 2;
                else if (i + 1 < len && (re[i + 1] == 'P' || re[i + 1] == '<') && i + 2 < len &&
                         re[i + 2] != '=' && re[i + 2] != '!') {
                    while (i < len && re[i] != '>')
                        i++;
                    if (i >= len) goto bad_group;
                    i++;
                } else
                    goto bad_group;
            }
            depth++;
            gir_sb_puts(&b, "(");
            continue;
        }
        if (c == ')') {
            if (!depth) {
                err_set(err, errlen, "regex: unbalanced ')'");
                free(b.p);
                return NULL;
            }
            depth--;
            i++;
            gir_sb_puts(&b, ")");
            continue;
        }
        if (c == '|') {
            i++;
            gir_sb_puts(&b, " | ");
            continue;
        }
        if (c == '*' || c == '+' || c == '?' || c == '{') {
            if (c == '{') {
                size_t j = i + 1;
                while (j < len && (re[j] == ',' || (re[j] >= '0' && re[j] <= '9') || re[j] == ' '))
                    j++;
                if (j >= len || re[j] != '}' || j == i + 1) { /* a literal '{' */
                    gir_sb_puts(&b, "\"{\"");
                    i++;
                    continue;
                }
                gir_sb_add(&b, re + i, j + 1 - i);
                i = j + 1;
            } else {
                gir_sb_add(&b, (const char *)&c, 1);
                i++;
            }
            if (i < len && (re[i] == '?' || re[i] == '+')) i++; /* lazy / possessive */
            continue;
        }
        if (c == '.') {
            gir_sb_puts(&b, "[^\\n]");
            i++;
            continue;
        }
        if (c == '^' || c == '$') {
            err_set(err, errlen, "regex: '%c' is only supported at the start/end", c);
            free(b.p);
            return NULL;
        }
        /* a literal character (whole UTF-8 sequence) */
        {
            int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
            gir_sb_puts(&b, " \"");
            if (n == 1)
                gir_esc_byte(&b, c);
            else
                gir_sb_add(&b, re + i, (size_t)n <= len - i ? (size_t)n : len - i);
            gir_sb_puts(&b, "\"");
            i += (size_t)n;
        }
    }
    if (depth) {
        err_set(err, errlen, "regex: unbalanced '('");
        free(b.p);
        return NULL;
    }
    gir_sb_puts(&b, ")\n");
    return b.p;
trailing:
    err_set(err, errlen, "regex: trailing '\\'");
    free(b.p);
    return NULL;
bad_escape:
    err_set(err, errlen, "regex: bad \\x or \\u escape");
    free(b.p);
    return NULL;
bad_group:
    err_set(err, errlen,
            "regex: lookarounds and other (?...) groups are not supported (accepted: (...), "
            "(?:...), (?P<name>...))");
    free(b.p);
    return NULL;
}

char *regex_choice_to_gbnf(const char *text, size_t len, char *err, size_t errlen) {
    json_error_t je;
    json_t *a = json_loadb(text, len, 0, &je);
    if (!a || !json_is_array(a) || json_array_size(a) == 0) {
        err_set(err, errlen, "choice: expected a non-empty list of strings");
        json_decref(a);
        return NULL;
    }
    sb b = {0};
    gir_sb_puts(&b, "root ::= ");
    for (size_t k = 0; k < json_array_size(a); k++) {
        json_t *s = json_array_get(a, k);
        if (!json_is_string(s)) {
            err_set(err, errlen, "choice: entry %zu is not a string (expected a list of strings)",
                    k);
            json_decref(a);
            free(b.p);
            return NULL;
        }
        if (k) gir_sb_puts(&b, " | ");
        gir_sb_puts(&b, "\"");
        const unsigned char *p = (const unsigned char *)json_string_value(s);
        size_t n = json_string_length(s);
        for (size_t i = 0; i < n; i++)
            if (p[i] >= 0x80)
                gir_sb_add(&b, (const char *)p + i, 1);
            else
                gir_esc_byte(&b, p[i]);
        gir_sb_puts(&b, "\"");
    }
    gir_sb_puts(&b, "\n");
    json_decref(a);
    return b.p;
}
