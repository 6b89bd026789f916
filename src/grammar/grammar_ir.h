/*
 * grammar_ir — private to grammar/: the parsed grammar (rules of alternatives of
 * elements) the GBNF parser builds and the matcher runs.
 */
#ifndef DISAGG_GRAMMAR_GRAMMAR_IR_H
#define DISAGG_GRAMMAR_GRAMMAR_IR_H

#include <stddef.h>
#include <stdint.h>

enum { GE_END = 0, GE_CLASS = 1, GE_REF = 2 };

typedef struct gelem {
    uint8_t kind; /* GE_* */
    uint8_t neg;  /* CLASS: negated */
    uint32_t a;   /* CLASS: first range (index into ranges, pairs lo,hi); REF: rule id */
    uint32_t n;   /* CLASS: number of ranges */
} gelem;

typedef struct grule {
    char *name;
    int *alts; /* start index of each alternative in elems (each ends with GE_END) */
    int n_alts, cap_alts;
    int defined;
} grule;

typedef struct gir {
    gelem *elems;
    int n_elems, cap_elems;
    uint32_t *ranges; /* code point pairs */
    int n_ranges, cap_ranges;
    grule *rules;
    int n_rules, cap_rules;
    int root;
} gir;

/* Parses GBNF / EBNF text into ir (start rule `root`); 0 or -EINVAL with err set. */
int gir_parse(gir *ir, const char *text, size_t len, char *err, size_t errlen);
void gir_free(gir *ir);
/* 1 when the code point cp is in the class element e. */
int gir_class_has(const gir *ir, const gelem *e, uint32_t cp);
/* 1 when some code point in [lo, hi] is in the class element e. */
int gir_class_meets(const gir *ir, const gelem *e, uint32_t lo, uint32_t hi);

/* A growable string (the front ends' output). */
typedef struct sb {
    char *p;
    size_t n, cap;
} sb;
void gir_sb_add(sb *b, const char *s, size_t n);
void gir_sb_puts(sb *b, const char *s);
void gir_sb_printf(sb *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* A byte of a GBNF literal or class, escaped where needed. */
void gir_esc_byte(sb *b, unsigned char c);

/* The other front ends: text in GBNF (malloc'd) or NULL with err set. */
char *json_schema_to_gbnf(const char *schema, size_t len, int any_ws, char *err, size_t errlen);
/* As json_schema_to_gbnf, the start rule named root_name, its rules numbered from first
 * (*next: the first number left unused), the shared json-* / ws rules only when helpers. */
char *json_schema_to_gbnf_ex(const char *schema, size_t len, int any_ws, const char *root_name,
                             int helpers, int first, int *next, char *err, size_t errlen);
char *regex_to_gbnf(const char *re, size_t len, char *err, size_t errlen);
char *regex_choice_to_gbnf(const char *json_array, size_t len, char *err, size_t errlen);

#endif
