/* tunable.c - the registry of a service's run-time parameters. See tunable.h. */
#include "common/tunable.h"

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "common/log.h"
#include "common/util.h"

struct entry {
	struct tunable def;
	bool fixed;
	char *fixed_text;    /* fixed: the value as given */
	bool fixed_numeric;  /* fixed INT/BYTES/BOOL whose text parsed: fixed_i holds it */
	int64_t fixed_i;
};

struct tunables {
	char service[64];
	struct entry e[TUNABLES_MAX];
	int n;
};

static const char *const type_names[] = {"", "int", "bytes", "enum", "string", "bool"};

struct tunables *tunables_create(const char *service)
{
	struct tunables *t = calloc(1, sizeof(*t));
	if (t)
		str_copy(t->service, sizeof(t->service), service ? service : "the service");
	return t;
}

void tunables_destroy(struct tunables **tp)
{
	if (!tp || !*tp)
		return;
	for (int i = 0; i < (*tp)->n; i++)
		free((*tp)->e[i].fixed_text);
	free(*tp);
	*tp = NULL;
}

static struct entry *find(struct tunables *t, const char *name)
{
	for (int i = 0; i < t->n; i++)
		if (!strcmp(t->e[i].def.name, name))
			return &t->e[i];
	return NULL;
}

static bool good_name(const char *name)
{
	size_t n = name ? strlen(name) : 0;
	if (n == 0 || n > TUNABLE_NAME_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!((name[i] >= 'a' && name[i] <= 'z') || (name[i] >= '0' && name[i] <= '9') || name[i] == '-'))
			return false;
	return true;
}

static int add_entry(struct tunables *t, const struct tunable *def, bool fixed, const char *text)
{
	if (!t || !def || !good_name(def->name) || def->type < TUNABLE_INT || def->type > TUNABLE_BOOL)
		return -EINVAL;
	if (!fixed && (!def->set || !def->get))
		return -EINVAL;
	if (def->type == TUNABLE_ENUM && (!def->values || !def->values[0]) && !fixed)
		return -EINVAL;
	if ((def->type == TUNABLE_INT || def->type == TUNABLE_BYTES) && def->min > def->max && !def->range)
		return -EINVAL;
	if (find(t, def->name))
		return -EEXIST;
	if (t->n == TUNABLES_MAX)
		return -ENOSPC;
	struct entry *e = &t->e[t->n];
	memset(e, 0, sizeof(*e));
	e->def = *def;
	e->fixed = fixed;
	if (fixed) {
		e->def.set = NULL;
		e->fixed_text = strdup(text ? text : "");
		if (!e->fixed_text)
			return -ENOMEM;
		char why[128];
		struct tunable_value v;
		if ((def->type == TUNABLE_INT || def->type == TUNABLE_BYTES || def->type == TUNABLE_BOOL) &&
		    tunable_parse(def, INT64_MIN, INT64_MAX, e->fixed_text, &v, why, sizeof(why)) == 0) {
			e->fixed_numeric = true;
			e->fixed_i = v.i;
		}
	}
	t->n++;
	return 0;
}

int tunables_add(struct tunables *t, const struct tunable *def)
{
	return add_entry(t, def, def && !def->set, NULL);
}

int tunables_add_fixed(struct tunables *t, const char *name, enum tunable_type type, const char *value,
		       const char *help)
{
	struct tunable def = {.name = name, .help = help ? help : "", .type = type};
	return add_entry(t, &def, true, value);
}

/* ---- parsing and formatting ---- */

