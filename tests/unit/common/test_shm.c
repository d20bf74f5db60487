/* test_shm.c - common/shm.c: owned shared-memory objects, their leftovers, their owners, and
 * attaching (the owner's start time is common/proc.c's: test_proc.c).
 *
 * Every object is named "/llmp-test-<runner pid>-<tag>" so parallel runs never collide; the
 * runner process removes every such name after each test case, whatever the tests did. */
#include <check.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/shm.h"
#include "common/util.h"
#include "tests/unit/common/test_helpers.h"

#define SIZE 8192
#define VERSION 3

static pid_t runner_pid; /* set in the runner, inherited by each forked test */
static char names[8][SHM_NAME_MAX];
static int n_names;

/* A name for this test; the fixtures unlink it afterwards. */
static const char *test_name(const char *tag)
{
	ck_assert_int_lt(n_names, 8);
	snprintf(names[n_names], SHM_NAME_MAX, "/llmp-test-%d-%s", (int)runner_pid, tag);
	shm_unlink(names[n_names]);
	return names[n_names++];
}

static void setup_runner(void)
{
	runner_pid = getpid();
}

/* In the runner: removes whatever a failed test left in /dev/shm. */
static void teardown_runner(void)
{
	char prefix[64];
	snprintf(prefix, sizeof(prefix), "llmp-test-%d-", (int)runner_pid);
	DIR *d = opendir("/dev/shm");
	if (!d)
		return;
	for (struct dirent *e; (e = readdir(d)) != NULL;) {
		if (str_has_prefix(e->d_name, prefix)) {
			char name[300];
			snprintf(name, sizeof(name), "/%s", e->d_name);
			shm_unlink(name);
		}
	}
	closedir(d);
}

static void setup(void)
{
	n_names = 0;
}

static void teardown(void)
{
	for (int i = 0; i < n_names; i++)
		shm_unlink(names[i]);
}

static int stat_shm(const char *name, struct stat *st)
{
	char path[128];
	snprintf(path, sizeof(path), "/dev/shm%s", name);
	return stat(path, st);
}

static struct shm_header *hdr(struct shm_object *o)
{
	return shm_object_base(o);
}

/* Data past the header, where the tests leave a marker. */
static char *data(struct shm_object *o)
{
	return (char *)shm_object_base(o) + sizeof(struct shm_header);
}

/* Forks a child that creates name, writes marker, sets ready (if asked) and _exit()s without
 * unlinking, as a crashed owner would. Returns the header as the child left it. */
static struct shm_header leave_dead_object(const char *name, size_t size, uint32_t kind, uint32_t version,
					   enum shm_leftover policy, bool ready, const char *marker)
{
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		struct shm_object *o = NULL;
		struct shm_header h;
		memset(&h, 0, sizeof(h));
		if (shm_object_create(name, size, kind, version, policy, &o, NULL) == 0) {
			strcpy(data(o), marker);
			if (ready)
				shm_object_set_ready(o);
			memcpy(&h, hdr(o), sizeof(h));
		}
		ssize_t w = write(p[1], &h, sizeof(h));
		_exit(w == (ssize_t)sizeof(h) ? 0 : 1);
	}
	close(p[1]);
	struct shm_header h;
	ck_assert_int_eq(read(p[0], &h, sizeof(h)), (ssize_t)sizeof(h));
	close(p[0]);
	int st;
	ck_assert_int_eq(waitpid(child, &st, 0), child); /* reaped: no zombie that kill(pid, 0) still sees */
	ck_assert(WIFEXITED(st) && WEXITSTATUS(st) == 0);
	ck_assert_uint_eq(h.magic, SHM_MAGIC);
	ck_assert_int_eq(h.owner_pid, child);
	return h;
}

/* ---- create ---- */

