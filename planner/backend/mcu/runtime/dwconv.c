/* planner's portable depthwise convolution for microcontrollers: y = conv(x, w), NCHW, one filter per
   channel (groups = channels), undilated, any kernel size, stride and zero padding; the convolution
   planner's kernels call (`planner_dwconv`), and the same with an int8 filter read where it lies, each
   channel's filter times its scale (`planner_dwconv_s8`, frozen weights stored int8). Under `precision:
   int8`, the depthwise and dense convolutions whose output is an int8 activation write its codes
   (`planner_dwconv_q`, `planner_conv_q`, at the end): a layer's fp32 output never lies in SRAM whole.

   Why: TVM's depthwise convolution emitted as C took 25 instructions per multiply-accumulate on a
   Cortex-M4 (MobileNetV2-w0.35 at 128x128: 76 M instructions a step, as many as all its dense
   convolutions). Here each channel's filter is read once into registers, and each output pixel whose
   taps all fall inside the image (nearly all) sums them unrolled, its input rows a stride apart: a load
   and a multiply-add per tap. The pixels near the border take the same sums over the taps that read the
   image alone. Each sum runs over the taps in order, row by row, as TVM's own convolution sums them. */
#include <stdint.h>

/* Where the FPU fuses a multiply-add (VFMA: Cortex-M4F, M7, M55) each tap is one instruction, rounded
   once, as planner's sgemm computes; elsewhere a product and a sum. */
#if defined(__ARM_FEATURE_FMA)
#define MAC(sum, a, b) ((sum) = __builtin_fmaf((a), (b), (sum)))
#else
#define MAC(sum, a, b) ((sum) += (a) * (b))
#endif

enum { MAX_TAPS = 49 }; /* a 7x7 filter: planner lowers larger ones with TVM */

/* One output pixel whose taps may read the padding, its input window's corner at (iy, ix): only the
   taps inside the image add, their range found once, not tested tap by tap. */
static inline float border(const float* x, const float* f, int32_t h, int32_t w, int32_t kh, int32_t kw, int32_t iy,
                           int32_t ix) {
  const int32_t i0 = iy < 0 ? -iy : 0, i1 = iy + kh > h ? h - iy : kh;
  const int32_t j0 = ix < 0 ? -ix : 0, j1 = ix + kw > w ? w - ix : kw;
  float sum = 0;
  for (int32_t i = i0; i < i1; ++i) {
    const float* row = x + (iy + i) * w + ix;
    for (int32_t j = j0; j < j1; ++j) MAC(sum, f[i * kw + j], row[j]);
  }
  return sum;
}

/* One channel: the filter `f` (kh x kw) over the plane `x` (h x w) into the plane `y` (oh x ow). */
static void plane(const float* x, const float* f, float* y, int32_t h, int32_t w, int32_t kh, int32_t kw, int32_t oh,
                  int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  /* the output columns whose taps are all inside the image: ox*sw - pl >= 0 and ox*sw - pl + kw <= w */
  int32_t x0 = (pl + sw - 1) / sw, x1 = w - kw + pl >= 0 ? (w - kw + pl) / sw + 1 : 0;
  if (x1 > ow) x1 = ow;
  if (x0 > x1) x0 = x1;
  for (int32_t oy = 0; oy < oh; ++oy) {
    const int32_t iy = oy * sh - pt;
    float* out = y + oy * ow;
    if (iy < 0 || iy + kh > h || (kh != 3 || kw != 3)) {
      for (int32_t ox = 0; ox < ow; ++ox) out[ox] = border(x, f, h, w, kh, kw, iy, ox * sw - pl);
      continue;
    }
    for (int32_t ox = 0; ox < x0; ++ox) out[ox] = border(x, f, h, w, kh, kw, iy, ox * sw - pl);
    const float f0 = f[0], f1 = f[1], f2 = f[2], f3 = f[3], f4 = f[4], f5 = f[5], f6 = f[6], f7 = f[7], f8 = f[8];
    const float* r0 = x + iy * w + x0 * sw - pl;
    const float* r1 = r0 + w;
    const float* r2 = r1 + w;
    for (int32_t ox = x0; ox < x1; ++ox) {
      float sum = 0;
      MAC(sum, f0, r0[0]), MAC(sum, f1, r0[1]), MAC(sum, f2, r0[2]);
      MAC(sum, f3, r1[0]), MAC(sum, f4, r1[1]), MAC(sum, f5, r1[2]);
      MAC(sum, f6, r2[0]), MAC(sum, f7, r2[1]), MAC(sum, f8, r2[2]);
      out[ox] = sum;
      r0 += sw, r1 += sw, r2 += sw;
    }
    for (int32_t ox = x1; ox < ow; ++ox) out[ox] = border(x, f, h, w, kh, kw, iy, ox * sw - pl);
  }
}

