//! The `tinyloop` command line: `tinyloop MODEL COMMAND ...` or `tinyloop synth ...`.

use std::ffi::{OsStr, OsString};
use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

#[path = "tinyloop/concurrent.rs"]
mod concurrent;
#[path = "tinyloop/position_buckets.rs"]
mod position_buckets;
#[path = "tinyloop/serve/mod.rs"]
mod serve;

use clap::error::ErrorKind;
use clap::{Args, CommandFactory, Parser, Subcommand};
use position_buckets::{BucketEdges, PositionBuckets};
use serde_json::json;
use tinyloop::env;
use tinyloop::model::flops::forward_flops;
use tinyloop::model::synth;
use tinyloop::{
    BetaMonEnv, BetaMonitor, ChatMessage, CtxTier, CtxTierStats, Device, EngineOptions, Error,
    GenerateParams, GenerateStats, KvMode, Model, ModelOptions, Result, SamplingParams,
    Speculation, TextParams, Tokenizer, DEFAULT_MAX_SEQ_LEN, MAX_DRAFT_LEN,
};

/// No upper bound on a whole-number option but its type's.
const MAX: u64 = u64::MAX;
/// The most timed repetitions of `bench`: its medians have long settled by then.
const MAX_REPEATS: u64 = 10_000;
/// Bit widths of block weights (`synth`, `convert`).
const WEIGHT_BITS: [u64; 3] = [16, 4, 2];

/// A parser of a whole-number option that accepts `lo..=hi`: a value outside (negative ones
/// included) or not a number is an error that states the range, after clap's naming of the
/// option and the value.
fn whole<T: TryFrom<u64> + Clone + Send + Sync + 'static>(
    lo: u64,
    hi: u64,
) -> impl Fn(&str) -> std::result::Result<T, String> + Clone + Send + Sync + 'static {
    move |text| {
        env::decimal(text)
            .filter(|n| (lo..=hi).contains(n))
            .and_then(|n| T::try_from(n).ok())
            .ok_or_else(|| format!("expected {}", env::integers(&(lo..=hi))))
    }
}

/// [`whole`] for an option that accepts only the listed values.
fn one_of<T: TryFrom<u64> + Clone + Send + Sync + 'static>(
    values: &'static [u64],
) -> impl Fn(&str) -> std::result::Result<T, String> + Clone + Send + Sync + 'static {
    move |text| {
        env::decimal(text)
            .filter(|n| values.contains(n))
            .and_then(|n| T::try_from(n).ok())
            .ok_or_else(|| format!("expected {}", env::either(values)))
    }
}

/// `--loops` and `--resume-from`: 1 to the `max_loops` the command opens models with.
fn loop_count() -> impl Fn(&str) -> std::result::Result<usize, String> + Clone + Send + Sync {
    whole(1, ModelOptions::default().max_loops as u64)
}

/// `--draft-loops`: below the verify loops, so at most `max_loops - 1`.
fn draft_loop_count() -> impl Fn(&str) -> std::result::Result<usize, String> + Clone + Send + Sync {
    whole(1, ModelOptions::default().max_loops as u64 - 1)
}

#[derive(Parser)]
#[command(
    name = "tinyloop",
    version,
    about = "Run looped transformers stored as .tinyloop files",
    override_usage = "tinyloop MODEL \
                      <info|generate|tokenize|score|bench|lens|trajectory|requantize> [OPTIONS]\n       \
                      tinyloop synth --preset NAME --seed S [--bits 4|2|16] --out PATH\n       \
                      tinyloop convert --safetensors F --config C --out PATH [OPTIONS]\n       \
                      tinyloop convert --hf DIR --out PATH [OPTIONS]\n       \
                      tinyloop help [COMMAND]",
    after_help = "`tinyloop help COMMAND` shows the options of a command (info, generate, \
                  tokenize, score, bench, lens, trajectory, requantize, synth, convert)."
)]
struct ModelCli {
    /// Path to a .tinyloop file.
    model: PathBuf,
    #[command(subcommand)]
    command: ModelCommand,
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Print the architecture and tensor statistics.
    Info {
        /// Print machine-readable JSON.
        #[arg(long)]
        json: bool,
    },
    /// Generate tokens after a prompt.
    Generate(GenerateArgs),
    /// Print the token ids of a text under the model's tokenizer.
    Tokenize(TokenizeArgs),
    /// Mean negative log-likelihood (nats/token) and perplexity of a text.
    Score(ScoreArgs),
    /// Measure load time, prefill throughput and decode latency.
    Bench(BenchArgs),
    /// The logit lens: the next-token distribution read out after each loop iteration.
    Lens(LensArgs),
    /// How the last position moves through the loop iterations (norm, change, KL, entropy).
    Trajectory(InputArgs),
    /// Serve the model over HTTP with the OpenAI API (/v1/completions, /v1/chat/completions,
    /// /v1/models), /health and Prometheus /metrics, through one engine (continuous batching).
    Serve(ServeArgs),
    /// Write a copy whose loop-block linears are re-quantized (round-to-nearest of the
    /// dequantized weights at the same group size) and/or whose f16 head is quantized
    /// (round-to-nearest); every other tensor is copied unchanged.
    Requantize {
        /// Bit width of the loop body in the copy: 2 or 4.
        #[arg(
            long,
            value_name = "BITS",
            value_parser = one_of::<u32>(&[2, 4]),
            required_unless_present = "head_bits"
        )]
        loop_body_bits: Option<u32>,
        /// Quantize the model's f16 head to this bit width (4 or 2) by round-to-nearest: a
        /// quarter of its bytes at 4 bits, which every decode step reads (docs/QUALITY.md gives
        /// its cost).
        #[arg(long, value_name = "BITS", value_parser = one_of::<u32>(&[2, 4]))]
        head_bits: Option<u32>,
        /// Group size of the quantized head (0: one group per row).
        #[arg(
            long,
            value_name = "G",
            requires = "head_bits",
            default_value_t = 128,
            value_parser = whole::<usize>(0, MAX)
        )]
        head_group_size: usize,
        /// Where to write the copy (not the input file).
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Args)]
struct ServeArgs {
    /// auto, cpu, cuda or cuda:N (default: TINYLOOP_DEVICE, else auto).
    #[arg(long)]
    device: Option<Device>,
    /// Upper bound on prompt + generated tokens of a request (default: 2048, or the model's
    /// max_position when that is smaller).
    #[arg(long, value_name = "N", value_parser = whole::<usize>(1, MAX))]
    max_seq_len: Option<usize>,
    /// KV cache mode: fp16, int8 or delta (default: as for the other commands).
    #[arg(long = "kv", value_name = "MODE")]
    kv: Option<KvMode>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// Port to listen on (0: any free port; the address is printed on stderr).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model's id in /v1/models and in responses (default: the file name without its
    /// extension).
    #[arg(long)]
    name: Option<String>,
    /// Rows one engine step runs at most (decode rows and prompt chunks together).
    #[arg(long, value_name = "N", value_parser = whole::<usize>(1, 65536))]
    max_step_rows: Option<usize>,
    /// Requests that run at once; more wait in the queue.
    #[arg(long, value_name = "N", value_parser = whole::<usize>(1, 65536))]
    max_running: Option<usize>,
    /// Positions of the KV pool that the running requests share (default: 8 × --max-seq-len);
    /// requests that do not fit wait.
    #[arg(long, value_name = "N", value_parser = whole::<usize>(1, MAX))]
    pool_positions: Option<usize>,
    /// Silence the library's load log.
    #[arg(long, short)]
    quiet: bool,
}

#[derive(Args, Clone)]
struct CommonArgs {
    /// auto, cpu, cuda or cuda:N (default: TINYLOOP_DEVICE, else auto).
    #[arg(long)]
    device: Option<Device>,
    /// Loop iterations (default: the model's default_loops).
    #[arg(long, value_parser = loop_count())]
    loops: Option<usize>,
    /// Upper bound on prompt + generated tokens, at most the model's max_position (default:
    /// 2048, or max_position when that is smaller).
    #[arg(long, value_name = "N", value_parser = whole::<usize>(1, MAX))]
    max_seq_len: Option<usize>,
    /// KV cache mode: fp16, fp16-h, int8-h, int4-h, int8, delta, age or age:A:B (default:
    /// TINYLOOP_KV_INT8=1 → int8, TINYLOOP_KV_DELTA=1 → delta, else fp16).
    #[arg(long = "kv", value_name = "MODE")]
    kv: Option<KvMode>,
    /// Prefill prompts in steps of N tokens (0: the whole prompt in one step). Score windows
    /// must then be at most N tokens.
    #[arg(long, default_value_t = 0, value_name = "N", value_parser = whole::<usize>(0, MAX))]
    prefill_chunk: usize,
    /// Print machine-readable JSON.
    #[arg(long)]
    json: bool,
    /// Silence the library's stderr lines: the load log and the CTX-TIER and BETA-MON lines
    /// (--json does too).
    #[arg(long, short)]
    quiet: bool,
    /// Keep an FP16 copy of the transformer blocks' weights on the GPU for prefill GEMMs through
    /// cuBLAS (default: TINYLOOP_EXPERIMENTAL_FP16_BODY=1).
    #[arg(long)]
    fp16_body: bool,
    /// How a loop that starts from a random state (Huginn) draws it: model (its own rule, from
    /// seed 0), zeros or seed:N. Other models accept only model.
    #[arg(long, value_name = "INIT")]
    state_init: Option<tinyloop::StateInit>,
}

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Prompt text, tokenized by the model's tokenizer; the generated text is printed as it
    /// streams.
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    prompt: Option<OsString>,
    /// Prompt token ids, comma-separated.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    tokens: Option<Vec<i64>>,
    /// Render the prompt as one user message with the model's chat template (and the start of
    /// the assistant's reply); only the reply is printed. With --prompt.
    #[arg(long)]
    chat: bool,
    /// Stop when the generated text contains STR (not printed); repeat for several. With
    /// --prompt.
    #[arg(long = "stop", value_name = "STR")]
    stop: Vec<String>,
    /// Tokens to generate after the prompt.
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = whole::<usize>(1, MAX))]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    speculation: SpeculationArgs,
    #[command(flatten)]
    ctx_tier: CtxTierArgs,
    #[command(flatten)]
    beta_mon: BetaMonArgs,
    #[command(flatten)]
    exit: ExitArgs,
}

