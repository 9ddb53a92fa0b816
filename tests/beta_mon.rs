//! BETA-MON on the CPU backend (the reference) and through the command line: the entropies of
//! every generation call equal an f64 recomputation from `score_last` logits, the agreement of
//! speculative calls equals a count from the draft and verify argmaxes, monitoring changes no
//! token, and with nothing asked for there is no output. tests/cuda_beta_mon.rs checks the GPU.
//!
//! Tolerance on the CPU: the backend computes each entropy in f64 ([`entropy_bits`], the same
//! function as the reference) from logits bit-identical to `score_last`'s (the CPU computes every
//! row of a step independently, in a fixed order), and stores it as f32: a relative error of at
//! most 2⁻²⁴ ≈ 6·10⁻⁸. The f64 mean and variance over at most a few hundred values add ~10⁻¹⁵.
//! So `CPU_TOL(h)` = 10⁻⁶ · (1 + h) bits bounds every per-token error with a wide margin.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::beta_mon::{assert_summary_matches, reference_entropies, thresholds_between};
use common::{open_cpu, synth_file, tokens};
use tinyloop::generate::sampling::argmax;
use tinyloop::{
    BetaMonitor, Error, GenerateParams, PrefixCache, SamplingParams, Session, Speculation,
};

fn cpu_tol(h: f64) -> f64 {
    1e-6 * (1.0 + h)
}

fn demo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("models/demo.tinyloop")
}

fn monitored(max_tokens: usize, loops: usize, monitor: BetaMonitor) -> GenerateParams {
    GenerateParams {
        max_tokens,
        loops: Some(loops),
        beta_monitor: Some(monitor),
        ..GenerateParams::default()
    }
}

fn sampled(params: GenerateParams, seed: u64) -> GenerateParams {
    GenerateParams {
        sampling: SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            seed,
        },
        ..params
    }
}

/// Generate with BETA-MON twice: once with default thresholds to find the tokens and their
/// reference entropies, then with thresholds placed between those entropies (the tokens do not
/// depend on the thresholds). Returns the second call's tokens and statistics and the reference.
fn monitored_run(
    session: &mut Session,
    prompt: &[u32],
    params: &GenerateParams,
    call: &mut dyn FnMut(&mut Session, &GenerateParams) -> Vec<u32>,
) -> (Vec<u32>, tinyloop::GenerateStats, Vec<f64>) {
    let loops = params.loops.expect("tests name the loops");
    let first = call(session, params);
    let reference = reference_entropies(session, prompt, &first, loops);
    let placed = GenerateParams {
        // Every model here has 256 tokens, so H <= 8 bits and cpu_tol(8) bounds every error.
        beta_monitor: Some(thresholds_between(&reference, cpu_tol(8.0))),
        ..params.clone()
    };
    let tokens = call(session, &placed);
    assert_eq!(tokens, first, "the thresholds changed the tokens");
    (tokens, session.last_generate_stats(), reference)
}

#[test]
fn entropies_equal_a_recomputation_from_score_last() {
    let models = [
        (synth_file("tiny", 2, 4), 4),
        (synth_file("tiny-gqa", 2, 4), 3),
        (synth_file("tiny-tied", 2, 2), 2),
    ];
    for (path, loops) in models {
        let model = open_cpu(&path);
        let mut s = model.new_session().unwrap();
        let vocab = model.config().vocab_size;
        let prompt = tokens(11, vocab, 5);
        let plain = monitored(48, loops, BetaMonitor::default());
        for (name, params) in [("greedy", plain.clone()), ("sampled", sampled(plain, 9))] {
            let (tokens, stats, reference) =
                monitored_run(&mut s, &prompt, &params, &mut |s, p| {
                    s.generate(&prompt, p).unwrap()
                });
            assert_eq!(tokens.len(), 48);
            let summary = stats.beta_mon.expect("a monitored call has a summary");
            let what = format!("{} {name}", path.display());
            assert_summary_matches(&summary, &reference, cpu_tol, &what);
            assert_eq!(summary.agreement_rate, None, "{what}: not speculative");
        }
    }
}

