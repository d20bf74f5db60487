/* config.h - command-line flags with environment overrides, one table per binary.
 *
 *   uint64_t budget; char *model = NULL;
 *   struct opt opts[] = {
 *       {"model", OPT_STRING, &model, NULL, "checkpoint directory (required)"},
 *       {"dram-budget", OPT_SIZE, &budget, "4GiB", "host memory for weights"},
 *       {0}};
 *   int rc = config_parse("ssd-loader", "reads weights into shared memory", opts, argc, argv, NULL);
 *   if (rc > 0) return 0;      // --help was printed
 *   if (rc < 0) return 2;      // the message naming the bad flag was printed
 *
 * Precedence: a flag on the command line, else an environment variable, else the default.
 * The variable is PIPELINE_<PROG>_<NAME> (upper case, '-' -> '_', PROG the program's first word:
 * PIPELINE_SSD_LOADER_DRAM_BUDGET, PIPELINE_PIPECTL_TIMEOUT), except for the flags every
 * binary shares, which are PIPELINE_INSTANCE, PIPELINE_RUN_DIR and PIPELINE_LOG_LEVEL; --help
 * shows each flag's variable. Flags are written --name VALUE or --name=VALUE;
 * OPT_BOOL flags take no value (--name, or PIPELINE_NAME=1). */
#ifndef PIPELINE_CONFIG_H
#define PIPELINE_CONFIG_H
#include <stdbool.h>
#include <stdint.h>
#ifdef __cplusplus
extern "C" {
#endif

enum opt_kind {
	OPT_STRING = 1, /* dest: char ** (points into argv/environ or the default; not owned) */
	OPT_SIZE = 2,	/* dest: uint64_t * ("6GiB") */
	OPT_INT = 3,	/* dest: long * */
	OPT_DOUBLE = 4, /* dest: double * */
	OPT_BOOL = 5,	/* dest: bool * */
};

struct opt {
	const char *name; /* NULL ends the table */
	enum opt_kind kind;
	void *dest;
	const char *def;  /* default as text; NULL leaves dest as it is */
	const char *help;
};

/* Parses argv[1..] against opts. Positional arguments are collected in order into
 * positional (array of argc entries, may be NULL if none are allowed) with their count in
 * *n_positional. Returns 0 on success, 1 when --help was printed, -EINVAL after printing
 * a message that names the bad flag or value. */
int config_parse(const char *prog, const char *summary, const struct opt *opts, int argc, char **argv,
		 char **positional, int *n_positional);

/* Prints the usage table for opts to stdout. */
void config_usage(const char *prog, const char *summary, const struct opt *opts);

#ifdef __cplusplus
}
#endif
#endif
