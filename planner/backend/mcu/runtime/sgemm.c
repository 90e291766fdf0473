/* planner's portable sgemm for microcontrollers: cblas_sgemm's row-major product,
     C = alpha * op(A) * op(B) + beta * C,
   under the name planner's convolution and matmul kernels call (`planner_sgemm`), and the same with an
   int8 A read where it lies (`planner_sgemm_s8`, frozen weights stored int8).

   Why: TVM's scalar loops emitted as C take about 13.5 instructions per multiply-accumulate on a
   Cortex-M4; a product held in registers 4x4 at a time — 4 values of A and 4 of B loaded for 16
   multiply-adds — takes under 2. Plain C: gcc keeps the 16 sums in the FPU's registers on any core
   with one. Where the FPU fuses a multiply-add (VFMA: Cortex-M4F, M7, M55) each step is one
   instruction, rounded once, as the VM's kernels on an FMA host are; elsewhere a product and a sum.
   Each sum runs over k in order; the edges (m or n not a multiple of 4) take the same sums one at a time. */
#include <stdint.h>

#if defined(__ARM_FEATURE_FMA)
#define MAC(sum, a, b) ((sum) = __builtin_fmaf((a), (b), (sum)))
#else
#define MAC(sum, a, b) ((sum) += (a) * (b))
#endif

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

/* How a value of A is read: as it is (`planner_sgemm`), or an int8 weight times its row's scale
   (`planner_sgemm_s8`). `s` walks the scales as `a` walks A: `sr` apart between A's rows, `sp`
   between its columns. */
#define LOAD_F32(a, i, s, j) ((a)[i])
#define LOAD_S8(a, i, s, j) ((float)(a)[i] * (s)[j])

static inline void store4x4(float s00, float s01, float s02, float s03, float s10, float s11, float s12, float s13,
                            float s20, float s21, float s22, float s23, float s30, float s31, float s32, float s33,
                            float alpha, float beta, float* c, int32_t ldc);

/* One 4x4 block of C at (i, j): the sums over p of A(i.., p) * B(p, j..), with A's element (r, p) at
   a[r * ar + p * ap] and B's element (p, c) at b[p * bp + c * bc]. */
static inline void block4x4(int32_t k, const float* a, int32_t ar, int32_t ap, const float* b, int32_t bp, int32_t bc,
                            float alpha, float beta, float* c, int32_t ldc) {
  float s00 = 0, s01 = 0, s02 = 0, s03 = 0, s10 = 0, s11 = 0, s12 = 0, s13 = 0;
  float s20 = 0, s21 = 0, s22 = 0, s23 = 0, s30 = 0, s31 = 0, s32 = 0, s33 = 0;
  for (int32_t p = 0; p < k; ++p) {
    const float a0 = a[0], a1 = a[ar], a2 = a[2 * ar], a3 = a[3 * ar];
    const float b0 = b[0], b1 = b[bc], b2 = b[2 * bc], b3 = b[3 * bc];
    MAC(s00, a0, b0), MAC(s01, a0, b1), MAC(s02, a0, b2), MAC(s03, a0, b3);
    MAC(s10, a1, b0), MAC(s11, a1, b1), MAC(s12, a1, b2), MAC(s13, a1, b3);
    MAC(s20, a2, b0), MAC(s21, a2, b1), MAC(s22, a2, b2), MAC(s23, a2, b3);
    MAC(s30, a3, b0), MAC(s31, a3, b1), MAC(s32, a3, b2), MAC(s33, a3, b3);
    a += ap;
    b += bp;
  }
  store4x4(s00, s01, s02, s03, s10, s11, s12, s13, s20, s21, s22, s23, s30, s31, s32, s33, alpha, beta, c, ldc);
}

/* One element of C, for the edges (m or n not a multiple of 4). */
#define ELEMENT(SUFFIX, TYPE, LOAD)                                                                        \
  static void element##SUFFIX(int32_t k, const TYPE* a, int32_t ap, const float* s, int32_t sp, const float* b, \
                              int32_t bp, float alpha, float beta, float* c) {                              \
    float sum = 0;                                                                                         \
    (void)s, (void)sp;                                                                                     \
    for (int32_t p = 0; p < k; ++p) MAC(sum, LOAD(a, p * ap, s, p * sp), b[p * bp]);                       \
    *c = beta == 0.0f ? alpha * sum : alpha * sum + beta * *c;                                             \
  }
ELEMENT(, float, LOAD_F32)
ELEMENT(_s8, int8_t, LOAD_S8)

