/*
** batch_norm_act.cu: batch normalisation of features [N, C] (with the ReLU after
** it fused in, optionally) on CUDA: training statistics, the normalisation,
** and its backward; torchsp.h says what each computes.  float32, float16,
** bfloat16 data; per-channel vectors in float32 or the data's dtype.
**
** Every kernel lays threads out the same way (BnLayout): a row of C channels
** is `lanes` threads of VEC channels each (16-byte loads when C allows), a
** block covers `rows` rows at a time and strides over the rows; a channel
** chunk of `lanes` vectors is blockIdx.y.  Each thread's channels stay fixed,
** so it loads their per-channel coefficients once.  The reductions (statistics,
** gradient sums) write one partial per block and channel to the workspace and
** a second kernel adds them in fp64 in block order: no atomics, bitwise the
** same sums run to run.  Launches: statistics 2, normalisation 1, backward 3.
*/
#include "conv_internal.cuh"

enum { BN_THREADS = 256, BN_UNROLL = 4 };

/* Partial-sum blocks of a reduction: a few per SM fill it; the workspace holds
** that many whatever N is (it does not depend on the problem's pointers). */
static int64_t bn_partial_blocks(void) {
  const int sms = tsp_device_sms();
  return 4 * (int64_t)(sms > 0 ? sms : 132);
}

/* How a kernel's threads cover the rows (file header). */
typedef struct {
  int vec;       /* channels per thread: 16 / sizeof(T) or 1 */
  int lanes;     /* threads per row (per channel chunk) */
  int rows;      /* rows a block covers at a time: BN_THREADS / lanes */
  int chunks;    /* channel chunks: gridDim.y */
  int64_t blocks; /* gridDim.x */
} BnLayout;

static BnLayout bn_layout(int64_t n, int64_t c, int vec, int64_t max_blocks) {
  BnLayout l;
  const int64_t vectors = c / vec;
  l.vec = vec;
  l.lanes = (int)(vectors < BN_THREADS ? vectors : BN_THREADS);
  l.rows = BN_THREADS / l.lanes;
  l.chunks = (int)((vectors + l.lanes - 1) / l.lanes);
  l.blocks = (n + l.rows - 1) / l.rows;
  const int64_t cap = max_blocks / l.chunks > 0 ? max_blocks / l.chunks : 1;
  if (l.blocks > cap) l.blocks = cap;
  if (l.blocks < 1) l.blocks = 1;
  return l;
}

template <typename T, int VEC> struct alignas(sizeof(T) * VEC) BnPack {
  T v[VEC];
};

/* A per-channel vector entry of runtime dtype t, as float. */
static __device__ __forceinline__ float bn_ld(const void *p, tsp_dtype t, int64_t i) {
  if (t == TSP_FLOAT16) return __half2float(static_cast<const __half *>(p)[i]);
  if (t == TSP_BFLOAT16) return __bfloat162float(static_cast<const __nv_bfloat16 *>(p)[i]);
  return static_cast<const float *>(p)[i];
}

static __device__ __forceinline__ void bn_st(void *p, tsp_dtype t, int64_t i, double v) {
  if (t == TSP_FLOAT16)
    static_cast<__half *>(p)[i] = __float2half_rn((float)v);
  else if (t == TSP_BFLOAT16)
    static_cast<__nv_bfloat16 *>(p)[i] = __float2bfloat16_rn((float)v);
  else
    static_cast<float *>(p)[i] = (float)v;
}

/* The affine of channel ch: pre = (x - mean) * scale + shift.  The forward and
** the backward both take it from here, with explicitly rounded operations (no
** contraction left to the compiler), so the backward's pre-ReLU value is
** bitwise the forward's. */
typedef struct {
  float mean, scale, shift, invstd;
} BnCoef;

