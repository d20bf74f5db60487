/* generate.c - pipectl generate: one MSG_GENERATE to gpu-runner, the streamed MSG_TOKEN
 * replies printed as they arrive, MSG_GEN_DONE ends the line.
 *
 * With --tokens the output is the generated ids on one line separated by spaces, the same as
 * run-local prints, so that the two can be compared byte for byte. With --prompt or --chat
 * the runner tokenizes with the model's tokenizer and the output is the generated text as it
 * comes (--ids prints the ids instead).
 *
 * --stats prints a timing line on stderr at the end; with --json the same numbers go to stderr
 * as one JSON object on one line instead (for scripts), printed by print_stats. --json alone
 * does nothing: it is not refused, as PIPELINE_PIPECTL_JSON (set for `pipectl get`, say) would
 * otherwise break every generate.
 *
 * --dump-logits FILE asks for MSG_LOGITS (GEN_LOGITS) and writes its values to FILE as they
 * came: raw float32, little-endian, vocab_size of them, no header. Raw rather than text so
 * that the fidelity test compares exactly what the runner computed.
 *
 * The runner dying in the middle of a request (kill -9, a crash, killed as hung) is reported,
 * not waited out. ZeroMQ does not tell a client that its peer died, so generate judges it from
 * the runner's heartbeats (MSG_HEARTBEAT on gpu-runner.pub, every second, during long work too):
 * it asks the runner for HELLO (its pid and epoch; waiting for a runner that is being restarted
 * to answer), subscribes to its heartbeats, sends GENERATE and right after it a second HELLO, the
 * probe. The probe travels behind the GENERATE on the same connection, so the runner that answers
 * it (its epoch) holds the request. The request is lost when that runner goes quiet for
 * GEN_SILENT_MS, when a heartbeat of a newer runner arrives (another epoch: the old process is
 * gone), or, as a fast path, when its process is seen gone (only where that is reliable: the pid
 * names, in our pid namespace, the process listening on the run dir's socket, with the start time
 * read then). When the HELLO's runner is gone before the probe was answered (it restarted between
 * HELLO and GENERATE, say), the request may sit queued for its successor: generate keeps waiting
 * while a successor beats, sending more probes; the successor answering the first probe holds the
 * request, a later probe answered first proves it was lost with the old one. When the request is
 * lost: "gpu-runner went away during the request (pid N): ...", exit status 1, and nothing is
 * retried (the tokens printed so far stay on stdout); the supervisor starts a new runner, which
 * serves the request when it is sent again. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/shm.h"
#include "common/util.h"
#include "tools/pipectl/pipectl.h"

#define GEN_SERVICE "gpu-runner"
#define GEN_DEFAULT_TIMEOUT_S 600

#define GEN_MAX_STOPS 16
/* How often the runner's process is looked at (the fast path) while a reply is awaited. */
#define GEN_LIVENESS_MS 250
/* Silence after which the runner that may hold the request counts as gone: five heartbeat
 * periods (services beat every second; the runner also while it computes or waits on peers). */
#define GEN_SILENT_MS 5000
/* While it is not known which runner holds the request, a HELLO probe at most this often. */
#define GEN_PROBE_MS 1000
#define GEN_MAX_PROBES 16
#define GEN_MAX_SEEN 8
/* A last look for replies a runner sent before it went away. */
#define GEN_LAST_LOOK_MS 100

/* Who holds the request, and the signs of its life (see the top of this file). */
struct runner_watch {
	struct rpc_client *c;
	void *sub;	       /* SUB on gpu-runner.pub; NULL: no heartbeats (the fast path only) */
	uint64_t corr;	       /* the GENERATE's */
	int hello_pid;	       /* the HELLO's runner, in its own pid namespace */
	uint64_t hello_epoch;  /* and its epoch */
	uint64_t start;	       /* hello_pid's start time where the fast path is reliable; else 0 */
	bool known;	       /* the runner holding the request is known (the first probe answered): */
	uint64_t epoch;	       /* its epoch */
	int pid;	       /* its pid, for the message */
	bool hello_gone;       /* while !known: the HELLO's runner is gone (a successor beat, or its pid) */
	uint64_t seen[GEN_MAX_SEEN]; /* epochs that beat while !known: none is newer than `epoch` */
	int n_seen;
	uint64_t probes[GEN_MAX_PROBES]; /* the HELLO probes sent after GENERATE, in order */
	int n_probes;
	bool first_probe;      /* probes[0] went right behind the GENERATE */
	uint64_t last_life_ns; /* last sign of life of a runner that may hold the request */
	uint64_t last_probe_ns, last_pid_ns;
	bool lost;
	const char *why;        /* how it was seen lost (for the message) */
};

/* After the HELLO: the fast path, where reliable, and the subscription to the heartbeats (before
 * GENERATE is sent, after the HELLO, so that no heartbeat of a runner older than the HELLO's
 * can arrive). */
