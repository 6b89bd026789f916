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

#include "model/arch.h"
#include "model/hf_cache.h"
#include <math.h>
#include "model/model_config.h"
#include "kernels/cpu/cpu_matmul.h"
#include "model/decoder.h"
#include "model/quant.h"
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
    decoder_model m;
    char err[2048] = "";
    int rc = decoder_load(&m, dir, 0, err, sizeof err);
    if (rc == 0) {
        decoder_free(&m);
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
    assert_int_equal(model_config_parse(&c, "{\"architectures\":[\"GPT2LMHeadModel\"]}", NULL, "x",
                                        err, sizeof err),
                     -EINVAL);
    assert_non_null(strstr(err, "GPT2LMHeadModel"));
    assert_non_null(strstr(err, "LlamaForCausalLM"));
    assert_int_equal(model_config_parse(&c, "{not json", NULL, "x", err, sizeof err), -EINVAL);
    assert_int_equal(
        model_config_parse(&c, "{\"architectures\":[\"Qwen2ForCausalLM\"],\"vocab_size\":10}", NULL,
                           "x", err, sizeof err),
        -EINVAL);
    assert_non_null(strstr(err, "hidden_size"));
    char buf[2048];
    snprintf(buf, sizeof buf, "%.*s,\"rope_scaling\":{\"type\":\"longrope\",\"factor\":4}}",
             (int)strlen(CFG4) - 1, CFG4);
    assert_int_equal(model_config_parse(&c, buf, NULL, "x", err, sizeof err), -EINVAL);
    assert_non_null(strstr(err, "longrope"));
    assert_non_null(strstr(err, "default, linear, dynamic, yarn, llama3"));
    snprintf(buf, sizeof buf, "%.*s,\"num_key_value_heads\":3}", (int)strlen(CFG4) - 1, CFG4);
    assert_int_equal(model_config_parse(&c, buf, NULL, "x", err, sizeof err), -EINVAL);
}

/* CFG4 with the architecture replaced and `extra` members added */
static int parse_arch(model_config *c, const char *arch, const char *mt, const char *extra,
                      char *err, size_t errlen) {
    char buf[4096];
    const char *body = strstr(CFG4, "\"vocab_size\"");
    snprintf(buf, sizeof buf, "{\"architectures\":[\"%s\"],\"model_type\":\"%s\",%.*s%s%s}", arch,
             mt, (int)strlen(body) - 1, body, extra[0] ? "," : "", extra);
    return model_config_parse(c, buf, NULL, arch, err, errlen);
}

