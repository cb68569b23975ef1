"""The fused host optimizer pass as a small C++ extension (`host_optimizer`'s first choice): torch's
own fused CPU Adam/AdamW kernel (aten/src/ATen/native/cpu/FusedAdamKernel.cpp: `at::vec::Vectorized`
and `at::parallel_for` over cache-line units, the same operations in the same order, compiled with
the same floating-point contraction), extended to read a bf16/fp16 gradient, write the streamed
copy, the fp32 `.grad`, the finite flag and optionally the new parameter and moments out of place
(`p_out`, `m_out`/`v_out`, `buf_out`: the old ones left as they were), all in the same loop (a tied
master's second download, `grad2`, read and added to the first in fp32 in that loop too: the sum is
the gradient, as `host_gradients.sum_downloads` makes it; `sum2`: that sum alone, one pass); and SGD (momentum) as torch's per-tensor step (each `add(..., alpha=)` one FMA).

Built at first use with `torch.utils.cpp_extension.load_inline` for this host's CPU capability
(`torch.backends.cpu.get_cpu_capability()`: the `Vectorized` ISA torch dispatches to) and cached
by torch (`TORCH_EXTENSIONS_DIR`, default ~/.cache/torch_extensions) under a name that hashes the
source, the flags and torch's version: a later process loads it in well under a second.
`load()` returns the module or raises; `host_optimizer` logs once and falls back.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from typing import Any

import torch

__all__ = ["SOURCE", "load", "flags"]

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/cpu/vec/functional.h>
#include <atomic>
#include <cmath>
#include <optional>

namespace {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
constexpr int64_t W = fVec::size();
constexpr int64_t UNIT = 64 / sizeof(float);  // torch's cache-line task unit
// units per thread at least (16K elements, ~450 KB of traffic): a small span runs on the calling thread
// instead of waking the others (torch's kernel uses 0: every span forks). The split changes no bit:
// every chunk but the last is whole vectors, so the scalar tail is the span's last numel % W elements
// however many threads step it.
constexpr int64_t GRAIN = 1024;

// 16-bit and fp32 gradients / copies, W elements at a time, as float vectors
template <typename T> inline fVec load_f(const T* p) {
  fVec out;
  at::vec::load_to_float<T>(p, out);
  return out;
}
template <> inline fVec load_f<float>(const float* p) { return fVec::loadu(p); }
template <typename T> inline void store_f(T* p, const fVec& x) { at::vec::convert<T>(x).store(p, W); }
template <> inline void store_f<float>(float* p, const fVec& x) { x.store(p); }

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// fp32 -> bf16 with the CPU's instruction (1 instead of ~8 integer ops): it rounds to nearest even
// as torch's conversion does, but flushes denormal inputs to zero and keeps NaN payloads; vectors
// holding either (rare) take torch's conversion, so the bits are torch's for every input
inline __m256i bf16_bits(const fVec& x) {
  __m512 v = x;
  if (__builtin_expect(_mm512_fpclass_ps_mask(v, 0x01 | 0x20 | 0x80) != 0, 0)) {  // QNaN, denormal, SNaN
    __m512i raw = at::vec::convert<c10::BFloat16>(x);
    return _mm512_castsi512_si256(raw);
  }
  return (__m256i)_mm512_cvtneps_pbh(v);
}
template <> inline void store_f<c10::BFloat16>(c10::BFloat16* p, const fVec& x) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
}
#endif

bool g_nt = true;

// the streamed copy (and p_out) with non-temporal stores where aligned: they are written, not read,
// so a normal store first reads each line in (write-allocate); these bypass that read
template <typename T> inline bool nt_ok(const T* p) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return g_nt && reinterpret_cast<uintptr_t>(p) % (sizeof(T) * W) == 0 && (sizeof(T) * W == 32 || sizeof(T) * W == 64);
#else
  return false;
#endif
}
template <typename T> inline void store_nt(T* p, const fVec& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<T, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    _mm512_stream_ps(reinterpret_cast<float*>(p), x);
#else
    _mm256_stream_ps(reinterpret_cast<float*>(p), x);
#endif
  } else {
#if defined(CPU_CAPABILITY_AVX512)
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      _mm256_stream_si256(reinterpret_cast<__m256i*>(p), bf16_bits(x));
      return;
    }
#endif
    __m512i raw = at::vec::convert<T>(x);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(p), _mm512_castsi512_si256(raw));
#else
    __m256i raw = at::vec::convert<T>(x);
    _mm_stream_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(raw));
#endif
  }
#else
  store_f<T>(p, x);
#endif
}
inline void fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// finite: x - x is +0 for finite x, NaN for inf and NaN; the sum stays 0 only if all are finite
inline bool all_zero(const fVec& acc) {
  float a[W];
  acc.store(a);
  for (int64_t i = 0; i < W; i++) if (!(a[i] == 0.0f)) return false;
  return true;
}

// A GradScaler's unscale, as torch's `_amp_foreach_non_finite_check_and_unscale_`: the fp32 gradient
// times the fp32 inverse scale, rounded once, before the update reads it. The product goes through an
// empty asm statement (a vector register it may have changed), so that -ffp-contract=fast cannot
// fuse the multiply into the update's first add (torch stores the rounded product into `.grad`).
inline fVec unscaled(const fVec& x, float inv) {
  fVec y = x * fVec(inv);
#if defined(CPU_CAPABILITY_AVX512)
  __m512 r = y;
  __asm__("" : "+v"(r));
  return fVec(r);
#elif defined(CPU_CAPABILITY_AVX2)
  __m256 r = y;
  __asm__("" : "+x"(r));
  return fVec(r);
#else
  float a[W];
  y.store(a);
  __asm__ __volatile__("" : : "r"(a) : "memory");
  return fVec::loadu(a);
#endif
}
inline float unscaled(float x, float inv) {
  volatile float y = x * inv;  // a volatile store: rounded, not contracted
  return y;
}

enum Mode { ORIGINAL = 0, ADAMW = 1 };

// One chunk of torch's adam_math<float, float, mode> (the float path, unchanged in its operations)
// with: the gradient loaded from G and written to grad_out as fp32, the finite flag, the new
// parameter written to p_out (else in place) and to the streamed copy C, the moments read from m_in, v_in and
// written to exp_avg_ptr, exp_avg_sq_ptr (the same pointers: in place; others: out of place, the old ones kept).
template <typename G, typename C, int mode>
bool adam_math(const float* p_in, float* param_ptr, const G* grad_ptr, const G* grad2_ptr, const float* m_in,
               const float* v_in,
               float* exp_avg_ptr, float* exp_avg_sq_ptr,
               float* grad_out, C* copy, double lr, double exp_avg_grad_coefficient,
               double exp_avg_sq_grad_coefficient, double bias_correction2_sqrt, double eps, double weight_decay,
               double beta2, double step_size, bool maximize, int64_t size, bool scaled, float inv) {
  using Vec = fVec;
  using scalar_t = float;
  Vec acc(0.0f);
  const bool nt_copy = copy && nt_ok(copy);
  const bool nt_p = param_ptr != p_in && nt_ok(param_ptr);
  int64_t d = 0;
  for (; d < size - (size % Vec::size()); d += Vec::size()) {
    Vec param_vec = Vec::loadu(p_in + d);
    Vec grad_vec = load_f<G>(grad_ptr + d);
    if (grad2_ptr) grad_vec = grad_vec + load_f<G>(grad2_ptr + d);  // a tied master's 2nd download, in fp32
    if (grad_out) grad_vec.store(grad_out + d);
    if (scaled) grad_vec = unscaled(grad_vec, inv);
    acc = acc + (grad_vec - grad_vec);
    if (maximize) grad_vec = grad_vec * Vec(scalar_t(-1.0));
    if (weight_decay != 0.f) {
      if constexpr (mode == ORIGINAL) {
        grad_vec += param_vec * Vec(scalar_t(weight_decay));
      } else {
        param_vec = param_vec * Vec(scalar_t(1 - lr * weight_decay));
      }
    }
    Vec exp_avg_vec = Vec::loadu(m_in + d);
    // exp_avg.lerp_(grad, 1 - beta1)
    const Vec lerp_weight = Vec(scalar_t(exp_avg_grad_coefficient));
    auto mask = lerp_weight.abs() < Vec(0.5);
    auto coeff = Vec::blendv(lerp_weight - Vec(1), lerp_weight, mask);
    auto base = Vec::blendv(grad_vec, exp_avg_vec, mask);
    exp_avg_vec = at::vec::fmadd(coeff, grad_vec - exp_avg_vec, base);

    Vec exp_avg_sq_vec = Vec::loadu(v_in + d) * Vec(scalar_t(beta2)) +
        Vec(scalar_t(exp_avg_sq_grad_coefficient)) * grad_vec * grad_vec;
    exp_avg_vec.store(exp_avg_ptr + d);
    exp_avg_sq_vec.store(exp_avg_sq_ptr + d);

    Vec denom_vec = (exp_avg_sq_vec.sqrt() / Vec(scalar_t(bias_correction2_sqrt))) + Vec(scalar_t(eps));
    param_vec = param_vec + Vec(scalar_t(-step_size)) * exp_avg_vec / denom_vec;
    if (nt_p) store_nt(param_ptr + d, param_vec); else param_vec.store(param_ptr + d);
    if (nt_copy) store_nt<C>(copy + d, param_vec); else if (copy) store_f<C>(copy + d, param_vec);
  }
  if (nt_copy || nt_p) fence();
  bool ok = all_zero(acc);
  for (; d < size; d++) {
    if (param_ptr != p_in) param_ptr[d] = p_in[d];
    if (exp_avg_ptr != m_in) exp_avg_ptr[d] = m_in[d];
    if (exp_avg_sq_ptr != v_in) exp_avg_sq_ptr[d] = v_in[d];
    scalar_t grad_val = grad_ptr[d];
    if (grad2_ptr) grad_val = grad_val + scalar_t(grad2_ptr[d]);
    if (grad_out) grad_out[d] = grad_val;
    if (scaled) grad_val = unscaled(grad_val, inv);
    ok = ok && std::isfinite(grad_val);
    if (maximize) grad_val = -grad_val;
    if (weight_decay != 0.f) {
      if constexpr (mode == ORIGINAL) {
        grad_val += param_ptr[d] * scalar_t(weight_decay);
      } else {
        param_ptr[d] = param_ptr[d] * scalar_t(1 - lr * weight_decay);
      }
    }
    // exp_avg.lerp_(grad, 1 - beta1)
    auto is_lerp_weight_small = std::abs(scalar_t(exp_avg_grad_coefficient)) < scalar_t(0.5);
    if (is_lerp_weight_small) {
      exp_avg_ptr[d] = exp_avg_ptr[d] + scalar_t(exp_avg_grad_coefficient) * (grad_val - exp_avg_ptr[d]);
    } else {
      exp_avg_ptr[d] = grad_val - (grad_val - exp_avg_ptr[d]) * (scalar_t(1) - scalar_t(exp_avg_grad_coefficient));
    }
    exp_avg_sq_ptr[d] = exp_avg_sq_ptr[d] * scalar_t(beta2);
    exp_avg_sq_ptr[d] = exp_avg_sq_ptr[d] + scalar_t(exp_avg_sq_grad_coefficient) * grad_val * grad_val;
    scalar_t demon_val = std::sqrt(exp_avg_sq_ptr[d]) / scalar_t(bias_correction2_sqrt) + scalar_t(eps);
    param_ptr[d] = param_ptr[d] - scalar_t(step_size) * exp_avg_ptr[d] / demon_val;
    if (copy) copy[d] = C(param_ptr[d]);
  }
  return ok;
}

template <typename T> T* ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<T>() : nullptr;
}

template <typename G, typename C, int mode>
bool adam_impl(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& grad2,
               const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& copy,
               const std::optional<at::Tensor>& p_out, const std::optional<at::Tensor>& m_out,
               const std::optional<at::Tensor>& v_out, double lr, double beta1, double beta2, double weight_decay,
               double eps, double step, bool maximize, double grad_scale) {
  const int64_t numel = param.numel();
  const float* p_in = param.data_ptr<float>();
  float* p_dst = p_out.has_value() ? p_out->data_ptr<float>() : param.data_ptr<float>();
  const G* g = grad.data_ptr<G>();
  const G* g2 = ptr<G>(grad2);
  const float* m = exp_avg.data_ptr<float>();
  const float* v = exp_avg_sq.data_ptr<float>();
  float* m_dst = m_out.has_value() ? m_out->data_ptr<float>() : exp_avg.data_ptr<float>();
  float* v_dst = v_out.has_value() ? v_out->data_ptr<float>() : exp_avg_sq.data_ptr<float>();
  float* go = ptr<float>(grad_out);
  C* cp = ptr<C>(copy);
  // need to use double here to align with non-fused adam (torch's comment)
  double bias_correction1 = 1 - std::pow(beta1, step);
  double bias_correction2 = 1 - std::pow(beta2, step);
  double exp_avg_grad_coefficient = 1 - beta1;
  double exp_avg_sq_grad_coefficient = 1 - beta2;
  double bias_correction2_sqrt = std::sqrt(bias_correction2);
  double step_size = lr / bias_correction1;
  std::atomic<bool> ok{true};
  int64_t num_units = (numel + UNIT - 1) / UNIT;
  at::parallel_for(0, num_units, GRAIN, [&](int64_t begin, int64_t end) {
    begin *= UNIT;
    end = std::min(end * UNIT, numel);
    bool fine = adam_math<G, C, mode>(p_in + begin, p_dst + begin, g + begin, g2 ? g2 + begin : nullptr, m + begin,
                                      v + begin, m_dst + begin,
                                      v_dst + begin,
                                      go ? go + begin : nullptr, cp ? cp + begin : nullptr, lr,
                                      exp_avg_grad_coefficient, exp_avg_sq_grad_coefficient, bias_correction2_sqrt,
                                      eps, weight_decay, beta2, step_size, maximize, end - begin,
                                      grad_scale != 1.0, float(grad_scale));
    if (!fine) ok.store(false, std::memory_order_relaxed);
  });
  return ok.load();
}

// SGD as torch's per-tensor step: every `a.add(b, alpha=c)` is fma(b, c, a), `buf.mul_(mom)` rounds once
template <typename G, typename C>
bool sgd_math(const float* p_in, float* p_dst, const G* g, const G* g2, const float* buf_in, float* buf, float* grad_out,
              C* copy,
              float wd, float mom,
              float damp1, float neg_lr, bool decay, bool nesterov, bool maximize, int64_t size, bool scaled,
              float inv) {
  fVec acc(0.0f);
  const bool nt_copy = copy && nt_ok(copy);
  const bool nt_p = p_dst != p_in && nt_ok(p_dst);
  int64_t d = 0;
  for (; d < size - (size % W); d += W) {
    fVec p = fVec::loadu(p_in + d);
    fVec x = load_f<G>(g + d);
    if (g2) x = x + load_f<G>(g2 + d);  // a tied master's 2nd download, in fp32
    if (grad_out) x.store(grad_out + d);
    if (scaled) x = unscaled(x, inv);
    acc = acc + (x - x);
    if (maximize) x = x.neg();
    if (decay) x = at::vec::fmadd(p, fVec(wd), x);
    if (buf) {
      fVec b = at::vec::fmadd(x, fVec(damp1), fVec::loadu(buf_in + d) * fVec(mom));
      b.store(buf + d);
      x = nesterov ? at::vec::fmadd(b, fVec(mom), x) : b;
    }
    p = at::vec::fmadd(x, fVec(neg_lr), p);
    if (nt_p) store_nt(p_dst + d, p); else p.store(p_dst + d);
    if (nt_copy) store_nt<C>(copy + d, p); else if (copy) store_f<C>(copy + d, p);
  }
  if (nt_copy || nt_p) fence();
  bool ok = all_zero(acc);
  for (; d < size; d++) {
    float p = p_in[d];
    float x = g[d];
    if (g2) x = x + float(g2[d]);
    if (grad_out) grad_out[d] = x;
    if (scaled) x = unscaled(x, inv);
    ok = ok && std::isfinite(x);
    if (maximize) x = -x;
    if (decay) x = std::fma(p, wd, x);
    if (buf) {
      float b = std::fma(x, damp1, buf_in[d] * mom);
      buf[d] = b;
      x = nesterov ? std::fma(b, mom, x) : b;
    }
    p = std::fma(x, neg_lr, p);
    p_dst[d] = p;
    if (copy) copy[d] = C(p);
  }
  return ok;
}

template <typename G, typename C>
bool sgd_impl(const at::Tensor& param, const at::Tensor& grad, const std::optional<at::Tensor>& grad2,
              const std::optional<at::Tensor>& buf,
              const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& copy,
              const std::optional<at::Tensor>& p_out, const std::optional<at::Tensor>& buf_out, double lr,
              double weight_decay, double momentum, double dampening, bool nesterov, bool maximize,
              double grad_scale) {
  const int64_t numel = param.numel();
  const float* p_in = param.data_ptr<float>();
  float* p_dst = p_out.has_value() ? p_out->data_ptr<float>() : param.data_ptr<float>();
  const G* g = grad.data_ptr<G>();
  const G* g2 = ptr<G>(grad2);
  const float* b = ptr<float>(buf);
  float* b_dst = buf_out.has_value() ? buf_out->data_ptr<float>() : ptr<float>(buf);
  float* go = ptr<float>(grad_out);
  C* cp = ptr<C>(copy);
  const float wd = float(weight_decay), mom = float(momentum), damp1 = float(1 - dampening), neg_lr = float(-lr);
  std::atomic<bool> ok{true};
  int64_t num_units = (numel + UNIT - 1) / UNIT;
  at::parallel_for(0, num_units, GRAIN, [&](int64_t begin, int64_t end) {
    begin *= UNIT;
    end = std::min(end * UNIT, numel);
    bool fine = sgd_math<G, C>(p_in + begin, p_dst + begin, g + begin, g2 ? g2 + begin : nullptr,
                               b ? b + begin : nullptr,
                               b ? b_dst + begin : nullptr,
                               go ? go + begin : nullptr, cp ? cp + begin : nullptr, wd, mom, damp1, neg_lr,
                               weight_decay != 0, nesterov, maximize, end - begin, grad_scale != 1.0,
                               float(grad_scale));
    if (!fine) ok.store(false, std::memory_order_relaxed);
  });
  return ok.load();
}

// The host's ceiling over the same bytes (benchmarks/cpu_optimizer.py): read p, m, v and the gradient,
// write p, m, v and the copy (the same stores as the pass), one multiply-add each.
template <typename G, typename C>
void triad_impl(float* p, const G* g, float* m, float* v, C* copy, float a, int64_t numel) {
  int64_t num_units = (numel + UNIT - 1) / UNIT;
  at::parallel_for(0, num_units, GRAIN, [&](int64_t begin, int64_t end) {
    begin *= UNIT;
    end = std::min(end * UNIT, numel);
    const bool nt_copy = copy && nt_ok(copy + begin);
    const fVec av(a);
    int64_t d = begin;
    for (; d < end - ((end - begin) % W); d += W) {
      fVec x = load_f<G>(g + d);
      fVec q = at::vec::fmadd(av, x, fVec::loadu(p + d));
      q.store(p + d);
      at::vec::fmadd(av, x, fVec::loadu(m + d)).store(m + d);
      at::vec::fmadd(av, x, fVec::loadu(v + d)).store(v + d);
      if (nt_copy) store_nt<C>(copy + d, q); else if (copy) store_f<C>(copy + d, q);
    }
    if (nt_copy) fence();
    for (; d < end; d++) {
      float x = g[d];
      p[d] = std::fma(a, x, p[d]);
      m[d] = std::fma(a, x, m[d]);
      v[d] = std::fma(a, x, v[d]);
      if (copy) copy[d] = C(p[d]);
    }
  });
}

void check(const at::Tensor& t, const char* what, int64_t n) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.numel() == n, "host kernel: ", what,
              " must be a contiguous CPU tensor of ", n, " elements, got ", t.sizes(), " on ", t.device());
}

void check_all(const at::Tensor& p, const at::Tensor& g, const std::optional<at::Tensor>& go,
               const std::optional<at::Tensor>& copy, const std::optional<at::Tensor>& p_out,
               const std::optional<at::Tensor>& g2 = std::nullopt) {
  int64_t n = p.numel();
  check(p, "p", n);
  TORCH_CHECK(p.scalar_type() == at::kFloat, "host kernel: p must be fp32");
  check(g, "grad", n);
  if (g2) {
    check(*g2, "grad2", n);
    TORCH_CHECK(g2->scalar_type() == g.scalar_type(), "host kernel: grad2 must have grad's dtype");
  }
  if (go) { check(*go, "grad_out", n); TORCH_CHECK(go->scalar_type() == at::kFloat, "host kernel: grad_out must be fp32"); }
  if (copy) check(*copy, "copy_out", n);
  if (p_out) { check(*p_out, "p_out", n); TORCH_CHECK(p_out->scalar_type() == at::kFloat, "host kernel: p_out must be fp32"); }
}

// dispatch over the gradient's and the copy's dtypes (fp32, bf16, fp16; no copy)
template <typename F>
bool dispatch(at::ScalarType gt, const std::optional<at::Tensor>& copy, F&& f) {
  auto with_copy = [&](auto gtag) -> bool {
    using G = decltype(gtag);
    if (!copy) return f(G(), (float*)nullptr, std::false_type());
    switch (copy->scalar_type()) {
      case at::kFloat: return f(G(), (float*)nullptr, std::true_type());
      case at::kBFloat16: return f(G(), (c10::BFloat16*)nullptr, std::true_type());
      case at::kHalf: return f(G(), (c10::Half*)nullptr, std::true_type());
      default: TORCH_CHECK(false, "host kernel: copy_out dtype ", copy->scalar_type(), " is not fp32, bf16 or fp16");
    }
  };
  switch (gt) {
    case at::kFloat: return with_copy(float());
    case at::kBFloat16: return with_copy(c10::BFloat16());
    case at::kHalf: return with_copy(c10::Half());
    default: TORCH_CHECK(false, "host kernel: gradient dtype ", gt, " is not fp32, bf16 or fp16");
  }
}

bool adam(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
          const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& copy,
          const std::optional<at::Tensor>& p_out, double lr, double beta1, double beta2, double weight_decay,
          double eps, double step, bool decoupled, bool maximize, const std::optional<at::Tensor>& m_out,
          const std::optional<at::Tensor>& v_out, double grad_scale, const std::optional<at::Tensor>& grad2) {
  check_all(p, g, grad_out, copy, p_out, grad2);
  check(m, "exp_avg", p.numel());
  check(v, "exp_avg_sq", p.numel());
  TORCH_CHECK(m_out.has_value() == v_out.has_value(), "host kernel: m_out and v_out go together");
  if (m_out) { check(*m_out, "m_out", p.numel()); check(*v_out, "v_out", p.numel()); }
  TORCH_CHECK(!m_out || (m_out->scalar_type() == at::kFloat && v_out->scalar_type() == at::kFloat), "host kernel: m_out, v_out: fp32");
  TORCH_CHECK(m.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "host kernel: the moments must be fp32");
  return dispatch(g.scalar_type(), copy, [&](auto gtag, auto* ctag, auto) -> bool {
    using G = decltype(gtag);
    using C = std::remove_pointer_t<decltype(ctag)>;
    return decoupled ? adam_impl<G, C, ADAMW>(p, g, grad2, m, v, grad_out, copy, p_out, m_out, v_out, lr, beta1, beta2, weight_decay, eps, step, maximize, grad_scale)
                     : adam_impl<G, C, ORIGINAL>(p, g, grad2, m, v, grad_out, copy, p_out, m_out, v_out, lr, beta1, beta2, weight_decay, eps, step, maximize, grad_scale);
  });
}

bool sgd(const at::Tensor& p, const at::Tensor& g, const std::optional<at::Tensor>& buf,
         const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& copy,
         const std::optional<at::Tensor>& p_out, double lr, double weight_decay, double momentum, double dampening,
         bool nesterov, bool maximize, const std::optional<at::Tensor>& buf_out, double grad_scale,
         const std::optional<at::Tensor>& grad2) {
  check_all(p, g, grad_out, copy, p_out, grad2);
  if (buf) {
    check(*buf, "momentum_buffer", p.numel());
    TORCH_CHECK(buf->scalar_type() == at::kFloat, "host kernel: momentum_buffer must be fp32");
  }
  TORCH_CHECK(!buf_out || buf, "host kernel: buf_out without a momentum_buffer");
  if (buf_out) check(*buf_out, "buf_out", p.numel());
  TORCH_CHECK(!buf_out || buf_out->scalar_type() == at::kFloat, "host kernel: buf_out must be fp32");
  return dispatch(g.scalar_type(), copy, [&](auto gtag, auto* ctag, auto) -> bool {
    using G = decltype(gtag);
    using C = std::remove_pointer_t<decltype(ctag)>;
    return sgd_impl<G, C>(p, g, grad2, buf, grad_out, copy, p_out, buf_out, lr, weight_decay, momentum, dampening, nesterov, maximize,
                          grad_scale);
  });
}

void triad(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
           const std::optional<at::Tensor>& copy, double a) {
  check_all(p, g, std::nullopt, copy, std::nullopt);
  check(m, "m", p.numel());
  check(v, "v", p.numel());
  dispatch(g.scalar_type(), copy, [&](auto gtag, auto* ctag, auto) -> bool {
    using G = decltype(gtag);
    using C = std::remove_pointer_t<decltype(ctag)>;
    triad_impl<G, C>(p.data_ptr<float>(), g.data_ptr<G>(), m.data_ptr<float>(), v.data_ptr<float>(), ptr<C>(copy),
                     float(a), p.numel());
    return true;
  });
}

// A tied master's two downloads summed into its fp32 `.grad` in one pass (the hand-over: read a and b,
// write out), with the bits of `host_gradients.sum_downloads` (a widened, b added in fp32: one rounding)
template <typename G>
void sum2_impl(float* out, const G* a, const G* b, int64_t numel) {
  int64_t num_units = (numel + UNIT - 1) / UNIT;
  at::parallel_for(0, num_units, GRAIN, [&](int64_t begin, int64_t end) {
    begin *= UNIT;
    end = std::min(end * UNIT, numel);
    const bool nt = nt_ok(out + begin);
    int64_t d = begin;
    for (; d < end - ((end - begin) % W); d += W) {
      fVec x = load_f<G>(a + d) + load_f<G>(b + d);
      if (nt) store_nt<float>(out + d, x); else x.store(out + d);
    }
    if (nt) fence();
    for (; d < end; d++) out[d] = float(a[d]) + float(b[d]);
  });
}

void sum2(const at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  int64_t n = out.numel();
  check(out, "out", n);
  TORCH_CHECK(out.scalar_type() == at::kFloat, "host kernel: out must be fp32");
  check(a, "a", n);
  check(b, "b", n);
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "host kernel: a and b must have one dtype");
  switch (a.scalar_type()) {
    case at::kFloat: sum2_impl<float>(out.data_ptr<float>(), a.data_ptr<float>(), b.data_ptr<float>(), n); break;
    case at::kBFloat16: sum2_impl<c10::BFloat16>(out.data_ptr<float>(), a.data_ptr<c10::BFloat16>(),
                                                 b.data_ptr<c10::BFloat16>(), n); break;
    case at::kHalf: sum2_impl<c10::Half>(out.data_ptr<float>(), a.data_ptr<c10::Half>(), b.data_ptr<c10::Half>(), n);
      break;
    default: TORCH_CHECK(false, "host kernel: download dtype ", a.scalar_type(), " is not fp32, bf16 or fp16");
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam", &adam, "one fused Adam/AdamW step of a flat span");
  m.def("sgd", &sgd, "one fused SGD (momentum) step of a flat span");
  m.def("sum2", &sum2, "out = a + b in fp32 (two downloads of a tied master summed into its .grad, one pass)");
  m.def("triad", &triad, "the host's ceiling over the pass's bytes: one multiply-add per tensor");
  m.def("nontemporal", [](bool on) { bool was = g_nt; g_nt = on; return was; },
        "whether the streamed copy and p_out are written with non-temporal stores (returns the previous setting)");
}
"""

