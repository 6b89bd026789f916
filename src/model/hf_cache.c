/*
 * hf_cache — offline Hugging Face cache lookup (layout of huggingface_hub's cache:
 * models--ORG--NAME/{refs/main, snapshots/<commit>/...}).
 */
#include "model/hf_cache.h"

#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int is_dir(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0 && S_ISDIR(sb.st_mode);
}

/* Looks in one hub directory; 0 and out set when found. */
static int hf_lookup(const char *hub, const char *repo_dir, const char *revision, char *out,
                     size_t outlen) {
    char base[4096], p[4096 + 512];
    snprintf(base, sizeof base, "%s/%s", hub, repo_dir);
    if (!is_dir(base)) return -ENOENT;
    if (revision) {
        /* a commit hash names a snapshot; a branch or tag names a refs/ file holding one */
        snprintf(p, sizeof p, "%s/snapshots/%s", base, revision);
        if (is_dir(p)) {
            snprintf(out, outlen, "%s", p);
            return 0;
        }
    }
    snprintf(p, sizeof p, "%s/refs/%s", base, revision ? revision : "main");
    FILE *f = fopen(p, "r");
    if (f) {
        char rev[256] = {0};
        int ok = fgets(rev, sizeof rev, f) != NULL;
        fclose(f);
        rev[strcspn(rev, "\r\n \t")] = 0;
        if (ok && rev[0] && !strchr(rev, '/')) {
            snprintf(p, sizeof p, "%s/snapshots/%s", base, rev);
            if (is_dir(p)) {
                snprintf(out, outlen, "%s", p);
                return 0;
            }
        }
    }
    if (revision) return -ENOENT; /* an explicit revision never falls back */
    /* no usable refs/main: accept a single snapshot */
    snprintf(p, sizeof p, "%s/snapshots", base);
    DIR *d = opendir(p);
    if (!d) return -ENOENT;
    struct dirent *de;
    int n = 0;
    char only[512] = {0};
    while ((de = readdir(d)))
        if (de->d_name[0] != '.') {
            n++;
            snprintf(only, sizeof only, "%s", de->d_name);
        }
    closedir(d);
    if (n != 1) return -ENOENT;
    snprintf(out, outlen, "%s/%s", p, only);
    return 0;
}

int hf_cache_resolve(const char *model, char *out, size_t outlen, char *err, size_t errlen) {
    return hf_cache_resolve_rev(model, NULL, out, outlen, err, errlen);
}

int hf_cache_resolve_rev(const char *model, const char *revision, char *out, size_t outlen,
                         char *err, size_t errlen) {
    if (revision && (!*revision || strstr(revision, "..") || revision[0] == '/')) {
        snprintf(err, errlen,
                 "revision '%s' is not a branch, tag or commit hash (e.g. main or a 40-hex "
                 "commit)",
                 revision);
        return -EINVAL;
    }
    if (!model || !*model) {
        snprintf(
            err, errlen,
            "empty MODEL: give a model directory or a hub name such as Qwen/Qwen2.5-0.5B-Instruct");
        return -EINVAL;
    }
    if (is_dir(model)) {
        snprintf(out, outlen, "%s", model);
        return 0;
    }
    const char *slash = strchr(model, '/');
    if (!slash || slash == model || !slash[1] || strchr(slash + 1, '/') || model[0] == '.') {
        snprintf(err, errlen,
                 "model '%s' is not a directory and not a hub name of the form ORG/NAME", model);
        return -ENOENT;
    }
    char repo_dir[1024];
    snprintf(repo_dir, sizeof repo_dir, "models--%.*s--%s", (int)(slash - model), model, slash + 1);

    char hubs[4][2048];
    int nh = 0;
    const char *e;
    if ((e = getenv("HF_HUB_CACHE")) && *e) snprintf(hubs[nh++], sizeof hubs[0], "%s", e);
    if ((e = getenv("HF_HOME")) && *e) snprintf(hubs[nh++], sizeof hubs[0], "%s/hub", e);
    if ((e = getenv("XDG_CACHE_HOME")) && *e)
        snprintf(hubs[nh++], sizeof hubs[0], "%s/huggingface/hub", e);
    if ((e = getenv("HOME")) && *e)
        snprintf(hubs[nh++], sizeof hubs[0], "%s/.cache/huggingface/hub", e);
    for (int i = 0; i < nh; i++)
        if (hf_lookup(hubs[i], repo_dir, revision, out, outlen) == 0) return 0;

    size_t o;
    if (revision)
        o = (size_t)snprintf(err, errlen,
                             "revision '%s' of model '%s' is not in the Hugging Face cache (no "
                             "snapshots/%s/ or refs/%s); looked in:",
                             revision, model, revision, revision);
    else
        o = (size_t)snprintf(
            err, errlen,
            "model '%s' is not a local directory and not in the Hugging Face cache; looked in:",
            model);
    for (int i = 0; i < nh && o < errlen; i++)
        o += (size_t)snprintf(err + o, errlen - o, " %s/%s/", hubs[i], repo_dir);
    if (o < errlen)
        snprintf(
            err + o, errlen - o,
            ". Download it where network is available (`huggingface-cli download %s`, which fills "
            "~/.cache/huggingface/hub or $HF_HOME/hub) or pass the model's directory "
            "(config.json, *.safetensors, tokenizer.json)",
            model);
    return -ENOENT;
}