#[test]
fn speculative_entropies_come_from_the_verify_rows() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(7, 256, 3);
    let base = monitored(40, 6, BetaMonitor::default());
    for reuse in [true, false] {
        let spec = Speculation {
            draft_loops: 2,
            draft_len: 4,
            reuse,
        };
        for (name, params) in [
            ("greedy", base.clone()),
            ("sampled", sampled(base.clone(), 3)),
        ] {
            let (_, stats, reference) = monitored_run(&mut s, &prompt, &params, &mut |s, p| {
                s.generate_speculative(&prompt, p, &spec, &mut |_| true)
                    .unwrap()
            });
            let summary = stats.beta_mon.unwrap();
            let what = format!("speculative {name} reuse={reuse}");
            assert_summary_matches(&summary, &reference, cpu_tol, &what);
            assert!(stats.drafted > 0, "{what}: drafted nothing");
            assert_eq!(summary.drafted, stats.drafted);
            assert_eq!(
                summary.agreement_rate,
                Some(stats.agreed as f64 / stats.drafted as f64)
            );
        }
    }
}

#[test]
fn prefix_and_resume_calls_are_monitored_like_generate() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let mut s = model.new_session().unwrap();
    let prefix = tokens(12, 256, 4);
    let prompt = tokens(9, 256, 5);
    let whole = [prefix.clone(), prompt.clone()].concat();
    let params = monitored(32, 6, BetaMonitor::default());
    let cache: PrefixCache = s.build_prefix_cache(&prefix, Some(6)).unwrap();
    let (_, stats, reference) = monitored_run(&mut s, &whole, &params, &mut |s, p| {
        s.generate_with_prefix(&cache, &prompt, p, &mut |_| true)
            .unwrap()
    });
    assert_summary_matches(&stats.beta_mon.unwrap(), &reference, cpu_tol, "prefix");
    let handle = s.build_resume_handle(&whole, Some(3)).unwrap();
    let (_, stats, reference) = monitored_run(&mut s, &whole, &params, &mut |s, p| {
        s.resume_generate(&handle, p, &mut |_| true).unwrap()
    });
    assert_summary_matches(&stats.beta_mon.unwrap(), &reference, cpu_tol, "resume");
}

/// Greedy self-speculative decoding replayed with `score_last`: each round drafts `k` tokens
/// by the argmax at `draft_loops`, compares each with the argmax at `verify_loops` of the same
/// prefix, and continues after the accepted drafts and the verify pass's token. Returns
/// (drafted, agreed).
fn replay_speculation(
    s: &mut Session,
    prompt: &[u32],
    tokens: &[u32],
    spec: &Speculation,
    verify_loops: usize,
) -> (usize, usize) {
    let mut argmax_at =
        |seq: &[u32], loops: usize| argmax(&s.score_last(seq, Some(loops)).unwrap());
    let max_tokens = tokens.len();
    let (mut n, mut drafted, mut agreed) = (1, 0, 0);
    while n < max_tokens {
        // As the engine: a round yields at most k + 1 tokens and never more than remain.
        let k = spec.draft_len.min(max_tokens - n - 1);
        if k == 0 {
            break;
        }
        let base = [prompt, &tokens[..n]].concat();
        let mut drafts = Vec::new();
        for _ in 0..k {
            let d = argmax_at(&[base.as_slice(), &drafts].concat(), spec.draft_loops);
            drafts.push(d);
        }
        let verified: Vec<u32> = (0..=k)
            .map(|j| argmax_at(&[base.as_slice(), &drafts[..j]].concat(), verify_loops))
            .collect();
        drafted += k;
        agreed += (0..k).filter(|&j| drafts[j] == verified[j]).count();
        let accepted = (0..k).take_while(|&j| drafts[j] == verified[j]).count();
        assert_eq!(
            tokens[n..=n + accepted],
            verified[..=accepted],
            "round at {n}"
        );
        n += accepted + 1;
    }
    (drafted, agreed)
}