/* Every family's description and every refusal names the field and what is accepted */
static void test_arch_descriptions(void **st) {
    (void)st;
    model_config c;
    char err[1024];
    assert_int_equal(parse_arch(&c, "Qwen2ForCausalLM", "qwen2", "", err, sizeof err), 0);
    assert_int_equal(c.qkv_bias, 1);
    assert_int_equal(c.qk_norm, 0);
    assert_int_equal(c.q_dim, 64);
    assert_int_equal(parse_arch(&c, "Qwen3ForCausalLM", "qwen3", "", err, sizeof err), 0);
    assert_int_equal(c.qkv_bias, 0);
    assert_int_equal(c.qk_norm, 1);
    assert_int_equal(c.head_dim, 128); /* transformers' Qwen3Config default */
    assert_int_equal(c.q_dim, 512);
    assert_int_equal(
        parse_arch(&c, "LlamaForCausalLM", "llama",
                   "\"head_dim\":32,\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":"
                   "32.0,\"low_freq_factor\":1.0,\"high_freq_factor\":4.0,\"original_"
                   "max_position_embeddings\":8192}",
                   err, sizeof err),
        0);
    assert_int_equal(c.head_dim, 32);
    assert_string_equal(c.rope.type, "llama3");
    assert_int_equal(c.rope.original_max_position, 8192);
    assert_int_equal(
        parse_arch(&c, "MistralForCausalLM", "mistral", "\"sliding_window\":1024", err, sizeof err),
        0);
    assert_int_equal(c.sliding_window, 1024);
    /* a window no shorter than the context changes nothing */
    assert_int_equal(
        parse_arch(&c, "MistralForCausalLM", "mistral", "\"sliding_window\":4096", err, sizeof err),
        0);
    assert_int_equal(c.sliding_window, 0);
    assert_int_equal(
        parse_arch(&c, "MistralForCausalLM", "mistral", "\"sliding_window\":null", err, sizeof err),
        0);
    assert_int_equal(c.sliding_window, 0);
    /* dynamic: the default table within max_position_embeddings */
    assert_int_equal(parse_arch(&c, "LlamaForCausalLM", "llama",
                                "\"rope_scaling\":{\"type\":\"dynamic\",\"factor\":2.0}", err,
                                sizeof err),
                     0);
    float a[8], b[8], fa, fb;
    arch_rope_table(&c, a, &fa);
    assert_int_equal(parse_arch(&c, "LlamaForCausalLM", "llama", "", err, sizeof err), 0);
    arch_rope_table(&c, b, &fb);
    assert_memory_equal(a, b, sizeof a);
    assert_true(fa == 1.0f && fb == 1.0f);
    /* refusals */
    static const struct {
        const char *arch, *mt, *extra, *needle1, *needle2;
    } bad[] = {
        {"LlamaForCausalLM", "llama", "\"attention_bias\":true", "attention_bias", "false"},
        {"LlamaForCausalLM", "llama", "\"mlp_bias\":true", "mlp_bias", "false"},
        {"Qwen3ForCausalLM", "qwen3", "\"attention_bias\":true", "attention_bias", "false"},
        {"LlamaForCausalLM", "llama", "\"hidden_act\":\"gelu\"", "hidden_act 'gelu'", "silu"},
        {"LlamaForCausalLM", "llama", "\"quantization_config\":{\"quant_method\":\"awq\"}",
         "quant_method \"awq\" is not supported", "accepted: quant_method \"fp8\""},
        {"LlamaForCausalLM", "llama",
         "\"quantization_config\":{\"quant_method\":\"gptq\",\"bits\":4}", "\"gptq\"",
         "compressed-tensors"},
        {"LlamaForCausalLM", "llama", "\"attention_sink\":true", "attention_sink", "absent"},
        {"Qwen3ForCausalLM", "qwen3", "\"use_sliding_window\":true", "use_sliding_window",
         "MistralForCausalLM"},
        {"Qwen2ForCausalLM", "qwen2", "\"use_sliding_window\":true", "use_sliding_window", "false"},
        {"Qwen3ForCausalLM", "qwen3", "\"layer_types\":[\"full_attention\",\"sliding_attention\"]",
         "layer_types[1] 'sliding_attention'", "full_attention"},
        {"LlamaForCausalLM", "llama", "\"rope_scaling\":{\"rope_type\":\"llama3\",\"factor\":8.0}",
         "llama3", "low_freq_factor"},
        {"LlamaForCausalLM", "llama", "\"rope_scaling\":{\"rope_type\":\"su\",\"factor\":8.0}",
         "rope_type 'su'", "default, linear, dynamic, yarn, llama3"},
        {"LlamaForCausalLM", "llama",
         "\"rope_parameters\":{\"rope_type\":\"mrope\",\"rope_theta\":1e4}",
         "rope_parameters.rope_type 'mrope'", "accepted"},
        {"LlamaForCausalLM", "llama", "\"partial_rotary_factor\":0.5", "partial_rotary_factor",
         "1.0"},
        {"LlamaForCausalLM", "llama",
         "\"rope_scaling\":{\"type\":\"linear\",\"factor\":2,\"partial_rotary_factor\":0.5}",
         "partial_rotary_factor", "1.0"},
        {"MistralForCausalLM", "mistral", "\"sliding_window\":-3", "sliding_window", "null"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc = parse_arch(&c, bad[i].arch, bad[i].mt, bad[i].extra, err, sizeof err);
        if (rc != -EINVAL || !strstr(err, bad[i].needle1) || !strstr(err, bad[i].needle2))
            fail_msg("case %zu (%s): rc %d, error '%s' (want '%s' and '%s')", i, bad[i].extra, rc,
                     err, bad[i].needle1, bad[i].needle2);
    }
}

/* The mixtures of experts: transformers' defaults, the sparse/dense layer rule, refusals */
static void test_moe_descriptions(void **st) {
    (void)st;
    model_config c;
    char err[1024];
    assert_int_equal(parse_arch(&c, "Qwen3MoeForCausalLM", "qwen3_moe", "", err, sizeof err), 0);
    assert_int_equal(c.n_experts, 128); /* Qwen3MoeConfig's defaults */
    assert_int_equal(c.n_experts_per_tok, 8);
    assert_int_equal(c.moe_intermediate_size, 768);
    assert_int_equal(c.norm_topk_prob, 0);
    assert_int_equal(c.qk_norm, 1);
    assert_int_equal(c.head_dim, 16); /* hidden / heads: not Qwen3's 128 */
    assert_true(model_layer_is_moe(&c, 0) && model_layer_is_moe(&c, 1));
    assert_int_equal(parse_arch(&c, "Qwen3MoeForCausalLM", "qwen3_moe",
                                "\"num_local_experts\":16,\"num_experts_per_tok\":4,"
                                "\"norm_topk_prob\":true,\"decoder_sparse_step\":2,"
                                "\"mlp_only_layers\":[1,7]",
                                err, sizeof err),
                     0);
    assert_int_equal(c.n_experts, 16);
    assert_int_equal(c.n_experts_per_tok, 4);
    assert_int_equal(c.norm_topk_prob, 1);
    /* (l + 1) % 2 == 0 and not in mlp_only_layers: layer 1 is listed, so none of the 2 */
    assert_false(model_layer_is_moe(&c, 0));
    assert_false(model_layer_is_moe(&c, 1));
    assert_int_equal(parse_arch(&c, "Qwen3MoeForCausalLM", "qwen3_moe",
                                "\"num_experts\":0", err, sizeof err),
                     0);
    assert_false(model_layer_is_moe(&c, 0)); /* no experts: every layer dense */
    assert_int_equal(parse_arch(&c, "MixtralForCausalLM", "mixtral", "", err, sizeof err), 0);
    assert_int_equal(c.n_experts, 8);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_int_equal(c.norm_topk_prob, 1);
    assert_int_equal(c.moe_intermediate_size, 160);
    assert_true(model_layer_is_moe(&c, 0) && model_layer_is_moe(&c, 1));
    assert_int_equal(parse_arch(&c, "MixtralForCausalLM", "mixtral", "\"sliding_window\":512",
                                err, sizeof err),
                     0);
    assert_int_equal(c.sliding_window, 512);
    static const struct {
        const char *arch, *mt, *extra, *needle1, *needle2;
    } bad[] = {
        {"MixtralForCausalLM", "mixtral", "\"num_experts_per_tok\":9", "num_experts_per_tok 9",
         "1 .. 8"},
        {"MixtralForCausalLM", "mixtral", "\"num_local_experts\":0", "num_local_experts",
         "[1, 512]"},
        {"Qwen3MoeForCausalLM", "qwen3_moe", "\"num_experts\":513", "num_experts", "[0, 512]"},
        {"Qwen3MoeForCausalLM", "qwen3_moe", "\"decoder_sparse_step\":0", "decoder_sparse_step",
         "[1, "},
        {"Qwen3MoeForCausalLM", "qwen3_moe", "\"mlp_only_layers\":[-1]", "mlp_only_layers[0]",
         "[0, 2)"},
        {"Qwen3MoeForCausalLM", "qwen3_moe", "\"mlp_only_layers\":\"all\"", "mlp_only_layers",
         "list of layer indices"},
        {"Qwen3MoeForCausalLM", "qwen3_moe", "\"norm_topk_prob\":\"yes\"", "norm_topk_prob",
         "true or false"},
        {"Qwen3MoeForCausalLM", "qwen3_moe", "\"use_sliding_window\":true", "use_sliding_window",
         "MistralForCausalLM"},
        {"Qwen2MoeForCausalLM", "qwen2_moe", "", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        err[0] = 0;
        int rc = parse_arch(&c, bad[i].arch, bad[i].mt, bad[i].extra, err, sizeof err);
        if (rc != -EINVAL || !strstr(err, bad[i].needle1) || !strstr(err, bad[i].needle2))
            fail_msg("case %zu (%s %s): rc %d, error '%s' (want '%s' and '%s')", i, bad[i].arch,
                     bad[i].extra, rc, err, bad[i].needle1, bad[i].needle2);
    }
}

/* bench/shapes' MoE configs read as the real models' (what `bench model --load-format dummy`
 * makes) */
static void test_moe_bench_shapes(void **st) {
    (void)st;
    model_config c;
    char dir[1200], err[1024];
    snprintf(dir, sizeof dir, "%s/bench/shapes/qwen3-30b-a3b", DISAGG_SOURCE_DIR);
    if (model_config_load(&c, dir, err, sizeof err)) fail_msg("%s", err);
    assert_int_equal(c.n_layers, 48);
    assert_int_equal(c.n_experts, 128);
    assert_int_equal(c.n_experts_per_tok, 8);
    assert_int_equal(c.moe_intermediate_size, 768);
    assert_int_equal(c.hidden_size, 2048);
    assert_int_equal(c.q_dim, 32 * 128);
    assert_int_equal(c.n_kv_heads, 4);
    assert_int_equal(c.vocab_size, 151936);
    assert_int_equal(c.norm_topk_prob, 1);
    for (int l = 0; l < 48; l++)
        assert_true(model_layer_is_moe(&c, l));
    snprintf(dir, sizeof dir, "%s/bench/shapes/mixtral-8x7b", DISAGG_SOURCE_DIR);
    if (model_config_load(&c, dir, err, sizeof err)) fail_msg("%s", err);
    assert_int_equal(c.n_layers, 32);
    assert_int_equal(c.n_experts, 8);
    assert_int_equal(c.n_experts_per_tok, 2);
    assert_int_equal(c.moe_intermediate_size, 14336);
    assert_int_equal(c.hidden_size, 4096);
    assert_int_equal(c.head_dim, 128);
    assert_int_equal(c.n_kv_heads, 8);
    assert_int_equal(c.vocab_size, 32000);
    assert_int_equal(c.sliding_window, 0);
}

/* A MoE checkpoint whose config.json disagrees with its tensors: the tensor and shapes named */
static void test_moe_load_errors(void **st) {
    (void)st;
    char src[1024], d[1200];
    json_t *g = fixture_model("qwen3moe-tiny", src, sizeof src);
    assert_non_null(g);
    json_decref(g);
    snprintf(d, sizeof d, "%s/moebad", g_tmp);
    const char *edit = "python3 -c \"import json,sys; p=sys.argv[1]+'/config.json'; "
                       "c=json.load(open(p)); c.update(json.loads(sys.argv[2])); "
                       "json.dump(c,open(p,'w'))\" %s '%s'";
    char cmd[2048];
    sh("rm -rf %s && cp -r %s %s", d, src, d);
    snprintf(cmd, sizeof cmd, edit, d, "{\"num_experts\": 9}");
    sh("%s", cmd);
    expect_load_error(d, "model.layers.0.mlp.gate.weight", "shape [8, 64]", "[9, 64]", NULL);
    sh("rm -rf %s && cp -r %s %s", d, src, d);
    snprintf(cmd, sizeof cmd, edit, d, "{\"moe_intermediate_size\": 16}");
    sh("%s", cmd);
    expect_load_error(d, "model.layers.0.mlp.experts.0.gate_proj.weight", "[16, 64]", NULL);
    /* layer 1 is dense in the checkpoint: made sparse, its router is missing */
    sh("rm -rf %s && cp -r %s %s", d, src, d);
    snprintf(cmd, sizeof cmd, edit, d, "{\"mlp_only_layers\": []}");
    sh("%s", cmd);
    expect_load_error(d, "missing tensor 'model.layers.1.mlp.gate.weight'", NULL);
    /* and the other way round: a sparse layer made dense leaves its experts without a place */
    sh("rm -rf %s && cp -r %s %s", d, src, d);
    snprintf(cmd, sizeof cmd, edit, d, "{\"mlp_only_layers\": [1, 2], \"intermediate_size\": 160}");
    sh("%s", cmd);
    expect_load_error(d, "model.layers.2.mlp.gate_proj.weight", "missing", NULL);
}

/* --load-format dummy: config.json alone; the same random weights every load */
static void dummy_case(const char *variant) {
    char d[1200], err[1024];
    snprintf(d, sizeof d, "%s/dummy-%s", g_tmp, variant);
    sh("rm -rf %s && mkdir -p %s && python3 %s/tools/gen_random_model.py --variant %s "
       "--out %s/full >/dev/null && cp %s/full/config.json %s/",
       d, d, DISAGG_SOURCE_DIR, variant, d, d, d);
    decoder_model m, m2;
    expect_load_error(d, "no *.safetensors", NULL); /* without dummy: the weights are needed */
    assert_int_equal(decoder_load_ex(&m, d, backend_cpu_default(), 0, 1, err, sizeof err), 0);
    assert_int_equal(decoder_load_ex(&m2, d, backend_cpu_default(), 0, 1, err, sizeof err), 0);
    assert_int_equal(m.w.st.n_files, 0);
    if (m.cfg.qk_norm) assert_non_null(m.w.layers[1].q_norm);
    assert_memory_equal(m.w.layers[1].wo.data, m2.w.layers[1].wo.data,
                        (size_t)m.cfg.hidden_size * m.cfg.q_dim * 2);
    if (m.cfg.n_experts) { /* layer 0 is sparse in both MoE variants */
        const layer_weights *L = &m.w.layers[0], *L2 = &m2.w.layers[0];
        assert_non_null(L->router.data);
        int last = m.cfg.n_experts - 1;
        assert_memory_equal(L->ex_down[last], L2->ex_down[last],
                            (size_t)m.cfg.hidden_size * m.cfg.moe_intermediate_size * 2);
        assert_memory_not_equal(L->ex_down[last], L->ex_down[0],
                                (size_t)m.cfg.hidden_size * m.cfg.moe_intermediate_size * 2);
    }
    decoder_state *s = decoder_state_init(&m, 8, 1);
    kv_store kv;
    assert_int_equal(kv_store_init(&kv, &m.cfg, 1, 16), 0);
    int32_t toks[4] = {1, 2, 3, 4}, table[1] = {0};
    float *lg = malloc((size_t)m.cfg.vocab_size * sizeof *lg);
    decoder_seq q = {toks, 4, 0, table, 1, lg, 0, NULL, NULL};
    assert_int_equal(decoder_forward(&m, s, &kv, &q, 1), 0);
    double sum = 0;
    for (int i = 0; i < m.cfg.vocab_size; i++) {
        assert_true(isfinite(lg[i]));
        sum += fabs(lg[i]);
    }
    assert_true(sum > 0);
    free(lg);
    kv_store_free(&kv);
    decoder_state_free(s);
    decoder_free(&m);
    decoder_free(&m2);
}

static void test_dummy_load(void **st) {
    (void)st;
    dummy_case("qwen3-tiny");
    dummy_case("qwen3moe-tiny"); /* the experts made up per name, too */
    dummy_case("mixtral-tiny");
}

/* --load-format dummy on an FP8 checkpoint's config.json: the random weights quantized in the
 * config's layout (the model runs the FP8 kernels the real checkpoint would), never silently
 * bf16; the same bytes every load.  The CPU keeps FP8 matrices dequantized to f32: each must be
 * the same config's unquantized dummy weights quantized in want_bn x want_bk blocks (0: the
 * whole dimension) and dequantized -- the layout is what this checks; the e4m3 arithmetic is
 * checked against numpy's in the FP8 goldens. */
static void dummy_fp8_case(const char *variant, int want_bn, int want_bk) {
    char d[1200], u[1300], err[1024];
    snprintf(d, sizeof d, "%s/dummy-%s", g_tmp, variant);
    snprintf(u, sizeof u, "%s/unquantized", d);
    sh("rm -rf %s && mkdir -p %s/unquantized && python3 %s/tools/gen_random_fp8.py --variant %s "
       "--out %s/full >/dev/null && cp %s/full/config.json %s/ && python3 -c \"import json,sys; "
       "c=json.load(open(sys.argv[1])); c.pop('quantization_config'); "
       "json.dump(c,open(sys.argv[2],'w'))\" %s/config.json %s/config.json",
       d, d, DISAGG_SOURCE_DIR, variant, d, d, d, d, u);
    decoder_model m, m2, mu;
    assert_int_equal(decoder_load_ex(&m, d, backend_cpu_default(), 0, 1, err, sizeof err), 0);
    assert_int_equal(decoder_load_ex(&m2, d, backend_cpu_default(), 0, 1, err, sizeof err), 0);
    assert_int_equal(decoder_load_ex(&mu, u, backend_cpu_default(), 0, 1, err, sizeof err), 0);
    const weight_mat *mats[] = {&m.w.layers[1].wq, &m.w.layers[1].wo, &m.w.layers[1].w_down},
                     *umats[] = {&mu.w.layers[1].wq, &mu.w.layers[1].wo, &mu.w.layers[1].w_down};
    for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
        const weight_mat *w = mats[i], *wu = umats[i];
        if (w->dtype != BACKEND_F32) /* bf16: the dummy weights went unquantized */
            fail_msg("%s: dummy matrix %zu is %s, not FP8 dequantized to float32", variant, i,
                     backend_dtype_name(w->dtype));
        assert_int_equal(wu->dtype, BACKEND_BF16);
        int N = w->rows, K = w->cols, bn = want_bn > 0 ? want_bn : N, bk = want_bk > 0 ? want_bk : K;
        int nkb = (K + bk - 1) / bk;
        float *f = malloc((size_t)N * K * sizeof *f), *sc = malloc((size_t)(N / bn + 1) * nkb * 4);
        uint8_t *q = malloc((size_t)N * K);
        assert_true(f && sc && q);
        const uint16_t *b16 = wu->data;
        for (size_t k = 0; k < (size_t)N * K; k++) {
            uint32_t x = (uint32_t)b16[k] << 16;
            memcpy(&f[k], &x, 4);
        }
        quant_fp8_matrix(q, sc, f, N, K, bn, bk);
        float e4m3[1];
        const float *got = w->data;
        for (int r = 0; r < N; r++)
            for (int c = 0; c < K; c++) {
                backend_e4m3_to_f32(e4m3, &q[(size_t)r * K + c], 1);
                float want = e4m3[0] * sc[(size_t)(r / bn) * nkb + c / bk];
                if (got[(size_t)r * K + c] != want)
                    fail_msg("%s: matrix %zu (%d x %d) [%d][%d] is %g; quantized in %d x %d "
                             "blocks it is %g",
                             variant, i, N, K, r, c, (double)got[(size_t)r * K + c], bn, bk,
                             (double)want);
            }
        free(f);
        free(sc);
        free(q);
    }
    assert_memory_equal(m.w.layers[1].wo.data, m2.w.layers[1].wo.data,
                        (size_t)m.w.layers[1].wo.rows * m.w.layers[1].wo.cols * 4);
    assert_int_not_equal(m.w.embed.dtype, BACKEND_F32); /* embeddings stay unquantized */
    decoder_free(&m);
    decoder_free(&m2);
    decoder_free(&mu);
}

static void test_dummy_load_fp8(void **st) {
    (void)st;
    dummy_fp8_case("qwen2-fp8-block-tiny", 128, 128); /* weight_block_size [128, 128] */
    dummy_fp8_case("llama-fp8-channel-tiny", 1, 0);   /* compressed-tensors channel */
    dummy_fp8_case("qwen3-fp8-tensor-tiny", 0, 0);    /* compressed-tensors tensor */
}

/* FP8 weights with a mixture of experts: refused at load naming both (the expert kernels take
 * no scales), for an FP8 config and for --quantization fp8 */
static void test_moe_fp8_refused(void **st) {
    (void)st;
    char d[1200], err[1024];
    snprintf(d, sizeof d, "%s/moe-fp8", g_tmp);
    sh("rm -rf %s && python3 %s/tools/gen_random_model.py --variant qwen3moe-tiny --out %s "
       ">/dev/null",
       d, DISAGG_SOURCE_DIR, d);
    decoder_model m;
    err[0] = 0;
    assert_int_not_equal(
        decoder_load_ex(&m, d, backend_cpu_default(), 0, DECODER_LOAD_FP8, err, sizeof err), 0);
    if (!strstr(err, "--quantization fp8") || !strstr(err, "mixture-of-experts"))
        fail_msg("-q fp8 on a MoE model: '%s'", err);
    sh("python3 -c \"import json,sys; p=sys.argv[1]+'/config.json'; c=json.load(open(p)); "
       "c['quantization_config']={'quant_method':'fp8','weight_block_size':[128,128]}; "
       "json.dump(c,open(p,'w'))\" %s",
       d);
    expect_load_error(d, "quantization_config", "mixture-of-experts", "accepted", NULL);
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
    decoder_model m;
    assert_int_equal(decoder_load(&m, "Org/Tiny", 0, err, sizeof err), 0);
    assert_int_equal(m.cfg.n_layers, 2);
    assert_int_equal(m.w.embed.dtype, CPU_BF16);
    decoder_free(&m);
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
    decoder_model a, b;
    assert_int_equal(decoder_load(&a, g_src, 0, err, sizeof err), 0);
    assert_int_equal(decoder_load(&b, d, 0, err, sizeof err), 0);
    assert_true(b.w.st.n_files > 1);
    assert_int_equal(a.w.matrix_bytes, b.w.matrix_bytes);
    assert_memory_equal(a.w.layers[1].w_down.data, b.w.layers[1].w_down.data,
                        (size_t)a.cfg.hidden_size * a.cfg.intermediate_size * 2);
    assert_true(a.cfg.rope_theta == b.cfg.rope_theta);
    decoder_free(&a);
    decoder_free(&b);
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
    sh("cp %s/config.json %s/ && sed -i 's/Qwen2ForCausalLM/GPTNeoXForCausalLM/' %s/config.json",
       g_src, d, d);
    expect_load_error(d, "GPTNeoXForCausalLM", "Qwen2ForCausalLM", NULL);
    /* a checkpoint with tensors the description has no place for: Qwen2's q/k/v biases under
     * a Mistral config */
    sh("cp %s/config.json %s/ && sed -i 's/Qwen2ForCausalLM/MistralForCausalLM/' %s/config.json",
       g_src, d, d);
    expect_load_error(d, "self_attn.", "bias", "no place in MistralForCausalLM", NULL);
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
        cmocka_unit_test(test_load_errors),      cmocka_unit_test(test_arch_descriptions),
        cmocka_unit_test(test_dummy_load),       cmocka_unit_test(test_dummy_load_fp8),
        cmocka_unit_test(test_moe_fp8_refused),       cmocka_unit_test(test_moe_descriptions),
        cmocka_unit_test(test_moe_load_errors),  cmocka_unit_test(test_moe_bench_shapes),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
