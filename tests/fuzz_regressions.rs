//! Inputs of the kinds the fuzzers found (fuzz/, docs/RELIABILITY.md), rebuilt programmatically:
//! each was a panic, an abort, a hang, a multi-gigabyte allocation or NaN logits before the loader
//! was hardened, and each is now a clear error. Checksums are recomputed after every edit, as the
//! fuzzers do, so that the checks behind the checksum are the ones tested.

mod common;

use serde_json::{json, Value};
use tinyloop::model::synth::{preset, random_model};
use tinyloop::{Device, Error, GenerateParams, Model, ModelConfig, ModelOptions};

/// A `.tinyloop` file taken apart, to be edited and put back together.
struct Parts {
    preamble: Vec<u8>,
    header: Value,
    data: Vec<u8>,
}

impl Parts {
    fn of(config: &ModelConfig, bits: u32, group: usize) -> Parts {
        let bytes = random_model(config, 5, bits, group).unwrap().to_bytes();
        let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
        Parts {
            preamble: bytes[..16].to_vec(),
            header: serde_json::from_slice(&bytes[24..24 + len]).unwrap(),
            data: bytes[(24 + len).div_ceil(64) * 64..].to_vec(),
        }
    }

    fn tiny() -> Parts {
        Parts::of(&preset("tiny").unwrap(), 4, 32)
    }

    fn tensor(&self, name: &str) -> &Value {
        let tensors = self.header["tensors"].as_array().unwrap();
        tensors.iter().find(|t| t["name"] == name).unwrap()
    }

    /// The data-section range of a tensor.
    fn range(&self, name: &str) -> std::ops::Range<usize> {
        let t = self.tensor(name);
        let offset = t["offset"].as_u64().unwrap() as usize;
        offset..offset + t["length"].as_u64().unwrap() as usize
    }

    /// Set f16 element `index` of tensor `name` (counting from its first byte).
    fn set_f16(&mut self, name: &str, index: usize, value: half::f16) {
        let at = self.range(name).start + 2 * index;
        self.data[at..at + 2].copy_from_slice(&value.to_le_bytes());
    }

    /// The bytes, with every checksum recomputed.
    fn bytes(&mut self) -> Vec<u8> {
        for t in self.header["tensors"].as_array_mut().unwrap() {
            let offset = t["offset"].as_u64().unwrap() as usize;
            let length = t["length"].as_u64().unwrap() as usize;
            if let Some(bytes) = self.data.get(offset..offset + length) {
                t["crc32"] = crc32fast::hash(bytes).into();
            }
        }
        let json = serde_json::to_vec(&self.header).unwrap();
        let mut out = self.preamble.clone();
        out.extend((json.len() as u64).to_le_bytes());
        out.extend(&json);
        out.resize(out.len().div_ceil(64) * 64, 0);
        out.extend(&self.data);
        out
    }
}

fn options() -> ModelOptions {
    ModelOptions {
        device: Some(Device::Cpu),
        max_seq_len: 16,
        max_loops: 8,
        log: false,
        ..ModelOptions::default()
    }
}

fn open(bytes: &[u8], name: &str) -> Result<Model, Error> {
    let path = common::scratch("fuzz-regressions").join(name);
    std::fs::write(&path, bytes).unwrap();
    Model::open(&path, &options())
}

/// Opening must fail with a format error whose message contains every one of `expected`.
fn assert_format_error(bytes: &[u8], name: &str, expected: &[&str]) {
    match open(bytes, name) {
        Err(Error::Format(msg)) => {
            for part in expected {
                assert!(msg.contains(part), "{name}: {msg:?} lacks {part:?}");
            }
        }
        Err(other) => panic!("{name}: wrong error kind {other:?}"),
        Ok(_) => panic!("{name}: accepted"),
    }
}

/// Found as capacity-overflow panics, aborts on 34–144 PB allocations, and a hang building 16 M
/// block names: every block count is checked against its limit before anything is sized by it.
#[test]
fn huge_block_counts_are_rejected_before_anything_is_sized_by_them() {
    for key in ["n_pre_blocks", "n_loop_blocks", "n_post_blocks"] {
        for count in [1u64 << 24, (1 << 31) - 1, (1 << 32) - 1, 1 << 53, u64::MAX] {
            let mut parts = Parts::tiny();
            parts.header["config"][key] = count.into();
            let expected = format!("{key} {count} exceeds the limit 1024");
            assert_format_error(&parts.bytes(), &format!("{key}-{count}"), &[&expected]);
        }
    }
}