static void watch_open(struct runner_watch *w, struct pipectl *p, struct rpc_client *c, const struct msg_hello_reply *h)
{
	w->c = c;
	w->hello_pid = h->pid > 0 && h->pid < INT32_MAX ? (int)h->pid : 0;
	w->pid = w->hello_pid;
	w->hello_epoch = h->epoch;
	w->seen[w->n_seen++] = h->epoch;
	char ep[300];
	if (bus_endpoint(p->run_dir, GEN_SERVICE, "pub", ep, sizeof(ep)) != 0)
		return;
	/* The pid is worth watching only if it names the runner here: in our pid namespace, the
	 * process that listens on the run dir's socket, alive from before to after its start time
	 * was read (a runner gone meanwhile leaves the fast path off; the heartbeats remain). */
	if (w->hello_pid) {
		uint64_t s1 = process_start_time(w->hello_pid);
		int lp = 0;
		if (s1)
			bus_unix_listener(ep + strlen("ipc://"), &lp);
		uint64_t s2 = lp == w->hello_pid ? process_start_time(w->hello_pid) : 0;
		w->start = s1 && s1 == s2 ? s1 : 0;
	}
	w->sub = bus_connect_sub(p->zctx, ep);
	if (!w->sub)
		log_warn("cannot subscribe to %s: %s (watching the runner's pid only)", ep, strerror(errno));
}

static void watch_close(struct runner_watch *w)
{
	if (w->sub)
		zmq_close(w->sub);
	w->sub = NULL;
}

static void watch_lost(struct runner_watch *w, const char *why)
{
	if (!w->lost) {
		log_debug("the request is lost: %s", why);
		w->why = why;
	}
	w->lost = true;
}

/* Sends a HELLO probe on the request's connection. */
static void send_probe(struct runner_watch *w)
{
	w->last_probe_ns = now_ns();
	if (w->n_probes == GEN_MAX_PROBES)
		return;
	static const char self[] = "pipectl";
	struct msg req;
	msg_init(&req, MSG_HELLO, 0);
	req.hello.client.p = (char *)self;
	req.hello.client.len = (uint32_t)strlen(self);
	req.hello.proto = PROTO_VERSION;
	uint64_t corr;
	if (rpc_send(w->c, &req, &corr) == 0)
		w->probes[w->n_probes++] = corr;
}

/* Right after GENERATE: the probe that tells who got it. */
static void watch_sent(struct runner_watch *w, uint64_t corr)
{
	w->corr = corr;
	send_probe(w);
	w->first_probe = w->n_probes == 1;
	w->last_life_ns = now_ns();
	w->last_pid_ns = w->last_life_ns;
}

static void on_probe_reply(struct runner_watch *w, int i, const struct msg *rep)
{
	if (w->known || !w->first_probe)
		return;
	if (i > 0) {
		/* A later probe answered before the first: the first, and the GENERATE before it, went
		 * to a runner that is gone. */
		watch_lost(w, "a runner started after it answered first");
		return;
	}
	w->known = true;
	w->last_life_ns = now_ns();
	if (rep->type != MSG_HELLO_REPLY) { /* an error reply: the runner answering holds it */
		w->epoch = w->hello_gone ? w->seen[w->n_seen - 1] : w->hello_epoch;
		w->pid = 0;
	} else {
		w->epoch = rep->hello_reply.epoch;
		w->pid = rep->hello_reply.pid < INT32_MAX ? (int)rep->hello_reply.pid : 0;
	}
	if (w->epoch != w->hello_epoch)
		w->start = 0; /* the fast path watches the HELLO's process */
	else if (w->hello_gone)
		watch_lost(w, "its successor was already beating");
}

static void on_beat(struct runner_watch *w, const struct msg_heartbeat *hb)
{
	if (hb->service.len != strlen(GEN_SERVICE) || memcmp(hb->service.p, GEN_SERVICE, hb->service.len))
		return;
	uint64_t x = hb->epoch;
	if (w->known) {
		if (x == w->epoch) {
			w->last_life_ns = now_ns();
			return;
		}
		for (int i = 0; i < w->n_seen; i++)
			if (x == w->seen[i])
				return; /* older than the runner holding the request, a late beat */
		watch_lost(w, "a newer gpu-runner beats");
		return;
	}
	if (x == w->hello_epoch) {
		if (!w->hello_gone)
			w->last_life_ns = now_ns();
		return;
	}
	/* A successor of the HELLO's runner: that one is gone. The request went with it, or waits
	 * for this one (it was sent while the runner restarted): the probes tell. */
	bool fresh = true;
	for (int i = 0; i < w->n_seen && fresh; i++)
		fresh = x != w->seen[i];
	if (fresh && w->n_seen < GEN_MAX_SEEN)
		w->seen[w->n_seen++] = x;
	if (fresh)
		send_probe(w);
	w->hello_gone = true;
	w->last_life_ns = now_ns();
}

