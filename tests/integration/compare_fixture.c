/* compare_fixture.c - the model-fidelity fixtures (tests/fixtures/NAME.json, written by
 * scripts/fixtures/hf_reference.py from Hugging Face transformers) read and compared for
 * tests/integration/fidelity.sh, which has no JSON parser of its own.
 *
 *   compare_fixture args FIXTURE          the make-synthetic-model arguments, one a line
 *   compare_fixture files FIXTURE         "SHA256  NAME" lines, the input of sha256sum -c
 *   compare_fixture prompt FIXTURE        the prompt's ids, comma separated (for --tokens)
 *   compare_fixture logits FIXTURE FILE   FILE (raw float32 little-endian, as pipectl generate
 *                                         --dump-logits writes it) against logits_last
 *   compare_fixture tokens FIXTURE IDS [--eos-may-stop]
 *                                         IDS (as generate and run-local print them) against
 *                                         the greedy continuation
 *
 * logits passes when the relative L2 error ||got - want|| / ||want|| is at most 1e-4. tokens
 * passes when every greedy token is identical, except that from the first step whose
 * top-1/top-2 margin in the fixture is below 1e-4 (a near tie, which float rounding may turn
 * either way) on nothing is compared. --eos-may-stop accepts a run that stopped early on an
 * EOS id of the fixture (run-local cannot ignore EOS). Each prints one line that says what
 * it measured.
 *
 * Exit status: 0 printed or agrees, 1 differs, 2 bad usage or a broken fixture or input. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PROG "compare_fixture"
/* The bounds: the C reference's (float32) by default; FIDELITY_REL_L2_MAX and
 * FIDELITY_TIE_MARGIN set others (the CUDA backend in bf16: 2e-2, and a tie margin of the
 * logits' measured absolute error). */
static double REL_L2_MAX = 1e-4;   /* on the last-position logits */
static double TIE_MARGIN = 1e-4;   /* a top-1/top-2 margin below this is a near tie */
#define MAX_VOCAB (1u << 24) /* make-synthetic-model's largest vocabulary */

enum { EXIT_AGREES = 0, EXIT_DIFFERS = 1, EXIT_BROKEN = 2 };

/* A fixture, checked: the arrays are owned here (fixture_free), the strings by root. */
struct fixture {
	const char *path, *name;
	json_t *root;
	json_t *args, *files; /* generator.args (strings), generator.files (name -> sha256) */
	int64_t *prompt, *greedy, *eos;
	size_t n_prompt, n_greedy, n_eos;
	float *logits;
	size_t n_logits;
	double *margins; /* n_greedy of them */
};

static void fixture_free(struct fixture *f)
{
	json_decref(f->root);
	free(f->prompt);
	free(f->greedy);
	free(f->eos);
	free(f->logits);
	free(f->margins);
	memset(f, 0, sizeof(*f));
}

static int broken(const struct fixture *f, const char *what)
{
	fprintf(stderr, "%s: %s: %s\n", PROG, f->path, what);
	return -EINVAL;
}

/* Reads key of obj, an array of non-negative integers, into a malloc'd *out. */
static int int_array(const struct fixture *f, json_t *obj, const char *key, int64_t **out, size_t *n)
{
	char what[128];
	json_t *a = json_object_get(obj, key);
	if (!json_is_array(a)) {
		snprintf(what, sizeof(what), "\"%s\" is missing or not an array", key);
		return broken(f, what);
	}
	*n = json_array_size(a);
	*out = malloc((*n ? *n : 1) * sizeof(**out));
	if (!*out)
		return -ENOMEM;
	for (size_t i = 0; i < *n; i++) {
		json_t *v = json_array_get(a, i);
		if (!json_is_integer(v) || json_integer_value(v) < 0) {
			snprintf(what, sizeof(what), "\"%s\"[%zu] is not a non-negative integer", key, i);
			return broken(f, what);
		}
		(*out)[i] = json_integer_value(v);
	}
	return 0;
}

