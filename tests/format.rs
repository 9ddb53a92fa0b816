//! The .tinyloop format: round trip, and one test per corruption class, each checking that the
//! error names the failure point.

mod common;

use serde_json::Value;
use tinyloop::model::synth::{preset, random_model};
use tinyloop::{Error, ModelFile};

fn valid_bytes() -> Vec<u8> {
    std::fs::read(common::synth_file("tiny-gqa", 3, 4)).unwrap()
}

fn header_of(bytes: &[u8]) -> (Value, usize) {
    let len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
    let data_start = (24 + len).div_ceil(64) * 64;
    (
        serde_json::from_slice(&bytes[24..24 + len]).unwrap(),
        data_start,
    )
}

/// Re-assemble a file with an edited header and the original data section.
fn with_header(bytes: &[u8], edit: impl FnOnce(&mut Value)) -> Vec<u8> {
    let (mut header, data_start) = header_of(bytes);
    edit(&mut header);
    let json = serde_json::to_vec(&header).unwrap();
    let mut out = bytes[..16].to_vec();
    out.extend((json.len() as u64).to_le_bytes());
    out.extend(&json);
    out.resize((24 + json.len()).div_ceil(64) * 64, 0);
    out.extend(&bytes[data_start..]);
    out
}

fn tensor<'a>(header: &'a mut Value, name: &str) -> &'a mut Value {
    header["tensors"]
        .as_array_mut()
        .unwrap()
        .iter_mut()
        .find(|t| t["name"] == name)
        .unwrap()
}

fn open_bytes(bytes: &[u8], name: &str) -> Result<ModelFile, Error> {
    let path = common::scratch("format").join(name);
    std::fs::write(&path, bytes).unwrap();
    ModelFile::open(&path)
}

/// Opening must fail with a format error whose message contains `expected`.
fn assert_rejected(bytes: &[u8], name: &str, expected: &str) {
    match open_bytes(bytes, name) {
        Err(Error::Format(msg)) => assert!(msg.contains(expected), "{name}: message {msg:?}"),
        Err(other) => panic!("{name}: wrong error kind {other:?}"),
        Ok(_) => panic!("{name}: corrupt file accepted"),
    }
}

#[test]
fn round_trip_preserves_config_metadata_and_every_tensor() {
    let config = preset("tiny-gqa").unwrap();
    let writer = random_model(&config, 5, 2, 32).unwrap();
    let path = common::scratch("format").join("roundtrip.tinyloop");
    writer.write(&path).unwrap();
    let file = ModelFile::open(&path).unwrap();
    assert_eq!(file.config, config);
    assert_eq!(file.metadata["tokenizer"], "bytes");
    // Rewriting what was read gives the identical file.
    let (header, data_start) = header_of(&std::fs::read(&path).unwrap());
    let bytes = std::fs::read(&path).unwrap();
    for t in header["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let (entry, data) = file.tensor(name).unwrap();
        let offset = data_start + t["offset"].as_u64().unwrap() as usize;
        assert_eq!(data, &bytes[offset..offset + data.len()], "{name}");
        assert_eq!(entry.crc32, crc32fast::hash(data));
        assert_eq!(offset % 64, 0, "{name} is not 64-byte aligned");
    }
    let again = random_model(&config, 5, 2, 32).unwrap();
    let path2 = common::scratch("format").join("roundtrip2.tinyloop");
    again.write(&path2).unwrap();
    assert_eq!(
        std::fs::read(&path2).unwrap(),
        bytes,
        "writer is not deterministic"
    );
}

#[test]
fn bad_magic() {
    let mut bytes = valid_bytes();
    bytes[0] = b'X';
    assert_rejected(&bytes, "magic", "bad magic");
}

#[test]
fn unsupported_version() {
    for version in [0u32, 3, u32::MAX] {
        let mut bytes = valid_bytes();
        bytes[8..12].copy_from_slice(&version.to_le_bytes());
        let expected = format!("unsupported format version {version}");
        assert_rejected(&bytes, "version", &expected);
    }
}

#[test]
fn own_architecture_is_written_as_version_1_and_read_as_2_too() {
    let bytes = valid_bytes();
    assert_eq!(u32::from_le_bytes(bytes[8..12].try_into().unwrap()), 1);
    let mut v2 = bytes.clone();
    v2[8..12].copy_from_slice(&2u32.to_le_bytes());
    ModelFile::from_bytes(v2).expect("a version-2 reader reads the default architecture");
}