#[test]
fn agreement_equals_a_count_from_the_draft_and_verify_argmaxes() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(7, 256, 6);
    let mut disagreed = false;
    for (draft_loops, draft_len) in [(1, 4), (2, 3), (4, 5)] {
        let spec = Speculation {
            draft_loops,
            draft_len,
            reuse: true,
        };
        let params = monitored(40, 6, BetaMonitor::default());
        let out = s
            .generate_speculative(&prompt, &params, &spec, &mut |_| true)
            .unwrap();
        let stats = s.last_generate_stats();
        let summary = stats.beta_mon.unwrap();
        let (drafted, agreed) = replay_speculation(&mut s, &prompt, &out, &spec, 6);
        assert_eq!((stats.drafted, stats.agreed), (drafted, agreed), "{spec:?}");
        assert_eq!(summary.drafted, drafted);
        assert_eq!(summary.agreement_rate, Some(agreed as f64 / drafted as f64));
        assert_eq!(
            summary.agreement_below_floor(),
            (agreed as f64 / drafted as f64) < 0.95
        );
        disagreed |= agreed < drafted;
    }
    assert!(
        disagreed,
        "the drafts always agreed: the count was not put to the test"
    );
}

#[test]
fn monitoring_changes_no_token_and_is_absent_unless_asked() {
    let model = open_cpu(&synth_file("tiny", 4, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(9, 256, 1);
    let off = GenerateParams {
        max_tokens: 24,
        loops: Some(4),
        ..GenerateParams::default()
    };
    let on = GenerateParams {
        beta_monitor: Some(BetaMonitor::default()),
        ..off.clone()
    };
    for params in [off.clone(), sampled(off.clone(), 4)] {
        let plain = s.generate(&prompt, &params).unwrap();
        assert_eq!(s.last_generate_stats().beta_mon, None);
        let watched = GenerateParams {
            beta_monitor: on.beta_monitor,
            ..params.clone()
        };
        assert_eq!(s.generate(&prompt, &watched).unwrap(), plain);
        assert_eq!(s.last_generate_stats().beta_mon.unwrap().n_tokens, 24);
        assert_eq!(s.generate(&prompt, &params).unwrap(), plain);
    }
}

#[test]
fn a_stop_token_ends_the_call_without_an_entropy() {
    let model = open_cpu(&synth_file("tiny", 3, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(7, 256, 7);
    let params = monitored(64, 4, BetaMonitor::default());
    let all = s.generate(&prompt, &params).unwrap();
    let stop = all[10];
    let cut = all.iter().position(|&t| t == stop).unwrap();
    let stopped = GenerateParams {
        stop_tokens: vec![stop],
        ..params
    };
    let out = s.generate(&prompt, &stopped).unwrap();
    assert_eq!(out, all[..cut]);
    let summary = s.last_generate_stats().beta_mon.unwrap();
    assert_eq!(summary.n_tokens, cut, "one entropy per returned token");
}

#[test]
fn bad_thresholds_are_invalid_arguments_that_name_the_field() {
    let model = open_cpu(&synth_file("tiny", 4, 4));
    let mut s = model.new_session().unwrap();
    let prompt = tokens(5, 256, 1);
    let with = |m: BetaMonitor| monitored(4, 2, m);
    let d = BetaMonitor::default();
    for (monitor, expected) in [
        (
            BetaMonitor {
                low_entropy_bits: -1.0,
                ..d
            },
            "beta_monitor.low_entropy_bits must be a finite number of bits >= 0, got -1",
        ),
        (
            BetaMonitor {
                high_entropy_bits: f64::INFINITY,
                ..d
            },
            "beta_monitor.high_entropy_bits must be a finite number",
        ),
        (
            BetaMonitor {
                low_entropy_bits: 3.0,
                high_entropy_bits: 2.0,
                ..d
            },
            "beta_monitor.low_entropy_bits (3) must not exceed beta_monitor.high_entropy_bits (2)",
        ),
        (
            BetaMonitor {
                agreement_floor: 1.01,
                ..d
            },
            "beta_monitor.agreement_floor must be in [0, 1], got 1.01",
        ),
    ] {
        match s.generate(&prompt, &with(monitor)) {
            Err(Error::InvalidArgument(msg)) => assert!(msg.contains(expected), "{msg}"),
            other => panic!("{monitor:?}: {other:?}"),
        }
    }
    // The session is unharmed.
    assert_eq!(s.generate(&prompt, &with(d)).unwrap().len(), 4);
}

// ---------------------------------------------------------------------------------------------
// The command line and the environment variables (each run in its own process).

fn tinyloop(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_tinyloop"));
    cmd.args(args).env("TINYLOOP_DEVICE", "cpu");
    for var in [
        "TINYLOOP_BETA_MONITOR",
        "TINYLOOP_BETA_MON_VERBOSE",
        "TINYLOOP_BETA_MON_AGREEMENT_FLOOR",
        "TINYLOOP_BETA_MON_LOW_ENTROPY_BITS",
        "TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS",
        "TINYLOOP_BETA_MON_FILE",
    ] {
        cmd.env_remove(var);
    }
    cmd.envs(env.iter().copied()).output().unwrap()
}

/// The demo's `generate` as text, with the library's log on: (stdout, stderr).
fn generate_text(env: &[(&str, &str)]) -> (String, String) {
    let model = demo();
    let args = [
        model.to_str().unwrap(),
        "generate",
        "--prompt",
        "ROMEO:",
        "--max-tokens",
        "40",
    ];
    let out = tinyloop(&args, env);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "failed: {stderr}");
    (String::from_utf8(out.stdout).unwrap(), stderr)
}

fn generate_json(extra: &[&str], env: &[(&str, &str)]) -> (serde_json::Value, String) {
    let model = demo();
    let mut args = vec![
        model.to_str().unwrap(),
        "generate",
        "--prompt",
        "ROMEO:",
        "--max-tokens",
        "40",
        "--json",
        "-q",
    ];
    args.extend_from_slice(extra);
    let out = tinyloop(&args, env);
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "failed: {stderr}");
    (serde_json::from_slice(&out.stdout).unwrap(), stderr)
}

/// The numbers of a summary line, by name (`H_mean` gives the mean, `H_std` the ±).
fn parse_summary(line: &str) -> Vec<(String, f64)> {
    let body = line
        .strip_prefix("[beta_mon] summary: ")
        .unwrap_or_else(|| panic!("not a summary line: {line}"));
    let mut fields = Vec::new();
    for word in body.split_whitespace() {
        let word = word.trim_matches(|c| c == '[' || c == ']' || c == '(' || c == ')' || c == ',');
        let Some((name, value)) = word.split_once('=') else {
            continue;
        };
        let number = |v: &str| v.trim_end_matches('%').parse::<f64>().unwrap();
        if let Some((mean, std)) = value.split_once('±') {
            fields.push((name.to_string(), number(mean)));
            fields.push(("H_std".to_string(), number(std)));
        } else {
            fields.push((name.to_string(), number(value)));
        }
    }
    fields
}

#[test]
fn without_the_variable_the_output_is_unchanged_and_with_it_the_summary_parses() {
    let (quiet, stderr) = generate_json(&[], &[]);
    assert!(!stderr.contains("[beta_mon]"), "{stderr}");
    assert!(quiet["stats"].get("beta_mon").is_none());
    let (watched, stderr) = generate_json(&[], &[("TINYLOOP_BETA_MONITOR", "1")]);
    assert_eq!(
        watched["tokens"], quiet["tokens"],
        "monitoring changed tokens"
    );
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    let fields = parse_summary(lines[0]);
    let b = &watched["stats"]["beta_mon"];
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "n_tokens",
            "H_mean",
            "H_std",
            "min",
            "max",
            "low<0.50",
            "high>6.00"
        ]
    );
    // Printed with 3 decimals (bits) and 1 decimal (percent): within half a unit of the last.
    for ((name, printed), (key, scale, half_unit)) in fields.iter().zip([
        ("n_tokens", 1.0, 0.0),
        ("entropy_mean_bits", 1.0, 5e-4),
        ("entropy_std_bits", 1.0, 5e-4),
        ("entropy_min_bits", 1.0, 5e-4),
        ("entropy_max_bits", 1.0, 5e-4),
        ("low_rate", 100.0, 0.05),
        ("high_rate", 100.0, 0.05),
    ]) {
        let exact = b[key].as_f64().unwrap() * scale;
        assert!(
            (printed - exact).abs() <= half_unit + 1e-9,
            "{name}: printed {printed}, stats {exact}"
        );
    }
    assert_eq!(b["n_tokens"], 40);
}

