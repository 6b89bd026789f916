/*
 * test_model_load — model loading: config.json in transformers 4.x and 5.x spellings,
 * generation_config defaults, HF cache resolution (refs/main, HF_HUB_CACHE / HF_HOME),
 * sharded safetensors, and clear errors for a missing model, truncated or corrupt files,
 * missing tensors, wrong shapes, unsupported dtypes and architectures.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>
#include <errno.h>

#include "model/hf_cache.h"
#include "model/model_config.h"
#include "kernels/cpu/cpu_matmul.h"
#include "model/qwen2.h"
#include "test_model_fixture.h"

static char g_src[1024]; /* the generated tiny bf16 model */
static char g_tmp[1024]; /* scratch directory of this test run */

static int setup(void **st) {
    (void)st;
    json_t *g = fixture_model("tiny-bf16", g_src, sizeof g_src);
    if (!g) return -1;
    json_decref(g);
    snprintf(g_tmp, sizeof g_tmp, "%s/disagg-test-load-%d",
             getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp", (int)getpid());
    char cmd[2300];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", g_tmp, g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **st) {
    (void)st;
    char cmd[1100];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_tmp);
    return system(cmd) == 0 ? 0 : -1;
}

static void sh(const char *fmt, ...) {
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    if (system(cmd) != 0) fail_msg("command failed: %s", cmd);
}

/* Loads dir, expects failure whose message contains each of the NULL-terminated needles. */
static void expect_load_error(const char *dir, ...) {
    qwen2_model m;
    char err[2048] = "";
    int rc = qwen2_load(&m, dir, 0, err, sizeof err);
    if (rc == 0) {
        qwen2_free(&m);
        fail_msg("loading %s succeeded; expected an error", dir);
    }
    va_list ap;
    va_start(ap, dir);
    const char *needle;
    while ((needle = va_arg(ap, const char *)))
        if (!strstr(err, needle)) fail_msg("error '%s' does not mention '%s'", err, needle);
    va_end(ap);
}

static const char *CFG4 = "{\"architectures\":[\"Qwen2ForCausalLM\"],\"model_type\":\"qwen2\","
                          "\"vocab_size\":1000,\"hidden_size\":64,"
                          "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_"
                          "heads\":2,\"intermediate_size\":160,"
                          "\"max_position_embeddings\":4096,\"rms_norm_eps\":1e-05,\"rope_theta\":"
                          "500000.0,\"torch_dtype\":\"bfloat16\","
                          "\"tie_word_embeddings\":true,\"eos_token_id\":151645}";
static const char *CFG5 =
    "{\"architectures\":[\"Qwen2ForCausalLM\"],\"model_type\":\"qwen2\",\"vocab_size\":1000,"
    "\"hidden_size\":64,"
    "\"num_hidden_layers\":2,\"num_attention_heads\":4,\"num_key_value_heads\":2,\"intermediate_"
    "size\":160,"
    "\"rope_parameters\":{\"rope_type\":\"default\",\"rope_theta\":250000.0},\"dtype\":\"float32\","
    "\"layer_types\":[\"full_attention\",\"full_attention\"],\"tie_word_embeddings\":false}";

static void test_config_spellings(void **st) {
    (void)st;
    model_config c;
    char err[512];
    assert_int_equal(model_config_parse(&c, CFG4,
                                        "{\"eos_token_id\":[151645,151643],\"temperature\":0.7,"
                                        "\"top_p\":0.8,\"top_k\":20,\"repetition_penalty\":1.05}",
                                        "cfg4", err, sizeof err),
                     0);
    assert_int_equal(c.vocab_size, 1000);
    assert_int_equal(c.head_dim, 16);
    assert_int_equal(c.n_kv_heads, 2);
    assert_true(c.rope_theta == 500000.0f);
    assert_true(c.rms_norm_eps == 1e-5f);
    assert_string_equal(c.dtype, "bfloat16");
    assert_int_equal(c.tie_embeddings, 1);
    assert_int_equal(c.n_eos, 2);
    assert_int_equal(c.gen_top_k, 20);
    assert_true(c.gen_top_p == 0.8f);
    assert_int_equal(model_config_parse(&c, CFG5, NULL, "cfg5", err, sizeof err), 0);
    assert_true(c.rope_theta == 250000.0f);
    assert_string_equal(c.dtype, "float32");
    assert_int_equal(c.tie_embeddings, 0);
    assert_int_equal(c.max_position, 32768);
    assert_int_equal(c.has_gen_defaults, 0);
}

