// oneDNN 2.6 conv forward / backward-data / backward-weights timing for one layer shape (NCHW user
// layout, oneDNN picks its own internal layout via format_tag::any; reorders are timed separately).
#include <oneapi/dnnl/dnnl.hpp>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>
using namespace dnnl;
using tag = memory::format_tag; using dt = memory::data_type;
template <class F> double timeit(F f, int n) { f(); auto t0 = std::chrono::steady_clock::now(); for (int i = 0; i < n; i++) f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / n; }
int main(int argc, char** argv) {
  int N = atoi(argv[1]), C = atoi(argv[2]), H = atoi(argv[3]), O = atoi(argv[4]), K = atoi(argv[5]), S = atoi(argv[6]), P = atoi(argv[7]);
  int OH = (H + 2 * P - K) / S + 1;
  engine eng(engine::kind::cpu, 0); stream st(eng);
  memory::dims src{N, C, H, H}, wei{O, C, K, K}, dst{N, O, OH, OH}, strides{S, S}, pad{P, P};
  auto any = [](memory::dims d) { return memory::desc(d, dt::f32, tag::any); };
  auto fwd_d = convolution_forward::desc(prop_kind::forward_training, algorithm::convolution_direct, any(src), any(wei), any(dst), strides, pad, pad);
  auto fwd_pd = convolution_forward::primitive_desc(fwd_d, eng);
  auto bwdd_pd = convolution_backward_data::primitive_desc(convolution_backward_data::desc(algorithm::convolution_direct, any(src), any(wei), any(dst), strides, pad, pad), eng, fwd_pd);
  auto bwdw_pd = convolution_backward_weights::primitive_desc(convolution_backward_weights::desc(algorithm::convolution_direct, any(src), any(wei), any(dst), strides, pad, pad), eng, fwd_pd);
  memory s(fwd_pd.src_desc(), eng), w(fwd_pd.weights_desc(), eng), d(fwd_pd.dst_desc(), eng);
  memory ds(bwdd_pd.diff_src_desc(), eng), dd(bwdd_pd.diff_dst_desc(), eng), dw(bwdw_pd.diff_weights_desc(), eng);
  memory s2(bwdw_pd.src_desc(), eng), dd2(bwdw_pd.diff_dst_desc(), eng);
  convolution_forward fwd(fwd_pd); convolution_backward_data bwdd(bwdd_pd); convolution_backward_weights bwdw(bwdw_pd);
  double fl = 2.0 * N * O * OH * OH * C * K * K;
  double tf = timeit([&] { fwd.execute(st, {{DNNL_ARG_SRC, s}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DST, d}}); st.wait(); }, 20);
  double tb = timeit([&] { bwdd.execute(st, {{DNNL_ARG_DIFF_DST, dd}, {DNNL_ARG_WEIGHTS, w}, {DNNL_ARG_DIFF_SRC, ds}}); st.wait(); }, 20);
  double tw = timeit([&] { bwdw.execute(st, {{DNNL_ARG_SRC, s2}, {DNNL_ARG_DIFF_DST, dd2}, {DNNL_ARG_DIFF_WEIGHTS, dw}}); st.wait(); }, 20);
  printf("N%d C%d H%d O%d K%d S%d P%d: fwd %.3f ms %.1f GF/s | bwd-data %.3f ms %.1f | bwd-weights %.3f ms %.1f  (impl %s)\n", N, C, H, O, K, S, P,
         tf * 1e3, fl / tf / 1e9, tb * 1e3, fl / tb / 1e9, tw * 1e3, fl / tw / 1e9, fwd_pd.impl_info_str());
}