/// A dimension of 2^63 used to make every expected length wrap to 0, so that a 3 KB file passed
/// validation; every field now has a range, and tensor sizes are computed with checked arithmetic.
#[test]
fn dimensions_whose_products_overflow_are_rejected() {
    for (key, value) in [
        ("dim", 1u64 << 63),
        ("ffn_dim", 1 << 40),
        ("vocab_size", 1 << 32),
        ("embed_factor_dim", u64::MAX),
        ("n_heads", 1 << 20),
        ("max_position", 1 << 40),
        ("default_loops", 1 << 32),
    ] {
        let mut parts = Parts::tiny();
        parts.header["config"][key] = value.into();
        let expected = format!("{key} {value} exceeds the limit");
        assert_format_error(&parts.bytes(), key, &[&expected]);
    }
    // A table entry whose own shape overflows is rejected before it is compared with the config.
    let mut parts = Parts::tiny();
    let embed = parts.header["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["name"] == "embed")
        .unwrap();
    embed["shape"] = json!([1u64 << 62, 1u64 << 62]);
    assert_format_error(
        &parts.bytes(),
        "shape-overflow",
        &["tensor embed", "too large"],
    );
}

/// Found as NaN logits (a NaN in `final_norm` generated token 0 forever, exit status 0): every
/// f16 value (norms, embedding, head, f16 weights, quantization scales and zeros) must be finite.
#[test]
fn non_finite_weights_are_rejected_naming_the_tensor() {
    let nan = half::f16::NAN;
    let inf = half::f16::INFINITY;
    let neg_inf = half::f16::NEG_INFINITY;
    let cases: [(&str, usize, half::f16, &str); 4] = [
        ("final_norm", 3, nan, "tensor final_norm: element 3 is NaN"),
        ("embed", 100, inf, "tensor embed: element 100 is inf"),
        ("head", 7, neg_inf, "tensor head: element 7 is -inf"),
        (
            "pre.1.attn_norm",
            0,
            nan,
            "tensor pre.1.attn_norm: element 0 is NaN",
        ),
    ];
    for (name, index, value, expected) in cases {
        let mut parts = Parts::tiny();
        parts.set_f16(name, index, value);
        assert_format_error(&parts.bytes(), name, &[expected]);
    }
    // Quantized weights: a scale, then a zero. `loop.0.mlp_up` is [256, 64] int4 with groups of
    // 32: 8192 bytes of codes, then 512 scales, then 512 zeros.
    let mut parts = Parts::tiny();
    let codes = 256 * 64 / 2;
    let scale = codes / 2 + 5; // f16 index of scale 5: row 2, group 1
    parts.set_f16("loop.0.mlp_up", scale, inf);
    assert_format_error(
        &parts.bytes(),
        "scale",
        &["tensor loop.0.mlp_up: scale of row 2, group 1 is inf"],
    );
    let mut parts = Parts::tiny();
    parts.set_f16("loop.0.mlp_up", codes / 2 + 512 + 1, nan);
    assert_format_error(
        &parts.bytes(),
        "zero",
        &["tensor loop.0.mlp_up: zero of row 0, group 1 is NaN"],
    );
}

/// Found as NaN logits from a file whose weights are all finite: a norm weight of 65504 (the
/// largest f16) overflows the f16 activations. The model opens (nothing is wrong with any single
/// value), but the logits are never handed out as NaN: scoring is an error saying why, and
/// generation completes without panicking.
#[test]
fn finite_weights_that_overflow_f16_activations_are_an_error_not_nan_logits() {
    let mut parts = Parts::tiny();
    for i in 0..64 {
        parts.set_f16("loop.0.mlp_norm", i, half::f16::MAX);
    }
    let model = open(&parts.bytes(), "overflow").expect("every value is finite");
    let mut session = model.new_session().unwrap();
    for result in [
        session.score_last(&[1, 2, 3], None),
        session.score(&[1, 2, 3], None),
    ] {
        match result {
            Err(Error::Format(msg)) => assert!(msg.contains("arithmetic overflowed"), "{msg}"),
            other => panic!("expected an overflow error, got {other:?}"),
        }
    }
    let params = GenerateParams {
        max_tokens: 2,
        ..GenerateParams::default()
    };
    assert_eq!(session.generate(&[1, 2, 3], &params).unwrap().len(), 2);
}

/// Found as a panic (`synth --bits 4 --group-size 1`) and as silently wrong logits (int4 groups of
/// 3 had a relative error of 1.18 against the reference): a group must be a whole number of
/// bytes of codes. Files, synth and convert all reject other sizes, naming the tensor.
#[test]
fn group_sizes_that_split_a_byte_are_rejected() {
    for (bits, group) in [(4, 1), (4, 3), (2, 2), (2, 6)] {
        let mut parts = Parts::tiny();
        let qkv = parts.header["tensors"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|t| t["name"] == "pre.0.attn_qkv")
            .unwrap();
        qkv["group_size"] = group.into();
        qkv["dtype"] = if bits == 4 { "int4" } else { "int2" }.into();
        let expected = format!(
            "group_size {group} is not a positive multiple of {}",
            8 / bits
        );
        assert_format_error(
            &parts.bytes(),
            &format!("group-{bits}-{group}"),
            &["tensor pre.0.attn_qkv", &expected],
        );

        let err = random_model(&preset("tiny").unwrap(), 1, bits, group as usize)
            .err()
            .expect("synth accepted the group size");
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains("tensor pre.0.attn_qkv")
                && m.contains(&expected)),
            "synth int{bits} group {group}: {err}"
        );
    }
}

