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
/* Close enough for a "did you mean" hint: a and b without their leading dashes differ in at
 * most 40 % of the longer one's characters (about difflib's ratio >= 0.6, argparse's cutoff),
 * so "--reasoning-parser" does not suggest "--tool-call-parser".  *dist gets the distance. */
int text_close_name(const char *a, const char *b, int *dist);
/* "an object", "an array", "a string", "an integer", "a number", "a boolean", "null". */
const char *text_json_kind(const json_t *v);

#endif
