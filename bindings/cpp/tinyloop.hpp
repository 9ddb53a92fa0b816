// tinyloop.hpp: header-only C++17 wrapper of libtinyloop's C ABI (include/tinyloop.h,
// docs/ABI.md).
//
//   tinyloop::Model model("model.tinyloop");            // throws tinyloop::Error on failure
//   std::vector<int32_t> out = model.generate({82, 79, 77, 69, 79, 58});
//   model.generate_stream(prompt, opts, [](int32_t t) { std::printf("%d ", t); });
//   std::vector<float> lens = model.score_logit_lens(prompt, 8);  // [8 * vocab]
//   std::string reply = model.generate_text("ROMEO:");     // models that carry a tokenizer
//
// Handles are move-only RAII objects: ~Model frees the model (tl_model_free), ~Session the
// session, ~PrefixCache and ~ResumeHandle theirs (closing their model releases them too). Every failure throws tinyloop::Error carrying the tl_status and the library's message.
// Threads: Model methods may be called from any thread; calls that run on the model's default
// session (generate*, score*) run one at a time (a concurrent one throws with TL_ERR_BUSY), the
// others (config, vram_usage_mb, device, new_session, cancel, close) never wait for them. A
// Session is used by one thread at a time; cancel() may come from any thread.
#ifndef TINYLOOP_HPP
#define TINYLOOP_HPP

#include <array>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "tinyloop.h"

namespace tinyloop {

static_assert(TL_ABI_VERSION == 1, "tinyloop.hpp is written for C ABI version 1");

/// A failed call: the status code and the library's message.
class Error : public std::runtime_error {
public:
    Error(tl_status status, const std::string& message)
        : std::runtime_error(message + " (" + tl_status_string(status) + ")"), status_(status) {}
    tl_status status() const noexcept { return status_; }

private:
    tl_status status_;
};

namespace detail {
/// Throw for a failed status, with the calling thread's last error message.
inline void check(tl_status status) {
    if (status != TL_OK) throw Error(status, tl_last_error_message());
}

/// `s` as a C string; a NUL byte inside it, which C would cut the string at, throws.
inline const char* c_str(const std::string& s, const char* what) {
    if (s.find('\0') != std::string::npos)
        throw Error(TL_ERR_INVALID_ARGUMENT, std::string(what) + " contains a NUL byte");
    return s.c_str();
}
}  // namespace detail

/// Throws unless the loaded library implements the ABI this header was written for.
inline void check_abi() {
    if (tl_abi_version() != TL_ABI_VERSION)
        throw Error(TL_ERR_INVALID_ARGUMENT,
                    "libtinyloop ABI version " + std::to_string(tl_abi_version()) +
                        " does not match tinyloop.hpp's " + std::to_string(TL_ABI_VERSION));
}

/// A read-only view of token ids (std::span-like): from a std::vector, std::array, a braced
/// list, or a pointer and a count. It does not own the tokens.
class Tokens {
public:
    Tokens() = default;
    Tokens(const int32_t* data, std::size_t size) : data_(data), size_(size) {}
    Tokens(const std::vector<int32_t>& v) : data_(v.data()), size_(v.size()) {}  // NOLINT
    template <std::size_t N>
    Tokens(const std::array<int32_t, N>& a) : data_(a.data()), size_(N) {}  // NOLINT
    // For call arguments such as generate({1, 2, 3}): the list lives until the call returns.
    // Do not keep a Tokens made from a braced list beyond the full expression.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Winit-list-lifetime"
#endif
    Tokens(std::initializer_list<int32_t> l) : data_(l.begin()), size_(l.size()) {}  // NOLINT
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
    const int32_t* data() const noexcept { return data_; }
    std::size_t size() const noexcept { return size_; }

private:
    const int32_t* data_ = nullptr;
    std::size_t size_ = 0;
};

namespace detail {
/// A move-only owner of a prefix cache or resume handle; `Free` releases it.
template <class Handle, void (*Free)(Handle*)>
class Bound {
public:
    explicit Bound(Handle* ptr) noexcept : ptr_(ptr) {}
    Bound(const Bound&) = delete;
    Bound& operator=(const Bound&) = delete;
    Bound(Bound&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
    Bound& operator=(Bound&& other) noexcept {
        if (this != &other) {
            Free(ptr_);
            ptr_ = std::exchange(other.ptr_, nullptr);
        }
        return *this;
    }
    ~Bound() { Free(ptr_); }

    /// The C handle (owned by this object; NULL once moved from).
    Handle* get() const noexcept { return ptr_; }

protected:
    /// Device memory it holds, in MB (10^6 bytes), through `memory_mb`.
    double memory(tl_status (*memory_mb)(const Handle*, double*)) const {
        double mb = 0;
        check(memory_mb(ptr_, &mb));
        return mb;
    }

private:
    Handle* ptr_ = nullptr;
};
}  // namespace detail

/// The KV entries of a prefix (Model::build_prefix_cache); set GenerateOptions::prefix_cache
/// to generate after it. Several sessions may use one cache at once. Move-only; closing the
/// model it was built on releases it (later uses throw with TL_ERR_CLOSED).
class PrefixCache : public detail::Bound<tl_prefix_cache, tl_prefix_cache_free> {
public:
    using Bound::Bound;
    double memory_mb() const { return memory(tl_prefix_cache_memory_mb); }
};

/// A prompt run at some loop count (Model::build_resume_handle); resume_generate continues it
/// at any depth. Move-only; closing the model it was built on releases it.
class ResumeHandle : public detail::Bound<tl_resume_handle, tl_resume_handle_free> {
public:
    using Bound::Bound;
    double memory_mb() const { return memory(tl_resume_handle_memory_mb); }
};

/// How generate_speculative drafts; the default constructor takes the library's defaults
/// (draft_len 4, reuse on) and draft_loops 0, which must be set.
struct SpeculativeOptions {
    uint32_t draft_loops;  ///< 1..verify loops - 1
    uint32_t draft_len;    ///< 1..TL_MAX_DRAFT_LEN
    bool reuse;            ///< verify from the draft's state (false: recompute, the baseline)