/// Adaptive exit: each token takes the output of the loop iteration an exit rule picks
/// (docs/ABI.md "Adaptive exit").
#[derive(Args, Clone)]
struct ExitArgs {
    /// Exit with the model's exit gate once the cumulative exit probability reaches T (0..1);
    /// shorthand for --exit gate:T.
    #[arg(long, value_name = "T", conflicts_with = "exit")]
    exit_threshold: Option<f64>,
    /// Exit rule: gate (the model's own threshold) or gate:T; or a criterion that needs no
    /// gate: entropy-diff, latent-diff, cosine, kl, minp-kl (each optionally :T) or
    /// argmax-stability (alias argmax, optionally :N).
    #[arg(long, value_name = "RULE")]
    exit: Option<String>,
    /// reference (the model's own semantics) or skip (generated tokens, and every call with a
    /// criterion, stop at their exit iteration and copy its KV into the skipped slots).
    #[arg(long, value_name = "POLICY")]
    exit_policy: Option<String>,
}

impl ExitArgs {
    fn exit(&self) -> Result<Option<tinyloop::Exit>> {
        use tinyloop::{Exit, ExitPolicy, ExitRule};
        let rule = match (self.exit_threshold, &self.exit) {
            (Some(t), _) => {
                tinyloop::generate::exit::check_threshold(t)?;
                Some(ExitRule::Gate { threshold: Some(t) })
            }
            (None, Some(rule)) => Some(rule.parse()?),
            (None, None) => None,
        };
        let policy = match &self.exit_policy {
            Some(p) => p.parse()?,
            None => ExitPolicy::Reference,
        };
        match rule {
            Some(rule) => Ok(Some(Exit { rule, policy })),
            None if self.exit_policy.is_none() => Ok(None),
            None => Err(Error::InvalidArgument(
                "--exit-policy needs --exit or --exit-threshold".into(),
            )),
        }
    }
}

#[derive(Args)]
struct TokenizeArgs {
    /// The text.
    #[arg(long)]
    prompt: OsString,
    /// Render the text as one user message with the model's chat template first.
    #[arg(long)]
    chat: bool,
    /// Leave out the special tokens the tokenizer adds around a text (its BOS, ...).
    #[arg(long)]
    no_special_tokens: bool,
    /// Print machine-readable JSON.
    #[arg(long)]
    json: bool,
}

/// CTX-TIER: the loop body runs at INT2 once the context is long (docs/ABI.md "CTX-TIER").
#[derive(Args, Clone)]
struct CtxTierArgs {
    /// Re-pack the loop body to INT2 when the sequence reaches --ctx-tier-long-t tokens, back to
    /// INT4 below --ctx-tier-short-t (defaults: TINYLOOP_CTX_TIER_* or 512 / 2048).
    #[arg(long)]
    ctx_tier: bool,
    /// Back to INT4 on a call whose first step leaves the sequence shorter than N tokens
    /// (default: TINYLOOP_CTX_TIER_SHORT_T, else 512).
    #[arg(long, value_name = "N", requires = "ctx_tier", value_parser = whole::<usize>(1, MAX))]
    ctx_tier_short_t: Option<usize>,
    /// To INT2 once the sequence reaches N tokens (default: TINYLOOP_CTX_TIER_LONG_T, else
    /// 2048).
    #[arg(long, value_name = "N", requires = "ctx_tier", value_parser = whole::<usize>(1, MAX))]
    ctx_tier_long_t: Option<usize>,
    /// Bits of the loop body at LONG (only 2).
    #[arg(long, value_name = "BITS", requires = "ctx_tier", value_parser = one_of::<u32>(&[2]))]
    ctx_tier_long_bits: Option<u32>,
}

impl CtxTierArgs {
    /// The policy the flags ask for, on top of the environment's (`None` without --ctx-tier).
    fn policy(&self) -> Result<Option<CtxTier>> {
        if !self.ctx_tier {
            return Ok(None);
        }
        let base = CtxTier::from_env()?.unwrap_or_default();
        let policy = CtxTier {
            short_t: self.ctx_tier_short_t.unwrap_or(base.short_t),
            long_t: self.ctx_tier_long_t.unwrap_or(base.long_t),
            long_bits: self.ctx_tier_long_bits.unwrap_or(base.long_bits),
            ..base
        };
        policy.validate()?;
        Ok(Some(policy))
    }
}

/// BETA-MON: the entropy of each token's distribution and the draft/verify agreement
/// (docs/ABI.md "BETA-MON").
#[derive(Args)]
struct BetaMonArgs {
    /// Monitor the call: BETA-MON's summary line on stderr (`generate`), `beta_mon` in the
    /// JSON stats.
    #[arg(long)]
    beta_monitor: bool,
    /// Entropies below this many bits count as low.
    #[arg(
        long,
        value_name = "BITS",
        default_value_t = BetaMonitor::default().low_entropy_bits,
        allow_negative_numbers = true,
        requires = "beta_monitor"
    )]
    beta_mon_low_entropy_bits: f64,
    /// Entropies above this many bits count as high.
    #[arg(
        long,
        value_name = "BITS",
        default_value_t = BetaMonitor::default().high_entropy_bits,
        allow_negative_numbers = true,
        requires = "beta_monitor"
    )]
    beta_mon_high_entropy_bits: f64,
    /// Speculative calls: warn when the draft/verify agreement is below this share.
    #[arg(
        long,
        value_name = "SHARE",
        default_value_t = BetaMonitor::default().agreement_floor,
        allow_negative_numbers = true,
        requires = "beta_monitor"
    )]
    beta_mon_agreement_floor: f64,
}

impl BetaMonArgs {
    fn monitor(&self) -> Option<BetaMonitor> {
        self.beta_monitor.then_some(BetaMonitor {
            low_entropy_bits: self.beta_mon_low_entropy_bits,
            high_entropy_bits: self.beta_mon_high_entropy_bits,
            agreement_floor: self.beta_mon_agreement_floor,
        })
    }
}

/// Self-speculative decoding: draft at fewer loop iterations, verify at `--loops`.
#[derive(Args)]
struct SpeculationArgs {
    /// Draft tokens at this many loop iterations (below --loops) and verify them in one step.
    #[arg(long, value_name = "D", value_parser = draft_loop_count())]
    draft_loops: Option<usize>,
    /// Tokens drafted per verify step (with --draft-loops).
    #[arg(
        long,
        value_name = "K",
        default_value_t = 4,
        requires = "draft_loops",
        value_parser = whole::<usize>(1, MAX_DRAFT_LEN as u64)
    )]
    draft_len: usize,
    /// Verify by recomputing every block application (the baseline) instead of continuing from
    /// the draft's KV and hidden state (with --draft-loops).
    #[arg(long, requires = "draft_loops")]
    no_draft_reuse: bool,
}

impl SpeculationArgs {
    fn speculation(&self) -> Option<Speculation> {
        self.draft_loops.map(|draft_loops| Speculation {
            draft_loops,
            draft_len: self.draft_len,
            reuse: !self.no_draft_reuse,
        })
    }
}

/// The input of `lens` and `trajectory`.
#[derive(Args)]
struct InputArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Text (byte-level models only).
    #[arg(long, conflicts_with = "tokens", required_unless_present = "tokens")]
    text: Option<OsString>,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', allow_negative_numbers = true)]
    tokens: Option<Vec<i64>>,
}

#[derive(Args)]
struct LensArgs {
    #[command(flatten)]
    input: InputArgs,
    /// Most likely tokens shown per iteration (the --json output has every logit).
    #[arg(
        long,
        value_name = "K",
        default_value_t = 5,
        conflicts_with = "json",
        value_parser = whole::<usize>(0, MAX)
    )]
    top: usize,
}

