/* A model of the compiled core's one-shot handoff, to choose how a waiting rank gives up its core:
 * L processes each do `work` µs of busy work per op (a call's Python and copy), publish their flag,
 * then wait for every flag as hfr_wait_one does (spin, yield, futex), with or without the crowded
 * rule (a yield that took over 1 ms, the flag still short, makes the process's waits sleep at once
 * for 100 ms).
 *
 *   cc -O2 benchmarks/wait_model.c -o /tmp/wait_model
 *   /tmp/wait_model 4 5 20000 64 16 1     # L, work µs, ops, spins, yields, crowded rule (0/1)
 *
 * Run it quiet and beside busy processes (python3 -c "while True: pass" twice). It prints
 * process 0's time per op: median, 90th and 99th percentiles, mean. */
#define _GNU_SOURCE
#include <limits.h>
#include <linux/futex.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int spins, yields, crowded_rule;
static int64_t crowded_until;

static void wait_flag(volatile int *w, int target) {
    for (int i = 0; i < spins; i++) {
        if (__atomic_load_n(w, __ATOMIC_ACQUIRE) >= target)
            return;
        __builtin_ia32_pause();
    }
    for (int y = 0;;) {
        int v = __atomic_load_n(w, __ATOMIC_ACQUIRE);
        if (v >= target)
            return;
        int64_t t = now();
        if (y < yields && !(crowded_rule && t < crowded_until)) {
            y++;
            sched_yield();
            if (crowded_rule && now() - t > 1000000 && __atomic_load_n(w, __ATOMIC_ACQUIRE) < target)
                crowded_until = now() + 100000000LL;
            continue;
        }
        struct timespec slice = {0, 50000000};
        syscall(SYS_futex, w, FUTEX_WAIT, v, &slice, NULL, 0);
    }
}

static int cmp(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

int main(int argc, char **argv) {
    if (argc != 7) {
        fprintf(stderr, "usage: %s L work_us ops spins yields crowded_rule\n", argv[0]);
        return 2;
    }
    int L = atoi(argv[1]), ops = atoi(argv[3]);
    int64_t work = atoll(argv[2]) * 1000;
    spins = atoi(argv[4]), yields = atoi(argv[5]), crowded_rule = atoi(argv[6]);
    if (L < 1 || L > 64 || ops < 1 || work < 0) {
        fprintf(stderr, "L must be 1..64, ops positive, work non-negative\n");
        return 2;
    }
    volatile int *flags = mmap(NULL, 64 * L, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    int64_t *times = mmap(NULL, 8 * ops, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    for (int r = 0; r < L; r++) {
        if (fork() == 0) {
            int64_t prev = now();
            for (int i = 1; i <= ops; i++) {
                for (int64_t end = now() + work; now() < end;)
                    ;
                volatile int *mine = flags + 16 * r;
                __atomic_store_n(mine, i, __ATOMIC_RELEASE);
                syscall(SYS_futex, mine, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
                for (int k = 0; k < L; k++)
                    wait_flag(flags + 16 * k, i);
                int64_t t = now();
                if (r == 0)
                    times[i - 1] = t - prev;
                prev = t;
            }
            _exit(0);
        }
    }
    for (int r = 0; r < L; r++)
        wait(NULL);
    qsort(times, ops, 8, cmp);
    double sum = 0;
    for (int i = 0; i < ops; i++)
        sum += times[i];
    printf("L=%d work=%lld us spins=%d yields=%d crowded rule=%d: median %.1f p90 %.1f p99 %.1f mean %.1f us\n", L,
           (long long)(work / 1000), spins, yields, crowded_rule, times[ops / 2] / 1e3, times[ops * 9 / 10] / 1e3,
           times[ops * 99 / 100] / 1e3, sum / ops / 1e3);
    return 0;
}