/// Found as an abort: `max_seq_len` 67 108 864 asked for a 16 GiB RoPE table (and more for the
/// buffers). Sequences are bounded by the model's `max_position`; the error gives both numbers.
#[test]
fn max_seq_len_beyond_max_position_is_an_error_not_an_abort() {
    let mut parts = Parts::tiny();
    let bytes = parts.bytes();
    for max_seq_len in [2049, 67_108_864, 1 << 31, usize::MAX] {
        let path = common::scratch("fuzz-regressions").join("seq.tinyloop");
        std::fs::write(&path, &bytes).unwrap();
        let options = ModelOptions {
            max_seq_len,
            ..options()
        };
        let err = Model::open(&path, &options).unwrap_err();
        let expected = format!("max_seq_len {max_seq_len} exceeds the model's max_position 2048");
        assert!(
            matches!(&err, Error::InvalidArgument(m) if m.contains(&expected)),
            "{err}"
        );
    }
}

/// Options the file's config contradicts, or whose products cannot be sized.
#[test]
fn loop_options_are_checked_at_open() {
    let mut parts = Parts::tiny();
    parts.header["config"]["default_loops"] = 9.into();
    let err = open(&parts.bytes(), "default-loops").unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m)
            if m.contains("the model's default_loops 9 exceeds max_loops 8")),
        "{err}"
    );

    let path = common::scratch("fuzz-regressions").join("loops.tinyloop");
    std::fs::write(&path, Parts::tiny().bytes()).unwrap();
    let options = ModelOptions {
        max_loops: usize::MAX,
        ..options()
    };
    let err = Model::open(&path, &options).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidArgument(m) if m.contains("would exceed the address space")),
        "{err}"
    );
}

/// Config values that turn into NaN inside the arithmetic: an ε that is 0 as an f32, and RoPE
/// bases whose angles overflow.
#[test]
fn numeric_config_values_that_break_the_arithmetic_are_rejected() {
    // (serde_json parses decimal exponents to the nearest few ulps, so messages are matched
    // without the printed value.)
    let eps = "must be positive and representable as f32";
    for (key, value, expected) in [
        ("norm_eps", json!(1e-50), ["norm_eps", eps]),
        ("norm_eps", json!(1e39), ["norm_eps", eps]),
        ("rope_theta", json!(1e-310), ["rope_theta", "must be ≥ 1"]),
        ("rope_theta", json!(0.5), ["rope_theta 5e-1", "must be ≥ 1"]),
    ] {
        let mut parts = Parts::tiny();
        parts.header["config"][key] = value;
        assert_format_error(&parts.bytes(), key, &expected);
    }
}
