/*
 * hf_cache — resolves a MODEL argument to a local directory: an existing directory is used
 * as is; otherwise ORG/NAME is looked up offline in the Hugging Face hub cache
 * ($HF_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub),
 * in models--ORG--NAME/snapshots/<rev>/ with <rev> from refs/main (or the only snapshot).
 * Never touches the network.
 */
#ifndef DISAGG_MODEL_HF_CACHE_H
#define DISAGG_MODEL_HF_CACHE_H

#include <stddef.h>

/* out gets the directory.  On failure returns -ENOENT/-EINVAL and err says where it looked
 * and how to put the model there. */
int hf_cache_resolve(const char *model, char *out, size_t outlen, char *err, size_t errlen);

/* As hf_cache_resolve, at a given revision (vLLM's --revision): a commit hash (the
 * snapshots/<rev>/ directory) or a branch or tag (refs/<rev> holds the commit).  NULL =
 * refs/main.  A local directory is used as is (a revision applies to hub names only). */
int hf_cache_resolve_rev(const char *model, const char *revision, char *out, size_t outlen,
                         char *err, size_t errlen);

#endif
