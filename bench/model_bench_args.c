/* model_bench_args — see model_bench_args.h. */
#include "bench/model_bench_args.h"

#include "base/flags.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* "a,b,c" into out (at most max values, each in [1, MB_INT_MAX]); -1 after printing the
 * error when v is not that. */
static int mb_list(const char *flag, const char *v, int *out, int *n, int max) {
    *n = 0;
    const char *p = v ? v : "";
    while (*p && *n < max) {
        char *end;
        long x = strtol(p, &end, 10);
        if (end == p || x < 1 || x > MB_INT_MAX || (*end && *end != ',')) break;
        out[(*n)++] = (int)x;
        p = *end ? end + 1 : end;
        if (!*end) return 0;
    }
    if (max == 1)
        fprintf(stderr, "disagg bench model: %s '%s' is invalid; accepted: an integer in [1, %d]\n",
                flag, v ? v : "", MB_INT_MAX);
    else
        fprintf(stderr,
                "disagg bench model: %s '%s' is invalid; accepted: comma-separated integers in "
                "[1, %d], at most %d\n",
                flag, v ? v : "", MB_INT_MAX, max);
    return -1;
}

/* One row of the caller's table (d->dst: its mb_opt). */
static int mb_value(flags_parser *p, const flag_def *d, const char *v) {
    const mb_opt *o = d->dst;
    int one, n1;
    if (o->kind == MB_INT) {
        if (mb_list(d->name, v, &one, &n1, 1)) return -1;
        *(int *)o->out = one;
    } else if (mb_list(d->name, v, o->out, o->n, MB_MAXLIST))
        return -1;
    return 0;
}

static int mb_model(flags_parser *p, const char *word) {
    const char **model = flags_arg(p);
    if (*model) {
        fprintf(stderr, "disagg bench model: unexpected argument '%s'\n", word);
        return -1;
    }
    *model = word;
    return 0;
}

int mb_parse_args(int argc, char **argv, const char *cmd, const mb_opt *opts, int n_opts,
                  const char *usage, const char **model) {
    *model = NULL;
    flag_def rows[MB_MAXOPTS + 2];
    int n = 0;
    /* "--device X": passed over (the caller chose by it) */
    rows[n++] = (flag_def){FLAG_STRING_("--device", (const char **)NULL), .opts = FLAG_HIDDEN};
    for (int k = 0; k < n_opts && k < MB_MAXOPTS; k++) {
        const mb_opt *o = &opts[k];
        if (o->kind == MB_FLAG)
            rows[n++] = (flag_def){FLAG_BOOL_(o->flag, (int *)o->out)};
        else if (o->kind == MB_WORD)
            rows[n++] = (flag_def){FLAG_STRING_(o->flag, (const char **)o->out)};
        else
            rows[n++] = (flag_def){FLAG_CUSTOM_(o->flag, (void *)o, mb_value),
                                   .metavar = o->kind == MB_LIST ? "N[,N..]" : "N"};
    }
    memset(&rows[n], 0, sizeof rows[n]);
    const flag_def *tables[] = {rows, NULL};
    char usage_nl[1024];
    snprintf(usage_nl, sizeof usage_nl, "%s\n\n", usage);
    const flags_spec spec = {.cmd = !strncmp(cmd, "disagg ", 7) ? cmd + 7 : cmd,
                             .usage = usage_nl,
                             .tables = tables,
                             .list_on_unknown = 1,
                             .positional = mb_model,
                             .arg = (void *)model};
    int rc = flags_parse(&spec, argc, argv);
    if (rc) return rc == FLAGS_HELP ? -1 : 2;
    if (!*model) {
        fprintf(stderr, "%s\n", usage);
        return 2;
    }
    return 0;
}

int mb_load_format(const char *v, int *dummy) {
    if (!strcmp(v, "auto") || !strcmp(v, "safetensors") || !strcmp(v, "dummy")) {
        *dummy = !strcmp(v, "dummy");
        return 0;
    }
    fprintf(stderr,
            "disagg bench model: --load-format '%s' is invalid; accepted: auto, safetensors, "
            "dummy\n",
            v);
    return 2;
}