/* Reads key of obj, an array of finite numbers, into a malloc'd *out of doubles. */
static int real_array(const struct fixture *f, json_t *obj, const char *key, double **out, size_t *n)
{
	char what[128];
	json_t *a = json_object_get(obj, key);
	if (!json_is_array(a)) {
		snprintf(what, sizeof(what), "\"%s\" is missing or not an array", key);
		return broken(f, what);
	}
	*n = json_array_size(a);
	*out = malloc((*n ? *n : 1) * sizeof(**out));
	if (!*out)
		return -ENOMEM;
	for (size_t i = 0; i < *n; i++) {
		json_t *v = json_array_get(a, i);
		if (!json_is_number(v) || !isfinite(json_number_value(v))) {
			snprintf(what, sizeof(what), "\"%s\"[%zu] is not a finite number", key, i);
			return broken(f, what);
		}
		(*out)[i] = json_number_value(v);
	}
	return 0;
}

static bool is_sha256(const char *s)
{
	if (strlen(s) != 64)
		return false;
	for (; *s; s++)
		if (!((*s >= '0' && *s <= '9') || (*s >= 'a' && *s <= 'f')))
			return false;
	return true;
}

/* Loads and checks path into f. Returns 0, or -errno after printing what is wrong. */
static int fixture_load(const char *path, struct fixture *f)
{
	json_error_t jerr;
	memset(f, 0, sizeof(*f));
	f->path = path;
	f->root = json_load_file(path, JSON_REJECT_DUPLICATES, &jerr);
	if (!f->root) {
		fprintf(stderr, "%s: cannot read fixture %s: %s (line %d)\n", PROG, path, jerr.text, jerr.line);
		return -EINVAL;
	}
	json_t *gen = json_object_get(f->root, "generator");
	f->name = json_string_value(json_object_get(f->root, "name"));
	f->args = json_object_get(gen, "args");
	f->files = json_object_get(gen, "files");
	if (!f->name || !json_is_array(f->args) || !json_array_size(f->args) || !json_is_object(f->files) ||
	    !json_object_size(f->files))
		return broken(f, "no \"name\", \"generator\".\"args\" or \"generator\".\"files\"");
	for (size_t i = 0; i < json_array_size(f->args); i++) {
		const char *a = json_string_value(json_array_get(f->args, i));
		if (!a || !*a || strchr(a, '\n') || !strcmp(a, "--out"))
			return broken(f, "an argument of \"generator\".\"args\" is not a word (or is --out)");
	}
	const char *file;
	json_t *sum;
	json_object_foreach(f->files, file, sum) {
		if (!json_is_string(sum) || !is_sha256(json_string_value(sum)) || !*file || strchr(file, '/') ||
		    strchr(file, '\n') || file[0] == '.')
			return broken(f, "\"generator\".\"files\" maps a file name to something other than a sha256");
	}

	double *logits = NULL;
	int rc = int_array(f, f->root, "prompt", &f->prompt, &f->n_prompt);
	if (!rc)
		rc = int_array(f, f->root, "greedy", &f->greedy, &f->n_greedy);
	if (!rc)
		rc = int_array(f, f->root, "eos_ids", &f->eos, &f->n_eos);
	if (!rc)
		rc = real_array(f, f->root, "margins", &f->margins, &(size_t){0});
	if (!rc)
		rc = real_array(f, f->root, "logits_last", &logits, &f->n_logits);
	if (rc) {
		free(logits);
		return rc;
	}
	size_t n_margins = json_array_size(json_object_get(f->root, "margins"));
	json_t *pos = json_object_get(f->root, "logits_position");
	if (!f->n_prompt || !f->n_greedy || n_margins != f->n_greedy || !f->n_logits || f->n_logits > MAX_VOCAB) {
		free(logits);
		return broken(f, "an empty prompt, greedy or logits_last, or margins not one per greedy step");
	}
	if (!json_is_integer(pos) || (size_t)json_integer_value(pos) != f->n_prompt - 1) {
		free(logits);
		return broken(f, "\"logits_position\" is not the prompt's last position");
	}
	for (size_t i = 0; i < f->n_prompt; i++)
		if ((size_t)f->prompt[i] >= f->n_logits) {
			free(logits);
			return broken(f, "a prompt id is outside the vocabulary (the length of logits_last)");
		}
	f->logits = malloc(f->n_logits * sizeof(float));
	if (!f->logits) {
		free(logits);
		return -ENOMEM;
	}
	/* The fixture holds 9 significant digits: the float32 transformers computed, exactly. */
	for (size_t i = 0; i < f->n_logits; i++)
		f->logits[i] = (float)logits[i];
	free(logits);
	return 0;
}

