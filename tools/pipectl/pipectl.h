/* pipectl.h - what the pipectl subcommands share: the instance they talk to, timeouts,
 * connecting to a service and reporting an RPC failure in words.
 *
 * main.c parses the global flags into a struct pipectl and hands it to one cmd_* function,
 * which parses its own flags (argv[0] is the command name) and returns the process exit
 * status: 0 success, 1 failure (a message on stderr), 2 bad usage.
 *
 *   struct rpc_client *c = pipectl_connect(p, "kv-store");     // NULL: message printed
 *   rc = rpc_call(c, &req, &rep, pipectl_timeout_ms(p, 10));
 *   if (rc) return pipectl_rpc_failed(p, "kv-store", "PING", rc, &rep);
 */
#ifndef PIPECTL_H
#define PIPECTL_H
#include <limits.h>
#include <stdbool.h>
#include <stdint.h>

#include <jansson.h>

#include "common/bus.h"
#include "common/config.h"
#include "common/protocol.h"

#define PIPECTL_EXIT_OK 0
#define PIPECTL_EXIT_FAIL 1
#define PIPECTL_EXIT_USAGE 2

/* Seconds a request/reply command waits when --timeout is not given. */
#define PIPECTL_DEFAULT_TIMEOUT_S 10
#define PIPECTL_TIMEOUT_MAX_S (INT_MAX / 1000) /* a wait in milliseconds fits an int */

struct pipectl {
	const char *instance; /* --instance (borrowed from argv/environ) */
	char run_dir[256];    /* --run-dir or run_dir_default(instance) */
	long timeout_s;	      /* --timeout; -1 when not given (each command has its own default) */
	void *zctx;	      /* ZeroMQ context, owned by main */
};

/* The service names a command accepts, NULL-terminated. */
extern const char *const pipectl_services[];

/* Is name one of pipectl_services? Prints an error naming the choices when not. */
bool pipectl_check_service(const char *name);

/* The timeout to use in milliseconds: --timeout if given, else def_s. */
int pipectl_timeout_ms(const struct pipectl *p, long def_s);

/* Creates a client of service, after checking that its control socket exists (a missing
 * socket is reported at once instead of after a timeout). Returns NULL after printing why.
 * The caller owns the client (rpc_client_destroy). */
struct rpc_client *pipectl_connect(struct pipectl *p, const char *service);

/* Prints why a call to service failed: rc from rpc_call/rpc_wait, rep the MSG_ERROR reply
 * when rc is -EREMOTEIO (freed here). what names the request. Returns PIPECTL_EXIT_FAIL. */
int pipectl_rpc_failed(const struct pipectl *p, const char *service, const char *what, int rc, struct msg *rep);

/* Whether the service that answered `what` named itself `asked`; prints why not. */
bool pipectl_same_service(const char *asked, const struct bytes *named, const char *what);

/* Parses text (len bytes from service, `what` names it: "stats", "parameters") as a JSON object.
 * Returns the object, or NULL after printing why. */
json_t *pipectl_json_object(const char *service, const char *what, const char *text, size_t len);

/* Parses a subcommand's flags: usage is "pipectl <usage>", summary one paragraph. With
 * n_pos_min/max the count of positional arguments is checked (pos holds them; it must have
 * argc entries). Returns 0 on success, 1 when --help was printed, 2 after a usage error. */
int pipectl_parse(const char *usage, const char *summary, const struct opt *opts, int argc, char **argv,
		  char **pos, int n_pos_min, int n_pos_max, int *n_pos);

/* Parses "1,2,3" into a malloc'd array (the caller frees *out). Every element must be a
 * decimal integer in 0..max. Returns 0, or -EINVAL after writing the reason into err. */
int pipectl_parse_ids(const char *text, uint64_t max, uint64_t **out, uint32_t *n, char *err, size_t errlen);

/* The subcommands: argv[0] is the command name. Each returns an exit status. */
int cmd_hello(struct pipectl *p, int argc, char **argv);
int cmd_ping(struct pipectl *p, int argc, char **argv);
int cmd_wait_ready(struct pipectl *p, int argc, char **argv);
int cmd_stats(struct pipectl *p, int argc, char **argv);
int cmd_shutdown(struct pipectl *p, int argc, char **argv);
int cmd_generate(struct pipectl *p, int argc, char **argv);
int cmd_summary(struct pipectl *p, int argc, char **argv);
int cmd_get(struct pipectl *p, int argc, char **argv);
int cmd_tune(struct pipectl *p, int argc, char **argv);

#endif
