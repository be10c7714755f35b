/*
** conv_wgmma_util.cuh: what the wgmma kernels (conv_wgmma.cu: all warps
** load and compute; conv_wgmma_ws.cu: producer warps load, consumer
** warpgroups compute; conv_wgmma_wgrad.cu: wgrad) share: shared-memory matrix descriptors, the wgmma
** fence / commit / wait instructions and the gathered rows' addresses
** (wg_elem_addr16); through conv_wgmma_ops.cuh, the m64nNk16 wrappers per N.
** Included by sm_90a translation units only (TSP_WGMMA); the instructions
** are emitted only when compiling device code for sm_90a (TSP_WGMMA_DEVICE,
** defined by the includer).
*/
#ifndef TSP_CONV_WGMMA_UTIL_CUH
#define TSP_CONV_WGMMA_UTIL_CUH

#include <stdint.h>

#include <cuda.h> /* CUtensorMap and its encoder's types only: the encoder is fetched at run time */

#include "conv_internal.cuh"
#include "conv_mma.cuh"
#include "conv_wgmma_ops.cuh"

/* What every wgmma tile needs of a launch (host side): fp16/bf16, red and n
** positive multiples of 8 that fit an int, V <= TSP_IGEMM_MAX_VOLUME, src
** 16-byte and out 4-byte aligned.  Tile-specific limits and the device
** check are the caller's. */
static inline int wg_launch_ok(tsp_dtype dtype, const tsp_os_launch *a) {
  if (dtype != TSP_FLOAT16 && dtype != TSP_BFLOAT16) return 0;
  if (a->red % 8 != 0 || a->n % 8 != 0 || a->red <= 0 || a->n <= 0 ||
      a->volume > TSP_IGEMM_MAX_VOLUME || a->red > 0x7fffffff || a->n > 0x7fffffff ||
      a->src_rows > 0x7fffffff)
    return 0;
  return (uintptr_t)a->src % 16 == 0 && (uintptr_t)a->out % 4 == 0;
}

/* Whether a [rows, cols] source (rows, cols >= 0) is small enough for
** wg_elem_addr16's 32-bit element offsets: a row's start plus the copied
** chunk's up to 64 elements stays below 2^32 (host side: the kernels' checks). */
static inline int wg_offsets_fit(int64_t rows, int64_t cols) {
  return (uint64_t)rows * (uint64_t)cols <= 0xffffffffULL - 64;
}

/* The address of element `off` of a 16-bit array at `base`: one wide
** multiply-add, in PTX because the compiler otherwise folds a 32-bit offset
** into 64-bit adds (4 instructions a copy where this is 2, LEA and LEA.HI.X in
** the SASS).  The row copies of conv_wgmma_ws.cu's producers and
** conv_wgmma_wgrad.cu's slabs address their rows so, as 32-bit element
** offsets (their checks: sources of fewer than 2^32 - 64 elements).  H100,
** lidar_198k, main kernel us, three rounds each way in one call
** (2026-11-26): ws forward, on 32-bit offsets added as 64-bit pointers, subm
** C = 128 84.6 / 84.7 / 84.9 -> 82.9 / 82.6 / 83.0, dgrad 83.9 / 84.1 /
** 84.1 -> 81.8 / 82.3 / 82.7, down3 C = 128 62.7 -> 61.7, C = 128 at 0.4 m
** 28.6 -> 28.0; C = 256 within its noise. */
static __device__ __forceinline__ const void *wg_elem_addr16(uint64_t base, uint32_t off) {
#ifdef TSP_WGMMA_DEVICE
  uint64_t a;
  asm("mad.wide.u32 %0, %1, 2, %2;\n" : "=l"(a) : "r"(off), "l"(base));
  return (const void *)a;
#else
  return (const void *)(base + 2 * (uint64_t)off);
#endif
}

/* Shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format"): start
** address, leading (K) and stride (8-row) byte offsets, all >> 4; base offset
** 0 and layout type 0 (no swizzle). */
static __device__ __forceinline__ uint64_t wg_desc(const void *smem, uint32_t lbo, uint32_t sbo) {
  const uint64_t addr = tsp_smem_addr(smem);
  return ((addr & 0x3FFFF) >> 4) | ((uint64_t)((lbo >> 4) & 0x3FFF) << 16) |
         ((uint64_t)((sbo >> 4) & 0x3FFF) << 32);
}

/* The 128-byte swizzle descriptors below in two words: the high one is the
** same for all of them (SBO = 1024 bytes, layout type 1), the low one holds
** the start address >> 4 (14 bits) and LBO.  Why split: a kernel that walks
** stages computes a stage's low words once and adds byte offsets >> 4 to them
** (no carry leaves the 14-bit field: shared addresses stay below 256 KB)
** instead of rebuilding each wgmma's descriptor from a pointer (Nsight
** Compute, ping-pong tile at C = 128: ~95 of the consumers' ~160
** instructions a step did that, 2026-11-26). */
enum { WG_DESC_SW128_HI = (1024 >> 4) | (1 << 30) };
static __device__ __forceinline__ uint64_t wg_desc_of_lo(uint32_t lo) {
  return ((uint64_t)WG_DESC_SW128_HI << 32) | lo;
}

/* The low word for the 128-byte swizzle (layout type 1): K-major rows of 64
** 16-bit elements (128 bytes) at a 128-byte pitch, the 16-byte chunk c of row
** r stored at chunk c ^ (r % 8); 8-row groups 1024 bytes apart (SBO); LBO
** unused (1).  The atom must start 1024-byte aligned; a k16 slice inside it
** starts 32 bytes on. */
static __device__ __forceinline__ uint32_t wg_desc_lo_sw128(const void *smem) {
  return ((tsp_smem_addr(smem) & 0x3FFFF) >> 4) | (1u << 16);
}

/* The low word for the 128-byte swizzle of MN-major operands (wgrad's A and
** B, the forward's B in conv_wgmma.cu's swizzled tiles, read with imm-trans =
** 1): 64 channels (128 bytes) per K row, the 16-byte chunk c of K row r
** stored at chunk c ^ (r % 8), K rows at a 128-byte pitch; SBO = 1024 bytes to
** the next 8 K rows, LBO = `lbo` bytes to the next 64 channels (PTX ISA:
** "Leading Dimension Byte Offset", MN-major swizzled).  The atom must start
** 1024-byte aligned; a k16 slice starts 2048 bytes on. */
static __device__ __forceinline__ uint32_t wg_desc_lo_sw128_mn(const void *smem, uint32_t lbo) {
  return ((tsp_smem_addr(smem) & 0x3FFFF) >> 4) | (((lbo >> 4) & 0x3FFF) << 16);
}