/* Reads the raw float32 file that pipectl generate --dump-logits wrote; *out malloc'd. */
static int read_logits(const char *path, float **out, size_t *n)
{
	FILE *fp = fopen(path, "rb");
	if (!fp) {
		int e = errno;
		fprintf(stderr, "%s: cannot open logits %s: %s\n", PROG, path, strerror(e));
		return -e;
	}
	size_t cap = 4096, len = 0;
	float *v = malloc(cap * sizeof(float));
	size_t got;
	while (v && (got = fread(v + len, sizeof(float), cap - len, fp)) > 0) {
		len += got;
		if (len == cap && cap < MAX_VOCAB) {
			float *nv = realloc(v, 2 * cap * sizeof(float));
			if (!nv) {
				free(v);
				v = NULL;
				break;
			}
			v = nv;
			cap *= 2;
		} else if (len == cap) {
			break;
		}
	}
	bool tail = v && fgetc(fp) != EOF; /* a partial float, or more than a vocabulary */
	bool err = ferror(fp);
	fclose(fp);
	if (!v)
		return -ENOMEM;
	if (err || tail) {
		fprintf(stderr, "%s: %s: %s\n", PROG, path,
			err ? "read error" : "not a whole number of float32 values (or too many)");
		free(v);
		return -EINVAL;
	}
	*out = v;
	*n = len;
	return 0;
}

static int cmd_logits(const struct fixture *f, const char *path)
{
	float *got = NULL;
	size_t n = 0;
	if (read_logits(path, &got, &n))
		return EXIT_BROKEN;
	if (n != f->n_logits) {
		printf("%s: logits: %s holds %zu values, the fixture %zu: FAIL\n", f->name, path, n, f->n_logits);
		free(got);
		return EXIT_DIFFERS;
	}
	double num = 0, den = 0, max_abs = 0;
	size_t at = 0, nonfinite = 0;
	for (size_t i = 0; i < n; i++) {
		if (!isfinite(got[i]))
			nonfinite++;
		double d = (double)got[i] - (double)f->logits[i];
		num += d * d;
		den += (double)f->logits[i] * f->logits[i];
		if (fabs(d) > max_abs) {
			max_abs = fabs(d);
			at = i;
		}
	}
	double rel = den > 0 ? sqrt(num / den) : INFINITY;
	bool ok = !nonfinite && rel <= REL_L2_MAX;
	printf("%s: logits: relative L2 %.3g (limit %g), max |diff| %.3g at id %zu, %zu values%s: %s\n", f->name, rel,
	       REL_L2_MAX, max_abs, at, n, nonfinite ? ", some not finite" : "", ok ? "ok" : "FAIL");
	free(got);
	return ok ? EXIT_AGREES : EXIT_DIFFERS;
}

/* Parses ids separated by spaces or commas into a malloc'd *out. */
static int parse_ids(const char *text, int64_t **out, size_t *n)
{
	size_t cap = 64, k = 0;
	int64_t *v = malloc(cap * sizeof(*v));
	const char *p = text;
	while (v) {
		while (*p == ' ' || *p == ',' || *p == '\n' || *p == '\t')
			p++;
		if (!*p)
			break;
		char *end;
		errno = 0;
		long long x = strtoll(p, &end, 10);
		if (end == p || errno || x < 0) {
			fprintf(stderr, "%s: tokens: \"%s\" is not a list of non-negative ids\n", PROG, text);
			free(v);
			return -EINVAL;
		}
		if (k == cap) {
			int64_t *nv = realloc(v, 2 * cap * sizeof(*v));
			if (!nv)
				break;
			v = nv;
			cap *= 2;
		}
		v[k++] = x;
		p = end;
	}
	if (!v || (*p && k == cap)) {
		free(v);
		return -ENOMEM;
	}
	*out = v;
	*n = k;
	return 0;
}

static bool is_eos(const struct fixture *f, int64_t tok)
{
	for (size_t i = 0; i < f->n_eos; i++)
		if (f->eos[i] == tok)
			return true;
	return false;
}

