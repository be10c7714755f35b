/*
** conv_mma.cuh: the few PTX instructions the tensor-core convolution kernels
** (conv_implicit_gemm.cu, conv_tf32.cu, conv_wgrad.cu) are built from, as
** inline functions: cp.async 16-byte copies global -> shared with zero fill,
** ldmatrix (plain and transposed) shared -> fragment registers, mma.sync
** m16n8k16 with fp32 accumulators for fp16 and bf16, and mma.sync m16n8k8
** for tf32 (float32 inputs rounded by cvt.rna.tf32.f32).
**
** Why mma.sync and not wgmma: the gathered A rows come from arbitrary input
** rows, so they land in shared memory through per-row cp.async anyway, and
** the layer sizes of the workload (C = 16..256, a few offsets per row) are
** small tiles for which the warp-level instruction is simpler to pipeline.
** sm_80 and newer; older targets compile to a trap (never dispatched: conv.cu
** checks the device's compute capability).
**
** Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), lane = l:
**   A (16x16, row major): a0 (row l/4, cols 2(l%4)+{0,1}), a1 row+8, a2 col+8,
**                         a3 row+8 col+8;
**   B (16x8, "col"):      b0 (rows 2(l%4)+{0,1}, col l/4), b1 rows+8;
**   C (16x8, fp32):       c0,c1 (row l/4, cols 2(l%4)+{0,1}), c2,c3 row+8.
** ldmatrix gives lane l row l/4, cols 2(l%4)+{0,1} of each 8x8 matrix; with
** .trans, rows and columns swap, which is what a B (or A) stored K-major needs.
** tf32 m16n8k8 ("Matrix Fragments for mma.m16n8k8", .tf32), g = l/4, t = l%4,
** one 32-bit element per register:
**   A (16x8, row major):  a0 (g, t), a1 (g+8, t), a2 (g, t+4), a3 (g+8, t+4);
**   B (8x8, "col"):       b0 (k t, n g), b1 (k t+4, n g);
**   C (16x8, fp32):       as for m16n8k16.
** ldmatrix moves 16-bit units, so tf32 fragments come from plain 32-bit
** shared loads (the kernels pick row pitches that keep them conflict free).
*/
#ifndef TSP_CONV_MMA_CUH
#define TSP_CONV_MMA_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#define TSP_MMA_UNAVAILABLE 1
#endif

static __device__ __forceinline__ uint32_t tsp_smem_addr(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; when !valid nothing is read and zeros land.
** Zeros are stored directly rather than by a zero-size cp.async, so that no
** request for the (shared, dummy) source address can reach the L2.  Measured
** on the H100 (2026-11-23): no change in time either way at C = 32-256. */
static __device__ __forceinline__ void tsp_cp_async16(void *dst, const void *src, bool valid) {
#ifndef TSP_MMA_UNAVAILABLE
  if (valid)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(tsp_smem_addr(dst)), "l"(src)
                 : "memory");
  else
    *(uint4 *)dst = make_uint4(0u, 0u, 0u, 0u);
#else
  __trap();
#endif
}

/* 16-byte cp.async to shared address dst reading `bytes` (16 or 0) of src and
** zero-filling the rest: a zero-size copy reads nothing but still lands, so a
** stage's copies need no branch (src must still be a valid global address). */
static __device__ __forceinline__ void tsp_cp_async16_bytes(uint32_t dst, const void *src,
                                                            uint32_t bytes) {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes)
               : "memory");
#else
  (void)dst, (void)src, (void)bytes;
  __trap();
#endif
}

/* 16 bytes global -> shared address dst (tsp_smem_addr) from src when `valid`, else a
** zero-size copy from `base` (any readable global address: nothing is read) that lands 16 zero
** bytes.  Straight-line code: as an if / else of a copy and a shared store, each copy compiled to
** a branch and a convergence barrier (conv_wgmma.cu's lean loader: what it gained there).
** conv_implicit_gemm.cu's loader writes the same select inline; routed through this helper its
** SASS is not the same (nvcc 13.0, 1,648 fewer instructions over its 28 kernels), so it stays
** inline until that is measured on a GPU. */
static __device__ __forceinline__ void tsp_cp_async16_or_zero(uint32_t dst, const void *src, const void *base,
                                                              bool valid) {
  tsp_cp_async16_bytes(dst, valid ? src : base, valid ? 16u : 0u);
}

static __device__ __forceinline__ void tsp_cp_async_commit() {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N> static __device__ __forceinline__ void tsp_cp_async_wait() {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

static __device__ __forceinline__ void tsp_ldmatrix_x4(uint32_t r[4], const void *p) {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(tsp_smem_addr(p)));
#else
  __trap();
#endif
}

static __device__ __forceinline__ void tsp_ldmatrix_x4_trans(uint32_t r[4], const void *p) {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(tsp_smem_addr(p)));
#else
  __trap();
#endif
}

/* c += a * b, m16n8k16, fp32 accumulators; element type picks the opcode. */
static __device__ __forceinline__ void tsp_mma16816(float c[4], const uint32_t a[4],
                                                    const uint32_t b[2], __half) {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

static __device__ __forceinline__ void tsp_mma16816(float c[4], const uint32_t a[4],
                                                    const uint32_t b[2], __nv_bfloat16) {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

/* float32 -> tf32 (round to nearest, ties away from zero), as the b32 register
** an m16n8k8 .tf32 operand takes.  NaN and infinities stay what they are. */
static __device__ __forceinline__ uint32_t tsp_to_tf32(float v) {
#ifndef TSP_MMA_UNAVAILABLE
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
#else
  __trap();
  return 0u;
#endif
}

/* c += a * b, m16n8k8, tf32 operands (tsp_to_tf32), fp32 accumulators. */
static __device__ __forceinline__ void tsp_mma1688_tf32(float c[4], const uint32_t a[4],
                                                        const uint32_t b[2]) {
#ifndef TSP_MMA_UNAVAILABLE
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
  __trap();
#endif
}

/* Two fp32 accumulators -> one 4-byte store of two 16-bit elements. */
static __device__ __forceinline__ void tsp_store2(__half *dst, float a, float b) {
  *(__half2 *)dst = __floats2half2_rn(a, b);
}
static __device__ __forceinline__ void tsp_store2(__nv_bfloat16 *dst, float a, float b) {
  *(__nv_bfloat162 *)dst = __floats2bfloat162_rn(a, b);
}
/* ... or one 8-byte store of two floats (float32 output: dst 8-byte aligned). */
static __device__ __forceinline__ void tsp_store2(float *dst, float a, float b) {
  *(float2 *)dst = make_float2(a, b);
}

/* The reverse: two adjacent elements (src 4-byte aligned for 16-bit types, 8 for float) as fp32. */
static __device__ __forceinline__ float2 tsp_load2(const __half *src) {
  return __half22float2(*(const __half2 *)src);
}
static __device__ __forceinline__ float2 tsp_load2(const __nv_bfloat16 *src) {
  return __bfloat1622float2(*(const __nv_bfloat162 *)src);
}
static __device__ __forceinline__ float2 tsp_load2(const float *src) { return *(const float2 *)src; }

#endif /* TSP_CONV_MMA_CUH */
