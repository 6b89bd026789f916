/*
 * uuid — random (version 4, RFC 4122 variant) UUIDs in their 36-character
 * text form ("xxxxxxxx-xxxx-4xxx-[89ab]xxx-xxxxxxxxxxxx"), drawn from the
 * process-wide generator of base/rng.h: unique, not secret.
 */
#ifndef DISAGG_BASE_UUID_H
#define DISAGG_BASE_UUID_H

#define UUID_STR_LEN 36

/* Writes a new UUID and its NUL into out. */
void uuid4(char out[UUID_STR_LEN + 1]);

#endif
