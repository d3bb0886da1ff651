/*
 * memcpy and memmove for the static (musl) build of bca.
 *
 * Why: musl's x86_64 memcpy is `rep movsq` for every size. On the machines bca was measured on
 * (AMD EPYC, virtualised) each call costs 45-55 ns before the first byte, so a 16-byte copy takes
 * 45 ns where glibc's takes 3.6 ns, and a 4 KiB page 215 ns against 36 ns. Rust moves, SQLite's
 * page handling and aws-lc all copy through `memcpy`: in the join storm the static binary spent
 * 9.9% of the appliance's core in it (1.6% for the glibc build). These are plain SSE2 (part of
 * every x86_64) loads and stores: small sizes with a few overlapping unaligned moves, larger ones
 * in 16-byte steps stored aligned.
 *
 * The build (build.rs) always compiles them as `bca_memmove` and `bca_memcpy`, which the test
 * `tests/it/fastmem.rs` checks against a byte loop for every size to 1 KiB, every alignment, and
 * every distance between source and destination to n+2 for sizes to 200; only for the musl target
 * does it also define `memcpy` and `memmove` (`BCA_LIBC_MEM`), linked whole so that they take the
 * place of musl's. memcpy is memmove (one comparison more).
 *
 * Compiled with -ffreestanding -fno-builtin (and, with GCC, -fno-tree-loop-distribute-patterns):
 * the compiler must not turn these loops back into calls to memcpy. And -fno-stack-protector:
 * musl copies the thread's TLS image with memcpy before the thread pointer, which the stack
 * protector's canary is read through, exists (musl builds its own memcpy the same way).
 */
#include <stddef.h>
#include <stdint.h>
#include <emmintrin.h>

typedef __m128i v128;
typedef uint64_t __attribute__((may_alias, aligned(1))) u64u;
typedef uint32_t __attribute__((may_alias, aligned(1))) u32u;
typedef uint16_t __attribute__((may_alias, aligned(1))) u16u;

static inline v128 ld(const unsigned char *p) { return _mm_loadu_si128((const v128 *)p); }
static inline void st(unsigned char *p, v128 x) { _mm_storeu_si128((v128 *)p, x); }

/* n <= 64: every load before any store, so any overlap is fine. */
static inline void copy_small(unsigned char *d, const unsigned char *s, size_t n)
{
    if (n >= 32) {
        v128 a = ld(s), b = ld(s + 16), c = ld(s + n - 32), e = ld(s + n - 16);
        st(d, a);
        st(d + 16, b);
        st(d + n - 32, c);
        st(d + n - 16, e);
    } else if (n >= 16) {
        v128 a = ld(s), b = ld(s + n - 16);
        st(d, a);
        st(d + n - 16, b);
    } else if (n >= 8) {
        uint64_t a = *(const u64u *)s, b = *(const u64u *)(s + n - 8);
        *(u64u *)d = a;
        *(u64u *)(d + n - 8) = b;
    } else if (n >= 4) {
        uint32_t a = *(const u32u *)s, b = *(const u32u *)(s + n - 4);
        *(u32u *)d = a;
        *(u32u *)(d + n - 4) = b;
    } else if (n >= 2) {
        uint16_t a = *(const u16u *)s, b = *(const u16u *)(s + n - 2);
        *(u16u *)d = a;
        *(u16u *)(d + n - 2) = b;
    } else if (n == 1) {
        *d = *s;
    }
}

void *bca_memmove(void *dest, const void *src, size_t n)
{
    unsigned char *d = dest;
    const unsigned char *s = src;
    if (n <= 64) {
        copy_small(d, s, n);
        return dest;
    }
    uintptr_t du = (uintptr_t)d, su = (uintptr_t)s;
    if (du - su >= n && su - du >= n) {
        /* No overlap: the first and last 16 bytes unaligned, the rest stored aligned. */
        v128 head = ld(s), tail = ld(s + n - 16);
        size_t i = 16 - (du & 15);
        while (i + 64 <= n - 16) {
            v128 a = ld(s + i), b = ld(s + i + 16), c = ld(s + i + 32), e = ld(s + i + 48);
            _mm_store_si128((v128 *)(d + i), a);
            _mm_store_si128((v128 *)(d + i + 16), b);
            _mm_store_si128((v128 *)(d + i + 32), c);
            _mm_store_si128((v128 *)(d + i + 48), e);
            i += 64;
        }
        while (i < n - 16) {
            _mm_store_si128((v128 *)(d + i), ld(s + i));
            i += 16;
        }
        st(d, head);
        st(d + n - 16, tail);
    } else if (du < su) {
        /* Overlap, destination first: forwards, each step read before it is written. */
        size_t i = 0;
        for (; i + 16 <= n; i += 16)
            st(d + i, ld(s + i));
        for (; i < n; i++)
            d[i] = s[i];
    } else if (du > su) {
        /* Overlap, source first: backwards. */
        size_t i = n;
        for (; i >= 16; i -= 16)
            st(d + i - 16, ld(s + i - 16));
        while (i > 0) {
            i--;
            d[i] = s[i];
        }
    }
    return dest;
}

void *bca_memcpy(void *restrict dest, const void *restrict src, size_t n)
{
    return bca_memmove(dest, src, n);
}

#ifdef BCA_LIBC_MEM
void *memcpy(void *restrict dest, const void *restrict src, size_t n)
{
    return bca_memmove(dest, src, n);
}

void *memmove(void *dest, const void *src, size_t n)
{
    return bca_memmove(dest, src, n);
}
#endif