    SpeculativeOptions() {
        tl_speculative_params p;
        detail::check(tl_speculative_default_params(&p));
        draft_loops = p.draft_loops;
        draft_len = p.draft_len;
        reuse = p.reuse;
    }

    tl_speculative_params to_c() const {
        tl_speculative_params p;
        detail::check(tl_speculative_default_params(&p));
        p.draft_loops = draft_loops;
        p.draft_len = draft_len;
        p.reuse = reuse;
        return p;
    }
};

/// Options of Model's constructor; the default constructor takes the library's defaults.
struct ModelOptions {
    /// Upper bound on prompt + generated tokens; 0 (the default): 2048, or the model's
    /// max_position when that is smaller.
    uint32_t max_seq_len;
    uint32_t prefill_chunk;
    uint32_t max_loops;
    bool log;
    /// "auto", "cpu", "cuda", "cuda:N"; empty uses TINYLOOP_DEVICE, or auto.
    std::string device;
    /// KV cache mode: "fp16", "fp16-h", "int8-h", "int4-h", "int8", "delta", "age" or
    /// "age:A:B"; empty uses TINYLOOP_KV_INT8 / TINYLOOP_KV_DELTA, else fp16.
    std::string kv_mode;
    /// FP16 body cache: 1 keeps an FP16 copy of the transformer blocks' quantized weights on the
    /// GPU for prefill GEMMs through cuBLAS, 0 does not, -1 follows
    /// TINYLOOP_EXPERIMENTAL_FP16_BODY.
    int32_t fp16_body;
    /// How a model whose loop starts from a random state (Huginn) draws it: "model" (its own
    /// rule, from seed 0; also empty), "zeros" or "seed:N". Other models accept only "model".
    std::string state_init;

    ModelOptions() {
        tl_model_params p;
        detail::check(tl_model_default_params(&p));
        max_seq_len = p.max_seq_len;
        prefill_chunk = p.prefill_chunk;
        max_loops = p.max_loops;
        log = p.log;
        fp16_body = p.fp16_body;
    }
};

/// A CTX-TIER policy: the loop body is re-packed to INT2 once the sequence reaches long_t
/// tokens, and back to INT4 on a call whose first step is below short_t. The default
/// constructor takes the library's defaults.
struct CtxTier {
    uint32_t short_t;
    uint32_t long_t;
    uint32_t long_bits;  ///< 2 (the only narrower encoding)
    bool verbose;        ///< add every transition to the summary on stderr
    std::string file;    ///< receives the call's summary as JSON ("": none)

    CtxTier() {
        tl_ctx_tier_params p;
        detail::check(tl_ctx_tier_default_params(&p));
        short_t = p.short_t;
        long_t = p.long_t;
        long_bits = p.long_bits;
        verbose = p.verbose;
    }

    /// The C struct; it points into this object's `file`.
    tl_ctx_tier_params to_c() const {
        tl_ctx_tier_params p;
        detail::check(tl_ctx_tier_default_params(&p));
        p.short_t = short_t;
        p.long_t = long_t;
        p.long_bits = long_bits;
        p.verbose = verbose;
        p.file = file.empty() ? nullptr : file.c_str();
        return p;
    }
};

/// The thresholds of a BETA-MONitored call (docs/ABI.md "BETA-MON"); the default constructor
/// takes the library's defaults (0.5 bits, 6 bits, 0.95).
struct BetaMonitor {
    double low_entropy_bits;   ///< entropies below count in beta_mon_low_rate
    double high_entropy_bits;  ///< entropies above count in beta_mon_high_rate
    double agreement_floor;    ///< speculative calls: an agreement below this is flagged