/// How tokens are chosen (docs/ABI.md "Sampling").
#[derive(Args)]
struct SamplingArgs {
    /// Sampling temperature; 0 is greedy (the most likely token, no randomness).
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the K most likely tokens (default 0: every token; with --temperature).
    #[arg(long, value_name = "K", value_parser = whole::<usize>(0, MAX))]
    top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities reach P, in (0, 1] (default 1:
    /// every token; with --temperature).
    #[arg(long, value_name = "P", allow_negative_numbers = true)]
    top_p: Option<f32>,
    /// Seed of the sampler (default 0; with --temperature).
    #[arg(long, value_name = "S", value_parser = whole::<u64>(0, MAX))]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampling the flags ask for; --top-k, --top-p and --seed are errors when decoding is
    /// greedy, where they would change nothing.
    fn params(&self) -> Result<SamplingParams> {
        let tuned = self.top_k.is_some() || self.top_p.is_some() || self.seed.is_some();
        if self.temperature == 0.0 && tuned {
            return Err(Error::InvalidArgument(
                "--top-k, --top-p and --seed shape sampling: pass --temperature > 0 with them \
                 (temperature 0 is greedy)"
                    .into(),
            ));
        }
        let greedy = SamplingParams::default();
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k.unwrap_or(greedy.top_k),
            top_p: self.top_p.unwrap_or(greedy.top_p),
            seed: self.seed.unwrap_or(greedy.seed),
        })
    }
}

#[derive(Args)]
struct ScoreArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Text to score (byte-level models only).
    #[arg(long, group = "input")]
    text: Option<OsString>,
    /// File whose bytes are scored (byte-level models only).
    #[arg(long, group = "input")]
    file: Option<PathBuf>,
    /// Token ids, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        allow_negative_numbers = true,
        group = "input"
    )]
    tokens: Option<Vec<i64>>,
    /// Tokens per scored window; long inputs are split into independent windows.
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = whole::<usize>(2, MAX))]
    window: usize,
    /// Score only the first N tokens of the input.
    #[arg(long, value_name = "N", value_parser = whole::<usize>(2, MAX))]
    limit: Option<usize>,
    /// Also report the NLL per range of positions inside the window: edges `128,256` give
    /// [0, 128), [128, 256) and, for longer windows, [256, window).
    #[arg(long, value_name = "EDGES")]
    buckets: Option<BucketEdges>,
    /// Feed every token as its own one-row decode step, as generation does, instead of the
    /// window as one step (to check the decode path; slower).
    #[arg(long, conflicts_with = "ctx_tier")]
    decode_path: bool,
    #[command(flatten)]
    ctx_tier: CtxTierArgs,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    common: CommonArgs,
    /// Tokens of the prompt (fixed pseudo-random tokens unless --prompt-file).
    #[arg(long, value_name = "N", default_value_t = 128, value_parser = whole::<usize>(1, MAX))]
    prompt_len: usize,
    /// Take the prompt from a text instead: the first --prompt-len tokens of FILE (its bytes for
    /// a byte-level model, else its UTF-8 text through the model's tokenizer) from
    /// --prompt-offset bytes on. Figures that depend on the text (speculative acceptance, exit
    /// depth) are only meaningful on real prose.
    #[arg(long, value_name = "FILE")]
    prompt_file: Option<PathBuf>,
    /// Where in --prompt-file the prompt starts, in bytes (moved forward to the next character
    /// boundary for a tokenizer).
    #[arg(
        long,
        value_name = "BYTES",
        requires = "prompt_file",
        default_value_t = 0,
        value_parser = whole::<usize>(0, MAX)
    )]
    prompt_offset: usize,
    /// Tokens generated per run (at least 2: decode time is measured between tokens).
    #[arg(long, value_name = "N", default_value_t = 64, value_parser = whole::<usize>(2, MAX))]
    gen_len: usize,
    /// Timed repetitions; medians are reported.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = whole::<usize>(1, MAX_REPEATS))]
    repeats: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    speculation: SpeculationArgs,
    #[command(flatten)]
    beta_mon: BetaMonArgs,
    #[command(flatten)]
    exit: ExitArgs,
    /// Keep the first N prompt tokens in a prefix cache (built once) and time generation after it.
    #[arg(
        long,
        value_name = "N",
        conflicts_with_all = ["resume_from", "draft_loops"],
        value_parser = whole::<usize>(1, MAX)
    )]
    prefix_cache: Option<usize>,
    /// Run the prompt once at L loops into a resume handle and time resuming it at --loops.
    #[arg(long, value_name = "L", conflicts_with = "draft_loops", value_parser = loop_count())]
    resume_from: Option<usize>,
    /// Also time a score call (logits for every prompt position) over the prompt.
    #[arg(long)]
    score: bool,
    /// Also run N clients at once, each generating --repeats times on its own session and
    /// thread (or through one engine, with --engine), and report their aggregate tokens/s and
    /// latency percentiles.
    #[arg(
        long,
        value_name = "N",
        conflicts_with_all = ["prefix_cache", "resume_from", "draft_loops"],
        value_parser = whole::<usize>(1, 1024)
    )]
    concurrency: Option<usize>,
    /// Serve the --concurrency clients through one engine (continuous batching) instead of a
    /// session each.
    #[arg(long, requires = "concurrency")]
    engine: bool,
    /// The engine's rows per step (decode rows and prompt chunks together).
    #[arg(long, value_name = "N", requires = "engine", value_parser = whole::<usize>(1, 65536))]
    max_step_rows: Option<usize>,
    #[command(flatten)]
    ctx_tier: CtxTierArgs,
}

#[derive(Parser)]
#[command(name = "tinyloop", version)]
struct ToolCli {
    #[command(subcommand)]
    command: ToolCommand,
}

#[derive(Subcommand)]
enum ToolCommand {
    /// Write a deterministic random-weight model.
    Synth {
        /// One of: tiny, small, tl-407m, tiny-gqa, tiny-tied, tiny-sandwich, tiny-recurrent,
        /// ouro-1.4b, ouro-1.4b-own, huginn-3.5b.
        #[arg(long)]
        preset: String,
        /// A folder with a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json and
        /// optionally generation_config.json) to store in the model, whose vocabulary is then
        /// the tokenizer's.
        #[arg(long, value_name = "DIR")]
        tokenizer: Option<PathBuf>,
        /// A vocabulary of N tokens instead of the preset's; the model then has no tokenizer
        /// (unless N is 256: bytes) and takes and gives token ids only.
        #[arg(
            long,
            value_name = "N",
            conflicts_with = "tokenizer",
            value_parser = whole::<usize>(1, MAX)
        )]
        vocab_size: Option<usize>,
        /// Seed of the random weights; the same seed writes the same file.
        #[arg(long, default_value_t = 0, value_parser = whole::<u64>(0, MAX))]
        seed: u64,
        /// Bit width of block weights: 4, 2 or 16.
        #[arg(long, default_value_t = 4, value_parser = one_of::<u32>(&WEIGHT_BITS))]
        bits: u32,
        /// Quantization group size of 4 and 2 bits (default 128, or a tensor's columns when it
        /// has fewer); 0 means one group per row.
        #[arg(long, value_name = "G", value_parser = whole::<usize>(0, MAX))]
        group_size: Option<usize>,
        /// Where to write the model.
        #[arg(long)]
        out: PathBuf,
    },
    /// Convert a safetensors checkpoint (+ config JSON) to .tinyloop.
    Convert(ConvertArgs),
    /// Precompile the CUDA kernels with NVRTC into the folder that the library searches
    /// (packaging: scripts/install, the Python wheel).
    #[command(hide = true)]
    Kernels {
        /// Architecture, e.g. sm_90; repeat the option for several.
        #[arg(long = "arch", required = true)]
        archs: Vec<String>,
        /// Destination: the tinyloop/kernels folder beside the installed libtinyloop.so.
        #[arg(long)]
        out: PathBuf,
    },
}

