#include "common/config.h"

#include <ctype.h>
#include <errno.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/util.h"

/* Flags every binary shares take one environment name for all of them; the rest are named
 * after the program, so two binaries' flags of the same name never collide. */
static const char *const shared_names[] = {"instance", "run-dir", "log-level"};

static void env_name(const char *prog, const char *name, char *buf, size_t len)
{
	size_t n = (size_t)snprintf(buf, len, "PIPELINE_");
	bool shared = false;
	for (size_t i = 0; i < sizeof(shared_names) / sizeof(shared_names[0]); i++)
		shared = shared || !strcmp(name, shared_names[i]);
	if (!shared) {
		/* The program's first word: "pipectl generate" -> PIPECTL_. */
		for (const char *p = prog; *p && *p != ' ' && n + 2 < len; p++)
			buf[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
		if (n + 1 < len)
			buf[n++] = '_';
	}
	for (const char *p = name; *p && n + 1 < len; p++)
		buf[n++] = *p == '-' ? '_' : (char)toupper((unsigned char)*p);
	buf[n] = 0;
}

static int set_value(const char *prog, const struct opt *o, const char *value, const char *source)
{
	int rc = 0;
	char *end = NULL;
	switch (o->kind) {
	case OPT_STRING:
		*(const char **)o->dest = value;
		return 0;
	case OPT_SIZE:
		rc = parse_size(value, (uint64_t *)o->dest);
		if (rc) {
			fprintf(stderr, "%s: %s '%s' is not a size (examples: 6GiB, 512MiB, 4096)\n", prog, source,
				value);
			return -EINVAL;
		}
		return 0;
	case OPT_INT: {
		errno = 0;
		long v = strtol(value, &end, 10); /* "010" is ten, not eight; "0x10" is no integer */
		if (errno || end == value || *end) {
			fprintf(stderr, "%s: %s '%s' is not an integer\n", prog, source, value);
			return -EINVAL;
		}
		*(long *)o->dest = v;
		return 0;
	}
	case OPT_DOUBLE: {
		errno = 0;
		double v = strtod(value, &end);
		if (errno || end == value || *end) {
			fprintf(stderr, "%s: %s '%s' is not a number\n", prog, source, value);
			return -EINVAL;
		}
		*(double *)o->dest = v;
		return 0;
	}
	case OPT_BOOL:
		if (!strcmp(value, "1") || !strcmp(value, "true") || !strcmp(value, "yes")) {
			*(bool *)o->dest = true;
		} else if (!strcmp(value, "0") || !strcmp(value, "false") || !strcmp(value, "no")) {
			*(bool *)o->dest = false;
		} else {
			fprintf(stderr, "%s: %s '%s' is not a boolean (1/0, true/false)\n", prog, source, value);
			return -EINVAL;
		}
		return 0;
	}
	return -EINVAL;
}

void config_usage(const char *prog, const char *summary, const struct opt *opts)
{
	printf("usage: %s [options]\n%s\n\noptions (each also read from the environment variable shown):\n", prog,
	       summary);
	for (const struct opt *o = opts; o->name; o++) {
		char env[96], flag[96];
		env_name(prog, o->name, env, sizeof(env));
		snprintf(flag, sizeof(flag), "--%s%s", o->name,
			 o->kind == OPT_BOOL ? "" : o->kind == OPT_SIZE ? " SIZE" : " VALUE");
		printf("  %-28s %s", flag, o->help);
		if (o->def)
			printf(" (default %s)", o->def);
		printf(" [%s]\n", env);
	}
	printf("  %-28s %s\n", "--help", "print this help and exit");
}

int config_parse(const char *prog, const char *summary, const struct opt *opts, int argc, char **argv,
		 char **positional, int *n_positional)
{
	int npos = 0;
	/* Defaults, then environment, then flags. */
	for (const struct opt *o = opts; o->name; o++) {
		if (o->def && set_value(prog, o, o->def, "default") != 0)
			return -EINVAL;
		char env[96];
		env_name(prog, o->name, env, sizeof(env));
		const char *v = getenv(env);
		if (v && *v) {
			char src[128];
			snprintf(src, sizeof(src), "environment %s", env);
			if (set_value(prog, o, v, src) != 0)
				return -EINVAL;
		}
	}
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
			config_usage(prog, summary, opts);
			return 1;
		}
		if (strncmp(a, "--", 2) != 0 || a[2] == 0) {
			if (!positional) {
				fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, a);
				return -EINVAL;
			}
			positional[npos++] = argv[i];
			continue;
		}
		const char *name = a + 2;
		const char *eq = strchr(name, '=');
		size_t nlen = eq ? (size_t)(eq - name) : strlen(name);
		const struct opt *o = opts;
		for (; o->name; o++)
			if (strlen(o->name) == nlen && !strncmp(o->name, name, nlen))
				break;
		if (!o->name) {
			fprintf(stderr, "%s: unknown flag '%s' (see --help)\n", prog, a);
			return -EINVAL;
		}
		const char *value;
		if (o->kind == OPT_BOOL && !eq) {
			value = "1";
		} else if (eq) {
			value = eq + 1;
		} else if (i + 1 < argc) {
			value = argv[++i];
		} else {
			fprintf(stderr, "%s: flag --%s needs a value\n", prog, o->name);
			return -EINVAL;
		}
		char src[128];
		snprintf(src, sizeof(src), "--%s", o->name);
		if (set_value(prog, o, value, src) != 0)
			return -EINVAL;
	}
	if (n_positional)
		*n_positional = npos;
	return 0;
}
