/* log.h - one-line log records on stderr, shared by every binary.
 *
 *   log_init("ssd-loader");            // once, at start; reads PIPELINE_LOG_LEVEL
 *   log_info("loaded %u groups", n);
 *
 * A record is "<iso time> <service>[pid] <level>: <text>". The level can change at run
 * time (log_set_level), which the live-tuning path uses. Thread-safe: one write(2) per
 * record. */
#ifndef PIPELINE_LOG_H
#define PIPELINE_LOG_H
#ifdef __cplusplus
extern "C" {
#endif

enum log_level { LOG_DEBUG = 0, LOG_INFO = 1, LOG_WARN = 2, LOG_ERROR = 3 };

void log_init(const char *service);
void log_set_level(enum log_level level);
enum log_level log_get_level(void);
/* Parses "debug", "info", "warn", "error". Returns 0 or -EINVAL. */
int log_parse_level(const char *text, enum log_level *out);
void log_write(enum log_level level, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#define log_debug(...) log_write(LOG_DEBUG, __VA_ARGS__)
#define log_info(...) log_write(LOG_INFO, __VA_ARGS__)
#define log_warn(...) log_write(LOG_WARN, __VA_ARGS__)
#define log_error(...) log_write(LOG_ERROR, __VA_ARGS__)

#ifdef __cplusplus
}
#endif
#endif