#[derive(Args)]
struct ConvertArgs {
    /// Checkpoint with the tensor names of docs/FORMAT.md (F32, F16 or BF16).
    #[arg(
        long,
        required_unless_present = "hf",
        requires = "config",
        conflicts_with = "hf"
    )]
    safetensors: Option<PathBuf>,
    /// JSON file holding the `config` object of docs/FORMAT.md.
    #[arg(long, requires = "safetensors", conflicts_with = "hf")]
    config: Option<PathBuf>,
    /// A Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer files) of a
    /// supported family: OuroForCausalLM (Ouro), RavenForCausalLM (Huginn).
    #[arg(long, value_name = "DIR")]
    hf: Option<PathBuf>,
    /// Where to write the .tinyloop file.
    #[arg(long)]
    out: PathBuf,
    /// Bit width of block weights: 16, 4 or 2.
    #[arg(long, default_value_t = 4, value_parser = one_of::<u32>(&WEIGHT_BITS))]
    bits: u32,
    /// Quantization group size of 4 and 2 bits (default 128); it must divide every block
    /// linear's columns. 0 means one group per row.
    #[arg(long, value_name = "G", value_parser = whole::<usize>(0, MAX))]
    group_size: Option<usize>,
    /// rtn (round to nearest) or gptq (needs --calib; 4 and 2 bits).
    #[arg(long, default_value = "rtn")]
    method: String,
    /// Calibration text for GPTQ: its bytes for byte-level models, tokenized with the folder's
    /// tokenizer with --hf.
    #[arg(long, value_name = "FILE")]
    calib: Option<PathBuf>,
    /// Use at most this many bytes of the calibration text (with --calib).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 32768,
        requires = "calib",
        value_parser = whole::<usize>(2, MAX)
    )]
    calib_bytes: usize,
    /// Loop iterations while calibrating (default: the config's default_loops; with --calib).
    #[arg(long, value_name = "L", requires = "calib", value_parser = loop_count())]
    calib_loops: Option<usize>,
    /// Tokens per calibration window (default: 512, or the config's max_position when that is
    /// smaller; with --calib).
    #[arg(long, value_name = "N", requires = "calib", value_parser = whole::<usize>(2, MAX))]
    window: Option<usize>,
    /// Tokenizer name stored in the metadata (default: "bytes" for vocab 256).
    #[arg(long)]
    tokenizer: Option<String>,
    /// Free-form provenance stored as metadata.source.
    #[arg(long)]
    source: Option<String>,
}

fn main() -> ExitCode {
    // args_os: a non-UTF-8 argument is an error for the argument that has it, never a panic.
    let args: Vec<OsString> = std::env::args_os().collect();
    let command = args.get(1).and_then(|a| a.to_str());
    let result = match command {
        Some("help") => help(args.get(2).map(OsString::as_os_str)),
        Some("synth" | "convert" | "kernels") => parse::<ToolCli>(&args).and_then(run_tool),
        _ => parse::<ModelCli>(&args).and_then(run_model),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Parse the command line. `--help` and `--version` print and exit 0; every argument error is an
/// [`Error`], reported on one line like any other.
fn parse<T: Parser>(args: &[OsString]) -> Result<T> {
    let matches = with_negative_values(T::command()).try_get_matches_from(args);
    match matches.and_then(|m| T::from_arg_matches(&m)) {
        Ok(cli) => Ok(cli),
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            print!("{e}");
            std::process::exit(0)
        }
        // No arguments at all: the help, as a reminder of how to call.
        Err(e) if e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            eprint!("{e}");
            std::process::exit(1)
        }
        Err(e) => Err(Error::InvalidArgument(argument_error(&e, args))),
    }
}

/// Let every option that takes a value accept a negative number, so that `--max-tokens -5` is
/// reported as a value out of range rather than as an unknown option `-5`.
fn with_negative_values(command: clap::Command) -> clap::Command {
    command
        .mut_args(|arg| {
            if arg.get_action().takes_values() {
                arg.allow_negative_numbers(true)
            } else {
                arg
            }
        })
        .mut_subcommands(with_negative_values)
}

/// One line for a clap error: a non-UTF-8 value says so; otherwise clap's message without the
/// usage block.
fn argument_error(e: &clap::Error, args: &[OsString]) -> String {
    if e.kind() == ErrorKind::InvalidUtf8 {
        let at = args.iter().position(|a| a.to_str().is_none()).unwrap_or(0);
        return match args[..at].last().and_then(|a| a.to_str()) {
            Some(flag) if flag.starts_with('-') => {
                format!("the value of {flag} is not valid UTF-8")
            }
            _ => format!("argument {at} is not valid UTF-8"),
        };
    }
    let text = e.render().to_string();
    let message = text
        .split("\nUsage:")
        .next()
        .unwrap_or_default()
        .split("For more information")
        .next()
        .unwrap_or_default();
    let line = message.split_whitespace().collect::<Vec<_>>().join(" ");
    let line = line.strip_prefix("error: ").unwrap_or(&line);
    format!("{line} (see --help)")
}

/// `tinyloop help [COMMAND]`.
fn help(command: Option<&OsStr>) -> Result<()> {
    let name = match command.map(|c| c.to_str()) {
        None => return print_help(ModelCli::command()),
        Some(Some(name)) => name,
        Some(None) => return Err(Error::InvalidArgument("unknown command (not UTF-8)".into())),
    };
    let model_command = ModelCli::command().find_subcommand(name).cloned();
    let tool_command = ToolCli::command().find_subcommand(name).cloned();
    match (model_command, tool_command) {
        (Some(c), _) => print_help(c.bin_name(format!("tinyloop MODEL {name}"))),
        (None, Some(c)) => print_help(c.bin_name(format!("tinyloop {name}"))),
        (None, None) => Err(Error::InvalidArgument(format!(
            "unknown command {name:?} (expected {})",
            command_names().join(", ")
        ))),
    }
}

/// Every command a user can run, in the order `help` lists them.
fn command_names() -> Vec<String> {
    let (model, tool) = (ModelCli::command(), ToolCli::command());
    model
        .get_subcommands()
        .chain(tool.get_subcommands())
        .filter(|c| !c.is_hide_set())
        .map(|c| c.get_name().to_string())
        .collect()
}

fn print_help(mut command: clap::Command) -> Result<()> {
    print!("{}", command.render_long_help());
    Ok(())
}

fn run_tool(cli: ToolCli) -> Result<()> {
    match cli.command {
        ToolCommand::Synth {
            preset,
            tokenizer,
            vocab_size,
            seed,
            bits,
            group_size,
            out,
        } => {
            let group_size = quantization_groups(bits, group_size)?;
            let mut config = synth::preset(&preset)?;
            config.vocab_size = vocab_size.unwrap_or(config.vocab_size);
            let metadata = match &tokenizer {
                Some(dir) => tinyloop::tokenizer::metadata_from_dir(dir)?,
                None => serde_json::Map::new(),
            };
            if tokenizer.is_some() {
                config.vocab_size = tinyloop::tokenizer::vocab_size(&metadata)?;
            }
            let mut writer = synth::random_model(&config, seed, bits, group_size)?;
            for (key, value) in metadata {
                writer.set_metadata(&key, value);
            }
            writer.write(&out)?;
            eprintln!(
                "wrote {} ({preset}, seed {seed}, {bits}-bit)",
                out.display()
            );
            Ok(())
        }
        ToolCommand::Convert(args) => convert(args),
        ToolCommand::Kernels { archs, out } => {
            for arch in &archs {
                let path = tinyloop::ship_kernels(arch, &out)?;
                eprintln!("wrote {}", path.display());
            }
            Ok(())
        }
    }
}

/// Group size of block weights quantized to 4 or 2 bits (`--group-size`, else 128). 16-bit
/// weights have no groups, so `--group-size` with them is an error.
fn quantization_groups(bits: u32, group_size: Option<usize>) -> Result<usize> {
    const DEFAULT_GROUP_SIZE: usize = 128;
    if bits == 16 && group_size.is_some() {
        return Err(Error::InvalidArgument(
            "--group-size applies to --bits 4 and 2 (16-bit weights have no groups)".into(),
        ));
    }
    Ok(group_size.unwrap_or(DEFAULT_GROUP_SIZE))
}

fn convert(args: ConvertArgs) -> Result<()> {
    use tinyloop::convert::{ConvertOptions, Input, Method};
    let method = match args.method.as_str() {
        "rtn" => Method::Rtn,
        "gptq" => Method::Gptq,
        other => {
            return Err(Error::InvalidArgument(format!(
                "unknown method {other:?} (expected rtn or gptq)"
            )))
        }
    };
    if method == Method::Gptq && args.bits == 16 {
        return Err(Error::InvalidArgument(
            "--method gptq quantizes to --bits 4 or 2, not 16".into(),
        ));
    }
    if method != Method::Gptq && args.calib.is_some() {
        return Err(Error::InvalidArgument(
            "--calib (and --calib-bytes, --calib-loops, --window) calibrate --method gptq".into(),
        ));
    }
    let group_size = quantization_groups(args.bits, args.group_size)?;
    let mut metadata = serde_json::Map::new();
    if let Some(t) = &args.tokenizer {
        metadata.insert("tokenizer".into(), json!(t));
    }
    if let Some(s) = &args.source {
        metadata.insert("source".into(), json!(s));
    }
    let input = match (args.hf, args.safetensors, args.config) {
        (Some(dir), _, _) => Input::HuggingFace(dir),
        (None, Some(safetensors), Some(config)) => Input::TinyLoop {
            safetensors,
            config,
        },
        _ => unreachable!("clap requires --hf, or --safetensors with --config"),
    };
    let calibration = match &args.calib {
        Some(path) => {
            let io = |e| Error::Io {
                path: path.clone(),
                source: e,
            };
            let mut bytes = Vec::new();
            std::fs::File::open(path)
                .map_err(io)?
                .take(args.calib_bytes as u64)
                .read_to_end(&mut bytes)
                .map_err(io)?;
            calibration_tokens(&input, bytes)?
        }
        None => Vec::new(),
    };
    let opts = ConvertOptions {
        input,
        out: args.out.clone(),
        bits: args.bits,
        group_size,
        method,
        calibration,
        calibration_loops: args.calib_loops,
        window: args.window.unwrap_or(0),
        metadata,
        progress: std::io::stderr().is_terminal(),
    };
    tinyloop::convert::convert(&opts)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}

