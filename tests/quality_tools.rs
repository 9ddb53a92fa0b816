//! The command-line tools of the quality study (docs/QUALITY.md): `score --buckets` reports the
//! NLL per range of positions, and `requantize` writes a copy whose loop body is re-quantized.

mod common;

use std::process::{Command, Output};

use tinyloop::format::{DType, ModelFile};
use tinyloop::model::quant::QuantizedMatrix;

fn tinyloop(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_tinyloop"))
        .args(args)
        .env("TINYLOOP_DEVICE", "cpu")
        .output()
        .unwrap()
}

fn json(args: &[&str]) -> serde_json::Value {
    let out = tinyloop(args);
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Exit status 1 and one `error:` line that contains `expected`.
fn assert_one_line_error(args: &[&str], expected: &str) {
    let out = tinyloop(args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
    let lines: Vec<&str> = stderr
        .lines()
        .filter(|l| !l.starts_with("[tinyloop]"))
        .collect();
    assert_eq!(lines.len(), 1, "{args:?}: {stderr}");
    assert!(lines[0].starts_with("error: "), "{args:?}: {stderr}");
    assert!(
        lines[0].contains(expected),
        "{args:?}: {stderr:?} lacks {expected:?}"
    );
}

fn path_str(path: &std::path::Path) -> &str {
    path.to_str().unwrap()
}

/// Comma-separated pseudo-random byte tokens.
fn token_list(n: usize) -> String {
    let ids: Vec<String> = common::tokens(n, 256, 7)
        .iter()
        .map(u32::to_string)
        .collect();
    ids.join(",")
}

/// Scoring is causal, so a bucket [0, e) of a long window must score what a window of the first
/// e tokens scores. Tolerance 1e-5 relative: the two runs sum the same f32 log-probabilities,
/// but the longer run's rows may round differently in the batched matrix products.
#[test]
fn buckets_split_the_window_by_position() {
    let model = common::synth_file("tiny", 1, 4);
    let m = path_str(&model);
    let tokens = token_list(40);
    let report = json(&[
        m,
        "score",
        "--tokens",
        &tokens,
        "--window",
        "20",
        "--buckets",
        "4,12",
        "--json",
    ]);
    let buckets = report["buckets"].as_array().unwrap();
    // Two 20-token windows predict positions 1..=19 each: 3, 8 and 8 tokens per window.
    let shape: Vec<[u64; 3]> = buckets
        .iter()
        .map(|b| ["start", "end", "tokens"].map(|key| b[key].as_u64().unwrap()))
        .collect();
    // Positions past the last edge form a bucket that ends with the window.
    assert_eq!(shape, vec![[0, 4, 6], [4, 12, 16], [12, 20, 16]]);

    // The buckets partition the scored tokens: their token-weighted mean is the total
    // (tolerance 1e-12 relative: f64 sums of the same values in another order).
    let total = report["nll"].as_f64().unwrap();
    let weighted: f64 = buckets
        .iter()
        .map(|b| b["nll"].as_f64().unwrap() * b["tokens"].as_f64().unwrap())
        .sum::<f64>()
        / report["tokens"].as_f64().unwrap();
    assert!(
        (weighted - total).abs() <= 1e-12 * total,
        "{weighted} vs {total}"
    );

    // [0, 4) of each 20-token window = a 4-token window over the same tokens.
    let first_of_each: Vec<String> = tokens
        .split(',')
        .collect::<Vec<_>>()
        .chunks(20)
        .flat_map(|w| w[..4].iter().map(|t| t.to_string()))
        .collect();
    let heads = json(&[
        m,
        "score",
        "--tokens",
        &first_of_each.join(","),
        "--window",
        "4",
        "--json",
    ]);
    let (bucket, direct) = (
        buckets[0]["nll"].as_f64().unwrap(),
        heads["nll"].as_f64().unwrap(),
    );
    assert!(
        (bucket - direct).abs() <= 1e-5 * direct,
        "{bucket} vs {direct}"
    );
}

#[test]
fn buckets_end_at_the_last_edge_and_show_in_the_text_output() {
    let model = common::synth_file("tiny", 1, 4);
    let m = path_str(&model);
    let tokens = token_list(16);
    let report = json(&[
        m,
        "score",
        "--tokens",
        &tokens,
        "--window",
        "16",
        "--buckets",
        "8,16",
        "--json",
    ]);
    let ends: Vec<_> = report["buckets"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["end"].clone())
        .collect();
    assert_eq!(ends, vec![serde_json::json!(8), serde_json::json!(16)]);

    let out = tinyloop(&[
        m,
        "score",
        "--tokens",
        &tokens,
        "--window",
        "16",
        "--buckets",
        "8,16",
        "-q",
    ]);
    let text = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    assert!(
        lines[1].contains("positions [0, 8)") && lines[1].contains("(7 tokens)"),
        "{text}"
    );
    assert!(
        lines[2].contains("positions [8, 16)") && lines[2].contains("(8 tokens)"),
        "{text}"
    );
}

#[test]
fn bad_bucket_lists_are_named() {
    let model = common::synth_file("tiny", 1, 4);
    let m = path_str(&model);
    for (edges, expected) in [
        ("", "empty"),
        ("0,8", "must be positive"),
        ("8,4", "must increase strictly: 4 follows 8"),
        ("8,8", "8 follows 8"),
        ("8,x", "\"x\" is not a positive integer"),
        ("-8", "bucket edge \"-8\" is not a positive integer"),
    ] {
        assert_one_line_error(
            &[m, "score", "--text", "hello", "--buckets", edges],
            expected,
        );
    }
}

/// The copy differs from its source exactly in the loop body, which is `requantize` of the
/// original, and it loads and scores.
#[test]
fn requantize_rewrites_only_the_loop_body() {
    let source = common::synth_file("tiny", 2, 4);
    let out = common::scratch("requantize").join("int2-body.tinyloop");
    let status = tinyloop(&[
        path_str(&source),
        "requantize",
        "--loop-body-bits",
        "2",
        "--out",
        path_str(&out),
    ]);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );

    let (before, after) = (
        ModelFile::open(&source).unwrap(),
        ModelFile::open(&out).unwrap(),
    );
    assert_eq!(before.config, after.config);
    let mut requantized = 0;
    for entry in before.tensor_entries() {
        let (old, old_bytes) = before.tensor(&entry.name).unwrap();
        let (new, new_bytes) = after.tensor(&entry.name).unwrap();
        if entry.name.starts_with("loop.") && old.dtype.is_quantized() {
            let [rows, cols] = [old.shape[0] as usize, old.shape[1] as usize];
            let g = old.group_size.unwrap() as usize;
            let original =
                QuantizedMatrix::from_bytes(old.dtype, rows, cols, g, old_bytes).unwrap();
            let expected = original.requantize(DType::Int2).unwrap();
            assert_eq!(new.dtype, DType::Int2, "{}", entry.name);
            assert_eq!(new.group_size, old.group_size, "{}", entry.name);
            assert_eq!(new_bytes, &expected.to_bytes()[..], "{}", entry.name);
            requantized += 1;
        } else {
            assert_eq!(
                (new.dtype, &new.shape, new.group_size),
                (old.dtype, &old.shape, old.group_size),
                "{}",
                entry.name
            );
            assert_eq!(new_bytes, old_bytes, "{}", entry.name);
        }
    }
    assert_eq!(requantized, 5 * before.config.n_loop_blocks);
    for (key, value) in &before.metadata {
        assert_eq!(after.metadata.get(key), Some(value), "metadata {key}");
    }
    let note = &after.metadata["loop_body_requantized"];
    assert_eq!(
        (&note["from"], &note["to"]),
        (&"int4".into(), &"int2".into())
    );

    let text = "To-morrow, and to-morrow, and to-morrow";
    let score = |path: &std::path::Path| {
        json(&[path_str(path), "score", "--text", text, "--json"])["nll"]
            .as_f64()
            .unwrap()
    };
    let (nll_int4, nll_int2) = (score(&source), score(&out));
    assert!(nll_int2.is_finite() && nll_int2 > 0.0, "{nll_int2}");
    assert_ne!(nll_int2, nll_int4, "the loop body did not change");
}

/// `requantize --head-bits` quantizes the f16 head by round-to-nearest (every other tensor is
/// copied byte for byte), alone or with the loop body, and records it in the metadata.
#[test]
fn requantize_quantizes_the_head() {
    let source = common::synth_file("tiny", 3, 4);
    let dir = common::scratch("requantize-head");
    let before = ModelFile::open(&source).unwrap();
    let (head, head_bytes) = before.tensor("head").unwrap();
    assert_eq!(head.dtype, DType::F16);
    let values: Vec<f32> = tinyloop::model::quant::f16_values(head_bytes)
        .map(|v| v.to_f32())
        .collect();
    let [rows, cols] = [head.shape[0] as usize, head.shape[1] as usize];
    for (bits, group, body) in [("4", 32, None), ("2", 64, Some("2"))] {
        let out = dir.join(format!("head-{bits}.tinyloop"));
        let group_arg = group.to_string();
        let mut args = vec![
            path_str(&source),
            "requantize",
            "--head-bits",
            bits,
            "--head-group-size",
            &group_arg,
            "--out",
            path_str(&out),
        ];
        if let Some(b) = body {
            args.extend(["--loop-body-bits", b]);
        }
        let status = tinyloop(&args);
        assert!(
            status.status.success(),
            "{}",
            String::from_utf8_lossy(&status.stderr)
        );
        let after = ModelFile::open(&out).unwrap();
        let dtype = if bits == "4" {
            DType::Int4
        } else {
            DType::Int2
        };
        let expected =
            tinyloop::model::quant::quantize_rtn(&values, rows, cols, dtype, group).unwrap();
        let (new_head, new_bytes) = after.tensor("head").unwrap();
        assert_eq!(
            (new_head.dtype, new_head.group_size),
            (dtype, Some(group as u64))
        );
        assert_eq!(new_bytes, &expected.to_bytes()[..]);
        // Round-to-nearest: every weight within half a step of the f16 original (plus the f16
        // rounding of the group's zero, at most half an ulp of its magnitude).
        let mut row = vec![0.0; cols];
        for r in 0..rows {
            expected.dequantize_row(r, &mut row);
            for (c, &got) in row.iter().enumerate() {
                let p = r * (cols / group) + c / group;
                let step = expected.scales[p].to_f32();
                let zero = expected.zeros[p].to_f32().abs();
                let want = values[r * cols + c];
                assert!(
                    (got - want).abs() <= step / 2.0 + zero * 2f32.powi(-11) + 1e-6,
                    "head[{r}, {c}]: {got} vs {want} (step {step})"
                );
            }
        }
        for entry in before.tensor_entries() {
            let changed = entry.name == "head"
                || (body.is_some()
                    && entry.name.starts_with("loop.")
                    && entry.dtype.is_quantized());
            if !changed {
                assert_eq!(
                    after.tensor(&entry.name).unwrap().1,
                    before.tensor(&entry.name).unwrap().1,
                    "{}",
                    entry.name
                );
            }
        }
        let note = &after.metadata["head_quantized"];
        assert_eq!(
            (&note["from"], &note["to"], &note["group_size"]),
            (&"f16".into(), &dtype.name().into(), &group.into())
        );
        assert_eq!(
            after.metadata.contains_key("loop_body_requantized"),
            body.is_some()
        );
        let nll = json(&[
            path_str(&out),
            "score",
            "--text",
            "To-morrow, and to-morrow",
            "--json",
        ])["nll"]
            .as_f64()
            .unwrap();
        assert!(nll.is_finite() && nll > 0.0, "{nll}");
    }
}

#[test]
fn requantize_errors_are_named() {
    let dir = common::scratch("requantize-errors");
    let out = dir.join("out.tinyloop");
    let o = path_str(&out);
    let int4 = common::synth_file("tiny", 1, 4);
    let f16 = common::synth_file("tiny", 1, 16);
    let int2 = common::synth_file("tiny", 1, 2);
    let (int4, f16, int2) = (path_str(&int4), path_str(&f16), path_str(&int2));
    let requantize = |model: &str, bits: &str, out: &str, expected: &str| {
        let args = [model, "requantize", "--loop-body-bits", bits, "--out", out];
        assert_one_line_error(&args, expected);
    };
    requantize(
        int4,
        "3",
        o,
        "'3' for '--loop-body-bits <BITS>': expected 2 or 4",
    );
    requantize(
        int4,
        "16",
        o,
        "'16' for '--loop-body-bits <BITS>': expected 2 or 4",
    );
    requantize(f16, "2", o, "loop-body tensor loop.0.attn_qkv is f16");
    requantize(
        int2,
        "2",
        o,
        "loop-body tensor loop.0.attn_qkv is already int2",
    );
    requantize(int4, "2", int4, "is the input model");
    requantize("/missing.tinyloop", "2", o, "cannot read /missing.tinyloop");
    assert_one_line_error(&[int4, "requantize", "--out", o], "--loop-body-bits");
    let head = |model: &str, args: &[&str], expected: &str| {
        let all: Vec<&str> = [model, "requantize"]
            .iter()
            .chain(args)
            .chain(&["--out", o])
            .copied()
            .collect();
        assert_one_line_error(&all, expected);
    };
    head(
        int4,
        &["--head-bits", "8"],
        "'8' for '--head-bits <BITS>': expected 2 or 4",
    );
    head(int4, &["--head-group-size", "32"], "--head-bits");
    // The tiny preset's head has 64 columns: a group of 48 does not divide them.
    head(
        int4,
        &["--head-bits", "4", "--head-group-size", "48"],
        "tensor head: ",
    );
    let tied = common::synth_file("tiny-tied", 1, 4);
    head(
        path_str(&tied),
        &["--head-bits", "4"],
        "the model's head is tied to the embedding",
    );
    let int4_head = dir.join("int4-head.tinyloop");
    let args = [
        int4,
        "requantize",
        "--head-bits",
        "4",
        "--out",
        path_str(&int4_head),
    ];
    assert!(tinyloop(&args).status.success());
    head(
        path_str(&int4_head),
        &["--head-bits", "2"],
        "the head is int4 already",
    );
    assert!(!out.exists(), "a failed requantize wrote {o}");
}

#[test]
fn an_int2_loop_body_requantizes_to_int4() {
    let source = common::synth_file("tiny", 1, 2);
    let out = common::scratch("requantize-up").join("int4-body.tinyloop");
    let args = [
        path_str(&source),
        "requantize",
        "--loop-body-bits",
        "4",
        "--out",
        path_str(&out),
    ];
    let status = tinyloop(&args);
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let file = ModelFile::open(&out).unwrap();
    assert_eq!(file.tensor("loop.0.mlp_down").unwrap().0.dtype, DType::Int4);
    assert_eq!(file.tensor("pre.0.mlp_down").unwrap().0.dtype, DType::Int2);
}
