/* backend_registry.c - which compute backends this binary holds, looked up by name. */
#include "services/gpu-runner/backend.h"

#include <string.h>

const struct backend_ops *backend_find(const char *name)
{
	if (!name)
		return NULL;
	if (!strcmp(name, backend_ref_ops.name))
		return &backend_ref_ops;
	/* "cuda" hooks in here once backend_cuda.cu defines it:
	 *   #ifdef PIPELINE_HAVE_CUDA
	 *	if (!strcmp(name, "cuda"))
	 *		return &backend_cuda_ops;  // extern const struct backend_ops backend_cuda_ops in backend.h
	 *   #endif
	 * Until then "cuda" is an unbuilt backend and gets NULL, like any unknown name. */
	return NULL;
}

const char *backend_default_name(void)
{
	/* Will be "cuda" when the CUDA backend is built and cudaGetDeviceCount finds a GPU. */
	return backend_ref_ops.name;
}