static int cmd_tokens(const struct fixture *f, const char *text, bool eos_may_stop)
{
	int64_t *got = NULL;
	size_t n = 0;
	if (parse_ids(text, &got, &n))
		return EXIT_BROKEN;
	/* Compare up to the first near tie: from there on either token is right. */
	size_t cmp = 0;
	while (cmp < f->n_greedy && f->margins[cmp] >= TIE_MARGIN)
		cmp++;
	int status = EXIT_AGREES;
	size_t same = 0;
	while (same < cmp && same < n && got[same] == f->greedy[same])
		same++;
	if (same < cmp && same < n) {
		printf("%s: tokens: step %zu is %lld, transformers' is %lld (margin there %.3g); %zu steps before it "
		       "identical: FAIL\n", f->name, same, (long long)got[same], (long long)f->greedy[same],
		       f->margins[same], same);
		status = EXIT_DIFFERS;
	} else if (n > f->n_greedy) {
		printf("%s: tokens: %zu of them, the fixture has %zu: FAIL\n", f->name, n, f->n_greedy);
		status = EXIT_DIFFERS;
	} else if (n < cmp && !(eos_may_stop && n > 0 && is_eos(f, got[n - 1]))) {
		printf("%s: tokens: only %zu of %zu, and the last is no EOS id: FAIL\n", f->name, n, f->n_greedy);
		status = EXIT_DIFFERS;
	} else if (n < cmp) {
		printf("%s: tokens: %zu of %zu identical, then stopped on EOS id %lld as the fixture's greedy "
		       "continuation would: ok\n", f->name, n, f->n_greedy, (long long)got[n - 1]);
	} else if (cmp < f->n_greedy) {
		printf("%s: tokens: %zu of %zu identical; step %zu is a near tie in the fixture (margin %.3g < %g), so "
		       "the steps from there on are not compared: ok\n", f->name, cmp, f->n_greedy, cmp,
		       f->margins[cmp], TIE_MARGIN);
	} else {
		printf("%s: tokens: %zu of %zu identical: ok\n", f->name, cmp, f->n_greedy);
	}
	free(got);
	return status;
}

static int usage(void)
{
	fprintf(stderr, "usage: %s args|files|prompt FIXTURE\n"
			"       %s logits FIXTURE FILE\n"
			"       %s tokens FIXTURE IDS [--eos-may-stop]\n",
		PROG, PROG, PROG);
	return EXIT_BROKEN;
}

static void bounds_from_env(void)
{
	const char *v = getenv("FIDELITY_REL_L2_MAX");
	if (v && *v)
		REL_L2_MAX = strtod(v, NULL);
	v = getenv("FIDELITY_TIE_MARGIN");
	if (v && *v)
		TIE_MARGIN = strtod(v, NULL);
}

int main(int argc, char **argv)
{
	bounds_from_env();
	if (argc < 3)
		return usage();
	const char *cmd = argv[1];
	bool one = !strcmp(cmd, "args") || !strcmp(cmd, "files") || !strcmp(cmd, "prompt");
	bool eos_may_stop = argc == 5 && !strcmp(argv[4], "--eos-may-stop");
	if (!(one && argc == 3) && !(!strcmp(cmd, "logits") && argc == 4) &&
	    !(!strcmp(cmd, "tokens") && (argc == 4 || eos_may_stop)))
		return usage();

	struct fixture f;
	if (fixture_load(argv[2], &f)) {
		fixture_free(&f);
		return EXIT_BROKEN;
	}
	int status = EXIT_AGREES;
	if (!strcmp(cmd, "args")) {
		for (size_t i = 0; i < json_array_size(f.args); i++)
			printf("%s\n", json_string_value(json_array_get(f.args, i)));
	} else if (!strcmp(cmd, "files")) {
		const char *file;
		json_t *sum;
		json_object_foreach(f.files, file, sum)
			printf("%s  %s\n", json_string_value(sum), file);
	} else if (!strcmp(cmd, "prompt")) {
		for (size_t i = 0; i < f.n_prompt; i++)
			printf(i ? ",%lld" : "%lld", (long long)f.prompt[i]);
		printf("\n");
	} else if (!strcmp(cmd, "logits")) {
		status = cmd_logits(&f, argv[3]);
	} else {
		status = cmd_tokens(&f, argv[3], eos_may_stop);
	}
	fixture_free(&f);
	if (fflush(stdout) != 0) {
		fprintf(stderr, "%s: cannot write the output: %s\n", PROG, strerror(errno));
		return EXIT_BROKEN;
	}
	return status;
}
