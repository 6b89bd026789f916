/*
 * flags — the table-driven command-line parser of every `disagg` command.
 *
 * A command describes its options as a table of flag_def (one row a flag: its name and
 * aliases, its type, where the value goes, its range, an environment variable to fall back
 * on, its metavar and help text) and calls flags_parse().  The parser takes "--flag VALUE"
 * and "--flag=VALUE", "--no-flag" for negatable switches, "--" (every later word is
 * positional), "-h"/"--help" (prints the help generated from the tables), and refuses an
 * unknown flag naming the closest known one (base/text's text_close_name: close names only).
 * Every error names the flag, the bad value and what is accepted, prefixed "disagg CMD: ".
 *
 * Rows are applied in command-line order, so a repeated flag's last value wins (a FLAG_LIST
 * is replaced, as argparse's nargs="+").  Environment fallbacks are applied first, so the
 * command line overrides them.
 *
 * Adding a flag: one row in the command's table, e.g.
 *     {FLAG_INT_("--max-num-seqs", &cfg.max_num_seqs, 1, 65536), .metavar = "N",
 *      .help = "most running requests (default 64)"},
 * then regenerate docs/configuration.md (python3 tools/gen_config_doc.py).
 */
#ifndef DISAGG_BASE_FLAGS_H
#define DISAGG_BASE_FLAGS_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

typedef struct flags_parser flags_parser;
typedef struct flag_def flag_def;

typedef enum flag_type {
    FLAG_END = 0,   /* ends a table ({0}) */
    FLAG_BOOL,      /* a switch: *dst (an int, sizeof 1..8) = 1; FLAG_NEGATABLE: --no-NAME = 0;
                     * FLAG_STORE_FALSE: the other way round.  Env fallback: an integer, 0 off */
    FLAG_INT,       /* an integer in [min, max] into *dst (signed or unsigned, by dst_size) */
    FLAG_DOUBLE,    /* a number in [lo, hi] (FLAG_OPEN_LO: (lo, hi]) into *(double *)dst */
    FLAG_STRING,    /* *(const char **)dst = the value (argv's memory, or the environment's) */
    FLAG_BYTES,     /* base/bytesize's grammar ("512M"), in [lo, hi], into *dst (size_t, u64) */
    FLAG_CHOICE,    /* one of choices[] (NULL-ended): *(int *)dst = its index */
    FLAG_LIST,      /* one or more words up to the next word starting with '-' (argparse's
                     * nargs="+"), or one JSON list of strings: into *(flag_list *)dst */
    FLAG_JSON,      /* JSON text (json_type: JSON_ARRAY / JSON_OBJECT, -1 any; FLAG_STRINGS:
                     * an array of strings) into *(json_t **)dst, owned by the caller */
    FLAG_CUSTOM,    /* fn(p, d, value) does it all (FLAG_SWITCH: no value, value NULL) */
    FLAG_NO_EFFECT, /* accepted and logged: "FLAG [VALUE]: accepted, no effect (why)" */
    FLAG_REFUSED,   /* a flag of a feature disagg lacks: "FLAG: why"; not in --help */
    FLAG_TEXT,      /* help only: a line (synopsis, help) with no flag behind it */
} flag_type;

/* flag_def.opts */
enum {
    FLAG_NEGATABLE = 1 << 0,   /* --no-NAME too (BOOL, NO_EFFECT, CUSTOM switch: value NULL and
                                * flags_negated() true) */
    FLAG_HIDDEN = 1 << 1,      /* not in --help (still parsed and hinted) */
    FLAG_OPEN_LO = 1 << 2,     /* DOUBLE: lo itself is refused */
    FLAG_SWITCH = 1 << 3,      /* CUSTOM / NO_EFFECT: takes no value */
    FLAG_STORE_FALSE = 1 << 4, /* BOOL: the flag stores 0 (e.g. --disable-log-stats) */
    FLAG_VARARGS = 1 << 5,     /* CUSTOM: fn gets the inline value (--f=V) or NULL and takes
                                * its words itself (flags_peek / flags_take) */
    FLAG_STRINGS = 1 << 6,     /* JSON: an array of strings only */
};

/* A setter or a check.  CUSTOM: the whole handling of the flag.  Other types: called after the
 * value is stored (value: the text given; NULL for a switch), to check or post-process it.
 * Returns 0, or -1 after printing an error (flags_error). */
typedef int (*flag_fn)(flags_parser *p, const flag_def *d, const char *value);

struct flag_def {
    const char *name;    /* "--max-model-len" (or a short one such as "-O") */
    const char *aliases; /* other spellings, space-separated: "-tp" */
    flag_type type;
    unsigned opts;              /* FLAG_* bits above */
    void *dst;                  /* where the value goes; CUSTOM: fn's object (flags_dst) */
    size_t dst_size;            /* sizeof *dst (BOOL, INT, BYTES) */
    long long min, max;         /* INT range */
    double lo, hi;              /* DOUBLE and BYTES range; LIST: most words (0: 64) */
    const char *const *choices; /* CHOICE: the accepted words, NULL-ended */
    int json_type;              /* JSON: JSON_ARRAY, JSON_OBJECT or -1 (any) */
    const char *env;            /* read before the command line when set and not empty */
    const char *metavar;        /* "N", "BYTES"; default by type */
    const char *unit;           /* range errors: "seconds" -> "expects seconds, a number..";
                                 * LIST: what one word is ("name": "at most 32 names") */
    const char *synopsis;       /* help's left column when not "ALIASES, NAME METAVAR" */
    const char *help;           /* help text ('\n' breaks a line) */
    const char *why;            /* REFUSED: the reason; NO_EFFECT: the note in the log line */
    flag_fn fn;                 /* see flag_fn */
};