# the compiler flags of torch's own build of its CPU kernels per capability (cmake/Codegen.cmake), and
# gcc's default contraction outside ISO C++ (torch's build uses gnu++17: -ffp-contract=fast)
_ISA = {"AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
                   "-DCPU_CAPABILITY_AVX512"],
        "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
        "DEFAULT": ["-DCPU_CAPABILITY=DEFAULT", "-DCPU_CAPABILITY_DEFAULT"]}

_lock = threading.Lock()
_module: Any = None


def _has_avx512_bf16() -> bool:
    try:
        return bool(torch.cpu.get_capabilities().get("avx512_bf16"))  # torch's cpuinfo probe
    except Exception:  # noqa: BLE001 - an older torch without the probe: the portable conversion
        return False


def flags() -> list[str]:
    """The C++ flags for this host: -O2, OpenMP (at::parallel_for is OpenMP in torch's build),
    contraction as torch's build, the vector ISA torch dispatches its own kernels to, and the
    AVX-512 BF16 conversion where the CPU has it (the streamed bf16 copy)."""
    cap = torch.backends.cpu.get_cpu_capability()
    isa = _ISA.get(cap, _ISA["DEFAULT"])
    return ["-O2", "-fopenmp", "-ffp-contract=fast"] + isa + (["-mavx512bf16"] if cap == "AVX512" and _has_avx512_bf16()
                                                              else [])


def load(verbose: bool = False) -> Any:
    """The built extension (built at the first call in any process, then loaded from torch's
    extension cache); raises whatever the build raises."""
    global _module
    with _lock:
        if _module is None:
            from torch.utils.cpp_extension import load_inline

            cflags = flags()
            cxx = os.environ.get("CXX", "c++")  # the compiler torch's build uses: another one, another build
            tag = hashlib.sha256("\0".join([SOURCE, *cflags, torch.__version__, cxx]).encode()).hexdigest()[:12]
            logging.getLogger("mobius_fx").info(
                "mobius_fx: loading the fused host optimizer kernel mobius_host_optimizer_%s (built on first use "
                "with %s, about a minute; then cached by torch.utils.cpp_extension)", tag, cxx)
            _module = load_inline(name=f"mobius_host_optimizer_{tag}", cpp_sources=[SOURCE], extra_cflags=cflags,
                                  extra_ldflags=["-fopenmp"], verbose=verbose or bool(os.environ.get("MOBIUS_FX_VERBOSE_BUILD")))
        return _module