/* What time alone tells: the fast path, the silence, the probes due. */
static void watch_tick(struct runner_watch *w)
{
	uint64_t now = now_ns();
	bool watching_hello = w->known ? w->epoch == w->hello_epoch : !w->hello_gone;
	if (w->start && watching_hello && now - w->last_pid_ns >= GEN_LIVENESS_MS * 1000000ull) {
		w->last_pid_ns = now;
		if (!process_alive(w->hello_pid, w->start)) {
			w->start = 0;
			if (w->known) {
				watch_lost(w, "its process is gone");
			} else {
				w->hello_gone = true;
				w->last_life_ns = now; /* a successor may be starting: give it time */
				send_probe(w);
			}
		}
	}
	if (!w->known && w->hello_gone && w->first_probe && now - w->last_probe_ns >= GEN_PROBE_MS * 1000000ull)
		send_probe(w);
	if (w->sub && now - w->last_life_ns >= GEN_SILENT_MS * 1000000ull)
		watch_lost(w, "no heartbeat for 5 s"); /* GEN_SILENT_MS */
}

/* Waits up to timeout_ms for the next reply to the GENERATE, reading heartbeats and probe
 * replies meanwhile. Returns as rpc_wait, or -ECONNRESET when the runner holding the request is
 * gone (after a last look for replies it sent before). */
