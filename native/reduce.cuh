// ddl reduction kernels: reduce one or several incoming chunks into place.
//
//     out[i] = op(...op(op(a0[i], a1[i]), a2[i])..., aK-1[i])        for i in [0, n)
//
// a0 is the local value (it may be `out` itself: in place) and a1.. are incoming chunks (receive
// scratch). The fold is left to right and the result is rounded to the element type after EVERY
// operation, so reducing k incoming chunks in one launch is bitwise identical to k launches (and to
// the host executor's numpy ufuncs): the reduction order stays the schedule's program order.
// MIN and MAX return one of their operands bit for bit (NaNs propagate as numpy's minimum/maximum).
// The one place bits may differ from the host: an arithmetic result that is NaN is a NaN, but GPUs
// produce the canonical NaN where x86 keeps the operand's payload.
//
// Memory access: 16-byte vector loads and stores (uint4) over the part of the range where every
// pointer is 16-byte aligned, with a scalar head (up to the first aligned address) and a scalar tail
// (the last n % pack elements). If the pointers are misaligned *differently* from one another no
// common aligned region exists and the whole range takes the scalar path (still correct, slower).
// A grid-stride loop makes any grid size correct; the body keeps UNROLL packs of every operand in
// flight per thread so that a modest grid saturates device memory bandwidth.
//
// The element loop is a __host__ __device__ template that takes the thread index and the thread
// count as arguments: the same code is compiled for the device (NVRTC, via CuPy's RawModule) and, in
// the tests, for the host, where every simulated thread is run in turn and the result compared with
// numpy bit for bit.
//
// This file is self-contained for NVRTC: no standard headers. Define DDL_WITH_HALF and/or
// DDL_WITH_BF16 before it to get float16 (__half) and bfloat16 (__nv_bfloat16) support.
#ifndef DDL_REDUCE_CUH
#define DDL_REDUCE_CUH

#if defined(DDL_WITH_HALF)
#include <cuda_fp16.h>
#endif
#if defined(DDL_WITH_BF16)
#include <cuda_bf16.h>
#endif

#define DDL_HD __host__ __device__ __forceinline__

