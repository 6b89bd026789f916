/* prompt_ids — see prompt_ids.h. */
#include "model/prompt_ids.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int prompt_ids_chat(const tokenizer *tok, const chat_template *ct, const json_t *messages,
                    const json_t *tools, const json_t *kwargs, bool add_generation_prompt,
                    bool add_special, int32_t **ids, size_t *n, char *err, size_t errcap) {
    /* bos_token / eos_token as the tokenizer names them (Llama 3 and Mistral print them) */
    char *bos = NULL;
    size_t bos_len = 0;
    int32_t bos_id = tokenizer_bos_id(tok);
    if (bos_id >= 0 && tokenizer_decode(tok, &bos_id, 1, false, &bos, &bos_len, err, errcap))
        bos = NULL;
    chat_template_opts opts = {.add_generation_prompt = add_generation_prompt,
                               .parse_tool_arguments = true,
                               .kwargs = kwargs,
                               .bos_token = bos,
                               .eos_token = tokenizer_eos_token(tok)};
    char *text = NULL;
    size_t len = 0;
    int rc = chat_template_render(ct, messages, tools, &opts, &text, &len, err, errcap);
    free(bos);
    if (rc) return -EINVAL;
    rc = tokenizer_encode(tok, text, len, add_special, ids, n, err, errcap);
    free(text);
    return rc ? -EINVAL : 0;
}

static int flag(const json_t *body, const char *key, bool def, bool *out, char *err,
                size_t errcap) {
    const json_t *v = json_object_get(body, key);
    *out = def;
    if (!v || json_is_null(v)) return 0;
    if (!json_is_boolean(v)) {
        snprintf(err, errcap, "'%s' must be a boolean", key);
        return -EINVAL;
    }
    *out = json_is_true(v);
    return 0;
}

/* A list of token ids copied; -EINVAL when an element is not an id. */
static int ids_of_array(const json_t *a, int32_t **ids, size_t *n, char *err, size_t errcap) {
    size_t m = json_array_size(a);
    int32_t *out = malloc((m ? m : 1) * sizeof *out);
    if (!out) {
        snprintf(err, errcap, "out of memory");
        return -ENOMEM;
    }
    for (size_t i = 0; i < m; i++) {
        const json_t *e = json_array_get(a, i);
        if (!json_is_integer(e) || json_integer_value(e) < 0 || json_integer_value(e) > INT32_MAX) {
            free(out);
            snprintf(err, errcap, "'prompt' element %zu is not a token id", i);
            return -EINVAL;
        }
        out[i] = (int32_t)json_integer_value(e);
    }
    *ids = out;
    *n = m;
    return 0;
}

int prompt_ids_of_body(const tokenizer *tok, const chat_template *ct, const json_t *body, bool chat,
                       int32_t **ids, size_t *n, char *err, size_t errcap) {
    *ids = NULL;
    *n = 0;
    bool add_special;
    if (chat) {
        const json_t *msgs = json_object_get(body, "messages");
        const json_t *tools = json_object_get(body, "tools");
        const json_t *kw = json_object_get(body, "chat_template_kwargs");
        bool add_gen;
        if (!ct) {
            snprintf(err, errcap, "no chat template");
            return -EINVAL;
        }
        if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
            snprintf(err, errcap, "'messages' must be a non-empty list");
            return -EINVAL;
        }
        if (flag(body, "add_generation_prompt", true, &add_gen, err, errcap) ||
            flag(body, "add_special_tokens", false, &add_special, err, errcap))
            return -EINVAL;
        /* an empty list is no tools, as the server reads it */
        return prompt_ids_chat(tok, ct, msgs, json_array_size(tools) > 0 ? tools : NULL,
                               json_is_object(kw) ? kw : NULL, add_gen, add_special, ids, n, err,
                               errcap);
    }
    const json_t *p = json_object_get(body, "prompt");
    if (flag(body, "add_special_tokens", true, &add_special, err, errcap)) return -EINVAL;
    if (json_is_array(p) && json_array_size(p) > 0 && !json_is_integer(json_array_get(p, 0)))
        p = json_array_get(p, 0); /* a list of prompts: the first */
    if (json_is_string(p)) {
        int rc = tokenizer_encode(tok, json_string_value(p), json_string_length(p), add_special,
                                  ids, n, err, errcap);
        return rc ? -EINVAL : 0;
    }
    if (json_is_array(p)) return ids_of_array(p, ids, n, err, errcap);
    snprintf(err, errcap, "'prompt' must be a string or a list of token ids");
    return -EINVAL;
}
