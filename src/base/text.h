/*
 * text — small helpers for user-facing messages shared by every layer: the
 * edit distance behind "did you mean ...?" hints, and how a JSON value's type
 * is named in an error ("got an array").
 */
#ifndef DISAGG_BASE_TEXT_H
#define DISAGG_BASE_TEXT_H

#include <jansson.h>

/* Levenshtein distance of a and b (bytes, ASCII case-insensitive); strings over 256 bytes give the
 * longer length (never a useful hint). */
int text_edit_distance(const char *a, const char *b);
/* "an object", "an array", "a string", "an integer", "a number", "a boolean", "null". */
const char *text_json_kind(const json_t *v);

#endif
