/*
 * tokenizer_load — tokenizer.json (model BPE with its vocab, merges and
 * options; added_tokens; the normalizer, pre-tokenizer, decoder and
 * post-processor, each parsed by its own file) and the tokenizer_config.json
 * fields the server needs.  Anything not supported fails the load with a
 * message naming the field and what is accepted.
 */
#include "model/tokenizer_int.h"

#include "base/err.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <utf8proc.h>

/* ======================================================================
 * loading
 * ====================================================================== */

static json_t *tok_load_json(const char *path, size_t flags, char *err, size_t cap, int *rc) {
    json_error_t je;
    json_t *root = json_load_file(path, JSON_DECODE_ANY | flags, &je);
    if (!root) {
        FILE *f = fopen(path, "rb");
        if (!f) {
            *rc = -ENOENT;
            err_set(err, cap, "%s: cannot open: %s", path, strerror(errno));
        } else {
            fclose(f);
            *rc = -EINVAL;
            err_set(err, cap, "%s: malformed JSON at line %d column %d: %s", path, je.line,
                    je.column, je.text);
        }
        return NULL;
    }
    if (!json_is_object(root)) {
        *rc = -EINVAL;
        err_set(err, cap, "%s: top level is not a JSON object", path);
        json_decref(root);
        return NULL;
    }
    return root;
}

/* Resolve a merge half (a vocabulary string) to an id. */
static int32_t tok_lookup_piece(tokenizer *t, const char *s, size_t n, tok_bytes *scratch) {
    if (!t->byte_level) return tok_vocab_find(t, (const uint8_t *)s, n);
    scratch->n = 0;
    if (!tok_byte_level_to_bytes(s, n, scratch)) {
        scratch->n = 0;
        if (tok_bytes_append(scratch, s, n)) return -1;
    }
    return tok_vocab_find(t, scratch->v, scratch->n);
}

/* Record id's vocabulary string and the bytes it decodes to. */
static int tok_add_strings(tokenizer *t, int32_t id, const char *s, tok_bytes *arena,
                           tok_bytes *keys) {
    size_t n = strlen(s);
    bool is_byte = false;
    t->key_off[id] = keys->n;
    t->key_len[id] = (uint32_t)n;
    t->tok_off[id] = arena->n;
    if (tok_bytes_append(keys, s, n) || tok_decode_key(t, s, n, arena, &is_byte)) return -ENOMEM;
    t->tok_len[id] = (uint32_t)(arena->n - t->tok_off[id]);
    t->is_byte[id] = is_byte;
    return 0;
}

