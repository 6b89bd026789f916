/*
 * file — reading a small text file whole (config.json, generation_config.json, a chat
 * template file), for the layers above that parse it.
 */
#ifndef DISAGG_BASE_FILE_H
#define DISAGG_BASE_FILE_H

#include <stddef.h>

/* The first cap bytes of path (a longer file is cut there), NUL-terminated, malloc'ed; NULL
 * with errno set when it cannot be opened or memory runs out. */
char *file_read_text(const char *path, size_t cap);

#endif