START_TEST(test_create_header_and_mode)
{
	const char *name = test_name("create");
	umask(0277); /* shm_open applies the umask; the object must still be 0600 */
	struct shm_object *o = NULL;
	bool adopted = true;
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	uint64_t before = (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, &adopted), 0);
	ck_assert(!adopted);
	struct stat st;
	ck_assert_int_eq(stat_shm(name, &st), 0);
	ck_assert_uint_eq(st.st_mode & 07777, 0600);
	ck_assert_int_eq(st.st_size, SIZE);
	ck_assert_uint_eq(st.st_uid, getuid());

	struct shm_header *h = hdr(o);
	ck_assert_uint_eq(h->magic, SHM_MAGIC);
	ck_assert_uint_eq(h->kind, SHM_KIND_TEST);
	ck_assert_uint_eq(h->layout_version, VERSION);
	ck_assert_uint_eq(h->total_size, SIZE);
	ck_assert_uint_ne(h->instance_id, 0);
	ck_assert_int_eq(h->owner_pid, getpid());
	ck_assert_uint_eq(h->owner_start, process_start_time(getpid()));
	ck_assert_uint_ne(h->owner_start, 0);
	ck_assert_uint_eq(h->adoptions, 0);
	ck_assert_uint_eq(h->ready, 0);
	ck_assert_uint_ge(h->created_unix_ns, before);
	ck_assert_uint_lt(h->created_unix_ns, before + 60ull * 1000000000ull);
	ck_assert(shm_owner_alive(h));
	ck_assert_uint_eq(shm_object_size(o), SIZE);
	ck_assert_str_eq(shm_object_get_name(o), name);
	/* The rest is zeroed and writable. */
	for (size_t i = sizeof(*h); i < SIZE; i++)
		TH_CHECK(((char *)h)[i] == 0, "byte %zu not zero", i);
	memset(data(o), 0xab, SIZE - sizeof(*h));
	shm_object_set_ready(o);
	ck_assert_uint_eq(h->ready, 1);
	shm_object_close(&o, true);
	ck_assert_ptr_null(o);
}
END_TEST

START_TEST(test_create_bad_arguments)
{
	struct shm_object *o = NULL;
	char longname[SHM_NAME_MAX + 8];
	memset(longname, 'n', sizeof(longname));
	longname[0] = '/';
	longname[SHM_NAME_MAX] = 0; /* SHM_NAME_MAX characters: one too many */
	ck_assert_int_eq(shm_object_create("no-slash", SIZE, SHM_KIND_TEST, 1, SHM_RECLAIM, &o, NULL), -EINVAL);
	ck_assert_int_eq(shm_object_create("/a/b", SIZE, SHM_KIND_TEST, 1, SHM_RECLAIM, &o, NULL), -EINVAL);
	ck_assert_int_eq(shm_object_create(longname, SIZE, SHM_KIND_TEST, 1, SHM_RECLAIM, &o, NULL), -EINVAL);
	ck_assert_int_eq(shm_object_create(NULL, SIZE, SHM_KIND_TEST, 1, SHM_RECLAIM, &o, NULL), -EINVAL);
	const char *name = test_name("small");
	ck_assert_int_eq(shm_object_create(name, sizeof(struct shm_header) - 1, SHM_KIND_TEST, 1, SHM_RECLAIM, &o,
					   NULL),
			 -EINVAL);
	ck_assert_ptr_null(o);
	struct stat st;
	ck_assert_int_ne(stat_shm(name, &st), 0); /* nothing left behind */
	/* Exactly a header is enough. */
	ck_assert_int_eq(shm_object_create(name, sizeof(struct shm_header), SHM_KIND_TEST, 1, SHM_RECLAIM, &o, NULL),
			 0);
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_create_exclusive)
{
	/* A second create of a name whose owner (this process) is alive is refused, with a message. */
	const char *name = test_name("excl");
	struct shm_object *o = NULL, *o2 = NULL;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	strcpy(data(o), "mine");
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	int rc = shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o2, NULL);
	char *err = th_capture_end(&cap);
	ck_assert_int_eq(rc, -EBUSY);
	ck_assert_ptr_null(o2);
	ck_assert_ptr_nonnull(strstr(err, name));
	free(err);
	bool adopted = true;
	shm_object_set_ready(o);
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o2, &adopted), -EBUSY);
	ck_assert(!adopted);
	ck_assert_str_eq(data(o), "mine"); /* untouched */
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_create_over_foreign_object)
{
	/* An object of that name without our header (not ours, or cut short) counts as dead. */
	const char *name = test_name("foreign");
	int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(ftruncate(fd, 4096), 0);
	ck_assert_int_eq(pwrite(fd, "not a header", 12, 0), 12);
	close(fd);
	struct shm_object *o = NULL;
	bool adopted = true;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, &adopted), 0);
	ck_assert(!adopted);
	ck_assert_uint_eq(hdr(o)->magic, SHM_MAGIC);
	ck_assert_uint_eq(shm_object_size(o), SIZE);
	shm_object_close(&o, true);

	fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600); /* empty: shorter than a header */
	ck_assert_int_ge(fd, 0);
	close(fd);
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	shm_object_close(&o, true);
}
END_TEST

