/*
 * beam_search — vLLM's beam search (use_beam_search, beam width n) driven on the
 * server's loop.  Each step, every live beam of a prompt is one engine request: the
 * prompt plus the beam's tokens, max_tokens 1, logprobs 2 × width (the prefix cache
 * makes every step after the first cost one token per beam).  The candidates are each
 * beam's top tokens (and the sampled one when it is not among them) with cumulative
 * logprob beam + token; eos candidates complete (with eos in their tokens only for
 * include_stop_str_in_output), the best `width` others are the new beams.  After
 * max_tokens steps the completed and live beams are ranked by vLLM's
 * get_beam_search_score — cum_logprob / len ** length_penalty, len counting the prompt
 * and the tokens, less a final eos — and the best `width` are the choices, finish_reason
 * "stop" (eos; stop_reason the eos id) or "length".  The engine requests' events come
 * through gen's queue: a step's slots are gen_choices the request owns.
 */
#ifndef DISAGG_SERVER_BEAM_SEARCH_H
#define DISAGG_SERVER_BEAM_SEARCH_H

#include "server/gen.h"

/* Start r's beam search (choices created, max_tokens[p] per prompt): submits every
 * prompt's first step.  On failure r->has_err / r->err are set (and what was submitted
 * finishes through the queue).  0 or a negative error. */
int beam_search_start(gen_req *r, const int *max_tokens);
/* A step request's events (slot->r->beam is set). */
void beam_search_on_token(gen_choice *slot, const engine_token *t);
void beam_search_on_finished(gen_choice *slot, const char *finish_reason, const char *error,
                             int error_status, int kv_role, int n_kv_received, int n_computed);
/* Abort the step requests in flight (client gone). */
void beam_search_abort(gen_req *r);
void beam_search_free(struct beam_search *b);

#endif
