/* backend_registry.c - which compute backends this binary holds, looked up by name. */
#include "services/gpu-runner/backend.h"

#include <string.h>

#ifdef PIPELINE_HAVE_CUDA
#include <cuda_runtime_api.h>

/* Defined in backend_cuda.cu. */
extern const struct backend_ops backend_cuda_ops;
#endif

const struct backend_ops *backend_find(const char *name)
{
	if (!name)
		return NULL;
	if (!strcmp(name, backend_ref_ops.name))
		return &backend_ref_ops;
#ifdef PIPELINE_HAVE_CUDA
	if (!strcmp(name, backend_cuda_ops.name))
		return &backend_cuda_ops;
#endif
	/* Without nvcc "cuda" is an unbuilt backend and gets NULL, like any unknown name. */
	return NULL;
}

const char *backend_default_name(void)
{
#ifdef PIPELINE_HAVE_CUDA
	/* No driver, no device, or a driver too old for the runtime: all mean the C backend. */
	int count = 0;
	if (cudaGetDeviceCount(&count) == cudaSuccess && count > 0)
		return backend_cuda_ops.name;
	cudaGetLastError(); /* the failure is not sticky: leave no error behind for later calls */
#endif
	return backend_ref_ops.name;
}
