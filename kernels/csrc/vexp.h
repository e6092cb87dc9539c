/* expf without branches or libm calls, so loops over it vectorize (glibc's vector expf
 * needs -ffast-math, which would also drop the IEEE semantics the kernels rely on).
 * Cephes' range reduction and polynomial: within 2 ulp of expf on [-87.3, 88.3]; inputs
 * are clamped to that range, so it returns ~1e-38 below it and ~2.4e38 above it. */
#ifndef TANDEM_VEXP_H
#define TANDEM_VEXP_H

#include <stdint.h>
#include <string.h>

/* x limited to [lo, hi] by selecting bits. Written as a select of values, GCC folded vexp at
 * each bound and computed every arm on every lane: SiLU divided each lane's g by 1 + e^88.3,
 * a subnormal result and a microcode assist of ~150 cycles on Intel (12.5 -> 4.3 us for the
 * default model's 1536 gates, docs/cpu.md). NaN passes through, as before. */
static inline float clamp_bits(float x, float lo, float hi)
{
    int32_t xb, lb, hb;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&lb, &lo, sizeof lb);
    memcpy(&hb, &hi, sizeof hb);
    const int32_t below = -(int32_t)(x < lo), above = -(int32_t)(x > hi);
    xb = (xb & ~(below | above)) | (lb & below) | (hb & above);
    memcpy(&x, &xb, sizeof x);
    return x;
}

static inline float vexp(float x)
{
    const float round_magic = 12582912.f; /* 1.5 * 2^23: adding it rounds to an integer */
    x = clamp_bits(x, -87.3f, 88.3f);
    const float shifted = x * 1.44269504088896341f + round_magic;
    const float n = shifted - round_magic;
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    int32_t bits;
    memcpy(&bits, &shifted, sizeof bits); /* low mantissa bits hold n */
    bits = (bits - 0x4B400000 + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

#endif