char *tunable_format_bytes(int64_t bytes, char *buf, size_t len)
{
	/* The largest binary unit that divides it, unless that leaves a long number and a decimal
	 * unit divides it (a bandwidth of 2.7TB reads 2700GB, not 2636718750KiB). */
	static const struct {
		const char *unit;
		int64_t mult;
	} bin[] = {{"TiB", 1ll << 40}, {"GiB", 1ll << 30}, {"MiB", 1ll << 20}, {"KiB", 1ll << 10}},
	  dec[] = {{"TB", 1000000000000ll}, {"GB", 1000000000ll}, {"MB", 1000000ll}, {"KB", 1000ll}};
	const char *unit = "";
	int64_t q = bytes;
	for (size_t i = 0; bytes > 0 && i < ARRAY_SIZE(bin); i++) {
		if (bytes % bin[i].mult == 0) {
			unit = bin[i].unit;
			q = bytes / bin[i].mult;
			break;
		}
	}
	for (size_t i = 0; bytes > 0 && q >= 1000000 && i < ARRAY_SIZE(dec); i++) {
		if (bytes % dec[i].mult == 0 && bytes / dec[i].mult < q) {
			unit = dec[i].unit;
			q = bytes / dec[i].mult;
			break;
		}
	}
	snprintf(buf, len, "%" PRId64 "%s", q, unit);
	return buf;
}

char *tunable_format(const struct tunable *def, const struct tunable_value *v, char *buf, size_t len)
{
	switch (def->type) {
	case TUNABLE_INT:
		snprintf(buf, len, "%" PRId64, v->i);
		break;
	case TUNABLE_BYTES:
		tunable_format_bytes(v->i, buf, len);
		break;
	case TUNABLE_BOOL:
		snprintf(buf, len, "%s", v->i ? "true" : "false");
		break;
	case TUNABLE_ENUM:
		snprintf(buf, len, "%s", v->s ? v->s : def->values && v->i >= 0 ? def->values[v->i] : "");
		break;
	default:
		snprintf(buf, len, "%s", v->s ? v->s : "");
		break;
	}
	return buf;
}

static void range_text(const struct tunable *def, int64_t min, int64_t max, char *buf, size_t len)
{
	char a[32], b[32];
	if (def->type == TUNABLE_BYTES)
		snprintf(buf, len, "%s..%s", tunable_format_bytes(min, a, sizeof(a)), tunable_format_bytes(max, b, sizeof(b)));
	else
		snprintf(buf, len, "%" PRId64 "..%" PRId64, min, max);
}

static void values_text(const char *const *values, char *buf, size_t len, const char *sep)
{
	size_t n = 0;
	buf[0] = 0;
	for (int i = 0; values && values[i] && n < len; i++) {
		int w = snprintf(buf + n, len - n, "%s%s", i ? sep : "", values[i]);
		if (w < 0)
			break;
		n += (size_t)w;
	}
}

int tunable_parse(const struct tunable *def, int64_t min, int64_t max, const char *text, struct tunable_value *out,
		  char *why, size_t whylen)
{
	memset(out, 0, sizeof(*out));
	if (!text)
		return errorf(why, whylen, -EINVAL, "no value given");
	size_t n = strlen(text);
	if (n > TUNABLE_VALUE_MAX)
		return errorf(why, whylen, -EINVAL, "a value of %zu bytes is too long (at most %d)", n, TUNABLE_VALUE_MAX);
	switch (def->type) {
	case TUNABLE_INT: {
		const char *p = text;
		if (*p == '+' || *p == '-')
			p++;
		bool digits = *p != 0;
		for (const char *q = p; *q; q++)
			digits = digits && *q >= '0' && *q <= '9';
		errno = 0;
		char *end = NULL;
		long long v = digits ? strtoll(text, &end, 10) : 0;
		if (!digits || *end)
			return errorf(why, whylen, -EINVAL, "'%.64s' is not an integer", text);
		if (errno == ERANGE || v < min || v > max) {
			char r[80];
			range_text(def, min, max, r, sizeof(r));
			return errorf(why, whylen, -ERANGE, "%.64s is out of range (%s)", text, r);
		}
		out->i = v;
		return 0;
	}
	case TUNABLE_BYTES: {
		uint64_t v = 0;
		int rc = parse_size(text, &v);
		if (rc == -EINVAL)
			return errorf(why, whylen, -EINVAL, "'%.64s' is not a size (examples: 512MiB, 4GiB, 4096)", text);
		char r[80], a[32];
		range_text(def, min, max, r, sizeof(r));
		if (rc || (int64_t)v < min || (int64_t)v > max)
			return errorf(why, whylen, -ERANGE, "%s is out of range (%s)",
				      rc ? text : tunable_format_bytes((int64_t)v, a, sizeof(a)), r);
		out->i = (int64_t)v;
		return 0;
	}
	case TUNABLE_ENUM:
		for (int i = 0; def->values && def->values[i]; i++) {
			if (!strcasecmp(text, def->values[i])) {
				out->i = i;
				out->s = def->values[i];
				return 0;
			}
		}
		{
			char list[256];
			values_text(def->values, list, sizeof(list), ", ");
			return errorf(why, whylen, -EINVAL, "'%.64s' is not one of %s", text, list);
		}
	case TUNABLE_BOOL:
		if (!strcasecmp(text, "true") || !strcmp(text, "1") || !strcasecmp(text, "yes") || !strcasecmp(text, "on")) {
			out->i = 1;
			return 0;
		}
		if (!strcasecmp(text, "false") || !strcmp(text, "0") || !strcasecmp(text, "no") ||
		    !strcasecmp(text, "off")) {
			out->i = 0;
			return 0;
		}
		return errorf(why, whylen, -EINVAL, "'%.64s' is not a boolean (true/false, 1/0, yes/no, on/off)", text);
	case TUNABLE_STRING:
		out->s = text;
		return 0;
	}
	return errorf(why, whylen, -EINVAL, "unknown type");
}

