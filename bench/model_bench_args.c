/* model_bench_args — see model_bench_args.h. */
#include "bench/model_bench_args.h"

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

static void mb_unknown(const char *cmd, const char *a, const mb_opt *opts, int n_opts) {
    fprintf(stderr, "%s: unknown option '%s'; accepted:", cmd, a);
    for (int k = 0; k < n_opts; k++)
        fprintf(stderr, "%s %s", k ? "," : "", opts[k].flag);
    fputc('\n', stderr);
}

int mb_parse_args(int argc, char **argv, const char *cmd, const mb_opt *opts, int n_opts,
                  const char *usage, const char **model) {
    *model = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        const mb_opt *o = NULL;
        for (int k = 0; k < n_opts && !o; k++)
            if (!strcmp(a, opts[k].flag)) o = &opts[k];
        if (!strcmp(a, "--device")) {
            i++;
        } else if (o && o->kind == MB_FLAG) {
            *(int *)o->out = 1;
        } else if (o) {
            int one, n1;
            if (o->kind == MB_WORD) {
                if (!v) {
                    fprintf(stderr, "disagg bench model: %s needs a value\n", a);
                    return 2;
                }
                *(const char **)o->out = v;
            } else if (o->kind == MB_INT ? mb_list(a, v, &one, &n1, 1)
                                         : mb_list(a, v, o->out, o->n, MB_MAXLIST)) {
                return 2;
            } else if (o->kind == MB_INT) {
                *(int *)o->out = one;
            }
            i++;
        } else if (a[0] == '-') {
            mb_unknown(cmd, a, opts, n_opts);
            return 2;
        } else if (!*model) {
            *model = a;
        } else {
            fprintf(stderr, "disagg bench model: unexpected argument '%s'\n", a);
            return 2;
        }
    }
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
