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

/* The value an int8 activation code stands for, as the step's `dequantize` computes it. */
static inline float dequantized(int8_t q, float scale, int32_t zero) { return (float)((int32_t)q - zero) * scale; }

/* A convolution's sum plus its bias, clipped to [lo, hi] (a ReLU: [0, FLT_MAX]) and quantized as the
   step's `quantize`: divided by the scale, rounded half to even (`nearbyintf`, as TVM's kernels and ONNX
   round), the zero point added, saturated. */
static inline int8_t requantized(float sum, float lo, float hi, float scale, int32_t zero) {
  float v = sum > hi ? hi : sum;
  v = v < lo ? lo : v;
  v = __builtin_nearbyintf(v / scale) + (float)zero;
  return (int8_t)(v > 127.0f ? 127.0f : v < -128.0f ? -128.0f : v);
}

/* A depthwise convolution whose output is an int8 activation (`precision: int8`): the codes
   `quantize(clip(conv(x, q * scale) + bias, lo, hi))`, out_scale and out_zero its quantization; `x` int8
   codes (`codes`: each channel's plane dequantized into `scratch` first, x_scale and x_zero) or fp32.
   Each sum is `planner_dwconv_s8`'s on the dequantized input, so the codes are those the step computes
   with its fp32 output in between, without that output: `scratch` holds one plane in and one out. */
static int32_t dwconv_q(const void* x, int32_t codes, float x_scale, int32_t x_zero, const int8_t* q, const float* scale,
                        const float* bias, float lo, float hi, float out_scale, int32_t out_zero, int8_t* y, float* scratch,
                        int32_t n, int32_t c, int32_t h, int32_t wd, int32_t kh, int32_t kw, int32_t oh, int32_t ow,
                        int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  float f[MAX_TAPS];
  const int32_t taps = kh * kw, in = h * wd, out = oh * ow;
  if (taps > MAX_TAPS) return -1;
  float* plane_out = codes ? scratch + in : scratch;
  for (int32_t p = 0; p < n * c; ++p) {
    for (int32_t t = 0; t < taps; ++t) f[t] = (float)q[(p % c) * taps + t] * scale[p % c];
    const float* plane_in = (const float*)x + p * in;
    if (codes) {
      const int8_t* codes_in = (const int8_t*)x + p * in;
      for (int32_t i = 0; i < in; ++i) scratch[i] = dequantized(codes_in[i], x_scale, x_zero);
      plane_in = scratch;
    }
    plane(plane_in, f, plane_out, h, wd, kh, kw, oh, ow, sh, sw, pt, pl);
    for (int32_t i = 0; i < out; ++i) y[p * out + i] = requantized(plane_out[i] + bias[p % c], lo, hi, out_scale, out_zero);
  }
  return 0;
}

int32_t planner_sgemm_s8(int32_t order, int32_t trans_a, int32_t trans_b, int32_t m, int32_t n, int32_t k, float alpha,
                         int8_t* a, int32_t lda, float* scale, float* panel, float* b, int32_t ldb, float beta, float* c,
                         int32_t ldc); /* runtime/sgemm.c */

/* A dense convolution (groups 1) whose output is an int8 activation, as `planner_dwconv_q` for a depthwise
   one: `chunk` output pixels at a time, their columns (im2col, each value dequantized as it is copied;
   padding 0) multiplied by the int8 weight in `planner_sgemm_s8`, the sums requantized into y. The sums
   are those over (channel, row, column) in order that the step's own im2col kernels make; `scratch`
   holds 4 * K + (K + o) * chunk floats, K = c * kh * kw — not the o x oh x ow fp32 output. */