#[test]
fn speculative_summary_adds_the_agreement_and_warns_below_the_floor() {
    let spec = ["--loops", "8", "--draft-loops", "1", "--draft-len", "4"];
    let (out, stderr) = generate_json(
        &spec,
        &[
            ("TINYLOOP_BETA_MONITOR", "1"),
            ("TINYLOOP_BETA_MON_AGREEMENT_FLOOR", "1"),
        ],
    );
    let stats = &out["stats"];
    let agreement = stats["agreement"].as_f64().unwrap();
    let drafted = stats["drafted"].as_u64().unwrap();
    assert!(agreement < 1.0, "the demo's 1-loop drafts do disagree");
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 2, "{stderr}");
    let suffix = format!(
        " | draft/verify agreement={:.2}% (flip={:.2}%, n={drafted})",
        100.0 * agreement,
        100.0 * (1.0 - agreement)
    );
    assert!(lines[0].ends_with(&suffix), "{}", lines[0]);
    assert!(
        lines[1].starts_with("[beta_mon] warning: draft/verify agreement"),
        "{}",
        lines[1]
    );
    assert_eq!(
        stats["beta_mon"]["agreement_rate"].as_f64(),
        Some(agreement)
    );
    // A floor of 0 never warns.
    let (_, stderr) = generate_json(
        &spec,
        &[
            ("TINYLOOP_BETA_MONITOR", "1"),
            ("TINYLOOP_BETA_MON_AGREEMENT_FLOOR", "0"),
        ],
    );
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
}

