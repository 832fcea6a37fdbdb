// Element types of the KV cache and their conversions to and from fp32.
//
// No CUDA header is included: fp16 and bf16 are stored as 16-bit words and converted
// with PTX cvt instructions (sm_80+), so the sources compile through NVRTC with no
// include path at all, on a machine with no CUDA toolkit.
#pragma once

// Tags naming the cache dtype in template arguments (and in NVRTC name expressions).
struct kv_f32 {};
struct kv_f16 {};
struct kv_bf16 {};

// A 16-byte copy unit (the widest global load/store of one thread).
struct __align__(16) kv_u128 {
    unsigned int x, y, z, w;
};

template <class T> struct KVType;

template <> struct KVType<kv_f32> {
    typedef float storage;
    static __device__ __forceinline__ float to_float(storage v) { return v; }
    static __device__ __forceinline__ storage from_float(float v) { return v; }
    // The 4 floats of one 16-byte word.
    static __device__ __forceinline__ void unpack(const kv_u128& w, float* f) {
        f[0] = __uint_as_float(w.x);
        f[1] = __uint_as_float(w.y);
        f[2] = __uint_as_float(w.z);
        f[3] = __uint_as_float(w.w);
    }
};

template <> struct KVType<kv_f16> {
    typedef unsigned short storage;
    static __device__ __forceinline__ float to_float(storage v) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
        return f;
    }
    static __device__ __forceinline__ storage from_float(float v) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
    static __device__ __forceinline__ void unpack_word(unsigned int w, float* f) {
        f[0] = to_float(static_cast<storage>(w & 0xffffu));
        f[1] = to_float(static_cast<storage>(w >> 16));
    }
    // The 8 halves of one 16-byte word, lowest address first.
    static __device__ __forceinline__ void unpack(const kv_u128& w, float* f) {
        unpack_word(w.x, f);
        unpack_word(w.y, f + 2);
        unpack_word(w.z, f + 4);
        unpack_word(w.w, f + 6);
    }
};

template <> struct KVType<kv_bf16> {
    typedef unsigned short storage;
    static __device__ __forceinline__ float to_float(storage v) {
        return __uint_as_float(static_cast<unsigned int>(v) << 16);
    }
    static __device__ __forceinline__ storage from_float(float v) {
        unsigned short h;
        asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(v));
        return h;
    }
    static __device__ __forceinline__ void unpack_word(unsigned int w, float* f) {
        f[0] = __uint_as_float(w << 16);
        f[1] = __uint_as_float(w & 0xffff0000u);
    }
    // The 8 bf16 values of one 16-byte word, lowest address first.
    static __device__ __forceinline__ void unpack(const kv_u128& w, float* f) {
        unpack_word(w.x, f);
        unpack_word(w.y, f + 2);
        unpack_word(w.z, f + 4);
        unpack_word(w.w, f + 6);
    }
};