/* x (n, c, h, w) by w (c, 1, kh, kw) into y (n, c, oh, ow), strides (sh, sw), leading padding (pt, pl). */
int32_t planner_dwconv(float* x, float* w, float* y, int32_t n, int32_t c, int32_t h, int32_t wd, int32_t kh, int32_t kw,
                       int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  if (kh * kw > MAX_TAPS) return -1;
  for (int32_t p = 0; p < n * c; ++p)
    plane(x + p * h * wd, w + (p % c) * kh * kw, y + p * oh * ow, h, wd, kh, kw, oh, ow, sh, sw, pt, pl);
  return 0;
}

/* The same with an int8 filter and one fp32 scale per channel: each channel's filter dequantized once
   into registers, exactly the values the step's copy of it held (`q * scale` in fp32), without the copy. */
int32_t planner_dwconv_s8(float* x, int8_t* q, float* scale, float* y, int32_t n, int32_t c, int32_t h, int32_t wd,
                          int32_t kh, int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  float f[MAX_TAPS];
  const int32_t taps = kh * kw;
  if (taps > MAX_TAPS) return -1;
  for (int32_t p = 0; p < n * c; ++p) {
    for (int32_t t = 0; t < taps; ++t) f[t] = (float)q[(p % c) * taps + t] * scale[p % c];
    plane(x + p * h * wd, f, y + p * oh * ow, h, wd, kh, kw, oh, ow, sh, sw, pt, pl);
  }
  return 0;
}


/* Integer products (int8 codes in, int8 codes out: `planner_conv_q`). Each output sums
   (x - x_zero) * q over its window in int32 — exactly, in any order — then takes the same float
   steps as above: times x_scale * scale (one float32 product per channel), plus the bias, clipped,
   requantized. Where the core has the DSP extension (Cortex-M4, M7, M33, M55), SMLAD sums two 16-bit
   products in one instruction and SXTB16 sign-extends two of a word's four int8 weights: 4 weights
   of a row read as one word and multiplied by 4 of a column in 2 instructions. The columns are int16,
   each group of 4 stored (0, 2, 1, 3), the order SXTB16 hands the weights in. `PLANNER_SIMD32` builds
   the same arithmetic in plain C, so that the host tests the order the board runs. */
#if defined(__ARM_FEATURE_DSP)
#define SIMD32 1
static inline uint32_t even_bytes(uint32_t v) {
  uint32_t r;
  __asm__("sxtb16 %0, %1" : "=r"(r) : "r"(v));
  return r;
}
static inline uint32_t odd_bytes(uint32_t v) {
  uint32_t r;
  __asm__("sxtb16 %0, %1, ror #8" : "=r"(r) : "r"(v));
  return r;
}
static inline int32_t smlad(uint32_t a, uint32_t b, int32_t acc) {
  int32_t r;
  __asm__("smlad %0, %1, %2, %3" : "=r"(r) : "r"(a), "r"(b), "r"(acc));
  return r;
}
#elif defined(PLANNER_SIMD32)
#define SIMD32 1
static inline uint32_t even_bytes(uint32_t v) {
  return (uint32_t)(uint16_t)(int16_t)(int8_t)v | (uint32_t)(uint16_t)(int16_t)(int8_t)(v >> 16) << 16;
}
static inline uint32_t odd_bytes(uint32_t v) { return even_bytes(v >> 8); }
static inline int32_t smlad(uint32_t a, uint32_t b, int32_t acc) {
  return acc + (int16_t)a * (int16_t)b + (int16_t)(a >> 16) * (int16_t)(b >> 16);
}
#else
#define SIMD32 0
#endif

#if SIMD32
static inline uint32_t word(const void* p) { /* an unaligned load: one LDR on v7E-M */
  uint32_t v;
  __builtin_memcpy(&v, p, 4);
  return v;
}
#endif

/* The clip and int8's range as bounds on the output code minus its zero point, and that zero point:
   the integer kernels' requantization of each sum. */