    BetaMonitor() {
        tl_generate_params p;
        detail::check(tl_generate_default_params(&p));
        low_entropy_bits = p.beta_mon_low_entropy_bits;
        high_entropy_bits = p.beta_mon_high_entropy_bits;
        agreement_floor = p.beta_mon_agreement_floor;
    }
};

/// Options of one generation call; the default constructor takes the library's defaults
/// (greedy, 128 tokens, the model's default loops).
struct GenerateOptions {
    uint32_t max_tokens;
    int32_t loops;  ///< 1..max_loops, or TL_LOOPS_DEFAULT
    float temperature;
    uint32_t top_k;
    float top_p;
    uint64_t seed;
    std::vector<int32_t> stop;
    /// Generate after this cache's prefix (built at the same loops): the same tokens as
    /// generating from prefix + prompt. generate and generate_stream only; not owned.
    const PrefixCache* prefix_cache = nullptr;
    /// The call's CTX-TIER policy; empty: the TINYLOOP_CTX_TIER* environment's policy when the
    /// model was opened, or no tiers.
    std::optional<CtxTier> ctx_tier;
    /// BETA-MON this call with these thresholds: its summary is then in last_generate_stats()
    /// (`beta_mon` true). Empty: monitored only when TINYLOOP_BETA_MONITOR=1.
    std::optional<BetaMonitor> beta_monitor;
    /// Adaptive exit (docs/ABI.md "Adaptive exit"): exit_threshold, in [0, 1], or exit ("gate":
    /// the model's own threshold, or "gate:T"; not both) takes each token from the first loop
    /// iteration whose cumulative exit probability reaches the threshold, on a model with an
    /// exit gate (Ouro). exit also takes Huginn's criteria, on any model: "entropy-diff",
    /// "latent-diff", "cosine", "kl", "minp-kl" (each optionally ":T") and "argmax-stability"
    /// or "argmax" (optionally ":N"), which stop each call at the first iteration where they
    /// fire; empty: no exit rule. exit_policy "reference" (also empty: the model's own code's
    /// semantics) or "skip" (generated tokens stop at their exit iteration and copy its KV into
    /// the slots they skip).
    /// generate, generate_stream, generate_text, generate_text_stream and score_exit only;
    /// last_generate_stats() then has exit_tokens and exit_mean_steps.
    std::optional<double> exit_threshold;
    std::string exit;
    std::string exit_policy;

    GenerateOptions() {
        tl_generate_params p;
        detail::check(tl_generate_default_params(&p));
        max_tokens = p.max_tokens;
        loops = p.loops;
        temperature = p.temperature;
        top_k = p.top_k;
        top_p = p.top_p;
        seed = p.seed;
    }

    tl_generate_params to_c() const {
        tl_generate_params p;
        detail::check(tl_generate_default_params(&p));
        p.max_tokens = max_tokens;
        p.loops = loops;
        p.temperature = temperature;
        p.top_k = top_k;
        p.top_p = top_p;
        p.seed = seed;
        p.stop_tokens = stop.empty() ? nullptr : stop.data();
        p.n_stop_tokens = stop.size();
        if (prefix_cache != nullptr && prefix_cache->get() == nullptr)
            throw Error(TL_ERR_INVALID_ARGUMENT, "GenerateOptions::prefix_cache was moved from");
        p.prefix_cache = prefix_cache != nullptr ? prefix_cache->get() : nullptr;
        if (ctx_tier) {
            ctx_tier_c_ = ctx_tier->to_c();
            p.ctx_tier = &ctx_tier_c_;
        }
        if (beta_monitor) {
            p.beta_monitor = true;
            p.beta_mon_low_entropy_bits = beta_monitor->low_entropy_bits;
            p.beta_mon_high_entropy_bits = beta_monitor->high_entropy_bits;
            p.beta_mon_agreement_floor = beta_monitor->agreement_floor;
        }
        if (exit_threshold) {
            // The C ABI reads a negative threshold as none; here that is an empty optional.
            if (*exit_threshold < 0)
                throw Error(TL_ERR_INVALID_ARGUMENT,
                            "GenerateOptions::exit_threshold " + std::to_string(*exit_threshold) +
                                " must lie in [0, 1] (empty: no threshold)");
            p.exit_threshold = *exit_threshold;
        }
        p.exit = exit.empty() ? nullptr : detail::c_str(exit, "GenerateOptions::exit");
        p.exit_policy = exit_policy.empty()
                            ? nullptr
                            : detail::c_str(exit_policy, "GenerateOptions::exit_policy");
        return p;
    }

  private:
    // What `to_c` points to: lives as long as these options.
    mutable tl_ctx_tier_params ctx_tier_c_{};
};

/// The static architecture of a model plus the options it was opened with.
/// How a text call tokenizes its prompt and turns the generated tokens into text.
struct TextOptions {
    /// Stop strings: generation ends once the generated text contains one (also across
    /// tokens); the text returned ends before it. None may be empty.
    std::vector<std::string> stop;
    /// Add the tokenizer's special tokens (its BOS, ...) to the prompt; false for a prompt
    /// from apply_chat_template, which has them already.
    bool add_special_tokens = true;
    /// Leave special tokens out of the generated text.
    bool skip_special_tokens = true;
};

/// One message of a conversation for Model::apply_chat_template.
struct ChatMessage {
    std::string role;  ///< "system", "user", "assistant", or another role the template knows
    std::string content;
};

namespace detail {
/// TextOptions in C form; the pointers refer to the options, which must outlive it.
struct CText {
    std::vector<const char*> stops;
    tl_text_params params;

