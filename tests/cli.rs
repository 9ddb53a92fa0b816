//! The `tinyloop` command line as a user runs it: every command works, and bad input exits
//! non-zero with one clear line and no panic.

mod common;

use std::process::{Command, Output};

fn tinyloop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyloop"))
        .args(args)
        .env("TINYLOOP_DEVICE", "cpu")
        .output()
        .unwrap()
}

fn stdout(out: &Output) -> String {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}

fn model() -> String {
    common::synth_file("tiny", 1, 4)
        .to_string_lossy()
        .into_owned()
}

#[test]
fn synth_writes_a_loadable_model_deterministically() {
    let dir = common::scratch("cli");
    let (a, b) = (dir.join("a.tinyloop"), dir.join("b.tinyloop"));
    for path in [&a, &b] {
        stdout(&tinyloop(&[
            "synth",
            "--preset",
            "tiny-gqa",
            "--seed",
            "3",
            "--bits",
            "2",
            "--out",
            path.to_str().unwrap(),
        ]));
    }
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap());
    let info: serde_json::Value =
        serde_json::from_str(&stdout(&tinyloop(&[a.to_str().unwrap(), "info", "--json"]))).unwrap();
    let config = &info["config"];
    for key in [
        "dim",
        "n_heads",
        "ffn_dim",
        "vocab_size",
        "embed_factor_dim",
        "n_pre_blocks",
        "default_loops",
    ] {
        assert!(config[key].is_u64(), "info lacks {key}");
    }
    assert_eq!(config["n_kv_heads"], 2);
    assert_eq!(info["dtypes"]["int2"]["tensors"], 20);
}

#[test]
fn generate_json_prints_tokens_and_text() {
    let out = stdout(&tinyloop(&[
        &model(),
        "generate",
        "--prompt",
        "Hi",
        "--max-tokens",
        "8",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 8);
    assert!(v["text"].is_string());
    // Same request via token ids ('H' = 72, 'i' = 105) gives the same tokens.
    let out2 = stdout(&tinyloop(&[
        &model(),
        "generate",
        "--tokens",
        "72,105",
        "--max-tokens",
        "8",
        "--json",
    ]));
    assert_eq!(
        serde_json::from_str::<serde_json::Value>(&out2).unwrap()["tokens"],
        v["tokens"]
    );
}

#[test]
fn generate_streams_text() {
    let out = stdout(&tinyloop(&[
        &model(),
        "generate",
        "--prompt",
        "ab",
        "--max-tokens",
        "5",
        "-q",
    ]));
    assert!(out.starts_with("ab"), "{out:?}");
}

#[test]
fn score_reports_nll_and_perplexity() {
    let out = stdout(&tinyloop(&[
        &model(),
        "score",
        "--text",
        "hello world",
        "--loops",
        "2",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let (nll, ppl) = (v["nll"].as_f64().unwrap(), v["ppl"].as_f64().unwrap());
    assert_eq!(v["tokens"], 10);
    // exp(nll) = ppl up to printing precision.
    assert!((nll.exp() - ppl).abs() < 1e-9 * ppl);
    assert!(nll > 0.0);
}

#[test]
fn bench_reports_every_field() {
    let out = stdout(&tinyloop(&[
        &model(),
        "bench",
        "--prompt-len",
        "16",
        "--gen-len",
        "4",
        "--repeats",
        "1",
        "--json",
    ]));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "load_ms",
        "prefill_tokens_per_s",
        "decode_ms_per_token",
        "memory_mb",
    ] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}");
    }
}

/// Every bad input exits with status 1 and a single `error:` line, never a panic.
#[test]
fn bad_input_exits_with_one_clear_line() {
    let dir = common::scratch("cli-bad");
    let corrupt = dir.join("corrupt.tinyloop");
    let mut bytes = std::fs::read(model()).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0xff;
    std::fs::write(&corrupt, bytes).unwrap();
    let m = model();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["/missing.tinyloop", "info"],
            "cannot read /missing.tinyloop",
        ),
        (
            vec![corrupt.to_str().unwrap(), "generate", "--prompt", "x"],
            "checksum mismatch",
        ),
        (
            vec![&m, "generate", "--tokens", "1,999"],
            "out of range for vocab_size 256",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--loops", "0"],
            "loops must be in",
        ),
        (vec![&m, "generate", "--prompt", ""], "empty token sequence"),
        (vec![&m, "generate", "--tokens", "-4"], "negative"),
        (
            vec![&m, "generate", "--prompt", "x", "--temperature", "-1"],
            "temperature",
        ),
        (
            vec![&m, "generate", "--prompt", "x", "--device", "tpu"],
            "unknown device",
        ),
        (
            vec![&m, "score", "--file", "/missing.txt"],
            "cannot read /missing.txt",
        ),
        (
            vec!["synth", "--preset", "huge", "--out", "/tmp/x"],
            "unknown preset",
        ),
        (
            vec![
                "synth", "--preset", "tiny", "--bits", "3", "--out", "/tmp/x",
            ],
            "bit width 3",
        ),
    ];
    for (args, expected) in cases {
        let out = tinyloop(&args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
        assert!(
            stderr.contains(expected),
            "{args:?}: {stderr:?} lacks {expected:?}"
        );
        let error_lines = stderr.lines().filter(|l| l.starts_with("error")).count();
        assert_eq!(error_lines, 1, "{args:?}: {stderr}");
    }
}
