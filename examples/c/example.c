/* A small C program using libtinyloop: open a model, inspect it, generate (whole and streamed),
 * score, use a second session, and release everything.
 *
 *   cc -std=c11 examples/c/example.c $(pkg-config --cflags --libs tinyloop) -o example
 *   ./example models/demo.tinyloop ["prompt"]
 *
 * (after scripts/install, see the README), or against the build tree of `cargo build --release`:
 *
 *   cc -std=c11 -Iinclude examples/c/example.c -Ltarget/release -ltinyloop \
 *       -Wl,-rpath,"$PWD/target/release" -o example
 *
 * Exit status 0 on success; every failure prints the status name and tl_last_error_message().
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tinyloop.h"

static int check(tl_status status, const char *what) {
    if (status != TL_OK) {
        fprintf(stderr, "%s failed: %s: %s\n", what, tl_status_string(status),
                tl_last_error_message());
        return 1;
    }
    return 0;
}

/* Stream callback: print each token (a byte for byte-vocabulary models) as it arrives. */
static bool print_token(int32_t token, void *user_data) {
    size_t *count = (size_t *)user_data;
    *count += 1;
    printf("%d ", token);
    return true;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.tinyloop [PROMPT]\n", argv[0]);
        return 2;
    }
    const char *text = argc > 2 ? argv[2] : "ROMEO:";
    if (tl_abi_version() != TL_ABI_VERSION) {
        fprintf(stderr, "ABI mismatch: library %u, header %u\n", tl_abi_version(), TL_ABI_VERSION);
        return 1;
    }

    tl_model_params mp;
    if (check(tl_model_default_params(&mp), "tl_model_default_params")) return 1;
    mp.max_seq_len = 256;
    mp.device = "cpu";
    mp.log = false;
    tl_model *model = NULL;
    if (check(tl_model_open(argv[1], &mp, &model), "tl_model_open")) return 1;

    int rc = 1;
    tl_session *session = NULL;
    int32_t *prompt = NULL;
    float *logits = NULL;
    int32_t out[32];
    int32_t again[32];
    size_t n_out = 0, n_again = 0, n_logits = 0, n_streamed = 0, n_dev = 0;
    char device[128];

    tl_config cfg;
    cfg.struct_size = sizeof cfg;
    if (check(tl_model_config(model, &cfg), "tl_model_config")) goto done;
    if (check(tl_model_device(model, device, sizeof device, &n_dev), "tl_model_device")) goto done;
    printf("model: dim %u, heads %u, ffn %u, vocab %u, pre %u, loop %u, default_loops %u, %s, on %s\n",
           cfg.dim, cfg.n_heads, cfg.ffn_dim, cfg.vocab_size, cfg.n_pre_blocks, cfg.n_loop_blocks,
           cfg.default_loops, cfg.norm, device);

    size_t n_prompt = strlen(text);
    prompt = malloc(n_prompt * sizeof *prompt);
    if (!prompt) goto done;
    for (size_t i = 0; i < n_prompt; i++) prompt[i] = (int32_t)(unsigned char)text[i] % (int32_t)cfg.vocab_size;

    tl_generate_params gp;
    if (check(tl_generate_default_params(&gp), "tl_generate_default_params")) goto done;
    gp.max_tokens = 16;
    if (check(tl_generate(model, prompt, n_prompt, &gp, out, 32, &n_out), "tl_generate")) goto done;
    printf("generate (greedy, %zu tokens):", n_out);
    for (size_t i = 0; i < n_out; i++) printf(" %d", out[i]);
    printf("\n");

    printf("stream: ");
    if (check(tl_generate_stream(model, prompt, n_prompt, &gp, print_token, &n_streamed),
              "tl_generate_stream")) goto done;
    printf("(%zu tokens)\n", n_streamed);

    /* A size query: NULL buffer, capacity 0 -> TL_ERR_BUFFER_TOO_SMALL with the length needed. */
    if (tl_score_last(model, prompt, n_prompt, TL_LOOPS_DEFAULT, NULL, 0, &n_logits) !=
        TL_ERR_BUFFER_TOO_SMALL) {
        fprintf(stderr, "size query did not report TL_ERR_BUFFER_TOO_SMALL\n");
        goto done;
    }
    logits = malloc(n_logits * sizeof *logits);
    if (!logits) goto done;
    if (check(tl_score_last(model, prompt, n_prompt, 2, logits, n_logits, &n_logits), "tl_score_last"))
        goto done;
    size_t best = 0;
    for (size_t i = 1; i < n_logits; i++) if (logits[i] > logits[best]) best = i;
    printf("score_last (loops 2): %zu logits, argmax %zu\n", n_logits, best);

    /* A second session over the same weights gives the same greedy tokens. */
    if (check(tl_session_new(model, &session), "tl_session_new")) goto done;
    if (check(tl_session_generate(session, prompt, n_prompt, &gp, again, 32, &n_again),
              "tl_session_generate")) goto done;
    if (n_again != n_out || memcmp(again, out, n_out * sizeof *out) != 0) {
        fprintf(stderr, "session output differs from the model's default session\n");
        goto done;
    }

    double mb = 0;
    if (check(tl_vram_usage_mb(model, &mb), "tl_vram_usage_mb")) goto done;
    printf("memory: %.3f MB\n", mb);
    printf("ok\n");
    rc = 0;

done:
    free(prompt);
    free(logits);
    tl_session_free(session);
    /* Releases everything tl_model_open allocated; the handle is dead afterwards. */
    if (tl_close(model) != TL_OK) rc = 1;
    return rc;
}
