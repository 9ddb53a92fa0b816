// GoogleTest suite of tinyloop.hpp against libtinyloop. TINYLOOP_TEST_MODEL names a
// byte-vocabulary model (CMake synthesizes one).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "tinyloop.hpp"

namespace {

const std::vector<int32_t> kPrompt = {82, 79, 77, 69, 79, 58};  // "ROMEO:"

std::string model_path() {
    const char* p = std::getenv("TINYLOOP_TEST_MODEL");
    if (p == nullptr || *p == '\0') throw std::runtime_error("set TINYLOOP_TEST_MODEL");
    return p;
}

tinyloop::Model open_model(uint32_t max_seq_len = 256) {
    tinyloop::ModelOptions opts;
    opts.max_seq_len = max_seq_len;
    opts.device = "cpu";
    opts.log = false;
    return tinyloop::Model(model_path(), opts);
}

tinyloop::GenerateOptions gen(uint32_t max_tokens) {
    tinyloop::GenerateOptions o;
    o.max_tokens = max_tokens;
    return o;
}

template <class F>
tl_status status_of(F&& f) {
    try {
        f();
    } catch (const tinyloop::Error& e) {
        return e.status();
    }
    return TL_OK;
}

static_assert(!std::is_copy_constructible_v<tinyloop::Model>, "Model is move-only");
static_assert(std::is_nothrow_move_constructible_v<tinyloop::Model>, "Model moves");
static_assert(!std::is_copy_assignable_v<tinyloop::Session>, "Session is move-only");

}  // namespace

TEST(Model, OpensAndDescribesItself) {
    auto m = open_model(128);
    auto cfg = m.config();
    EXPECT_EQ(cfg.vocab_size, 256u);
    EXPECT_GT(cfg.dim, 0u);
    EXPECT_EQ(cfg.dim % cfg.n_heads, 0u);
    EXPECT_EQ(cfg.max_seq_len, 128u);
    EXPECT_TRUE(cfg.norm == "rmsnorm" || cfg.norm == "layernorm");
    EXPECT_GT(m.vram_usage_mb(), 0.0);
    EXPECT_EQ(m.device().rfind("cpu", 0), 0u) << m.device();
}

TEST(Model, DefaultMaxSeqLenIsTheModels) {
    tinyloop::ModelOptions opts;
    EXPECT_EQ(opts.max_seq_len, 0u) << "the default: the model's";
    opts.device = "cpu";
    opts.log = false;
    tinyloop::Model m(model_path(), opts);
    auto cfg = m.config();
    EXPECT_EQ(cfg.max_seq_len, std::min<uint32_t>(2048, cfg.max_position));
}

