/*
 * model_bench_args — the argument loop shared by `disagg bench model MODEL --device cuda`
 * (model_bench_cuda.c) and its `--batch-invariant` form (model_bench_inv.c): the one
 * positional MODEL and a table of options — flags, one integer, a comma-separated list of
 * integers, a word the caller checks — with the errors naming the bad value and what is
 * accepted.
 */
#ifndef DISAGG_BENCH_MODEL_BENCH_ARGS_H
#define DISAGG_BENCH_MODEL_BENCH_ARGS_H

#define MB_MAXLIST 16        /* values of a list option */
#define MB_MAXOPTS 32        /* options of one table */
#define MB_INT_MAX (1 << 20) /* integers are in [1, MB_INT_MAX] */

typedef enum mb_kind {
    MB_FLAG, /* no value: *(int *)out = 1 */
    MB_INT,  /* one integer: *(int *)out */
    MB_LIST, /* integers "a,b,c": (int *)out[MB_MAXLIST], *n of them */
    MB_WORD  /* any value: *(const char **)out (the caller checks it) */
} mb_kind;

typedef struct mb_opt {
    const char *flag; /* "--batches" */
    mb_kind kind;     /* what it takes */
    void *out;        /* where its value goes (see mb_kind) */
    int *n;           /* MB_LIST: the number of values */
} mb_opt;

/* Parses argv[1..argc): MODEL into *model and the options of opts; "--device X" is passed
 * over (the caller chose by it).  cmd names the command in the unknown-option error
 * ("disagg bench model --device cuda"), usage is printed when MODEL is missing.  0, 2
 * (the exit status) after printing what was wrong, or -1 after printing --help (exit 0). */
int mb_parse_args(int argc, char **argv, const char *cmd, const mb_opt *opts, int n_opts,
                  const char *usage, const char **model);

/* --load-format: "auto"/"safetensors" (*dummy = 0) or "dummy" (1, vLLM's: config.json alone,
 * random weights); 0, or 2 after printing what is accepted. */
int mb_load_format(const char *v, int *dummy);

#endif