static int watch_wait(struct runner_watch *w, struct msg *rep, int timeout_ms)
{
	uint64_t now = now_ns(), deadline = now + (uint64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000ull;
	uint64_t last_look = w->lost ? now + GEN_LAST_LOOK_MS * 1000000ull : 0;
	void *dealer = rpc_client_socket(w->c);
	char err[256];
	memset(rep, 0, sizeof(*rep)); /* msg_free(rep) is safe after any return */
	for (;;) {
		for (;;) {
			int rc = bus_recv(dealer, rep, 0, err, sizeof(err));
			if (rc == -ETIMEDOUT)
				break;
			if (rc == -EINTR)
				continue;
			if (rc == -EBADMSG || rc == -ENOMSG || rc == -EPROTONOSUPPORT) {
				log_warn("bad reply from %s: %s", GEN_SERVICE, err);
				return -EBADMSG;
			}
			if (rc)
				return rc;
			if (rep->corr == w->corr) {
				w->last_life_ns = now_ns();
				return rep->type == MSG_ERROR ? -EREMOTEIO : 0;
			}
			for (int i = 0; i < w->n_probes; i++)
				if (rep->corr == w->probes[i])
					on_probe_reply(w, i, rep);
			msg_free(rep);
			memset(rep, 0, sizeof(*rep));
		}
		for (int n = 0; w->sub && n < 1000; n++) {
			struct msg m;
			int rc = bus_recv(w->sub, &m, 0, err, sizeof(err));
			if (rc == 0 && m.type == MSG_HEARTBEAT)
				on_beat(w, &m.heartbeat);
			msg_free(&m);
			if (rc == -ETIMEDOUT || (rc && rc != -EINTR && rc != -EBADMSG && rc != -ENOMSG &&
						 rc != -EPROTONOSUPPORT))
				break;
		}
		watch_tick(w);
		now = now_ns();
		if (w->lost && !last_look)
			last_look = now + GEN_LAST_LOOK_MS * 1000000ull;
		uint64_t until = last_look ? last_look : deadline;
		if (now >= until)
			return last_look ? -ECONNRESET : -ETIMEDOUT;
		uint64_t left_ms = (until - now + 999999) / 1000000ull;
		zmq_pollitem_t items[2] = {{.socket = dealer, .events = ZMQ_POLLIN},
					   {.socket = w->sub, .events = ZMQ_POLLIN}};
		zmq_poll(items, w->sub ? 2 : 1, left_ms < GEN_LIVENESS_MS ? (long)left_ms : GEN_LIVENESS_MS);
	}
}

/* The arguments turned into a request; arrays and JSON texts owned here. */
struct gen_args {
	uint64_t *tokens, *stop_ids;
	uint32_t n_tokens, n_stop_ids;
	long max_new, top_k, seed;
	double temperature, top_p, min_p, repetition_penalty;
	bool stats, stats_json, ignore_eos, special_as_text, no_bos, print_ids;
	const char *dump_logits; /* --dump-logits FILE (borrowed from argv); NULL: not asked */
	const char *prompt, *chat, *system; /* borrowed from argv */
	const char *messages;		    /* --messages FILE (- standard input), borrowed */
	const char *stops[GEN_MAX_STOPS];   /* --stop, as often as given */
	int n_stops;
	char *chat_json, *stops_json;	    /* built from the above */
	bool text;			    /* a text prompt: print text */
};

/* Does the word w name a flag of opts that takes its value from the next word ("--prompt", not
 * "--prompt=x" nor a boolean)? */
static bool takes_next(const struct opt *opts, const char *w)
{
	if (strncmp(w, "--", 2) != 0 || strchr(w, '='))
		return false;
	for (const struct opt *o = opts; o->name; o++)
		if (!strcmp(o->name, w + 2))
			return o->kind != OPT_BOOL;
	return false;
}

/* -n N is the short form of --max-new N; config_parse knows only long flags, and takes each
 * flag once, so the repeatable --stop is collected here. Returns a malloc'd copy of argv with
 * "-n" replaced and the --stop flags taken out (*argc_out), or NULL. A flag's value is left as it
 * is, whatever it reads ("--prompt -n", "--prompt --stop"). */
static char **expand_short_flags(int argc, char **argv, const struct opt *opts, int *argc_out, struct gen_args *a,
				 int *bad)
{
	static char max_new_flag[] = "--max-new";
	char **out = calloc((size_t)argc + 1, sizeof(*out));
	if (!out)
		return NULL;
	int n = 0;
	*bad = 0;
	for (int i = 0; i < argc; i++) {
		const char *v = NULL;
		if (i > 0 && !strcmp(argv[i], "--stop")) {
			if (i + 1 >= argc) {
				*bad = 1;
				break;
			}
			v = argv[++i];
		} else if (i > 0 && !strncmp(argv[i], "--stop=", 7)) {
			v = argv[i] + 7;
		}
		if (v) {
			if (a->n_stops == GEN_MAX_STOPS || !*v) {
				*bad = 2;
				break;
			}
			a->stops[a->n_stops++] = v;
			continue;
		}
		if (i > 0 && takes_next(opts, argv[i]) && i + 1 < argc) {
			out[n++] = argv[i++];
			out[n++] = argv[i];
			continue;
		}
		out[n++] = i > 0 && !strcmp(argv[i], "-n") ? max_new_flag : argv[i];
	}
	*argc_out = n;
	return out;
}

/* Reads a whole text file of at most max bytes into a NUL-terminated heap buffer. Returns 0
 * or -errno (-EFBIG when larger). */
static int read_text_file(const char *path, size_t max, char **out, size_t *len)
{
	FILE *f = fopen(path, "rb");
	if (!f)
		return -errno;
	struct stat st;
	if (fstat(fileno(f), &st) == 0 && S_ISDIR(st.st_mode)) { /* its read said "Input/output error" */
		fclose(f);
		return -EISDIR;
	}
	char *buf = malloc(max + 1);
	if (!buf) {
		fclose(f);
		return -ENOMEM;
	}
	size_t n = fread(buf, 1, max + 1, f);
	int rc = ferror(f) ? -EIO : n > max ? -EFBIG : 0;
	fclose(f);
	if (rc) {
		free(buf);
		return rc;
	}
	buf[n] = 0;
	*out = buf;
	*len = n;
	return 0;
}

/* A file's ids separated by commas, white space (as `pipectl tokenize` writes them, a line or
 * several) or both, made into the comma-separated list pipectl_parse_ids takes, in place: a run of
 * white space with at most one comma in it is one comma, and white space at either end goes. */
static void ids_separators(char *s)
{
	size_t w = 0;
	bool sep = false;
	int commas = 0;
	for (size_t r = 0; s[r]; r++) {
		char c = s[r];
		if (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r') {
			sep = true;
			commas += c == ',';
			continue;
		}
		if (sep && (w > 0 || commas)) {
			/* Two commas in a run keep their empty element, which the parser names. */
			for (int k = 0; k < (commas > 1 ? commas : 1); k++)
				s[w++] = ',';
		}
		sep = false;
		commas = 0;
		s[w++] = c;
	}
	if (commas > 0 || (w == 0 && sep))
		s[w++] = ','; /* a trailing comma: the parser's empty element, as before */
	s[w] = '\0';
}

/* The sampling and length options in their ranges, whatever the prompt is (ids, text or chat).
 * Returns 0 or PIPECTL_EXIT_USAGE after saying which. */
static int check_ranges(const struct gen_args *a)
{
	if (a->max_new < 1) {
		fprintf(stderr, "pipectl: generate: -n must be at least 1, not %ld\n", a->max_new);
		return PIPECTL_EXIT_USAGE;
	}
	if (!(a->temperature >= 0) || a->temperature > 1e6) {
		fprintf(stderr, "pipectl: generate: --temperature must be 0 (greedy) or positive, not %g\n",
			a->temperature);
		return PIPECTL_EXIT_USAGE;
	}
	if (a->top_k < 0) {
		fprintf(stderr, "pipectl: generate: --top-k must not be negative (0 is off), not %ld\n", a->top_k);
		return PIPECTL_EXIT_USAGE;
	}
	if (!(a->top_p > 0 && a->top_p <= 1)) {
		fprintf(stderr, "pipectl: generate: --top-p must be in (0, 1] (1 is off), not %g\n", a->top_p);
		return PIPECTL_EXIT_USAGE;
	}
	if (a->seed < 0) {
		fprintf(stderr, "pipectl: generate: --seed must not be negative, not %ld\n", a->seed);
		return PIPECTL_EXIT_USAGE;
	}
	if (a->dump_logits && !*a->dump_logits) {
		fprintf(stderr, "pipectl: generate: --dump-logits needs a file name\n");
		return PIPECTL_EXIT_USAGE;
	}
	return 0;
}

static int parse_args(int argc, char **argv, struct gen_args *a)
{
	const char *tokens = NULL, *stop_ids = NULL;
	struct opt opts[] = {
		{"tokens", OPT_STRING, &tokens, NULL,
		 "prompt token ids, comma separated: 1,2,3; @FILE reads them from FILE, separated by commas or "
		 "white space as `pipectl tokenize` writes them (for prompts too long for one argument)"},
		{"prompt", OPT_STRING, &a->prompt, NULL, "prompt text (the runner tokenizes it, BOS first)"},
		{"chat", OPT_STRING, &a->chat, NULL, "a user message, through the model's chat template"},
		{"messages", OPT_STRING, &a->messages, NULL,
		 "a chat of several turns: FILE (- for standard input) holds a JSON array of {\"role\", \"content\"} "
		 "messages, as an HTTP chat request's \"messages\"; it goes through the model's chat template"},
		{"system", OPT_STRING, &a->system, NULL, "with --chat: a system message before it"},
		{"special-as-text", OPT_BOOL, &a->special_as_text, NULL,
		 "special-token text in --prompt/--chat/--messages is plain text, not special tokens"},
		{"no-bos", OPT_BOOL, &a->no_bos, NULL, "with --prompt: no BOS token first"},
		{"ids", OPT_BOOL, &a->print_ids, NULL, "with --prompt/--chat/--messages: print token ids, not text"},
		{"max-new", OPT_INT, &a->max_new, "16", "tokens to generate (short: -n N)"},
		{"temperature", OPT_DOUBLE, &a->temperature, "0", "sampling temperature; 0 (or under 1e-6) is greedy"},
		{"top-k", OPT_INT, &a->top_k, "0", "sample among the k most likely tokens; 0 is off"},
		{"top-p", OPT_DOUBLE, &a->top_p, "1", "sample within cumulative probability p; 1 is off"},
		{"seed", OPT_INT, &a->seed, "0", "seed of the sampler"},
		{"min-p", OPT_DOUBLE, &a->min_p, "0", "drop tokens less likely than p times the likeliest; 0 is off"},
		{"repetition-penalty", OPT_DOUBLE, &a->repetition_penalty, "1",
		 "divide the logits of tokens already in the text by this (1 is off)"},
		{"stop-ids", OPT_STRING, &stop_ids, NULL,
		 "extra token ids that end generation, comma separated (the model's eos ids always do)"},
		{"stats", OPT_BOOL, &a->stats, NULL, "print a timing line on stderr at the end"},
		{"json", OPT_BOOL, &a->stats_json, NULL,
		 "with --stats: print the timings as one JSON object on one line of stderr instead (prompt_tokens, "
		 "prefill_ms, prefill_tok_s, tokens_generated, reason, decode_ms, decode_tok_s, total_ms)"},
		{"ignore-eos", OPT_BOOL, &a->ignore_eos, NULL,
		 "do not stop on the model's end-of-sequence ids (--stop-ids still stop)"},
		{"dump-logits", OPT_STRING, &a->dump_logits, NULL,
		 "write the logits of the prompt's last position to FILE: raw float32 little-endian, one per "
		 "vocabulary entry, no header"},
		{0},
	};
	int nargs, bad;
	char **args = expand_short_flags(argc, argv, opts, &nargs, a, &bad);
	if (!args) {
		fprintf(stderr, "pipectl: out of memory\n");
		return PIPECTL_EXIT_FAIL;
	}
	if (bad) {
		free(args);
		fprintf(stderr, bad == 1 ? "pipectl: generate: --stop needs a string\n"
					 : "pipectl: generate: --stop takes a non-empty string, at most %d times\n",
			GEN_MAX_STOPS);
		return PIPECTL_EXIT_USAGE;
	}
	int rc = pipectl_parse("generate (--tokens IDS | --prompt TEXT | --chat TEXT | --messages FILE) [-n N] [--stop STR]...",
			       "Generates with gpu-runner. With --tokens it prints each id as it arrives, separated by "
			       "spaces; with --prompt or --chat the text as it arrives. Either way a newline ends it. "
			       "--stop STR (repeatable, up to 16) ends generation once the text holds STR.",
			       opts, nargs, args, NULL, 0, 0, NULL);
	free(args);
	if (rc)
		return rc == 1 ? -1 : PIPECTL_EXIT_USAGE;

	char err[256];
	int ways = (tokens && *tokens) + (a->prompt && *a->prompt) + (a->chat && *a->chat) +
		   (a->messages && *a->messages);
	if (ways != 1) {
		fprintf(stderr, "pipectl: generate: give the prompt one way: --tokens 1,2,3, --prompt TEXT, --chat "
				"TEXT or --messages FILE\n");
		return PIPECTL_EXIT_USAGE;
	}
	if (a->system && !a->chat) {
		fprintf(stderr, "pipectl: generate: --system goes with --chat\n");
		return PIPECTL_EXIT_USAGE;
	}
	if (!(a->min_p >= 0 && a->min_p <= 1) || !(a->repetition_penalty > 0 && a->repetition_penalty < 1e6)) {
		fprintf(stderr, "pipectl: generate: --min-p must be in [0, 1] and --repetition-penalty positive\n");
		return PIPECTL_EXIT_USAGE;
	}
	a->text = !tokens || !*tokens;
	if (a->messages && *a->messages) {
		/* The runner checks each message; here only that the file is a JSON array. */
		json_error_t jerr;
		json_t *msgs = !strcmp(a->messages, "-") ? json_loadf(stdin, 0, &jerr) : json_load_file(a->messages, 0, &jerr);
		if (!msgs || !json_is_array(msgs) || !json_array_size(msgs)) {
			fprintf(stderr, "pipectl: generate: --messages %s: %s\n", a->messages,
				msgs ? "not a non-empty JSON array of {\"role\", \"content\"} messages" : jerr.text);
			json_decref(msgs);
			return PIPECTL_EXIT_USAGE;
		}
		a->chat_json = json_dumps(msgs, JSON_COMPACT);
		json_decref(msgs);
		if (!a->chat_json) {
			fprintf(stderr, "pipectl: generate: out of memory\n");
			return PIPECTL_EXIT_FAIL;
		}
	}
	/* Each piece checked: jansson makes no string of text that is not UTF-8, and an array takes
	 * that NULL without a word (a --system or --stop dropped in silence). */
	if (a->chat) {
		json_t *msgs = json_array();
		bool ok = msgs != NULL;
		if (ok && a->system)
			ok = json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "system", "content", a->system)) == 0;
		if (ok)
			ok = json_array_append_new(msgs, json_pack("{s:s, s:s}", "role", "user", "content", a->chat)) == 0;
		a->chat_json = ok ? json_dumps(msgs, JSON_COMPACT) : NULL;
		json_decref(msgs);
		if (!a->chat_json) {
			fprintf(stderr, "pipectl: generate: --chat and --system must be UTF-8 text\n");
			return PIPECTL_EXIT_USAGE;
		}
	}
	if (a->n_stops) {
		json_t *st = json_array();
		bool ok = st != NULL;
		for (int i = 0; ok && i < a->n_stops; i++)
			ok = json_array_append_new(st, json_string(a->stops[i])) == 0;
		a->stops_json = ok ? json_dumps(st, JSON_COMPACT) : NULL;
		json_decref(st);
		if (!a->stops_json) {
			fprintf(stderr, "pipectl: generate: --stop strings must be UTF-8\n");
			return PIPECTL_EXIT_USAGE;
		}
	}
	/* Stop ids go with a text prompt as with ids (they were dropped with --prompt and --chat). */
	if (stop_ids && *stop_ids) {
		if (pipectl_parse_ids(stop_ids, UINT32_MAX, &a->stop_ids, &a->n_stop_ids, err, sizeof(err)) != 0) {
			fprintf(stderr, "pipectl: generate: --stop-ids: %s\n", err);
			return PIPECTL_EXIT_USAGE;
		}
		if (a->n_stop_ids > 1024) {
			fprintf(stderr, "pipectl: generate: --stop-ids holds %u ids, at most 1024\n", a->n_stop_ids);
			return PIPECTL_EXIT_USAGE;
		}
	}
	if (a->text)
		return check_ranges(a);
	char *from_file = NULL;
	if (tokens[0] == '@') {
		size_t len = 0;
		int frc = read_text_file(tokens + 1, 64u << 20, &from_file, &len);
		if (frc) {
			fprintf(stderr, "pipectl: generate: --tokens %s: %s\n", tokens, strerror(-frc));
			return PIPECTL_EXIT_USAGE;
		}
		if (strlen(from_file) != len) {
			fprintf(stderr, "pipectl: generate: --tokens %s holds a NUL byte\n", tokens);
			free(from_file);
			return PIPECTL_EXIT_USAGE;
		}
		ids_separators(from_file);
		tokens = from_file;
	}
	int prc = pipectl_parse_ids(tokens, UINT32_MAX, &a->tokens, &a->n_tokens, err, sizeof(err));
	free(from_file);
	if (prc != 0) {
		fprintf(stderr, "pipectl: generate: --tokens: %s\n", err);
		return PIPECTL_EXIT_USAGE;
	}
	if (a->n_tokens > PROTO_MAX_ARRAY) {
		fprintf(stderr, "pipectl: generate: --tokens holds %u ids, at most %u\n", a->n_tokens,
			PROTO_MAX_ARRAY);
		return PIPECTL_EXIT_USAGE;
	}
	return check_ranges(a);
}