#[test]
fn the_flag_and_the_file_and_verbose_lines() {
    let dir = common::scratch("beta-mon-file");
    let file = dir.join("last.json");
    let file_str = file.to_str().unwrap();
    // --beta-monitor alone: the summary from the command line, and in the JSON stats.
    let (out, stderr) = generate_json(&["--beta-monitor"], &[]);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("[beta_mon] summary: n_tokens=40 "));
    let stats = out["stats"]["beta_mon"].clone();
    // The file gets the same JSON; verbose adds one line per token.
    let (again, stderr) = generate_json(
        &[],
        &[
            ("TINYLOOP_BETA_MONITOR", "1"),
            ("TINYLOOP_BETA_MON_VERBOSE", "1"),
            ("TINYLOOP_BETA_MON_FILE", file_str),
        ],
    );
    assert_eq!(again["stats"]["beta_mon"], stats);
    let written: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(written, stats);
    for key in [
        "n_tokens",
        "entropy_mean_bits",
        "entropy_std_bits",
        "entropy_min_bits",
        "entropy_max_bits",
        "low_rate",
        "high_rate",
        "agreement_rate",
    ] {
        assert!(written.get(key).is_some(), "{key} missing from {written}");
    }
    let token_lines = |stderr: &str| {
        stderr
            .lines()
            .filter(|l| l.starts_with("[beta_mon] token "))
            .count()
    };
    // The token lines are the library's log: none under -q, one per token from a model that
    // logs.
    assert_eq!(token_lines(&stderr), 0, "{stderr}");
    let (_, stderr) = generate_text(&[
        ("TINYLOOP_BETA_MONITOR", "1"),
        ("TINYLOOP_BETA_MON_VERBOSE", "1"),
    ]);
    assert_eq!(token_lines(&stderr), 40, "{stderr}");
    // The file alone writes it for calls that ask, and prints nothing.
    std::fs::remove_file(&file).unwrap();
    let (_, stderr) = generate_json(&["--beta-monitor"], &[("TINYLOOP_BETA_MON_FILE", file_str)]);
    assert_eq!(
        stderr.lines().count(),
        1,
        "only the flag's summary: {stderr}"
    );
    assert!(file.exists());
    // Custom thresholds from the flags.
    let (out, _) = generate_json(
        &[
            "--beta-monitor",
            "--beta-mon-low-entropy-bits",
            "1.5",
            "--beta-mon-high-entropy-bits",
            "2.5",
        ],
        &[],
    );
    assert_eq!(out["stats"]["beta_mon"]["low_entropy_bits"], 1.5);
    assert_eq!(out["stats"]["beta_mon"]["high_entropy_bits"], 2.5);
}