/* ---- leftovers ---- */

START_TEST(test_open_mode_not_adopted)
{
	/* A leftover of ours that other users may open is laid out anew at 0600, never adopted; an
	 * object that is not 0600 is not attached to. */
	const char *name = test_name("openmode");
	struct shm_header old = leave_dead_object(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, true, "shared");
	int fd = shm_open(name, O_RDWR, 0);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(fchmod(fd, 0644), 0);
	close(fd);
	struct shm_object *a = NULL;
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -EPERM);
	ck_assert_ptr_null(a);
	struct shm_object *o = NULL;
	bool adopted = true;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, &adopted), 0);
	ck_assert(!adopted);
	ck_assert_uint_ne(hdr(o)->instance_id, old.instance_id);
	ck_assert_str_eq(data(o), "");
	struct stat st;
	ck_assert_int_eq(stat_shm(name, &st), 0);
	ck_assert_uint_eq(st.st_mode & 07777, 0600);
	shm_object_set_ready(o);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), 0);
	shm_object_close(&a, false);
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_other_users_object_refused)
{
	/* Another user's object of that name (made first in /dev/shm, which everyone may write): neither
	 * adopted, removed nor attached to. Needs the right to give it away (root). */
	if (geteuid() != 0)
		return;
	const char *name = test_name("otheruser");
	leave_dead_object(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, true, "theirs");
	int fd = shm_open(name, O_RDWR, 0);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(fchown(fd, 65534, 65534), 0);
	close(fd);
	struct shm_object *o = NULL;
	bool adopted = true;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, &adopted), -EPERM);
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), -EPERM);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &o), -EPERM);
	struct stat st;
	ck_assert_int_eq(stat_shm(name, &st), 0); /* still there, still theirs */
	ck_assert_uint_eq(st.st_uid, 65534);
}
END_TEST