static __device__ __forceinline__ BnCoef bn_coef(const tsp_bn_affine &a, tsp_dtype stat_t, tsp_dtype param_t,
                                                 int64_t ch) {
  BnCoef k;
  k.mean = bn_ld(a.mean, stat_t, ch);
  const float spread = bn_ld(a.spread, stat_t, ch);
  k.invstd = a.spread_is_var ? (float)(1.0 / sqrt((double)spread + a.eps)) : spread;
  k.scale = a.weight ? __fmul_rn(bn_ld(a.weight, param_t, ch), k.invstd) : k.invstd;
  k.shift = a.bias ? bn_ld(a.bias, param_t, ch) : 0.0f;
  return k;
}

static __device__ __forceinline__ float bn_pre(float x, const BnCoef &k) {
  return __fmaf_rn(__fsub_rn(x, k.mean), k.scale, k.shift);
}

/* The ReLU's gradient mask: y (pre rounded to T) > 0; NaN gives 0, as torch's. */
template <typename T> static __device__ __forceinline__ bool bn_open(float pre) {
  return tsp_to_float(tsp_from_float<T>(pre)) > 0.0f;
}

/* Row r of the thread's VEC channels starting at ch. */
template <typename T, int VEC>
static __device__ __forceinline__ BnPack<T, VEC> bn_row(const T *p, int64_t r, int64_t c, int64_t ch) {
  return *reinterpret_cast<const BnPack<T, VEC> *>(p + r * c + ch);
}

/* The thread's place: its first channel (>= c when it has none) and its row
** within the block's step (>= rows when it has none). */
struct BnPlace {
  int64_t ch;
  int sub;
  bool active;
};

template <int VEC> static __device__ __forceinline__ BnPlace bn_place(int64_t c, int lanes, int rows) {
  BnPlace p;
  const int lane = (int)threadIdx.x % lanes;
  p.sub = (int)threadIdx.x / lanes;
  p.ch = ((int64_t)blockIdx.y * lanes + lane) * VEC;
  p.active = p.sub < rows && p.ch < c;
  return p;
}

/*
** Reduction pass: per thread, sums u and v over its rows for its channels, then
** the block's sums per channel into part [gridDim.x, 2, c] (u then v).
**   BWD == false: u = x - K, v = u^2, K = x[0, ch] (statistics);
**   BWD == true:  u = dyr, v = dyr * (x - mean) (gradient sums); with RES the
**                 pre-ReLU value adds res, and dyr is written to dres.
*/
template <typename T, int VEC, bool BWD, bool RES>
__global__ void __launch_bounds__(BN_THREADS, 2)
    bn_sums_kernel(const T *__restrict__ x, const T *__restrict__ dy, const T *__restrict__ res,
                   T *__restrict__ dres, int64_t n, int64_t c, int lanes, int rows, tsp_bn_affine a,
                   tsp_dtype stat_t, tsp_dtype param_t, int relu, float *__restrict__ part) {
  extern __shared__ float bn_shared[]; /* [rows, lanes * VEC, 2] */
  const BnPlace at = bn_place<VEC>(c, lanes, rows);
  float su[VEC], sv[VEC], base[VEC];
  BnCoef k[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) su[i] = sv[i] = base[i] = 0.0f;
  if (at.active) {
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      if (BWD) {
        k[i] = bn_coef(a, stat_t, param_t, at.ch + i);
        base[i] = k[i].mean;
      } else {
        base[i] = tsp_to_float(x[at.ch + i]);
      }
    }
    /* With a residual three streams in and one out: two rows in flight (as many bytes as four
    ** rows of one stream) keep the registers below 128. */
    constexpr int UNROLL = RES ? 2 : BN_UNROLL;
    const int64_t step = (int64_t)gridDim.x * rows;
    for (int64_t r = (int64_t)blockIdx.x * rows + at.sub; r < n; r += UNROLL * step) {
      BnPack<T, VEC> xs[UNROLL], gs[UNROLL], rs[UNROLL];
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (r + u * step < n) {
          xs[u] = bn_row<T, VEC>(x, r + u * step, c, at.ch);
          if (BWD) gs[u] = bn_row<T, VEC>(dy, r + u * step, c, at.ch);
          if (RES) rs[u] = bn_row<T, VEC>(res, r + u * step, c, at.ch);
        }
      }
#pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        if (r + u * step >= n) continue;
        BnPack<T, VEC> o;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
          const float xv = tsp_to_float(xs[u].v[i]);
          const float d = xv - base[i];
          if (BWD) {
            float g = tsp_to_float(gs[u].v[i]);
            float pre = bn_pre(xv, k[i]);
            if (RES) pre = __fadd_rn(pre, tsp_to_float(rs[u].v[i]));
            if (relu && !bn_open<T>(pre)) g = 0.0f;
            if (RES) o.v[i] = tsp_from_float<T>(g);
            su[i] += g;
            sv[i] = fmaf(g, d, sv[i]);
          } else {
            su[i] += d;
            sv[i] = fmaf(d, d, sv[i]);
          }
        }
        if (RES) *reinterpret_cast<BnPack<T, VEC> *>(dres + (r + u * step) * c + at.ch) = o;
      }
    }
  }
  const int width = lanes * VEC * 2; /* values of one row step */
  if (at.sub < rows) {
    float *mine = bn_shared + (int64_t)at.sub * width + ((int)threadIdx.x % lanes) * VEC * 2;
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      mine[2 * i] = su[i];
      mine[2 * i + 1] = sv[i];
    }
  }
  __syncthreads();
  for (int vi = threadIdx.x; vi < width; vi += BN_THREADS) {
    const int64_t ch = (int64_t)blockIdx.y * lanes * VEC + vi / 2;
    if (ch >= c) continue;
    float s = 0.0f;
    for (int sub = 0; sub < rows; ++sub) s += bn_shared[(int64_t)sub * width + vi];
    part[((int64_t)blockIdx.x * 2 + (vi & 1)) * c + ch] = s;
  }
}