/// The GPTQ calibration text as token ids: through the tokenizer of a Hugging Face folder (its
/// bytes cut at `--calib-bytes`, so a character split there is replaced), else its bytes.
fn calibration_tokens(input: &tinyloop::convert::Input, bytes: Vec<u8>) -> Result<Vec<u32>> {
    use tinyloop::tokenizer::{metadata_from_dir, Tokenizer};
    let tinyloop::convert::Input::HuggingFace(dir) = input else {
        return Ok(bytes.into_iter().map(u32::from).collect());
    };
    let metadata = metadata_from_dir(dir)?;
    let tokenizer = Tokenizer::from_metadata(&metadata, usize::MAX)?
        .expect("a folder's tokenizer.json is a Hugging Face tokenizer");
    tokenizer.encode(&String::from_utf8_lossy(&bytes), false)
}

fn run_model(cli: ModelCli) -> Result<()> {
    match cli.command {
        ModelCommand::Info { json } => info(&cli.model, json),
        ModelCommand::Generate(args) => generate(&cli.model, args),
        ModelCommand::Tokenize(args) => tokenize(&cli.model, args),
        ModelCommand::Score(args) => score(&cli.model, args),
        ModelCommand::Bench(args) => bench(&cli.model, args),
        ModelCommand::Lens(args) => lens(&cli.model, args),
        ModelCommand::Trajectory(args) => trajectory(&cli.model, args),
        ModelCommand::Serve(args) => serve_model(&cli.model, args),
        ModelCommand::Requantize {
            loop_body_bits,
            head_bits,
            head_group_size,
            out,
        } => {
            use tinyloop::convert::requantize::{quantized_dtype, requantize_file, Requantization};
            let plan = Requantization {
                loop_body: loop_body_bits.map(quantized_dtype).transpose()?,
                head: head_bits
                    .map(quantized_dtype)
                    .transpose()?
                    .map(|dtype| (dtype, head_group_size)),
            };
            requantize_file(&cli.model, &out, &plan)?;
            let mut what = Vec::new();
            if let Some(bits) = loop_body_bits {
                what.push(format!("loop body at {bits} bits"));
            }
            if let Some(bits) = head_bits {
                what.push(format!("head at {bits} bits"));
            }
            eprintln!("wrote {} ({})", out.display(), what.join(", "));
            Ok(())
        }
    }
}

fn open(path: &PathBuf, common: &CommonArgs) -> Result<Model> {
    let options = ModelOptions {
        // 0: the model's default.
        max_seq_len: common.max_seq_len.unwrap_or(0),
        prefill_chunk: common.prefill_chunk,
        device: common.device,
        kv_mode: common.kv,
        log: !common.quiet && !common.json,
        fp16_body: common.fp16_body.then_some(true),
        state_init: common.state_init.unwrap_or_default(),
        ..ModelOptions::default()
    };
    Model::open(path, &options)
}

fn serve_model(path: &PathBuf, args: ServeArgs) -> Result<()> {
    let options = ModelOptions {
        max_seq_len: args.max_seq_len.unwrap_or(0),
        device: args.device,
        kv_mode: args.kv,
        log: !args.quiet,
        ..ModelOptions::default()
    };
    let model = Model::open(path, &options)?;
    let name = args.name.unwrap_or_else(|| {
        path.file_stem()
            .map_or("model".into(), |s| s.to_string_lossy().into_owned())
    });
    let defaults = EngineOptions::default();
    let engine = EngineOptions {
        max_step_rows: args.max_step_rows.unwrap_or(defaults.max_step_rows),
        max_running: args.max_running.unwrap_or(defaults.max_running),
        pool_positions: args.pool_positions.unwrap_or(defaults.pool_positions),
        ..defaults
    };
    serve::run(model, name, &engine, (args.host, args.port).into())
}

fn is_byte_level(model: &Model) -> bool {
    model.config().vocab_size == 256
}

/// The tokens of `--text`, `--file` or `--prompt`: the bytes for a byte-level model (any bytes),
/// else the UTF-8 text through the model's tokenizer, with its special tokens.
fn text_tokens(model: &Model, text: &[u8], flag: &str) -> Result<Vec<u32>> {
    let tokenizer = model.tokenizer().map_err(|e| match e {
        Error::InvalidArgument(why) => Error::InvalidArgument(format!("{flag}: {why}")),
        other => other,
    })?;
    if let Tokenizer::HuggingFace(_) = tokenizer {
        let text = std::str::from_utf8(text)
            .map_err(|_| Error::InvalidArgument(format!("{flag} is not valid UTF-8")))?;
        return tokenizer.encode(text, true);
    }
    // A --file can be as large as the disk: four bytes per byte may not fit in memory.
    let mut tokens = Vec::new();
    tokens
        .try_reserve_exact(text.len())
        .map_err(|_| Error::OutOfMemory {
            bytes: text.len().saturating_mul(4),
            what: format!("the tokens of {flag}"),
        })?;
    tokens.extend(text.iter().map(|&b| u32::from(b)));
    Ok(tokens)
}

fn utf8<'a>(text: &'a OsStr, flag: &str) -> Result<&'a str> {
    text.to_str().ok_or_else(|| {
        Error::InvalidArgument(format!(
            "{flag} is not valid UTF-8 (pass the bytes as --tokens, or score a --file)"
        ))
    })
}

/// `--tokens` of a model: ids from 0 to vocab_size - 1.
fn parse_tokens(ids: &[i64], model: &Model) -> Result<Vec<u32>> {
    let vocab = model.config().vocab_size;
    ids.iter()
        .map(|&t| {
            u32::try_from(t)
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    Error::InvalidArgument(format!(
                        "--tokens: token id {t} is outside 0 to {} (vocab_size {vocab})",
                        vocab - 1
                    ))
                })
        })
        .collect()
}

fn info(path: &PathBuf, json: bool) -> Result<()> {
    let file = tinyloop::ModelFile::open(path)?;
    let c = &file.config;
    let mut by_dtype = std::collections::BTreeMap::<&str, (usize, u64)>::new();
    for t in file.tensor_entries() {
        let e = by_dtype.entry(t.dtype.name()).or_default();
        e.0 += 1;
        e.1 += t.length;
    }
    let config = serde_json::to_value(c).expect("config serializes");
    if json {
        let dtypes: serde_json::Map<_, _> = by_dtype
            .iter()
            .map(|(k, (n, b))| (k.to_string(), json!({"tensors": n, "bytes": b})))
            .collect();
        let out = json!({
            "config": config,
            "tensors": file.tensor_entries().count(),
            "file_bytes": file.file_len(),
            "dtypes": dtypes,
            "metadata": file.metadata,
        });
        println!("{out}");
        return Ok(());
    }
    println!("{}", path.display());
    for (key, value) in config.as_object().expect("config is an object") {
        println!("  {key:<17} {value}");
    }
    println!("  tensors           {}", file.tensor_entries().count());
    for (dtype, (n, bytes)) in &by_dtype {
        println!(
            "    {dtype:<5} {n:>4} tensors {:>10.2} MB",
            *bytes as f64 / 1e6
        );
    }
    println!("  file size         {:.2} MB", file.file_len() as f64 / 1e6);
    for (key, value) in &file.metadata {
        // A stored tokenizer is megabytes of JSON: long values are summarized (--json has them).
        let text = value.to_string();
        if text.len() > 160 {
            println!("  metadata.{key} = <{} bytes of JSON>", text.len());
        } else {
            println!("  metadata.{key} = {text}");
        }
    }
    Ok(())
}