    explicit CText(const TextOptions& t) {
        check(tl_text_default_params(&params));
        for (const std::string& stop : t.stop) stops.push_back(c_str(stop, "stop string"));
        params.stop = stops.data();
        params.n_stop = stops.size();
        params.add_special_tokens = t.add_special_tokens;
        params.skip_special_tokens = t.skip_special_tokens;
    }
};
}  // namespace detail

struct Config {
    uint32_t dim, n_heads, n_kv_heads, ffn_dim, vocab_size, embed_factor_dim;
    uint32_t n_pre_blocks, n_loop_blocks, n_post_blocks, default_loops;
    std::string norm;  ///< "rmsnorm" | "layernorm"
    double norm_eps, rope_theta;
    uint32_t max_position;
    std::string head;  ///< "untied" | "tied"
    uint32_t max_seq_len, prefill_chunk, max_loops;
};

/// What score_exit returns: logits [tokens.size() * vocab] (row-major), each position's from its
/// exit iteration, and those iterations (1-based).
struct ExitScores {
    std::vector<float> logits;
    std::vector<int32_t> exit_steps;
};

namespace detail {

/// Stream state: the user's callable, and an exception it threw (rethrown after the C call,
/// since exceptions must not cross the C boundary).
template <class F>
struct Stream {
    F* fn;
    std::exception_ptr error;

    static bool callback(int32_t token, void* user_data) noexcept {
        auto* self = static_cast<Stream*>(user_data);
        try {
            if constexpr (std::is_same_v<decltype((*self->fn)(token)), void>) {
                (*self->fn)(token);
                return true;
            } else {
                return static_cast<bool>((*self->fn)(token));
            }
        } catch (...) {
            self->error = std::current_exception();
            return false;
        }
    }
};

/// Text stream state: the user's callable on std::string_view pieces, and an exception it threw.
template <class F>
struct TextStream {
    F* fn;
    std::exception_ptr error;

    static bool callback(const char* piece, std::size_t len, void* user_data) noexcept {
        auto* self = static_cast<TextStream*>(user_data);
        try {
            std::string_view text(piece, len);
            if constexpr (std::is_same_v<decltype((*self->fn)(text)), void>) {
                (*self->fn)(text);
                return true;
            } else {
                return static_cast<bool>((*self->fn)(text));
            }
        } catch (...) {
            self->error = std::current_exception();
            return false;
        }
    }
};

/// Calls shared by Model (its default session) and Session. `Self` supplies the C functions.
template <class Self, class Handle>
class Runner {
public:
    /// Up to opts.max_tokens new tokens after `prompt` (the stop token is not returned).
    std::vector<int32_t> generate(Tokens prompt, const GenerateOptions& opts = {}) const {
        tl_generate_params p = opts.to_c();
        std::vector<int32_t> out(opts.max_tokens > 0 ? opts.max_tokens : 1);
        std::size_t n = 0;
        check(Self::c_generate(handle(), prompt.data(), prompt.size(), &p, out.data(), out.size(),
                               &n));
        out.resize(n);
        return out;
    }

    /// Call `on_token(token)` for each new token as soon as it exists, on this thread. It may
    /// return bool (false stops generation) or void. An exception it throws stops generation
    /// and is rethrown here.
    template <class F>
    void generate_stream(Tokens prompt, const GenerateOptions& opts, F&& on_token) const {
        tl_generate_params p = opts.to_c();
        using Fn = std::remove_reference_t<F>;
        Stream<Fn> stream{&on_token, nullptr};
        tl_status status = Self::c_stream(handle(), prompt.data(), prompt.size(), &p,
                                          &Stream<Fn>::callback, &stream);
        if (stream.error) std::rethrow_exception(stream.error);
        check(status);
    }

    /// Logits [vocab] at the last position.
    std::vector<float> score_last(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        return score_call(Self::c_score_last, tokens, loops);
    }

    /// Logits [tokens.size() * vocab], row-major.
    std::vector<float> score(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        return score_call(Self::c_score, tokens, loops);
    }

    /// Score under the exit rule of opts (exit_threshold or exit, and exit_policy; a rule is
    /// required) at opts.loops. tokens[0, prompt_len) run as a generation call's prompt and every
    /// later token as a generated one (its own step at the rule's policy), so scoring a greedy
    /// generation's prompt and tokens gives, from row prompt_len - 1 on, its tokens as the argmax
    /// and its exit iterations. The other options are not read (prefix_cache must be null).
    ExitScores score_exit(Tokens tokens, std::size_t prompt_len, const GenerateOptions& opts) const {
        tl_generate_params p = opts.to_c();
        std::size_t need = 0;
        tl_status status = Self::c_score_exit(handle(), tokens.data(), tokens.size(), prompt_len,
                                              &p, nullptr, 0, &need, nullptr);
        if (status != TL_ERR_BUFFER_TOO_SMALL) check(status);
        ExitScores out{std::vector<float>(need), std::vector<int32_t>(tokens.size())};
        check(Self::c_score_exit(handle(), tokens.data(), tokens.size(), prompt_len, &p,
                                 out.logits.data(), out.logits.size(), &need,
                                 out.exit_steps.data()));
        return out;
    }

    /// log p(tokens[i+1] | tokens[..=i]), tokens.size() - 1 values.
    std::vector<float> logprobs(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        return score_call(Self::c_logprobs, tokens, loops);
    }

    /// logprobs computed through the decode path: each token but the last fed as its own
    /// one-row decode step, exactly as generation feeds the tokens it produces.
    std::vector<float> logprobs_decode(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        return score_call(Self::c_logprobs_decode, tokens, loops);
    }

    /// Stop the call running (in another thread): a generation at its next token, a score call
    /// at its next block application; it then throws Error with TL_ERR_CANCELLED. Callable
    /// from any thread.
    void cancel() const { check(Self::c_cancel(handle())); }