#[test]
fn unknown_flags() {
    let mut bytes = valid_bytes();
    bytes[12] = 1;
    assert_rejected(&bytes, "flags", "unsupported flags");
}

#[test]
fn truncated_preamble_header_and_data() {
    let bytes = valid_bytes();
    assert_rejected(&bytes[..20], "trunc-preamble", "truncated file");
    assert_rejected(&bytes[..100], "trunc-header", "truncated file");
    assert_rejected(
        &bytes[..bytes.len() - 10],
        "trunc-data",
        "offset out of range",
    );
}

#[test]
fn huge_header_length() {
    let mut bytes = valid_bytes();
    bytes[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_rejected(&bytes, "header-len", "header length");
}

#[test]
fn malformed_header_json() {
    let mut bytes = valid_bytes();
    bytes[24] = b'!';
    assert_rejected(&bytes, "json", "header JSON");
}

#[test]
fn missing_tensor() {
    let bytes = with_header(&valid_bytes(), |h| {
        h["tensors"]
            .as_array_mut()
            .unwrap()
            .retain(|t| t["name"] != "loop.1.mlp_up");
    });
    assert_rejected(&bytes, "missing", "missing tensor loop.1.mlp_up");
}

#[test]
fn unexpected_tensor() {
    let bytes = with_header(&valid_bytes(), |h| {
        let mut extra = tensor(h, "final_norm").clone();
        extra["name"] = "surprise".into();
        h["tensors"].as_array_mut().unwrap().push(extra);
    });
    assert_rejected(&bytes, "extra", "unexpected tensor surprise");
}

#[test]
fn shape_mismatch() {
    let bytes = with_header(&valid_bytes(), |h| {
        // Keep the byte length consistent so only the shape check can catch it.
        let t = tensor(h, "final_norm");
        t["shape"] = serde_json::json!([32, 2]);
    });
    assert_rejected(&bytes, "shape", "shape mismatch in tensor final_norm");
}

#[test]
fn dtype_mismatch() {
    let bytes = with_header(&valid_bytes(), |h| {
        let t = tensor(h, "final_norm");
        t["dtype"] = "f32".into();
        t["shape"] = serde_json::json!([32]);
    });
    assert_rejected(&bytes, "dtype", "dtype mismatch in tensor final_norm");
}

#[test]
fn length_inconsistent_with_shape() {
    let bytes = with_header(&valid_bytes(), |h| {
        let t = tensor(h, "pre.0.attn_out");
        t["length"] = (t["length"].as_u64().unwrap() - 2).into();
    });
    assert_rejected(&bytes, "length", "tensor pre.0.attn_out: length");
}

#[test]
fn checksum_mismatch() {
    let mut bytes = valid_bytes();
    let (mut header, data_start) = header_of(&bytes);
    let t = tensor(&mut header, "loop.0.attn_qkv");
    let at = data_start + t["offset"].as_u64().unwrap() as usize + 5;
    bytes[at] ^= 0x40;
    assert_rejected(&bytes, "crc", "checksum mismatch in tensor loop.0.attn_qkv");
}

#[test]
fn offset_out_of_range_and_misaligned() {
    let bytes = with_header(&valid_bytes(), |h| {
        tensor(h, "embed")["offset"] = (1u64 << 40).into();
    });
    assert_rejected(&bytes, "range", "tensor embed: offset out of range");
    let bytes = with_header(&valid_bytes(), |h| {
        tensor(h, "embed")["offset"] = 3.into();
    });
    assert_rejected(&bytes, "align", "not 64-byte aligned");
}

#[test]
fn invalid_config() {
    let bytes = with_header(&valid_bytes(), |h| h["config"]["n_kv_heads"] = 3.into());
    assert_rejected(
        &bytes,
        "config",
        "n_heads 4 is not divisible by n_kv_heads 3",
    );
}

#[test]
fn missing_file_is_an_io_error_naming_the_path() {
    let err = ModelFile::open("/nonexistent/model.tinyloop").unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("/nonexistent/model.tinyloop"));
}

