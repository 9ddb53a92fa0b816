// The looped-model calls through tinyloop.hpp. The model runs on the CPU, whose results do not
// depend on how the work is split into steps, so the equalities are exact (as in the Rust
// tests, tests/looped.rs).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tinyloop.hpp"

namespace {

const std::vector<int32_t> kPrompt = {82, 79, 77, 69, 79, 58};  // "ROMEO:"
const std::vector<int32_t> kPrefix = {84, 111, 32, 98, 101, 32, 111, 114, 32, 110, 111, 116, 32};

tinyloop::Model open_model() {
    const char* path = std::getenv("TINYLOOP_TEST_MODEL");
    if (path == nullptr || *path == '\0') throw std::runtime_error("set TINYLOOP_TEST_MODEL");
    tinyloop::ModelOptions opts;
    opts.max_seq_len = 256;
    opts.device = "cpu";
    opts.log = false;
    return tinyloop::Model(path, opts);
}

tinyloop::GenerateOptions greedy(uint32_t max_tokens, int32_t loops) {
    tinyloop::GenerateOptions o;
    o.max_tokens = max_tokens;
    o.loops = loops;
    return o;
}

tl_status status_of(const std::function<void()>& f) {
    try {
        f();
    } catch (const tinyloop::Error& e) {
        return e.status();
    }
    return TL_OK;
}

TEST(Looped, LogitLensRowsAreScoreLastAndTrajectoryArgmaxesThem) {
    auto model = open_model();
    const std::size_t vocab = model.config().vocab_size;
    std::vector<float> lens = model.score_logit_lens(kPrompt, 5);
    ASSERT_EQ(lens.size(), 5 * vocab);
    for (int32_t l = 1; l <= 5; l++) {
        std::vector<float> row(lens.begin() + (l - 1) * vocab, lens.begin() + l * vocab);
        EXPECT_EQ(row, model.score_last(kPrompt, l)) << "row " << l;
    }
    auto path = model.score_trajectory(kPrompt, 5);
    ASSERT_EQ(path.size(), 5u);
    EXPECT_EQ(path[0].kl_prev, 0.0);
    for (std::size_t i = 0; i < path.size(); i++) {
        auto row = lens.begin() + i * vocab;
        auto best = std::max_element(row, row + vocab) - row;
        EXPECT_EQ(path[i].argmax, best) << "point " << i;
        EXPECT_GT(path[i].hidden_norm, 0.0);
    }
    auto session = model.new_session();
    EXPECT_EQ(session.score_logit_lens(kPrompt, 3),
              std::vector<float>(lens.begin(), lens.begin() + 3 * vocab));
    EXPECT_EQ(status_of([&] { model.score_logit_lens(kPrompt, 0); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Looped, GreedySpeculationEqualsPlainGeneration) {
    auto model = open_model();
    auto session = model.new_session();
    auto opts = greedy(24, 4);
    auto plain = model.generate(kPrompt, opts);
    tinyloop::SpeculativeOptions spec;
    EXPECT_EQ(spec.draft_loops, 0u);
    EXPECT_EQ(status_of([&] { model.generate_speculative(kPrompt, opts, spec); }),
              TL_ERR_INVALID_ARGUMENT);
    for (uint32_t draft_loops : {1u, 3u}) {
        for (bool reuse : {false, true}) {
            spec.draft_loops = draft_loops;
            spec.reuse = reuse;
            EXPECT_EQ(model.generate_speculative(kPrompt, opts, spec), plain);
            tl_generate_stats stats = model.last_generate_stats();
            EXPECT_EQ(stats.tokens, plain.size());
            EXPECT_GT(stats.drafted, 0u);
            EXPECT_LE(stats.accepted, stats.drafted);
            EXPECT_EQ(session.generate_speculative(kPrompt, opts, spec), plain);
            EXPECT_GT(session.last_generate_stats().drafted, 0u);
        }
    }
    spec.draft_len = TL_MAX_DRAFT_LEN + 1;
    EXPECT_EQ(status_of([&] { model.generate_speculative(kPrompt, opts, spec); }),
              TL_ERR_INVALID_ARGUMENT);
}

TEST(Looped, SpeculativeNoCacheIsSpeculationWithoutReuse) {
    auto model = open_model();
    auto session = model.new_session();
    auto opts = greedy(24, 4);
    auto plain = model.generate(kPrompt, opts);
    tinyloop::SpeculativeOptions without_reuse;
    without_reuse.draft_loops = 2;
    without_reuse.reuse = false;
    auto expected = model.generate_speculative(kPrompt, opts, without_reuse);
    EXPECT_EQ(expected, plain);
    EXPECT_EQ(model.generate_speculative_no_cache(kPrompt, opts, 2), expected);
    EXPECT_EQ(session.generate_speculative_no_cache(kPrompt, opts, 2, without_reuse.draft_len),
              expected);
    EXPECT_GT(session.last_generate_stats().drafted, 0u);
    EXPECT_EQ(status_of([&] { model.generate_speculative_no_cache(kPrompt, opts, 4); }),
              TL_ERR_INVALID_ARGUMENT);
}

TEST(Looped, PrefixCacheEqualsGeneratingFromTheWholeText) {
    auto model = open_model();
    std::vector<int32_t> whole = kPrefix;
    whole.insert(whole.end(), kPrompt.begin(), kPrompt.end());
    auto opts = greedy(12, 3);
    auto expected = model.generate(whole, opts);
    tinyloop::PrefixCache cache = model.build_prefix_cache(kPrefix, 3);
    EXPECT_GT(cache.memory_mb(), 0.0);
    opts.prefix_cache = &cache;
    EXPECT_EQ(model.generate(kPrompt, opts), expected);
    auto session = model.new_session();
    EXPECT_EQ(session.generate(kPrompt, opts), expected);
    tinyloop::PrefixCache moved = std::move(cache);
    EXPECT_EQ(status_of([&] { model.generate(kPrompt, opts); }), TL_ERR_INVALID_ARGUMENT);
    opts.prefix_cache = &moved;
    EXPECT_EQ(model.generate(kPrompt, opts), expected);
    opts.loops = 4;
    EXPECT_EQ(status_of([&] { model.generate(kPrompt, opts); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Looped, ResumeEqualsAFreshGenerationAtAnyDepth) {
    auto model = open_model();
    auto session = model.new_session();
    tinyloop::ResumeHandle handle = model.build_resume_handle(kPrompt, 4);
    EXPECT_GT(handle.memory_mb(), 0.0);
    for (int32_t depth : {1, 2, 4, 6}) {
        auto fresh = model.generate(kPrompt, greedy(16, depth));
        EXPECT_EQ(model.resume_generate(handle, greedy(16, depth)), fresh) << depth;
        EXPECT_EQ(session.resume_generate(handle, greedy(16, depth)), fresh) << depth;
    }
}

TEST(Looped, BoundHandlesAreReleasedWithTheirModel) {
    auto model = open_model();
    auto session = model.new_session();
    auto cache = model.build_prefix_cache(kPrefix);
    auto handle = session.build_resume_handle(kPrompt);
    model.close();
    auto opts = greedy(4, TL_LOOPS_DEFAULT);
    opts.prefix_cache = &cache;
    EXPECT_EQ(status_of([&] { session.generate(kPrompt, opts); }), TL_ERR_CLOSED);
    EXPECT_EQ(status_of([&] { session.resume_generate(handle, greedy(4, TL_LOOPS_DEFAULT)); }),
              TL_ERR_CLOSED);
    EXPECT_EQ(status_of([&] { cache.memory_mb(); }), TL_ERR_CLOSED);
    EXPECT_EQ(session.generate(kPrompt, greedy(4, TL_LOOPS_DEFAULT)).size(), 4u);
    EXPECT_EQ(status_of([&] { model.build_prefix_cache(kPrefix); }), TL_ERR_CLOSED);
}

TEST(Looped, CtxTierSwitchesTheLoopBodyInTheMiddleOfGeneration) {
    auto model = open_model();
    auto opts = greedy(10, 3);
    auto plain = model.generate(kPrompt, opts);
    EXPECT_EQ(model.last_generate_stats().ctx_tier_final, 0) << "no policy, no tier statistics";
    tinyloop::CtxTier tier;
    tier.short_t = 4;
    tier.long_t = 9;
    opts.ctx_tier = tier;
    auto out = model.generate(kPrompt, opts);
    auto stats = model.last_generate_stats();
    // 6 prompt tokens: observations at seq_len 6, 7, 8 run at INT4, from 9 on at INT2.
    EXPECT_EQ(stats.ctx_tier_observations, 10u);
    EXPECT_EQ(stats.ctx_tier_short_steps, 3u);
    EXPECT_EQ(stats.ctx_tier_long_steps, 7u);
    EXPECT_EQ(stats.ctx_tier_transitions, 1u);
    EXPECT_EQ(stats.ctx_tier_final, 2);
    ASSERT_EQ(out.size(), 10u);
    EXPECT_TRUE(std::equal(out.begin(), out.begin() + 3, plain.begin()));
    opts.ctx_tier->long_bits = 3;
    EXPECT_EQ(status_of([&] { model.generate(kPrompt, opts); }), TL_ERR_INVALID_ARGUMENT);
}

}  // namespace