/* Adds part's `blocks` partials of channel ch in block order, in fp64: 8
** channels a block, 32 slices of the partials each, then the slices in order.
** Many slices because the loop is latency-bound: a MinkUNet step at batch 4
** has 98 finishing launches, which took ~1.07 ms of its 8.67 ms of norm
** kernels with 32 channels and 8 slices a block (what the other norm kernels
** left, session 70 call 2) and 0.50 ms with these (call 3). */
enum { BN_FIN_CH = 8, BN_FIN_SLICES = BN_THREADS / BN_FIN_CH };

static __device__ __forceinline__ bool bn_total(const float *part, int64_t blocks, int64_t c, double *u,
                                                double *v, int64_t *ch_out) {
  __shared__ double s[BN_FIN_SLICES][BN_FIN_CH][2];
  const int tx = (int)threadIdx.x % BN_FIN_CH, ty = (int)threadIdx.x / BN_FIN_CH;
  const int64_t ch = (int64_t)blockIdx.x * BN_FIN_CH + tx;
  double a = 0.0, b = 0.0;
  if (ch < c) {
#pragma unroll 4
    for (int64_t bl = ty; bl < blocks; bl += BN_FIN_SLICES) {
      a += part[(bl * 2) * c + ch];
      b += part[(bl * 2 + 1) * c + ch];
    }
  }
  s[ty][tx][0] = a;
  s[ty][tx][1] = b;
  __syncthreads();
  if (ty != 0 || ch >= c) return false;
  a = b = 0.0;
  for (int i = 0; i < BN_FIN_SLICES; ++i) {
    a += s[i][tx][0];
    b += s[i][tx][1];
  }
  *u = a;
  *v = b;
  *ch_out = ch;
  return true;
}

