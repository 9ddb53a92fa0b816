/* The seed surface's lifecycle: a program that calls only tl_model_open, tl_generate,
 * tl_generate_stream, tl_score_last, tl_vram_usage_mb, tl_model_config and tl_close (never
 * tl_model_free), with NULL params (the defaults), opening and closing the model several times.
 * Run under valgrind / AddressSanitizer by scripts/test-bindings.sh: tl_close must release
 * everything tl_model_open allocated (0 bytes definitely lost), and calls on the closed handle
 * must be answered TL_ERR_CLOSED without touching freed memory (0 errors).
 *
 *   cc -std=c11 -Iinclude tests/c/seed_lifecycle.c -Ltarget/release -ltinyloop -o seed_lifecycle
 *   ./seed_lifecycle tiny.tinyloop
 */
#include <stdio.h>
#include <string.h>

#include "tinyloop.h"

#define CYCLES 3

static int fail(const char *what, tl_status status) {
    fprintf(stderr, "seed_lifecycle: %s: %s (%s)\n", what, tl_status_string(status), tl_last_error_message());
    return 1;
}

static bool count_token(int32_t token, void *user_data) {
    (void)token;
    (*(int *)user_data)++;
    return true;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.tinyloop\n", argv[0]);
        return 2;
    }
    static const int32_t prompt[] = {82, 79, 77, 69, 79, 58}; /* "ROMEO:" */
    const size_t n_prompt = sizeof prompt / sizeof prompt[0];
    int32_t first[128];
    size_t first_len = 0;
    for (int cycle = 0; cycle < CYCLES; cycle++) {
        tl_model *m = NULL;
        tl_status st = tl_model_open(argv[1], NULL, &m);
        if (st != TL_OK) return fail("tl_model_open", st);

        tl_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.struct_size = sizeof cfg;
        if ((st = tl_model_config(m, &cfg)) != TL_OK) return fail("tl_model_config", st);
        float logits[4096];
        if (cfg.vocab_size > sizeof logits / sizeof logits[0]) {
            fprintf(stderr, "seed_lifecycle: vocab %u too large for this test\n", cfg.vocab_size);
            return 1;
        }

        int32_t out[128]; /* the default max_tokens */
        size_t len = 0;
        if ((st = tl_generate(m, prompt, n_prompt, NULL, out, 128, &len)) != TL_OK) return fail("tl_generate", st);
        if (cycle == 0) {
            memcpy(first, out, len * sizeof *out);
            first_len = len;
        } else if (len != first_len || memcmp(out, first, len * sizeof *out) != 0) {
            fprintf(stderr, "seed_lifecycle: greedy output differs between cycles\n");
            return 1;
        }
        int streamed = 0;
        if ((st = tl_generate_stream(m, prompt, n_prompt, NULL, count_token, &streamed)) != TL_OK)
            return fail("tl_generate_stream", st);
        if ((st = tl_score_last(m, prompt, n_prompt, TL_LOOPS_DEFAULT, logits, cfg.vocab_size, &len)) != TL_OK)
            return fail("tl_score_last", st);
        double mb = 0;
        if ((st = tl_vram_usage_mb(m, &mb)) != TL_OK) return fail("tl_vram_usage_mb", st);

        if ((st = tl_close(m)) != TL_OK) return fail("tl_close", st);
        /* The closed handle is looked up, not dereferenced. */
        if ((st = tl_vram_usage_mb(m, &mb)) != TL_ERR_CLOSED) return fail("tl_vram_usage_mb after close", st);
        if ((st = tl_generate(m, prompt, n_prompt, NULL, out, 128, &len)) != TL_ERR_CLOSED)
            return fail("tl_generate after close", st);
        if ((st = tl_close(m)) != TL_OK) return fail("tl_close again", st);
        printf("cycle %d: %zu + %d tokens, %u logits, %.3f MB, closed\n", cycle, first_len, streamed,
               cfg.vocab_size, mb);
    }
    printf("seed_lifecycle: ok\n");
    return 0;
}