static inline void store4x4(float s00, float s01, float s02, float s03, float s10, float s11, float s12, float s13,
                            float s20, float s21, float s22, float s23, float s30, float s31, float s32, float s33,
                            float alpha, float beta, float* c, int32_t ldc) {
  float* c0 = c;
  float* c1 = c0 + ldc;
  float* c2 = c1 + ldc;
  float* c3 = c2 + ldc;
  if (beta == 0.0f) { /* C's old values unread (they may be anything, as BLAS allows) */
    c0[0] = alpha * s00, c0[1] = alpha * s01, c0[2] = alpha * s02, c0[3] = alpha * s03;
    c1[0] = alpha * s10, c1[1] = alpha * s11, c1[2] = alpha * s12, c1[3] = alpha * s13;
    c2[0] = alpha * s20, c2[1] = alpha * s21, c2[2] = alpha * s22, c2[3] = alpha * s23;
    c3[0] = alpha * s30, c3[1] = alpha * s31, c3[2] = alpha * s32, c3[3] = alpha * s33;
  } else {
    c0[0] = alpha * s00 + beta * c0[0], c0[1] = alpha * s01 + beta * c0[1];
    c0[2] = alpha * s02 + beta * c0[2], c0[3] = alpha * s03 + beta * c0[3];
    c1[0] = alpha * s10 + beta * c1[0], c1[1] = alpha * s11 + beta * c1[1];
    c1[2] = alpha * s12 + beta * c1[2], c1[3] = alpha * s13 + beta * c1[3];
    c2[0] = alpha * s20 + beta * c2[0], c2[1] = alpha * s21 + beta * c2[1];
    c2[2] = alpha * s22 + beta * c2[2], c2[3] = alpha * s23 + beta * c2[3];
    c3[0] = alpha * s30 + beta * c3[0], c3[1] = alpha * s31 + beta * c3[1];
    c3[2] = alpha * s32 + beta * c3[2], c3[3] = alpha * s33 + beta * c3[3];
  }
}

/* The product specialised for each (transA, transB): a stride of 1 known to the compiler is a load
   at a constant offset, not an address computed. A's scales (SR, SP) follow its stored rows: along
   op(A)'s rows untransposed, along its columns transposed. With int8 A each 4 rows of op(A) are
   first written to `panel` as the fp32 values they stand for, [p][r], once for all of B's columns:
   the 4x4 blocks then multiply fp32 values, as `planner_sgemm` does (a conversion and a scaling per
   value of A at every block cost 0.7 instructions per multiply-accumulate). */
#define PRODUCT(SUFFIX, LOAD, AR, AP, SR, SP, BP, BC)                                                            \
  do {                                                                                                          \
    const int32_t m4 = m - m % 4, n4 = n - n % 4;                                                               \
    for (int32_t i = 0; i < m4; i += 4) {                                                                       \
      const float* rows = (const float*)a + i * (AR);                                                           \
      int32_t ar = (AR), ap = (AP);                                                                             \
      if (panel) {                                                                                              \
        for (int32_t p = 0; p < k; ++p)                                                                         \
          for (int32_t r = 0; r < 4; ++r)                                                                       \
            panel[4 * p + r] = LOAD(a, (i + r) * (AR) + p * (AP), s, (i + r) * (SR) + p * (SP));                \
        rows = panel, ar = 1, ap = 4;                                                                           \
      }                                                                                                         \
      for (int32_t j = 0; j < n4; j += 4)                                                                       \
        block4x4(k, rows, ar, ap, b + j * (BC), (BP), (BC), alpha, beta, c + i * ldc + j, ldc);                 \
    }                                                                                                           \
    for (int32_t i = 0; i < m; ++i)                                                                             \
      for (int32_t j = i < m4 ? n4 : 0; j < n; ++j)                                                             \
        element##SUFFIX(k, a + i * (AR), (AP), s + i * (SR), (SP), b + j * (BC), (BP), alpha, beta, c + i * ldc + j); \
  } while (0)

#define TRANSPOSITIONS(SUFFIX, LOAD)                               \
  do {                                                             \
    if (order != ROW_MAJOR) return -1;                             \
    if (trans_a == NO_TRANS && trans_b == NO_TRANS) {              \
      PRODUCT(SUFFIX, LOAD, lda, 1, 1, 0, ldb, 1);                 \
    } else if (trans_a == NO_TRANS && trans_b == TRANS) {          \
      PRODUCT(SUFFIX, LOAD, lda, 1, 1, 0, 1, ldb);                 \
    } else if (trans_a == TRANS && trans_b == NO_TRANS) {          \
      PRODUCT(SUFFIX, LOAD, 1, lda, 0, 1, ldb, 1);                 \
    } else if (trans_a == TRANS && trans_b == TRANS) {             \
      PRODUCT(SUFFIX, LOAD, 1, lda, 0, 1, 1, ldb);                 \
    } else {                                                       \
      return -1;                                                   \
    }                                                              \
    return 0;                                                      \
  } while (0)

int32_t planner_sgemm(int32_t order, int32_t trans_a, int32_t trans_b, int32_t m, int32_t n, int32_t k, float alpha,
                      float* a, int32_t lda, float* b, int32_t ldb, float beta, float* c, int32_t ldc) {
  const float* s = 0;   /* no scales: LOAD_F32 never reads them */
  float* panel = 0;     /* A's rows read where they are */
  TRANSPOSITIONS(, LOAD_F32);
}

/* A int8 (a frozen weight read where it lies, in flash), each of its stored rows times its fp32
   `scale`: the value the weight stands for, exactly as the step would have dequantized it, so the
   products are those of `planner_sgemm` on the dequantized weight, without its copy in SRAM.
   `panel`: room for 4 * k floats (the caller's scratch). */
int32_t planner_sgemm_s8(int32_t order, int32_t trans_a, int32_t trans_b, int32_t m, int32_t n, int32_t k, float alpha,
                         int8_t* a, int32_t lda, float* scale, float* panel, float* b, int32_t ldb, float beta, float* c,
                         int32_t ldc) {
  const float* s = scale;
  if (!panel) return -1;
  TRANSPOSITIONS(_s8, LOAD_S8);
}