template <typename T>
__global__ void __launch_bounds__(BN_THREADS)
    bn_stats_finish(const float *__restrict__ part, int64_t blocks, const T *__restrict__ x, int64_t n, int64_t c,
                    tsp_bn_stats s, tsp_dtype param_t) {
  double u, v;
  int64_t ch;
  if (blockIdx.x == 0 && threadIdx.x == 0 && s.batches != nullptr) *s.batches += 1;
  if (!bn_total(part, blocks, c, &u, &v, &ch)) return;
  const double m1 = u / (double)n;
  double var = v / (double)n - m1 * m1;
  if (var < 0.0) var = 0.0;
  const double mean = (double)tsp_to_float(x[ch]) + m1;
  static_cast<float *>(s.mean)[ch] = (float)mean;
  static_cast<float *>(s.invstd)[ch] = (float)(1.0 / sqrt(var + s.eps));
  if (s.running_mean != nullptr) {
    const double rm = bn_ld(s.running_mean, param_t, ch), rv = bn_ld(s.running_var, param_t, ch);
    bn_st(s.running_mean, param_t, ch, (1.0 - s.momentum) * rm + s.momentum * mean);
    bn_st(s.running_var, param_t, ch, (1.0 - s.momentum) * rv + s.momentum * var * (double)n / (double)(n - 1));
  }
}

/* Backward sums to gradients and dx's coefficients: dx = A dyr + B (x - mean) + D,
** coef [3, c] float. */
__global__ void __launch_bounds__(BN_THREADS)
    bn_backward_finish(const float *__restrict__ part, int64_t blocks, int64_t n, int64_t c, tsp_bn_affine a,
                       tsp_dtype param_t, tsp_bn_grads g, float *__restrict__ coef) {
  double u, v;
  int64_t ch;
  if (!bn_total(part, blocks, c, &u, &v, &ch)) return;
  const double invstd = bn_ld(a.spread, TSP_FLOAT32, ch);
  const double w = a.weight ? bn_ld(a.weight, param_t, ch) : 1.0;
  if (g.dbias != nullptr) bn_st(g.dbias, param_t, ch, u);
  if (g.dweight != nullptr) bn_st(g.dweight, param_t, ch, v * invstd);
  const double k = w * invstd;
  coef[ch] = (float)k;
  coef[c + ch] = (float)(-k * invstd * invstd * v / (double)n);
  coef[2 * c + ch] = (float)(-k * u / (double)n);
}

/* y = relu?(pre) with pre = the affine (+ res with RES) (BWD == false), or
** dx = A dyr + B (x - mean) + D (BWD == true; with a residual dy is the sums
** pass's dres, already masked, and relu is 0). */
template <typename T, int VEC, bool BWD, bool RES>
__global__ void __launch_bounds__(BN_THREADS, 2)
    bn_map_kernel(const T *__restrict__ x, const T *__restrict__ dy, const T *__restrict__ res,
                  T *__restrict__ out, int64_t n, int64_t c, int lanes, int rows, tsp_bn_affine a,
                  tsp_dtype stat_t, tsp_dtype param_t, int relu, const float *__restrict__ coef) {
  const BnPlace at = bn_place<VEC>(c, lanes, rows);
  if (!at.active) return;
  BnCoef k[VEC];
  float ca[VEC], cb[VEC], cd[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) {
    k[i] = bn_coef(a, stat_t, param_t, at.ch + i);
    if (BWD) {
      ca[i] = coef[at.ch + i];
      cb[i] = coef[c + at.ch + i];
      cd[i] = coef[2 * c + at.ch + i];
    }
  }
  /* Four rows in flight in both directions: the backward's dx pass with two (fewer registers, no
  ** bfloat16 spills) took 2.52 ms of a MinkUNet step at batch 4 against 2.42 with four (session
  ** 70, calls 2 and 3). */
  constexpr int UNROLL = BN_UNROLL;
  const int64_t step = (int64_t)gridDim.x * rows;
  for (int64_t r = (int64_t)blockIdx.x * rows + at.sub; r < n; r += UNROLL * step) {
    BnPack<T, VEC> xs[UNROLL], gs[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (r + u * step < n) {
        xs[u] = bn_row<T, VEC>(x, r + u * step, c, at.ch);
        if (BWD) gs[u] = bn_row<T, VEC>(dy, r + u * step, c, at.ch);
        if (RES && !BWD) gs[u] = bn_row<T, VEC>(res, r + u * step, c, at.ch);
      }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      if (r + u * step >= n) continue;
      BnPack<T, VEC> o;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float xv = tsp_to_float(xs[u].v[i]);
        float pre = bn_pre(xv, k[i]);
        if (RES && !BWD) pre = __fadd_rn(pre, tsp_to_float(gs[u].v[i]));
        float val;
        if (BWD) {
          float gv = tsp_to_float(gs[u].v[i]);
          if (relu && !bn_open<T>(pre)) gv = 0.0f;
          val = fmaf(ca[i], gv, fmaf(cb[i], __fsub_rn(xv, k[i].mean), cd[i]));
        } else {
          val = relu && pre <= 0.0f ? 0.0f : pre; /* NaN stays NaN, as torch.relu */
        }
        o.v[i] = tsp_from_float<T>(val);
      }
      *reinterpret_cast<BnPack<T, VEC> *>(out + (r + u * step) * c + at.ch) = o;
    }
  }
}

