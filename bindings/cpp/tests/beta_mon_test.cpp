// BETA-MON through tinyloop.hpp: GenerateOptions::beta_monitor turns it on for a call, the
// summary is in last_generate_stats(), and bad thresholds are TL_ERR_INVALID_ARGUMENT. The model
// runs on the CPU, whose entropies are the library's f64 reference stored as f32.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "tinyloop.hpp"

namespace {

const std::vector<int32_t> kPrompt = {82, 79, 77, 69, 79, 58};  // "ROMEO:"

tinyloop::Model open_cpu_model() {
    const char* path = std::getenv("TINYLOOP_TEST_MODEL");
    if (path == nullptr || *path == '\0') throw std::runtime_error("set TINYLOOP_TEST_MODEL");
    tinyloop::ModelOptions opts;
    opts.max_seq_len = 256;
    opts.device = "cpu";
    opts.log = false;
    return tinyloop::Model(path, opts);
}

double entropy_bits(const std::vector<float>& logits) {
    const double max = *std::max_element(logits.begin(), logits.end());
    double s = 0, t = 0;
    for (float v : logits) {
        const double z = v - max, e = std::exp(z);
        s += e;
        t += z * e;
    }
    return (std::log(s) - t / s) / std::log(2.0);
}

TEST(BetaMon, SummaryEqualsARecomputationFromScoreLast) {
    auto model = open_cpu_model();
    tinyloop::GenerateOptions opts;
    opts.max_tokens = 20;
    opts.loops = 4;
    const auto plain = model.generate(kPrompt, opts);
    EXPECT_FALSE(model.last_generate_stats().beta_mon);
    opts.beta_monitor = tinyloop::BetaMonitor();
    EXPECT_EQ(opts.beta_monitor->low_entropy_bits, 0.5);
    EXPECT_EQ(opts.beta_monitor->high_entropy_bits, 6.0);
    EXPECT_EQ(opts.beta_monitor->agreement_floor, 0.95);
    const auto tokens = model.generate(kPrompt, opts);
    ASSERT_EQ(tokens, plain);
    const tl_generate_stats stats = model.last_generate_stats();
    ASSERT_TRUE(stats.beta_mon);
    EXPECT_EQ(stats.beta_mon_n_tokens, tokens.size());
    double mean = 0, lo = INFINITY, hi = -INFINITY;
    for (size_t i = 0; i < tokens.size(); i++) {
        std::vector<int32_t> seq = kPrompt;
        seq.insert(seq.end(), tokens.begin(), tokens.begin() + i);
        const double h = entropy_bits(model.score_last(seq, 4));
        mean += h / tokens.size();
        lo = std::min(lo, h);
        hi = std::max(hi, h);
    }
    // The library stores each f64 entropy as f32 (2^-24 relative): 1e-6 (1 + H) bits is ample.
    const double tol = 1e-6 * (1 + hi);
    EXPECT_NEAR(stats.beta_mon_entropy_mean_bits, mean, tol);
    EXPECT_NEAR(stats.beta_mon_entropy_min_bits, lo, tol);
    EXPECT_NEAR(stats.beta_mon_entropy_max_bits, hi, tol);
    EXPECT_EQ(stats.beta_mon_low_entropy_bits, 0.5);
}

TEST(BetaMon, SpeculativeCallsFlagALowAgreement) {
    auto model = open_cpu_model();
    tinyloop::GenerateOptions opts;
    opts.max_tokens = 24;
    opts.loops = 4;
    tinyloop::BetaMonitor monitor;
    monitor.agreement_floor = 1.0;
    opts.beta_monitor = monitor;
    tinyloop::SpeculativeOptions spec;
    spec.draft_loops = 1;
    model.generate_speculative(kPrompt, opts, spec);
    const tl_generate_stats stats = model.last_generate_stats();
    ASSERT_TRUE(stats.beta_mon);
    EXPECT_GT(stats.drafted, 0u);
    EXPECT_EQ(stats.beta_mon_agreement_below_floor, stats.agreement < 1.0);
    EXPECT_EQ(stats.beta_mon_agreement_floor, 1.0);
}

TEST(BetaMon, BadThresholdsAreInvalidArguments) {
    auto model = open_cpu_model();
    for (auto bad : {-1.0, std::numeric_limits<double>::quiet_NaN()}) {
        tinyloop::GenerateOptions opts;
        opts.max_tokens = 2;
        tinyloop::BetaMonitor monitor;
        monitor.low_entropy_bits = bad;
        opts.beta_monitor = monitor;
        try {
            model.generate(kPrompt, opts);
            FAIL() << "accepted low_entropy_bits " << bad;
        } catch (const tinyloop::Error& e) {
            EXPECT_EQ(e.status(), TL_ERR_INVALID_ARGUMENT);
            EXPECT_NE(std::string(e.what()).find("beta_monitor.low_entropy_bits"), std::string::npos)
                << e.what();
        }
    }
}

}  // namespace
