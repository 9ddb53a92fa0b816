//! Helpers shared by the integration tests.
#![allow(dead_code)] // each test crate uses a different subset

pub mod reference;

use std::path::PathBuf;

use tinyloop::model::synth::{preset, random_model};
use tinyloop::{Device, Model, ModelOptions};

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tinyloop-test-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Write a synthetic model and return its path.
pub fn synth_file(preset_name: &str, seed: u64, bits: u32) -> PathBuf {
    let path = scratch("models").join(format!("{preset_name}-{seed}-{bits}.tinyloop"));
    if !path.exists() {
        let config = preset(preset_name).unwrap();
        let tmp = path.with_extension(format!("tmp{:?}", std::thread::current().id()));
        random_model(&config, seed, bits, 32)
            .unwrap()
            .write(&tmp)
            .unwrap();
        std::fs::rename(&tmp, &path).unwrap();
    }
    path
}

pub fn cpu_options() -> ModelOptions {
    ModelOptions {
        device: Some(Device::Cpu),
        max_seq_len: 256,
        log: false,
        ..ModelOptions::default()
    }
}

pub fn open_cpu(path: &std::path::Path) -> Model {
    Model::open(path, &cpu_options()).unwrap()
}

/// Deterministic pseudo-random tokens below `vocab`.
pub fn tokens(n: usize, vocab: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_add(salt).wrapping_mul(2_654_435_761) >> 9) % vocab as u32)
        .collect()
}