typedef struct {
  float lo, hi;
  int32_t zero;
} Codes;

/* v rounded half to even, |v| < 2^22: the FPU's own rounding of a sum with 1.5 * 2^23 */
static inline float rounded(float v) { return (v + 12582912.0f) - 12582912.0f; }

static inline float bound(float v, float lo, float hi) { return v <= lo ? lo : v >= hi ? hi : rounded(v); }

static inline Codes codes_of(float lo, float hi, float out_scale, int32_t out_zero) {
  const float lo_code = (float)(-128 - out_zero), hi_code = (float)(127 - out_zero);
  return (Codes){bound(lo / out_scale, lo_code, hi_code), bound(hi / out_scale, lo_code, hi_code), out_zero};
}

#if !defined(PLANNER_MINF)
#if defined(PLANNER_MINMAXNM) /* FPv5 (Cortex-M7, M55): VMINNM and VMAXNM */
#define PLANNER_MINF(x, c) __builtin_fminf((x), (c))
#define PLANNER_MAXF(x, c) __builtin_fmaxf((x), (c))
#else
#define PLANNER_MINF(x, c) ((x) < (c) ? (x) : (c))
#define PLANNER_MAXF(x, c) ((x) > (c) ? (x) : (c))
#endif
#endif

/* A channel's integer sum as its output code: `acc * m + b` is the output over its scale (m = x_scale
   * scale / out_scale, b = bias / out_scale, float32), clamped to `c`'s bounds (the clip and int8's
   range: clamping before rounding to integer bounds is rounding then saturating), rounded half to even
   by adding 1.5 * 2^23 (the float's low bits are then the integer: no conversion, no library call on
   an FPU without VRINT), the zero point added. */
static inline int8_t code_of(float v, float lo, float hi, int32_t zero) {
  v = PLANNER_MINF(PLANNER_MAXF(v, lo), hi) + 12582912.0f;
  int32_t bits;
  __builtin_memcpy(&bits, &v, 4);
  return (int8_t)(bits - 0x4B400000 + zero);
}

/* (gcc copies a struct argument to the stack at each inlined call: the bounds go as scalars) */
#define coded(acc, m, b, c) code_of((float)(acc) * (m) + (b), (c).lo, (c).hi, (c).zero)

/* A float sum plus its bias as the step's `quantize` computes it after the clip: divided by the
   scale, rounded half to even, the zero point added, saturated (the clip and the saturation as
   bounds on the code, the same codes). */
static inline int8_t requantized(float sum, float out_scale, Codes c) { return code_of(sum / out_scale, c.lo, c.hi, c.zero); }

/* A depthwise convolution whose output is an int8 activation (`precision: int8`): the codes
   `quantize(clip(conv(x, q * scale) + bias, lo, hi))`, out_scale and out_zero its quantization. Of a
   float input (`dwconv_qf`, a decoded image) each sum is `planner_dwconv_s8`'s, `scratch` one output
   plane. Of int8 codes (`dwconv_q`, below) its sums are int32, exact — never a layer's fp32 output. */
static int32_t dwconv_qf(const float* x, const int8_t* q, const float* scale, const float* bias, float lo, float hi,
                         float out_scale, int32_t out_zero, int8_t* y, float* scratch, int32_t n, int32_t c, int32_t h,
                         int32_t wd, int32_t kh, int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt,
                         int32_t pl) {
  const Codes codes = codes_of(lo, hi, out_scale, out_zero);
  float f[MAX_TAPS];
  const int32_t taps = kh * kw, out = oh * ow;
  if (taps > MAX_TAPS) return -1;
  for (int32_t p = 0; p < n * c; ++p) {
    for (int32_t t = 0; t < taps; ++t) f[t] = (float)q[(p % c) * taps + t] * scale[p % c];
    plane(x + p * h * wd, f, scratch, h, wd, kh, kw, oh, ow, sh, sw, pt, pl);
    for (int32_t i = 0; i < out; ++i) y[p * out + i] = requantized(scratch[i] + bias[p % c], out_scale, codes);
  }
  return 0;
}

/* Of int8 codes: each channel's plane as (x - x_zero) in int16 with its padding (0, the code of 0)
   around it, so that every output pixel sums all its taps, no border case; `scratch` holds the
   padded plane and nothing else. A 3x3 filter's rows pair their first two taps in one SMLAD. */
