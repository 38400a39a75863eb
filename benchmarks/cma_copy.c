/* How fast one process can read another's memory with cross-memory attach (process_vm_readv),
 * against memcpy of the same pieces: the question behind reading peers' tensors in place.
 *
 *   cc -O2 benchmarks/cma_copy.c -o /tmp/cma_copy && /tmp/cma_copy 262144
 *
 * The parent fills 64 MiB; a forked child reads it piece by piece into one scratch piece (as a
 * reducer would), then into a whole buffer, and times memcpy of the same pieces; 3 repeats,
 * the first paying the page faults. GB/s are bytes read. */
#define _GNU_SOURCE
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int read_remote(pid_t pid, char *dst, const char *src, size_t n) {
    struct iovec local = {dst, n}, remote = {(void *)src, n};
    return process_vm_readv(pid, &local, 1, &remote, 1, 0) == (ssize_t)n ? 0 : -1;
}

int main(int argc, char **argv) {
    const size_t total = (size_t)64 << 20;
    const size_t piece = argc > 1 ? (size_t)atol(argv[1]) : 262144;
    if (piece == 0 || total % piece) {
        fprintf(stderr, "piece must divide 64 MiB\n");
        return 2;
    }
    char *src = malloc(total);
    if (!src)
        return 1;
    memset(src, 1, total);
    const pid_t parent = getpid();
    const pid_t child = fork();
    if (child < 0)
        return 1;
    if (child > 0) {
        int status = 0;
        waitpid(child, &status, 0);
        return WIFEXITED(status) ? WEXITSTATUS(status) : 1;
    }
    char *scratch = malloc(piece), *whole = malloc(total);
    if (!scratch || !whole)
        return 1;
    memset(whole, 2, total);
    for (int rep = 0; rep < 3; rep++) {
        double t = now();
        for (size_t off = 0; off < total; off += piece)
            if (read_remote(parent, scratch, src + off, piece)) {
                perror("process_vm_readv");
                return 1;
            }
        const double cma_piece = now() - t;
        t = now();
        for (size_t off = 0; off < total; off += piece)
            if (read_remote(parent, whole + off, src + off, piece))
                return 1;
        const double cma_whole = now() - t;
        t = now();
        for (size_t off = 0; off < total; off += piece)
            memcpy(scratch, whole + off, piece);
        const double copy_piece = now() - t;
        t = now();
        for (size_t off = 0; off + piece <= total / 2; off += piece)
            memcpy(whole + off, whole + total / 2 + off, piece);
        const double copy_whole = 2 * (now() - t);
        printf("piece %zu B: process_vm_readv %.1f GB/s into one piece, %.1f GB/s into a whole buffer; "
               "memcpy %.1f and %.1f GB/s\n", piece, total / cma_piece / 1e9, total / cma_whole / 1e9,
               total / copy_piece / 1e9, total / copy_whole / 1e9);
    }
    return 0;
}