/* Row makers (designated initializers: add .metavar, .help, .env, .fn ... after them). */
#define FLAG_BOOL_(nm, ptr) .name = (nm), .type = FLAG_BOOL, .dst = (ptr), .dst_size = sizeof *(ptr)
#define FLAG_INT_(nm, ptr, a, b)                                                                   \
    .name = (nm), .type = FLAG_INT, .dst = (ptr), .dst_size = sizeof *(ptr), .min = (a), .max = (b)
#define FLAG_DOUBLE_(nm, ptr, a, b)                                                                \
    .name = (nm), .type = FLAG_DOUBLE, .dst = (ptr), .lo = (a), .hi = (b)
#define FLAG_STRING_(nm, ptr) .name = (nm), .type = FLAG_STRING, .dst = (ptr)
#define FLAG_BYTES_(nm, ptr, a, b)                                                                 \
    .name = (nm), .type = FLAG_BYTES, .dst = (ptr), .dst_size = sizeof *(ptr), .lo = (a), .hi = (b)
#define FLAG_CHOICE_(nm, ptr, ...)                                                                 \
    .name = (nm), .type = FLAG_CHOICE, .dst = (ptr), .choices = (const char *const[]) {            \
        __VA_ARGS__, NULL                                                                          \
    }
#define FLAG_LIST_(nm, ptr)       .name = (nm), .type = FLAG_LIST, .dst = (ptr)
#define FLAG_JSON_(nm, ptr, jt)   .name = (nm), .type = FLAG_JSON, .dst = (ptr), .json_type = (jt)
#define FLAG_CUSTOM_(nm, obj, f)  .name = (nm), .type = FLAG_CUSTOM, .dst = (obj), .fn = (f)
#define FLAG_NO_EFFECT_(nm, note) .name = (nm), .type = FLAG_NO_EFFECT, .why = (note)
#define FLAG_REFUSED_(nm, reason) .name = (nm), .type = FLAG_REFUSED, .why = (reason)
#define FLAG_TEXT_(syn, text)     .type = FLAG_TEXT, .synopsis = (syn), .help = (text)

/* FLAG_LIST's value: v[0..n) (argv's or json's strings). */
typedef struct flag_list {
    const char **v;
    int n;
    json_t *json; /* owns v's strings when they came as a JSON list (flag_list_free) */
} flag_list;
void flag_list_free(flag_list *l);

/* A command's options. */
typedef struct flags_spec {
    const char *cmd;               /* "serve", "bootstrap register": messages, help */
    const char *usage;             /* help text before the options (ends with '\n') */
    const char *epilog;            /* after them, or NULL */
    const flag_def *const *tables; /* NULL-ended list of {0}-ended tables (help order) */
    int help_col;                  /* column of the help text (default 30) */
    int underscores;               /* --max_model_len means --max-model-len (vLLM) */
    int list_on_unknown;           /* an unknown flag's error lists every accepted one */
    /* a word that is not a flag (or any word after "--"); NULL: refused as unexpected */
    int (*positional)(flags_parser *p, const char *word);
    void *arg; /* flags_arg() for fn and positional */
    FILE *err; /* errors (NULL: stderr) */
} flags_spec;

/* Parses argv[1..argc).  0: parsed; FLAGS_HELP: --help printed (exit 0); -1: an error was
 * printed (exit 2). */
#define FLAGS_HELP 1
int flags_parse(const flags_spec *s, int argc, char **argv);
/* The help text: usage, one line (or more, wrapped) per row, epilog. */
void flags_help(const flags_spec *s, FILE *f);
/* The row for a spelling (name, alias or --no-NAME; underscores as the spec says), or NULL;
 * *negated (may be NULL) is 1 for --no-NAME. */
const flag_def *flags_find(const flags_spec *s, const char *flag, int *negated);
/* 1 when d takes no value (a switch). */
int flags_is_switch(const flag_def *d);

/* ---- for fn and positional ---------------------------------------------------------------- */
const char *flags_cmd(const flags_parser *p);
void *flags_arg(const flags_parser *p);
/* The flag as written ("-tp", "--no-enforce-eager"; underscores turned into dashes). */
const char *flags_spelled(const flags_parser *p);
int flags_negated(const flags_parser *p); /* the row was given as --no-NAME */
int flags_inline(const flags_parser *p);  /* the value came as --flag=VALUE */
/* The next word of argv, or NULL (none left); flags_take consumes it. */
const char *flags_peek(const flags_parser *p);
const char *flags_take(flags_parser *p);
/* "disagg CMD: " + the message + "\n" on the spec's error stream. */
void flags_error(flags_parser *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The converters behind the types, with their messages (for fn that needs one). */
int flags_int(flags_parser *p, const flag_def *d, const char *v, long long *out);
int flags_double(flags_parser *p, const flag_def *d, const char *v, double *out);
/* 1 when s is one of the NULL-ended words. */
int flags_one_of(const char *s, const char *const *words);

#endif