START_TEST(test_reclaim_dead_owner)
{
	const char *name = test_name("reclaim");
	struct shm_header old = leave_dead_object(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, true, "left");
	struct shm_object *o = NULL;
	bool adopted = true;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, &adopted), 0);
	ck_assert(!adopted);
	struct shm_header *h = hdr(o);
	ck_assert_uint_ne(h->instance_id, old.instance_id); /* laid out anew */
	ck_assert_int_eq(h->owner_pid, getpid());
	ck_assert_uint_eq(h->owner_start, process_start_time(getpid()));
	ck_assert_uint_eq(h->adoptions, 0);
	ck_assert_uint_eq(h->ready, 0);
	ck_assert_str_eq(data(o), ""); /* old contents gone */
	struct stat st;
	ck_assert_int_eq(stat_shm(name, &st), 0);
	ck_assert_uint_eq(st.st_mode & 07777, 0600);
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_adopt_dead_owner)
{
	const char *name = test_name("adopt");
	struct shm_header old = leave_dead_object(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, true, "kept");
	/* A second owner adopts it and dies too: the count goes on. */
	struct shm_header mid = leave_dead_object(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, true, "kept2");
	ck_assert_uint_eq(mid.instance_id, old.instance_id);
	ck_assert_uint_eq(mid.adoptions, 1);
	ck_assert_int_ne(mid.owner_pid, old.owner_pid);

	struct shm_object *o = NULL;
	bool adopted = false;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, &adopted), 0);
	ck_assert(adopted);
	struct shm_header *h = hdr(o);
	ck_assert_uint_eq(h->instance_id, old.instance_id);
	ck_assert_uint_eq(h->created_unix_ns, old.created_unix_ns);
	ck_assert_int_eq(h->owner_pid, getpid());
	ck_assert_uint_eq(h->owner_start, process_start_time(getpid()));
	ck_assert_uint_eq(h->adoptions, 2);
	ck_assert_uint_eq(h->ready, 1);
	ck_assert_str_eq(data(o), "kept2");
	ck_assert(shm_owner_alive(h));
	/* Others can attach to the adopted object as before. */
	struct shm_object *a = NULL;
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), 0);
	ck_assert_str_eq(data(a), "kept2");
	shm_object_close(&a, false);
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_adopt_mismatch_reclaims)
{
	/* A leftover that does not match what the new owner wants, or was never made ready, is
	 * laid out anew even under SHM_ADOPT. */
	struct {
		size_t size;
		uint32_t kind, version;
		bool ready;
	} cases[] = {
		{SIZE * 2, SHM_KIND_TEST, VERSION, true},
		{SIZE, SHM_KIND_KV_POOL, VERSION, true},
		{SIZE, SHM_KIND_TEST, VERSION + 1, true},
		{SIZE, SHM_KIND_TEST, VERSION, false},
	};
	for (size_t i = 0; i < ARRAY_SIZE(cases); i++) {
		char tag[16];
		snprintf(tag, sizeof(tag), "mismatch%zu", i);
		const char *name = test_name(tag);
		struct shm_header old = leave_dead_object(name, cases[i].size, cases[i].kind, cases[i].version,
							  SHM_RECLAIM, cases[i].ready, "stale");
		struct shm_object *o = NULL;
		bool adopted = true;
		ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, &adopted), 0);
		ck_assert_msg(!adopted, "case %zu adopted", i);
		ck_assert_uint_ne(hdr(o)->instance_id, old.instance_id);
		ck_assert_uint_eq(hdr(o)->kind, SHM_KIND_TEST);
		ck_assert_uint_eq(hdr(o)->layout_version, VERSION);
		ck_assert_uint_eq(shm_object_size(o), SIZE);
		ck_assert_str_eq(data(o), "");
		struct stat st;
		ck_assert_int_eq(stat_shm(name, &st), 0);
		ck_assert_int_eq(st.st_size, SIZE);
		shm_object_close(&o, true);
	}
}
END_TEST

START_TEST(test_zombie_owner_counts_as_dead)
{
	/* An owner that exited but is not reaped yet (a zombie) owns nothing: its successor may
	 * reclaim or adopt at once, without waiting for the parent to reap it. */
	const char *name = test_name("zombie");
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		struct shm_object *o = NULL;
		int rc = shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL);
		if (rc == 0)
			shm_object_set_ready(o);
		char c = rc == 0 ? 'y' : 'n';
		ssize_t w = write(p[1], &c, 1);
		_exit(w == 1 ? 0 : 1);
	}
	close(p[1]);
	char c = 0;
	ck_assert_int_eq(read(p[0], &c, 1), 1);
	close(p[0]);
	ck_assert_int_eq(c, 'y');
	/* Wait until the child has exited without reaping it. */
	siginfo_t si;
	ck_assert_int_eq(waitid(P_PID, (id_t)child, &si, WEXITED | WNOWAIT), 0);
	ck_assert(pid_alive(child)); /* kill(pid, 0) still sees the zombie */
	struct shm_object *o = NULL;
	bool adopted = false;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, &adopted), 0);
	ck_assert(adopted);
	ck_assert_int_eq(hdr(o)->owner_pid, getpid());
	shm_object_close(&o, true);
	int st;
	ck_assert_int_eq(waitpid(child, &st, 0), child);
}
END_TEST

