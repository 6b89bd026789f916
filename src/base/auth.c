#include "base/auth.h"

#include <errno.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/params.h>
#include <openssl/rand.h>
#include <stdlib.h>

int auth_hmacv(const void *key, size_t key_len, const void *const *parts, const size_t *lens,
               size_t n, uint8_t out[AUTH_MAC_LEN]) {
    if (!key || key_len == 0)
        return -EINVAL;
    EVP_MAC *mac = EVP_MAC_fetch(NULL, "HMAC", NULL);
    EVP_MAC_CTX *ctx = mac ? EVP_MAC_CTX_new(mac) : NULL;
    if (!ctx) {
        EVP_MAC_free(mac);
        return -ENOMEM;
    }
    OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", (char *)"SHA256", 0),
                           OSSL_PARAM_construct_end()};
    size_t out_len = 0;
    int ok = EVP_MAC_init(ctx, key, key_len, params);
    for (size_t i = 0; ok && i < n; i++)
        ok = EVP_MAC_update(ctx, (const unsigned char *)parts[i], lens[i]);
    ok = ok && EVP_MAC_final(ctx, out, &out_len, AUTH_MAC_LEN) && out_len == AUTH_MAC_LEN;
    EVP_MAC_CTX_free(ctx);
    EVP_MAC_free(mac);
    return ok ? 0 : -EIO;
}

int auth_hmac(const void *key, size_t key_len, const void *msg, size_t msg_len,
              uint8_t out[AUTH_MAC_LEN]) {
    const void *parts[1] = {msg};
    size_t lens[1] = {msg_len};
    return auth_hmacv(key, key_len, parts, lens, 1, out);
}

bool auth_equal(const void *a, const void *b, size_t len) {
    return CRYPTO_memcmp(a, b, len) == 0;
}

int auth_random(void *buf, size_t len) {
    return RAND_bytes((unsigned char *)buf, (int)len) == 1 ? 0 : -EIO;
}

const char *auth_secret_resolve(const char *configured) {
    if (configured && configured[0])
        return configured;
    const char *env = getenv(AUTH_SECRET_ENV);
    return (env && env[0]) ? env : NULL;
}

void auth_hex(const uint8_t *bytes, size_t len, char *out) {
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < len; i++) {
        out[2 * i] = digits[bytes[i] >> 4];
        out[2 * i + 1] = digits[bytes[i] & 15];
    }
    out[2 * len] = '\0';
}

void auth_thread_stop(void) {
    OPENSSL_thread_stop();
}
