/* The copies shared by the compiled pieces (transports/_ring.c,
   pycoll/_step.c, pycoll/_replay.c).

   copy_bytes(dst, src, n): memcpy, but back to front without REP MOVSB where
   dst starts 1-63 bytes after src modulo the 4 KiB page.

   vm_move(pid, local, remote, n, write): n bytes between address local of
   this process and address remote of process pid, by process_vm_readv (write
   0) or process_vm_writev, repeated until all moved; where the destination
   starts 1-63 bytes after the source modulo the page (1-31 on AMD), through
   a buffer of this thread that lies as the remote range does.  Returns 0, or the errno
   of the call that failed (EFAULT where one moved nothing).  It takes no
   Python object, so callers run it without the GIL.

   Why: REP MOVSB, which glibc's memcpy uses from about 2 KiB up (to its
   non-temporal threshold) and the kernel's cross-memory copy at any length
   on CPUs with fast string moves, runs many times slower where the
   destination starts a short distance after the source modulo the page.  On
   the 2-core AMD EPYC machine, 16 bytes on: memcpy of 64 KiB 22.4 us against
   1.7 (this copy_bytes: 1.9), process_vm_readv of 1 MiB 391 against 52
   (vm_move: 79) (benchmarks/skewed_copies.py; benchmarks/RESULTS.md,
   "Copies a short distance apart modulo the page"). */
#ifndef PYCOLL_COPIES_H
#define PYCOLL_COPIES_H

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

/* A cross-memory copy so skewed of at least this many bytes goes through the
   thread's buffer, in parts of at most VM_BOUNCE (on the machine above, 1 MiB
   16 bytes on took 87 us in 64 KiB parts, 76-81 in 128 KiB to 1 MiB ones;
   16 MiB 2069, 1842, 1700 and 1621 in 64, 128, 256 and 1024 KiB ones). */
#define VM_BOUNCE_MIN 4096
#define VM_BOUNCE (256 << 10)

/* How far dst starts after src modulo the page: skewed from 1 to 63 bytes,
   for the kernel's copy on AMD from 1 to 31 (there, from 32 to 63, 1 MiB took
   the kernel 59-63 us against 52 aligned and the detour 78; on the Xeon 146
   against 42, and the detour would save it). */
static inline size_t
skew(const void *dst, const void *src)
{
    return ((uintptr_t)dst - (uintptr_t)src) & 4095;
}

/* What the copies ask of the CPU, once: bit 0 AVX2, bit 1 an AMD CPU. */
static int
cpu_bits(void)
{
#if defined(__x86_64__)
    static int known = -1;
    int b = __atomic_load_n(&known, __ATOMIC_RELAXED);
    if (b < 0) {
        __builtin_cpu_init();
        b = (__builtin_cpu_supports("avx2") != 0) | (__builtin_cpu_is("amd") != 0) << 1;
        __atomic_store_n(&known, b, __ATOMIC_RELAXED);
    }
    return b;
#else
    return 0;
#endif
}

#if defined(__x86_64__)
#include <immintrin.h>
/* Back to front, the stores aligned: no load then follows a store to the same
   address modulo the page, the stall that slows REP MOVSB and glibc's forward
   loops alike.  Which width stays fast depends on where in its line the skew
   puts the loads: on the Xeon that ran the GPU tests 16-byte stores stalled
   where the skew is 16-31 modulo 64 (64 KiB: 4.3 us against 1.7), 32-byte
   ones where it is 32-63 (2.4); the AMD EPYC took either at 1.2-1.8 us
   (benchmarks/skewed_copies.py). */
static void
copy_back16(char *dst, const char *src, size_t n)
{
    size_t i = n - (((uintptr_t)(dst + n)) & 15);
    memcpy(dst + i, src + i, n - i);
    while (i >= 64) {
        i -= 64;
        __m128i a = _mm_loadu_si128((const __m128i *)(src + i + 48));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 32));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 16));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + i));
        _mm_store_si128((__m128i *)(dst + i + 48), a);
        _mm_store_si128((__m128i *)(dst + i + 32), b);
        _mm_store_si128((__m128i *)(dst + i + 16), c);
        _mm_store_si128((__m128i *)(dst + i), d);
    }
    memcpy(dst, src, i);
}