namespace ddl {

typedef unsigned long long u64;

// ---- element traits ------------------------------------------------------------------------------
// S: the storage type (what memory holds, a plain integer or float: it can sit in a union with
// uint4), C: the type arithmetic is done in; store() rounds a C value to the element type.

// MIN/MAX of two equal floats (-0.0 and +0.0) keep the first operand, as numpy's scalar loops do,
// unless DDL_<MIN|MAX>_TIES_SECOND_<TYPE> is 1: numpy's SIMD loops keep the second. ddl/gpu/kernels.py
// asks the running numpy and defines them, so the device gives the host executor's bits.
#ifndef DDL_MIN_TIES_SECOND_FLOAT
#define DDL_MIN_TIES_SECOND_FLOAT 0
#endif
#ifndef DDL_MAX_TIES_SECOND_FLOAT
#define DDL_MAX_TIES_SECOND_FLOAT 0
#endif
#ifndef DDL_MIN_TIES_SECOND_DOUBLE
#define DDL_MIN_TIES_SECOND_DOUBLE 0
#endif
#ifndef DDL_MAX_TIES_SECOND_DOUBLE
#define DDL_MAX_TIES_SECOND_DOUBLE 0
#endif
#ifndef DDL_MIN_TIES_SECOND_HALF
#define DDL_MIN_TIES_SECOND_HALF 0
#endif
#ifndef DDL_MAX_TIES_SECOND_HALF
#define DDL_MAX_TIES_SECOND_HALF 0
#endif
#ifndef DDL_MIN_TIES_SECOND_BF16
#define DDL_MIN_TIES_SECOND_BF16 0
#endif
#ifndef DDL_MAX_TIES_SECOND_BF16
#define DDL_MAX_TIES_SECOND_BF16 0
#endif

#define DDL_FLOAT_ELEM(T, MIN2, MAX2)                                                         \
    template <> struct Elem<T> {                                                              \
        typedef T S;                                                                          \
        typedef T C;                                                                          \
        enum { min_ties_second = MIN2, max_ties_second = MAX2 };                              \
        static DDL_HD C load(S s) { return s; }                                               \
        static DDL_HD S store(C c) { return c; }                                              \
    };

template <class T> struct Elem;
DDL_FLOAT_ELEM(float, DDL_MIN_TIES_SECOND_FLOAT, DDL_MAX_TIES_SECOND_FLOAT)
DDL_FLOAT_ELEM(double, DDL_MIN_TIES_SECOND_DOUBLE, DDL_MAX_TIES_SECOND_DOUBLE)

// Integers: arithmetic wraps modulo 2^bits (two's complement) like numpy. It is done in an unsigned
// type at least as wide as int (W), so that neither signed overflow nor the promotion of small
// unsigned types to int (65535 * 65535 overflows int) is ever undefined behaviour.
#define DDL_INT_ELEM(T, W)                                                                    \
    template <> struct Elem<T> {                                                              \
        typedef T S;                                                                          \
        typedef T C;                                                                          \
        typedef W Wide;                                                                       \
        static DDL_HD C load(S s) { return s; }                                               \
        static DDL_HD S store(C c) { return c; }                                              \
    };

DDL_INT_ELEM(signed char, unsigned int)
DDL_INT_ELEM(unsigned char, unsigned int)
DDL_INT_ELEM(short, unsigned int)
DDL_INT_ELEM(unsigned short, unsigned int)
DDL_INT_ELEM(int, unsigned int)
DDL_INT_ELEM(unsigned int, unsigned int)
DDL_INT_ELEM(long long, unsigned long long)
DDL_INT_ELEM(unsigned long long, unsigned long long)

#if defined(DDL_WITH_HALF)
// float16: computed in float, rounded to nearest even after each operation. float has 24 bits of
// significand >= 2 * 11 + 2, so the double rounding is innocuous: the result is the correctly rounded
// half-precision result, identical to numpy's float16 ufuncs.
template <> struct Elem<__half> {
    typedef unsigned short S;
    typedef float C;
    enum { min_ties_second = DDL_MIN_TIES_SECOND_HALF, max_ties_second = DDL_MAX_TIES_SECOND_HALF };
    static DDL_HD C load(S s) {
        __half_raw r;
        r.x = s;
        return __half2float(__half(r));
    }
    static DDL_HD S store(C c) {
        __half_raw r = __float2half_rn(c);
        return r.x;
    }
};
#endif

#if defined(DDL_WITH_BF16)
// bfloat16: computed in float (24 >= 2 * 8 + 2 bits), rounded to nearest even after each operation,
// identical to ml_dtypes.bfloat16 numpy arithmetic.
template <> struct Elem<__nv_bfloat16> {
    typedef unsigned short S;
    typedef float C;
    enum { min_ties_second = DDL_MIN_TIES_SECOND_BF16, max_ties_second = DDL_MAX_TIES_SECOND_BF16 };
    static DDL_HD C load(S s) {
        __nv_bfloat16_raw r;
        r.x = s;
        return __bfloat162float(__nv_bfloat16(r));
    }
    static DDL_HD S store(C c) {
        __nv_bfloat16_raw r = __float2bfloat16_rn(c);
        return r.x;
    }
};
#endif

// ---- reduction operations ------------------------------------------------------------------------
// combine<T>(a, b) takes and returns STORAGE values: arithmetic converts, computes in C and rounds
// back to the element type (so a chain of operations rounds after every one, as numpy does); MIN and
// MAX select one of their operands unchanged (NaN payloads and signed zeros pass through bit for
// bit). Integer SUM/PROD go through E::Wide (wrapping). MIN/MAX on floats follow numpy's
// minimum/maximum: a NaN in either operand propagates.

template <class E, bool IsInt> struct Arith;
template <class E> struct Arith<E, false> {
    typedef typename E::C C;
    static DDL_HD C add(C a, C b) { return a + b; }
    static DDL_HD C mul(C a, C b) { return a * b; }
    static DDL_HD bool first_is_min(C a, C b) { return (E::min_ties_second ? a < b : a <= b) || a != a; }
    static DDL_HD bool first_is_max(C a, C b) { return (E::max_ties_second ? a > b : a >= b) || a != a; }
};
template <class E> struct Arith<E, true> {
    typedef typename E::C C;
    typedef typename E::Wide W;
    static DDL_HD C add(C a, C b) { return (C)((W)a + (W)b); }
    static DDL_HD C mul(C a, C b) { return (C)((W)a * (W)b); }
    static DDL_HD bool first_is_min(C a, C b) { return !(b < a); }
    static DDL_HD bool first_is_max(C a, C b) { return !(b > a); }
};

template <class T> struct IsInt { enum { value = 0 }; };
template <> struct IsInt<signed char> { enum { value = 1 }; };
template <> struct IsInt<unsigned char> { enum { value = 1 }; };
template <> struct IsInt<short> { enum { value = 1 }; };
template <> struct IsInt<unsigned short> { enum { value = 1 }; };
template <> struct IsInt<int> { enum { value = 1 }; };
template <> struct IsInt<unsigned int> { enum { value = 1 }; };
template <> struct IsInt<long long> { enum { value = 1 }; };
template <> struct IsInt<unsigned long long> { enum { value = 1 }; };

#define DDL_OP_TYPES                                   \
    typedef Elem<T> E;                                 \
    typedef typename E::S S;                           \
    typedef Arith<E, IsInt<T>::value> A;

struct OpSum {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        DDL_OP_TYPES
        return E::store(A::add(E::load(a), E::load(b)));
    }
};
struct OpProd {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        DDL_OP_TYPES
        return E::store(A::mul(E::load(a), E::load(b)));
    }
};
struct OpMin {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        DDL_OP_TYPES
        return A::first_is_min(E::load(a), E::load(b)) ? a : b;
    }
};
struct OpMax {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        DDL_OP_TYPES
        return A::first_is_max(E::load(a), E::load(b)) ? a : b;
    }
};
// Bitwise operations exist for integers only (instantiating them for a float type fails to compile).
struct OpBand {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        return (typename Elem<T>::S)(a & b);
    }
};
struct OpBor {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        return (typename Elem<T>::S)(a | b);
    }
};
struct OpBxor {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        return (typename Elem<T>::S)(a ^ b);
    }
};
// Logical operations (MPI_LAND, MPI_LOR, MPI_LXOR): any non-zero operand is true; the result is 1 or 0.
struct OpLand {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        return (typename Elem<T>::S)(a != 0 && b != 0);
    }
};
struct OpLor {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        return (typename Elem<T>::S)(a != 0 || b != 0);
    }
};
struct OpLxor {
    template <class T> static DDL_HD typename Elem<T>::S combine(typename Elem<T>::S a, typename Elem<T>::S b) {
        return (typename Elem<T>::S)((a != 0) != (b != 0));
    }
};