static int32_t conv_q(const void* x, int32_t codes, float x_scale, int32_t x_zero, int8_t* q, float* scale,
                      const float* bias, float lo, float hi, float out_scale, int32_t out_zero, int8_t* y, float* scratch,
                      int32_t chunk, int32_t n, int32_t c, int32_t h, int32_t wd, int32_t o, int32_t kh, int32_t kw,
                      int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  const int32_t k = c * kh * kw, pixels = oh * ow;
  float* panel = scratch;
  float* cols = panel + 4 * k;
  float* sums = cols + k * chunk;
  for (int32_t image = 0; image < n; ++image) {
    const int8_t* xq = (const int8_t*)x + image * c * h * wd;
    const float* xf = (const float*)x + image * c * h * wd;
    int8_t* out = y + image * o * pixels;
    for (int32_t p0 = 0; p0 < pixels; p0 += chunk) {
      const int32_t m = pixels - p0 < chunk ? pixels - p0 : chunk;
      float* col = cols;
      if (k == c && sh == 1 && sw == 1 && pt == 0 && pl == 0 && oh == h && ow == wd) { /* 1x1: rows as they lie */
        for (int32_t ci = 0; ci < c; ++ci, col += m) {
          const int32_t at = ci * pixels + p0;
          for (int32_t j = 0; j < m; ++j) col[j] = codes ? dequantized(xq[at + j], x_scale, x_zero) : xf[at + j];
        }
      } else {
        for (int32_t ci = 0; ci < c; ++ci)
          for (int32_t ky = 0; ky < kh; ++ky)
            for (int32_t kx = 0; kx < kw; ++kx) {
              int32_t oy = p0 / ow, ox = p0 % ow;
              for (int32_t j = 0; j < m; ++j, ++col) {
                const int32_t iy = oy * sh - pt + ky, ix = ox * sw - pl + kx;
                const int32_t at = (ci * h + iy) * wd + ix;
                *col = iy < 0 || iy >= h || ix < 0 || ix >= wd ? 0.0f
                       : codes                                  ? dequantized(xq[at], x_scale, x_zero)
                                                                : xf[at];
                if (++ox == ow) ox = 0, ++oy;
              }
            }
      }
      if (planner_sgemm_s8(101, 111, 111, o, m, k, 1.0f, q, k, scale, panel, cols, m, 0.0f, sums, m)) return -1;
      for (int32_t oc = 0; oc < o; ++oc)
        for (int32_t j = 0; j < m; ++j)
          out[oc * pixels + p0 + j] = requantized(sums[oc * m + j] + bias[oc], lo, hi, out_scale, out_zero);
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
  return dwconv_q(x, 1, x_scale, x_zero, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, n, c, h, wd, kh, kw,
                  oh, ow, sh, sw, pt, pl);
}
int32_t planner_dwconv_qf(float* x, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS, int32_t n, SIZES, int32_t kh,
                          int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  return dwconv_q(x, 0, 1.0f, 0, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, n, c, h, wd, kh, kw, oh, ow,
                  sh, sw, pt, pl);
}
int32_t planner_conv_q(int8_t* x, float x_scale, int32_t x_zero, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS,
                       int32_t chunk, int32_t n, SIZES, int32_t o, int32_t kh, int32_t kw, int32_t oh, int32_t ow,
                       int32_t sh, int32_t sw, int32_t pt, int32_t pl) {
  return conv_q(x, 1, x_scale, x_zero, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, chunk, n, c, h, wd, o,
                kh, kw, oh, ow, sh, sw, pt, pl);
}
int32_t planner_conv_qf(float* x, int8_t* q, float* scale, float* bias, QUANTIZED_ARGS, int32_t chunk, int32_t n, SIZES,
                        int32_t o, int32_t kh, int32_t kw, int32_t oh, int32_t ow, int32_t sh, int32_t sw, int32_t pt,
                        int32_t pl) {
  return conv_q(x, 0, 1.0f, 0, q, scale, bias, lo, hi, out_scale, out_zero, y, scratch, chunk, n, c, h, wd, o, kh, kw,
                oh, ow, sh, sw, pt, pl);
}