    /// The logit lens: logits [loops * vocab] (row-major) at the last position, read out after
    /// each loop iteration; row L-1 equals score_last(tokens, L).
    std::vector<float> score_logit_lens(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        return score_call(Self::c_score_logit_lens, tokens, loops);
    }

    /// The last position's path through the loop iterations, one point per iteration.
    std::vector<tl_trajectory_point> score_trajectory(Tokens tokens,
                                                      int32_t loops = TL_LOOPS_DEFAULT) const {
        return score_call(Self::c_score_trajectory, tokens, loops);
    }

    /// Self-speculative generation at opts.loops (the verify loops), drafting spec.draft_len
    /// tokens at a time at spec.draft_loops. Greedy output equals generate's.
    std::vector<int32_t> generate_speculative(Tokens prompt, const GenerateOptions& opts,
                                              const SpeculativeOptions& spec) const {
        tl_generate_params p = opts.to_c();
        tl_speculative_params sp = spec.to_c();
        std::vector<int32_t> out(opts.max_tokens > 0 ? opts.max_tokens : 1);
        std::size_t n = 0;
        check(Self::c_generate_speculative(handle(), prompt.data(), prompt.size(), &p, &sp,
                                           out.data(), out.size(), &n));
        out.resize(n);
        return out;
    }

    /// generate_speculative with reuse off, under the reference pages' name: the verify pass
    /// recomputes every block application instead of continuing from the draft's KV and hidden
    /// state. The same tokens, slower; the baseline that draft reuse is measured against.
    std::vector<int32_t> generate_speculative_no_cache(
        Tokens prompt, const GenerateOptions& opts, uint32_t draft_loops,
        uint32_t draft_len = SpeculativeOptions().draft_len) const {
        SpeculativeOptions spec;
        spec.draft_loops = draft_loops;
        spec.draft_len = draft_len;
        spec.reuse = false;
        return generate_speculative(prompt, opts, spec);
    }

    /// Run `tokens` at `loops` and keep their KV entries for generate with
    /// GenerateOptions::prefix_cache (at the same loops), on any session of this model.
    PrefixCache build_prefix_cache(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        tl_prefix_cache* cache = nullptr;
        check(Self::c_prefix_cache_new(handle(), tokens.data(), tokens.size(), loops, &cache));
        return PrefixCache(cache);
    }

    /// Run the prompt `tokens` at `loops` and keep what resume_generate needs to generate after
    /// it at any loop count.
    ResumeHandle build_resume_handle(Tokens tokens, int32_t loops = TL_LOOPS_DEFAULT) const {
        tl_resume_handle* h = nullptr;
        check(Self::c_resume_handle_new(handle(), tokens.data(), tokens.size(), loops, &h));
        return ResumeHandle(h);
    }

    /// Generate after the prompt of `h` at opts.loops (any depth): the same tokens as generate
    /// from that prompt at those loops.
    std::vector<int32_t> resume_generate(const ResumeHandle& h,
                                         const GenerateOptions& opts = {}) const {
        tl_generate_params p = opts.to_c();
        std::vector<int32_t> out(opts.max_tokens > 0 ? opts.max_tokens : 1);
        std::size_t n = 0;
        check(Self::c_resume_generate(handle(), h.get(), &p, out.data(), out.size(), &n));
        out.resize(n);
        return out;
    }

    /// Generate after the text `prompt`, tokenized by the model's tokenizer; returns the
    /// generated text. Generation also ends at the tokenizer's end-of-sequence tokens and at
    /// text.stop.
    std::string generate_text(const std::string& prompt, const GenerateOptions& opts = {},
                              const TextOptions& text = {}) const {
        tl_generate_params p = opts.to_c();
        detail::CText t(text);
        const char* c_prompt = detail::c_str(prompt, "prompt");
        std::size_t need = 0;
        tl_status status =
            Self::c_generate_text(handle(), c_prompt, &p, &t.params, nullptr, 0, &need);
        if (status != TL_ERR_BUFFER_TOO_SMALL) check(status);
        std::string out(need, '\0');
        check(Self::c_generate_text(handle(), c_prompt, &p, &t.params, out.data(), out.size(),
                                    &need));
        out.resize(need > 0 ? need - 1 : 0);
        return out;
    }

    /// generate_text calling `on_piece(std::string_view)` with each piece of generated text as
    /// soon as it is known (whole characters, never part of a stop string), on this thread. It
    /// may return bool (false stops generation) or void; an exception it throws stops
    /// generation and is rethrown here.
    template <class F>
    void generate_text_stream(const std::string& prompt, const GenerateOptions& opts,
                              const TextOptions& text, F&& on_piece) const {
        tl_generate_params p = opts.to_c();
        detail::CText t(text);
        using Fn = std::remove_reference_t<F>;
        TextStream<Fn> stream{&on_piece, nullptr};
        tl_status status = Self::c_generate_text_stream(
            handle(), detail::c_str(prompt, "prompt"), &p, &t.params, &TextStream<Fn>::callback,
            &stream);
        if (stream.error) std::rethrow_exception(stream.error);
        check(status);
    }