// ---- memory access -------------------------------------------------------------------------------
static DDL_HD u64 addr(const void* p) { return (u64)(p); }

// a0 may alias out: plain load. a1.. are receive scratch, read-only during the kernel: read-only
// cache path on the device.
static DDL_HD uint4 load_pack(const uint4* p) { return *p; }
static DDL_HD uint4 load_pack_ro(const uint4* p) {
#if defined(__CUDA_ARCH__)
    return __ldg(p);
#else
    return *p;
#endif
}

// ---- the reduction -------------------------------------------------------------------------------
// K operands (K >= 2): src[0] is the local value, src[1..K-1] the incoming chunks. Where the first
// incoming chunk goes first (Schedule.operand_order: ranks that combine the same partial results put
// them in the same order, see ddl/verify.py) the two swap places, and src[1] may then be `out`
// itself. Its read-only loads stay valid: each element is loaded once, by the thread that stores it,
// before it stores it.
template <class Op, class T, int K> struct Reduce {
    typedef Elem<T> E;
    typedef typename E::S S;
    enum { PACK = 16 / sizeof(S), UNROLL = K <= 3 ? 4 : (K <= 5 ? 2 : 1) };
    union Pack {
        uint4 v;
        S e[PACK];
    };

    static DDL_HD S element(const S* const* src, u64 i) {
        S acc = src[0][i];
#pragma unroll
        for (int k = 1; k < K; ++k) acc = Op::template combine<T>(acc, src[k][i]);
        return acc;
    }

    // Elements [0, head) and [tail, n) are scalar; packs in between are vectorised.
    static DDL_HD void split(S* out, const S* const* src, u64 n, u64& head, u64& npacks) {
        const u64 mis = addr(out) & 15;
        bool same = true;
#pragma unroll
        for (int k = 0; k < K; ++k) same = same && ((addr(src[k]) & 15) == mis);
        if (!same) {  // no common aligned region: all scalar
            head = n;
            npacks = 0;
            return;
        }
        head = ((16 - mis) & 15) / sizeof(S);
        if (head > n) head = n;
        npacks = (n - head) / PACK;
    }

    static DDL_HD void run(S* out, const S* const* src, u64 n, u64 tid, u64 nthreads) {
        u64 head, npacks;
        split(out, src, n, head, npacks);
        for (u64 i = tid; i < head; i += nthreads) out[i] = element(src, i);

        uint4* o = (uint4*)(out + head);
        const uint4* s[K];
#pragma unroll
        for (int k = 0; k < K; ++k) s[k] = (const uint4*)(src[k] + head);
        u64 p = tid;
        // main loop: UNROLL packs of every operand loaded before any arithmetic (memory-level parallelism)
        for (; p + (UNROLL - 1) * nthreads < npacks; p += UNROLL * nthreads) {
            Pack in[K][UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) in[0][u].v = load_pack(s[0] + p + u * nthreads);
#pragma unroll
            for (int k = 1; k < K; ++k)
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) in[k][u].v = load_pack_ro(s[k] + p + u * nthreads);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                Pack r;
#pragma unroll
                for (int e = 0; e < PACK; ++e) {
                    S acc = in[0][u].e[e];
#pragma unroll
                    for (int k = 1; k < K; ++k) acc = Op::template combine<T>(acc, in[k][u].e[e]);
                    r.e[e] = acc;
                }
                o[p + u * nthreads] = r.v;
            }
        }
        for (; p < npacks; p += nthreads) {  // remainder packs, one at a time
            Pack in[K];
            in[0].v = load_pack(s[0] + p);
#pragma unroll
            for (int k = 1; k < K; ++k) in[k].v = load_pack_ro(s[k] + p);
            Pack r;
#pragma unroll
            for (int e = 0; e < PACK; ++e) {
                S acc = in[0].e[e];
#pragma unroll
                for (int k = 1; k < K; ++k) acc = Op::template combine<T>(acc, in[k].e[e]);
                r.e[e] = acc;
            }
            o[p] = r.v;
        }
        for (u64 i = head + npacks * PACK + tid; i < n; i += nthreads) out[i] = element(src, i);
    }
};

