#include "common/log.h"

#include <errno.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>
#include <unistd.h>

static char log_service[32] = "pipeline";
static _Atomic int log_level = LOG_INFO;

static const char *const level_names[] = {"debug", "info", "warn", "error"};

int log_parse_level(const char *text, enum log_level *out)
{
	for (int i = 0; i < 4; i++) {
		if (strcasecmp(text, level_names[i]) == 0) {
			*out = (enum log_level)i;
			return 0;
		}
	}
	return -EINVAL;
}

void log_init(const char *service)
{
	snprintf(log_service, sizeof(log_service), "%s", service);
	const char *env = getenv("PIPELINE_LOG_LEVEL");
	enum log_level level;
	if (env && log_parse_level(env, &level) == 0)
		log_set_level(level);
}

void log_set_level(enum log_level level)
{
	atomic_store(&log_level, (int)level);
}

enum log_level log_get_level(void)
{
	return (enum log_level)atomic_load(&log_level);
}

void log_write(enum log_level level, const char *fmt, ...)
{
	if ((int)level < atomic_load(&log_level))
		return;
	char buf[1024];
	struct timespec ts;
	struct tm tm;
	clock_gettime(CLOCK_REALTIME, &ts);
	gmtime_r(&ts.tv_sec, &tm);
	int n = snprintf(buf, sizeof(buf), "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %s[%d] %s: ",
			 tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec,
			 ts.tv_nsec / 1000000, log_service, (int)getpid(), level_names[level]);
	va_list ap;
	va_start(ap, fmt);
	int m = vsnprintf(buf + n, sizeof(buf) - (size_t)n - 1, fmt, ap);
	va_end(ap);
	size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
	if (len > sizeof(buf) - 2)
		len = sizeof(buf) - 2;
	buf[len++] = '\n';
	ssize_t w = write(STDERR_FILENO, buf, len);
	(void)w;
}
