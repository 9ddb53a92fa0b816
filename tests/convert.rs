//! `tinyloop convert`: safetensors + config JSON → .tinyloop, by RTN and GPTQ, with clear errors.

mod common;

use std::collections::HashMap;
use std::path::PathBuf;

use tinyloop::convert::{convert, Checkpoint, ConvertOptions, Input, Method};
use tinyloop::model::layout::expected_tensors;
use tinyloop::model::synth::preset;
use tinyloop::{Error, Model};

fn options(st: PathBuf, cfg: PathBuf, bits: u32, method: Method, out: &str) -> ConvertOptions {
    ConvertOptions {
        input: Input::TinyLoop {
            safetensors: st,
            config: cfg,
        },
        out: common::scratch("convert").join(out),
        bits,
        group_size: 32,
        method,
        calibration: common::tokens(300, 256, 1),
        calibration_loops: None,
        window: 64,
        metadata: Default::default(),
        progress: false,
    }
}

#[test]
fn rtn_and_gptq_conversions_load_and_agree_with_f16() {
    let (st, cfg) = common::checkpoint("tiny-gqa", None, None);
    let input = common::tokens(12, 256, 5);
    let mut logits = HashMap::new();
    for (bits, method, name) in [
        (16, Method::Rtn, "f16"),
        (4, Method::Rtn, "int4-rtn"),
        (4, Method::Gptq, "int4-gptq"),
        (2, Method::Gptq, "int2-gptq"),
    ] {
        let opts = options(
            st.clone(),
            cfg.clone(),
            bits,
            method,
            &format!("{name}.tinyloop"),
        );
        convert(&opts).unwrap();
        let model = common::open_cpu(&opts.out);
        assert_eq!(model.info().metadata["tokenizer"], "bytes");
        logits.insert(
            name,
            model.new_session().unwrap().score(&input, Some(2)).unwrap(),
        );
    }
    let rel = |a: &[f32], b: &[f32]| {
        let d: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let n: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (d / n).sqrt()
    };
    // Quantization perturbs the logits but keeps them near the f16 model's. Measured on this
    // deterministic checkpoint: int4-rtn 0.22, int4-gptq 0.17, int2-gptq 0.66 relative L2. A gross
    // conversion error (a transposed, misnamed or misplaced weight) decorrelates the logits and gives
    // about sqrt(2) ≈ 1.4, so the bounds below catch it with margin; fewer bits must cost accuracy.
    let (int4_rtn, int4_gptq, int2_gptq) = (
        rel(&logits["int4-rtn"], &logits["f16"]),
        rel(&logits["int4-gptq"], &logits["f16"]),
        rel(&logits["int2-gptq"], &logits["f16"]),
    );
    assert!(
        int4_rtn < 0.4 && int4_gptq < 0.4,
        "int4: rtn {int4_rtn}, gptq {int4_gptq}"
    );
    assert!(int2_gptq < 1.0, "int2 gptq {int2_gptq}");
    assert!(
        int4_gptq < int2_gptq,
        "int4 {int4_gptq} vs int2 {int2_gptq}"
    );
}

#[test]
fn missing_tensor_is_named() {
    let (st, cfg) = common::checkpoint("tiny", Some("loop.0.mlp_up"), None);
    let err = convert(&options(st, cfg, 4, Method::Rtn, "missing.tinyloop")).unwrap_err();
    assert!(
        matches!(&err, Error::Format(m) if m.contains("no tensor loop.0.mlp_up")),
        "{err}"
    );
}