__attribute__((target("avx2"))) static void
copy_back32(char *dst, const char *src, size_t n)
{
    size_t i = n - (((uintptr_t)(dst + n)) & 31);
    memcpy(dst + i, src + i, n - i);
    while (i >= 128) {
        i -= 128;
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i + 96));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 64));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + i));
        _mm256_store_si256((__m256i *)(dst + i + 96), a);
        _mm256_store_si256((__m256i *)(dst + i + 64), b);
        _mm256_store_si256((__m256i *)(dst + i + 32), c);
        _mm256_store_si256((__m256i *)(dst + i), d);
    }
    memcpy(dst, src, i);
}

static void
copy_skewed(char *dst, const char *src, size_t n)
{
    if ((cpu_bits() & 1) && (skew(dst, src) & 63) < 32)
        copy_back32(dst, src, n);
    else
        copy_back16(dst, src, n);
}
#else
/* In pieces too short for REP MOVSB (glibc takes it from 2112 bytes up). */
static void
copy_skewed(char *dst, const char *src, size_t n)
{
    for (size_t i = 0; i < n; i += 2048)
        memcpy(dst + i, src + i, n - i < 2048 ? n - i : 2048);
}
#endif

/* From this many bytes glibc's memcpy leaves REP MOVSB for loops that store
   past the caches, and runs as fast skewed as not (16 MiB on the Xeon: 2.4-2.8
   ms, the loops above 3.0-3.8). */
#define COPY_SKEW_MAX (4 << 20)

static inline void
copy_bytes(void *dst, const void *src, size_t n)
{
    if (n < 256 || n >= COPY_SKEW_MAX || skew(dst, src) - 1 >= 63) /* 0 wraps */
        memcpy(dst, src, n);
    else
        copy_skewed((char *)dst, (const char *)src, n);
}

static inline int
vm_direct(pid_t pid, char *local, uint64_t remote, size_t n, int write)
{
    size_t done = 0;
    while (done < n) {
        struct iovec l = {local + done, n - done};
        struct iovec r = {(void *)(uintptr_t)(remote + done), n - done};
        ssize_t got = write ? process_vm_writev(pid, &l, 1, &r, 1, 0)
                            : process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (got <= 0)
            return got < 0 && errno ? errno : EFAULT;
        done += (size_t)got;
    }
    return 0;
}

/* The thread's buffer (VM_BOUNCE + a page, freed when the thread exits), or
   NULL where it cannot be had: the copy then goes direct. */
static pthread_key_t vm_key;
static int vm_key_made;
static pthread_once_t vm_once = PTHREAD_ONCE_INIT;

static void
vm_make_key(void)
{
    vm_key_made = pthread_key_create(&vm_key, free) == 0;
}

static char *
vm_bounce(void)
{
    pthread_once(&vm_once, vm_make_key);
    if (!vm_key_made)
        return NULL;
    void *b = pthread_getspecific(vm_key);
    if (b == NULL) {
        if (posix_memalign(&b, 4096, VM_BOUNCE + 4096))
            return NULL;
        if (pthread_setspecific(vm_key, b)) {
            free(b);
            return NULL;
        }
    }
    return (char *)b;
}

static inline int
vm_move(pid_t pid, char *local, uint64_t remote, size_t n, int write)
{
    const void *src = write ? (const void *)local : (const void *)(uintptr_t)remote;
    const void *dst = write ? (const void *)(uintptr_t)remote : (const void *)local;
    char *b;
    if (n < VM_BOUNCE_MIN || skew(dst, src) - 1 >= (cpu_bits() & 2 ? 31u : 63u) ||
        (b = vm_bounce()) == NULL)
        return vm_direct(pid, local, remote, n, write);
    b += remote & 4095; /* the kernel copies between ranges aligned alike */
    for (size_t at = 0; at < n; at += VM_BOUNCE) {
        size_t k = n - at < VM_BOUNCE ? n - at : VM_BOUNCE;
        if (write)
            copy_bytes(b, local + at, k);
        int e = vm_direct(pid, b, remote + at, k, write);
        if (e)
            return e;
        if (!write)
            copy_bytes(local + at, b, k);
    }
    return 0;
}

#endif
