/* fuzz_codec.c - libFuzzer harness for the message codec (common/codec.c).
 *
 * The input is one ZeroMQ frame as another process could send it. msg_decode must take any
 * bytes without a crash, a leak or undefined behaviour, and return 0 or one of the errors
 * protocol.h lists. What decodes must survive the round trip: encode(decode(x)) succeeds,
 * decodes again, and encodes to the same bytes (the encoding is a function of every field's
 * value, so equal bytes mean the second decode gave the first one's message back). msg_free runs
 * twice after every decode, failed ones included (protocol.h: safe twice; on failure nothing is
 * left to free), so a dangling pointer left in the message shows as a double free.
 *
 *   build-fuzz/fuzz/fuzz_codec -dict=tests/fuzz/codec.dict NEW_DIR tests/fuzz/corpus/codec
 *
 * FUZZ_VERBOSE=1 prints what became of each input. docs/fuzzing.md says more. */
#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/protocol.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define CHECK(cond, ...)                                                   \
	do {                                                               \
		if (!(cond)) {                                             \
			fprintf(stderr, "fuzz_codec: %s: ", #cond);        \
			fprintf(stderr, __VA_ARGS__);                      \
			fputc('\n', stderr);                               \
			abort();                                           \
		}                                                          \
	} while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char err[256];
	struct msg m;
	int rc = msg_decode(data, size, &m, err, sizeof(err));
	if (getenv("FUZZ_VERBOSE"))
		fprintf(stderr, "fuzz_codec: %s\n", rc ? err : msg_type_name(m.type));
	if (rc != 0) {
		CHECK(rc == -EBADMSG || rc == -EPROTONOSUPPORT || rc == -ENOMSG || rc == -ENOMEM,
		      "msg_decode returned %d (%s)", rc, err);
		CHECK(memchr(err, 0, sizeof(err)) != NULL, "the error message is not terminated");
		msg_free(&m);
		return 0;
	}
	CHECK(strcmp(msg_type_name(m.type), "unknown") != 0, "decoded a message of unknown type %u", m.type);

	void *b1 = NULL, *b2 = NULL;
	size_t n1 = 0, n2 = 0;
	rc = msg_encode(&m, &b1, &n1);
	/* Re-encoding may grow a message (a 1-byte integer becomes an 8-byte float64): only a
	 * message near the size limit may be refused for its size. */
	if (rc == -EINVAL && size > PROTO_MAX_MSG_BYTES / 16)
		goto out;
	CHECK(rc == 0, "a decoded %s does not encode: %d", msg_type_name(m.type), rc);

	struct msg m2;
	rc = msg_decode(b1, n1, &m2, err, sizeof(err));
	CHECK(rc == 0, "the re-encoded %s does not decode: %d (%s)", msg_type_name(m.type), rc, err);
	CHECK(m2.type == m.type && m2.corr == m.corr, "type or correlation id changed in the round trip");
	rc = msg_encode(&m2, &b2, &n2);
	CHECK(rc == 0, "the round-tripped %s does not encode: %d", msg_type_name(m.type), rc);
	CHECK(n1 == n2 && memcmp(b1, b2, n1) == 0, "%s changed in the round trip (%zu bytes, then %zu)",
	      msg_type_name(m.type), n1, n2);
	msg_free(&m2);
	msg_free(&m2);
out:
	free(b1);
	free(b2);
	msg_free(&m);
	msg_free(&m);
	return 0;
}