#[test]
fn unknown_tensor_is_named() {
    let (st, cfg) = common::checkpoint("tiny", None, Some("lm_head.weight"));
    let err = convert(&options(st, cfg, 4, Method::Rtn, "extra.tinyloop")).unwrap_err();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

#[test]
fn shape_mismatch_is_named() {
    // The checkpoint is tiny-tied (no pre blocks) but the config claims tiny.
    let (st, _) = common::checkpoint("tiny", None, None);
    let (_, other_cfg) = common::checkpoint("small", None, None);
    let err = convert(&options(st, other_cfg, 4, Method::Rtn, "shape.tinyloop")).unwrap_err();
    assert!(err.to_string().contains("checkpoint shape"), "{err}");
}

#[test]
fn gptq_without_calibration_is_an_error() {
    let (st, cfg) = common::checkpoint("tiny", None, None);
    let mut opts = options(st, cfg, 4, Method::Gptq, "nocalib.tinyloop");
    opts.calibration.clear();
    let err = convert(&opts).unwrap_err();
    assert!(err.to_string().contains("calibration"), "{err}");
}

#[test]
fn converted_model_generates() {
    let (st, cfg) = common::checkpoint("tiny", None, None);
    let opts = options(st, cfg, 2, Method::Rtn, "gen.tinyloop");
    convert(&opts).unwrap();
    let model = Model::open(&opts.out, &common::cpu_options()).unwrap();
    let out = model
        .new_session()
        .unwrap()
        .generate(
            &[1, 2, 3],
            &tinyloop::GenerateParams {
                max_tokens: 5,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(out.len(), 5);
}

/// A checkpoint of `preset_name` in memory, every value 0.5 except `value` at element `at` of
/// tensor `poisoned`.
fn checkpoint_with(preset_name: &str, poisoned: &str, at: usize, value: f32) -> Vec<u8> {
    let config = preset(preset_name).unwrap();
    let data: Vec<(String, Vec<usize>, Vec<u8>)> = expected_tensors(&config)
        .into_iter()
        .map(|spec| {
            let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
            let n: usize = shape.iter().product();
            let bytes = (0..n)
                .flat_map(|i| {
                    let v = if spec.name == poisoned && i == at {
                        value
                    } else {
                        0.5
                    };
                    v.to_le_bytes()
                })
                .collect();
            (spec.name, shape, bytes)
        })
        .collect();
    let views = data.iter().map(|(name, shape, bytes)| {
        let view =
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), bytes);
        (name.as_str(), view.unwrap())
    });
    safetensors::serialize(views, None).unwrap()
}

#[test]
fn non_finite_checkpoint_values_are_named() {
    let config = preset("tiny").unwrap();
    for (value, expected) in [
        (f32::NAN, "tensor final_norm: element 5 is NaN"),
        (f32::INFINITY, "tensor final_norm: element 5 is inf"),
    ] {
        let bytes = checkpoint_with("tiny", "final_norm", 5, value);
        let err = Checkpoint::parse(&bytes, &config).err().expect("accepted");
        assert!(
            matches!(&err, Error::Format(m) if m.contains(expected)),
            "{err}"
        );
    }
    let err = Checkpoint::parse(b"not a checkpoint", &config)
        .err()
        .expect("accepted");
    assert!(
        matches!(&err, Error::Format(m) if m.contains("safetensors")),
        "{err}"
    );
}

#[test]
fn values_outside_the_f16_range_are_named() {
    let dir = common::scratch("convert");
    let (st, cfg) = (dir.join("big.safetensors"), dir.join("big.json"));
    std::fs::write(&st, checkpoint_with("tiny", "embed", 7, 1e6)).unwrap();
    std::fs::write(
        &cfg,
        serde_json::to_string(&preset("tiny").unwrap()).unwrap(),
    )
    .unwrap();
    let err = convert(&options(st, cfg, 4, Method::Rtn, "big.tinyloop")).unwrap_err();
    assert!(
        err.to_string()
            .contains("tensor embed: element 7 (1000000) is outside the f16 range"),
        "{err}"
    );
}

#[test]
fn unsupported_group_sizes_and_windows_are_named() {
    let (st, cfg) = common::checkpoint("tiny", None, None);
    let mut opts = options(st, cfg, 4, Method::Rtn, "group.tinyloop");
    opts.group_size = 3;
    let err = convert(&opts).unwrap_err();
    assert!(
        err.to_string()
            .contains("tensor pre.0.attn_qkv: group_size 3 is not a positive multiple of 2"),
        "{err}"
    );
    opts.group_size = 32;
    opts.method = Method::Gptq;
    opts.window = 4096;
    let err = convert(&opts).unwrap_err();
    assert!(
        err.to_string()
            .contains("calibration window 4096 exceeds the model's max_position 2048"),
        "{err}"
    );
}

/// A group size larger than a tensor's columns is refused (it would be stored smaller than the
/// metadata says); sizes that fit are recorded as given.
#[test]
fn group_sizes_above_a_tensor_s_columns_are_refused_and_metadata_is_truthful() {
    let (st, cfg) = common::checkpoint("tiny", None, None);
    let mut opts = options(st, cfg, 4, Method::Rtn, "g128.tinyloop");
    opts.group_size = 128;
    let err = convert(&opts).unwrap_err().to_string();
    assert!(
        err.contains("tensor pre.0.attn_qkv: group_size 128 exceeds its 64 columns"),
        "{err}"
    );
    assert!(!opts.out.exists());
    for (group_size, recorded) in [(32, "int4 g32 rtn"), (0, "int4 per-row rtn")] {
        opts.group_size = group_size;
        convert(&opts).unwrap();
        let model = common::open_cpu(&opts.out);
        assert_eq!(model.info().metadata["quantization"], recorded);
        let file = tinyloop::ModelFile::open(&opts.out).unwrap();
        // The five linears of a block; its norms are vectors.
        let linears: Vec<_> = file
            .tensor_entries()
            .filter(|t| t.name.starts_with("pre.0.") && t.shape.len() == 2)
            .collect();
        assert_eq!(linears.len(), 5);
        for t in linears {
            let expected = if group_size == 0 {
                t.shape[1]
            } else {
                group_size as u64
            };
            assert_eq!(t.group_size, Some(expected), "{}", t.name);
        }
    }
}

/// Window 0 (the default) calibrates in windows of 512 tokens, or of max_position when that is
/// smaller: a model of 256 positions converts without naming a window.
#[test]
fn gptq_default_window_fits_the_model_s_positions() {
    let (st, _) = common::checkpoint("tiny", None, None);
    let config = tinyloop::ModelConfig {
        max_position: 256,
        ..preset("tiny").unwrap()
    };
    let cfg = common::scratch("convert").join("positions-256.json");
    std::fs::write(&cfg, serde_json::to_string(&config).unwrap()).unwrap();
    let mut opts = options(st, cfg, 4, Method::Gptq, "window-default.tinyloop");
    opts.calibration = common::tokens(600, 256, 2);
    opts.window = 0;
    convert(&opts).unwrap();
    opts.window = 512;
    let err = convert(&opts).unwrap_err().to_string();
    assert!(
        err.contains("calibration window 512 exceeds the model's max_position 256"),
        "{err}"
    );
}
