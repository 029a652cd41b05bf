/*
 * What Mooncake's transfer_engine_bench moved, checked from inside it: benches/transfer_local.rs
 * preloads this library (LD_PRELOAD) into Mooncake's target and initiators, since the bench
 * itself checks no bytes and its buffers live in other processes' GPU memory.
 *
 * The one allocation of GPUDIRECT_MC_BYTES bytes (the bench's --buffer_size) a process makes
 * with cudaMalloc is taken over: in an initiator (GPUDIRECT_MC_ROLE=initiator) the 8-byte word
 * at offset o holds o ^ SALT, in the target zeros, whatever the bench memsets into it. Mooncake's
 * bench writes block k of a batch from the same offset on both sides, so a target word holding
 * its own offset's pattern was written from the right place. When the target frees its buffer
 * (it does on SIGTERM), it prints one line to stderr:
 *
 *   MC-CHECK bytes=B patterned=P first_other=F zero=Z other=X
 *
 * P bytes hold their offset's pattern, F is the offset of the first word that does not (B when
 * every word does), Z bytes are still zero and X bytes hold anything else. After writes that
 * covered [0, S), exactly: P = F = S, X = 0.
 *
 * Build: cc -O2 -shared -fPIC -o mooncake_check.so mooncake_check.c -ldl
 * (benches/baselines/mooncake.sh does). It declares the few CUDA runtime calls it uses itself:
 * no CUDA headers needed.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int cudaError_t;
typedef void *cudaStream_t;
enum { HOST_TO_DEVICE = 1, DEVICE_TO_HOST = 2 };

#define SALT 0x9E3779B97F4A7C15ull
#define CHUNK ((size_t)64 << 20)

static char *buf;
static size_t buf_len;
static int counted;

static void *real(const char *name) {
    void *f = dlsym(RTLD_NEXT, name);
    if (!f) {
        fprintf(stderr, "MC-CHECK error: no %s to forward to\n", name);
        abort();
    }
    return f;
}

static int is_initiator(void) {
    const char *r = getenv("GPUDIRECT_MC_ROLE");
    return r && strcmp(r, "initiator") == 0;
}

/* The pattern (initiator) or zeros (target) over the whole buffer, synchronously. */
static cudaError_t fill(void) {
    cudaError_t (*copy)(void *, const void *, size_t, int) = real("cudaMemcpy");
    cudaError_t (*set)(void *, int, size_t) = real("cudaMemset");
    if (!is_initiator())
        return set(buf, 0, buf_len);
    uint64_t *h = malloc(CHUNK);
    if (!h)
        return 2; /* cudaErrorMemoryAllocation */
    cudaError_t rc = 0;
    for (size_t at = 0; at < buf_len && rc == 0; at += CHUNK) {
        size_t n = buf_len - at < CHUNK ? buf_len - at : CHUNK;
        for (size_t i = 0; i < n / 8; i++)
            h[i] = (uint64_t)(at + 8 * i) ^ SALT;
        rc = copy(buf + at, h, n, HOST_TO_DEVICE);
    }
    free(h);
    return rc;
}

static void count(void) {
    cudaError_t (*copy)(void *, const void *, size_t, int) = real("cudaMemcpy");
    counted = 1;
    uint64_t *h = malloc(CHUNK);
    if (!h) {
        fprintf(stderr, "MC-CHECK error: no host memory to read the target back\n");
        return;
    }
    size_t patterned = 0, zero = 0, other = 0, first_other = buf_len;
    for (size_t at = 0; at < buf_len; at += CHUNK) {
        size_t n = buf_len - at < CHUNK ? buf_len - at : CHUNK;
        cudaError_t rc = copy(h, buf + at, n, DEVICE_TO_HOST);
        if (rc != 0) {
            fprintf(stderr, "MC-CHECK error: cudaMemcpy back failed (%d)\n", rc);
            free(h);
            return;
        }
        for (size_t i = 0; i < n / 8; i++) {
            uint64_t o = (uint64_t)(at + 8 * i);
            if (h[i] == (o ^ SALT)) {
                patterned += 8;
                continue;
            }
            if (first_other == buf_len)
                first_other = o;
            if (h[i] == 0)
                zero += 8;
            else
                other += 8;
        }
    }
    free(h);
    fprintf(stderr, "MC-CHECK bytes=%zu patterned=%zu first_other=%zu zero=%zu other=%zu\n",
            buf_len, patterned, first_other, zero, other);
    fflush(stderr);
}

static int inside(const void *p) {
    return buf && (const char *)p >= buf && (const char *)p < buf + buf_len;
}

cudaError_t cudaMalloc(void **p, size_t n) {
    cudaError_t (*f)(void **, size_t) = real("cudaMalloc");
    cudaError_t rc = f(p, n);
    const char *want = getenv("GPUDIRECT_MC_BYTES");
    if (rc == 0 && !buf && want && n == strtoull(want, NULL, 10) && n % 8 == 0) {
        buf = *p;
        buf_len = n;
        rc = fill();
    }
    return rc;
}

cudaError_t cudaMemset(void *p, int v, size_t n) {
    if (inside(p))
        return fill();
    cudaError_t (*f)(void *, int, size_t) = real("cudaMemset");
    return f(p, v, n);
}

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s) {
    if (inside(p))
        return fill();
    cudaError_t (*f)(void *, int, size_t, cudaStream_t) = real("cudaMemsetAsync");
    return f(p, v, n, s);
}

cudaError_t cudaFree(void *p) {
    if (p && p == buf) {
        if (!is_initiator() && !counted)
            count();
        buf = NULL;
    }
    cudaError_t (*f)(void *) = real("cudaFree");
    return f(p);
}

/* A target that exits without freeing its buffer: read it back while the runtime may still
 * be up (an error line otherwise). */
__attribute__((destructor)) static void at_exit(void) {
    if (buf && !is_initiator() && !counted)
        count();
}
