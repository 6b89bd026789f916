/*
 * fuzz_openai_request — the JSON body of POST /v1/completions and
 * POST /v1/chat/completions (any client on the network) through what the
 * server does with it before the engine: oai_request_parse, then for chat the
 * model's chat template (model/chat_template) and for both the tokenizer, on
 * the repository's tiny model (models/disagg-sotu-tiny).  The first byte picks
 * the endpoint (even: completions, odd: chat); the rest is the body.
 *
 * Checks: a refused body has a 4xx status and a message; an accepted one is
 * within the documented limits, and every token id of its prompt lies in the
 * vocabulary.  Tool-call parsing (every tool_parser) also runs on the rendered
 * prompt: it is the same kind of text the model may echo back.
 */
#include "fuzz/fuzz_util.h"

#include "model/chat_template.h"
#include "model/tokenizer.h"
#include "server/openai_request.h"
#include "server/tool_parser.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TINY_MODEL DISAGG_SOURCE_DIR "/models/disagg-sotu-tiny"

static tokenizer *g_tok;
static chat_template *g_tmpl;
static oai_defaults g_def;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    fuzz_quiet_logs();
    char err[512];
    if (tokenizer_load(TINY_MODEL, &g_tok, err, sizeof err) != 0 ||
        chat_template_init(tokenizer_chat_template(g_tok), &g_tmpl, err, sizeof err) != 0) {
        fprintf(stderr, "fuzz_openai_request: %s\n", err);
        abort();
    }
    oai_defaults_init(&g_def);
    g_def.served_model_name = "tiny";
    g_def.model_path = TINY_MODEL;
    return 0;
}

static void tokenize(const char *text, size_t len, bool add_special) {
    int32_t *ids = NULL;
    size_t n = 0;
    char err[256];
    if (tokenizer_encode(g_tok, text, len, add_special, &ids, &n, err, sizeof err) != 0) return;
    int32_t vocab = tokenizer_vocab_size(g_tok);
    for (size_t i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) abort();
    free(ids);
}

static void check_request(const oai_request *r) {
    if (r->n < 1 || r->n > OAI_MAX_N || r->n_stop < 0 || r->n_stop > OAI_MAX_STOPS) abort();
    if (r->logprobs > OAI_MAX_LOGPROBS || r->prompt_logprobs > OAI_MAX_LOGPROBS) abort();
    for (int i = 0; i < r->n_stop; i++)
        if (!r->stop[i]) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    oai_kind kind = (data[0] & 1) ? OAI_CHAT : OAI_COMPLETIONS;
    oai_request r;
    oai_error e;
    memset(&e, 0, sizeof e);
    if (oai_request_parse(&r, kind, (const char *)data + 1, size - 1, &g_def, &e) != 0) {
        if (e.status < 400 || e.status > 499 || !e.type || !e.message[0]) abort();
        free(oai_error_json(&e));
        oai_request_free(&r); /* a refused body may keep kv_transfer_params */
        return 0;
    }
    check_request(&r);
    if (kind == OAI_COMPLETIONS) {
        if (r.n_prompts < 1) abort();
        for (int i = 0; i < r.n_prompts; i++)
            if (r.prompts[i].text) tokenize(r.prompts[i].text, r.prompts[i].text_len, true);
    } else {
        chat_template_opts opts = {.add_generation_prompt = r.add_generation_prompt,
                                   .parse_tool_arguments = true};
        char *text = NULL, err[512];
        size_t len = 0;
        if (chat_template_render(g_tmpl, r.messages, r.tools, &opts, &text, &len, err,
                                 sizeof err) == 0) {
            if (strlen(text) > len) abort();
            tokenize(text, len, r.add_special_tokens);
            static const char *const parsers[] = {"hermes", "llama3_json", "mistral"};
            for (int i = 0; i < 3; i++) {
                const tool_parser *tp = tool_parser_find(parsers[i]);
                json_t *calls = NULL;
                size_t content_len = 0;
                if (tp->parse(text, len, &calls, &content_len) > 0) {
                    if (content_len > len) abort();
                    json_decref(calls);
                }
                if (tp->safe_prefix(text, len) > len) abort();
            }
            free(text);
        } else if (!err[0]) {
            abort();
        }
    }
    oai_request_free(&r);
    return 0;
}
