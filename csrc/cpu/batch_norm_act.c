/*
** batch_norm_act.c: batch normalisation of features [N, C] (with the ReLU after
** it fused in, optionally) on the CPU: training statistics, the normalisation,
** and its backward.  torchsp.h says what each computes.
**
** float32 and float64 (the CPU shim upcasts float16 and bfloat16, and gives
** the per-channel vectors in the data's dtype).  Arithmetic in double; rows
** are summed in chunks of BN_CHUNK, one OpenMP task each, and the chunks'
** sums added in order, so results do not depend on the thread count.
*/
#include <math.h>
#include <stdlib.h>

#include "torchsp.h"

enum { BN_CHUNK = 1024 };

static inline double bn_load(const void *p, tsp_dtype t, int64_t i) {
  return t == TSP_FLOAT64 ? ((const double *)p)[i] : (double)((const float *)p)[i];
}

static inline void bn_store(void *p, tsp_dtype t, int64_t i, double v) {
  if (t == TSP_FLOAT64)
    ((double *)p)[i] = v;
  else
    ((float *)p)[i] = (float)v;
}

/* v rounded to t and back: the value y holds (the ReLU's mask is taken on it). */
static inline double bn_round(tsp_dtype t, double v) { return t == TSP_FLOAT64 ? v : (double)(float)v; }

static int bn_valid(const tsp_bn_problem *p) {
  return p->n >= 0 && p->c >= 1 && (p->dtype == TSP_FLOAT32 || p->dtype == TSP_FLOAT64) &&
         p->param_dtype == p->dtype;
}

/* The affine per channel: pre = (x - mean[c]) * scale[c] + shift[c]; mean and
** invstd out as well.  Three malloc'd [C] arrays in one block; NULL when out of memory. */
static double *bn_coefficients(const tsp_bn_problem *p, const tsp_bn_affine *a) {
  const int64_t c = p->c;
  double *k = (double *)malloc(sizeof(double) * 4 * (size_t)c);
  if (k == NULL) return NULL;
  for (int64_t j = 0; j < c; ++j) {
    const double spread = bn_load(a->spread, p->dtype, j);
    const double invstd = a->spread_is_var ? 1.0 / sqrt(spread + a->eps) : spread;
    const double w = a->weight ? bn_load(a->weight, p->dtype, j) : 1.0;
    k[j] = bn_load(a->mean, p->dtype, j);
    k[c + j] = w * invstd;
    k[2 * c + j] = a->bias ? bn_load(a->bias, p->dtype, j) : 0.0;
    k[3 * c + j] = invstd;
  }
  return k;
}

/* The forward's value of element (i = r C + j) before the ReLU, from x's value xv: the affine, plus
** the residual when there is one. */
static inline double bn_pre(const tsp_bn_problem *p, double xv, const void *res, int64_t i, const double *k,
                            int64_t c, int64_t j) {
  const double v = (xv - k[j]) * k[c + j] + k[2 * c + j];
  return res != NULL ? v + bn_load(res, p->dtype, i) : v;
}

/* The ReLU's gradient mask there: y (pre rounded to dtype) > 0; NaN gives 0, as torch's. */
static inline int bn_open(const tsp_bn_problem *p, double xv, const void *res, int64_t i, const double *k,
                          int64_t c, int64_t j) {
  return bn_round(p->dtype, bn_pre(p, xv, res, i, k, c, j)) > 0.0;
}

/* sums [chunks, 2, C] of (u, v) per chunk of rows, added in chunk order into out [2, C].
** The row sums are of u = x - K, v = u^2 (stats), or u = dyr, v = dyr (x - mean) (backward). */
static tsp_status bn_sums(const tsp_bn_problem *p, const void *x, const void *dy, const void *res,
                          const double *k, double *out) {
  const int64_t n = p->n, c = p->c, chunks = (n + BN_CHUNK - 1) / BN_CHUNK;
  double *part = (double *)calloc((size_t)(chunks > 0 ? chunks : 1) * 2 * (size_t)c, sizeof(double));
  if (part == NULL) return TSP_ERR_ALLOC;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < chunks; ++b) {
    double *u = part + b * 2 * c, *v = u + c;
    const int64_t end = (b + 1) * BN_CHUNK < n ? (b + 1) * BN_CHUNK : n;
    for (int64_t r = b * BN_CHUNK; r < end; ++r) {
      for (int64_t j = 0; j < c; ++j) {
        const double xv = bn_load(x, p->dtype, r * c + j);
        if (dy == NULL) {
          const double d = xv - bn_load(x, p->dtype, j);  /* K = x[0, j] */
          u[j] += d;
          v[j] += d * d;
        } else {
          double g = bn_load(dy, p->dtype, r * c + j);
          if (p->relu && !bn_open(p, xv, res, r * c + j, k, c, j)) g = 0.0;
          u[j] += g;
          v[j] += g * (xv - k[j]);
        }
      }
    }
  }
  for (int64_t j = 0; j < 2 * c; ++j) out[j] = 0.0;
  for (int64_t b = 0; b < chunks; ++b)
    for (int64_t j = 0; j < 2 * c; ++j) out[j] += part[b * 2 * c + j];
  free(part);
  return TSP_OK;
}

