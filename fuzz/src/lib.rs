//! Fuzzing of the three ways a file enters TinyLoop: the `.tinyloop` header and tensor table,
//! opening a model and running it, and the converter's safetensors reader.
//!
//! Each target is a function from bytes to an [`Outcome`] (how the input was handled) or a
//! finding (a property that failed). Panics, aborts, hangs and oversized allocations are caught
//! by the runner: libFuzzer (`fuzz_targets/`) or the stable-toolchain runner (`src/main.rs`).
//! Both use the structure-aware mutators of [`mutate`], which keep checksums valid so that
//! mutations reach past the CRC check.

pub mod container;
pub mod mutate;
pub mod rng;
pub mod seeds;
pub mod targets;

/// How a target handled an input that raised no finding: a short label, counted by the runner.
pub type Outcome = &'static str;

/// The fuzz targets by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// `ModelFile::from_bytes`: preamble, header JSON, config, tensor table, checksums, values.
    Header,
    /// `Model::open` on the CPU, then `score_last` and a two-token `generate`.
    OpenDecode,
    /// The converter's safetensors reader (`convert::Checkpoint::parse`).
    Safetensors,
}

impl Target {
    pub const ALL: [Target; 3] = [Target::Header, Target::OpenDecode, Target::Safetensors];

    pub fn name(self) -> &'static str {
        match self {
            Target::Header => "header",
            Target::OpenDecode => "open_decode",
            Target::Safetensors => "safetensors",
        }
    }

    pub fn from_name(name: &str) -> Option<Target> {
        Target::ALL.into_iter().find(|t| t.name() == name)
    }

    /// Run one input.
    pub fn run(self, bytes: &[u8]) -> Result<Outcome, String> {
        match self {
            Target::Header => targets::header(bytes),
            Target::OpenDecode => targets::open_decode(bytes),
            Target::Safetensors => targets::safetensors(bytes),
        }
    }

    /// The seed corpus.
    pub fn seeds(self) -> Vec<Vec<u8>> {
        match self {
            Target::Header | Target::OpenDecode => seeds::tinyloop_files(),
            Target::Safetensors => seeds::safetensors_files(),
        }
    }

    /// A mutation of `input`.
    pub fn mutate(self, input: &[u8], rng: &mut rng::Rng) -> Vec<u8> {
        match self {
            Target::Header | Target::OpenDecode => mutate::tinyloop(input, rng),
            Target::Safetensors => mutate::safetensors(input, rng),
        }
    }
}

/// libFuzzer's custom-mutator hook: a structure-aware mutation of `data[..size]` written back in
/// place, or libFuzzer's own byte-level mutation (`fallback`) one time in four and whenever the
/// result would not fit in `max_size`.
pub fn libfuzzer_mutate(
    target: Target,
    data: &mut [u8],
    size: usize,
    max_size: usize,
    seed: u32,
    fallback: impl FnOnce(&mut [u8], usize, usize) -> usize,
) -> usize {
    let mut rng = rng::Rng::new(u64::from(seed));
    if rng.below(4) == 0 {
        return fallback(data, size, max_size);
    }
    let out = target.mutate(&data[..size], &mut rng);
    if out.len() > max_size.min(data.len()) {
        return fallback(data, size, max_size);
    }
    data[..out.len()].copy_from_slice(&out);
    out.len()
}
