/* C ABI test: drives every row of the bad-input table in docs/ABI.md, the buffer / ownership
 * conventions (close and free of closed handles, values that are not handles), concurrency
 * (BUSY, cancellation, close while running and refusing new calls) and the two-thread session
 * test (concurrent results equal sequential ones).
 *
 *   cc -std=c11 -pthread -Iinclude tests/c/abi_test.c -Ltarget/release -ltinyloop -lm -o abi_test
 *   ./abi_test tiny.tinyloop [tiny-text.tinyloop]
 *
 * The model must have a byte vocabulary (vocab_size 256), e.g. `tinyloop synth --preset tiny`.
 * The text calls need a model that carries the tokenizer fixture: the second argument, else
 * TINYLOOP_TEST_TEXT_MODEL (`tinyloop synth --preset tiny --tokenizer tests/data/tokenizer`).
 * Prints one line per check and "abi_test: N passed, M failed"; exit status 1 on any failure.
 */
#include <math.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tinyloop.h"

static int passed = 0, failed = 0;

/* Check that `call` returned `want`; on failure print the message of the last error. */
#define EXPECT(call, want, label)                                                               \
    do {                                                                                        \
        tl_status got_ = (call);                                                                \
        if (got_ == (want)) {                                                                   \
            passed++;                                                                           \
            printf("ok   %-58s %s\n", label, tl_status_string(got_));                           \
        } else {                                                                                \
            failed++;                                                                           \
            printf("FAIL %-58s got %s, want %s (%s)\n", label, tl_status_string(got_),          \
                   tl_status_string(want), tl_last_error_message());                            \
        }                                                                                       \
    } while (0)

#define CHECK(cond, label)                                                                      \
    do {                                                                                        \
        if (cond) {                                                                             \
            passed++;                                                                           \
            printf("ok   %s\n", label);                                                         \
        } else {                                                                                \
            failed++;                                                                           \
            printf("FAIL %s (line %d)\n", label, __LINE__);                                     \
        }                                                                                       \
    } while (0)

static const char *model_path;
static const char *text_model_path;
static const int32_t PROMPT[] = {82, 79, 77, 69, 79, 58}; /* "ROMEO:" */
#define N_PROMPT (sizeof PROMPT / sizeof PROMPT[0])

static tl_model *open_path(const char *path, uint32_t max_seq_len) {
    tl_model_params mp;
    tl_model_default_params(&mp);
    mp.max_seq_len = max_seq_len;
    mp.device = "cpu";
    mp.log = false;
    tl_model *m = NULL;
    if (tl_model_open(path, &mp, &m) != TL_OK) {
        fprintf(stderr, "cannot open %s: %s\n", path, tl_last_error_message());
        exit(2);
    }
    return m;
}

static tl_model *open_model(uint32_t max_seq_len) { return open_path(model_path, max_seq_len); }

static tl_generate_params gen_params(uint32_t max_tokens) {
    tl_generate_params gp;
    tl_generate_default_params(&gp);
    gp.max_tokens = max_tokens;
    return gp;
}