tsp_status tsp_bn_stats_cpu(const tsp_bn_problem *p, const void *x, const tsp_bn_stats *s) {
  if (!bn_valid(p) || p->n < 1 || (s->running_mean == NULL) != (s->running_var == NULL) ||
      (s->running_mean != NULL && p->n < 2))
    return TSP_ERR_ARGUMENT;
  const int64_t n = p->n, c = p->c;
  double *sum = (double *)malloc(sizeof(double) * 2 * (size_t)c);
  if (sum == NULL) return TSP_ERR_ALLOC;
  const tsp_status st = bn_sums(p, x, NULL, NULL, NULL, sum);
  if (st != TSP_OK) {
    free(sum);
    return st;
  }
  for (int64_t j = 0; j < c; ++j) {
    const double m1 = sum[j] / (double)n;
    double var = sum[c + j] / (double)n - m1 * m1;
    if (var < 0.0) var = 0.0;
    const double mean = bn_load(x, p->dtype, j) + m1;
    bn_store(s->mean, p->dtype, j, mean);
    bn_store(s->invstd, p->dtype, j, 1.0 / sqrt(var + s->eps));
    if (s->running_mean != NULL) {
      const double rm = bn_load(s->running_mean, p->param_dtype, j);
      const double rv = bn_load(s->running_var, p->param_dtype, j);
      bn_store(s->running_mean, p->param_dtype, j, (1.0 - s->momentum) * rm + s->momentum * mean);
      bn_store(s->running_var, p->param_dtype, j,
               (1.0 - s->momentum) * rv + s->momentum * var * (double)n / (double)(n - 1));
    }
  }
  if (s->batches != NULL) *s->batches += 1;
  free(sum);
  return TSP_OK;
}

tsp_status tsp_bn_forward_cpu(const tsp_bn_problem *p, const void *x, const void *residual,
                              const tsp_bn_affine *a, void *y) {
  if (!bn_valid(p)) return TSP_ERR_ARGUMENT;
  const int64_t n = p->n, c = p->c;
  double *k = bn_coefficients(p, a);
  if (k == NULL) return TSP_ERR_ALLOC;
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < n; ++r) {
    for (int64_t j = 0; j < c; ++j) {
      double v = bn_pre(p, bn_load(x, p->dtype, r * c + j), residual, r * c + j, k, c, j);
      if (p->relu && v <= 0.0) v = 0.0; /* NaN stays NaN, as torch.relu */
      bn_store(y, p->dtype, r * c + j, v);
    }
  }
  free(k);
  return TSP_OK;
}

tsp_status tsp_bn_backward_cpu(const tsp_bn_problem *p, const void *dy, const void *x,
                               const void *residual, const tsp_bn_affine *a, const tsp_bn_grads *g) {
  if (!bn_valid(p) || a->spread_is_var || (g->dresidual != NULL && (residual == NULL || !p->relu)))
    return TSP_ERR_ARGUMENT;
  const int64_t n = p->n, c = p->c;
  double *k = bn_coefficients(p, a);
  double *sum = (double *)malloc(sizeof(double) * 2 * (size_t)c);
  tsp_status st = k != NULL && sum != NULL ? TSP_OK : TSP_ERR_ALLOC;
  if (st == TSP_OK) st = bn_sums(p, x, dy, residual, k, sum);
  if (st == TSP_OK) {
    for (int64_t j = 0; j < c; ++j) {
      if (g->dbias != NULL) bn_store(g->dbias, p->param_dtype, j, sum[j]);
      if (g->dweight != NULL) bn_store(g->dweight, p->param_dtype, j, sum[c + j] * k[3 * c + j]);
    }
  }
  if (st == TSP_OK && (g->dx != NULL || g->dresidual != NULL) && n > 0) {
    /* dx = k (dyr - mean(dyr) - xhat mean(dyr xhat)), k = w invstd; dresidual = dyr */
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t j = 0; j < c; ++j) {
        const double xv = bn_load(x, p->dtype, r * c + j), invstd = k[3 * c + j];
        double d = bn_load(dy, p->dtype, r * c + j);
        if (p->relu && !bn_open(p, xv, residual, r * c + j, k, c, j)) d = 0.0;
        if (g->dresidual != NULL) bn_store(g->dresidual, p->dtype, r * c + j, d);
        if (g->dx == NULL) continue;
        const double xhat = (xv - k[j]) * invstd;
        const double v = k[c + j] * (d - sum[j] / (double)n - xhat * invstd * sum[c + j] / (double)n);
        bn_store(g->dx, p->dtype, r * c + j, v);
      }
    }
  }
  free(k);
  free(sum);
  return st;
}
