/*
 * model_bench_moe — the work accounting of `disagg bench model` for every architecture,
 * mixtures of experts included: how many matrix parameters a model holds, how many one
 * token multiplies with (a sparse layer's router and its top_k experts), and how many a
 * decode step of B tokens reads (the experts any of them chose).
 */
#ifndef DISAGG_BENCH_MODEL_BENCH_MOE_H
#define DISAGG_BENCH_MODEL_BENCH_MOE_H

#include "model/model_config.h"

/* Matrix parameters of the decoder (q/k/v/o, the dense MLPs, routers and experts, the
 * embedding and lm_head; tied: once): *total all of them, *active_layers those of the layers
 * one token's forward multiplies with (its top_k experts per sparse layer; no embedding or
 * lm_head). */
void mbm_params(const model_config *c, int tied, double *total, double *active_layers);
/* Parameters a decode step of B tokens reads: the layers' matrices with, per sparse layer, the
 * experts expected to be chosen by at least one token under uniform routing,
 * n_experts * (1 - (1 - top_k / n_experts)^B), plus lm_head (vocab x hidden, tied or not: an
 * untied embedding table is not read beyond its B rows). */
double mbm_step_params(const model_config *c, int B);

#endif