fn generate(path: &PathBuf, args: GenerateArgs) -> Result<()> {
    // Everything is checked before anything is printed: the flags here, the prompt and the
    // request by the library before the first token, with which the prompt is echoed.
    if args.prompt.is_none() && (args.chat || !args.stop.is_empty()) {
        return Err(Error::InvalidArgument(
            "--chat and --stop work on text: pass the prompt as --prompt".into(),
        ));
    }
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        loops: args.common.loops,
        sampling: args.sampling.params()?,
        stop_tokens: Vec::new(),
        ctx_tier: args.ctx_tier.policy()?,
        beta_monitor: args.beta_mon.monitor(),
        exit: args.exit.exit()?,
    };
    let model = open(path, &args.common)?;
    let prompt = match (&args.prompt, &args.tokens) {
        (Some(text), _) => return generate_text(&model, utf8(text, "--prompt")?, &args, &params),
        (None, Some(ids)) => parse_tokens(ids, &model)?,
        (None, None) => unreachable!("clap requires --prompt or --tokens"),
    };
    let mut session = model.new_session()?;
    let speculation = args.speculation.speculation();
    let run =
        |session: &mut tinyloop::Session, on_token: &mut dyn FnMut(u32) -> bool| match &speculation
        {
            Some(spec) => session.generate_speculative(&prompt, &params, spec, on_token),
            None => session.generate_stream(&prompt, &params, on_token),
        };
    let byte_level = is_byte_level(&model);
    if args.common.json {
        let tokens = run(&mut session, &mut |_| true)?;
        let text = byte_level.then(|| decode_bytes(&tokens));
        let stats = stats_json(&session.last_generate_stats(), speculation.is_some());
        print_beta_mon(&model, &session.last_generate_stats());
        println!(
            "{}",
            json!({"tokens": tokens, "text": text, "stats": stats})
        );
        return Ok(());
    }
    let mut stdout = std::io::stdout().lock();
    let mut echo = byte_level.then(|| decode_bytes(&prompt));
    // Bytes of a multi-byte character arrive one token at a time; print whole characters.
    let mut pending = Vec::new();
    let tokens = run(&mut session, &mut |t| {
        if let Some(prompt) = echo.take() {
            stdout.write_all(prompt.as_bytes()).ok();
        }
        if byte_level {
            pending.push(t as u8);
            if std::str::from_utf8(&pending).is_ok() || pending.len() >= 4 {
                stdout
                    .write_all(String::from_utf8_lossy(&pending).as_bytes())
                    .ok();
                stdout.flush().ok();
                pending.clear();
            }
        } else {
            write!(stdout, "{t} ").ok();
        }
        true
    })?;
    stdout
        .write_all(String::from_utf8_lossy(&pending).as_bytes())
        .ok();
    writeln!(stdout).ok();
    report(&model, &session, &args, tokens.len());
    Ok(())
}

/// `generate --prompt`: the prompt through the model's tokenizer (or its chat template), the
/// generated text printed as it streams, until `--max-tokens`, an end-of-sequence token or a
/// `--stop` string.
fn generate_text(
    model: &Model,
    prompt: &str,
    args: &GenerateArgs,
    params: &GenerateParams,
) -> Result<()> {
    let (prompt, mut echo) = if args.chat {
        let user = [ChatMessage::new("user", prompt)];
        (model.apply_chat_template(&user, true)?, None)
    } else {
        (prompt.to_string(), Some(prompt))
    };
    let text = TextParams {
        stop: args.stop.clone(),
        // A chat template writes the special tokens itself.
        add_special_tokens: !args.chat,
        ..TextParams::default()
    };
    let mut session = model.new_session()?;
    let speculation = args.speculation.speculation();
    let run =
        |session: &mut tinyloop::Session, on_text: &mut dyn FnMut(&str) -> bool| match &speculation
        {
            Some(spec) => session.generate_text_speculative(&prompt, params, spec, &text, on_text),
            None => session.generate_text_stream(&prompt, params, &text, on_text),
        };
    if args.common.json {
        let out = run(&mut session, &mut |_| true)?;
        let stats = stats_json(&session.last_generate_stats(), speculation.is_some());
        print_beta_mon(model, &session.last_generate_stats());
        println!(
            "{}",
            json!({"tokens": out.tokens, "text": out.text, "stats": stats})
        );
        return Ok(());
    }
    let mut stdout = std::io::stdout().lock();
    let out = run(&mut session, &mut |piece| {
        // The prompt is echoed once the request is known to be good.
        if let Some(prompt) = echo.take() {
            stdout.write_all(prompt.as_bytes()).ok();
        }
        stdout.write_all(piece.as_bytes()).ok();
        stdout.flush().ok();
        true
    })?;
    if let Some(prompt) = echo {
        stdout.write_all(prompt.as_bytes()).ok();
    }
    writeln!(stdout).ok();
    report(model, &session, args, out.tokens.len());
    Ok(())
}

/// After a generation: BETA-MON's summary, and unless `-q` a line with the token count (and the
/// speculation's acceptance).
fn report(model: &Model, session: &tinyloop::Session, args: &GenerateArgs, tokens: usize) {
    print_beta_mon(model, &session.last_generate_stats());
    if !args.common.quiet {
        let stats = session.last_generate_stats();
        eprint!("[tinyloop] generated {tokens} tokens");
        if !stats.exit_steps.is_empty() {
            let loops = args.common.loops.unwrap_or(model.config().default_loops);
            eprint!(
                "; exit after {:.2} iterations on average, per iteration {:?}",
                stats.mean_exit_steps(),
                stats.exit_histogram(loops)
            );
        }
        if args.speculation.draft_loops.is_some() {
            eprint!(
                "; accepted {} of {} drafts ({:.1} %), draft/verify agreement {:.1} %",
                stats.accepted,
                stats.drafted,
                100.0 * stats.acceptance_rate(),
                100.0 * stats.agreement()
            );
        }
        eprintln!();
    }
}

/// `tokenize`: the ids of a text under the tokenizer stored in the file (the weights are not
/// loaded).
fn tokenize(path: &PathBuf, args: TokenizeArgs) -> Result<()> {
    let file = tinyloop::ModelFile::open(path)?;
    let tokenizer =
        Tokenizer::from_metadata(&file.metadata, file.config.vocab_size)?.ok_or_else(|| {
            Error::InvalidArgument(format!(
                "the model has no tokenizer (vocab_size {}, metadata names none)",
                file.config.vocab_size
            ))
        })?;
    let mut text = utf8(&args.prompt, "--prompt")?.to_string();
    if args.chat {
        text = tokenizer.apply_chat_template(&[ChatMessage::new("user", text)], true)?;
    }
    let tokens = tokenizer.encode(&text, !args.chat && !args.no_special_tokens)?;
    if args.json {
        println!("{}", json!({"tokens": tokens, "text": text}));
    } else {
        let ids: Vec<String> = tokens.iter().map(u32::to_string).collect();
        println!("{}", ids.join(","));
    }
    Ok(())
}

/// The prompt of `bench`: --prompt-len tokens of --prompt-file from --prompt-offset, or by
/// default fixed pseudo-random tokens (so that the default figures need no text file).
fn bench_prompt(model: &Model, args: &BenchArgs) -> Result<Vec<u32>> {
    let n = args.prompt_len;
    let Some(file) = &args.prompt_file else {
        let vocab = model.config().vocab_size as u32;
        return Ok((0..n as u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 7) % vocab)
            .collect());
    };
    let bytes = std::fs::read(file).map_err(|e| Error::Io {
        path: file.clone(),
        source: e,
    })?;
    if args.prompt_offset > bytes.len() {
        return Err(Error::InvalidArgument(format!(
            "--prompt-offset {} is past the end of --prompt-file {} ({} bytes)",
            args.prompt_offset,
            file.display(),
            bytes.len()
        )));
    }
    // A tokenizer reads whole characters (UTF-8 continuation bytes are 10xxxxxx): the text starts
    // at the next character and ends before a cut one. It needs no more than a few bytes per
    // token, so a long file is not tokenized whole.
    let inside_char =
        |i: usize| !is_byte_level(model) && i < bytes.len() && bytes[i] & 0xC0 == 0x80;
    let mut start = args.prompt_offset;
    while inside_char(start) {
        start += 1;
    }
    let mut end = bytes.len().min(start.saturating_add(n.saturating_mul(64)));
    while inside_char(end) {
        end -= 1;
    }
    let mut tokens = text_tokens(model, &bytes[start..end], "--prompt-file")?;
    if tokens.len() < n {
        return Err(Error::InvalidArgument(format!(
            "--prompt-file {} holds {} tokens from byte {start}, fewer than --prompt-len {n}",
            file.display(),
            tokens.len()
        )));
    }
    tokens.truncate(n);
    Ok(tokens)
}

/// BETA-MON's summary line (and agreement warning) of a monitored call, unless the library
/// printed it already (`TINYLOOP_BETA_MONITOR=1` on a model that logs).
fn print_beta_mon(model: &Model, stats: &GenerateStats) {
    let printed = model.options().log && BetaMonEnv::from_env().is_ok_and(|env| env.enabled);
    if let Some(summary) = stats.beta_mon.filter(|_| !printed) {
        eprintln!("{}", summary.line());
        if let Some(warning) = summary.agreement_warning() {
            eprintln!("{warning}");
        }
    }
}

/// A call's statistics as JSON (the speculative fields only for speculative calls; `beta_mon`
/// for monitored calls).
fn stats_json(stats: &GenerateStats, speculative: bool) -> serde_json::Value {
    let mut out = json!({
        "tokens": stats.tokens,
        "prefill_ms": stats.prefill_ms,
        "decode_ms": stats.decode_ms,
    });
    if speculative {
        out["drafted"] = json!(stats.drafted);
        out["accepted"] = json!(stats.accepted);
        out["acceptance_rate"] = json!(stats.acceptance_rate());
        out["agreement"] = json!(stats.agreement());
    }
    if !stats.exit_steps.is_empty() {
        out["exit_mean_steps"] = json!(stats.mean_exit_steps());
    }
    if let Some(tier) = &stats.ctx_tier {
        out["ctx_tier"] = ctx_tier_json(tier);
    }
    if let Some(summary) = &stats.beta_mon {
        out["beta_mon"] = summary.to_json();
    }
    out
}

