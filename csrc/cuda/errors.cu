/*
** errors.cu: the last CUDA error seen by a torchsp kernel, as text for the
** shim's TORCH_CHECK messages.  Thread-local so concurrent streams on other
** host threads do not overwrite each other's message.
*/
#include <stdio.h>

#include "cuda_common.cuh"

static thread_local char tsp_last_error[256] = "no CUDA error recorded";

void tsp_cuda_record_error(cudaError_t err, const char *where) {
  snprintf(tsp_last_error, sizeof tsp_last_error, "%s: %s (%s)", where, cudaGetErrorString(err),
           cudaGetErrorName(err));
}

extern "C" const char *tsp_cuda_last_error(void) { return tsp_last_error; }