/* ------------------------------------------------------------- launchers --- */

static int bn_valid(const tsp_bn_problem *p) {
  return p->n >= 0 && p->c >= 1 && p->c <= INT32_MAX &&
         (p->dtype == TSP_FLOAT32 || p->dtype == TSP_FLOAT16 || p->dtype == TSP_BFLOAT16) &&
         (p->param_dtype == p->dtype || p->param_dtype == TSP_FLOAT32);
}

static size_t bn_elem(tsp_dtype t) { return t == TSP_FLOAT32 ? 4 : 2; }

/* 16-byte vectors when C is a multiple of their channels and every row pointer is aligned. */
static int bn_vec(const tsp_bn_problem *p, const void *a, const void *b, const void *d) {
  const int v = (int)(16 / bn_elem(p->dtype));
  const uintptr_t bits = (uintptr_t)a | (uintptr_t)b | (uintptr_t)d;
  return p->c % v == 0 && bits % 16 == 0 ? v : 1;
}

static size_t bn_shared_bytes(const BnLayout &l) { return (size_t)l.rows * l.lanes * l.vec * 2 * sizeof(float); }

/* The sums pass; res and dres given (both) for a backward with a residual and relu. */
template <typename T, int VEC, bool BWD>
static void bn_launch_sums(const tsp_bn_problem *p, const BnLayout &l, const void *x, const void *dy,
                           const void *res, void *dres, const tsp_bn_affine &a, float *part, cudaStream_t s) {
  const dim3 grid((unsigned)l.blocks, (unsigned)l.chunks);
  const T *xt = static_cast<const T *>(x), *dyt = static_cast<const T *>(dy), *rt = static_cast<const T *>(res);
  T *drt = static_cast<T *>(dres);
  if constexpr (BWD) {
    if (res != NULL) {
      bn_sums_kernel<T, VEC, true, true><<<grid, BN_THREADS, bn_shared_bytes(l), s>>>(
          xt, dyt, rt, drt, p->n, p->c, l.lanes, l.rows, a, TSP_FLOAT32, p->param_dtype, p->relu, part);
      return;
    }
  }
  bn_sums_kernel<T, VEC, BWD, false><<<grid, BN_THREADS, bn_shared_bytes(l), s>>>(
      xt, dyt, NULL, NULL, p->n, p->c, l.lanes, l.rows, a, TSP_FLOAT32, p->param_dtype, p->relu, part);
}