/* Checks a MSG_LOGITS reply against the request and writes its values to a->dump_logits.
 * Returns 0, or PIPECTL_EXIT_FAIL after printing why. */
static int write_logits(const struct gen_args *a, const struct msg_logits *l)
{
	if (a->n_tokens && l->position != a->n_tokens - 1) {
		fprintf(stderr, "pipectl: gpu-runner sent the logits of position %llu, not of the prompt's last (%u)\n",
			(unsigned long long)l->position, a->n_tokens - 1);
		return PIPECTL_EXIT_FAIL;
	}
	if (l->values.len == 0 || l->values.len % sizeof(float)) {
		fprintf(stderr, "pipectl: gpu-runner sent %u bytes of logits, not a positive multiple of 4\n",
			l->values.len);
		return PIPECTL_EXIT_FAIL;
	}
	FILE *f = fopen(a->dump_logits, "wb");
	if (!f) {
		fprintf(stderr, "pipectl: --dump-logits: cannot create %s: %s\n", a->dump_logits, strerror(errno));
		return PIPECTL_EXIT_FAIL;
	}
	size_t done = fwrite(l->values.p, 1, l->values.len, f);
	int werr = done == l->values.len ? 0 : errno;
	if (fclose(f) != 0 && !werr)
		werr = errno;
	if (done != l->values.len || werr) {
		fprintf(stderr, "pipectl: --dump-logits: cannot write %s: %s\n", a->dump_logits,
			strerror(werr ? werr : EIO));
		unlink(a->dump_logits);
		return PIPECTL_EXIT_FAIL;
	}
	return 0;
}

