// The options of the public looped families (docs/MODELS.md) through tinyloop.hpp: Ouro's
// adaptive exit on the tiny-sandwich preset, Huginn's initial state on tiny-recurrent (the paths
// CMake compiled in, where it synthesizes them). The Rust tests (tests/hf.rs, src/generate/exit.rs)
// check the numerics; here the wrapper's plumbing.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "tinyloop.hpp"

namespace {

const std::vector<int32_t> kPrompt = {82, 79, 77, 69, 79, 58};  // "ROMEO:"

tinyloop::Model open_model(const char* path, const std::string& state_init = "") {
    tinyloop::ModelOptions opts;
    opts.max_seq_len = 256;
    opts.device = "cpu";
    opts.log = false;
    opts.state_init = state_init;
    return tinyloop::Model(path, opts);
}

tinyloop::GenerateOptions with_exit(std::optional<double> threshold, const std::string& exit = "",
                                    const std::string& policy = "") {
    tinyloop::GenerateOptions o;
    o.max_tokens = 12;
    o.exit_threshold = threshold;
    o.exit = exit;
    o.exit_policy = policy;
    return o;
}

/// The message of the tinyloop::Error `f` throws, which must carry TL_ERR_INVALID_ARGUMENT.
std::string invalid_message(const std::function<void()>& f) {
    try {
        f();
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_INVALID_ARGUMENT) << e.what();
        return e.what();
    }
    ADD_FAILURE() << "no tinyloop::Error";
    return "";
}

/// Every returned token has an exit iteration, within the default 4 loops.
void expect_exit_stats(const tl_generate_stats& stats, std::size_t tokens) {
    EXPECT_EQ(stats.tokens, tokens);
    EXPECT_EQ(stats.exit_tokens, tokens);
    EXPECT_GE(stats.exit_mean_steps, 1.0);
    EXPECT_LE(stats.exit_mean_steps, 4.0);
}

TEST(Families, AnExitThresholdReportsEveryTokensExitIteration) {
    auto model = open_model(TINYLOOP_TEST_SANDWICH_MODEL_PATH);
    EXPECT_EQ(model.config().default_loops, 4u);
    model.generate(kPrompt, with_exit(std::nullopt));
    EXPECT_EQ(model.last_generate_stats().exit_tokens, 0u) << "no rule, no exits";
    EXPECT_EQ(model.last_generate_stats().exit_mean_steps, 0.0);
    const auto out = model.generate(kPrompt, with_exit(0.5));
    ASSERT_EQ(out.size(), 12u);
    expect_exit_stats(model.last_generate_stats(), out.size());
    // "gate:T" is the same rule as the threshold T.
    EXPECT_EQ(model.generate(kPrompt, with_exit(std::nullopt, "gate:0.5")), out);
    std::vector<int32_t> streamed;
    model.generate_stream(kPrompt, with_exit(0.5), [&](int32_t t) { streamed.push_back(t); });
    EXPECT_EQ(streamed, out);
    expect_exit_stats(model.last_generate_stats(), out.size());
    auto session = model.new_session();
    EXPECT_EQ(session.generate(kPrompt, with_exit(0.5)), out);
    expect_exit_stats(session.last_generate_stats(), out.size());
}

TEST(Families, TheSkipPolicy) {
    auto model = open_model(TINYLOOP_TEST_SANDWICH_MODEL_PATH);
    const auto out = model.generate(kPrompt, with_exit(0.5, "", "skip"));
    ASSERT_EQ(out.size(), 12u);
    expect_exit_stats(model.last_generate_stats(), out.size());
    auto session = model.new_session();
    std::vector<int32_t> streamed;
    session.generate_stream(kPrompt, with_exit(std::nullopt, "gate:0.5", "skip"),
                            [&](int32_t t) { streamed.push_back(t); });
    EXPECT_EQ(streamed, out);
    expect_exit_stats(session.last_generate_stats(), out.size());
}

TEST(Families, TextGenerationTakesTheExitOptions) {
    // A byte-level model (vocab 256, no stored tokenizer) takes text too.
    auto model = open_model(TINYLOOP_TEST_SANDWICH_MODEL_PATH);
    auto opts = with_exit(0.5);
    opts.max_tokens = 8;
    model.generate_text("ROMEO:", opts);
    auto stats = model.last_generate_stats();
    EXPECT_GT(stats.exit_tokens, 0u);
    EXPECT_EQ(stats.exit_tokens, stats.tokens);
    opts.exit_policy = "skip";
    model.generate_text_stream("ROMEO:", opts, {}, [](std::string_view) {});
    EXPECT_GT(model.last_generate_stats().exit_tokens, 0u);
}

TEST(Families, BadExitOptionsNameTheField) {
    auto model = open_model(TINYLOOP_TEST_SANDWICH_MODEL_PATH);
    const struct {
        tinyloop::GenerateOptions opts;
        const char* needle;
    } cases[] = {
        {with_exit(1.5), "exit_threshold"},
        {with_exit(-0.5), "exit_threshold"},
        {with_exit(std::nan("")), "exit_threshold"},
        {with_exit(std::nullopt, "kl:x"), "exit rule"},
        {with_exit(0.5, "gate:0.5"), "exit_threshold or exit, not both"},
        {with_exit(std::nullopt, "", "skip"), "exit_policy is set without an exit rule"},
        {with_exit(std::nullopt, "gate:0.5", "fast"), "exit_policy"},
        {with_exit(std::nullopt, std::string("gate\0:0.5", 9)), "exit contains a NUL byte"},
        // The preset names no default threshold.
        {with_exit(std::nullopt, "gate"), "no default threshold"},
    };
    for (const auto& c : cases) {
        EXPECT_NE(invalid_message([&] { model.generate(kPrompt, c.opts); }).find(c.needle),
                  std::string::npos)
            << c.needle;
        EXPECT_NE(invalid_message([&] { model.generate_stream(kPrompt, c.opts, [](int32_t) {}); })
                      .find(c.needle),
                  std::string::npos)
            << c.needle;
    }
}

