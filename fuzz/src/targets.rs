//! The fuzz targets. Rejecting an input with an error is fine; a finding is a property that fails
//! for an input the library accepted, returned as `Err` with a message.

use std::path::PathBuf;

use tinyloop::convert::Checkpoint;
use tinyloop::{Device, Error, GenerateParams, Model, ModelFile, ModelOptions, StateInit};

use crate::seeds::small_config;
use crate::Outcome;

/// Validate the bytes as a `.tinyloop` file and read every tensor of a file that passes.
pub fn header(bytes: &[u8]) -> Result<Outcome, String> {
    let file = match ModelFile::from_bytes(bytes.to_vec()) {
        Ok(file) => file,
        Err(e) => return Ok(rejected(&e)),
    };
    for entry in file.tensor_entries() {
        let (_, data) = file
            .tensor(&entry.name)
            .ok_or_else(|| format!("tensor {} is listed but cannot be read", entry.name))?;
        if data.len() as u64 != entry.length {
            return Err(format!(
                "tensor {} has {} bytes, not {}",
                entry.name,
                data.len(),
                entry.length
            ));
        }
    }
    Ok("valid")
}

/// Open the bytes as a model on the CPU; if that succeeds, score three tokens and generate two:
/// both must succeed, and the logits must be finite.
pub fn open_decode(bytes: &[u8]) -> Result<Outcome, String> {
    let path = scratch_file();
    std::fs::write(&path, bytes)
        .map_err(|e| format!("harness: cannot write {}: {e}", path.display()))?;
    let options = ModelOptions {
        max_seq_len: 16,
        prefill_chunk: 0,
        device: Some(Device::Cpu),
        max_loops: 8,
        kv_mode: None,
        log: false,
        fp16_body: None,
        state_init: StateInit::Model,
    };
    let opened = Model::open(&path, &options);
    std::fs::remove_file(&path).ok(); // an open model keeps its mapping
    let model = match opened {
        Ok(model) => model,
        Err(e) => return Ok(rejected(&e)),
    };
    let vocab = model.config().vocab_size as u32;
    let tokens = [1 % vocab, 0, 2 % vocab];
    let after_open = |what: &str, e: Error| format!("{what} failed on a model that opened: {e}");
    let mut session = model
        .new_session()
        .map_err(|e| after_open("new_session", e))?;
    // Finite weights can still overflow f16 activations; that must be an error, never NaN.
    let outcome = match session.score_last(&tokens, None) {
        Ok(logits) => match logits.iter().position(|v| !v.is_finite()) {
            Some(i) => return Err(format!("logit {i} is {} on a model that opened", logits[i])),
            None => "opened and decoded",
        },
        Err(Error::Format(why)) if why.contains("arithmetic overflowed") => {
            "opened; overflow reported"
        }
        Err(e) => return Err(after_open("score_last", e)),
    };
    let params = GenerateParams {
        max_tokens: 2,
        ..GenerateParams::default()
    };
    let generated = session
        .generate(&tokens, &params)
        .map_err(|e| after_open("generate", e))?;
    if generated.len() != 2 {
        return Err(format!(
            "generate returned {} tokens, not 2",
            generated.len()
        ));
    }
    Ok(outcome)
}

/// Parse the bytes as a checkpoint for [`small_config`].
pub fn safetensors(bytes: &[u8]) -> Result<Outcome, String> {
    Ok(match Checkpoint::parse(bytes, &small_config()) {
        Ok(_) => "parsed",
        Err(e) => rejected(&e),
    })
}

/// The kind of error an input was rejected with.
fn rejected(e: &Error) -> Outcome {
    match e {
        Error::Format(_) => "rejected: format",
        Error::InvalidArgument(_) => "rejected: invalid argument",
        Error::OutOfMemory { .. } => "rejected: out of memory",
        Error::Io { .. } | Error::Write { .. } => "rejected: io",
        _ => "rejected: other",
    }
}

/// A per-thread scratch file (the model API opens paths).
fn scratch_file() -> PathBuf {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    dir.join(format!(
        "tinyloop-fuzz-{}-{:?}.tinyloop",
        std::process::id(),
        std::thread::current().id()
    ))
}