static int32_t dwconv_q(const int8_t* x, float x_scale, int32_t x_zero, const int8_t* q, const float* scale,
                        const float* bias, float lo, float hi, float out_scale, int32_t out_zero, int8_t* y, float* scratch,
                        int32_t n, int32_t c, int32_t h, int32_t wd, int32_t kh, int32_t kw, int32_t oh, int32_t ow,
                        int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  int32_t f[MAX_TAPS];
  const int32_t taps = kh * kw, in = h * wd, out = oh * ow;
  const int32_t hp = (oh - 1) * sh + kh, wp = (ow - 1) * sw + kw; /* the rows and columns the taps read */
  int16_t* padded = (int16_t*)scratch;
  const Codes codes = codes_of(lo, hi, out_scale, out_zero);
  if (taps > MAX_TAPS) return -1;
  for (int32_t p = 0; p < n * c; ++p) {
    for (int32_t t = 0; t < taps; ++t) f[t] = q[(p % c) * taps + t];
    const int8_t* plane_in = x + p * in;
    for (int32_t r = 0; r < hp; ++r) {
      const int32_t iy = r - pt;
      int16_t* row = padded + r * wp;
      if (iy < 0 || iy >= h) {
        for (int32_t j = 0; j < wp; ++j) row[j] = 0;
        continue;
      }
      for (int32_t j = 0; j < wp; ++j) {
        const int32_t ix = j - pl;
        row[j] = ix < 0 || ix >= wd ? 0 : (int16_t)(plane_in[iy * wd + ix] - x_zero);
      }
    }
    const float m = x_scale * scale[p % c] / out_scale, b = bias[p % c] / out_scale;
    int8_t* plane_out = y + p * out;
    for (int32_t oy = 0; oy < oh; ++oy) {
      const int16_t* r0 = padded + oy * sh * wp;
      if (kh == 3 && kw == 3) {
        const int16_t* r1 = r0 + wp;
        const int16_t* r2 = r1 + wp;
        const int32_t f2 = f[2], f5 = f[5], f8 = f[8];
#if SIMD32
        const uint32_t f01 = (uint16_t)f[0] | (uint32_t)f[1] << 16, f34 = (uint16_t)f[3] | (uint32_t)f[4] << 16;
        const uint32_t f67 = (uint16_t)f[6] | (uint32_t)f[7] << 16;
#else
        const int32_t f0 = f[0], f1 = f[1], f3 = f[3], f4 = f[4], f6 = f[6], f7 = f[7];
#endif
        for (int32_t ox = 0; ox < ow; ++ox, r0 += sw, r1 += sw, r2 += sw) {
#if SIMD32
          int32_t sum = smlad(word(r0), f01, r0[2] * f2);
          sum = smlad(word(r1), f34, sum + r1[2] * f5);
          sum = smlad(word(r2), f67, sum + r2[2] * f8);
#else
          const int32_t sum = r0[0] * f0 + r0[1] * f1 + r0[2] * f2 + r1[0] * f3 + r1[1] * f4 + r1[2] * f5 + r2[0] * f6 +
                              r2[1] * f7 + r2[2] * f8;
#endif
          plane_out[oy * ow + ox] = coded(sum, m, b, codes);
        }
        continue;
      }
      for (int32_t ox = 0; ox < ow; ++ox) {
        int32_t sum = 0;
        for (int32_t i = 0; i < kh; ++i)
          for (int32_t j = 0; j < kw; ++j) sum += f[i * kw + j] * r0[i * wp + ox * sw + j];
        plane_out[oy * ow + ox] = coded(sum, m, b, codes);
      }
    }
  }
  return 0;
}

int32_t planner_sgemm_s8(int32_t order, int32_t trans_a, int32_t trans_b, int32_t m, int32_t n, int32_t k, float alpha,
                         int8_t* a, int32_t lda, float* scale, float* panel, float* b, int32_t ldb, float beta, float* c,
                         int32_t ldc); /* runtime/sgemm.c */

/* A dense convolution (groups 1) of a float input (a decoded image) whose output is an int8 activation:
   `chunk` output pixels at a time, their columns (im2col, padding 0) multiplied by the int8 weight in
   `planner_sgemm_s8`, the sums requantized into y: the sums over (channel, row, column) in order that the
   step's own im2col kernels make; `scratch` holds 4 * K + (K + o) * chunk floats, K = c * kh * kw — not
   the o x oh x ow fp32 output. */
