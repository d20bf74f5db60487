/* test_headers.c - the program of the header check. The check itself happened at build time:
 * each public header was compiled alone (see CMakeLists.txt), and this binary only links
 * those objects. */
#include <stdio.h>

int main(void)
{
	printf("every public header compiled on its own\n");
	return 0;
}