TEST(Families, AnExitRuleNeedsAnExitGate) {
    const char* path = std::getenv("TINYLOOP_TEST_MODEL");
    if (path == nullptr || *path == '\0') throw std::runtime_error("set TINYLOOP_TEST_MODEL");
    auto model = open_model(path);
    for (const auto& opts : {with_exit(0.5), with_exit(std::nullopt, "gate:0.5")}) {
        EXPECT_NE(invalid_message([&] { model.generate(kPrompt, opts); }).find("no exit gate"),
                  std::string::npos);
    }
}

int32_t argmax(const float* row, std::size_t n) {
    std::size_t best = 0;
    for (std::size_t i = 1; i < n; i++)
        if (row[i] > row[best]) best = i;
    return static_cast<int32_t>(best);
}

// Scoring a greedy generation's prompt and tokens with its rule gives, from row kPrompt.size() - 1
// on, its tokens as the argmax and its exit iterations (their mean: the statistics keep no more).
// On the CPU the two paths run the same block applications, so the comparisons are exact.
TEST(Families, ScoreExitOfAGenerationGivesItsTokensAndExits) {
    auto model = open_model(TINYLOOP_TEST_SANDWICH_MODEL_PATH);
    auto session = model.new_session();
    for (auto opts : {with_exit(0.5), with_exit(std::nullopt, "gate:0.7", "skip"),
                      with_exit(std::nullopt, "argmax:1")}) {
        opts.loops = 4;
        const auto out = model.generate(kPrompt, opts);
        ASSERT_EQ(out.size(), 12u);
        const double generated_mean = model.last_generate_stats().exit_mean_steps;
        std::vector<int32_t> tokens = kPrompt;
        tokens.insert(tokens.end(), out.begin(), out.end() - 1);
        const std::size_t n = kPrompt.size();
        const auto scored = model.score_exit(tokens, n, opts);
        ASSERT_EQ(scored.logits.size(), tokens.size() * 256);
        ASSERT_EQ(scored.exit_steps.size(), tokens.size());
        int sum = 0;
        bool early = false;
        for (std::size_t i = n - 1; i < tokens.size(); i++) {
            EXPECT_EQ(argmax(scored.logits.data() + i * 256, 256), out[i - (n - 1)]) << "row " << i;
            EXPECT_GE(scored.exit_steps[i], 1);
            EXPECT_LE(scored.exit_steps[i], 4);
            sum += scored.exit_steps[i];
            early = early || scored.exit_steps[i] < 4;
        }
        EXPECT_TRUE(early) << opts.exit;
        // A sum of 12 small integers is exact in double: the means are equal, not near.
        EXPECT_EQ(sum / 12.0, generated_mean) << opts.exit;
        const auto again = session.score_exit(tokens, n, opts);
        EXPECT_EQ(again.logits, scored.logits);
        EXPECT_EQ(again.exit_steps, scored.exit_steps);
    }
}

TEST(Families, BadScoreExitArgumentsNameThem) {
    auto model = open_model(TINYLOOP_TEST_SANDWICH_MODEL_PATH);
    const auto gate = with_exit(0.5);
    const struct {
        std::size_t prompt_len;
        tinyloop::GenerateOptions opts;
        const char* needle;
    } cases[] = {
        {0, gate, "prompt_len 0 must be in 1..=6"},
        {7, gate, "prompt_len 7 must be in 1..=6"},
        {6, tinyloop::GenerateOptions(), "no exit rule"},
        {6, with_exit(std::nullopt, "kl:x"), "exit rule"},
    };
    for (const auto& c : cases) {
        EXPECT_NE(invalid_message([&] { model.score_exit(kPrompt, c.prompt_len, c.opts); })
                      .find(c.needle),
                  std::string::npos)
            << c.needle;
    }
}

std::vector<int32_t> greedy(const std::string& state_init) {
    auto model = open_model(TINYLOOP_TEST_RECURRENT_MODEL_PATH, state_init);
    tinyloop::GenerateOptions opts;
    opts.max_tokens = 12;
    return model.generate(kPrompt, opts);
}

TEST(Families, StateInitDrawsTheInitialState) {
    EXPECT_EQ(greedy("zeros").size(), 12u);
    const auto seeded = greedy("seed:3");
    EXPECT_EQ(seeded.size(), 12u);
    EXPECT_EQ(greedy("seed:3"), seeded);
    // "model" (also empty) is the model's own rule from seed 0.
    const auto def = greedy("");
    EXPECT_EQ(greedy("model"), def);
    EXPECT_EQ(greedy("seed:0"), def);
}

TEST(Families, BadStateInitNamesTheField) {
    EXPECT_NE(invalid_message([] { greedy("seed:x"); }).find("state_init"), std::string::npos);
    // A loop that carries its state from the pre blocks has no initial state to draw.
    const char* path = std::getenv("TINYLOOP_TEST_MODEL");
    if (path == nullptr || *path == '\0') throw std::runtime_error("set TINYLOOP_TEST_MODEL");
    EXPECT_NE(invalid_message([&] { open_model(path, "zeros"); }).find("state_init"),
              std::string::npos);
}

}  // namespace