static int32_t conv_qf(const void* x, const float* dscale, const float* doffset, int8_t* q, float* scale, const float* bias, float lo,
                       float hi, float out_scale, int32_t out_zero, int8_t* y, float* scratch, int32_t chunk, int32_t n,
                       int32_t c, int32_t h, int32_t wd, int32_t o, int32_t kh, int32_t kw, int32_t oh, int32_t ow,
                       int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  const Codes codes = codes_of(lo, hi, out_scale, out_zero);
  const int32_t k = c * kh * kw, pixels = oh * ow;
  float* panel = scratch;
  float* cols = panel + 4 * k;
  float* sums = cols + k * chunk;
  for (int32_t image = 0; image < n; ++image) {
    const float* xf = (const float*)x + image * c * h * wd;
    const uint8_t* xp = (const uint8_t*)x + image * c * h * wd;
    int8_t* out = y + image * o * pixels;
    for (int32_t p0 = 0; p0 < pixels; p0 += chunk) {
      const int32_t m = pixels - p0 < chunk ? pixels - p0 : chunk;
      float* col = cols;
      for (int32_t ci = 0; ci < c; ++ci)
        for (int32_t ky = 0; ky < kh; ++ky)
          for (int32_t kx = 0; kx < kw; ++kx) {
            int32_t oy = p0 / ow, ox = p0 % ow;
            for (int32_t j = 0; j < m; ++j, ++col) {
              const int32_t iy = oy * sh - pt + ky, ix = ox * sw - pl + kx;
              const int32_t at = (ci * h + iy) * wd + ix;
              *col = iy < 0 || iy >= h || ix < 0 || ix >= wd ? 0.0f
                     : dscale                                 ? (float)xp[at] * dscale[ci] + doffset[ci]
                                                              : xf[at];
              if (++ox == ow) ox = 0, ++oy;
            }
          }
      if (planner_sgemm_s8(101, 111, 111, o, m, k, 1.0f, q, k, scale, panel, cols, m, 0.0f, sums, m)) return -1;
      for (int32_t oc = 0; oc < o; ++oc)
        for (int32_t j = 0; j < m; ++j)
          out[oc * pixels + p0 + j] = requantized(sums[oc * m + j] + bias[oc], out_scale, codes);
    }
  }
  return 0;
}

/* Where the k-th value of a column lies: groups of 4 stored (0, 2, 1, 3) up to `k4`, the rest in order. */
static inline int32_t slot(int32_t p, int32_t k4) { return p < k4 ? (p & ~3) | (p & 1) << 1 | (p & 2) >> 1 : p; }

/* The sums of rows wa, wb of the weight (k int8 each) with columns u, v (k int16 each, `slot` order). */
static inline void dot2x2(const int8_t* wa, const int8_t* wb, const int16_t* u, const int16_t* v, int32_t k, int32_t* s) {
  int32_t au = 0, av = 0, bu = 0, bv = 0, p = 0;
#if defined(__ARM_FEATURE_DSP)
  /* 4 weights of each row by 4 values of each column: 19 instructions for 16 products. Written out
     because gcc, given this loop in C, keeps half its 13 live values on the stack. */
  const int8_t* end = wa + (k & ~3);
  while (wa < end) {
    uint32_t t0, t1, t2, t3;
    __asm__(
        "ldr %[t0], [%[wa]], #4\n\t"
        "ldr %[t1], [%[u]], #4\n\t"
        "ldr %[t2], [%[v]], #4\n\t"
        "sxtb16 %[t3], %[t0]\n\t"
        "smlad %[au], %[t3], %[t1], %[au]\n\t"
        "smlad %[av], %[t3], %[t2], %[av]\n\t"
        "ldr %[t3], [%[wb]]\n\t"
        "sxtb16 %[t3], %[t3]\n\t"
        "smlad %[bu], %[t3], %[t1], %[bu]\n\t"
        "smlad %[bv], %[t3], %[t2], %[bv]\n\t"
        "ldr %[t3], [%[wb]], #4\n\t"
        "ldr %[t1], [%[u]], #4\n\t"
        "ldr %[t2], [%[v]], #4\n\t"
        "sxtb16 %[t0], %[t0], ror #8\n\t"
        "sxtb16 %[t3], %[t3], ror #8\n\t"
        "smlad %[au], %[t0], %[t1], %[au]\n\t"
        "smlad %[av], %[t0], %[t2], %[av]\n\t"
        "smlad %[bu], %[t3], %[t1], %[bu]\n\t"
        "smlad %[bv], %[t3], %[t2], %[bv]"
        : [au] "+r"(au), [av] "+r"(av), [bu] "+r"(bu), [bv] "+r"(bv), [wa] "+r"(wa), [wb] "+r"(wb), [u] "+r"(u),
          [v] "+r"(v), [t0] "=&r"(t0), [t1] "=&r"(t1), [t2] "=&r"(t2), [t3] "=&r"(t3)
        :
        : "memory");
  }
  k &= 3;
#elif SIMD32
  for (; p + 4 <= k; p += 4) {
    const uint32_t a = word(wa + p), b = word(wb + p), u02 = word(u + p), v02 = word(v + p);
    const uint32_t u13 = word(u + p + 2), v13 = word(v + p + 2);
    au = smlad(even_bytes(a), u02, au), au = smlad(odd_bytes(a), u13, au);
    av = smlad(even_bytes(a), v02, av), av = smlad(odd_bytes(a), v13, av);
    bu = smlad(even_bytes(b), u02, bu), bu = smlad(odd_bytes(b), u13, bu);
    bv = smlad(even_bytes(b), v02, bv), bv = smlad(odd_bytes(b), v13, bv);
  }
#endif
  for (; p < k; ++p) au += wa[p] * u[p], av += wa[p] * v[p], bu += wb[p] * u[p], bv += wb[p] * v[p];
  s[0] = au, s[1] = av, s[2] = bu, s[3] = bv;
}