static bool keep_going(int32_t token, void *user_data) {
    (void)token;
    (void)user_data;
    return true;
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: NULL for every pointer argument.                                                    */

static void test_null_arguments(tl_model *m) {
    tl_session *s = NULL;
    EXPECT(tl_session_new(m, &s), TL_OK, "setup: tl_session_new");
    tl_generate_params gp = gen_params(4);
    int32_t out[8];
    float logits[512];
    size_t len = 0;
    double mb = 0;
    tl_config cfg;
    cfg.struct_size = sizeof cfg;
    char dev[64];
    tl_model *never = NULL;

    EXPECT(tl_model_default_params(NULL), TL_ERR_INVALID_ARGUMENT, "tl_model_default_params(NULL)");
    EXPECT(tl_generate_default_params(NULL), TL_ERR_INVALID_ARGUMENT, "tl_generate_default_params(NULL)");
    EXPECT(tl_model_open(NULL, NULL, &never), TL_ERR_INVALID_ARGUMENT, "tl_model_open path NULL");
    EXPECT(tl_model_open(model_path, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "tl_model_open out_model NULL");
    CHECK(never == NULL, "tl_model_open leaves *out_model unwritten on failure");
    EXPECT(tl_model_config(NULL, &cfg), TL_ERR_INVALID_ARGUMENT, "tl_model_config model NULL");
    EXPECT(tl_model_config(m, NULL), TL_ERR_INVALID_ARGUMENT, "tl_model_config config NULL");
    EXPECT(tl_vram_usage_mb(NULL, &mb), TL_ERR_INVALID_ARGUMENT, "tl_vram_usage_mb model NULL");
    EXPECT(tl_vram_usage_mb(m, NULL), TL_ERR_INVALID_ARGUMENT, "tl_vram_usage_mb out_mb NULL");
    EXPECT(tl_model_device(NULL, dev, sizeof dev, &len), TL_ERR_INVALID_ARGUMENT, "tl_model_device model NULL");
    EXPECT(tl_model_device(m, dev, sizeof dev, NULL), TL_ERR_INVALID_ARGUMENT, "tl_model_device len NULL");
    EXPECT(tl_model_device(m, NULL, sizeof dev, &len), TL_ERR_INVALID_ARGUMENT, "tl_model_device out NULL, cap > 0");
    EXPECT(tl_cancel(NULL), TL_ERR_INVALID_ARGUMENT, "tl_cancel(NULL)");
    EXPECT(tl_session_cancel(NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_cancel(NULL)");
    EXPECT(tl_session_new(NULL, &s), TL_ERR_INVALID_ARGUMENT, "tl_session_new model NULL");
    EXPECT(tl_session_new(m, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_new out_session NULL");

    EXPECT(tl_generate(NULL, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_generate model NULL");
    EXPECT(tl_generate(m, NULL, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_generate tokens NULL");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, NULL, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_generate out NULL, cap > 0");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, NULL), TL_ERR_INVALID_ARGUMENT, "tl_generate len NULL");
    EXPECT(tl_generate_stream(NULL, PROMPT, N_PROMPT, &gp, keep_going, NULL), TL_ERR_INVALID_ARGUMENT, "tl_generate_stream model NULL");
    EXPECT(tl_generate_stream(m, NULL, N_PROMPT, &gp, keep_going, NULL), TL_ERR_INVALID_ARGUMENT, "tl_generate_stream tokens NULL");
    EXPECT(tl_generate_stream(m, PROMPT, N_PROMPT, &gp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "tl_generate_stream callback NULL");
    EXPECT(tl_score_last(NULL, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last model NULL");
    EXPECT(tl_score_last(m, NULL, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last tokens NULL");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last out NULL, cap > 0");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_score_last len NULL");

    EXPECT(tl_score(NULL, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score model NULL");
    EXPECT(tl_score(m, NULL, 1, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score tokens NULL");
    EXPECT(tl_score(m, PROMPT, 1, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score out NULL");
    EXPECT(tl_score(m, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_score len NULL");
    EXPECT(tl_logprobs(NULL, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_logprobs model NULL");
    EXPECT(tl_logprobs(m, NULL, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_logprobs tokens NULL");
    EXPECT(tl_logprobs(m, PROMPT, 2, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_logprobs out NULL");
    EXPECT(tl_logprobs(m, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_logprobs len NULL");
    EXPECT(tl_logprobs_decode(NULL, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_logprobs_decode model NULL");
    EXPECT(tl_logprobs_decode(m, NULL, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_logprobs_decode tokens NULL");
    EXPECT(tl_logprobs_decode(m, PROMPT, 2, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_logprobs_decode out NULL");
    EXPECT(tl_logprobs_decode(m, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_logprobs_decode len NULL");

    EXPECT(tl_session_generate(NULL, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_generate session NULL");
    EXPECT(tl_session_generate(s, NULL, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_generate tokens NULL");
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, NULL, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_generate out NULL");
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 8, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_generate len NULL");
    EXPECT(tl_session_generate_stream(NULL, PROMPT, N_PROMPT, &gp, keep_going, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_generate_stream session NULL");
    EXPECT(tl_session_generate_stream(s, NULL, N_PROMPT, &gp, keep_going, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_generate_stream tokens NULL");
    EXPECT(tl_session_generate_stream(s, PROMPT, N_PROMPT, &gp, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_generate_stream callback NULL");
    EXPECT(tl_session_score_last(NULL, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score_last session NULL");
    EXPECT(tl_session_score_last(s, NULL, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score_last tokens NULL");
    EXPECT(tl_session_score_last(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score_last out NULL");
    EXPECT(tl_session_score_last(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_score_last len NULL");
    EXPECT(tl_session_score(NULL, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score session NULL");
    EXPECT(tl_session_score(s, NULL, 1, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score tokens NULL");
    EXPECT(tl_session_score(s, PROMPT, 1, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score out NULL");
    EXPECT(tl_session_score(s, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_score len NULL");
    EXPECT(tl_session_logprobs(NULL, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs session NULL");
    EXPECT(tl_session_logprobs(s, NULL, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs tokens NULL");
    EXPECT(tl_session_logprobs(s, PROMPT, 2, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs out NULL");
    EXPECT(tl_session_logprobs(s, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs len NULL");
    EXPECT(tl_session_logprobs_decode(NULL, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs_decode session NULL");
    EXPECT(tl_session_logprobs_decode(s, NULL, 2, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs_decode tokens NULL");
    EXPECT(tl_session_logprobs_decode(s, PROMPT, 2, TL_LOOPS_DEFAULT, NULL, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs_decode out NULL");
    EXPECT(tl_session_logprobs_decode(s, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 512, NULL), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs_decode len NULL");

    /* NULL where NULL means "default" or "nothing". */
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, NULL, out, 8, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_generate params NULL = defaults (max_tokens 128 > cap 8)");
    CHECK(len == 128, "  ... required length 128 reported");
    gp.stop_tokens = NULL;
    gp.n_stop_tokens = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "params.stop_tokens NULL with n_stop_tokens 0");
    gp.n_stop_tokens = 2;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "params.stop_tokens NULL with n_stop_tokens 2");
    gp.n_stop_tokens = 0;
    EXPECT(tl_generate_stream(m, PROMPT, N_PROMPT, &gp, keep_going, NULL), TL_OK, "tl_generate_stream user_data NULL");
    EXPECT(tl_close(NULL), TL_OK, "tl_close(NULL)");
    tl_model_free(NULL);
    tl_session_free(NULL);
    CHECK(1, "tl_model_free(NULL), tl_session_free(NULL) return");
    CHECK(strcmp(tl_status_string(12345), "TL_UNKNOWN_STATUS") == 0, "tl_status_string(unknown)");
    CHECK(strcmp(tl_status_string(TL_ERR_BUSY), "TL_ERR_BUSY") == 0, "tl_status_string(TL_ERR_BUSY)");
    tl_session_free(s);
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: bad values.                                                                         */

static void test_bad_values(tl_model *m) {
    tl_generate_params gp = gen_params(4);
    int32_t out[8];
    float logits[512];
    size_t len = 12345;

    EXPECT(tl_generate(m, PROMPT, 0, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "empty prompt (n_tokens 0)");
    CHECK(len == 12345, "  ... *len unwritten on failure");
    EXPECT(tl_generate(m, NULL, 0, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "empty prompt (tokens NULL, n_tokens 0)");
    EXPECT(tl_score_last(m, PROMPT, 0, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "empty prompt to tl_score_last");
    int32_t big[] = {1, 2, 256};
    EXPECT(tl_generate(m, big, 3, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "token == vocab_size");
    big[2] = 1 << 30;
    EXPECT(tl_score_last(m, big, 3, TL_LOOPS_DEFAULT, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "token > vocab_size (score_last)");
    int32_t neg[] = {1, -5};
    EXPECT(tl_generate(m, neg, 2, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "negative token");

    gp.temperature = -0.5f;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "temperature < 0");
    gp.temperature = NAN;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "temperature NaN");
    gp.temperature = INFINITY;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "temperature inf");
    gp = gen_params(4);
    gp.temperature = 0.8f;
    gp.top_p = 0.0f;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "top_p 0");
    gp.top_p = 1.5f;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "top_p 1.5");
    gp.top_p = -0.1f;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "top_p < 0");
    gp.top_p = NAN;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "top_p NaN");
    gp.top_p = 1.0f;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "top_p 1 (sampling, seed 0)");

    gp = gen_params(4);
    gp.loops = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "loops 0");
    gp.loops = 65; /* default max_loops is 64 */
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "loops above max_loops");
    gp.loops = -2;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "loops -2");
    gp.loops = 64;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "loops == max_loops");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, 0, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last loops 0");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, 65, logits, 512, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last loops above max_loops");

    gp = gen_params(0);
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "max_tokens 0");

    gp = gen_params(4);
    int32_t stop_bad[] = {300};
    gp.stop_tokens = stop_bad;
    gp.n_stop_tokens = 1;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "stop token >= vocab_size");
    stop_bad[0] = -1;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "negative stop token");

    /* BETA-MON thresholds, checked only when the call asks for it */
    gp = gen_params(4);
    gp.beta_mon_low_entropy_bits = -1.0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "beta_mon thresholds unread without beta_monitor");
    gp.beta_monitor = true;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "beta_mon_low_entropy_bits < 0");
    CHECK(strstr(tl_last_error_message(), "beta_monitor.low_entropy_bits") != NULL, "  ... the message names the field");
    gp.beta_mon_low_entropy_bits = 7.0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "beta_mon_low above high");
    gp.beta_mon_low_entropy_bits = 0.5;
    gp.beta_mon_high_entropy_bits = NAN;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "beta_mon_high_entropy_bits NaN");
    gp.beta_mon_high_entropy_bits = 6.0;
    gp.beta_mon_agreement_floor = 1.5;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "beta_mon_agreement_floor 1.5");
    gp.beta_mon_agreement_floor = 0.95;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "tl_generate with beta_monitor");
    {
        tl_generate_stats bs;
        bs.struct_size = sizeof bs;
        EXPECT(tl_last_generate_stats(m, &bs), TL_OK, "tl_last_generate_stats of a monitored call");
        CHECK(bs.beta_mon && bs.beta_mon_n_tokens == len && bs.beta_mon_entropy_min_bits >= 0.0 &&
                  bs.beta_mon_entropy_min_bits <= bs.beta_mon_entropy_mean_bits &&
                  bs.beta_mon_entropy_mean_bits <= bs.beta_mon_entropy_max_bits &&
                  bs.beta_mon_entropy_max_bits <= 8.0 + 1e-4 && bs.beta_mon_low_entropy_bits == 0.5,
              "  ... beta_mon set, one entropy per token, 0 <= min <= mean <= max <= log2(256)");
    }

    /* struct_size */
    gp = gen_params(4);
    gp.struct_size = sizeof gp - 1;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_generate_params.struct_size too small");
    gp.struct_size = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_INVALID_ARGUMENT, "tl_generate_params.struct_size 0");
    struct {
        tl_generate_params p;
        char future[32];
    } bigger;
    memset(&bigger, 0x7f, sizeof bigger);
    bigger.p = gen_params(4);
    bigger.p.struct_size = sizeof bigger;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &bigger.p, out, 8, &len), TL_OK, "tl_generate_params.struct_size larger (forward compat)");
    tl_config cfg;
    cfg.struct_size = 8;
    EXPECT(tl_model_config(m, &cfg), TL_ERR_INVALID_ARGUMENT, "tl_config.struct_size too small");
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: output buffers.                                                                     */

static void test_buffers(tl_model *m) {
    tl_generate_params gp = gen_params(6);
    int32_t out[8] = {-7, -7, -7, -7, -7, -7, -7, -7};
    float logits[512];
    size_t len = 0;

    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 5, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_generate cap < max_tokens");
    CHECK(len == 6, "  ... *len = max_tokens (6)");
    CHECK(out[0] == -7, "  ... out untouched");
    len = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, NULL, 0, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_generate size query (NULL, 0)");
    CHECK(len == 6, "  ... *len = 6");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 6, &len), TL_OK, "tl_generate cap == max_tokens");
    CHECK(len == 6 && out[0] >= 0 && out[0] < 256, "  ... 6 tokens in range");

    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 255, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_score_last cap < vocab_size");
    CHECK(len == 256, "  ... *len = vocab_size (256)");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 512, &len), TL_OK, "tl_score_last cap > vocab_size");
    CHECK(len == 256, "  ... *len = 256");

    static float rows[6 * 256];
    EXPECT(tl_score(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, NULL, 0, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_score size query");
    CHECK(len == 6 * 256, "  ... *len = n * vocab");
    EXPECT(tl_score(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, rows, 6 * 256, &len), TL_OK, "tl_score");
    EXPECT(tl_logprobs(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 4, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_logprobs cap < n - 1");
    CHECK(len == 5, "  ... *len = 5");
    EXPECT(tl_logprobs(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 5, &len), TL_OK, "tl_logprobs");
    float decoded[5];
    EXPECT(tl_logprobs_decode(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, decoded, 4, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_logprobs_decode cap < n - 1");
    CHECK(len == 5, "  ... *len = 5");
    EXPECT(tl_logprobs_decode(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, decoded, 5, &len), TL_OK, "tl_logprobs_decode");
    /* On the CPU one-row and one-step rows are computed alike (docs/NUMERICS.md). */
    CHECK(len == 5 && memcmp(decoded, logits, sizeof decoded) == 0, "  ... == tl_logprobs (bitwise, CPU)");

    char dev[64];
    EXPECT(tl_model_device(m, NULL, 0, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_model_device size query");
    size_t need = len;
    EXPECT(tl_model_device(m, dev, need, &len), TL_OK, "tl_model_device exact size");
    CHECK(strlen(dev) + 1 == need, "  ... NUL-terminated, *len includes the NUL");
    EXPECT(tl_model_kv_mode(m, dev, sizeof dev, &len), TL_OK, "tl_model_kv_mode");
    CHECK(strcmp(dev, "fp16") == 0, "  ... the default mode is fp16");

    tl_session *s = NULL;
    EXPECT(tl_session_new(m, &s), TL_OK, "setup: tl_session_new");
    static float all[6 * 256];
    EXPECT(tl_session_score(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, all, 6 * 256 - 1, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_session_score cap < n * vocab");
    CHECK(len == 6 * 256, "  ... *len = n * vocab (1536)");
    EXPECT(tl_session_score(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, all, 6 * 256, &len), TL_OK, "tl_session_score");
    EXPECT(tl_session_score_last(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_OK, "tl_session_score_last");
    /* The last row of score equals score_last within f32 rounding of two identical code paths. */
    CHECK(memcmp(all + 5 * 256, logits, 256 * sizeof(float)) == 0, "  ... last row of tl_session_score == tl_session_score_last (bitwise)");
    EXPECT(tl_session_logprobs(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 4, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_session_logprobs cap < n - 1");
    CHECK(len == 5, "  ... *len = n - 1 (5)");
    EXPECT(tl_session_logprobs(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 5, &len), TL_OK, "tl_session_logprobs");
    int lp_ok = len == 5;
    for (size_t i = 0; i < 5; i++) lp_ok = lp_ok && logits[i] <= 0.0f && isfinite(logits[i]);
    CHECK(lp_ok, "  ... 5 finite log-probabilities <= 0");
    EXPECT(tl_session_logprobs(s, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 5, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs with 1 token");
    EXPECT(tl_session_logprobs_decode(s, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 5, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_logprobs_decode with 1 token");
    EXPECT(tl_session_logprobs_decode(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, NULL, 0, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_session_logprobs_decode size query");
    CHECK(len == 5, "  ... *len = n - 1 (5)");
    EXPECT(tl_session_logprobs_decode(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 5, &len), TL_OK, "tl_session_logprobs_decode");
    tl_session_free(s);
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: open failures, sequence length.                                                     */

static void test_open_and_lengths(void) {
    tl_model *m = NULL;
    tl_model_params mp;
    tl_model_default_params(&mp);
    mp.log = false;
    mp.device = "cpu";

    EXPECT(tl_model_open("/nonexistent/model.tinyloop", &mp, &m), TL_ERR_IO, "open missing file");
    CHECK(strstr(tl_last_error_message(), "tl_model_open") != NULL, "  ... message names tl_model_open");
    char garbage_path[] = "/tmp/tl_abi_garbage_XXXXXX";
    int fd = mkstemp(garbage_path);
    if (fd >= 0) {
        const char junk[] = "this is not a tinyloop file at all, just some bytes";
        if (write(fd, junk, sizeof junk) < 0) perror("write");
        close(fd);
    }
    EXPECT(tl_model_open(garbage_path, &mp, &m), TL_ERR_FORMAT, "open a file with bad magic");
    CHECK(strlen(tl_last_error_message()) > 0, "  ... message names the failure point");
    printf("     (%s)\n", tl_last_error_message());
    unlink(garbage_path);
    /* A truncated copy of the real model. */
    FILE *src = fopen(model_path, "rb");
    char trunc_path[] = "/tmp/tl_abi_trunc_XXXXXX";
    fd = mkstemp(trunc_path);
    if (src && fd >= 0) {
        char buf[4096];
        size_t n = fread(buf, 1, sizeof buf, src);
        if (write(fd, buf, n / 2) < 0) perror("write");
    }
    if (src) fclose(src);
    if (fd >= 0) close(fd);
    EXPECT(tl_model_open(trunc_path, &mp, &m), TL_ERR_FORMAT, "open a truncated file");
    printf("     (%s)\n", tl_last_error_message());
    unlink(trunc_path);

    mp.max_seq_len = 1u << 20;
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "max_seq_len above max_position");
    CHECK(strstr(tl_last_error_message(), "max_position") != NULL, "  ... the message names max_position");
    mp.max_seq_len = 64;
    mp.max_loops = 0;
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "max_loops 0");
    mp.max_loops = 64;
    mp.device = "tpu";
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "device \"tpu\"");
    mp.device = "cuda:99";
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_DEVICE, "device \"cuda:99\" (no such GPU)");
    mp.device = "cpu";
    mp.kv_mode = "int3";
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "kv_mode \"int3\"");
    CHECK(strstr(tl_last_error_message(), "fp16, fp16-h, int8-h, int4-h, int8, delta, age") != NULL,
          "  ... the message lists the modes");
    mp.kv_mode = "age:4096:1024";
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "kv_mode age boundaries out of order");
    mp.kv_mode = "age:64:18446744073709551552";
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "kv_mode age boundary above max_position");
    CHECK(strstr(tl_last_error_message(), "FP8 boundary 18446744073709551552 is above the model's max_position") != NULL,
          "  ... the message names the boundary and the bound");
    mp.kv_mode = NULL;
    mp.struct_size = 4;
    EXPECT(tl_model_open(model_path, &mp, &m), TL_ERR_INVALID_ARGUMENT, "tl_model_params.struct_size too small");
    CHECK(m == NULL, "  ... no handle written by failed opens");
    tl_model_default_params(&mp);
    mp.log = false;
    mp.device = "cpu";
    mp.max_seq_len = 16;
    EXPECT(tl_model_open(model_path, &mp, &m), TL_OK, "open with max_seq_len 16");
    if (m == NULL) return;

    int32_t long_prompt[20];
    for (int i = 0; i < 20; i++) long_prompt[i] = 65 + i;
    tl_generate_params gp = gen_params(1);
    int32_t out[16];
    float logits[256];
    size_t len;
    EXPECT(tl_generate(m, long_prompt, 17, &gp, out, 16, &len), TL_ERR_INVALID_ARGUMENT, "prompt (17) longer than max_seq_len (16)");
    EXPECT(tl_score_last(m, long_prompt, 17, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last prompt longer than max_seq_len");
    EXPECT(tl_generate(m, long_prompt, 16, &gp, out, 16, &len), TL_ERR_INVALID_ARGUMENT, "prompt (16) leaves no room in max_seq_len (16)");
    gp = gen_params(8);
    EXPECT(tl_generate(m, long_prompt, 10, &gp, out, 16, &len), TL_OK, "prompt + max_tokens (10 + 8) > max_seq_len (16): generation stops at max_seq_len");
    CHECK(len == 6, "  ... with the 6 tokens that fit");
    gp = gen_params(6);
    EXPECT(tl_generate(m, long_prompt, 10, &gp, out, 16, &len), TL_OK, "prompt + max_tokens == max_seq_len");
    tl_prefix_cache *cache = NULL;
    EXPECT(tl_prefix_cache_new(m, long_prompt, 16, 2, &cache), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_new prefix of max_seq_len tokens");
    tl_resume_handle *full = NULL;
    EXPECT(tl_resume_handle_new(m, long_prompt, 16, 2, &full), TL_ERR_INVALID_ARGUMENT, "tl_resume_handle_new prompt of max_seq_len tokens");
    CHECK(strstr(tl_last_error_message(), "leaves no room for a generated token in max_seq_len 16") != NULL,
          "  ... the message says no token could be generated");
    CHECK(cache == NULL && full == NULL, "  ... no handle written");
    tl_resume_handle *room = NULL;
    EXPECT(tl_resume_handle_new(m, long_prompt, 15, 2, &room), TL_OK, "tl_resume_handle_new prompt of max_seq_len - 1 tokens");
    gp = gen_params(1);
    EXPECT(tl_resume_generate(m, room, &gp, out, 16, &len), TL_OK, "  ... tl_resume_generate makes its one token");
    tl_resume_handle_free(room);
    tl_model_free(m);

    /* prefill_chunk: score calls refuse sequences longer than the chunk; generate and the
       decode-path logprobs accept them. */
    tl_model_default_params(&mp);
    mp.log = false;
    mp.device = "cpu";
    mp.max_seq_len = 64;
    mp.prefill_chunk = 4;
    m = NULL;
    EXPECT(tl_model_open(model_path, &mp, &m), TL_OK, "open with prefill_chunk 4");
    if (m == NULL) return;
    EXPECT(tl_score_last(m, long_prompt, 5, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_last n > prefill_chunk");
    gp = gen_params(4);
    EXPECT(tl_generate(m, long_prompt, 10, &gp, out, 16, &len), TL_OK, "tl_generate n > prefill_chunk (chunked prefill)");
    EXPECT(tl_logprobs_decode(m, long_prompt, 10, TL_LOOPS_DEFAULT, logits, 256, &len), TL_OK, "tl_logprobs_decode n > prefill_chunk (one row per step)");
    CHECK(len == 9, "  ... *len = n - 1 (9)");
    tl_model_free(m);
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: use after close.                                                                    */

static void test_use_after_close(void) {
    tl_model *m = open_model(64);
    tl_session *s = NULL;
    EXPECT(tl_session_new(m, &s), TL_OK, "setup: session before close");
    EXPECT(tl_close(m), TL_OK, "tl_close");
    EXPECT(tl_close(m), TL_OK, "tl_close again (idempotent)");
    tl_generate_params gp = gen_params(4);
    int32_t out[8];
    float logits[256];
    size_t len;
    double mb;
    char dev[64];
    tl_config cfg;
    cfg.struct_size = sizeof cfg;
    tl_session *s2 = NULL;

    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_CLOSED, "tl_generate after close");
    CHECK(strstr(tl_last_error_message(), "tl_generate") != NULL, "  ... message names tl_generate");
    printf("     (%s)\n", tl_last_error_message());
    EXPECT(tl_generate_stream(m, PROMPT, N_PROMPT, &gp, keep_going, NULL), TL_ERR_CLOSED, "tl_generate_stream after close");
    CHECK(strstr(tl_last_error_message(), "tl_generate_stream") != NULL, "  ... message names tl_generate_stream");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_CLOSED, "tl_score_last after close");
    EXPECT(tl_score(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_CLOSED, "tl_score after close");
    EXPECT(tl_logprobs(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_CLOSED, "tl_logprobs after close");
    EXPECT(tl_logprobs_decode(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_CLOSED, "tl_logprobs_decode after close");
    EXPECT(tl_model_config(m, &cfg), TL_ERR_CLOSED, "tl_model_config after close");
    EXPECT(tl_vram_usage_mb(m, &mb), TL_ERR_CLOSED, "tl_vram_usage_mb after close");
    CHECK(strstr(tl_last_error_message(), "tl_vram_usage_mb") != NULL, "  ... message names tl_vram_usage_mb");
    EXPECT(tl_model_device(m, dev, sizeof dev, &len), TL_ERR_CLOSED, "tl_model_device after close");
    EXPECT(tl_session_new(m, &s2), TL_ERR_CLOSED, "tl_session_new after close");
    EXPECT(tl_cancel(m), TL_OK, "tl_cancel after close (no-op)");
    /* A session made before close keeps the weights alive and keeps working. */
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "session made before close still generates");
    tl_model_free(m);
    tl_model_free(m);
    EXPECT(tl_vram_usage_mb(m, &mb), TL_ERR_CLOSED, "tl_model_free after tl_close, and twice: no-ops");
    EXPECT(tl_close(m), TL_OK, "tl_close after tl_model_free (no-op)");
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "... and after tl_model_free of its model");
    tl_session_free(s);
    tl_session_free(s);
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_CLOSED, "tl_session_generate after tl_session_free (freed twice: no-op)");
    CHECK(strstr(tl_last_error_message(), "tl_session_generate called on a freed session") != NULL, "  ... message names the function and says freed");
    EXPECT(tl_session_score_last(s, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_CLOSED, "tl_session_score_last after tl_session_free");
    EXPECT(tl_session_cancel(s), TL_OK, "tl_session_cancel after tl_session_free (no-op)");

    /* Handle values are never reused: the closed handle stays closed while new models open. */
    tl_model *fresh[4];
    int distinct = 1;
    for (int i = 0; i < 4; i++) {
        fresh[i] = open_model(64);
        distinct = distinct && fresh[i] != m;
    }
    CHECK(distinct, "new models get new handle values");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_CLOSED, "  ... and the closed one stays closed");
    EXPECT(tl_generate(fresh[3], PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "  ... while the new ones work");
    for (int i = 0; i < 4; i++) EXPECT(tl_close(fresh[i]), TL_OK, "tl_close a new model");
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: values that are not handles of the right kind.                                      */

static void test_not_handles(void) {
    tl_model *m = open_model(64);
    tl_session *s = NULL;
    EXPECT(tl_session_new(m, &s), TL_OK, "setup: session");
    tl_generate_params gp = gen_params(2);
    int32_t out[4];
    size_t len;
    double mb;

    EXPECT(tl_generate((const tl_model *)s, PROMPT, N_PROMPT, &gp, out, 4, &len), TL_ERR_INVALID_ARGUMENT, "a tl_session passed as a tl_model");
    CHECK(strstr(tl_last_error_message(), "model is a tl_session handle, not a tl_model") != NULL, "  ... message says so");
    EXPECT(tl_session_generate((const tl_session *)m, PROMPT, N_PROMPT, &gp, out, 4, &len), TL_ERR_INVALID_ARGUMENT, "a tl_model passed as a tl_session");
    EXPECT(tl_close((tl_model *)s), TL_ERR_INVALID_ARGUMENT, "tl_close of a tl_session (closes nothing)");
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 4, &len), TL_OK, "  ... the session still works");
    static char not_a_handle[64];
    tl_model *forged = (tl_model *)not_a_handle;
    EXPECT(tl_vram_usage_mb(forged, &mb), TL_ERR_INVALID_ARGUMENT, "an address that is not a handle");
    CHECK(strstr(tl_last_error_message(), "not a handle") != NULL, "  ... message says so");
    EXPECT(tl_cancel(forged), TL_ERR_INVALID_ARGUMENT, "tl_cancel of a value that is not a handle");
    tl_model_free(forged);
    tl_session_free((tl_session *)not_a_handle);
    CHECK(strstr(tl_last_error_message(), "tl_session_free: session is not a handle") != NULL, "tl_model_free / tl_session_free of non-handles only set the last error");
    tl_session_free(s);
    EXPECT(tl_close(m), TL_OK, "tl_close");
}

/* ---------------------------------------------------------------------------------------- */
/* Rows: concurrent use (BUSY), cancellation, close while running.                           */

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int started;  /* the first token arrived */
    int release;  /* the callback may return */
    int tokens;
    const tl_model *model;     /* for tl_cancel / re-entry from the callback */
    const tl_session *session; /* for tl_session_cancel from the callback */
    tl_status reentry;         /* status of a call made from inside the callback */
    int mode;                  /* 0: block on first token; 1: cancel self; 2: re-enter; 3: slow */
} gate;

static void gate_init(gate *g, int mode) {
    memset(g, 0, sizeof *g);
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    g->mode = mode;
    g->reentry = TL_OK;
}

static void gate_destroy(gate *g) {
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
}

static bool gate_callback(int32_t token, void *user_data) {
    (void)token;
    gate *g = user_data;
    pthread_mutex_lock(&g->mu);
    g->tokens++;
    int first = g->tokens == 1;
    if (first) {
        g->started = 1;
        pthread_cond_broadcast(&g->cv);
    }
    pthread_mutex_unlock(&g->mu);
    if (first && g->mode == 0) {
        pthread_mutex_lock(&g->mu);
        while (!g->release) pthread_cond_wait(&g->cv, &g->mu);
        pthread_mutex_unlock(&g->mu);
    }
    if (first && g->mode == 1) {
        if (g->session) tl_session_cancel(g->session);
        else tl_cancel(g->model);
    }
    if (first && g->mode == 2) {
        int32_t out[4];
        size_t len;
        tl_generate_params gp = gen_params(2);
        if (g->session) g->reentry = tl_session_generate(g->session, PROMPT, N_PROMPT, &gp, out, 4, &len);
        else g->reentry = tl_close((tl_model *)g->model);
    }
    if (g->mode == 3) usleep(5000);
    return true;
}

static void gate_wait_started(gate *g) {
    pthread_mutex_lock(&g->mu);
    while (!g->started) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_release(gate *g) {
    pthread_mutex_lock(&g->mu);
    g->release = 1;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

typedef struct {
    tl_model *model;
    tl_session *session;
    gate *g;
    uint32_t max_tokens;
    tl_status status;
} stream_job;

static void *stream_thread(void *arg) {
    stream_job *job = arg;
    tl_generate_params gp = gen_params(job->max_tokens);
    if (job->session)
        job->status = tl_session_generate_stream(job->session, PROMPT, N_PROMPT, &gp, gate_callback, job->g);
    else
        job->status = tl_generate_stream(job->model, PROMPT, N_PROMPT, &gp, gate_callback, job->g);
    return NULL;
}

static void test_busy(void) {
    tl_model *m = open_model(256);
    tl_generate_params gp = gen_params(4);
    int32_t out[8];
    float logits[256];
    size_t len;

    /* Model handle: a stream blocked in its callback holds the default session. */
    gate g;
    gate_init(&g, 0);
    stream_job job = {m, NULL, &g, 8, TL_OK};
    pthread_t t;
    pthread_create(&t, NULL, stream_thread, &job);
    gate_wait_started(&g);
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_BUSY, "tl_generate while another thread streams (model)");
    CHECK(strstr(tl_last_error_message(), "busy") != NULL, "  ... message says busy");
    EXPECT(tl_score_last(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_BUSY, "tl_score_last while another thread streams (model)");
    EXPECT(tl_generate_stream(m, PROMPT, N_PROMPT, &gp, keep_going, NULL), TL_ERR_BUSY, "tl_generate_stream while another thread streams");
    EXPECT(tl_score(m, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_BUSY, "tl_score while another thread streams (model)");
    EXPECT(tl_logprobs(m, PROMPT, 2, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_BUSY, "tl_logprobs while another thread streams (model)");
    double mb;
    EXPECT(tl_vram_usage_mb(m, &mb), TL_OK, "tl_vram_usage_mb does not wait for a running call");
    tl_config cfg;
    cfg.struct_size = sizeof cfg;
    EXPECT(tl_model_config(m, &cfg), TL_OK, "tl_model_config does not wait for a running call");
    tl_session *other = NULL;
    EXPECT(tl_session_new(m, &other), TL_OK, "tl_session_new while the default session is busy");
    EXPECT(tl_session_generate(other, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "another session runs meanwhile");
    gate_release(&g);
    pthread_join(t, NULL);
    EXPECT(job.status, TL_OK, "the blocked stream completes");
    CHECK(g.tokens == 8, "  ... with all 8 tokens");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "model usable again afterwards");
    gate_destroy(&g);

    /* Session handle. */
    gate_init(&g, 0);
    stream_job sjob = {NULL, other, &g, 8, TL_OK};
    pthread_create(&t, NULL, stream_thread, &sjob);
    gate_wait_started(&g);
    EXPECT(tl_session_generate(other, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_BUSY, "tl_session_generate while another thread streams");
    EXPECT(tl_session_score_last(other, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_BUSY, "tl_session_score_last while busy");
    EXPECT(tl_session_score(other, PROMPT, 1, TL_LOOPS_DEFAULT, logits, 256, &len), TL_ERR_BUSY, "tl_session_score while busy");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "the model's default session is independent");
    gate_release(&g);
    pthread_join(t, NULL);
    EXPECT(sjob.status, TL_OK, "the blocked session stream completes");
    gate_destroy(&g);

    /* Re-entry from inside a callback. */
    gate_init(&g, 2);
    g.session = other;
    tl_generate_params gp8 = gen_params(8);
    EXPECT(tl_session_generate_stream(other, PROMPT, N_PROMPT, &gp8, gate_callback, &g), TL_OK, "stream whose callback re-enters its session");
    EXPECT(g.reentry, TL_ERR_BUSY, "  ... the re-entrant call gets TL_ERR_BUSY");
    gate_destroy(&g);
    gate_init(&g, 2);
    g.model = m;
    EXPECT(tl_generate_stream(m, PROMPT, N_PROMPT, &gp8, gate_callback, &g), TL_OK, "stream whose callback calls tl_close on its model");
    EXPECT(g.reentry, TL_ERR_BUSY, "  ... tl_close from the callback gets TL_ERR_BUSY (no deadlock)");
    gate_destroy(&g);

    tl_session_free(other);
    tl_model_free(m);
}

static void test_cancel(void) {
    tl_model *m = open_model(512);
    tl_session *s = NULL;
    tl_session_new(m, &s);
    int32_t out[300];
    size_t len = 777;

    /* Cancel from another thread while the callback holds the first token. */
    gate g;
    gate_init(&g, 0);
    stream_job job = {NULL, s, &g, 200, TL_OK};
    pthread_t t;
    pthread_create(&t, NULL, stream_thread, &job);
    gate_wait_started(&g);
    EXPECT(tl_session_cancel(s), TL_OK, "tl_session_cancel from another thread");
    gate_release(&g);
    pthread_join(t, NULL);
    EXPECT(job.status, TL_ERR_CANCELLED, "the cancelled session stream returns TL_ERR_CANCELLED");
    CHECK(g.tokens == 1, "  ... after exactly one token");
    gate_destroy(&g);

    gate_init(&g, 0);
    stream_job mjob = {m, NULL, &g, 200, TL_OK};
    pthread_create(&t, NULL, stream_thread, &mjob);
    gate_wait_started(&g);
    EXPECT(tl_cancel(m), TL_OK, "tl_cancel (model) from another thread");
    gate_release(&g);
    pthread_join(t, NULL);
    EXPECT(mjob.status, TL_ERR_CANCELLED, "the cancelled model stream returns TL_ERR_CANCELLED");
    gate_destroy(&g);

    /* Cancel from inside the callback. */
    gate_init(&g, 1);
    g.session = s;
    tl_generate_params gp = gen_params(200);
    EXPECT(tl_session_generate_stream(s, PROMPT, N_PROMPT, &gp, gate_callback, &g), TL_ERR_CANCELLED, "tl_session_cancel from inside the callback");
    gate_destroy(&g);

    /* A cancel does not leak into the next call; tl_generate output is unwritten when cancelled. */
    gp = gen_params(8);
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 300, &len), TL_OK, "next call after a cancel runs normally");
    CHECK(len == 8, "  ... 8 tokens");

    /* tl_close while another thread streams: the stream is cancelled, close waits for it. */
    gate_init(&g, 3);
    stream_job cjob = {m, NULL, &g, 200, TL_OK};
    pthread_create(&t, NULL, stream_thread, &cjob);
    gate_wait_started(&g);
    EXPECT(tl_close(m), TL_OK, "tl_close while another thread streams on the model");
    pthread_join(t, NULL);
    EXPECT(cjob.status, TL_ERR_CANCELLED, "  ... the running stream returns TL_ERR_CANCELLED");
    size_t got = len;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 300, &len), TL_ERR_CLOSED, "  ... and later calls TL_ERR_CLOSED");
    CHECK(len == got, "  ... *len unwritten");
    gate_destroy(&g);

    tl_session_free(s);
    tl_model_free(m);
}

/* tl_close, waiting for a stream parked in its callback, refuses new calls at once. */

typedef struct {
    tl_model *model;
    tl_status status;
} close_job;

static void *close_thread(void *arg) {
    close_job *job = arg;
    job->status = tl_close(job->model);
    return NULL;
}

static void test_close_liveness(void) {
    tl_model *m = open_model(256);
    gate g;
    gate_init(&g, 0);
    stream_job job = {m, NULL, &g, 100, TL_OK};
    pthread_t streamer, closer;
    pthread_create(&streamer, NULL, stream_thread, &job);
    gate_wait_started(&g);
    close_job cj = {m, TL_OK};
    pthread_create(&closer, NULL, close_thread, &cj);
    /* BUSY until close starts, then CLOSED; bounded so that a regression fails, not hangs. */
    tl_generate_params gp = gen_params(2);
    int32_t out[4];
    size_t len;
    tl_status st = TL_ERR_BUSY;
    int other = 0;
    for (int i = 0; i < 60000 && st == TL_ERR_BUSY; i++) {
        st = tl_generate(m, PROMPT, N_PROMPT, &gp, out, 4, &len);
        if (st == TL_ERR_BUSY) usleep(1000);
        else if (st != TL_ERR_CLOSED) other = 1;
    }
    EXPECT(st, TL_ERR_CLOSED, "new calls get TL_ERR_CLOSED while tl_close waits for a running call");
    CHECK(!other, "  ... and only TL_ERR_BUSY before");
    double mb;
    EXPECT(tl_vram_usage_mb(m, &mb), TL_ERR_CLOSED, "  ... non-waiting calls too");
    gate_release(&g);
    pthread_join(streamer, NULL);
    pthread_join(closer, NULL);
    EXPECT(job.status, TL_ERR_CANCELLED, "  ... the running stream is cancelled");
    EXPECT(cj.status, TL_OK, "  ... and tl_close returns TL_OK once it has returned");
    gate_destroy(&g);
}

/* ---------------------------------------------------------------------------------------- */
/* Two threads, each with its own session over one shared model, generate concurrently; the  */
/* results equal sequential runs (greedy and seeded sampling are deterministic).              */

typedef struct {
    tl_session *session;
    const int32_t *prompt;
    size_t n_prompt;
    tl_generate_params params;
    int32_t out[64];
    size_t len;
    tl_status status;
} gen_job;

static void *gen_thread(void *arg) {
    gen_job *job = arg;
    for (int rep = 0; rep < 3 && job->status == TL_OK; rep++)
        job->status = tl_session_generate(job->session, job->prompt, job->n_prompt, &job->params,
                                          job->out, 64, &job->len);
    return NULL;
}

static void test_concurrent_sessions(void) {
    tl_model *m = open_model(256);
    static const int32_t p1[] = {72, 101, 108, 108, 111};      /* "Hello" */
    static const int32_t p2[] = {84, 111, 32, 98, 101, 32, 111}; /* "To be o" */
    gen_job seq[2], par[2];
    memset(seq, 0, sizeof seq);
    memset(par, 0, sizeof par);
    tl_session *s[2] = {NULL, NULL};
    EXPECT(tl_session_new(m, &s[0]), TL_OK, "setup: session 0");
    EXPECT(tl_session_new(m, &s[1]), TL_OK, "setup: session 1");
    for (int i = 0; i < 2; i++) {
        seq[i].session = par[i].session = s[i];
        seq[i].prompt = par[i].prompt = i == 0 ? p1 : p2;
        seq[i].n_prompt = par[i].n_prompt = i == 0 ? 5 : 7;
        seq[i].params = gen_params(48);
        if (i == 1) {
            seq[i].params.temperature = 0.9f;
            seq[i].params.top_k = 40;
            seq[i].params.top_p = 0.95f;
            seq[i].params.seed = 1234;
            seq[i].params.loops = 3;
        }
        par[i].params = seq[i].params;
    }
    gen_thread(&seq[0]);
    gen_thread(&seq[1]);
    EXPECT(seq[0].status, TL_OK, "sequential run, session 0 (greedy)");
    EXPECT(seq[1].status, TL_OK, "sequential run, session 1 (sampled, seed 1234)");
    pthread_t t[2];
    for (int i = 0; i < 2; i++) pthread_create(&t[i], NULL, gen_thread, &par[i]);
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    EXPECT(par[0].status, TL_OK, "concurrent run, session 0");
    EXPECT(par[1].status, TL_OK, "concurrent run, session 1");
    for (int i = 0; i < 2; i++) {
        char label[96];
        snprintf(label, sizeof label, "session %d: concurrent tokens == sequential tokens (%zu)", i, seq[i].len);
        CHECK(seq[i].len == par[i].len && seq[i].len > 0 &&
                  memcmp(seq[i].out, par[i].out, seq[i].len * sizeof(int32_t)) == 0,
              label);
    }
    tl_session_free(s[0]);
    tl_session_free(s[1]);
    tl_model_free(m);
}

/* ---------------------------------------------------------------------------------------- */
/* The looped-model calls: their equalities through the C ABI, and their bad-input rows.     */

static const int32_t PREFIX[] = {84, 111, 32, 98, 101, 32, 111, 114, 32, 110, 111, 116, 32}; /* "To be or not " */
#define N_PREFIX (sizeof PREFIX / sizeof PREFIX[0])

static int same_tokens(const int32_t *a, size_t la, const int32_t *b, size_t lb) {
    return la == lb && la > 0 && memcmp(a, b, la * sizeof *a) == 0;
}

static int argmax_of(const float *row, size_t n) {
    size_t best = 0;
    for (size_t i = 1; i < n; i++)
        if (row[i] > row[best]) best = i;
    return (int)best;
}

static void test_logit_lens_and_trajectory(tl_model *m, tl_session *s) {
    static float lens[6 * 256], shorter[3 * 256], last[256];
    size_t len = 0;
    EXPECT(tl_score_logit_lens(m, PROMPT, N_PROMPT, 6, NULL, 0, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_score_logit_lens size query");
    CHECK(len == 6 * 256, "  ... *len = loops * vocab_size");
    EXPECT(tl_score_logit_lens(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, NULL, 0, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_score_logit_lens size query at TL_LOOPS_DEFAULT");
    CHECK(len == 4 * 256, "  ... *len = default_loops (4) * vocab_size");
    EXPECT(tl_score_logit_lens(m, PROMPT, N_PROMPT, 65, NULL, 0, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_logit_lens loops above max_loops (before sizing)");
    EXPECT(tl_score_logit_lens(m, PROMPT, N_PROMPT, 6, lens, 6 * 256, &len), TL_OK, "tl_score_logit_lens at 6 loops");
    int rows_equal = len == 6 * 256;
    for (int l = 1; l <= 6; l++) {
        rows_equal = rows_equal && tl_score_last(m, PROMPT, N_PROMPT, l, last, 256, &len) == TL_OK &&
                     memcmp(lens + (l - 1) * 256, last, sizeof last) == 0;
    }
    CHECK(rows_equal, "  ... row L == tl_score_last at L loops (bitwise), L = 1..6");
    EXPECT(tl_session_score_logit_lens(s, PROMPT, N_PROMPT, 3, shorter, 3 * 256, &len), TL_OK, "tl_session_score_logit_lens at 3 loops");
    CHECK(len == 3 * 256 && memcmp(lens, shorter, sizeof shorter) == 0, "  ... the first 3 rows at 6 loops are the rows at 3 (bitwise)");

    tl_trajectory_point path[6], path3[3];
    EXPECT(tl_score_trajectory(m, PROMPT, N_PROMPT, 6, path, 5, &len), TL_ERR_BUFFER_TOO_SMALL, "tl_score_trajectory cap < loops");
    CHECK(len == 6, "  ... *len = loops (6)");
    EXPECT(tl_score_trajectory(m, PROMPT, N_PROMPT, 6, path, 6, &len), TL_OK, "tl_score_trajectory at 6 loops");
    int points_ok = len == 6 && path[0].kl_prev == 0.0;
    for (int i = 0; i < 6; i++) {
        points_ok = points_ok && path[i].argmax == argmax_of(lens + i * 256, 256) &&
                    path[i].hidden_norm > 0 && isfinite(path[i].hidden_norm) &&
                    path[i].rel_change > 0 && isfinite(path[i].rel_change) &&
                    path[i].entropy >= 0 && path[i].entropy <= 8.0 && path[i].kl_prev >= 0;
    }
    /* Entropy of a distribution over 256 tokens is at most log2(256) = 8 bits. */
    CHECK(points_ok, "  ... argmax of each point == argmax of its lens row; kl_prev[0] 0; finite norms; entropy in [0, 8] bits");
    EXPECT(tl_session_score_trajectory(s, PROMPT, N_PROMPT, 3, path3, 3, &len), TL_OK, "tl_session_score_trajectory at 3 loops");
    int prefix_ok = len == 3;
    for (int i = 0; i < 3; i++)
        prefix_ok = prefix_ok && path3[i].hidden_norm == path[i].hidden_norm &&
                    path3[i].rel_change == path[i].rel_change && path3[i].kl_prev == path[i].kl_prev &&
                    path3[i].entropy == path[i].entropy && path3[i].argmax == path[i].argmax;
    CHECK(prefix_ok, "  ... the first 3 points at 6 loops are the points at 3 (exactly)");
    EXPECT(tl_score_trajectory(m, PROMPT, N_PROMPT, 0, path, 6, &len), TL_ERR_INVALID_ARGUMENT, "tl_score_trajectory loops 0");
    EXPECT(tl_session_score_trajectory(s, NULL, N_PROMPT, 3, path3, 3, &len), TL_ERR_INVALID_ARGUMENT, "tl_session_score_trajectory tokens NULL");
}

static void test_speculative(tl_model *m, tl_session *s) {
    tl_generate_params gp = gen_params(24);
    gp.loops = 4;
    int32_t plain[32], out[32];
    size_t lp = 0, lo = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, plain, 32, &lp), TL_OK, "plain greedy generate at 4 loops");
    tl_generate_stats st;
    st.struct_size = sizeof st;
    EXPECT(tl_last_generate_stats(m, &st), TL_OK, "tl_last_generate_stats after tl_generate");
    CHECK(st.tokens == lp && st.drafted == 0 && st.accepted == 0 && st.acceptance_rate == 0.0 && st.prefill_ms >= 0 && st.decode_ms >= 0,
          "  ... tokens == returned, no drafts, times >= 0");

    tl_speculative_params sp;
    EXPECT(tl_speculative_default_params(&sp), TL_OK, "tl_speculative_default_params");
    CHECK(sp.struct_size == sizeof sp && sp.draft_loops == 0 && sp.draft_len == 4 && sp.reuse, "  ... draft_loops 0 (unset), draft_len 4, reuse");
    EXPECT(tl_speculative_default_params(NULL), TL_ERR_INVALID_ARGUMENT, "tl_speculative_default_params(NULL)");
    int all_equal = 1, stats_ok = 1, runs = 0;
    const uint32_t drafts[] = {1, 3}, lens[] = {1, 4, TL_MAX_DRAFT_LEN};
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 3; k++)
            for (int reuse = 0; reuse < 2; reuse++) {
                sp.draft_loops = drafts[d];
                sp.draft_len = lens[k];
                sp.reuse = reuse;
                tl_status status = tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo);
                all_equal = all_equal && status == TL_OK && same_tokens(out, lo, plain, lp);
                st.struct_size = sizeof st;
                stats_ok = stats_ok && tl_last_generate_stats(m, &st) == TL_OK && st.tokens == lo &&
                           st.drafted > 0 && st.accepted <= st.drafted &&
                           st.acceptance_rate == (double)st.accepted / (double)st.drafted &&
                           st.agreement >= st.acceptance_rate && st.agreement <= 1.0;
                runs++;
            }
    CHECK(all_equal && runs == 12, "tl_generate_speculative greedy == tl_generate at the verify loops (draft 1, 3; len 1, 4, 15; reuse on and off)");
    /* Greedily, a draft is accepted exactly when its argmax agrees, until the first disagreement. */
    CHECK(stats_ok, "  ... stats: tokens, drafted > 0, accepted <= drafted, rate = accepted / drafted <= agreement <= 1");
    sp.draft_loops = 2;
    sp.draft_len = 4;
    sp.reuse = true;
    EXPECT(tl_session_generate_speculative(s, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_OK, "tl_session_generate_speculative");
    CHECK(same_tokens(out, lo, plain, lp), "  ... == tl_generate");
    st.struct_size = sizeof st;
    EXPECT(tl_session_last_generate_stats(s, &st), TL_OK, "tl_session_last_generate_stats");
    CHECK(st.tokens == lo && st.drafted > 0, "  ... the session's own statistics");

    /* Bad input rows. */
    size_t untouched = 777;
    lo = untouched;
    sp.draft_loops = 4;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "draft_loops == verify_loops");
    CHECK(strstr(tl_last_error_message(), "draft_loops") != NULL && lo == untouched, "  ... message names draft_loops; *len unwritten");
    sp.draft_loops = 5;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "draft_loops > verify_loops");
    sp.draft_loops = 0;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "draft_loops 0");
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, NULL, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "tl_generate_speculative spec NULL (defaults: draft_loops unset)");
    sp.draft_loops = 2;
    sp.draft_len = 0;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "draft_len 0");
    sp.draft_len = TL_MAX_DRAFT_LEN + 1;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "draft_len above TL_MAX_DRAFT_LEN (16)");
    CHECK(strstr(tl_last_error_message(), "draft_len") != NULL, "  ... message names draft_len");
    sp.draft_len = 4;
    sp.struct_size = 4;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "tl_speculative_params.struct_size too small");
    sp.struct_size = sizeof sp;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 23, &lo), TL_ERR_BUFFER_TOO_SMALL, "tl_generate_speculative cap < max_tokens");
    CHECK(lo == 24, "  ... *len = max_tokens (24)");
    EXPECT(tl_generate_speculative(NULL, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "tl_generate_speculative model NULL");
    EXPECT(tl_session_generate_speculative(NULL, PROMPT, N_PROMPT, &gp, &sp, out, 32, &lo), TL_ERR_INVALID_ARGUMENT, "tl_session_generate_speculative session NULL");
    EXPECT(tl_last_generate_stats(m, NULL), TL_ERR_INVALID_ARGUMENT, "tl_last_generate_stats out NULL");
    st.struct_size = 8;
    EXPECT(tl_last_generate_stats(m, &st), TL_ERR_INVALID_ARGUMENT, "tl_generate_stats.struct_size too small");
}

static void test_prefix_cache(tl_model *m, tl_session *s) {
    int32_t whole[N_PREFIX + N_PROMPT];
    memcpy(whole, PREFIX, sizeof PREFIX);
    memcpy(whole + N_PREFIX, PROMPT, sizeof PROMPT);
    tl_generate_params gp = gen_params(12);
    gp.loops = 3;
    int32_t expected[16], out[16];
    size_t le = 0, lo = 0;
    /* The default session's KV slots for 3 loops exist from here on, so only the cache adds. */
    EXPECT(tl_generate(m, whole, N_PREFIX + N_PROMPT, &gp, expected, 16, &le), TL_OK, "generate from prefix + prompt at 3 loops");
    double before = 0, after = 0, cache_mb = 0;
    tl_vram_usage_mb(m, &before);
    tl_prefix_cache *cache = NULL;
    EXPECT(tl_prefix_cache_new(m, PREFIX, N_PREFIX, 3, &cache), TL_OK, "tl_prefix_cache_new at 3 loops");
    EXPECT(tl_prefix_cache_memory_mb(cache, &cache_mb), TL_OK, "tl_prefix_cache_memory_mb");
    tl_vram_usage_mb(m, &after);
    /* Both sides are byte counts / 1e6 in double: equal to well below one byte (1e-6 MB). */
    CHECK(cache_mb > 0 && fabs(after - before - cache_mb) < 1e-6, "  ... its bytes count in tl_vram_usage_mb");
    gp.prefix_cache = cache;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_OK, "tl_generate with the prefix cache");
    CHECK(same_tokens(out, lo, expected, le), "  ... == tl_generate(prefix + prompt)");
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_OK, "tl_session_generate with the model's prefix cache");
    CHECK(same_tokens(out, lo, expected, le), "  ... == tl_generate(prefix + prompt)");
    tl_session *other = NULL;
    tl_session_new(m, &other);
    gen_job jobs[2];
    memset(jobs, 0, sizeof jobs);
    pthread_t t[2];
    for (int i = 0; i < 2; i++) {
        jobs[i].session = i == 0 ? s : other;
        jobs[i].prompt = PROMPT;
        jobs[i].n_prompt = N_PROMPT;
        jobs[i].params = gp;
        pthread_create(&t[i], NULL, gen_thread, &jobs[i]);
    }
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
    CHECK(jobs[0].status == TL_OK && jobs[1].status == TL_OK && same_tokens(jobs[0].out, jobs[0].len, expected, le) &&
              same_tokens(jobs[1].out, jobs[1].len, expected, le),
          "two threads, two sessions, one prefix cache at once: both == tl_generate(prefix + prompt)");
    tl_session_free(other);

    tl_prefix_cache *built_on_session = NULL;
    EXPECT(tl_session_prefix_cache_new(s, PREFIX, N_PREFIX, 3, &built_on_session), TL_OK, "tl_session_prefix_cache_new");
    gp.prefix_cache = built_on_session;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_OK, "tl_generate with a cache built on a session");
    CHECK(same_tokens(out, lo, expected, le), "  ... == tl_generate(prefix + prompt)");
    tl_prefix_cache_free(built_on_session);

    /* Bad input rows. */
    gp.prefix_cache = cache;
    gp.loops = 4;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_ERR_INVALID_ARGUMENT, "prefix cache built at other loops (3) than the generation's (4)");
    CHECK(strstr(tl_last_error_message(), "built at loops 3") != NULL, "  ... message names the cache's loops");
    gp.loops = 3;
    tl_speculative_params sp;
    tl_speculative_default_params(&sp);
    sp.draft_loops = 1;
    EXPECT(tl_generate_speculative(m, PROMPT, N_PROMPT, &gp, &sp, out, 16, &lo), TL_ERR_INVALID_ARGUMENT, "tl_generate_speculative with a prefix cache");
    tl_model *m2 = open_model(256);
    EXPECT(tl_generate(m2, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_ERR_INVALID_ARGUMENT, "a prefix cache from another model");
    CHECK(strstr(tl_last_error_message(), "belongs to another model") != NULL, "  ... message says it belongs to another model");
    gp.prefix_cache = (const tl_prefix_cache *)s;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_ERR_INVALID_ARGUMENT, "a tl_session passed as a prefix cache");
    CHECK(strstr(tl_last_error_message(), "prefix_cache is a tl_session handle") != NULL, "  ... message says so");
    tl_prefix_cache *unwritten = (tl_prefix_cache *)&gp;
    EXPECT(tl_prefix_cache_new(m, PREFIX, 0, 3, &unwritten), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_new empty prefix");
    CHECK(unwritten == (tl_prefix_cache *)&gp, "  ... *out_cache unwritten");
    EXPECT(tl_prefix_cache_new(m, PREFIX, N_PREFIX, 3, NULL), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_new out_cache NULL");
    EXPECT(tl_prefix_cache_new(NULL, PREFIX, N_PREFIX, 3, &unwritten), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_new model NULL");
    EXPECT(tl_prefix_cache_new(m, PREFIX, N_PREFIX, 65, &unwritten), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_new loops above max_loops");
    EXPECT(tl_prefix_cache_memory_mb(cache, NULL), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_memory_mb out_mb NULL");
    EXPECT(tl_prefix_cache_memory_mb(NULL, &cache_mb), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_memory_mb cache NULL");

    /* Freed: every use is TL_ERR_CLOSED, freeing again is a no-op, its bytes are released. */
    tl_prefix_cache_free(cache);
    tl_vram_usage_mb(m, &after);
    CHECK(fabs(after - before) < 1e-6, "tl_prefix_cache_free releases its bytes");
    gp.prefix_cache = cache;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_ERR_CLOSED, "a freed prefix cache passed again");
    CHECK(strstr(tl_last_error_message(), "tl_generate called with a prefix cache that was freed") != NULL, "  ... message names the function and says freed");
    tl_prefix_cache_free(cache);
    tl_prefix_cache_free(NULL);
    EXPECT(tl_prefix_cache_memory_mb(cache, &cache_mb), TL_ERR_CLOSED, "tl_prefix_cache_free twice and of NULL: no-ops; the handle stays closed");
    tl_model_free(m2);
}

static void test_resume(tl_model *m, tl_session *s) {
    tl_resume_handle *h = NULL;
    EXPECT(tl_resume_handle_new(m, PROMPT, N_PROMPT, 4, &h), TL_OK, "tl_resume_handle_new at 4 loops");
    double mb = 0;
    EXPECT(tl_resume_handle_memory_mb(h, &mb), TL_OK, "tl_resume_handle_memory_mb");
    CHECK(mb > 0, "  ... > 0 MB");
    int all_equal = 1;
    const int32_t depths[] = {1, 2, 4, 6};
    for (int i = 0; i < 4; i++) {
        tl_generate_params gp = gen_params(16);
        gp.loops = depths[i];
        int32_t fresh[16], resumed[16], on_session[16];
        size_t lf = 0, lr = 0, ls = 0;
        all_equal = all_equal && tl_generate(m, PROMPT, N_PROMPT, &gp, fresh, 16, &lf) == TL_OK &&
                    tl_resume_generate(m, h, &gp, resumed, 16, &lr) == TL_OK &&
                    tl_session_resume_generate(s, h, &gp, on_session, 16, &ls) == TL_OK &&
                    same_tokens(resumed, lr, fresh, lf) && same_tokens(on_session, ls, fresh, lf);
    }
    CHECK(all_equal, "tl_resume_generate (model and session) at 1, 2, 4, 6 loops from 4 == fresh tl_generate");
    tl_resume_handle *built_on_session = NULL;
    EXPECT(tl_session_resume_handle_new(s, PROMPT, N_PROMPT, 2, &built_on_session), TL_OK, "tl_session_resume_handle_new at 2 loops");
    tl_generate_params gp = gen_params(8);
    gp.loops = 5;
    int32_t a[8], b[8];
    size_t la = 0, lb = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, a, 8, &la), TL_OK, "fresh tl_generate at 5 loops");
    EXPECT(tl_resume_generate(m, built_on_session, &gp, b, 8, &lb), TL_OK, "tl_resume_generate at 5 from 2");
    CHECK(same_tokens(a, la, b, lb), "  ... == fresh tl_generate");
    tl_resume_handle_free(built_on_session);

    /* Bad input rows. */
    gp.loops = 65;
    EXPECT(tl_resume_generate(m, h, &gp, b, 8, &lb), TL_ERR_INVALID_ARGUMENT, "tl_resume_generate loops above max_loops");
    CHECK(strstr(tl_last_error_message(), "loops must be in 1..=64") != NULL, "  ... message gives the range");
    gp.loops = 0;
    EXPECT(tl_resume_generate(m, h, &gp, b, 8, &lb), TL_ERR_INVALID_ARGUMENT, "tl_resume_generate loops 0");
    gp.loops = 4;
    EXPECT(tl_resume_generate(m, NULL, &gp, b, 8, &lb), TL_ERR_INVALID_ARGUMENT, "tl_resume_generate handle NULL");
    EXPECT(tl_resume_generate(m, h, &gp, b, 7, &lb), TL_ERR_BUFFER_TOO_SMALL, "tl_resume_generate cap < max_tokens");
    tl_prefix_cache *cache = NULL;
    tl_prefix_cache_new(m, PREFIX, N_PREFIX, 4, &cache);
    gp.prefix_cache = cache;
    EXPECT(tl_resume_generate(m, h, &gp, b, 8, &lb), TL_ERR_INVALID_ARGUMENT, "tl_resume_generate with a prefix cache");
    gp.prefix_cache = NULL;
    EXPECT(tl_resume_generate(m, (const tl_resume_handle *)cache, &gp, b, 8, &lb), TL_ERR_INVALID_ARGUMENT, "a prefix cache passed as a resume handle");
    CHECK(strstr(tl_last_error_message(), "resume_handle is a tl_prefix_cache handle") != NULL, "  ... message says so");
    tl_prefix_cache_free(cache);
    tl_model *m2 = open_model(256);
    EXPECT(tl_resume_generate(m2, h, &gp, b, 8, &lb), TL_ERR_INVALID_ARGUMENT, "a resume handle from another model");
    CHECK(strstr(tl_last_error_message(), "belongs to another model") != NULL, "  ... message says it belongs to another model");
    tl_model_free(m2);
    tl_resume_handle_free(h);
    EXPECT(tl_resume_generate(m, h, &gp, b, 8, &lb), TL_ERR_CLOSED, "a freed resume handle passed again");
    CHECK(strstr(tl_last_error_message(), "tl_resume_generate called with a resume handle that was freed") != NULL, "  ... message names the function and says freed");
    tl_resume_handle_free(h);
    tl_resume_handle_free(NULL);
    EXPECT(tl_resume_handle_memory_mb(h, &mb), TL_ERR_CLOSED, "tl_resume_handle_free twice and of NULL: no-ops; the handle stays closed");
}

/* Prefix caches and resume handles live with their model handle: tl_close retires them. */
static void test_bound_handles_after_close(void) {
    tl_model *m = open_model(256);
    tl_session *s = NULL;
    tl_session_new(m, &s);
    tl_prefix_cache *cache = NULL, *session_cache = NULL;
    tl_resume_handle *h = NULL;
    EXPECT(tl_prefix_cache_new(m, PREFIX, N_PREFIX, TL_LOOPS_DEFAULT, &cache), TL_OK, "setup: a prefix cache");
    EXPECT(tl_session_prefix_cache_new(s, PREFIX, N_PREFIX, TL_LOOPS_DEFAULT, &session_cache), TL_OK, "setup: a prefix cache built on a session");
    EXPECT(tl_resume_handle_new(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, &h), TL_OK, "setup: a resume handle");
    EXPECT(tl_close(m), TL_OK, "tl_close with live prefix caches and resume handles");
    tl_generate_params gp = gen_params(4);
    gp.prefix_cache = cache;
    int32_t out[8];
    size_t len;
    double mb;
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_ERR_CLOSED, "a prefix cache used after its model is closed");
    CHECK(strstr(tl_last_error_message(), "tl_session_generate called with a prefix cache that was freed or whose model was closed") != NULL,
          "  ... message names the function and says why");
    gp.prefix_cache = NULL;
    EXPECT(tl_session_resume_generate(s, h, &gp, out, 8, &len), TL_ERR_CLOSED, "a resume handle used after its model is closed");
    EXPECT(tl_prefix_cache_memory_mb(session_cache, &mb), TL_ERR_CLOSED, "  ... also a cache built on one of its sessions");
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 8, &len), TL_OK, "  ... while the session itself keeps working");
    tl_prefix_cache *late = NULL;
    EXPECT(tl_session_prefix_cache_new(s, PREFIX, N_PREFIX, TL_LOOPS_DEFAULT, &late), TL_ERR_CLOSED, "tl_session_prefix_cache_new after the session's model is closed");
    CHECK(late == NULL, "  ... *out_cache unwritten");
    EXPECT(tl_prefix_cache_new(m, PREFIX, N_PREFIX, TL_LOOPS_DEFAULT, &late), TL_ERR_CLOSED, "tl_prefix_cache_new after close");
    /* Freeing a handle that close retired is a no-op. session_cache is left to tl_close, which
     * released it (src/ffi/bound.rs tests that close drops what it retires). */
    tl_prefix_cache_free(cache);
    tl_resume_handle_free(h);
    CHECK(1, "tl_prefix_cache_free / tl_resume_handle_free of retired handles: no-ops");
    tl_session_free(s);
    tl_model_free(m);
}

static void test_bound_handles_refused_in_age_mode(void) {
    tl_model_params mp;
    tl_model_default_params(&mp);
    mp.device = "cpu";
    mp.log = false;
    mp.max_seq_len = 256;
    mp.kv_mode = "age";
    tl_model *m = NULL;
    if (tl_model_open(model_path, &mp, &m) != TL_OK) {
        CHECK(0, "open in age mode");
        return;
    }
    tl_prefix_cache *cache = NULL;
    tl_resume_handle *h = NULL;
    EXPECT(tl_prefix_cache_new(m, PREFIX, N_PREFIX, TL_LOOPS_DEFAULT, &cache), TL_ERR_INVALID_ARGUMENT, "tl_prefix_cache_new in KV mode age");
    CHECK(strstr(tl_last_error_message(), "age mode") != NULL, "  ... message names age mode");
    EXPECT(tl_resume_handle_new(m, PROMPT, N_PROMPT, TL_LOOPS_DEFAULT, &h), TL_ERR_INVALID_ARGUMENT, "tl_resume_handle_new in KV mode age");
    CHECK(cache == NULL && h == NULL, "  ... no handle written");
    tl_close(m);
}

/* A program built against the first header, whose tl_generate_params ends before prefix_cache. */
static void test_earlier_generate_params(tl_model *m) {
    tl_generate_params gp = gen_params(8);
    int32_t a[8], b[8];
    size_t la = 0, lb = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, a, 8, &la), TL_OK, "tl_generate_params of this header");
    gp.struct_size = offsetof(tl_generate_params, prefix_cache);
    gp.prefix_cache = (const tl_prefix_cache *)&gp; /* beyond the earlier struct: never read */
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, b, 8, &lb), TL_OK, "tl_generate_params of the first header (ends before prefix_cache)");
    CHECK(same_tokens(a, la, b, lb), "  ... same tokens");
}

/* CTX-TIER: a policy through tl_generate_params.ctx_tier switches the loop body to INT2 at
 * long_t; the tokens before the switch are those of plain generation. */
static void test_ctx_tier(tl_model *m, tl_session *s) {
    tl_ctx_tier_params tp;
    EXPECT(tl_ctx_tier_default_params(&tp), TL_OK, "tl_ctx_tier_default_params");
    CHECK(tp.struct_size == sizeof tp && tp.short_t == 512 && tp.long_t == 2048 && tp.long_bits == 2 && !tp.verbose && tp.file == NULL,
          "  ... short_t 512, long_t 2048, long_bits 2, not verbose, no file");
    EXPECT(tl_ctx_tier_default_params(NULL), TL_ERR_INVALID_ARGUMENT, "tl_ctx_tier_default_params(NULL)");
    tl_generate_params gp = gen_params(10);
    gp.loops = 3;
    int32_t plain[16], out[16];
    size_t lp = 0, lo = 0;
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, plain, 16, &lp), TL_OK, "plain generate for CTX-TIER");
    tp.short_t = 4;
    tp.long_t = N_PROMPT + 3;
    gp.ctx_tier = &tp;
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_OK, "tl_session_generate with a CTX-TIER policy");
    CHECK(lo == lp && same_tokens(out, 3, plain, 3), "  ... the tokens before the transition are those of plain generation");
    tl_generate_stats st;
    st.struct_size = sizeof st;
    EXPECT(tl_session_last_generate_stats(s, &st), TL_OK, "tl_session_last_generate_stats after CTX-TIER");
    CHECK(st.ctx_tier_observations == 10 && st.ctx_tier_short_steps == 3 && st.ctx_tier_long_steps == 7 &&
              st.ctx_tier_transitions == 1 && st.ctx_tier_final == 2,
          "  ... 10 observations, 3 at SHORT, 7 at LONG, 1 transition, LONG at the end");
    /* The default session still holds INT4, so the model holds both loop bodies now. */
    double at_long = 0, after = 0;
    EXPECT(tl_vram_usage_mb(m, &at_long), TL_OK, "tl_vram_usage_mb at LONG");
    tp.long_bits = 3;
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_ERR_INVALID_ARGUMENT, "CTX-TIER long_bits 3");
    CHECK(strstr(tl_last_error_message(), "long_bits") != NULL, "  ... the message names long_bits");
    gp.ctx_tier = NULL;
    EXPECT(tl_session_generate(s, PROMPT, N_PROMPT, &gp, out, 16, &lo), TL_OK, "generate without a policy after CTX-TIER");
    CHECK(lo == lp && same_tokens(out, lo, plain, lp), "  ... the INT4 tokens again");
    EXPECT(tl_vram_usage_mb(m, &after), TL_OK, "tl_vram_usage_mb back at SHORT");
    CHECK(after < at_long, "  ... the INT2 re-pack is freed once no session is at LONG");
}

/* Scoring with an exit rule: the model has no exit gate, so a criterion. Scoring a greedy
 * generation's own tokens after its prompt gives, row by row, the tokens and exit iterations
 * the generation had. */
static void test_score_exit(tl_model *m, tl_session *s) {
    enum { N_GEN = 8, N = N_PROMPT + N_GEN - 1 };
    tl_generate_params gp = gen_params(N_GEN);
    gp.loops = 4;
    gp.exit = "argmax:1";
    int32_t tokens[N], gen[N_GEN];
    size_t lg = 0, len = 0;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, gen, N_GEN, &lg), TL_OK, "tl_generate with exit argmax:1");
    tl_generate_stats st;
    st.struct_size = sizeof st;
    EXPECT(tl_last_generate_stats(m, &st), TL_OK, "  ... its statistics");
    memcpy(tokens, PROMPT, sizeof PROMPT);
    memcpy(tokens + N_PROMPT, gen, (N_GEN - 1) * sizeof *gen);

    static float rows[N * 256], again[N * 256];
    int32_t steps[N], none[N];
    for (size_t i = 0; i < N; i++) none[i] = -1;
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, &gp, NULL, 0, &len, NULL), TL_ERR_BUFFER_TOO_SMALL, "tl_score_exit size query");
    CHECK(len == N * 256, "  ... *len = n_tokens * vocab_size");
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, &gp, rows, N * 256 - 1, &len, none), TL_ERR_BUFFER_TOO_SMALL, "tl_score_exit cap < n_tokens * vocab_size");
    CHECK(none[0] == -1, "  ... exit_steps untouched");
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, &gp, rows, N * 256, &len, steps), TL_OK, "tl_score_exit of the generation's tokens");
    int same = len == N * 256 && lg == N_GEN && st.exit_tokens == N_GEN;
    double sum = 0;
    for (size_t i = N_PROMPT - 1; i < N; i++) {
        same = same && argmax_of(rows + i * 256, 256) == gen[i - (N_PROMPT - 1)] && steps[i] >= 1 && steps[i] <= 4;
        sum += steps[i];
    }
    /* Sums of small integers are exact in double, so the means are equal, not near. */
    CHECK(same && sum / N_GEN == st.exit_mean_steps, "  ... argmax == the generated tokens, mean exit iteration == exit_mean_steps");
    CHECK(sum < 4 * N_GEN, "  ... some tokens exit before the last iteration");
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, &gp, again, N * 256, &len, NULL), TL_OK, "tl_score_exit exit_steps NULL");
    CHECK(memcmp(rows, again, sizeof rows) == 0, "  ... the same logits");
    EXPECT(tl_session_score_exit(s, tokens, N, N_PROMPT, &gp, again, N * 256, &len, none), TL_OK, "tl_session_score_exit");
    CHECK(memcmp(rows, again, sizeof rows) == 0 && memcmp(steps, none, sizeof steps) == 0, "  ... the model form's logits and exit iterations");

    EXPECT(tl_score_exit(m, tokens, N, 0, &gp, rows, N * 256, &len, steps), TL_ERR_INVALID_ARGUMENT, "tl_score_exit prompt_len 0");
    CHECK(strstr(tl_last_error_message(), "prompt_len") != NULL, "  ... the message names prompt_len");
    EXPECT(tl_score_exit(m, tokens, N, N + 1, &gp, rows, N * 256, &len, steps), TL_ERR_INVALID_ARGUMENT, "tl_score_exit prompt_len > n_tokens");
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, NULL, rows, N * 256, &len, steps), TL_ERR_INVALID_ARGUMENT, "tl_score_exit params NULL (no exit rule)");
    tl_generate_params plain = gen_params(1);
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, &plain, rows, N * 256, &len, steps), TL_ERR_INVALID_ARGUMENT, "tl_score_exit without an exit rule");
    CHECK(strstr(tl_last_error_message(), "no exit rule") != NULL, "  ... the message says so");
    plain.exit_threshold = 0.5;
    EXPECT(tl_score_exit(m, tokens, N, N_PROMPT, &plain, rows, N * 256, &len, steps), TL_ERR_INVALID_ARGUMENT, "tl_score_exit gate on a model without an exit gate");
    EXPECT(tl_session_score_exit(s, NULL, N, N_PROMPT, &gp, rows, N * 256, &len, steps), TL_ERR_INVALID_ARGUMENT, "tl_session_score_exit tokens NULL");
}

static void test_looped(void) {
    tl_model *m = open_model(256);
    tl_session *s = NULL;
    EXPECT(tl_session_new(m, &s), TL_OK, "setup: tl_session_new");
    test_logit_lens_and_trajectory(m, s);
    test_speculative(m, s);
    test_prefix_cache(m, s);
    test_resume(m, s);
    test_earlier_generate_params(m);
    test_ctx_tier(m, s);
    test_score_exit(m, s);
    tl_session_free(s);
    tl_model_free(m);
    test_bound_handles_after_close();
    test_bound_handles_refused_in_age_mode();
}

/* ---------------------------------------------------------------------------------------- */

static void test_basics(void) {
    CHECK(tl_abi_version() == TL_ABI_VERSION, "tl_abi_version() == TL_ABI_VERSION");
    tl_model *m = open_model(256);
    tl_config cfg;
    cfg.struct_size = sizeof cfg;
    EXPECT(tl_model_config(m, &cfg), TL_OK, "tl_model_config");
    CHECK(cfg.vocab_size == 256 && cfg.dim > 0 && cfg.n_heads > 0 && cfg.default_loops > 0,
          "  ... byte vocab, positive sizes");
    CHECK(cfg.max_seq_len == 256 && cfg.max_loops == 64, "  ... open options echoed");
    tl_model_params defaults;
    tl_model_default_params(&defaults);
    CHECK(defaults.max_seq_len == 0, "  ... default max_seq_len 0: the model's");
    defaults.device = "cpu";
    defaults.log = false;
    tl_model *by_default = NULL;
    EXPECT(tl_model_open(model_path, &defaults, &by_default), TL_OK, "open with max_seq_len 0");
    tl_config resolved;
    resolved.struct_size = sizeof resolved;
    if (by_default != NULL && tl_model_config(by_default, &resolved) == TL_OK) {
        uint32_t expected = resolved.max_position < 2048 ? resolved.max_position : 2048;
        CHECK(resolved.max_seq_len == expected, "  ... max_seq_len = min(2048, max_position)");
    }
    tl_model_free(by_default);
    CHECK(strcmp(cfg.norm, "rmsnorm") == 0 || strcmp(cfg.norm, "layernorm") == 0, "  ... norm name");
    double mb = -1;
    EXPECT(tl_vram_usage_mb(m, &mb), TL_OK, "tl_vram_usage_mb");
    CHECK(mb > 0, "  ... > 0 MB");
    tl_generate_params gp = gen_params(12);
    int32_t a[16], b[16];
    size_t la, lb;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, a, 16, &la), TL_OK, "greedy generate");
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, b, 16, &lb), TL_OK, "greedy generate again");
    CHECK(la == 12 && la == lb && memcmp(a, b, la * sizeof *a) == 0, "  ... bit-identical across calls");
    int32_t stop[] = {a[3]};
    gp.stop_tokens = stop;
    gp.n_stop_tokens = 1;
    EXPECT(tl_generate(m, PROMPT, N_PROMPT, &gp, b, 16, &lb), TL_OK, "generate with a stop token");
    size_t first = 0;
    while (a[first] != stop[0]) first++;
    CHECK(lb == first && memcmp(a, b, lb * sizeof *a) == 0, "  ... stops before the stop token, which is not returned");
    tl_model_free(m);
}

/* ---------------------------------------------------------------------------------------- */
/* Text in, text out: the tokenizer fixture's model (byte-level BPE, 384 tokens, ChatML).     */

static const int32_t HELLO_IDS[] = {381, 39, 68, 272, 78, 11, 262, 273, 311, 0}; /* "Hello, world!" */
#define N_HELLO (sizeof HELLO_IDS / sizeof HELLO_IDS[0])
static const char NOT_UTF8[] = {'a', (char)0xC3, 0};

struct pieces {
    char text[4096];
    size_t len, calls, stop_after;
};

static bool collect_piece(const char *piece, size_t len, void *user_data) {
    struct pieces *p = user_data;
    if (p->len + len < sizeof p->text) {
        memcpy(p->text + p->len, piece, len);
        p->len += len;
        p->text[p->len] = 0;
    }
    p->calls++;
    return p->stop_after == 0 || p->calls < p->stop_after;
}

static void test_text_tokens(tl_model *m, tl_model *bytes) {
    int32_t ids[64];
    size_t n = 0;
    EXPECT(tl_tokenize(m, "Hello, world!", true, ids, 64, &n), TL_OK, "tl_tokenize");
    CHECK(n == N_HELLO && memcmp(ids, HELLO_IDS, sizeof HELLO_IDS) == 0,
          "  ... the ids of the Python tokenizers package, BOS first");
    EXPECT(tl_tokenize(m, "Hello, world!", false, ids, 64, &n), TL_OK, "tl_tokenize without special tokens");
    CHECK(n == N_HELLO - 1 && ids[0] == HELLO_IDS[1], "  ... no BOS");
    n = 0;
    EXPECT(tl_tokenize(m, "Hello, world!", true, NULL, 0, &n), TL_ERR_BUFFER_TOO_SMALL, "tl_tokenize size query");
    CHECK(n == N_HELLO, "  ... *len = the token count");
    EXPECT(tl_tokenize(m, "Hello, world!", true, ids, 3, &n), TL_ERR_BUFFER_TOO_SMALL, "tl_tokenize cap < token count");
    EXPECT(tl_tokenize(NULL, "x", true, ids, 64, &n), TL_ERR_INVALID_ARGUMENT, "tl_tokenize model NULL");
    EXPECT(tl_tokenize(m, NULL, true, ids, 64, &n), TL_ERR_INVALID_ARGUMENT, "tl_tokenize text NULL");
    EXPECT(tl_tokenize(m, "x", true, ids, 64, NULL), TL_ERR_INVALID_ARGUMENT, "tl_tokenize len NULL");
    EXPECT(tl_tokenize(m, NOT_UTF8, true, ids, 64, &n), TL_ERR_INVALID_ARGUMENT, "tl_tokenize text not UTF-8");
    CHECK(strstr(tl_last_error_message(), "text is not valid UTF-8") != NULL, "  ... message says so");
    EXPECT(tl_tokenize(bytes, "\xc3\xa9", true, ids, 64, &n), TL_OK, "tl_tokenize byte-level model");
    CHECK(n == 2 && ids[0] == 0xC3 && ids[1] == 0xA9, "  ... the bytes");

    char text[256];
    EXPECT(tl_detokenize(m, HELLO_IDS, N_HELLO, true, text, sizeof text, &n), TL_OK, "tl_detokenize");
    CHECK(n == 14 && strcmp(text, "Hello, world!") == 0, "  ... text, *len = bytes + NUL");
    EXPECT(tl_detokenize(m, HELLO_IDS, N_HELLO, false, text, sizeof text, &n), TL_OK, "tl_detokenize special tokens kept");
    CHECK(strcmp(text, "<|endoftext|>Hello, world!") == 0, "  ... <|endoftext|> kept");
    strcpy(text, "untouched");
    EXPECT(tl_detokenize(m, HELLO_IDS, N_HELLO, true, text, 5, &n), TL_ERR_BUFFER_TOO_SMALL, "tl_detokenize cap < text");
    CHECK(n == 14 && strcmp(text, "untouched") == 0, "  ... *len = needed size, out untouched");
    const int32_t outside[] = {1, 384}, negative[] = {-1};
    EXPECT(tl_detokenize(m, outside, 2, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT, "tl_detokenize token == vocab_size");
    EXPECT(tl_detokenize(m, negative, 1, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT, "tl_detokenize negative token");
    EXPECT(tl_detokenize(m, NULL, 2, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT, "tl_detokenize tokens NULL");
    const int32_t cut[] = {0xF0, 0x9F};
    EXPECT(tl_detokenize(bytes, cut, 2, true, text, sizeof text, &n), TL_OK, "tl_detokenize a cut-off character");
    CHECK(strcmp(text, "\xef\xbf\xbd") == 0, "  ... U+FFFD");

    int32_t id = -7;
    EXPECT(tl_special_token(m, "<|im_end|>", &id), TL_OK, "tl_special_token");
    CHECK(id == 383, "  ... <|im_end|> is 383");
    id = -7;
    EXPECT(tl_special_token(m, "<|tool|>", &id), TL_ERR_INVALID_ARGUMENT, "tl_special_token unknown special token");
    CHECK(id == -7 && strstr(tl_last_error_message(), "unknown special token \"<|tool|>\"") != NULL,
          "  ... named, *out_token unwritten");
    EXPECT(tl_special_token(m, "<|im_end|>", NULL), TL_ERR_INVALID_ARGUMENT, "tl_special_token out_token NULL");
    EXPECT(tl_special_token(bytes, "<s>", &id), TL_ERR_INVALID_ARGUMENT, "tl_special_token byte-level model");
}

static void test_chat_template(tl_model *m, tl_model *bytes) {
    tl_chat_message user[] = {{"user", "Hello, who are you?"}};
    char text[512];
    size_t n = 0;
    EXPECT(tl_apply_chat_template(m, user, 1, true, text, sizeof text, &n), TL_OK, "tl_apply_chat_template");
    const char *want = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                       "<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n";
    CHECK(strcmp(text, want) == 0 && n == strlen(want) + 1, "  ... as jinja2 renders it");
    EXPECT(tl_apply_chat_template(m, user, 1, true, NULL, 0, &n), TL_ERR_BUFFER_TOO_SMALL, "tl_apply_chat_template size query");
    CHECK(n == strlen(want) + 1, "  ... *len = needed size");
    EXPECT(tl_apply_chat_template(bytes, user, 1, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT,
           "tl_apply_chat_template byte-level model");
    CHECK(strstr(tl_last_error_message(), "no chat template") != NULL, "  ... message says why");
    tl_chat_message tool[] = {{"tool", "42"}};
    EXPECT(tl_apply_chat_template(m, tool, 1, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT,
           "tl_apply_chat_template role the template refuses");
    CHECK(strstr(tl_last_error_message(), "unknown role: tool") != NULL, "  ... the template's message");
    tl_chat_message bad[] = {{"user", NOT_UTF8}}, null_role[] = {{NULL, "x"}};
    EXPECT(tl_apply_chat_template(m, bad, 1, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT,
           "tl_apply_chat_template content not UTF-8");
    EXPECT(tl_apply_chat_template(m, null_role, 1, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT,
           "tl_apply_chat_template role NULL");
    EXPECT(tl_apply_chat_template(m, NULL, 1, true, text, sizeof text, &n), TL_ERR_INVALID_ARGUMENT,
           "tl_apply_chat_template messages NULL");
}

static void test_generate_text(tl_model *m, tl_session *s) {
    tl_generate_params gp = gen_params(16);
    gp.loops = 2;
    size_t need = 0, n = 0;
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, NULL, NULL, 0, &need), TL_ERR_BUFFER_TOO_SMALL,
           "tl_generate_text size query");
    CHECK(need > 16, "  ... *len = max_tokens * bytes per token + 1");
    char *text = malloc(need), *again = malloc(need);
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, NULL, text, need - 1, &n), TL_ERR_BUFFER_TOO_SMALL,
           "tl_generate_text cap below the bound");
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, NULL, text, need, &n), TL_OK, "tl_generate_text");
    CHECK(n == strlen(text) + 1, "  ... *len = bytes + NUL");

    /* The same as generating from the prompt's tokens with the EOS ids as stop tokens. */
    int32_t prompt[64], tokens[16], eos[] = {383, 381};
    size_t n_prompt = 0, n_tokens = 0;
    tl_tokenize(m, "ROMEO:", true, prompt, 64, &n_prompt);
    tl_generate_params by_ids = gp;
    by_ids.stop_tokens = eos;
    by_ids.n_stop_tokens = 2;
    EXPECT(tl_generate(m, prompt, n_prompt, &by_ids, tokens, 16, &n_tokens), TL_OK, "tl_generate of its tokens");
    tl_detokenize(m, tokens, n_tokens, true, again, need, &n);
    CHECK(strcmp(text, again) == 0, "  ... tl_generate_text = tl_detokenize(tl_generate)");
    EXPECT(tl_session_generate_text(s, "ROMEO:", &gp, NULL, again, need, &n), TL_OK, "tl_session_generate_text");
    CHECK(strcmp(text, again) == 0, "  ... same text");
    tl_speculative_params spec;
    tl_speculative_default_params(&spec);
    spec.draft_loops = 1;
    EXPECT(tl_generate_text_speculative(m, "ROMEO:", &gp, &spec, NULL, again, need, &n), TL_OK,
           "tl_generate_text_speculative");
    CHECK(strcmp(text, again) == 0, "  ... greedy: the same text");

    struct pieces p = {0};
    EXPECT(tl_generate_text_stream(m, "ROMEO:", &gp, NULL, collect_piece, &p), TL_OK, "tl_generate_text_stream");
    CHECK(strcmp(p.text, text) == 0 && p.calls > 0, "  ... the pieces make up the text");
    struct pieces first = {.stop_after = 1};
    EXPECT(tl_session_generate_text_stream(s, "ROMEO:", &gp, NULL, collect_piece, &first), TL_OK,
           "tl_session_generate_text_stream, callback returns false");
    CHECK(first.calls == 1, "  ... generation ends (TL_OK)");

    /* A stop string from the middle of the text. */
    tl_text_params tp;
    tl_text_default_params(&tp);
    char stop[8] = {0};
    size_t at = strlen(text) / 2;
    while (at > 0 && ((unsigned char)text[at] & 0xC0) == 0x80) at--;
    unsigned char lead = (unsigned char)text[at];
    memcpy(stop, text + at, lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2); /* one character */
    const char *stops[] = {"never there", stop};
    tp.stop = stops;
    tp.n_stop = 2;
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, &tp, again, need, &n), TL_OK, "tl_generate_text with stop strings");
    CHECK(strlen(again) == (size_t)(strstr(text, stop) - text) && strncmp(again, text, strlen(again)) == 0,
          "  ... the text ends before the stop string");

    const char *empty[] = {""};
    tp.stop = empty;
    tp.n_stop = 1;
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, &tp, again, need, &n), TL_ERR_INVALID_ARGUMENT, "tl_text_params empty stop string");
    tp.stop = NULL;
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, &tp, again, need, &n), TL_ERR_INVALID_ARGUMENT, "tl_text_params.stop NULL with n_stop 1");
    const char *bad[] = {NOT_UTF8};
    tp.stop = bad;
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, &tp, again, need, &n), TL_ERR_INVALID_ARGUMENT, "tl_text_params stop string not UTF-8");
    tl_text_default_params(&tp);
    tp.struct_size = 4;
    EXPECT(tl_generate_text(m, "ROMEO:", &gp, &tp, again, need, &n), TL_ERR_INVALID_ARGUMENT, "tl_text_params.struct_size too small");
    EXPECT(tl_text_default_params(NULL), TL_ERR_INVALID_ARGUMENT, "tl_text_default_params(NULL)");
    EXPECT(tl_generate_text(m, NOT_UTF8, &gp, NULL, again, need, &n), TL_ERR_INVALID_ARGUMENT, "tl_generate_text prompt not UTF-8");
    EXPECT(tl_generate_text(m, NULL, &gp, NULL, again, need, &n), TL_ERR_INVALID_ARGUMENT, "tl_generate_text prompt NULL");
    EXPECT(tl_generate_text_stream(m, "ROMEO:", &gp, NULL, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "tl_generate_text_stream callback NULL");
    tl_prefix_cache *cache = NULL;
    tl_prefix_cache_new(m, HELLO_IDS, N_HELLO, 2, &cache);
    tl_generate_params with_cache = gp;
    with_cache.prefix_cache = cache;
    EXPECT(tl_generate_text(m, "ROMEO:", &with_cache, NULL, again, need, &n), TL_ERR_INVALID_ARGUMENT,
           "tl_generate_text with a prefix cache");
    tl_prefix_cache_free(cache);
    free(text);
    free(again);
}

static void test_score_text(tl_model *m) {
    float lp[64], want[64];
    size_t n = 0, n_want = 0;
    EXPECT(tl_score_text(m, "Hello, world!", 2, NULL, 0, &n), TL_ERR_BUFFER_TOO_SMALL, "tl_score_text size query");
    CHECK(n == N_HELLO - 1, "  ... *len = tokens - 1");
    EXPECT(tl_score_text(m, "Hello, world!", 2, lp, 64, &n), TL_OK, "tl_score_text");
    tl_logprobs(m, HELLO_IDS, N_HELLO, 2, want, 64, &n_want);
    CHECK(n == n_want && memcmp(lp, want, n * sizeof *lp) == 0, "  ... = tl_logprobs of its tokens");
    EXPECT(tl_score_text(m, "", 2, lp, 64, &n), TL_ERR_INVALID_ARGUMENT, "tl_score_text text of 1 token");
    EXPECT(tl_score_text(m, NOT_UTF8, 2, lp, 64, &n), TL_ERR_INVALID_ARGUMENT, "tl_score_text text not UTF-8");
}

static void test_text(void) {
    CHECK(text_model_path != NULL && *text_model_path != 0,
          "a text model (argument 2 or TINYLOOP_TEST_TEXT_MODEL)");
    if (text_model_path == NULL || *text_model_path == 0) return;
    tl_model *m = open_path(text_model_path, 256), *bytes = open_model(256);
    tl_session *s = NULL;
    tl_session_new(m, &s);
    test_text_tokens(m, bytes);
    test_chat_template(m, bytes);
    test_generate_text(m, s);
    test_score_text(m);
    tl_session_free(s);
    tl_model_free(bytes);
    tl_model_free(m);
}

/* The engine (docs/ABI.md "Engines"): requests equal tl_generate, cancellation, freeing with
 * requests in flight, and the engine rows of the bad-input table. */
static void test_engine(void) {
    tl_model *m = open_model(256);
    tl_engine_params ep;
    EXPECT(tl_engine_default_params(&ep), TL_OK, "tl_engine_default_params");
    EXPECT(tl_engine_default_params(NULL), TL_ERR_INVALID_ARGUMENT, "tl_engine_default_params(NULL)");
    ep.max_step_rows = 8;
    ep.page_size = 4;
    tl_engine *e = NULL;
    EXPECT(tl_engine_new(NULL, &ep, &e), TL_ERR_INVALID_ARGUMENT, "tl_engine_new model NULL");
    EXPECT(tl_engine_new(m, &ep, NULL), TL_ERR_INVALID_ARGUMENT, "tl_engine_new out_engine NULL");
    ep.max_running = 0;
    EXPECT(tl_engine_new(m, &ep, &e), TL_ERR_INVALID_ARGUMENT, "tl_engine_new max_running 0");
    ep.max_running = 64;
    EXPECT(tl_engine_new(m, &ep, &e), TL_OK, "tl_engine_new");

    uint64_t ids[3];
    tl_generate_params gp[3];
    for (int i = 0; i < 3; i++) {
        gp[i] = gen_params(5 + 3 * i);
        gp[i].loops = 1 + 2 * i;
        EXPECT(tl_engine_submit(e, PROMPT, N_PROMPT - i, &gp[i], &ids[i]), TL_OK, "tl_engine_submit");
    }
    for (int i = 0; i < 3; i++) {
        int32_t got[16], want[16];
        size_t n = 0, want_len = 0;
        tl_engine_event ev;
        tl_status st;
        while ((st = tl_engine_next(e, ids[i], -1, &ev)) == TL_OK && ev.kind == TL_EVENT_TOKEN && n < 16)
            got[n++] = ev.token;
        EXPECT(st, TL_OK, "tl_engine_next until TL_EVENT_DONE");
        CHECK(ev.kind == TL_EVENT_DONE && ev.stats.tokens == n && ev.stats.finish == TL_FINISH_LENGTH,
              "  ... the request finished with its tokens counted");
        EXPECT(tl_generate(m, PROMPT, N_PROMPT - i, &gp[i], want, 16, &want_len), TL_OK, "tl_generate alone");
        CHECK(want_len == n && memcmp(got, want, n * sizeof got[0]) == 0,
              "  ... the engine's tokens equal tl_generate's");
        EXPECT(tl_engine_next(e, ids[i], 0, &ev), TL_ERR_INVALID_ARGUMENT, "tl_engine_next after its end");
    }
    int32_t empty = 0;
    uint64_t id = 0;
    EXPECT(tl_engine_submit(e, &empty, 0, NULL, &id), TL_ERR_INVALID_ARGUMENT, "tl_engine_submit empty prompt");
    EXPECT(tl_engine_submit(e, PROMPT, N_PROMPT, NULL, NULL), TL_ERR_INVALID_ARGUMENT, "tl_engine_submit out_id NULL");
    tl_engine_event ev;
    EXPECT(tl_engine_next(e, 12345, 0, &ev), TL_ERR_INVALID_ARGUMENT, "tl_engine_next unknown id");
    EXPECT(tl_engine_cancel(e, 12345), TL_ERR_INVALID_ARGUMENT, "tl_engine_cancel unknown id");

    tl_generate_params long_run = gen_params(200);
    long_run.loops = 6;
    EXPECT(tl_engine_submit(e, PROMPT, N_PROMPT, &long_run, &id), TL_OK, "tl_engine_submit a long request");
    EXPECT(tl_engine_next(e, id, -1, &ev), TL_OK, "  ... its first token");
    EXPECT(tl_engine_cancel(e, id), TL_OK, "tl_engine_cancel");
    tl_status st;
    while ((st = tl_engine_next(e, id, -1, &ev)) == TL_OK) {
    }
    EXPECT(st, TL_ERR_CANCELLED, "  ... the cancelled request ends with TL_ERR_CANCELLED");
    tl_engine_stats es;
    EXPECT(tl_engine_get_stats(e, &es), TL_OK, "tl_engine_get_stats");
    CHECK(es.running == 0 && es.pages_used == 0 && es.steps > 0, "  ... nothing running, no page held");

    EXPECT(tl_engine_submit(e, PROMPT, N_PROMPT, &long_run, &id), TL_OK, "tl_engine_submit before free");
    tl_engine_free(e);
    EXPECT(tl_engine_next(e, id, 0, &ev), TL_ERR_CLOSED, "tl_engine_next after tl_engine_free");
    EXPECT(tl_engine_submit(e, PROMPT, N_PROMPT, NULL, &id), TL_ERR_CLOSED, "tl_engine_submit after tl_engine_free");
    tl_engine_free(e);
    tl_engine_free(NULL);
    CHECK(1, "tl_engine_free twice and of NULL: no-ops");
    tl_model_free(m);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s MODEL.tinyloop (byte vocabulary) [TEXT_MODEL.tinyloop]\n", argv[0]);
        return 2;
    }
    model_path = argv[1];
    text_model_path = argc > 2 ? argv[2] : getenv("TINYLOOP_TEST_TEXT_MODEL");
    test_basics();
    tl_model *m = open_model(256);
    test_null_arguments(m);
    test_bad_values(m);
    test_buffers(m);
    tl_model_free(m);
    test_open_and_lengths();
    test_use_after_close();
    test_not_handles();
    test_busy();
    test_cancel();
    test_close_liveness();
    test_concurrent_sessions();
    test_looped();
    test_text();
    test_engine();
    printf("abi_test: %d passed, %d failed\n", passed, failed);
    return failed == 0 ? 0 : 1;
}