TEST(Model, OpenFailuresCarryStatusAndMessage) {
    try {
        tinyloop::Model bad("/nonexistent/x.tinyloop");
        FAIL() << "opened a missing file";
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_IO);
        EXPECT_NE(std::string(e.what()).find("/nonexistent/x.tinyloop"), std::string::npos) << e.what();
    }
    tinyloop::ModelOptions opts;
    opts.max_seq_len = 1u << 20;  // above max_position
    EXPECT_EQ(status_of([&] { tinyloop::Model m(model_path(), opts); }), TL_ERR_INVALID_ARGUMENT);
    tinyloop::ModelOptions bad_kv;
    bad_kv.kv_mode = "int3";
    EXPECT_EQ(status_of([&] { tinyloop::Model m(model_path(), bad_kv); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Model, EveryKvModeGenerates) {
    for (const char* mode : {"fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age:64:128"}) {
        tinyloop::ModelOptions opts;
        opts.device = "cpu";
        opts.log = false;
        opts.kv_mode = mode;
        tinyloop::Model m(model_path(), opts);
        EXPECT_EQ(m.kv_mode(), mode);
        tinyloop::GenerateOptions g;
        g.max_tokens = 8;
        EXPECT_EQ(m.generate({1, 2, 3, 4, 5}, g).size(), 8u) << mode;
    }
}

TEST(Model, GenerateIsDeterministicAndMatchesStream) {
    auto m = open_model();
    auto a = m.generate(kPrompt, gen(16));
    ASSERT_EQ(a.size(), 16u);
    EXPECT_EQ(a, m.generate({82, 79, 77, 69, 79, 58}, gen(16)));  // braced list works too
    std::vector<int32_t> streamed;
    m.generate_stream(kPrompt, gen(16), [&](int32_t t) { streamed.push_back(t); });
    EXPECT_EQ(streamed, a);
    int n = 0;
    m.generate_stream(kPrompt, gen(16), [&](int32_t) { return ++n < 3; });
    EXPECT_EQ(n, 3);
    auto o = gen(16);
    o.stop = {a[5]};
    auto stopped = m.generate(kPrompt, o);
    std::size_t first = 0;
    while (a[first] != a[5]) ++first;
    EXPECT_EQ(stopped, std::vector<int32_t>(a.begin(), a.begin() + first));
}

TEST(Model, ScoreCalls) {
    auto m = open_model();
    auto last = m.score_last(kPrompt);
    ASSERT_EQ(last.size(), 256u);
    auto all = m.score(kPrompt, TL_LOOPS_DEFAULT);
    ASSERT_EQ(all.size(), 256u * kPrompt.size());
    // Same code path on the same device: bitwise equal.
    EXPECT_TRUE(std::equal(last.begin(), last.end(), all.end() - 256));
    auto lp = m.logprobs(kPrompt, 2);
    ASSERT_EQ(lp.size(), kPrompt.size() - 1);
    for (float v : lp) EXPECT_LE(v, 0.0f);
    EXPECT_NE(m.score_last(kPrompt, 1), last);
}

// On the CPU a row is computed alike in a one-row decode step and in a one-step score
// (docs/NUMERICS.md "Scoring through the decode path"): the two agree bit for bit.
TEST(Model, LogprobsDecodeEqualsLogprobsOnCpu) {
    auto m = open_model();
    std::vector<int32_t> tokens = kPrompt;
    tokens.insert(tokens.end(), kPrompt.begin(), kPrompt.end());
    auto same_bits = [](const std::vector<float>& a, const std::vector<float>& b) {
        return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
    };
    for (int32_t loops : {1, 4}) {
        auto got = m.logprobs_decode(tokens, loops);
        ASSERT_EQ(got.size(), tokens.size() - 1);
        EXPECT_TRUE(same_bits(got, m.logprobs(tokens, loops))) << "loops " << loops;
    }
    auto s = m.new_session();
    EXPECT_TRUE(same_bits(s.logprobs_decode(tokens), m.logprobs(tokens)));
    EXPECT_EQ(status_of([&] { s.logprobs_decode({kPrompt[0]}); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Model, GenerationStopsAtMaxSeqLen) {
    auto m = open_model(64);
    EXPECT_EQ(m.generate(kPrompt, gen(60)).size(), 64u - kPrompt.size());
}

TEST(Model, InvalidArgumentsThrowWithStatus) {
    auto m = open_model(64);
    auto bad = [&](auto edit, std::vector<int32_t> prompt = kPrompt) {
        auto o = gen(4);
        edit(o);
        return status_of([&] { m.generate(prompt, o); });
    };
    auto none = [](tinyloop::GenerateOptions&) {};
    EXPECT_EQ(bad(none, {}), TL_ERR_INVALID_ARGUMENT) << "empty prompt";
    EXPECT_EQ(bad(none, {1, 256}), TL_ERR_INVALID_ARGUMENT) << "token >= vocab";
    EXPECT_EQ(bad(none, {-3}), TL_ERR_INVALID_ARGUMENT) << "negative token";
    EXPECT_EQ(bad([](auto& o) { o.temperature = -1; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad([](auto& o) { o.temperature = NAN; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad([](auto& o) { o.top_p = 0; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad([](auto& o) { o.top_p = 2; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad([](auto& o) { o.loops = 0; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad([](auto& o) { o.loops = 65; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad([](auto& o) { o.max_tokens = 0; }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(bad(none, std::vector<int32_t>(64, 1)), TL_ERR_INVALID_ARGUMENT) << "prompt fills max_seq_len";
    EXPECT_EQ(status_of([&] { m.score_last(std::vector<int32_t>(65, 1)); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Model, CloseIsIdempotentAndLaterCallsThrowClosed) {
    auto m = open_model(64);
    auto s = m.new_session();
    m.close();
    m.close();
    try {
        m.generate(kPrompt, gen(2));
        FAIL() << "generate after close";
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_CLOSED);
        EXPECT_NE(std::string(e.what()).find("tl_generate"), std::string::npos) << e.what();
    }
    EXPECT_EQ(status_of([&] { m.score_last(kPrompt); }), TL_ERR_CLOSED);
    EXPECT_EQ(status_of([&] { m.config(); }), TL_ERR_CLOSED);
    EXPECT_EQ(status_of([&] { m.vram_usage_mb(); }), TL_ERR_CLOSED);
    EXPECT_EQ(status_of([&] { m.new_session(); }), TL_ERR_CLOSED);
    // The session made before close keeps the weights alive.
    EXPECT_EQ(s.generate(kPrompt, gen(3)).size(), 3u);
}

TEST(Model, MovedFromHandleIsInert) {
    auto m = open_model(64);
    tinyloop::Model n = std::move(m);
    EXPECT_EQ(m.get(), nullptr);  // NOLINT(bugprone-use-after-move): checking the moved-from state
    EXPECT_EQ(status_of([&] { m.generate(kPrompt, gen(2)); }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(n.generate(kPrompt, gen(2)).size(), 2u);
}

TEST(Model, ExceptionInStreamCallbackPropagates) {
    auto m = open_model();
    EXPECT_THROW(m.generate_stream(kPrompt, gen(8), [](int32_t) -> bool { throw std::logic_error("x"); }),
                 std::logic_error);
    EXPECT_EQ(m.generate(kPrompt, gen(2)).size(), 2u);  // usable afterwards
}

TEST(Concurrency, BusyWhileAnotherThreadStreams) {
    auto m = open_model();
    std::mutex mu;
    std::condition_variable cv;
    bool started = false, release = false;
    tl_status stream_status = TL_OK;
    std::thread t([&] {
        stream_status = status_of([&] {
            m.generate_stream(kPrompt, gen(8), [&](int32_t) {
                std::unique_lock<std::mutex> lock(mu);
                if (!started) {
                    started = true;
                    cv.notify_all();
                    cv.wait(lock, [&] { return release; });
                }
            });
        });
    });
    {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return started; });
    }
    EXPECT_EQ(status_of([&] { m.generate(kPrompt, gen(2)); }), TL_ERR_BUSY);
    EXPECT_GT(m.vram_usage_mb(), 0.0);  // does not wait
    {
        std::lock_guard<std::mutex> lock(mu);
        release = true;
    }
    cv.notify_all();
    t.join();
    EXPECT_EQ(stream_status, TL_OK);
}

TEST(Concurrency, CancelFromAnotherThread) {
    auto m = open_model(512);
    auto s = m.new_session();
    std::atomic<int> tokens{0};
    std::atomic<bool> cancelled{false};
    std::thread t([&] {
        while (tokens.load() == 0) std::this_thread::yield();
        s.cancel();
        cancelled = true;
    });
    tl_status status = status_of([&] {
        s.generate_stream(kPrompt, gen(400), [&](int32_t) {
            ++tokens;
            // Hold the first token until the cancel has been sent, so the stop is deterministic.
            while (!cancelled.load()) std::this_thread::yield();
        });
    });
    t.join();
    EXPECT_EQ(status, TL_ERR_CANCELLED);
    EXPECT_EQ(tokens.load(), 1);
    EXPECT_EQ(s.generate(kPrompt, gen(3)).size(), 3u);  // the next call is unaffected
}

TEST(Concurrency, TwoSessionsInParallelEqualSequential) {
    auto m = open_model();
    const std::vector<std::vector<int32_t>> prompts = {{72, 101, 108, 108, 111}, {84, 111, 32, 98, 101}};
    std::vector<tinyloop::GenerateOptions> opts = {gen(40), gen(40)};
    opts[1].temperature = 0.8f;
    opts[1].seed = 3;
    std::vector<tinyloop::Session> sessions;
    sessions.push_back(m.new_session());
    sessions.push_back(m.new_session());
    std::vector<std::vector<int32_t>> sequential;
    for (int i = 0; i < 2; i++) sequential.push_back(sessions[i].generate(prompts[i], opts[i]));
    std::vector<std::vector<int32_t>> parallel[2];
    std::thread threads[2];
    for (int i = 0; i < 2; i++)
        threads[i] = std::thread([&, i] {
            for (int rep = 0; rep < 3; rep++) parallel[i].push_back(sessions[i].generate(prompts[i], opts[i]));
        });
    for (auto& t : threads) t.join();
    for (int i = 0; i < 2; i++)
        for (const auto& r : parallel[i]) EXPECT_EQ(r, sequential[i]) << "session " << i;
}