static int tok_parse_model(tokenizer *t, const char *path, json_t *model, json_t *added_list,
                           char *err, size_t cap) {
    const char *type = json_string_value(json_object_get(model, "type"));
    if (!type || strcmp(type, "BPE") != 0) {
        err_set(err, cap, "%s: unsupported model type \"%s\" (supported: BPE)", path,
                type ? type : "(missing)");
        return -ENOTSUP;
    }
    const char *cont = json_string_value(json_object_get(model, "continuing_subword_prefix"));
    const char *eow = json_string_value(json_object_get(model, "end_of_word_suffix"));
    if ((cont && *cont) || (eow && *eow)) {
        err_set(err, cap,
                "%s: BPE with continuing_subword_prefix/end_of_word_suffix is not supported", path);
        return -ENOTSUP;
    }
    json_t *dropout = json_object_get(model, "dropout");
    if (dropout && !json_is_null(dropout) && json_number_value(dropout) != 0.0) {
        err_set(err, cap, "%s: BPE dropout is not supported", path);
        return -ENOTSUP;
    }
    t->ignore_merges = json_is_true(json_object_get(model, "ignore_merges"));
    t->byte_fallback = json_is_true(json_object_get(model, "byte_fallback"));
    t->fuse_unk = json_is_true(json_object_get(model, "fuse_unk"));
    json_t *vocab = json_object_get(model, "vocab");
    json_t *merges = json_object_get(model, "merges");
    if (!json_is_object(vocab)) {
        err_set(err, cap, "%s: model.vocab is missing or not an object", path);
        return -EINVAL;
    }
    if (!json_is_array(merges)) {
        err_set(err, cap, "%s: model.merges is missing or not an array", path);
        return -EINVAL;
    }

    /* id range */
    int64_t max_id = -1;
    const char *key;
    json_t *val;
    json_object_foreach(vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) > INT32_MAX - 1) {
            err_set(err, cap, "%s: model.vocab[\"%s\"] is not a non-negative integer id", path,
                    key);
            return -EINVAL;
        }
        if (json_integer_value(val) > max_id) max_id = json_integer_value(val);
    }
    size_t i;
    json_array_foreach(added_list, i, val) {
        json_t *id = json_object_get(val, "id");
        const char *content = json_string_value(json_object_get(val, "content"));
        if (!json_is_integer(id) || json_integer_value(id) < 0 ||
            json_integer_value(id) > INT32_MAX - 1 || !content) {
            err_set(err, cap,
                    "%s: added_tokens[%zu] needs an integer \"id\" >= 0 and a string "
                    "\"content\"",
                    path, i);
            return -EINVAL;
        }
        if (json_integer_value(id) > max_id) max_id = json_integer_value(id);
    }
    if (max_id < 0) {
        err_set(err, cap, "%s: model.vocab is empty", path);
        return -EINVAL;
    }
    if (max_id >= TOK_MAX_ID) {
        err_set(err, cap, "%s: token id %lld is too large (ids below %d are supported)", path,
                (long long)max_id, TOK_MAX_ID);
        return -EINVAL;
    }
    t->n_ids = (int32_t)(max_id + 1);
    size_t n = (size_t)t->n_ids;
    t->has_id = calloc(n, 1);
    t->is_special = calloc(n, 1);
    t->tok_off = calloc(n, sizeof(size_t));
    t->tok_len = calloc(n, sizeof(uint32_t));
    t->is_byte = calloc(n, 1);
    t->key_off = calloc(n, sizeof(size_t));
    t->key_len = calloc(n, sizeof(uint32_t));
    t->vocab_mask = tok_pow2_at_least(2 * json_object_size(vocab)) - 1;
    t->vocab_ht = malloc((t->vocab_mask + 1) * sizeof(int32_t));
    if (!t->has_id || !t->is_special || !t->tok_off || !t->tok_len || !t->vocab_ht || !t->is_byte ||
        !t->key_off || !t->key_len)
        return -ENOMEM;
    memset(t->vocab_ht, 0xff, (t->vocab_mask + 1) * sizeof(int32_t));

    /* token strings and the bytes they decode to, each into one arena */
    tok_bytes arena = {0}, keys = {0};
    int rc = 0;
    json_object_foreach(vocab, key, val) {
        int32_t id = (int32_t)json_integer_value(val);
        if (t->has_id[id]) {
            err_set(err, cap, "%s: model.vocab id %d appears twice (\"%s\")", path, id, key);
            rc = -EINVAL;
            break;
        }
        t->has_id[id] = 1;
        if ((rc = tok_add_strings(t, id, key, &arena, &keys))) break;
    }
    json_array_foreach(added_list, i, val) {
        if (rc) break;
        int32_t id = (int32_t)json_integer_value(json_object_get(val, "id"));
        if (t->has_id[id]) continue; /* an added token that is also in the vocab */
        t->has_id[id] = 2;
        rc = tok_add_strings(t, id, json_string_value(json_object_get(val, "content")), &arena,
                             &keys);
    }
    t->arena = arena.v;
    t->keys = keys.v;
    if (rc) return rc;
    for (size_t id = 0; id < n; id++) {
        if (t->tok_len[id] > t->max_tok_len) t->max_tok_len = t->tok_len[id];
        size_t kn;
        const uint8_t *k = tok_match_key(t, (int32_t)id, &kn);
        if (t->has_id[id] == 1 && tok_vocab_find(t, k, kn) < 0) tok_vocab_insert(t, (int32_t)id);
    }
    for (int b = 0; b < 256; b++) {
        uint8_t c = (uint8_t)b;
        char hex[8];
        snprintf(hex, sizeof(hex), "<0x%02X>", (unsigned)b);
        t->byte_id[b] = t->byte_level || b < 0x80 ? tok_vocab_find(t, &c, 1) : -1;
        t->fallback_id[b] = t->byte_fallback && !t->byte_level
                                ? tok_vocab_find(t, (const uint8_t *)hex, strlen(hex))
                                : -1;
    }
    t->unk_id = -1;
    json_t *unk = json_object_get(model, "unk_token");
    if (json_is_string(unk)) {
        tok_bytes scratch = {0};
        const char *u = json_string_value(unk);
        t->unk_id = tok_lookup_piece(t, u, strlen(u), &scratch);
        free(scratch.v);
        if (t->unk_id < 0) {
            err_set(err, cap, "%s: model.unk_token \"%s\" is not in the vocab", path, u);
            return -EINVAL;
        }
    }

    /* merges */
    size_t nm = json_array_size(merges);
    t->merge_mask = tok_pow2_at_least(2 * nm + 16) - 1;
    t->merges = malloc((t->merge_mask + 1) * sizeof(tok_merge));
    if (!t->merges) return -ENOMEM;
    for (size_t k = 0; k <= t->merge_mask; k++)
        t->merges[k].key = UINT64_MAX;
    tok_bytes scratch = {0}, joined = {0};
    json_array_foreach(merges, i, val) {
        const char *a, *b;
        size_t la, lb;
        if (json_is_string(val)) {
            const char *s = json_string_value(val);
            const char *sp = strchr(s, ' ');
            if (!sp || strchr(sp + 1, ' ')) {
                err_set(err, cap,
                        "%s: merges[%zu] \"%s\" is not two tokens separated by one "
                        "space",
                        path, i, s);
                rc = -EINVAL;
                break;
            }
            a = s;
            la = (size_t)(sp - s);
            b = sp + 1;
            lb = strlen(b);
        } else if (json_is_array(val) && json_array_size(val) == 2 &&
                   json_is_string(json_array_get(val, 0)) &&
                   json_is_string(json_array_get(val, 1))) {
            a = json_string_value(json_array_get(val, 0));
            b = json_string_value(json_array_get(val, 1));
            la = strlen(a);
            lb = strlen(b);
        } else {
            err_set(err, cap, "%s: merges[%zu] is neither \"a b\" nor [\"a\", \"b\"]", path, i);
            rc = -EINVAL;
            break;
        }
        int32_t ia = tok_lookup_piece(t, a, la, &scratch);
        int32_t ib = tok_lookup_piece(t, b, lb, &scratch);
        joined.n = 0;
        if (tok_bytes_append(&joined, a, la) || tok_bytes_append(&joined, b, lb)) {
            rc = -ENOMEM;
            break;
        }
        int32_t inew = tok_lookup_piece(t, (const char *)joined.v, joined.n, &scratch);
        if (ia < 0 || ib < 0 || inew < 0) {
            err_set(err, cap, "%s: merges[%zu] (\"%.*s\", \"%.*s\"): %s is not in the vocab", path,
                    i, (int)la, a, (int)lb, b,
                    ia < 0   ? "the first token"
                    : ib < 0 ? "the second token"
                             : "the merged token");
            rc = -EINVAL;
            break;
        }
        tok_merge_insert(t, ia, ib, (uint32_t)i, inew);
    }
    free(scratch.v);
    free(joined.v);
    return rc;
}

