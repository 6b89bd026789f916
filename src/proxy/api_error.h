/*
 * api_error — OpenAI-style error bodies, the shape the `openai` clients parse:
 * {"error": {"message": ..., "type": ..., "param": null, "code": <status>}}.
 * The type names follow the status (BadRequestError, NotFoundError, ...), as
 * the OpenAI-compatible server (src/server) does.
 */
#ifndef DISAGG_PROXY_API_ERROR_H
#define DISAGG_PROXY_API_ERROR_H

/* "BadRequestError" for 400, "NotFoundError" for 404, ... */
const char *api_error_type(int status);
/* A malloc'ed JSON error body (never NULL unless out of memory). */
char *api_error_json(int status, const char *message);

#endif
