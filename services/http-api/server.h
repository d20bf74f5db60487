/* server.h - http-api's HTTP side (libmicrohttpd): routing, request bodies, the bearer token,
 * replies and server-sent event streams.
 *
 *   struct server_config cfg = {...};
 *   struct server *s;
 *   rc = server_start(&cfg, &s, err, sizeof(err));    // listening once it returns 0
 *   ... until a signal ...
 *   server_stop(&s);
 *
 * Endpoints: GET /health, GET /metrics (Prometheus text, metrics.h; like /health it needs no key),
 * GET /v1/models, POST /v1/completions, POST /v1/chat/completions.
 * Errors are OpenAI's {"error": {"message", "type", "param", "code"}}. */
#ifndef HTTP_API_SERVER_H
#define HTTP_API_SERVER_H
#include <stddef.h>
#include <stdint.h>

#include "services/http-api/openai.h"
#include "services/http-api/runner_client.h"

struct server_config {
	const char *listen_addr; /* an IPv4 address, e.g. "127.0.0.1" */
	uint16_t port;		 /* 0: the system picks one (server_port tells) */
	uint64_t max_body;	 /* bytes of a request body; more: 413 */
	long max_connections;	 /* connections served at once */
	long max_per_ip;	 /* ... from one client address (0: no limit) */
	unsigned idle_timeout_s; /* a connection that sends and takes nothing this long is closed (a slow
				  * client, one that stops reading, or an idle keep-alive one; not one waiting
				  * while the model makes its answer); 0: never */
	int send_buffer;	 /* SO_SNDBUF of each connection in bytes; 0: the kernel's, which grows */
	const char *cors_origin; /* Access-Control-Allow-Origin of every answer, and preflights
				  * answered; NULL: none (one server a process) */
	const char *api_key;	 /* the bearer token every request but /health and /metrics needs; NULL: none */
	const char *model_id;	 /* the model's name in replies; NULL: asked from the instance */
	struct api_limits limits;
	struct runner_client *runner;	 /* serves the generations */
	const struct runner_options *ro; /* for /health and the model's name */
};

struct server;

/* Starts listening and serving on threads of its own. Returns 0 with *out set, or -errno with
 * err filled (the address taken, say). */
int server_start(const struct server_config *cfg, struct server **out, char *err, size_t errlen);

/* The port it listens on. */
uint16_t server_port(const struct server *s);

/* Stops listening and ends every connection. *s is NULL after. */
void server_stop(struct server **s);

#endif