static int tok_parse_added(tokenizer *t, const char *path, json_t *list, char *err, size_t cap) {
    size_t n = json_array_size(list);
    if (n == 0) return 0;
    t->added = calloc(n, sizeof(*t->added));
    if (!t->added) return -ENOMEM;
    size_t i;
    json_t *v;
    json_array_foreach(list, i, v) {
        tok_added *a = &t->added[t->n_added];
        const char *content = json_string_value(json_object_get(v, "content"));
        a->len = strlen(content);
        if (a->len == 0) {
            err_set(err, cap, "%s: added_tokens[%zu] has empty content", path, i);
            return -EINVAL;
        }
        a->id = (int32_t)json_integer_value(json_object_get(v, "id"));
        a->special = json_is_true(json_object_get(v, "special"));
        json_t *norm = json_object_get(v, "normalized");
        /* HF default: normalized = !special */
        a->normalized = norm ? json_is_true(norm) : !a->special;
        if (a->normalized) { /* matched against normalized text: normalize it too */
            int rc = tok_normalize(t, (const uint8_t *)content, a->len, &a->content, &a->len);
            if (rc) {
                err_set(err, cap, "%s: added_tokens[%zu] content is not valid UTF-8", path, i);
                return rc;
            }
        } else {
            a->content = strdup(content);
            if (!a->content) return -ENOMEM;
        }
        a->lstrip = json_is_true(json_object_get(v, "lstrip"));
        a->rstrip = json_is_true(json_object_get(v, "rstrip"));
        a->single_word = json_is_true(json_object_get(v, "single_word"));
        if (a->special) t->is_special[a->id] = 1;
        t->added_first[a->normalized][(uint8_t)a->content[0]] = 1;
        if (a->normalized)
            t->any_added_norm = true;
        else
            t->any_added_raw = true;
        t->n_added++;
    }
    return 0;
}

