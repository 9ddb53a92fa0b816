// Text in, text out through tinyloop.hpp. TINYLOOP_TEST_TEXT_MODEL (else the path CMake compiled
// in, where it synthesizes one) names a model that carries the repository's tokenizer fixture
// (tests/data/tokenizer).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "tinyloop.hpp"

namespace {

// "Hello, world!" under the fixture (expected.json), BOS (<|endoftext|>, 381) first.
const std::vector<int32_t> kHello = {381, 39, 68, 272, 78, 11, 262, 273, 311, 0};
// generation_config.json's eos_token_id: <|im_end|>, <|endoftext|>.
const std::vector<int32_t> kEos = {383, 381};

tinyloop::Model open_text_model() {
    const char* p = std::getenv("TINYLOOP_TEST_TEXT_MODEL");
    if (p == nullptr || *p == '\0') p = TINYLOOP_TEST_TEXT_MODEL_PATH;
    tinyloop::ModelOptions opts;
    opts.max_seq_len = 256;
    opts.device = "cpu";
    opts.log = false;
    return tinyloop::Model(p, opts);
}

tinyloop::GenerateOptions greedy(uint32_t max_tokens) {
    tinyloop::GenerateOptions o;
    o.max_tokens = max_tokens;
    o.loops = 2;
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

}  // namespace

TEST(Text, TokenizeAndDetokenize) {
    tinyloop::Model m = open_text_model();
    EXPECT_EQ(m.tokenize("Hello, world!"), kHello);
    EXPECT_EQ(m.tokenize("Hello, world!", false), std::vector<int32_t>(kHello.begin() + 1, kHello.end()));
    EXPECT_TRUE(m.tokenize("", false).empty());
    EXPECT_EQ(m.detokenize(kHello), "<|endoftext|>Hello, world!");
    EXPECT_EQ(m.detokenize(kHello, true), "Hello, world!");
    const std::string mixed = "café 日本 مرحبا 👨‍👩‍👧\t\n";
    EXPECT_EQ(m.detokenize(m.tokenize(mixed, false)), mixed);
    EXPECT_EQ(status_of([&] { m.detokenize({384}); }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(status_of([&] { m.tokenize(std::string("a\0b", 3)); }), TL_ERR_INVALID_ARGUMENT);
    EXPECT_EQ(status_of([&] { m.tokenize("a\xc3"); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Text, SpecialTokensAndChatTemplate) {
    tinyloop::Model m = open_text_model();
    EXPECT_EQ(m.special_token("<|im_start|>"), 382);
    try {
        m.special_token("<|tool|>");
        FAIL() << "an unknown special token was accepted";
    } catch (const tinyloop::Error& e) {
        EXPECT_EQ(e.status(), TL_ERR_INVALID_ARGUMENT);
        EXPECT_NE(std::string(e.what()).find("unknown special token"), std::string::npos);
    }
    EXPECT_EQ(m.apply_chat_template({{"user", "Hello, who are you?"}}),
              "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
              "<|im_start|>user\nHello, who are you?<|im_end|>\n<|im_start|>assistant\n");
    EXPECT_EQ(status_of([&] { m.apply_chat_template({{"tool", "x"}}); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Text, GenerateTextIsGeneratedTokensDecoded) {
    tinyloop::Model m = open_text_model();
    const std::string text = m.generate_text("ROMEO:", greedy(20));
    tinyloop::GenerateOptions by_ids = greedy(20);
    by_ids.stop = kEos;
    EXPECT_EQ(text, m.detokenize(m.generate(m.tokenize("ROMEO:"), by_ids), true));
    std::string streamed;
    m.generate_text_stream("ROMEO:", greedy(20), {}, [&](std::string_view piece) { streamed += piece; });
    EXPECT_EQ(streamed, text);
    tinyloop::Session s = m.new_session();
    EXPECT_EQ(s.generate_text("ROMEO:", greedy(20)), text);
}

TEST(Text, StopStringsEndTheTextBeforeThem) {
    tinyloop::Model m = open_text_model();
    const std::string full = m.generate_text("Hello", greedy(40));
    ASSERT_GT(full.size(), 4u);
    // One whole character from the middle of the text.
    std::size_t at = full.size() / 2, end = at + 1;
    while (at > 0 && (static_cast<unsigned char>(full[at]) & 0xC0) == 0x80) at--;
    while (end < full.size() && (static_cast<unsigned char>(full[end]) & 0xC0) == 0x80) end++;
    const std::string stop = full.substr(at, end - at);
    tinyloop::TextOptions t;
    t.stop = {"never there", stop};
    EXPECT_EQ(m.generate_text("Hello", greedy(40), t), full.substr(0, full.find(stop)));
    t.stop = {""};
    EXPECT_EQ(status_of([&] { m.generate_text("Hello", greedy(4), t); }), TL_ERR_INVALID_ARGUMENT);
}

TEST(Text, ScoreTextIsLogprobsOfItsTokens) {
    tinyloop::Model m = open_text_model();
    EXPECT_EQ(m.score_text("Hello, world!", 2), m.logprobs(kHello, 2));
    EXPECT_EQ(status_of([&] { m.score_text(""); }), TL_ERR_INVALID_ARGUMENT);
}