/* The elementwise pass; res: the forward's residual (NULL in backward). */
template <typename T, int VEC, bool BWD>
static void bn_launch_map(const tsp_bn_problem *p, const BnLayout &l, const void *x, const void *dy, const void *res,
                          void *out, const tsp_bn_affine &a, tsp_dtype stat_t, int relu, const float *coef,
                          cudaStream_t s) {
  const dim3 grid((unsigned)l.blocks, (unsigned)l.chunks);
  const T *xt = static_cast<const T *>(x), *dyt = static_cast<const T *>(dy), *rt = static_cast<const T *>(res);
  T *ot = static_cast<T *>(out);
  if constexpr (!BWD) {
    if (res != NULL) {
      bn_map_kernel<T, VEC, false, true><<<grid, BN_THREADS, 0, s>>>(xt, dyt, rt, ot, p->n, p->c, l.lanes, l.rows,
                                                                     a, stat_t, p->param_dtype, relu, coef);
      return;
    }
  }
  bn_map_kernel<T, VEC, BWD, false><<<grid, BN_THREADS, 0, s>>>(xt, dyt, NULL, ot, p->n, p->c, l.lanes, l.rows, a,
                                                                stat_t, p->param_dtype, relu, coef);
}

template <typename T> struct BnType {
  using type = T;
};
template <int V> struct BnVec {
  static constexpr int value = V;
};

/* f(BnType<T>(), BnVec<VEC>()) for the problem's dtype and vector width. */
template <typename F> static void bn_dispatch(const tsp_bn_problem *p, int vec, F &&f) {
  if (p->dtype == TSP_FLOAT32) {
    if (vec == 4) f(BnType<float>(), BnVec<4>()); else f(BnType<float>(), BnVec<1>());
  } else if (p->dtype == TSP_FLOAT16) {
    if (vec == 8) f(BnType<__half>(), BnVec<8>()); else f(BnType<__half>(), BnVec<1>());
  } else {
    if (vec == 8) f(BnType<__nv_bfloat16>(), BnVec<8>()); else f(BnType<__nv_bfloat16>(), BnVec<1>());
  }
}

extern "C" size_t tsp_bn_cuda_workspace(const tsp_bn_problem *p) {
  return ((size_t)bn_partial_blocks() * 2 + 3) * (size_t)p->c * sizeof(float);
}

extern "C" tsp_status tsp_bn_stats_cuda(const tsp_bn_problem *p, const void *x, const tsp_bn_stats *s,
                                        void *workspace, size_t workspace_bytes, cudaStream_t stream) {
  if (!bn_valid(p) || p->n < 1 || (s->running_mean == NULL) != (s->running_var == NULL) ||
      (s->running_mean != NULL && p->n < 2) || workspace_bytes < tsp_bn_cuda_workspace(p))
    return TSP_ERR_ARGUMENT;
  const int vec = bn_vec(p, x, NULL, NULL);
  const BnLayout l = bn_layout(p->n, p->c, vec, bn_partial_blocks());
  float *part = static_cast<float *>(workspace);
  const tsp_bn_affine none = {NULL, NULL, 0, 0.0, NULL, NULL};
  bn_dispatch(p, vec, [&](auto t, auto v) {
    bn_launch_sums<typename decltype(t)::type, decltype(v)::value, false>(p, l, x, NULL, NULL, NULL, none, part,
                                                                          stream);
  });
  const unsigned fin = (unsigned)((p->c + BN_FIN_CH - 1) / BN_FIN_CH);
  if (p->dtype == TSP_FLOAT32)
    bn_stats_finish<float><<<fin, BN_THREADS, 0, stream>>>(part, l.blocks, static_cast<const float *>(x), p->n,
                                                           p->c, *s, p->param_dtype);
  else if (p->dtype == TSP_FLOAT16)
    bn_stats_finish<__half><<<fin, BN_THREADS, 0, stream>>>(part, l.blocks, static_cast<const __half *>(x), p->n,
                                                            p->c, *s, p->param_dtype);
  else
    bn_stats_finish<__nv_bfloat16><<<fin, BN_THREADS, 0, stream>>>(
        part, l.blocks, static_cast<const __nv_bfloat16 *>(x), p->n, p->c, *s, p->param_dtype);
  return tsp_cuda_check_launch("tsp_bn_stats_cuda");
}