START_TEST(test_live_owner_refused)
{
	const char *name = test_name("live");
	int p[2];
	ck_assert_int_eq(pipe(p), 0);
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		struct shm_object *o = NULL;
		char ok = shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL) == 0;
		if (ok)
			shm_object_set_ready(o);
		ssize_t w = write(p[1], &ok, 1);
		(void)w;
		for (;;)
			pause();
	}
	close(p[1]);
	char ok = 0;
	ck_assert_int_eq(read(p[0], &ok, 1), 1);
	close(p[0]);
	ck_assert(ok);
	struct shm_object *o = NULL;
	struct th_capture cap;
	th_capture_begin(&cap, STDERR_FILENO);
	int rc_reclaim = shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL);
	int rc_adopt = shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_ADOPT, &o, NULL);
	char *err = th_capture_end(&cap);
	/* Kill the child before asserting so a failure leaves no process behind. */
	kill(child, SIGKILL);
	int st;
	ck_assert_int_eq(waitpid(child, &st, 0), child);
	ck_assert_int_eq(rc_reclaim, -EBUSY);
	ck_assert_int_eq(rc_adopt, -EBUSY);
	ck_assert_ptr_null(o);
	char pidtext[32];
	snprintf(pidtext, sizeof(pidtext), "%d", (int)child);
	ck_assert_msg(strstr(err, name) && strstr(err, pidtext), "message '%s' names neither object nor pid", err);
	free(err);
	/* Now that it is dead, the object is reclaimed. */
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_pid_reuse_counts_as_dead)
{
	/* The recorded pid belongs to a live process, but one that started at another time: the
	 * original owner is gone and its pid was reused. */
	const char *name = test_name("reuse");
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	struct shm_header *h = hdr(o);
	uint64_t old_id = h->instance_id;
	h->owner_start += 12345;
	ck_assert(!shm_owner_alive(h));
	shm_object_close(&o, false);
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	ck_assert_uint_ne(hdr(o)->instance_id, old_id);
	shm_object_close(&o, true);
}
END_TEST

START_TEST(test_owner_alive)
{
	struct shm_header h;
	memset(&h, 0, sizeof(h));
	atomic_store(&h.owner_pid, (int32_t)getpid());
	h.owner_start = process_start_time(getpid());
	ck_assert(shm_owner_alive(&h));
	h.owner_start = 0; /* unknown start time: the pid decides */
	ck_assert(shm_owner_alive(&h));
	h.owner_start = process_start_time(getpid()) + 1;
	ck_assert(!shm_owner_alive(&h));
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0)
		_exit(0);
	int st;
	ck_assert_int_eq(waitpid(child, &st, 0), child);
	atomic_store(&h.owner_pid, (int32_t)child);
	h.owner_start = 0;
	ck_assert(!shm_owner_alive(&h));
	atomic_store(&h.owner_pid, 0);
	ck_assert(!shm_owner_alive(&h));
}
END_TEST