static double per_second(uint64_t n, double ms)
{
	return ms > 0 ? (double)n * 1000.0 / ms : 0;
}

/* --stats: the request's timings on stderr, as a line or (--json) as a JSON object. Returns
 * PIPECTL_EXIT_OK, or PIPECTL_EXIT_FAIL after printing why. */
static int print_stats(const struct gen_args *a, const struct msg_gen_done *d, double total_ms)
{
	const char *reason = d->reason.p ? d->reason.p : "-";
	double prefill_tok_s = per_second(d->n_prompt, d->prefill_ms);
	double decode_tok_s = per_second(d->n_generated, d->decode_ms);
	if (!a->stats_json) {
		fprintf(stderr,
			"prompt %llu tokens: prefill %.1f ms (%.1f tok/s); generated %llu tokens (%s): decode %.1f ms "
			"(%.1f tok/s); %.1f ms in all\n",
			(unsigned long long)d->n_prompt, d->prefill_ms, prefill_tok_s, (unsigned long long)d->n_generated,
			reason, d->decode_ms, decode_tok_s, total_ms);
		return PIPECTL_EXIT_OK;
	}
	json_t *o = json_pack("{s:I, s:f, s:f, s:I, s:s, s:f, s:f, s:f}", "prompt_tokens", (json_int_t)d->n_prompt,
			      "prefill_ms", d->prefill_ms, "prefill_tok_s", prefill_tok_s, "tokens_generated",
			      (json_int_t)d->n_generated, "reason", reason, "decode_ms", d->decode_ms, "decode_tok_s",
			      decode_tok_s, "total_ms", total_ms);
	char *text = o ? json_dumps(o, JSON_COMPACT | JSON_PRESERVE_ORDER) : NULL;
	json_decref(o);
	if (!text) {
		fprintf(stderr, "pipectl: generate: cannot write the timings as JSON (reason '%s')\n", reason);
		return PIPECTL_EXIT_FAIL;
	}
	fprintf(stderr, "%s\n", text);
	free(text);
	return PIPECTL_EXIT_OK;
}