/* TemplateProcessing "single": the ids before and after $A. */
static int post_parse_template(tokenizer *t, const char *path, json_t *pp, char *err, size_t cap) {
    json_t *single = json_object_get(pp, "single");
    json_t *specials = json_object_get(pp, "special_tokens");
    if (!json_is_array(single)) {
        err_set(err, cap, "%s: TemplateProcessing has no \"single\" array", path);
        return -EINVAL;
    }
    bool seen_a = false;
    size_t i;
    json_t *item;
    json_array_foreach(single, i, item) {
        json_t *seq = json_object_get(item, "Sequence");
        json_t *sp = json_object_get(item, "SpecialToken");
        if (seq) {
            const char *which = json_string_value(json_object_get(seq, "id"));
            if (!which || strcmp(which, "A") != 0 || seen_a) {
                err_set(err, cap,
                        "%s: TemplateProcessing single: only one $A sequence is supported", path);
                return -ENOTSUP;
            }
            seen_a = true;
            continue;
        }
        const char *name = json_string_value(json_object_get(sp, "id"));
        json_t *ids = json_object_get(json_object_get(specials, name ? name : ""), "ids");
        if (!name || !json_is_array(ids)) {
            err_set(err, cap,
                    "%s: TemplateProcessing single[%zu] is neither a Sequence nor a SpecialToken "
                    "listed in special_tokens with its ids",
                    path, i);
            return -EINVAL;
        }
        size_t k;
        json_t *idv;
        json_array_foreach(ids, k, idv) {
            int64_t id = json_integer_value(idv);
            if (!json_is_integer(idv) || id < 0 || id >= t->n_ids || !t->has_id[id]) {
                err_set(err, cap,
                        "%s: TemplateProcessing special token \"%s\" has id %lld, "
                        "not in the vocabulary",
                        path, name, (long long)id);
                return -EINVAL;
            }
            int *cnt = seen_a ? &t->n_post_suf : &t->n_post_pre;
            int32_t *dst = seen_a ? t->post_suf : t->post_pre;
            if (*cnt == TOK_MAX_POST) {
                err_set(err, cap, "%s: TemplateProcessing adds more than %d tokens on a side", path,
                        TOK_MAX_POST);
                return -ENOTSUP;
            }
            dst[(*cnt)++] = (int32_t)id;
        }
    }
    if (!seen_a) {
        err_set(err, cap, "%s: TemplateProcessing single has no $A sequence", path);
        return -EINVAL;
    }
    t->has_template = true;
    return 0;
}

static int tok_parse_post(tokenizer *t, const char *path, json_t *pp, char *err, size_t cap) {
    if (!pp || json_is_null(pp)) return 0;
    const char *type = json_string_value(json_object_get(pp, "type"));
    if (type && strcmp(type, "ByteLevel") == 0) return 0; /* offsets only: ids unchanged */
    if (type && strcmp(type, "TemplateProcessing") == 0) {
        if (t->has_template) {
            err_set(err, cap, "%s: more than one TemplateProcessing post_processor", path);
            return -ENOTSUP;
        }
        return post_parse_template(t, path, pp, err, cap);
    }
    if (type && strcmp(type, "Sequence") == 0) {
        json_t *list = json_object_get(pp, "processors");
        if (!json_is_array(list)) {
            err_set(err, cap, "%s: Sequence post_processor has no \"processors\" array", path);
            return -EINVAL;
        }
        size_t i;
        json_t *x;
        json_array_foreach(list, i, x) {
            int rc = tok_parse_post(t, path, x, err, cap);
            if (rc) return rc;
        }
        return 0;
    }
    err_set(err, cap,
            "%s: unsupported post_processor type \"%s\" (supported: ByteLevel, "
            "TemplateProcessing, Sequence of these, null)",
            path, type ? type : "(missing)");
    return -ENOTSUP;
}

/* eos_token etc.: a string or an AddedToken object {"content": ...}. */
static const char *cfg_token_text(json_t *v) {
    if (json_is_string(v)) return json_string_value(v);
    if (json_is_object(v)) return json_string_value(json_object_get(v, "content"));
    return NULL;
}