// out[i] = out[i] / divisor, rounded to the element type (ends an AVG: SUM then divide by the number
// of ranks, like numpy's true_divide(x, n, out=x) on the host).
template <class T> struct Scale {
    typedef Elem<T> E;
    typedef typename E::S S;
    typedef typename E::C C;
    enum { PACK = 16 / sizeof(S) };
    union Pack {
        uint4 v;
        S e[PACK];
    };
    static DDL_HD void run(S* out, u64 n, double divisor, u64 tid, u64 nthreads) {
        const C d = (C)divisor;
        u64 head = ((16 - (addr(out) & 15)) & 15) / sizeof(S);
        if (head > n) head = n;
        const u64 npacks = (n - head) / PACK;
        for (u64 i = tid; i < head; i += nthreads) out[i] = E::store(E::load(out[i]) / d);
        uint4* o = (uint4*)(out + head);
        for (u64 p = tid; p < npacks; p += nthreads) {
            Pack x;
            x.v = o[p];
#pragma unroll
            for (int e = 0; e < PACK; ++e) x.e[e] = E::store(E::load(x.e[e]) / d);
            o[p] = x.v;
        }
        for (u64 i = head + npacks * PACK + tid; i < n; i += nthreads) out[i] = E::store(E::load(out[i]) / d);
    }
};

// ---- entry points --------------------------------------------------------------------------------
// reduce_thread: one (simulated or real) thread's share; the generated kernels call it with the CUDA
// thread index, the host test harness with every index in turn.
template <class Op, class T, class... P>
DDL_HD void reduce_thread(T* out, u64 n, u64 tid, u64 nthreads, const T* a0, P... in) {
    typedef typename Elem<T>::S S;
    const S* src[1 + sizeof...(P)] = {(const S*)a0, (const S*)in...};
    Reduce<Op, T, 1 + sizeof...(P)>::run((S*)out, src, n, tid, nthreads);
}

template <class T> DDL_HD void scale_thread(T* out, u64 n, double divisor, u64 tid, u64 nthreads) {
    Scale<T>::run((typename Elem<T>::S*)out, n, divisor, tid, nthreads);
}

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
__device__ __forceinline__ u64 thread_index() { return (u64)blockIdx.x * blockDim.x + threadIdx.x; }
__device__ __forceinline__ u64 thread_count() { return (u64)gridDim.x * blockDim.x; }
#endif

}  // namespace ddl

#endif  // DDL_REDUCE_CUH