#[test]
fn an_unwritable_file_is_one_warning_and_keeps_the_tokens() {
    let (plain, _) = generate_text(&[]);
    let (out, stderr) = generate_text(&[
        ("TINYLOOP_BETA_MONITOR", "1"),
        ("TINYLOOP_BETA_MON_FILE", "/nonexistent-dir/beta.json"),
    ]);
    assert_eq!(out, plain);
    let warnings: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("[beta_mon] warning: cannot write TINYLOOP_BETA_MON_FILE="))
        .collect();
    assert_eq!(warnings.len(), 1, "{stderr}");
    assert!(warnings[0].contains("/nonexistent-dir/beta.json"));
}

#[test]
fn bad_variables_and_flags_exit_1_naming_what_was_wrong() {
    let model = demo();
    let args = [model.to_str().unwrap(), "generate", "--prompt", "A", "-q"];
    for (var, value, expected) in [
        (
            "TINYLOOP_BETA_MONITOR",
            "yes",
            "TINYLOOP_BETA_MONITOR=\"yes\" is not accepted: expected 1, on or true, or 0, off or false",
        ),
        (
            "TINYLOOP_BETA_MON_VERBOSE",
            "2",
            "TINYLOOP_BETA_MON_VERBOSE=\"2\" is not accepted",
        ),
        (
            "TINYLOOP_BETA_MON_LOW_ENTROPY_BITS",
            "-0.5",
            "TINYLOOP_BETA_MON_LOW_ENTROPY_BITS must be a finite number of bits >= 0",
        ),
        (
            "TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS",
            "0.1",
            "TINYLOOP_BETA_MON_LOW_ENTROPY_BITS (0.5) must not exceed \
             TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS (0.1)",
        ),
        (
            "TINYLOOP_BETA_MON_AGREEMENT_FLOOR",
            "95",
            "TINYLOOP_BETA_MON_AGREEMENT_FLOOR must be in [0, 1], got 95",
        ),
        (
            "TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS",
            "lots",
            "TINYLOOP_BETA_MON_HIGH_ENTROPY_BITS=\"lots\" is not accepted: expected a finite number",
        ),
    ] {
        let out = tinyloop(&args, &[(var, value)]);
        let stderr = String::from_utf8(out.stderr).unwrap();
        assert_eq!(out.status.code(), Some(1), "{var}={value}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{var}={value}: {stderr}");
        assert!(stderr.contains(expected), "{var}={value}: {stderr}");
    }
    let out = tinyloop(
        &[
            model.to_str().unwrap(),
            "generate",
            "--prompt",
            "A",
            "--beta-monitor",
            "--beta-mon-agreement-floor",
            "-1",
        ],
        &[],
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("beta_monitor.agreement_floor must be in [0, 1], got -1"),
        "{stderr}"
    );
}

#[test]
fn bench_runs_with_the_monitor_on() {
    let model = synth_file("tiny", 4, 4);
    let out = tinyloop(
        &[
            model.to_str().unwrap(),
            "bench",
            "--prompt-len",
            "8",
            "--gen-len",
            "8",
            "--repeats",
            "1",
            "--beta-monitor",
            "--json",
            "-q",
        ],
        &[],
    );
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(out.status.success(), "{stderr}");
    assert!(
        !stderr.contains("[beta_mon]"),
        "bench prints no summaries: {stderr}"
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["beta_monitor"], true);
    assert_eq!(report["stats"]["beta_mon"]["n_tokens"], 8);
}