static int tok_read_text_file(const char *path, char **out) {
    FILE *f = fopen(path, "rb");
    if (!f) return -errno;
    tok_bytes b = {0};
    char buf[65536];
    size_t k;
    while ((k = fread(buf, 1, sizeof(buf), f)) > 0) {
        if (tok_bytes_append(&b, buf, k)) {
            fclose(f);
            free(b.v);
            return -ENOMEM;
        }
    }
    fclose(f);
    if (tok_bytes_append(&b, "", 1)) {
        free(b.v);
        return -ENOMEM;
    }
    *out = (char *)b.v;
    return 0;
}

static int tok_parse_config(tokenizer *t, const char *dir, char *err, size_t cap) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/tokenizer_config.json", dir);
    FILE *probe = fopen(path, "rb");
    if (!probe) return 0; /* optional */
    fclose(probe);
    int rc = 0;
    /* transformers writes model_max_length 1e30 as an integer: read numbers as reals */
    json_t *cfg = tok_load_json(path, JSON_DECODE_INT_AS_REAL, err, cap, &rc);
    if (!cfg) return rc;
    struct {
        const char *key;
        int32_t *id;
    } specs[] = {{"eos_token", &t->eos_id}, {"pad_token", &t->pad_id}, {"bos_token", &t->bos_id}};
    for (size_t k = 0; k < 3; k++) {
        json_t *v = json_object_get(cfg, specs[k].key);
        if (!v || json_is_null(v)) continue;
        const char *s = cfg_token_text(v);
        if (!s) {
            err_set(err, cap, "%s: %s is neither a string nor an object with \"content\"", path,
                    specs[k].key);
            rc = -EINVAL;
            goto out;
        }
        *specs[k].id = tokenizer_token_id(t, s);
        if (*specs[k].id < 0) {
            err_set(err, cap, "%s: %s \"%s\" is not a token of tokenizer.json", path, specs[k].key,
                    s);
            rc = -EINVAL;
            goto out;
        }
        if (k == 0) {
            t->eos_token = strdup(s);
            if (!t->eos_token) {
                rc = -ENOMEM;
                goto out;
            }
        }
    }
    t->add_bos = json_is_true(json_object_get(cfg, "add_bos_token"));
    t->add_eos = json_is_true(json_object_get(cfg, "add_eos_token"));
    json_t *mml = json_object_get(cfg, "model_max_length");
    if (json_is_integer(mml) && json_integer_value(mml) > 0)
        t->model_max_length = (uint64_t)json_integer_value(mml);
    else if (json_is_real(mml) && json_real_value(mml) > 0 && json_real_value(mml) < 1e18)
        t->model_max_length = (uint64_t)json_real_value(mml);

    json_t *ct = json_object_get(cfg, "chat_template");
    const char *tmpl = NULL;
    if (json_is_string(ct)) {
        tmpl = json_string_value(ct);
    } else if (json_is_array(ct)) { /* [{"name": ..., "template": ...}]: take "default" */
        size_t i;
        json_t *x;
        json_array_foreach(ct, i, x) {
            const char *name = json_string_value(json_object_get(x, "name"));
            if (name && strcmp(name, "default") == 0)
                tmpl = json_string_value(json_object_get(x, "template"));
        }
        if (!tmpl) {
            err_set(err, cap, "%s: chat_template list has no entry named \"default\"", path);
            rc = -EINVAL;
            goto out;
        }
    } else if (ct && !json_is_null(ct)) {
        err_set(err, cap, "%s: chat_template is neither a string nor a list", path);
        rc = -EINVAL;
        goto out;
    }
    if (tmpl) {
        t->chat_template = strdup(tmpl);
        if (!t->chat_template) rc = -ENOMEM;
    } else { /* newer transformers write it beside the config */
        snprintf(path, sizeof(path), "%s/chat_template.jinja", dir);
        if (tok_read_text_file(path, &t->chat_template) == -ENOMEM) rc = -ENOMEM;
    }
out:
    json_decref(cfg);
    return rc;
}