static void test_config_errors(void **st) {
    (void)st;
    model_config c;
    char err[512];
    assert_int_equal(model_config_parse(&c, "{\"architectures\":[\"LlamaForCausalLM\"]}", NULL, "x",
                                        err, sizeof err),
                     -EINVAL);
    assert_non_null(strstr(err, "LlamaForCausalLM"));
    assert_int_equal(model_config_parse(&c, "{not json", NULL, "x", err, sizeof err), -EINVAL);
    assert_int_equal(
        model_config_parse(&c, "{\"architectures\":[\"Qwen2ForCausalLM\"],\"vocab_size\":10}", NULL,
                           "x", err, sizeof err),
        -EINVAL);
    assert_non_null(strstr(err, "hidden_size"));
    char buf[2048];
    snprintf(buf, sizeof buf, "%.*s,\"rope_scaling\":{\"type\":\"yarn\",\"factor\":4}}",
             (int)strlen(CFG4) - 1, CFG4);
    assert_int_equal(model_config_parse(&c, buf, NULL, "x", err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "yarn"));
    snprintf(buf, sizeof buf, "%.*s,\"num_key_value_heads\":3}", (int)strlen(CFG4) - 1, CFG4);
    assert_int_equal(model_config_parse(&c, buf, NULL, "x", err, sizeof err), -EINVAL);
}

static void test_hf_cache(void **st) {
    (void)st;
    char out[4096], err[4096];
    sh("mkdir -p %s/hub/models--Org--Tiny/refs %s/hub/models--Org--Tiny/snapshots/abc123 "
       "%s/hub/models--Org--Tiny/snapshots/old999 && printf abc123 > "
       "%s/hub/models--Org--Tiny/refs/main",
       g_tmp, g_tmp, g_tmp, g_tmp);
    setenv("HF_HUB_CACHE", "/nonexistent-hub", 1);
    char home[1100];
    snprintf(home, sizeof home, "%s", g_tmp);
    setenv("HF_HOME", home, 1);
    assert_int_equal(hf_cache_resolve("Org/Tiny", out, sizeof out, err, sizeof err), 0);
    assert_non_null(strstr(out, "models--Org--Tiny/snapshots/abc123"));
    /* not cached: the error says where it looked and how to get it */
    assert_int_equal(hf_cache_resolve("Org/Missing", out, sizeof out, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "/nonexistent-hub/models--Org--Missing/"));
    assert_non_null(strstr(err, "huggingface-cli download Org/Missing"));
    assert_int_equal(hf_cache_resolve("no-such-dir", out, sizeof out, err, sizeof err), -ENOENT);
    assert_non_null(strstr(err, "no-such-dir"));
    /* a full model found through the cache loads */
    sh("cp %s/config.json %s/model.safetensors %s/hub/models--Org--Tiny/snapshots/abc123/", g_src,
       g_src, g_tmp);
    qwen2_model m;
    assert_int_equal(qwen2_load(&m, "Org/Tiny", 0, err, sizeof err), 0);
    assert_int_equal(m.cfg.n_layers, 2);
    assert_int_equal(m.w.embed.dtype, CPU_BF16);
    qwen2_free(&m);
    unsetenv("HF_HOME");
    unsetenv("HF_HUB_CACHE");
}