    /// log p(token[i+1] | tokens[..=i]) for the tokens of `text` under the model's tokenizer,
    /// with its special tokens: one value per token after the first.
    std::vector<float> score_text(const std::string& text, int32_t loops = TL_LOOPS_DEFAULT) const {
        const char* c_text = detail::c_str(text, "text");
        std::size_t need = 0;
        tl_status status = Self::c_score_text(handle(), c_text, loops, nullptr, 0, &need);
        if (status != TL_ERR_BUFFER_TOO_SMALL) check(status);
        std::vector<float> out(need > 0 ? need : 1);
        check(Self::c_score_text(handle(), c_text, loops, out.data(), out.size(), &need));
        out.resize(need);
        return out;
    }

    /// What the last successful generation call here did (tokens, times, drafts accepted, exit
    /// iterations).
    tl_generate_stats last_generate_stats() const {
        tl_generate_stats stats{};
        stats.struct_size = sizeof stats;
        check(Self::c_last_generate_stats(handle(), &stats));
        return stats;
    }

protected:
    Handle* handle() const noexcept { return static_cast<const Self*>(this)->get(); }

private:
    /// A C function that fills a buffer of T for tokens at some loops.
    template <class T>
    using BufferFn = tl_status (*)(const Handle*, const int32_t*, std::size_t, int32_t, T*,
                                   std::size_t, std::size_t*);