extern "C" tsp_status tsp_bn_forward_cuda(const tsp_bn_problem *p, const void *x, const void *residual,
                                          const tsp_bn_affine *a, void *y, cudaStream_t stream) {
  if (!bn_valid(p)) return TSP_ERR_ARGUMENT;
  if (p->n == 0) return TSP_OK;
  const int vec = bn_vec(p, x, y, residual);
  const BnLayout l = bn_layout(p->n, p->c, vec, 2 * bn_partial_blocks());
  const tsp_dtype stat_t = a->spread_is_var ? p->param_dtype : TSP_FLOAT32;
  bn_dispatch(p, vec, [&](auto t, auto v) {
    bn_launch_map<typename decltype(t)::type, decltype(v)::value, false>(p, l, x, NULL, residual, y, *a, stat_t,
                                                                         p->relu, NULL, stream);
  });
  return tsp_cuda_check_launch("tsp_bn_forward_cuda");
}

extern "C" tsp_status tsp_bn_backward_cuda(const tsp_bn_problem *p, const void *dy, const void *x,
                                           const void *residual, const tsp_bn_affine *a, const tsp_bn_grads *g,
                                           void *workspace, size_t workspace_bytes, cudaStream_t stream) {
  /* With a residual and relu the sums pass writes dyr to dresidual and the dx pass reads it
  ** there, so dresidual is required then (the shim gives a scratch one when r needs no gradient). */
  const bool masked_copy = residual != NULL && p->relu;
  if (!bn_valid(p) || a->spread_is_var || workspace_bytes < tsp_bn_cuda_workspace(p) ||
      (p->n > 0 && masked_copy != (g->dresidual != NULL)))  /* no rows: empty tensors, NULL pointers */
    return TSP_ERR_ARGUMENT;
  float *part = static_cast<float *>(workspace);
  float *coef = part + (size_t)bn_partial_blocks() * 2 * (size_t)p->c;
  if (p->n == 0) {
    if (g->dweight != NULL || g->dbias != NULL) {  /* zero sums: one block of partials, all zero */
      if (cudaMemsetAsync(part, 0, 2 * (size_t)p->c * sizeof(float), stream) != cudaSuccess)
        return tsp_cuda_check(cudaGetLastError(), "tsp_bn_backward_cuda");
      const unsigned fin = (unsigned)((p->c + BN_FIN_CH - 1) / BN_FIN_CH);
      bn_backward_finish<<<fin, BN_THREADS, 0, stream>>>(part, 1, 1, p->c, *a, p->param_dtype, *g, coef);
    }
    return tsp_cuda_check_launch("tsp_bn_backward_cuda");
  }
  const uintptr_t more = (uintptr_t)residual | (uintptr_t)g->dresidual;
  const int vec = bn_vec(p, x, dy, (const void *)((uintptr_t)g->dx | more));
  const BnLayout l = bn_layout(p->n, p->c, vec, bn_partial_blocks());
  bn_dispatch(p, vec, [&](auto t, auto v) {
    bn_launch_sums<typename decltype(t)::type, decltype(v)::value, true>(p, l, x, dy, masked_copy ? residual : NULL,
                                                                         g->dresidual, *a, part, stream);
  });
  const unsigned fin = (unsigned)((p->c + BN_FIN_CH - 1) / BN_FIN_CH);
  bn_backward_finish<<<fin, BN_THREADS, 0, stream>>>(part, l.blocks, p->n, p->c, *a, p->param_dtype, *g, coef);
  if (g->dx != NULL) {
    const BnLayout m = bn_layout(p->n, p->c, vec, 2 * bn_partial_blocks());
    const void *dyr = masked_copy ? g->dresidual : dy;
    bn_dispatch(p, vec, [&](auto t, auto v) {
      bn_launch_map<typename decltype(t)::type, decltype(v)::value, true>(
          p, m, x, dyr, NULL, g->dx, *a, TSP_FLOAT32, masked_copy ? 0 : p->relu, coef, stream);
    });
  }
  return tsp_cuda_check_launch("tsp_bn_backward_cuda");
}
