/* file — see file.h. */
#include "base/file.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

char *file_read_text(const char *path, size_t cap) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *buf = malloc(cap + 1);
    size_t n = buf ? fread(buf, 1, cap, f) : 0;
    fclose(f);
    if (buf)
        buf[n] = 0;
    else
        errno = ENOMEM;
    return buf;
}