/* The 64-byte swizzle for an MN-major operand of 32 channels (the forward's B
** in conv_wgmma.cu's tile 13 at n <= 32, read with imm-trans-b = 1): K row r's
** 64 bytes at 64 r, its 16-byte chunk c at chunk c ^ ((r / 2) % 4) (address
** bits 4-5 xor bits 7-8); SBO = 512 bytes to the next 8 K rows, LBO unused
** (one 32-channel atom), layout type 2.  The atom must start 512-byte
** aligned; a k16 slice starts 1024 bytes on.  Why not the 128-byte swizzle:
** its 64-channel rows would copy and keep as many zeros as channels. */
static constexpr uint32_t WG_DESC_SW64_HI = (512u >> 4) | (2u << 30);
static __device__ __forceinline__ uint64_t wg_desc_sw64_of_lo(uint32_t lo) {
  return ((uint64_t)WG_DESC_SW64_HI << 32) | lo;
}
static __device__ __forceinline__ uint32_t wg_desc_lo_sw64_mn(const void *smem) {
  return ((tsp_smem_addr(smem) & 0x3FFFF) >> 4) | (1u << 16);
}
static __device__ __forceinline__ void wg_fence() {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
static __device__ __forceinline__ void wg_commit() {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N> static __device__ __forceinline__ void wg_wait() {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
/* cp.async (generic proxy) writes -> wgmma (async proxy) reads of shared memory. */
static __device__ __forceinline__ void proxy_fence() {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}
/* Keep the compiler from moving accumulator reads or writes across a wgmma wait. */
template <int N> static __device__ __forceinline__ void acc_fence(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

/* The tensor map that B's copies (TMA) read w through, in conv_wgmma_ws.cu's
** producers and conv_wgmma.cu's ring: 16-bit elements (fp16 and bf16 alike),
** the 128-byte swizzle, zeros past the ends.  bt (the forward): w [V, red, n],
** boxes of 64 produced x 64 reduced channels; else (dgrad) w [V, n, red],
** boxes of 64 reduced x bn produced channels.  The caller checked what the
** encoder requires: w 16-byte aligned, red and n multiples of 8 (row pitches
** multiples of 16 bytes), bn <= 256.  Encoded once per host thread and key
** (conv_wgmma_ws.cu: a layer's weight stays at one address); an error status
** when the driver has no encoder or refuses. */
tsp_status wg_weight_map(CUtensorMap *map, const tsp_os_launch &a, int bt, int bn);

/* ------------------------------------------------ mbarrier and copies --- */

static __device__ __forceinline__ void mb_init(uint64_t *bar, uint32_t count) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(tsp_smem_addr(bar)), "r"(count)
               : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#else
  (void)bar, (void)count;
#endif
}

/* Spin until the phase with this parity has completed; the barrier at the
** shared-memory address `addr` (tsp_smem_addr), or at bar. */
static __device__ __forceinline__ void mb_wait_at(uint32_t addr, uint32_t parity) {
#ifdef TSP_WGMMA_DEVICE
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(addr), "r"(parity)
        : "memory");
  } while (!done);
#else
  (void)addr, (void)parity;
#endif
}
static __device__ __forceinline__ void mb_wait(uint64_t *bar, uint32_t parity) {
  mb_wait_at(tsp_smem_addr(bar), parity);
}

static __device__ __forceinline__ void mb_arrive(uint64_t *bar) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(tsp_smem_addr(bar)) : "memory");
#else
  (void)bar;
#endif
}

/* One arrival that also announces `bytes` of bulk copies completing on the
** barrier at shared address addr, or at bar. */
static __device__ __forceinline__ void mb_arrive_expect_tx_at(uint32_t addr, uint32_t bytes) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(addr), "r"(bytes) : "memory");
#else
  (void)addr, (void)bytes;
#endif
}
static __device__ __forceinline__ void mb_arrive_expect_tx(uint64_t *bar, uint32_t bytes) {
  mb_arrive_expect_tx_at(tsp_smem_addr(bar), bytes);
}

/* Arrive on bar once all of this thread's earlier cp.async have landed (the
** arrival is one of those counted at init: .noinc). */
static __device__ __forceinline__ void mb_arrive_cp_async(uint64_t *bar) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(tsp_smem_addr(bar))
               : "memory");
#else
  (void)bar;
#endif
}

/* A 3-D tensor-map copy (TMA) of the box at (x, y, z), innermost first, into
** shared memory (1024-byte aligned for the 128-byte swizzle), completing on
** bar; elements past the tensor's ends arrive as zeros and count as bytes.
** The _at form takes both shared-memory addresses (tsp_smem_addr). */
static __device__ __forceinline__ void tma_load_3d_at(uint32_t dst, const CUtensorMap *map, int x, int y, int z,
                                                      uint32_t bar) {
#ifdef TSP_WGMMA_DEVICE
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
      "l"((uint64_t)map), "r"(x), "r"(y), "r"(z), "r"(bar)
      : "memory");
#else
  (void)dst, (void)map, (void)x, (void)y, (void)z, (void)bar;
#endif
}
static __device__ __forceinline__ void tma_load_3d(void *dst, const CUtensorMap *map, int x, int y, int z,
                                                   uint64_t *bar) {
  tma_load_3d_at(tsp_smem_addr(dst), map, x, y, z, tsp_smem_addr(bar));
}

#endif /* TSP_CONV_WGMMA_UTIL_CUH */