#[test]
fn a_directory_is_an_io_error_saying_so() {
    let dir = common::scratch("format-dir");
    let err = ModelFile::open(&dir).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");
    assert!(err.to_string().contains("is a directory"), "{err}");
}

#[test]
fn bytes_in_memory_are_validated_like_a_file() {
    let bytes = valid_bytes();
    let file = ModelFile::from_bytes(bytes.clone()).unwrap();
    assert_eq!(file.config, preset("tiny-gqa").unwrap());
    let mut corrupt = bytes;
    corrupt[0] = b'X';
    let err = ModelFile::from_bytes(corrupt).unwrap_err();
    assert!(err.to_string().contains("bad magic"), "{err}");
}

#[test]
fn group_size_on_an_unquantized_tensor() {
    let bytes = with_header(&valid_bytes(), |h| {
        tensor(h, "final_norm")["group_size"] = 32.into();
    });
    assert_rejected(
        &bytes,
        "f16-group",
        "tensor final_norm: group_size 32 given for an unquantized f16 tensor",
    );
}

#[test]
fn group_size_that_does_not_divide_the_columns() {
    // pre.0.attn_out is [64, 64]; 48 is a whole number of bytes but does not divide 64.
    let bytes = with_header(&valid_bytes(), |h| {
        tensor(h, "pre.0.attn_out")["group_size"] = 48.into();
    });
    assert_rejected(
        &bytes,
        "group-divide",
        "tensor pre.0.attn_out: group_size 48 does not divide 64 columns",
    );
}

/// Every config limit is accepted at its value and rejected one above (docs/FORMAT.md "Limits").
#[test]
fn config_limits_are_inclusive() {
    use tinyloop::model::config::limits::*;
    let base = preset("tiny").unwrap();
    let at_limit = [
        ("dim", MAX_DIM),
        ("ffn_dim", MAX_FFN_DIM),
        ("vocab_size", MAX_VOCAB),
        ("embed_factor_dim", MAX_DIM),
        ("n_pre_blocks", MAX_BLOCKS),
        ("n_loop_blocks", MAX_BLOCKS),
        ("n_post_blocks", MAX_BLOCKS),
        ("default_loops", MAX_DEFAULT_LOOPS),
        ("max_position", MAX_POSITION),
        ("n_heads", MAX_HEADS),
    ];
    for (key, limit) in at_limit {
        let with = |value: usize| {
            let mut config = serde_json::to_value(&base).unwrap();
            config[key] = value.into();
            if key == "n_heads" {
                // Heads must divide dim into even head dims and be divisible by the KV heads.
                config["dim"] = (2 * value).into();
                config["n_kv_heads"] = 1.into();
            }
            serde_json::from_value::<tinyloop::ModelConfig>(config).unwrap()
        };
        with(limit).validate().unwrap();
        let err = with(limit + 1).validate().unwrap_err();
        let expected = format!("{key} {} exceeds the limit {limit}", limit + 1);
        assert!(err.to_string().contains(&expected), "{err}");
    }
}

/// The smallest group sizes the format allows (one byte of codes: 2 for int4, 4 for int2) run
/// correctly: logits against the f64 reference, with the tolerance of tests/forward.rs (2e-3
/// relative L2 error; see there for why).
#[test]
fn smallest_group_sizes_match_the_reference() {
    use common::reference::Reference;
    let config = preset("tiny-gqa").unwrap();
    for (bits, group) in [(4, 2), (2, 4)] {
        let path = common::scratch("format").join(format!("group-{bits}-{group}.tinyloop"));
        random_model(&config, 3, bits, group)
            .unwrap()
            .write(&path)
            .unwrap();
        let reference = Reference::load(&std::fs::read(&path).unwrap());
        let model = common::open_cpu(&path);
        let input = common::tokens(7, config.vocab_size, 1);
        let actual = model.new_session().unwrap().score(&input, Some(2)).unwrap();
        let expected: Vec<f64> = reference.logits(&input, 2).into_iter().flatten().collect();
        let diff: f64 = actual
            .iter()
            .zip(&expected)
            .map(|(&a, &b)| (a as f64 - b).powi(2))
            .sum();
        let norm: f64 = expected.iter().map(|b| b * b).sum();
        let err = (diff / norm).sqrt();
        assert!(
            err < 2e-3,
            "int{bits} group {group}: relative error {err:.2e}"
        );
    }
}
