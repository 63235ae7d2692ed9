// kvaddr: the library's CUDA source (loaded by kvaddr/kernel_loader.py through cupy.RawModule).
//
// One header per kernel family under kernels/, in dependency order. The library kernels are
// C++ templates; a module compiles only the instantiations it names (kvaddr/kernel_names.py's
// LIBRARY_KERNELS). The baselines the profiler measures the library against are extern "C"
// kernels (kvaddr/kernel_names.py's BASELINE_KERNELS), compiled only with KV_BASELINES defined.
//
// Semantics: docs/spec.md and kvaddr/reference.py (the oracle); the vLLM step: docs/vllm.md and
// kvaddr/engines/vllm_reference.py; the draft addressing: docs/spec-decode.md and
// kvaddr/engines/spec_reference.py.

#include "kernels/common.cuh"
#include "kernels/attention.cuh"
#include "kernels/dsa_step.cuh"
#include "kernels/step.cuh"
#include "kernels/mtp.cuh"
#include "kernels/vllm.cuh"
#include "kernels/vllm_dsa.cuh"
#include "kernels/dsa.cuh"
#include "kernels/spec.cuh"
#ifdef KV_BASELINES
#include "kernels/baselines.cuh"
#endif