/// What CTX-TIER observed in a call, as JSON.
fn ctx_tier_json(t: &CtxTierStats) -> serde_json::Value {
    json!({
        "observations": t.observations,
        "short_steps": t.short_steps,
        "long_steps": t.long_steps,
        "transitions": t.transitions,
        "last_seq_len": t.last_seq_len,
        "elapsed_ms": t.elapsed_ms,
        "apply_ms": t.apply_ms,
        "freed_bytes": t.freed_bytes,
        "tier": t.tier.to_string(),
    })
}

/// The model, the tokens and the loop count of `lens` and `trajectory`.
fn lens_input(path: &PathBuf, args: &InputArgs) -> Result<(Model, Vec<u32>, usize)> {
    let model = open(path, &args.common)?;
    let tokens = match (&args.text, &args.tokens) {
        (Some(text), _) => text_tokens(&model, utf8(text, "--text")?.as_bytes(), "--text")?,
        (None, Some(ids)) => parse_tokens(ids, &model)?,
        (None, None) => unreachable!("clap requires --text or --tokens"),
    };
    let loops = args.common.loops.unwrap_or(model.config().default_loops);
    Ok((model, tokens, loops))
}

/// A token as `lens` and `trajectory` print it: the quoted character of a byte-level model, the
/// quoted text of a Hugging Face tokenizer's token, else the id.
fn token_name(model: &Model, token: u32) -> String {
    match model.tokenizer() {
        Ok(Tokenizer::Bytes) => format!("{:?}", (token as u8) as char),
        Ok(tokenizer) => match tokenizer.decode(&[token], false) {
            Ok(text) => format!("{text:?}"),
            Err(_) => token.to_string(),
        },
        Err(_) => token.to_string(),
    }
}

fn trajectory(path: &PathBuf, args: InputArgs) -> Result<()> {
    let (model, tokens, loops) = lens_input(path, &args)?;
    let points = model
        .new_session()?
        .score_trajectory(&tokens, Some(loops))?;
    if args.common.json {
        let rows: Vec<_> = points
            .iter()
            .map(|p| {
                json!({"hidden_norm": p.hidden_norm, "rel_change": p.rel_change,
                       "kl_prev": p.kl_prev, "entropy": p.entropy, "argmax": p.argmax})
            })
            .collect();
        println!("{}", json!({"loops": loops, "trajectory": rows}));
        return Ok(());
    }
    println!("iteration  hidden_norm  rel_change    kl_prev  entropy_bits  argmax");
    for (i, p) in points.iter().enumerate() {
        println!(
            "{:>9}  {:>11.4}  {:>10.4}  {:>9.5}  {:>12.4}  {}",
            i + 1,
            p.hidden_norm,
            p.rel_change,
            p.kl_prev,
            p.entropy,
            token_name(&model, p.argmax)
        );
    }
    Ok(())
}

fn lens(path: &PathBuf, args: LensArgs) -> Result<()> {
    let (model, tokens, loops) = lens_input(path, &args.input)?;
    let logits = model
        .new_session()?
        .score_logit_lens(&tokens, Some(loops))?;
    let vocab = model.config().vocab_size;
    if args.input.common.json {
        let rows: Vec<&[f32]> = logits.chunks_exact(vocab).collect();
        println!(
            "{}",
            json!({"loops": loops, "vocab": vocab, "logits": rows})
        );
        return Ok(());
    }
    for (i, row) in logits.chunks_exact(vocab).enumerate() {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        let total: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]));
        let top: Vec<String> = order
            .iter()
            .take(args.top)
            .map(|&t| {
                let p = (row[t] as f64 - max).exp() / total;
                format!("{} {:.3}", token_name(&model, t as u32), p)
            })
            .collect();
        println!("iteration {:>2}: {}", i + 1, top.join("  "));
    }
    Ok(())
}