    template <class T>
    std::vector<T> score_call(BufferFn<T> fn, Tokens tokens, int32_t loops) const {
        // Ask for the required length first (a NULL buffer of capacity 0), then fill.
        std::size_t need = 0;
        tl_status status = fn(handle(), tokens.data(), tokens.size(), loops, nullptr, 0, &need);
        if (status != TL_ERR_BUFFER_TOO_SMALL) {
            check(status);  // a real error (TL_OK is impossible for a zero-capacity buffer
            need = 0;       // unless nothing is needed)
        }
        std::vector<T> out(need > 0 ? need : 1);
        std::size_t n = 0;
        check(fn(handle(), tokens.data(), tokens.size(), loops, out.data(), out.size(), &n));
        out.resize(n);
        return out;
    }
};

}  // namespace detail

class Session;

/// An open .tinyloop model: weights on one device plus a default session. Move-only.
class Model : public detail::Runner<Model, tl_model> {
public:
    /// Open `path` (throws Error: TL_ERR_IO, TL_ERR_FORMAT naming the failure point, ...).
    explicit Model(const std::string& path, const ModelOptions& opts = ModelOptions()) {
        check_abi();
        tl_model_params p;
        detail::check(tl_model_default_params(&p));
        p.max_seq_len = opts.max_seq_len;
        p.prefill_chunk = opts.prefill_chunk;
        p.max_loops = opts.max_loops;
        p.log = opts.log;
        p.fp16_body = opts.fp16_body;
        p.device = opts.device.empty() ? nullptr : opts.device.c_str();
        p.kv_mode = opts.kv_mode.empty() ? nullptr : opts.kv_mode.c_str();
        p.state_init = opts.state_init.empty() ? nullptr : opts.state_init.c_str();
        detail::check(tl_model_open(path.c_str(), &p, &ptr_));
    }
    Model(const Model&) = delete;
    Model& operator=(const Model&) = delete;
    Model(Model&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
    Model& operator=(Model&& other) noexcept {
        if (this != &other) {
            tl_model_free(ptr_);
            ptr_ = std::exchange(other.ptr_, nullptr);
        }
        return *this;
    }
    ~Model() { tl_model_free(ptr_); }

    /// Release the weights and default session now (idempotent; a running call on the default
    /// session is cancelled and awaited). Later calls throw Error(TL_ERR_CLOSED).
    void close() { detail::check(tl_close(ptr_)); }

    Config config() const {
        tl_config c;
        c.struct_size = sizeof c;
        detail::check(tl_model_config(ptr_, &c));
        return Config{c.dim,          c.n_heads,       c.n_kv_heads,    c.ffn_dim,
                      c.vocab_size,   c.embed_factor_dim, c.n_pre_blocks, c.n_loop_blocks,
                      c.n_post_blocks, c.default_loops, c.norm,         c.norm_eps,
                      c.rope_theta,   c.max_position,  c.head,          c.max_seq_len,
                      c.prefill_chunk, c.max_loops};
    }

    /// Device memory of the weights and all live sessions, in MB (10^6 bytes).
    double vram_usage_mb() const {
        double mb = 0;
        detail::check(tl_vram_usage_mb(ptr_, &mb));
        return mb;
    }

    /// The device the weights live on, in words.
    std::string device() const { return text(tl_model_device); }

    /// The KV cache mode of the model's sessions (as opened, or chosen by the environment).
    std::string kv_mode() const { return text(tl_model_kv_mode); }

    /// A new session over this model's weights (defined below).
    Session new_session() const;

    /// The token ids of `text` under the model's tokenizer; with add_special_tokens, those the
    /// tokenizer adds around a text (its BOS, ...). Never waits for a running call.
    std::vector<int32_t> tokenize(const std::string& text, bool add_special_tokens = true) const {
        const char* c_text = detail::c_str(text, "text");
        std::size_t need = 0;
        tl_status status = tl_tokenize(ptr_, c_text, add_special_tokens, nullptr, 0, &need);
        if (status != TL_ERR_BUFFER_TOO_SMALL) detail::check(status);
        std::vector<int32_t> out(need > 0 ? need : 1);
        detail::check(tl_tokenize(ptr_, c_text, add_special_tokens, out.data(), out.size(), &need));
        out.resize(need);
        return out;
    }

    /// The text of `tokens` (special tokens left out with skip_special_tokens); bytes that do
    /// not form UTF-8 become U+FFFD.
    std::string detokenize(Tokens tokens, bool skip_special_tokens = false) const {
        return sized_text([&](char* out, std::size_t cap, std::size_t* len) {
            return tl_detokenize(ptr_, tokens.data(), tokens.size(), skip_special_tokens, out,
                                 cap, len);
        });
    }

    /// The id of the special token written `text` (e.g. "<|im_end|>"); an unknown one throws
    /// Error with TL_ERR_INVALID_ARGUMENT naming it.
    int32_t special_token(const std::string& text) const {
        int32_t id = 0;
        detail::check(tl_special_token(ptr_, detail::c_str(text, "text"), &id));
        return id;
    }

    /// `messages` rendered by the model's chat template; with add_generation_prompt, followed
    /// by the start of the assistant's reply. Generate from it with
    /// TextOptions::add_special_tokens false.
    std::string apply_chat_template(const std::vector<ChatMessage>& messages,
                                    bool add_generation_prompt = true) const {
        std::vector<tl_chat_message> c;
        for (const ChatMessage& m : messages)
            c.push_back({detail::c_str(m.role, "role"), detail::c_str(m.content, "content")});
        return sized_text([&](char* out, std::size_t cap, std::size_t* len) {
            return tl_apply_chat_template(ptr_, c.data(), c.size(), add_generation_prompt, out,
                                          cap, len);
        });
    }

private:
    /// The NUL-terminated text `get(out, cap, len)` writes: a size query, then the call.
    template <class Get>
    static std::string sized_text(Get&& get) {
        std::size_t need = 0;
        tl_status status = get(nullptr, 0, &need);
        if (status != TL_ERR_BUFFER_TOO_SMALL) detail::check(status);
        std::string s(need, '\0');
        detail::check(get(s.data(), s.size(), &need));
        s.resize(need > 0 ? need - 1 : 0);
        return s;
    }

    /// The string a tl_model_* text accessor writes.
    std::string text(tl_status (*get)(const tl_model*, char*, std::size_t, std::size_t*)) const {
        std::size_t need = 0;
        tl_status status = get(ptr_, nullptr, 0, &need);
        if (status != TL_ERR_BUFFER_TOO_SMALL) detail::check(status);
        std::string s(need, '\0');
        detail::check(get(ptr_, s.data(), s.size(), &need));
        s.resize(need > 0 ? need - 1 : 0);
        return s;
    }

public:
    /// The C handle (owned by this object).
    tl_model* get() const noexcept { return ptr_; }

    static constexpr auto c_generate = tl_generate;
    static constexpr auto c_stream = tl_generate_stream;
    static constexpr auto c_score_last = tl_score_last;
    static constexpr auto c_score = tl_score;
    static constexpr auto c_score_exit = tl_score_exit;
    static constexpr auto c_logprobs = tl_logprobs;
    static constexpr auto c_logprobs_decode = tl_logprobs_decode;
    static constexpr auto c_cancel = tl_cancel;
    static constexpr auto c_score_logit_lens = tl_score_logit_lens;
    static constexpr auto c_score_trajectory = tl_score_trajectory;
    static constexpr auto c_generate_speculative = tl_generate_speculative;
    static constexpr auto c_prefix_cache_new = tl_prefix_cache_new;
    static constexpr auto c_resume_handle_new = tl_resume_handle_new;
    static constexpr auto c_resume_generate = tl_resume_generate;
    static constexpr auto c_last_generate_stats = tl_last_generate_stats;
    static constexpr auto c_generate_text = tl_generate_text;
    static constexpr auto c_generate_text_stream = tl_generate_text_stream;
    static constexpr auto c_score_text = tl_score_text;

private:
    tl_model* ptr_ = nullptr;
};

/// One sequence's buffers and KV cache over a Model's weights. Move-only; it keeps the weights
/// alive even after the Model is closed or destroyed.
class Session : public detail::Runner<Session, tl_session> {
public:
    explicit Session(tl_session* ptr) noexcept : ptr_(ptr) {}
    Session(const Session&) = delete;
    Session& operator=(const Session&) = delete;
    Session(Session&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
    Session& operator=(Session&& other) noexcept {
        if (this != &other) {
            tl_session_free(ptr_);
            ptr_ = std::exchange(other.ptr_, nullptr);
        }
        return *this;
    }
    ~Session() { tl_session_free(ptr_); }

    tl_session* get() const noexcept { return ptr_; }

    static constexpr auto c_generate = tl_session_generate;
    static constexpr auto c_stream = tl_session_generate_stream;
    static constexpr auto c_score_last = tl_session_score_last;
    static constexpr auto c_score = tl_session_score;
    static constexpr auto c_score_exit = tl_session_score_exit;
    static constexpr auto c_logprobs = tl_session_logprobs;
    static constexpr auto c_logprobs_decode = tl_session_logprobs_decode;
    static constexpr auto c_cancel = tl_session_cancel;
    static constexpr auto c_score_logit_lens = tl_session_score_logit_lens;
    static constexpr auto c_score_trajectory = tl_session_score_trajectory;
    static constexpr auto c_generate_speculative = tl_session_generate_speculative;
    static constexpr auto c_prefix_cache_new = tl_session_prefix_cache_new;
    static constexpr auto c_resume_handle_new = tl_session_resume_handle_new;
    static constexpr auto c_resume_generate = tl_session_resume_generate;
    static constexpr auto c_last_generate_stats = tl_session_last_generate_stats;
    static constexpr auto c_generate_text = tl_session_generate_text;
    static constexpr auto c_generate_text_stream = tl_session_generate_text_stream;
    static constexpr auto c_score_text = tl_session_score_text;

private:
    tl_session* ptr_ = nullptr;
};

inline Session Model::new_session() const {
    tl_session* s = nullptr;
    detail::check(tl_session_new(ptr_, &s));
    return Session(s);
}

/// How an engine is sized (docs/ABI.md "Engines"); starts from the library's defaults.
struct EngineOptions {
    uint32_t max_step_rows;   ///< rows one step runs at most (decode rows and prompt chunks)
    uint32_t max_running;     ///< requests that run at once; more wait in the queue
    uint32_t page_size;       ///< positions per KV page
    uint32_t max_queued;      ///< requests waiting at most; submit beyond it throws TL_ERR_BUSY
    uint64_t pool_positions;  ///< positions of the KV pool; 0: 8 × max_seq_len

