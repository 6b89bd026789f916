/*
 * api_error — OpenAI-style error bodies, the shape the `openai` clients parse:
 * {"error": {"message": ..., "type": ..., "param": null|"field", "code": <status>}}.
 * The type names follow the status (base/http_msg.h http_error_type, which
 * the OpenAI-compatible server in src/server uses too).
 */
#ifndef DISAGG_PROXY_API_ERROR_H
#define DISAGG_PROXY_API_ERROR_H

/* A malloc'ed JSON error body (never NULL unless out of memory). */
char *api_error_json(int status, const char *message);
/* The same with "param" naming the offending request field (null when
 * param is NULL or empty), as `disagg serve` answers a bad field. */
char *api_error_json_param(int status, const char *param, const char *message);

#endif
