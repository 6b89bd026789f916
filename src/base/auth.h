/*
 * auth — the shared-secret primitives behind authenticated KV ports
 * (docs/security.md): HMAC-SHA256 (OpenSSL), a constant-time compare, random
 * nonces from the OS CSPRNG, and the one rule for where the secret comes from.
 * No hand-rolled crypto: every primitive here is OpenSSL's.
 */
#ifndef DISAGG_BASE_AUTH_H
#define DISAGG_BASE_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define AUTH_MAC_LEN 32   /* HMAC-SHA256 output */
#define AUTH_NONCE_LEN 32 /* challenge nonce */
#define AUTH_SECRET_ENV "DISAGG_KV_SECRET"

/* out = HMAC-SHA256(key, msg). Returns 0, or -EINVAL when key is empty. */
int auth_hmac(const void *key, size_t key_len, const void *msg, size_t msg_len,
              uint8_t out[AUTH_MAC_LEN]);
/* HMAC over the concatenation of n parts (parts[i], lens[i]) without copying. */
int auth_hmacv(const void *key, size_t key_len, const void *const *parts, const size_t *lens,
               size_t n, uint8_t out[AUTH_MAC_LEN]);
/* Constant-time equality of two len-byte buffers. */
bool auth_equal(const void *a, const void *b, size_t len);
/* Fill buf with len bytes from the OS CSPRNG. Returns 0 or -EIO. */
int auth_random(void *buf, size_t len);
/* The secret in effect: `configured` when non-NULL and non-empty (a config key
 * or a flag), else $DISAGG_KV_SECRET when set and non-empty, else NULL (no
 * authentication: vLLM/Mooncake peers work unchanged). */
const char *auth_secret_resolve(const char *configured);
/* Free this thread's OpenSSL state now (OPENSSL_thread_stop): a detached
 * thread that used the functions above calls it before it signals that it is
 * done, so that nothing of it is left when the process exits. */
void auth_thread_stop(void);
/* Lowercase hex of len bytes into out (2*len+1 bytes). */
void auth_hex(const uint8_t *bytes, size_t len, char *out);

#endif