    EngineOptions() {
        tl_engine_params p;
        detail::check(tl_engine_default_params(&p));
        max_step_rows = p.max_step_rows;
        max_running = p.max_running;
        page_size = p.page_size;
        max_queued = p.max_queued;
        pool_positions = p.pool_positions;
    }
};

/// One event of a request (Engine::next): a token, its end (with what it did), or nothing yet.
struct EngineEvent {
    enum class Kind { None, Token, Done };
    Kind kind = Kind::None;
    int32_t token = -1;
    tl_request_stats stats{};
};

/// Many concurrent requests over one model, batched at every step: each request's tokens are
/// those Model::generate gives it alone. Move-only; ~Engine frees it (its queued and running
/// requests end with TL_ERR_CANCELLED). Every method may be called from any thread; the events
/// of different requests may be taken from different threads at once. CPU models only.
class Engine {
public:
    explicit Engine(const Model& model, const EngineOptions& opts = EngineOptions()) {
        tl_engine_params p;
        detail::check(tl_engine_default_params(&p));
        p.max_step_rows = opts.max_step_rows;
        p.max_running = opts.max_running;
        p.page_size = opts.page_size;
        p.max_queued = opts.max_queued;
        p.pool_positions = opts.pool_positions;
        detail::check(tl_engine_new(model.get(), &p, &ptr_));
    }
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;
    Engine(Engine&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)) {}
    Engine& operator=(Engine&& other) noexcept {
        if (this != &other) {
            tl_engine_free(ptr_);
            ptr_ = std::exchange(other.ptr_, nullptr);
        }
        return *this;
    }
    ~Engine() { tl_engine_free(ptr_); }

    /// Queue a request (the options of Model::generate; no prefix cache, CTX-TIER, BETA-MON or
    /// exit rule) and return its id.
    uint64_t submit(Tokens prompt, const GenerateOptions& opts = {}) const {
        tl_generate_params p = opts.to_c();
        uint64_t id = 0;
        detail::check(tl_engine_submit(ptr_, prompt.data(), prompt.size(), &p, &id));
        return id;
    }

    /// The next event of request `id`, waiting up to `timeout_ms` (-1: until there is one).
    /// A request that ended without finishing throws its error (TL_ERR_CANCELLED when it was
    /// cancelled or the engine freed).
    EngineEvent next(uint64_t id, int32_t timeout_ms = -1) const {
        tl_engine_event e;
        detail::check(tl_engine_next(ptr_, id, timeout_ms, &e));
        EngineEvent out;
        out.kind = e.kind == TL_EVENT_TOKEN  ? EngineEvent::Kind::Token
                   : e.kind == TL_EVENT_DONE ? EngineEvent::Kind::Done
                                             : EngineEvent::Kind::None;
        out.token = e.token;
        out.stats = e.stats;
        return out;
    }

    /// Every remaining token of request `id`, once it has finished; `stats` (if given) receives
    /// what it did.
    std::vector<int32_t> wait(uint64_t id, tl_request_stats* stats = nullptr) const {
        std::vector<int32_t> tokens;
        for (;;) {
            EngineEvent e = next(id);
            if (e.kind == EngineEvent::Kind::Done) {
                if (stats != nullptr) *stats = e.stats;
                return tokens;
            }
            tokens.push_back(e.token);
        }
    }

    /// Cancel request `id` (throws TL_ERR_INVALID_ARGUMENT once it has ended).
    void cancel(uint64_t id) const { detail::check(tl_engine_cancel(ptr_, id)); }

    /// The queue, running requests, KV pool use and step counts now.
    tl_engine_stats stats() const {
        tl_engine_stats s;
        detail::check(tl_engine_get_stats(ptr_, &s));
        return s;
    }

    tl_engine* get() const noexcept { return ptr_; }

private:
    tl_engine* ptr_ = nullptr;
};

}  // namespace tinyloop

#endif  // TINYLOOP_HPP
