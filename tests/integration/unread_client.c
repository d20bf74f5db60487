/* unread_client.c - an HTTP client that sends one request and then reads nothing, for
 * tests/integration/http_api.sh: its receive buffer is made small (SO_RCVBUF, before connecting)
 * so that the server's writes block after a few KiB, as they do for a client that stops reading
 * over a real network after megabytes. It holds the connection until it is killed, or until
 * SECONDS pass.
 *
 *   unread_client PORT SECONDS < REQUEST      (the whole HTTP request on stdin; 127.0.0.1)
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	if (argc != 3) {
		fprintf(stderr, "usage: unread_client PORT SECONDS < REQUEST\n");
		return 2;
	}
	int port = atoi(argv[1]), seconds = atoi(argv[2]);
	if (port <= 0 || port > 65535 || seconds <= 0) {
		fprintf(stderr, "unread_client: bad PORT or SECONDS\n");
		return 2;
	}
	static char req[1 << 16];
	size_t len = fread(req, 1, sizeof(req), stdin);
	if (len == 0 || len == sizeof(req)) {
		fprintf(stderr, "unread_client: the request on stdin must be 1..65535 bytes\n");
		return 2;
	}
	int fd = socket(AF_INET, SOCK_STREAM, 0);
	int rcv = 4096;
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
	sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv)) != 0 ||
	    connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
		fprintf(stderr, "unread_client: connecting to 127.0.0.1:%d: %s\n", port, strerror(errno));
		return 1;
	}
	for (size_t off = 0; off < len;) {
		ssize_t n = write(fd, req + off, len - off);
		if (n < 0) {
			fprintf(stderr, "unread_client: sending the request: %s\n", strerror(errno));
			return 1;
		}
		off += (size_t)n;
	}
	sleep((unsigned)seconds);
	close(fd);
	return 0;
}