/* ---- JSON ---- */

static void range_of(const struct entry *e, int64_t *min, int64_t *max)
{
	*min = e->def.min;
	*max = e->def.max;
	if (e->def.range)
		e->def.range(e->def.ctx, min, max);
}

char *tunables_names(const struct tunables *t, char *buf, size_t len)
{
	size_t n = 0;
	buf[0] = 0;
	for (int pass = 0; pass < 2; pass++) {
		for (int i = 0; i < t->n && n < len; i++) {
			if (t->e[i].fixed != (pass == 1))
				continue;
			int w = snprintf(buf + n, len - n, "%s%s", n ? ", " : "", t->e[i].def.name);
			if (w < 0)
				break;
			n += (size_t)w;
		}
	}
	return buf;
}

/* The current value of a settable entry as text. */
static void current_text(const struct entry *e, char *buf, size_t len, struct tunable_value *v)
{
	memset(v, 0, sizeof(*v));
	e->def.get(e->def.ctx, v);
	tunable_format(&e->def, v, buf, len);
}

static json_t *entry_json(const struct entry *e)
{
	const struct tunable *d = &e->def;
	json_t *o = json_object();
	if (!o)
		return NULL;
	int rc = 0;
	char text[TUNABLE_VALUE_MAX + 1];
	if (e->fixed) {
		if (e->fixed_numeric) {
			struct tunable_value v = {.i = e->fixed_i};
			tunable_format(d, &v, text, sizeof(text));
			rc |= json_object_set_new(o, "value", d->type == TUNABLE_BOOL ? json_boolean(v.i) : json_integer(v.i));
		} else {
			snprintf(text, sizeof(text), "%s", e->fixed_text);
			rc |= json_object_set_new(o, "value", json_string(text));
		}
	} else {
		struct tunable_value v;
		current_text(e, text, sizeof(text), &v);
		json_t *jv = d->type == TUNABLE_INT || d->type == TUNABLE_BYTES ? json_integer(v.i)
			     : d->type == TUNABLE_BOOL				? json_boolean(v.i)
										: json_string(text);
		rc |= json_object_set_new(o, "value", jv);
	}
	rc |= json_object_set_new(o, "text", json_string(text));
	rc |= json_object_set_new(o, "type", json_string(type_names[d->type]));
	rc |= json_object_set_new(o, "tunable", json_boolean(!e->fixed));
	if (!e->fixed) {
		char r[256];
		if (d->type == TUNABLE_INT || d->type == TUNABLE_BYTES) {
			int64_t min, max;
			range_of(e, &min, &max);
			rc |= json_object_set_new(o, "min", json_integer(min));
			rc |= json_object_set_new(o, "max", json_integer(max));
			range_text(d, min, max, r, sizeof(r));
		} else if (d->type == TUNABLE_ENUM) {
			json_t *a = json_array();
			for (int i = 0; a && d->values[i]; i++)
				json_array_append_new(a, json_string(d->values[i]));
			rc |= json_object_set_new(o, "values", a);
			values_text(d->values, r, sizeof(r), "|");
		} else if (d->type == TUNABLE_BOOL) {
			snprintf(r, sizeof(r), "true|false");
		} else {
			snprintf(r, sizeof(r), "text");
		}
		rc |= json_object_set_new(o, "range", json_string(r));
	}
	rc |= json_object_set_new(o, "description", json_string(d->help ? d->help : ""));
	if (rc) {
		json_decref(o);
		return NULL;
	}
	return o;
}