/* Reads the stream of replies to the request until MSG_GEN_DONE or a failure. */
static int read_stream(struct pipectl *p, struct runner_watch *w, const struct gen_args *a)
{
	int timeout_ms = pipectl_timeout_ms(p, GEN_DEFAULT_TIMEOUT_S);
	uint64_t count = 0, t0 = now_ns();
	bool have_logits = false;
	struct msg rep;
	for (;;) {
		int rc = watch_wait(w, &rep, timeout_ms);
		if (rc) {
			if (count)
				putchar('\n');
			fflush(stdout);
			if (rc == -ECONNRESET) {
				fprintf(stderr,
					"pipectl: gpu-runner went away during the request (pid %d; %s): it exited or was "
					"killed after sending %llu token%s; its supervisor starts it again (scripts/pipeline "
					"status), then send the request again\n",
					w->pid, w->why ? w->why : "lost", (unsigned long long)count, count == 1 ? "" : "s");
				return PIPECTL_EXIT_FAIL;
			}
			if (rc == -ETIMEDOUT) {
				fprintf(stderr, "pipectl: gpu-runner sent nothing for %d s (after %llu tokens)\n",
					timeout_ms / 1000, (unsigned long long)count);
				return PIPECTL_EXIT_FAIL;
			}
			return pipectl_rpc_failed(p, GEN_SERVICE, "GENERATE", rc, &rep);
		}
		if (rep.type == MSG_LOGITS && a->dump_logits && !have_logits && count == 0) {
			/* Asked for: one, before the first token. */
			int status = write_logits(a, &rep.logits);
			msg_free(&rep);
			if (status)
				return status;
			have_logits = true;
			continue;
		}
		if (rep.type == MSG_TOKEN) {
			if (a->dump_logits && !have_logits) { /* so count is 0: nothing printed yet */
				fprintf(stderr, "pipectl: gpu-runner sent a token before the logits asked for\n");
				msg_free(&rep);
				return PIPECTL_EXIT_FAIL;
			}
			if (rep.token.index != count) {
				putchar('\n');
				fflush(stdout);
				fprintf(stderr, "pipectl: gpu-runner sent token number %llu where %llu was due\n",
					(unsigned long long)rep.token.index, (unsigned long long)count);
				msg_free(&rep);
				return PIPECTL_EXIT_FAIL;
			}
			if (a->text && !a->print_ids)
				fwrite(rep.token.text.p ? rep.token.text.p : "", 1, rep.token.text.len, stdout);
			else
				printf(count ? " %llu" : "%llu", (unsigned long long)rep.token.token);
			fflush(stdout);
			count++;
			msg_free(&rep);
			continue;
		}
		if (rep.type != MSG_GEN_DONE) {
			if (count)
				putchar('\n');
			fflush(stdout);
			fprintf(stderr, "pipectl: gpu-runner answered GENERATE with %s\n", msg_type_name(rep.type));
			msg_free(&rep);
			return PIPECTL_EXIT_FAIL;
		}
		if (a->text && !a->print_ids && rep.gen_done.text.len)
			fwrite(rep.gen_done.text.p, 1, rep.gen_done.text.len, stdout);
		putchar('\n');
		fflush(stdout);
		const struct msg_gen_done *d = &rep.gen_done;
		int status = PIPECTL_EXIT_OK;
		if (a->dump_logits && !have_logits) {
			fprintf(stderr, "pipectl: gpu-runner finished without sending the logits asked for\n");
			status = PIPECTL_EXIT_FAIL;
		}
		if (d->n_generated != count) {
			fprintf(stderr, "pipectl: gpu-runner reported %llu tokens generated but sent %llu\n",
				(unsigned long long)d->n_generated, (unsigned long long)count);
			status = PIPECTL_EXIT_FAIL;
		}
		if (a->stats && print_stats(a, d, (double)(now_ns() - t0) / 1e6) != PIPECTL_EXIT_OK)
			status = PIPECTL_EXIT_FAIL;
		msg_free(&rep);
		return status;
	}
}

