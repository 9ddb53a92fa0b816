// The engine from C++: requests from several threads get Model::generate's tokens; cancel and
// the engine's destruction end requests with TL_ERR_CANCELLED; bad input throws.
#include <gtest/gtest.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "tinyloop.hpp"

namespace {

tinyloop::Model cpu_model() {
    const char* path = std::getenv("TINYLOOP_TEST_MODEL");
    if (path == nullptr || *path == '\0') throw std::runtime_error("set TINYLOOP_TEST_MODEL");
    tinyloop::ModelOptions o;
    o.device = "cpu";
    o.max_seq_len = 256;
    o.log = false;
    return tinyloop::Model(path, o);
}

}  // namespace

TEST(Engine, RequestsFromThreadsEqualGenerationAlone) {
    tinyloop::Model model = cpu_model();
    tinyloop::EngineOptions eo;
    eo.max_step_rows = 8;
    eo.page_size = 4;
    tinyloop::Engine engine(model, eo);
    const std::vector<int32_t> prompt = {82, 79, 77, 69, 79, 58};
    std::vector<std::vector<int32_t>> got(4);
    std::vector<std::thread> threads;
    for (int i = 0; i < 4; i++) {
        threads.emplace_back([&, i] {
            tinyloop::GenerateOptions g;
            g.max_tokens = 6 + i;
            g.loops = 1 + i;
            got[i] = engine.wait(engine.submit(prompt, g));
        });
    }
    for (auto& t : threads) t.join();
    tinyloop::Session alone = model.new_session();
    for (int i = 0; i < 4; i++) {
        tinyloop::GenerateOptions g;
        g.max_tokens = 6 + i;
        g.loops = 1 + i;
        EXPECT_EQ(got[i], alone.generate(prompt, g)) << "request " << i;
    }
    tl_engine_stats s = engine.stats();
    EXPECT_EQ(s.running, 0u);
    EXPECT_EQ(s.pages_used, 0u);
    EXPECT_EQ(s.tokens, 6u + 7u + 8u + 9u);
}

TEST(Engine, CancelStatsAndBadInput) {
    tinyloop::Model model = cpu_model();
    tinyloop::Engine engine(model);
    tinyloop::GenerateOptions g;
    g.max_tokens = 200;
    g.loops = 6;
    uint64_t id = engine.submit({1, 2, 3}, g);
    EXPECT_EQ(engine.next(id).kind, tinyloop::EngineEvent::Kind::Token);
    engine.cancel(id);
    try {
        engine.wait(id);
        FAIL() << "a cancelled request finished";
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_CANCELLED);
    }
    try {
        engine.cancel(id);
        FAIL() << "cancel after the end";
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(e.what()).find("has already ended"), std::string::npos);
    }
    try {
        engine.submit({}, g);
        FAIL() << "an empty prompt was accepted";
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_INVALID_ARGUMENT);
    }
    tinyloop::GenerateOptions short_request;
    short_request.max_tokens = 3;
    tl_request_stats stats{};
    EXPECT_EQ(engine.wait(engine.submit({4, 5}, short_request), &stats).size(), 3u);
    EXPECT_EQ(stats.tokens, 3u);
    EXPECT_EQ(stats.finish, TL_FINISH_LENGTH);
    tinyloop::EngineOptions bad;
    bad.max_running = 0;
    EXPECT_THROW(tinyloop::Engine(model, bad), tinyloop::Error);
}