START_TEST(test_object_owner)
{
	/* Owned by us, alive: 1 and our pid. */
	const char *name = test_name("owner");
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	int owner = 0;
	ck_assert_int_eq(shm_object_owner(name, &owner), 1);
	ck_assert_int_eq(owner, getpid());
	/* Another start time under our pid: not ours any more. */
	hdr(o)->owner_start += 1;
	owner = -1;
	ck_assert_int_eq(shm_object_owner(name, &owner), 0);
	ck_assert_int_eq(owner, -1); /* untouched */
	shm_object_close(&o, true);
	/* Left by a dead owner. */
	const char *dead = test_name("owner-dead");
	leave_dead_object(dead, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, true, "x");
	ck_assert_int_eq(shm_object_owner(dead, &owner), 0);
	/* Not one of ours: too short for a header, or another magic. */
	const char *foreign = test_name("owner-foreign");
	int fd = shm_open(foreign, O_CREAT | O_EXCL | O_RDWR, 0600);
	ck_assert_int_ge(fd, 0);
	ck_assert_int_eq(shm_object_owner(foreign, &owner), 0);
	struct shm_header h;
	memset(&h, 0, sizeof(h));
	h.magic = SHM_MAGIC ^ 1;
	atomic_store(&h.owner_pid, (int32_t)getpid());
	ck_assert_int_eq(pwrite(fd, &h, sizeof(h), 0), (ssize_t)sizeof(h));
	close(fd);
	ck_assert_int_eq(shm_object_owner(foreign, &owner), 0);
	/* No such object. */
	ck_assert_int_eq(shm_object_owner(test_name("owner-none"), &owner), -ENOENT);
}
END_TEST

/* ---- attach ---- */

START_TEST(test_attach)
{
	const char *name = test_name("attach");
	struct shm_object *o = NULL, *a = NULL;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	/* Not ready yet. */
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -EAGAIN);
	ck_assert_ptr_null(a);
	strcpy(data(o), "hello");
	shm_object_set_ready(o);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, true, &a), 0);
	ck_assert_uint_eq(shm_object_size(a), SIZE);
	ck_assert_str_eq(shm_object_get_name(a), name);
	ck_assert_str_eq(data(a), "hello");
	ck_assert_ptr_ne(shm_object_base(a), shm_object_base(o));
	strcpy(data(a), "written by the attacher"); /* same memory through a second mapping */
	ck_assert_str_eq(data(o), "written by the attacher");
	shm_object_close(&a, false);
	ck_assert_ptr_null(a);
	/* Read-only: the mapping refuses writes (checked in a child, where the fault is expected). */
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), 0);
	pid_t child = fork();
	ck_assert_int_ge(child, 0);
	if (child == 0) {
		signal(SIGSEGV, SIG_DFL);
		data(a)[0] = 'x';
		_exit(0);
	}
	int st;
	ck_assert_int_eq(waitpid(child, &st, 0), child);
	ck_assert_msg(WIFSIGNALED(st) && WTERMSIG(st) == SIGSEGV, "a write through a read-only attach succeeded");
	shm_object_close(&a, false);
	/* Closing an attachment leaves the object. */
	struct stat sst;
	ck_assert_int_eq(stat_shm(name, &sst), 0);

	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_KV_POOL, VERSION, false, &a), -EPROTO);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION + 1, false, &a), -EPROTO);
	hdr(o)->total_size = SIZE * 2; /* header and object disagree on the size */
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -EPROTO);
	hdr(o)->total_size = SIZE;
	hdr(o)->magic ^= 1;
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -EPROTO);
	hdr(o)->magic ^= 1;
	ck_assert_ptr_null(a);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), 0);
	shm_object_close(&a, false);
	shm_object_close(&o, true);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -ENOENT);
	ck_assert_ptr_null(a);
}
END_TEST

START_TEST(test_attach_unsized)
{
	/* Created but not yet sized by its owner: not ready. */
	const char *name = test_name("unsized");
	int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
	ck_assert_int_ge(fd, 0);
	struct shm_object *a = NULL;
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -EAGAIN);
	ck_assert_int_eq(ftruncate(fd, 64), 0);
	ck_assert_int_eq(shm_object_attach(name, SHM_KIND_TEST, VERSION, false, &a), -EAGAIN);
	close(fd);
	ck_assert_ptr_null(a);
}
END_TEST

/* ---- close ---- */