static char *dump(json_t *o, int *rc, char *why, size_t whylen)
{
	char *text = o ? json_dumps(o, JSON_COMPACT) : NULL;
	json_decref(o);
	if (!text)
		*rc = errorf(why, whylen, -ENOMEM, "out of memory");
	return text;
}

static int unknown_key(struct tunables *t, const char *name, char *why, size_t whylen)
{
	char names[2048];
	return errorf(why, whylen, -ENOENT, "unknown key '%.64s' for %s; known: %s", name, t->service,
		      tunables_names(t, names, sizeof(names)));
}

char *tunables_get_json(struct tunables *t, const char *keys, size_t len, int *rc, char *why, size_t whylen)
{
	*rc = 0;
	json_t *out = json_object();
	if (!out) {
		*rc = errorf(why, whylen, -ENOMEM, "out of memory");
		return NULL;
	}
	if (!keys || !len) {
		for (int i = 0; i < t->n; i++)
			if (json_object_set_new(out, t->e[i].def.name, entry_json(&t->e[i])) != 0) {
				json_decref(out);
				*rc = errorf(why, whylen, -ENOMEM, "out of memory");
				return NULL;
			}
		return dump(out, rc, why, whylen);
	}
	json_error_t jerr;
	json_t *a = json_loadb(keys, len, 0, &jerr);
	if (!a || !json_is_array(a)) {
		*rc = errorf(why, whylen, -EINVAL, "keys must be a JSON array of parameter names (%s)",
			     a ? "not an array" : jerr.text);
		goto fail;
	}
	if (json_array_size(a) > TUNABLES_MAX) {
		*rc = errorf(why, whylen, -EINVAL, "%zu keys asked for; at most %d", json_array_size(a), TUNABLES_MAX);
		goto fail;
	}
	size_t i;
	json_t *k;
	json_array_foreach(a, i, k) {
		if (!json_is_string(k)) {
			*rc = errorf(why, whylen, -EINVAL, "key %zu is not a string", i);
			goto fail;
		}
		const char *name = json_string_value(k);
		if (json_string_length(k) > TUNABLE_NAME_MAX || strlen(name) != json_string_length(k)) {
			*rc = errorf(why, whylen, -EINVAL, "key %zu is not a parameter name (at most %d bytes, no NUL)", i,
				     TUNABLE_NAME_MAX);
			goto fail;
		}
		struct entry *e = find(t, name);
		if (!e) {
			*rc = unknown_key(t, name, why, whylen);
			goto fail;
		}
		if (json_object_set_new(out, name, entry_json(e)) != 0) {
			*rc = errorf(why, whylen, -ENOMEM, "out of memory");
			goto fail;
		}
	}
	json_decref(a);
	return dump(out, rc, why, whylen);
fail:
	json_decref(a);
	json_decref(out);
	return NULL;
}

struct pending {
	struct entry *e;
	struct tunable_value v;
	char num[64]; /* the text of a JSON number or boolean */
};