int tokenizer_load(const char *dir, tokenizer **out, char *err, size_t err_cap) {
    tok_global_init_once();
    *out = NULL;
    char path[4096];
    if (snprintf(path, sizeof(path), "%s/tokenizer.json", dir) >= (int)sizeof(path)) {
        err_set(err, err_cap, "tokenizer directory path too long: %s", dir);
        return -ENAMETOOLONG;
    }
    int rc = 0;
    json_t *root = tok_load_json(path, 0, err, err_cap, &rc);
    if (!root) return rc;
    tokenizer *t = calloc(1, sizeof(*t));
    if (!t) {
        json_decref(root);
        return -ENOMEM;
    }
    t->eos_id = t->pad_id = t->bos_id = t->unk_id = -1;
    pthread_mutex_init(&t->cache_mu, NULL);
    t->cache = calloc(TOK_CACHE_SLOTS, sizeof(*t->cache));
    if (!t->cache) {
        rc = -ENOMEM;
        goto fail;
    }

    json_t *model = json_object_get(root, "model");
    json_t *added = json_object_get(root, "added_tokens");
    if (!json_is_object(model)) {
        err_set(err, err_cap, "%s: \"model\" is missing or not an object", path);
        rc = -EINVAL;
        goto fail;
    }
    if (added && !json_is_array(added) && !json_is_null(added)) {
        err_set(err, err_cap, "%s: \"added_tokens\" is not an array", path);
        rc = -EINVAL;
        goto fail;
    }
    if (!json_is_array(added)) added = NULL;
    /* the steps first: the model's tables depend on byte-level or not and on
     * what each token decodes to */
    rc = tok_parse_normalizer(t, path, json_object_get(root, "normalizer"), err, err_cap);
    t->nfc_only = t->n_norm == 1 && t->norm[0].kind == NORM_UTF8PROC &&
                  t->norm[0].flags == (UTF8PROC_STABLE | UTF8PROC_COMPOSE);
    t->norm_ascii_noop = true;
    for (int k = 0; k < t->n_norm; k++)
        t->norm_ascii_noop &= t->norm[k].kind == NORM_UTF8PROC;
    if (!rc) rc = tok_parse_pre(t, path, json_object_get(root, "pre_tokenizer"), err, err_cap);
    if (!rc) rc = tok_parse_decoder(t, path, json_object_get(root, "decoder"), err, err_cap);
    if (rc) goto fail;
    t->byte_level = t->dec_byte_level;
    for (int k = 0; k < t->n_pre; k++)
        t->byte_level |= t->pre[k].kind == PRE_BYTE_LEVEL;
    if (t->byte_level && (t->dec_from || t->dec_byte_fallback || t->dec_strip)) {
        err_set(err, err_cap,
                "%s: a ByteLevel tokenizer with a Replace/ByteFallback/Strip/Metaspace decoder is "
                "not supported",
                path);
        rc = -ENOTSUP;
        goto fail;
    }
    json_t *empty = json_array();
    rc = tok_parse_model(t, path, model, added ? added : empty, err, err_cap);
    json_decref(empty);
    if (!rc && added) rc = tok_parse_added(t, path, added, err, err_cap);
    if (!rc) rc = tok_parse_post(t, path, json_object_get(root, "post_processor"), err, err_cap);
    if (rc) goto fail;
    json_decref(root);
    root = NULL;
    rc = tok_parse_config(t, dir, err, err_cap);
    if (rc) goto fail;
    *out = t;
    return 0;
fail:
    if (rc == -ENOMEM) err_set(err, err_cap, "%s: out of memory while loading", path);
    json_decref(root);
    tokenizer_free(t);
    return rc;
}

void tokenizer_free(tokenizer *t) {
    if (!t) return;
    free(t->has_id);
    free(t->is_special);
    free(t->arena);
    free(t->tok_off);
    free(t->tok_len);
    free(t->is_byte);
    free(t->keys);
    free(t->key_off);
    free(t->key_len);
    for (int k = 0; k < t->n_norm; k++)
        tok_norm_free(&t->norm[k]);
    free(t->dec_from);
    free(t->dec_to);
    free(t->vocab_ht);
    free(t->merges);
    for (size_t i = 0; i < t->n_added; i++)
        free(t->added[i].content);
    free(t->added);
    for (int k = 0; k < t->n_pre; k++)
        if (t->pre[k].re) onig_free(t->pre[k].re);
    free(t->eos_token);
    free(t->chat_template);
    if (t->cache) {
        for (size_t i = 0; i < TOK_CACHE_SLOTS; i++) {
            free(t->cache[i].key);
            free(t->cache[i].ids);
        }
        free(t->cache);
    }
    pthread_mutex_destroy(&t->cache_mu);
    free(t);
}