int cmd_generate(struct pipectl *p, int argc, char **argv)
{
	struct gen_args a = {0};
	struct runner_watch w = {0};
	int status = parse_args(argc, argv, &a);
	if (status) {
		status = status < 0 ? PIPECTL_EXIT_OK : status;
		goto out_free;
	}
	struct rpc_client *c = pipectl_connect(p, GEN_SERVICE);
	if (!c) {
		status = PIPECTL_EXIT_FAIL;
		goto out_free;
	}
	/* Which runner serves us (a runner being restarted is waited for). */
	struct msg hello;
	int rc = rpc_wait_ready(c, &hello, pipectl_timeout_ms(p, GEN_DEFAULT_TIMEOUT_S));
	if (rc == -ETIMEDOUT) {
		fprintf(stderr, "pipectl: gpu-runner did not answer HELLO in %d s (run dir %s; see scripts/pipeline status)\n",
			pipectl_timeout_ms(p, GEN_DEFAULT_TIMEOUT_S) / 1000, p->run_dir);
		status = PIPECTL_EXIT_FAIL;
		goto out_client;
	}
	if (rc) {
		status = pipectl_rpc_failed(p, GEN_SERVICE, "HELLO", rc, &hello);
		goto out_client;
	}
	watch_open(&w, p, c, &hello.hello_reply);
	msg_free(&hello);
	struct msg req;
	msg_init(&req, MSG_GENERATE, 0);
	req.generate.tokens.v = a.tokens;
	req.generate.tokens.n = a.n_tokens;
	req.generate.max_new = (uint64_t)a.max_new;
	req.generate.temperature = a.temperature;
	req.generate.top_k = (uint64_t)a.top_k;
	req.generate.top_p = a.top_p;
	req.generate.seed = (uint64_t)a.seed;
	req.generate.stop_ids.v = a.stop_ids;
	req.generate.stop_ids.n = a.n_stop_ids;
	req.generate.min_p = a.min_p;
	req.generate.repetition_penalty = a.repetition_penalty;
	if (a.prompt) {
		req.generate.prompt.p = (char *)a.prompt;
		req.generate.prompt.len = (uint32_t)strlen(a.prompt);
	}
	if (a.chat_json) {
		req.generate.chat.p = a.chat_json;
		req.generate.chat.len = (uint32_t)strlen(a.chat_json);
	}
	if (a.stops_json) {
		req.generate.stop_strings.p = a.stops_json;
		req.generate.stop_strings.len = (uint32_t)strlen(a.stops_json);
	}
	req.generate.flags = (a.ignore_eos ? GEN_IGNORE_EOS : 0) | (a.dump_logits ? GEN_LOGITS : 0) |
			     (a.special_as_text ? GEN_SPECIAL_AS_TEXT : 0) | (a.no_bos ? GEN_NO_BOS : 0) |
			     (a.text && !a.print_ids ? GEN_TEXT : 0);
	uint64_t corr;
	rc = rpc_send(c, &req, &corr);
	if (rc) {
		fprintf(stderr, "pipectl: cannot send GENERATE to gpu-runner: %s\n",
			rc == -ETIMEDOUT ? "its queue is full (is it running?)" : strerror(-rc));
		status = PIPECTL_EXIT_FAIL;
		goto out_client;
	}
	watch_sent(&w, corr);
	status = read_stream(p, &w, &a);
out_client:
	watch_close(&w);
	rpc_client_destroy(&c);
out_free:
	free(a.tokens);
	free(a.stop_ids);
	free(a.chat_json);
	free(a.stops_json);
	return status;
}