static inline int32_t dot(const int8_t* w, const int16_t* u, int32_t k) {
  int32_t s = 0, p = 0;
#if SIMD32
  for (; p + 4 <= k; p += 4) {
    const uint32_t a = word(w + p);
    s = smlad(even_bytes(a), word(u + p), s), s = smlad(odd_bytes(a), word(u + p + 2), s);
  }
#endif
  for (; p < k; ++p) s += w[p] * u[p];
  return s;
}

/* Two rows of the weight (wa and the next) by the `m` columns: their codes into ya and yb. Not inlined,
   so that the products' loop has the core's registers to itself. */
static __attribute__((noinline)) void rows2(const int8_t* wa, int32_t k, const int16_t* cols, int32_t m, float ma,
                                            float ba, float mb, float bb, const Codes* bounds, int8_t* ya,
                                            int8_t* yb) {
  const Codes codes = *bounds; /* its fields in registers, not copied at each call of `coded` */
  int32_t j = 0;
  for (int32_t s[4]; j + 1 < m; j += 2) {
    dot2x2(wa, wa + k, cols + j * k, cols + (j + 1) * k, k, s);
    ya[j] = coded(s[0], ma, ba, codes), ya[j + 1] = coded(s[1], ma, ba, codes);
    yb[j] = coded(s[2], mb, bb, codes), yb[j + 1] = coded(s[3], mb, bb, codes);
  }
  if (j < m) ya[j] = coded(dot(wa, cols + j * k, k), ma, ba, codes), yb[j] = coded(dot(wa + k, cols + j * k, k), mb, bb, codes);
}

/* `chunk` output pixels at a time: their columns, (x - x_zero) as int16 (padding 0), pixel by pixel in
   `scratch` (chunk * K int16); each output channel's row of the weight read where it lies (flash). */
