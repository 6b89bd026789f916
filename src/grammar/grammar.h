/*
 * grammar — structured outputs: a grammar (GBNF / xgrammar's EBNF dialect, or one
 * compiled from a JSON Schema, a regular expression or a list of choices) compiled to a
 * byte-level pushdown automaton, run over a model's vocabulary as token masks.
 *
 * The automaton: a matcher state is the set of the grammar's parse stacks after the
 * bytes so far (persistent stacks, hash-consed: a state is a sorted set of stack ids).
 * Repetitions are right-recursive helper rules called in tail position, so a loop
 * (a JSON string, a run of digits) does not grow the stack and its state recurs.  The
 * states are built lazily and interned, and so are their byte transitions (a lazy DFA
 * over the PDA's configurations): after warm-up a token is a few table lookups.  A
 * state's token mask (which tokens of the vocabulary may come next) is computed once,
 * by walking the vocabulary sorted by bytes (a shared prefix is walked once; a rejected
 * prefix rejects its whole subtree), and cached with the state: the decode of a
 * typical schema revisits the same few states, so a mask is a table lookup.
 *
 * Character classes match UTF-8 code points (a token may end inside a character: the
 * state holds the partial code point).  Special tokens are never allowed; the stop
 * tokens are the caller's (grammar_state_accepting says when they are).
 *
 * Threading: a grammar's lazily built tables are guarded by its own mutex; any thread
 * may run matchers; grammar_ref / grammar_unref are atomic.
 */
#ifndef DISAGG_GRAMMAR_GRAMMAR_H
#define DISAGG_GRAMMAR_GRAMMAR_H

#include <stddef.h>
#include <stdint.h>

/* The model's vocabulary as the grammar sees it: each token's bytes (special tokens and
 * empty ones are never allowed). Immutable once built; shared by every grammar. */
typedef struct grammar_vocab grammar_vocab;

/* bytes[i] / lens[i] for i < n; is_special[i] (may be NULL) marks tokens never allowed. */
grammar_vocab *grammar_vocab_new(int n, const uint8_t *const *bytes, const size_t *lens,
                                 const uint8_t *is_special);
void grammar_vocab_free(grammar_vocab *v);
int grammar_vocab_size(const grammar_vocab *v);

typedef struct grammar grammar;

typedef enum grammar_kind {
    GRAMMAR_GBNF = 0,    /* GBNF / EBNF text, start rule `root` */
    GRAMMAR_JSON_SCHEMA, /* a JSON Schema (text) */
    GRAMMAR_JSON_OBJECT, /* any JSON object (text ignored) */
    GRAMMAR_REGEX,       /* a regular expression, matched whole */
    GRAMMAR_CHOICE,      /* a JSON array of strings: exactly one of them */
} grammar_kind;

/* Options of the JSON Schema / json_object grammars. */
typedef struct grammar_options {
    int any_whitespace; /* 1 (vLLM's default): [ \n\t]* between JSON tokens; 0: compact */
} grammar_options;

/* Compiles text of kind over vocab (borrowed: must outlive the grammar).  NULL on an
 * invalid or unsupported grammar: err names what was wrong and what is accepted. */
grammar *grammar_compile(grammar_kind kind, const char *text, size_t len,
                         const grammar_options *opt, const grammar_vocab *vocab, char *err,
                         size_t errlen);
/* The GBNF text a kind compiles to (a JSON Schema, a regex, choices), malloc'd; NULL
 * on error (err set).  For tests and `disagg bench grammar`. */
char *grammar_to_gbnf(grammar_kind kind, const char *text, size_t len, const grammar_options *opt,
                      char *err, size_t errlen);
/* A JSON Schema's GBNF rules for embedding in a larger grammar: its start rule named
 * root_name, its other rules numbered from first (*next: the next free number), the shared
 * json-* and ws rules written only when helpers (write them once). */
char *grammar_json_schema_rules(const char *schema, size_t len, int any_whitespace,
                                const char *root_name, int helpers, int first, int *next, char *err,
                                size_t errlen);
grammar *grammar_ref(grammar *g);
void grammar_unref(grammar *g);
/* Counts of the lazily built tables (states, masks computed, stack nodes). */
void grammar_stats(grammar *g, int *n_states, int *n_masks, int *n_nodes);

/* A matcher state (one sequence's position): an id in g's state table. */
typedef int32_t grammar_state;
#define GRAMMAR_DEAD ((grammar_state)0)

grammar_state grammar_start(grammar *g);
/* The state after the token's bytes, or GRAMMAR_DEAD when the grammar rejects them
 * (also for a special token). */
grammar_state grammar_advance_token(grammar *g, grammar_state s, int32_t token);
/* The state after raw bytes (GRAMMAR_DEAD when rejected). */
grammar_state grammar_advance_bytes(grammar *g, grammar_state s, const uint8_t *b, size_t n);
/* 1 when the bytes so far form a whole sentence of the grammar (stop tokens allowed). */
int grammar_state_accepting(grammar *g, grammar_state s);
/* 1 when no byte may follow (only a stop token). */
int grammar_state_terminated(grammar *g, grammar_state s);
/* The state's allowed tokens as a bitset over the vocabulary ((n + 31) / 32 words; bit
 * i of word i / 32), stop tokens not included.  Owned by g, valid while g lives. */
const uint32_t *grammar_state_mask(grammar *g, grammar_state s);

#endif