char *tunables_set_json(struct tunables *t, const char *settings, size_t len, int *rc, char *why, size_t whylen)
{
	*rc = 0;
	json_error_t jerr;
	json_t *o = settings && len ? json_loadb(settings, len, JSON_REJECT_DUPLICATES, &jerr) : NULL;
	struct pending *p = NULL;
	json_t *out = NULL;
	if (!o || !json_is_object(o)) {
		*rc = errorf(why, whylen, -EINVAL, "settings must be a JSON object of name -> value (%s)",
			     o ? "not an object" : settings && len ? jerr.text : "empty");
		goto out;
	}
	size_t n = json_object_size(o);
	if (n == 0 || n > TUNABLES_MAX) {
		*rc = errorf(why, whylen, -EINVAL, "%zu settings; give 1 to %d", n, TUNABLES_MAX);
		goto out;
	}
	p = calloc(n, sizeof(*p));
	out = json_object();
	if (!p || !out) {
		*rc = errorf(why, whylen, -ENOMEM, "out of memory");
		goto out;
	}
	/* Check everything first. */
	size_t k = 0;
	const char *name;
	json_t *val;
	json_object_foreach(o, name, val) {
		struct pending *q = &p[k++];
		char reason[1024];
		if (strlen(name) > TUNABLE_NAME_MAX) {
			*rc = errorf(why, whylen, -EINVAL, "a key of %zu bytes is not a parameter name (at most %d)",
				     strlen(name), TUNABLE_NAME_MAX);
			goto out;
		}
		q->e = find(t, name);
		if (!q->e) {
			*rc = unknown_key(t, name, why, whylen);
			goto out;
		}
		if (q->e->fixed) {
			*rc = errorf(why, whylen, -EPERM, "%s: fixed at start: restart %s with --%s", name, t->service,
				     name);
			goto out;
		}
		const char *text;
		if (json_is_string(val)) {
			text = json_string_value(val);
			if (strlen(text) != json_string_length(val)) {
				*rc = errorf(why, whylen, -EINVAL, "%s: the value holds a NUL byte", name);
				goto out;
			}
		} else if (json_is_integer(val)) {
			snprintf(q->num, sizeof(q->num), "%" JSON_INTEGER_FORMAT, json_integer_value(val));
			text = q->num;
		} else if (json_is_real(val)) {
			snprintf(q->num, sizeof(q->num), "%.17g", json_real_value(val));
			text = q->num;
		} else if (json_is_boolean(val)) {
			snprintf(q->num, sizeof(q->num), "%s", json_is_true(val) ? "true" : "false");
			text = q->num;
		} else {
			*rc = errorf(why, whylen, -EINVAL, "%s: the value must be a string", name);
			goto out;
		}
		int64_t min, max;
		range_of(q->e, &min, &max);
		int prc = tunable_parse(&q->e->def, min, max, text, &q->v, reason, sizeof(reason));
		if (prc == 0)
			prc = q->e->def.set(q->e->def.ctx, &q->v, false, reason, sizeof(reason));
		if (prc) {
			*rc = errorf(why, whylen, prc, "%s: %s", name, reason);
			goto out;
		}
	}
	/* Then apply. A change is logged while the level lets it show: before it when the level is
	 * info or lower now, else after (a change of the level itself to info or lower). */
	for (size_t i = 0; i < n; i++) {
		struct entry *e = p[i].e;
		char old[TUNABLE_VALUE_MAX + 1], new_text[TUNABLE_VALUE_MAX + 1], reason[1024];
		struct tunable_value cur;
		current_text(e, old, sizeof(old), &cur);
		tunable_format(&e->def, &p[i].v, new_text, sizeof(new_text));
		bool changed = strcmp(old, new_text) != 0;
		bool before = log_get_level() <= LOG_INFO;
		if (changed && before)
			log_info("tune: %s %s -> %s", e->def.name, old, new_text);
		int arc = e->def.set(e->def.ctx, &p[i].v, true, reason, sizeof(reason));
		if (arc) {
			log_error("tune: %s: the change passed its check but failed: %s", e->def.name, reason);
			*rc = errorf(why, whylen, arc, "%s: %s", e->def.name, reason);
			goto out;
		}
		if (changed && !before)
			log_info("tune: %s %s -> %s", e->def.name, old, new_text);
	}
	for (size_t i = 0; i < n; i++) {
		if (json_object_set_new(out, p[i].e->def.name, entry_json(p[i].e)) != 0) {
			*rc = errorf(why, whylen, -ENOMEM, "out of memory");
			goto out;
		}
	}
	free(p);
	json_decref(o);
	return dump(out, rc, why, whylen);
out:
	free(p);
	json_decref(o);
	json_decref(out);
	return NULL;
}
