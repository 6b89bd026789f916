/*
 * test_model_fixture — shared by the model unit tests: makes the random tiny test models
 * with tools/gen_random_qwen2.py (Qwen2: "tiny-f32", "tiny-bf16") or
 * tools/gen_random_model.py (the other architectures: "llama-tiny", "qwen3-tiny",
 * "mistral-tiny"; numpy only) or tools/gen_random_fp8.py (the FP8 checkpoints: names with
 * "fp8" or "online") in a per-user temp directory, checks
 * their weights digest against the golden file's, and reads the golden JSON.
 */
#ifndef DISAGG_TEST_MODEL_FIXTURE_H
#define DISAGG_TEST_MODEL_FIXTURE_H

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* name: "tiny-f32" | "tiny-bf16"; gen_args as recorded in the golden file.  Fills dir.
 * Returns the golden JSON (caller json_decref) or NULL on failure (printed). */
static json_t *fixture_model(const char *name, char *dir, size_t dirlen) {
    char gpath[1024];
    snprintf(gpath, sizeof gpath, "%s/tests/data/model/golden-%s.json", DISAGG_SOURCE_DIR, name);
    json_error_t je;
    json_t *g = json_load_file(gpath, 0, &je);
    if (!g) {
        fprintf(stderr, "fixture: %s: %s\n", gpath, je.text);
        return NULL;
    }
    const char *want = json_string_value(json_object_get(g, "weights_sha256"));
    int seed = (int)json_integer_value(json_object_get(g, "seed"));
    int qwen2 = !strncmp(name, "tiny-", 5), fp8 = strstr(name, "fp8") || strstr(name, "online");
    char args[128];
    if (qwen2)
        snprintf(args, sizeof args, "%s --seed %d",
                 !strcmp(name, "tiny-f32") ? "--shape tiny --dtype f32 --untied"
                                           : "--shape tiny --dtype bf16",
                 seed);
    else
        snprintf(args, sizeof args, "--variant %s", name);
    const char *tmp = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    snprintf(dir, dirlen, "%s/disagg-test-models-%d/%s-%d", tmp, (int)getuid(), name, seed);
    char marker[1200], line[256] = {0};
    snprintf(marker, sizeof marker, "%s/weights_sha256", dir);
    FILE *f = fopen(marker, "r");
    if (f) {
        if (!fgets(line, sizeof line, f)) line[0] = 0;
        fclose(f);
    }
    line[strcspn(line, "\n")] = 0;
    if (strcmp(line, want)) {
        char cmd[4096];
        snprintf(cmd, sizeof cmd,
                 "mkdir -p %s && python3 %s/tools/%s --out %s %s | sed "
                 "-n 's/^weights_sha256 //p' > %s",
                 dir, DISAGG_SOURCE_DIR,
                 qwen2 ? "gen_random_qwen2.py"
                 : fp8 ? "gen_random_fp8.py"
                       : "gen_random_model.py",
                 dir, args, marker);
        if (system(cmd) != 0) {
            fprintf(stderr, "fixture: generator failed: %s\n", cmd);
            json_decref(g);
            return NULL;
        }
        f = fopen(marker, "r");
        line[0] = 0;
        if (f) {
            if (!fgets(line, sizeof line, f)) line[0] = 0;
            fclose(f);
        }
        line[strcspn(line, "\n")] = 0;
        if (strcmp(line, want)) {
            fprintf(
                stderr,
                "fixture: generated %s weights digest '%s' != golden '%s' (numpy RNG changed?)\n",
                name, line, want);
            json_decref(g);
            return NULL;
        }
    }
    return g;
}

#endif