static int32_t conv_q(const int8_t* x, float x_scale, int32_t x_zero, const int8_t* q, const float* scale,
                      const float* bias, float lo, float hi, float out_scale, int32_t out_zero, int8_t* y, int16_t* cols,
                      int32_t chunk, int32_t n, int32_t c, int32_t h, int32_t wd, int32_t o, int32_t kh, int32_t kw,
                      int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  const int32_t k = c * kh * kw, k4 = SIMD32 ? k & ~3 : 0, pixels = oh * ow;
  const int32_t pointwise = k == c && sh == 1 && sw == 1 && pt == 0 && pl == 0 && oh == h && ow == wd;
  const Codes codes = codes_of(lo, hi, out_scale, out_zero);
  for (int32_t image = 0; image < n; ++image) {
    const int8_t* xq = x + image * c * h * wd;
    int8_t* out = y + image * o * pixels;
    for (int32_t p0 = 0; p0 < pixels; p0 += chunk) {
      const int32_t m = pixels - p0 < chunk ? pixels - p0 : chunk;
      for (int32_t p = 0; p < k; ++p) {
        int16_t* col = cols + slot(p, k4);
        if (pointwise) { /* a 1x1 convolution's columns: its input rows as they lie */
          const int8_t* row = xq + p * pixels + p0;
          for (int32_t j = 0; j < m; ++j, col += k) *col = (int16_t)(row[j] - x_zero);
          continue;
        }
        const int32_t ci = p / (kh * kw), ky = p / kw % kh, kx = p % kw;
        int32_t oy = p0 / ow, ox = p0 % ow;
        for (int32_t j = 0; j < m; ++j, col += k) {
          const int32_t iy = oy * sh - pt + ky, ix = ox * sw - pl + kx;
          *col = iy < 0 || iy >= h || ix < 0 || ix >= wd ? 0 : (int16_t)(xq[(ci * h + iy) * wd + ix] - x_zero);
          if (++ox == ow) ox = 0, ++oy;
        }
      }
      for (int32_t oc = 0; oc < o; ++oc) {
        const int8_t* wa = q + oc * k;
        const float ma = x_scale * scale[oc] / out_scale, ba = bias[oc] / out_scale;
        int8_t* ya = out + oc * pixels + p0;
        if (oc + 1 < o) { /* two channels by two pixels: each word of weights or columns read once for two sums */
          const float mb = x_scale * scale[oc + 1] / out_scale, bb = bias[oc + 1] / out_scale;
          rows2(wa, k, cols, m, ma, ba, mb, bb, &codes, ya, ya + pixels);
          ++oc;
          continue;
        }
        for (int32_t j = 0; j < m; ++j) ya[j] = coded(dot(wa, cols + j * k, k), ma, ba, codes);
      }
    }
  }
  return 0;
}

/* The kernels the step calls: the input int8 codes with their scale and zero point (`_q`), or fp32
   (`_qf`: a decoded image). */
#define QUANTIZED_ARGS                                                                                               \
  float lo, float hi, float out_scale, int32_t out_zero, int8_t *y, float *scratch
#define SIZES int32_t c, int32_t h, int32_t wd
int32_t planner_dwconv_q(int8_t* x, float x_scale, int32_t x_zero, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS,
                         int32_t n, SIZES, int32_t kh, int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw,
                         int32_t pt, int32_t pl) {
  return dwconv_q(x, x_scale, x_zero, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, n, c, h, wd, kh, kw,
                  oh, ow, sh, sw, pt, pl);
}
int32_t planner_dwconv_qf(float* x, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS, int32_t n, SIZES, int32_t kh,
                          int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  return dwconv_qf(x, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, n, c, h, wd, kh, kw, oh, ow,
                  sh, sw, pt, pl);
}
int32_t planner_conv_q(int8_t* x, float x_scale, int32_t x_zero, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS,
                       int32_t chunk, int32_t n, SIZES, int32_t o, int32_t kh, int32_t kw, int32_t oh, int32_t ow,
                       int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  return conv_q(x, x_scale, x_zero, q, scale, bias, lo, hi, out_scale, out_zero, y, (int16_t*)scratch, chunk, n, c, h,
                wd, o, kh, kw, oh, ow, sh, sw, pt, pl);
}
int32_t planner_conv_qf(float* x, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS, int32_t chunk, int32_t n, SIZES,
                        int32_t o, int32_t kh, int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt,
                        int32_t pl) {
  return conv_qf(x, 0, 0, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, chunk, n, c, h, wd, o, kh, kw, oh, ow,
                 sh, sw, pt, pl);
}
/* Of 8-bit pixels `x` decoded as the step decodes them, `(float)p * dscale[ci] + doffset[ci]` per
   channel, as each is copied into the columns: the decoded image never in SRAM. */
int32_t planner_conv_qp(uint8_t* x, float* dscale, float* doffset, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS, int32_t chunk,
                        int32_t n, SIZES, int32_t o, int32_t kh, int32_t kw, int32_t oh, int32_t ow, int32_t sh,
                        int32_t sw, int32_t pt, int32_t pl) {
  return conv_qf(x, dscale, doffset, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, chunk, n, c, h, wd, o, kh, kw, oh,
                 ow, sh, sw, pt, pl);
}
