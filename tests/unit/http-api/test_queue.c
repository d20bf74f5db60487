/* test_queue.c - when http-api refuses a request with 429 (runner_queue_refuses, runner_client.h):
 * only when it would have to wait for a worker and --max-queue requests already wait ahead of it.
 * A request queued but not yet taken by an idle worker does not make the next one wait while
 * another worker is idle (that refused requests with idle workers and --max-queue 0). */
#include <check.h>
#include <stdbool.h>

#include "services/http-api/runner_client.h"
#include "tests/unit/common/test_helpers.h"

START_TEST(test_idle_workers_take_requests)
{
	/* queued, busy, workers, max_queue */
	ck_assert(!runner_queue_refuses(0, 0, 1, 0));
	ck_assert(!runner_queue_refuses(0, 3, 4, 0));
	/* one queued, not yet taken, three workers idle: the next one has a worker too */
	ck_assert(!runner_queue_refuses(1, 0, 4, 0));
	ck_assert(!runner_queue_refuses(3, 0, 4, 0));
	ck_assert(!runner_queue_refuses(1, 2, 4, 0));
}
END_TEST

START_TEST(test_waiting_bounded_by_max_queue)
{
	/* every worker busy: it would wait; max_queue 0 refuses, 1 takes one */
	ck_assert(runner_queue_refuses(0, 1, 1, 0));
	ck_assert(!runner_queue_refuses(0, 1, 1, 1));
	ck_assert(runner_queue_refuses(1, 1, 1, 1));
	/* as many queued as idle workers: the new one waits */
	ck_assert(runner_queue_refuses(1, 0, 1, 0));
	ck_assert(runner_queue_refuses(4, 0, 4, 0));
	ck_assert(!runner_queue_refuses(4, 0, 4, 1));
	/* 6 queued for 2 idle workers: 4 wait ahead of the new one */
	ck_assert(!runner_queue_refuses(6, 2, 4, 5));
	ck_assert(runner_queue_refuses(6, 2, 4, 4));
	/* more busy than workers (a worker counted while stopping) is no idle one */
	ck_assert(runner_queue_refuses(0, 5, 4, 0));
}
END_TEST

static Suite *queue_suite(void)
{
	Suite *s = suite_create("http_api_queue");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_idle_workers_take_requests);
	tcase_add_test(tc, test_waiting_bounded_by_max_queue);
	suite_add_tcase(s, tc);
	return s;
}

int main(void)
{
	return th_run(queue_suite());
}
