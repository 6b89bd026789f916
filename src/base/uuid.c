/* uuid — see uuid.h. */
#include "base/uuid.h"

#include "base/rng.h"

#include <stdint.h>
#include <string.h>

void uuid4(char out[UUID_STR_LEN + 1]) {
    uint8_t b[16];
    uint64_t x = rng_global_next(), y = rng_global_next();
    memcpy(b, &x, 8);
    memcpy(b + 8, &y, 8);
    b[6] = (uint8_t)((b[6] & 0x0f) | 0x40); /* version 4 */
    b[8] = (uint8_t)((b[8] & 0x3f) | 0x80); /* RFC 4122 variant */
    static const char hex[] = "0123456789abcdef";
    char *o = out;
    for (int i = 0; i < 16; i++) {
        if (i == 4 || i == 6 || i == 8 || i == 10) *o++ = '-';
        *o++ = hex[b[i] >> 4];
        *o++ = hex[b[i] & 15];
    }
    *o = 0;
}