START_TEST(test_close)
{
	const char *name = test_name("close");
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	shm_object_close(&o, false);
	ck_assert_ptr_null(o);
	shm_object_close(&o, false); /* twice: nothing happens */
	shm_object_close(&o, true);
	shm_object_close(NULL, true);
	struct stat st;
	ck_assert_int_eq(stat_shm(name, &st), 0); /* still there */
	/* The header still names this live process as the owner: a second create is refused
	 * until the name is removed. */
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), -EBUSY);
	shm_unlink(name);
	ck_assert_int_eq(shm_object_create(name, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	shm_object_close(&o, true);
	ck_assert_int_ne(stat_shm(name, &st), 0);
	ck_assert_int_eq(errno, ENOENT);
}
END_TEST

/* ---- names and process start times ---- */

START_TEST(test_object_name)
{
	char buf[SHM_NAME_MAX], want[SHM_NAME_MAX];
	ck_assert_int_eq(shm_object_name("default", "weights", buf, sizeof(buf)), 0);
	snprintf(want, sizeof(want), "/llmp-%u-default-weights", (unsigned)getuid());
	ck_assert_str_eq(buf, want);
	char small[12];
	ck_assert_int_eq(shm_object_name("default", "weights", small, sizeof(small)), -ENAMETOOLONG);
	/* Longer than SHM_NAME_MAX fails even with a larger buffer. */
	char big[512], inst[200];
	memset(inst, 'i', sizeof(inst) - 1);
	inst[sizeof(inst) - 1] = 0;
	ck_assert_int_eq(shm_object_name(inst, "kv", big, sizeof(big)), -ENAMETOOLONG);
	/* A name that fits is one shm_object_create takes. */
	char iname[64];
	snprintf(iname, sizeof(iname), "test%d", (int)runner_pid);
	ck_assert_int_eq(shm_object_name(iname, "obj", buf, sizeof(buf)), 0);
	ck_assert_ptr_null(strchr(buf + 1, '/'));
	ck_assert_int_lt(n_names, 8);
	strcpy(names[n_names++], buf);
	struct shm_object *o = NULL;
	ck_assert_int_eq(shm_object_create(buf, SIZE, SHM_KIND_TEST, VERSION, SHM_RECLAIM, &o, NULL), 0);
	shm_object_close(&o, true);
}
END_TEST

static Suite *shm_suite(void)
{
	Suite *s = suite_create("shm");
	TCase *tc = tcase_create("create");
	tcase_add_unchecked_fixture(tc, setup_runner, teardown_runner);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_create_header_and_mode);
	tcase_add_test(tc, test_create_bad_arguments);
	tcase_add_test(tc, test_create_exclusive);
	tcase_add_test(tc, test_create_over_foreign_object);
	suite_add_tcase(s, tc);
	tc = tcase_create("leftovers");
	tcase_add_unchecked_fixture(tc, setup_runner, teardown_runner);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_reclaim_dead_owner);
	tcase_add_test(tc, test_adopt_dead_owner);
	tcase_add_test(tc, test_open_mode_not_adopted);
	tcase_add_test(tc, test_other_users_object_refused);
	tcase_add_test(tc, test_adopt_mismatch_reclaims);
	tcase_add_test(tc, test_zombie_owner_counts_as_dead);
	tcase_add_test(tc, test_live_owner_refused);
	tcase_add_test(tc, test_pid_reuse_counts_as_dead);
	tcase_add_test(tc, test_owner_alive);
	tcase_add_test(tc, test_object_owner);
	suite_add_tcase(s, tc);
	tc = tcase_create("attach");
	tcase_add_unchecked_fixture(tc, setup_runner, teardown_runner);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_attach);
	tcase_add_test(tc, test_attach_unsized);
	tcase_add_test(tc, test_close);
	suite_add_tcase(s, tc);
	tc = tcase_create("names");
	tcase_add_unchecked_fixture(tc, setup_runner, teardown_runner);
	tcase_add_checked_fixture(tc, setup, teardown);
	tcase_add_test(tc, test_object_name);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(shm_suite());
}