static void test_sharded_matches_single(void **st) {
    (void)st;
    char d[1200], err[1024];
    snprintf(d, sizeof d, "%s/sharded", g_tmp);
    sh("python3 %s/tools/gen_random_qwen2.py --out %s --shape tiny --dtype bf16 --seed 4321 "
       "--shard-mb 2 "
       "--config-style 5 >/dev/null",
       DISAGG_SOURCE_DIR, d);
    qwen2_model a, b;
    assert_int_equal(qwen2_load(&a, g_src, 0, err, sizeof err), 0);
    assert_int_equal(qwen2_load(&b, d, 0, err, sizeof err), 0);
    assert_true(b.w.st.n_files > 1);
    assert_int_equal(a.w.matrix_bytes, b.w.matrix_bytes);
    assert_memory_equal(a.w.layers[1].w_down.data, b.w.layers[1].w_down.data,
                        (size_t)a.cfg.hidden_size * a.cfg.intermediate_size * 2);
    assert_true(a.cfg.rope_theta == b.cfg.rope_theta);
    qwen2_free(&a);
    qwen2_free(&b);
}

static void test_load_errors(void **st) {
    (void)st;
    char d[1200];
    snprintf(d, sizeof d, "%s/bad", g_tmp);
    /* no config.json */
    sh("rm -rf %s && mkdir -p %s", d, d);
    expect_load_error(d, "config.json", NULL);
    /* config but no weights */
    sh("cp %s/config.json %s/", g_src, d);
    expect_load_error(d, "no *.safetensors", NULL);
    /* truncated weights */
    sh("head -c 5000000 %s/model.safetensors > %s/model.safetensors", g_src, d);
    expect_load_error(d, "model.safetensors", "truncated", NULL);
    /* corrupt header length */
    sh("printf '\\377\\377\\377\\377\\377\\377\\377\\177garbage' > %s/model.safetensors", d);
    expect_load_error(d, "model.safetensors", "header length", NULL);
    /* corrupt header JSON */
    sh("printf '\\020\\000\\000\\000\\000\\000\\000\\000{\"a\":[1,2,3,' > %s/model.safetensors", d);
    expect_load_error(d, "model.safetensors", "corrupt", NULL);
    /* missing tensor: config asks for 3 layers */
    sh("cp %s/model.safetensors %s/ && sed -i 's/\"num_hidden_layers\": 2/\"num_hidden_layers\": "
       "3/' %s/config.json",
       g_src, d, d);
    expect_load_error(d, "model.layers.2.input_layernorm.weight", "missing", NULL);
    /* wrong shape: config's intermediate_size differs */
    sh("cp %s/config.json %s/ && sed -i 's/\"intermediate_size\": 160/\"intermediate_size\": 128/' "
       "%s/config.json",
       g_src, d, d);
    expect_load_error(d, "model.layers.0.mlp.gate_proj.weight", "shape [160, 64]", "[128, 64]",
                      NULL);
    /* unsupported architecture */
    sh("cp %s/config.json %s/ && sed -i 's/Qwen2ForCausalLM/MistralForCausalLM/' %s/config.json",
       g_src, d, d);
    expect_load_error(d, "MistralForCausalLM", "Qwen2ForCausalLM", NULL);
    /* unsupported dtype: an F64 embedding */
    sh("python3 -c \"import json,struct,sys; "
       "h=json.dumps({'model.embed_tokens.weight':{'dtype':'F64','shape':[151936,64],"
       "'data_offsets':[0,151936*64*8]}}).encode(); f=open(sys.argv[1],'wb'); "
       "f.write(struct.pack('<Q',len(h))+h); "
       "f.truncate(8+len(h)+151936*64*8)\" %s/model.safetensors && cp %s/config.json %s/",
       d, g_src, d);
    expect_load_error(d, "model.embed_tokens.weight", "F64", NULL);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_config_spellings), cmocka_unit_test(test_config_errors),
        cmocka_unit_test(test_hf_cache),         cmocka_unit_test(test_sharded_matches_single),
        cmocka_unit_test(test_load_errors),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
