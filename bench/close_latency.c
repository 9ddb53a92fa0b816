/* How long tl_close takes while 8 threads keep calling tl_generate on the same model, retrying
 * on TL_ERR_BUSY until they get TL_ERR_CLOSED. Prints one line per round and the median and
 * maximum; see docs/RELIABILITY.md.
 *
 *   cc -std=c11 -O2 -pthread -Iinclude bench/close_latency.c -Ltarget/release -ltinyloop \
 *      -Wl,-rpath,$PWD/target/release -o close_latency
 *   ./close_latency tiny.tinyloop [ROUNDS]
 */
#define _DEFAULT_SOURCE
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "tinyloop.h"

#define THREADS 8
#define MAX_ROUNDS 100

static tl_model *model;
static volatile int closing;
static long calls_after_close_began[THREADS];

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *retry_until_closed(void *arg) {
    long id = (long)arg;
    static const int32_t prompt[] = {82, 79, 77, 69, 79, 58};
    int32_t out[32];
    size_t len;
    tl_generate_params gp;
    tl_generate_default_params(&gp);
    gp.max_tokens = 32;
    for (;;) {
        int after = closing;
        tl_status status = tl_generate(model, prompt, 6, &gp, out, 32, &len);
        if (after) calls_after_close_began[id]++;
        if (status == TL_ERR_CLOSED) return NULL;
    }
}

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.tinyloop [ROUNDS]\n", argv[0]);
        return 2;
    }
    int rounds = argc > 2 ? atoi(argv[2]) : 10;
    if (rounds < 1 || rounds > MAX_ROUNDS) rounds = 10;
    double ms[MAX_ROUNDS];
    for (int r = 0; r < rounds; r++) {
        tl_model_params mp;
        tl_model_default_params(&mp);
        mp.device = "cpu";
        mp.max_seq_len = 128;
        mp.log = false;
        if (tl_model_open(argv[1], &mp, &model) != TL_OK) {
            fprintf(stderr, "%s\n", tl_last_error_message());
            return 1;
        }
        closing = 0;
        pthread_t threads[THREADS];
        for (long i = 0; i < THREADS; i++) {
            calls_after_close_began[i] = 0;
            pthread_create(&threads[i], NULL, retry_until_closed, (void *)i);
        }
        usleep(200000); /* let every thread get into its loop */
        closing = 1;
        double start = now();
        tl_status status = tl_close(model);
        ms[r] = (now() - start) * 1e3;
        long calls = 0;
        for (int i = 0; i < THREADS; i++) {
            pthread_join(threads[i], NULL);
            calls += calls_after_close_began[i];
        }
        printf("round %d: tl_close %s in %.3f ms; %ld calls started after close began\n", r,
               tl_status_string(status), ms[r], calls);
    }
    qsort(ms, rounds, sizeof ms[0], by_value);
    printf("tl_close with %d threads retrying: median %.3f ms, max %.3f ms (%d rounds)\n", THREADS,
           ms[rounds / 2], ms[rounds - 1], rounds);
    return 0;
}