fn decode_bytes(tokens: &[u32]) -> String {
    let bytes: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

fn score(path: &PathBuf, args: ScoreArgs) -> Result<()> {
    if args.window < 2 {
        return Err(Error::InvalidArgument("--window must be >= 2".into()));
    }
    let policy = args.ctx_tier.policy()?;
    let model = open(path, &args.common)?;
    let tokens = match (&args.text, &args.file, &args.tokens) {
        (Some(text), _, _) => text_tokens(&model, utf8(text, "--text")?.as_bytes(), "--text")?,
        (_, Some(file), _) => {
            let bytes = std::fs::read(file).map_err(|e| Error::Io {
                path: file.clone(),
                source: e,
            })?;
            text_tokens(&model, &bytes, "--file")?
        }
        (_, _, Some(ids)) => parse_tokens(ids, &model)?,
        _ => {
            return Err(Error::InvalidArgument(
                "pass --text, --file or --tokens".into(),
            ))
        }
    };
    let tokens = &tokens[..args.limit.unwrap_or(tokens.len()).min(tokens.len())];
    let chunk = args.common.prefill_chunk;
    // Windows run in steps of --prefill-chunk tokens when that is shorter, and under a tier
    // policy always step by step (the tier is observed before each step).
    let stepwise = policy.is_some() || (chunk > 0 && chunk < args.window);
    let mut session = model.new_session()?;
    let (mut nll, mut count) = (0f64, 0usize);
    let (mut short_steps, mut long_steps, mut transitions) = (0, 0, 0);
    let windows = tokens.chunks(args.window);
    let mut buckets = args
        .buckets
        .as_ref()
        .map(|edges| PositionBuckets::new(edges, args.window));
    let progress = Progress::new(&args.common, "score", windows.len());
    for (i, window) in windows.enumerate() {
        progress.show(i);
        if window.len() < 2 {
            continue;
        }
        let logprobs = if args.decode_path {
            session.logprobs_decode(window, args.common.loops)?
        } else if stepwise {
            let lp = session.logprobs_with(window, args.common.loops, policy.as_ref())?;
            if let Some(t) = session.last_ctx_tier_stats() {
                (short_steps, long_steps) =
                    (short_steps + t.short_steps, long_steps + t.long_steps);
                transitions += t.transitions;
            }
            lp
        } else {
            session.logprobs(window, args.common.loops)?
        };
        nll -= logprobs.iter().map(|&l| l as f64).sum::<f64>();
        count += logprobs.len();
        if let Some(buckets) = &mut buckets {
            buckets.add(&logprobs);
        }
    }
    progress.finish();
    if count == 0 {
        return Err(Error::InvalidArgument(
            "need at least 2 tokens to score".into(),
        ));
    }
    let mean = nll / count as f64;
    let loops = args.common.loops.unwrap_or(model.config().default_loops);
    if args.common.json {
        let mut report = json!({"nll": mean, "ppl": mean.exp(), "tokens": count, "loops": loops});
        if let Some(buckets) = &buckets {
            report["buckets"] = buckets.to_json();
        }
        if let Some(p) = &policy {
            report["ctx_tier"] = json!({
                "short_t": p.short_t,
                "long_t": p.long_t,
                "long_bits": p.long_bits,
                "short_steps": short_steps,
                "long_steps": long_steps,
                "transitions": transitions,
            });
        }
        println!("{report}");
    } else {
        println!(
            "nll {mean:.4} nats/token  ppl {:.3}  ({count} predicted tokens, loops {loops})",
            mean.exp()
        );
        for line in buckets.iter().flat_map(PositionBuckets::lines) {
            println!("{line}");
        }
    }
    Ok(())
}

/// A progress line on stderr, only when stderr is a terminal and the output is neither `--json`
/// nor `-q`.
struct Progress {
    enabled: bool,
    label: &'static str,
    total: usize,
}

impl Progress {
    fn new(common: &CommonArgs, label: &'static str, total: usize) -> Progress {
        Progress {
            enabled: !common.quiet && !common.json && std::io::stderr().is_terminal(),
            label,
            total,
        }
    }

    /// `done` of `total` steps are finished.
    fn show(&self, done: usize) {
        if self.enabled {
            eprint!("\r[{}] {done}/{} ", self.label, self.total);
            std::io::stderr().flush().ok();
        }
    }

    /// Erase the line.
    fn finish(&self) {
        if self.enabled {
            eprint!("\r\x1b[2K");
        }
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn bench(path: &PathBuf, args: BenchArgs) -> Result<()> {
    let params = GenerateParams {
        max_tokens: args.gen_len,
        loops: args.common.loops,
        sampling: args.sampling.params()?,
        ctx_tier: args.ctx_tier.policy()?,
        beta_monitor: args.beta_mon.monitor(),
        exit: args.exit.exit()?,
        ..GenerateParams::default()
    };
    // Room for the prompt and the generated tokens: --max-seq-len, else the model's default (0),
    // unless the run needs more.
    let needed = args.prompt_len.checked_add(args.gen_len).ok_or_else(|| {
        Error::InvalidArgument(format!(
            "--prompt-len {} + --gen-len {} overflow a token count",
            args.prompt_len, args.gen_len
        ))
    })?;
    let max_seq_len = match args.common.max_seq_len {
        Some(n) if n > 0 => n.max(needed),
        _ if needed <= DEFAULT_MAX_SEQ_LEN => 0,
        _ => needed,
    };
    let raised = max_seq_len != args.common.max_seq_len.unwrap_or(0);
    let common = CommonArgs {
        max_seq_len: Some(max_seq_len),
        ..args.common
    };
    let start = Instant::now();
    let model = open(path, &common).map_err(|e| match e {
        Error::InvalidArgument(why) if raised => Error::InvalidArgument(format!(
            "--prompt-len {} + --gen-len {} need max_seq_len {needed}: {why}",
            args.prompt_len, args.gen_len
        )),
        other => other,
    })?;
    let load_ms = start.elapsed().as_secs_f64() * 1e3;
    let prompt = bench_prompt(&model, &args)?;
    let mut session = model.new_session()?;
    let speculation = args.speculation.speculation();
    // Handles are built once, outside the timed runs.
    let prefix = match args.prefix_cache {
        Some(n) if n >= prompt.len() => {
            return Err(Error::InvalidArgument(format!(
                "--prefix-cache must be below --prompt-len ({}), got {n}",
                prompt.len()
            )))
        }
        Some(n) => Some(session.build_prefix_cache(&prompt[..n], common.loops)?),
        None => None,
    };
    let resume = match args.resume_from {
        Some(l1) => Some(session.build_resume_handle(&prompt, Some(l1))?),
        None => None,
    };
    // One generation yields both numbers: the first token arrives after the prefill (and one
    // head evaluation); the gaps between later tokens are decode steps.
    let run = |session: &mut tinyloop::Session| -> Result<(f64, f64)> {
        let start = Instant::now();
        let mut stamps = Vec::with_capacity(args.gen_len);
        let mut stamp = |_| {
            stamps.push(start.elapsed().as_secs_f64() * 1e3);
            true
        };
        match (&speculation, &prefix, &resume) {
            (Some(spec), _, _) => session.generate_speculative(&prompt, &params, spec, &mut stamp),
            (_, Some(cache), _) => {
                session.generate_with_prefix(cache, &prompt[cache.len()..], &params, &mut stamp)
            }
            (_, _, Some(handle)) => session.resume_generate(handle, &params, &mut stamp),
            _ => session.generate_stream(&prompt, &params, &mut stamp),
        }?;
        let decode = (stamps[stamps.len() - 1] - stamps[0]) / (stamps.len() - 1) as f64;
        Ok((stamps[0], decode))
    };
    // Runs: one warm-up (caches, lazily sized buffers), the timed repeats, one reopening.
    let progress = Progress::new(&common, "bench", args.repeats + 2);
    progress.show(0);
    run(&mut session)?;
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    for i in 0..args.repeats {
        progress.show(1 + i);
        let (first, per_token) = run(&mut session)?;
        prefill.push(first);
        decode.push(per_token);
    }
    progress.show(1 + args.repeats);
    let prefill_ms = median(prefill);
    let decode_ms = median(decode);
    let score_ms = if args.score {
        Some(time_score(
            &mut session,
            &prompt,
            common.loops,
            args.repeats,
        )?)
    } else {
        None
    };
    let concurrency = match args.concurrency {
        Some(n) => {
            let via = if args.engine {
                let defaults = EngineOptions::default();
                // Room for every client's request at once (the default pool is 8 sequences of
                // max_seq_len), so that the clients run together rather than in turns.
                let each = (args.prompt_len + args.gen_len).next_multiple_of(defaults.page_size);
                let pool = (8 * model.options().max_seq_len).max(n * each);
                concurrent::Via::Engine(EngineOptions {
                    max_step_rows: args.max_step_rows.unwrap_or(defaults.max_step_rows),
                    max_running: defaults.max_running.max(n),
                    pool_positions: pool,
                    ..defaults
                })
            } else {
                concurrent::Via::Sessions
            };
            Some(concurrent::run(
                &model,
                &prompt,
                &params,
                n,
                args.repeats,
                &via,
            )?)
        }
        None => None,
    };
    // Opening again in the same process: the driver, context and kernels are loaded already, as
    // for a service that loads a second model or reloads one.
    let start = Instant::now();
    let quiet = CommonArgs {
        quiet: true,
        ..common.clone()
    };
    drop(open(path, &quiet)?);
    let reload_ms = start.elapsed().as_secs_f64() * 1e3;
    progress.finish();
    let loops = common.loops.unwrap_or(model.config().default_loops);
    // Throughput counts as bench/torch_peer.py does (tinyloop::model::flops): the first token's
    // time covers the prompt's forward pass and the head on its last row.
    let (config, n) = (model.config(), args.prompt_len);
    let prefill_flops = forward_flops(config, n, 0, loops, 1);
    let score_flops = forward_flops(config, n, 0, loops, n);
    let tflops = |flops: f64, ms: f64| flops / (ms * 1e-3) / 1e12;
    let report = json!({
        "device": model.info().device,
        "loops": loops,
        "load_ms": load_ms,
        "reload_ms": reload_ms,
        "prompt_len": args.prompt_len,
        "prompt_file": args.prompt_file.as_ref().map(|f| f.display().to_string()),
        "prompt_offset": args.prompt_offset,
        "gen_len": args.gen_len,
        "prefill_ms": prefill_ms,
        "prefill_tokens_per_s": args.prompt_len as f64 / prefill_ms * 1e3,
        "prefill_flops": prefill_flops,
        "prefill_tflops_per_s": tflops(prefill_flops, prefill_ms),
        "score_ms": score_ms,
        "score_tflops_per_s": score_ms.map(|ms| tflops(score_flops, ms)),
        "decode_ms_per_token": decode_ms,
        "decode_tokens_per_s": 1e3 / decode_ms,
        "memory_mb": model.memory_bytes() as f64 / 1e6,
        "weight_mb_at_load": model.info().weight_bytes as f64 / 1e6,
        "weight_mb": model.weight_bytes() as f64 / 1e6,
        "kv_mode": session.kv_mode().to_string(),
        "kv_mb": session.kv_bytes() as f64 / 1e6,
        "max_seq_len": model.options().max_seq_len,
        "prefill_chunk": common.prefill_chunk,
        "kernels": model.info().kernels,
        "kernel_ms": model.info().kernel_ms,
        "repeats": args.repeats,
        "temperature": args.sampling.temperature,
        "top_k": args.sampling.top_k,
        "top_p": args.sampling.top_p,
        "draft_loops": speculation.map(|s| s.draft_loops),
        "draft_len": speculation.map(|s| s.draft_len),
        "draft_reuse": speculation.map(|s| s.reuse),
        "prefix_cache": args.prefix_cache,
        "resume_from": args.resume_from,
        "beta_monitor": args.beta_mon.beta_monitor,
        "concurrency": concurrency,
        "stats": stats_json(&session.last_generate_stats(), speculation.is_some()),
    });
    if common.json {
        println!("{report}");
    } else {
        println!(
            "device {}  loops {loops}  kv {}{}\n  load            {load_ms:>10.1} ms (again in-process {reload_ms:.1} ms)\n  prefill ({:>4} tok) {:>7.1} tok/s\n  decode          {decode_ms:>10.3} ms/token ({:.1} tok/s)\n  memory          {:>10.1} MB (KV cache {:.1} MB for {} tokens)",
            model.info().device,
            session.kv_mode(),
            if args.beta_mon.beta_monitor {
                "  beta-mon on"
            } else {
                ""
            },
            args.prompt_len,
            args.prompt_len as f64 / prefill_ms * 1e3,
            1e3 / decode_ms,
            model.memory_bytes() as f64 / 1e6,
            session.kv_bytes() as f64 / 1e6,
            model.options().max_seq_len,
        );
        println!(
            "  prefill compute {:>10.1} TFLOP/s ({:.1} ms)",
            tflops(prefill_flops, prefill_ms),
            prefill_ms
        );
        if let Some(ms) = score_ms {
            println!(
                "  score ({n:>4} tok) {ms:>9.2} ms ({:.1} TFLOP/s)",
                tflops(score_flops, ms)
            );
        }
        if let Some(c) = &concurrency {
            println!(
                "  concurrent      {} clients ({}): {:.1} tok/s aggregate, first token p50 {:.1} \
                 ms, between tokens p50 {:.3} / p99 {:.3} ms",
                c["clients"],
                c["via"].as_str().unwrap_or(""),
                c["aggregate_tokens_per_s"].as_f64().unwrap_or(0.0),
                c["ttft_ms"]["p50"].as_f64().unwrap_or(0.0),
                c["itl_ms"]["p50"].as_f64().unwrap_or(0.0),
                c["itl_ms"]["p99"].as_f64().unwrap_or(0.0),
            );
        }
        if let Some(kernels) = &model.info().kernels {
            println!("  kernels         {kernels}");
        }
    }
    Ok(())
}

/// Median milliseconds of `repeats` score calls over `prompt` (after one warm-up call).
fn time_score(
    session: &mut tinyloop::Session,
    prompt: &[u32],
    loops: Option<usize>,
    repeats: usize,
) -> Result<f64> {
    session.score(prompt, loops)?;
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let start = Instant::now();
        session.score(prompt, loops)?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
    }
    Ok(median(times))
}
