//! Memory-mapped reader. Everything is validated before any tensor is handed out.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use half::f16;
use memmap2::Mmap;
use rayon::prelude::*;
use serde::Deserialize;

use super::{
    align_up, first_non_finite_f16, format_version, DType, TensorEntry, FORMAT_VERSION, MAGIC,
    MAX_HEADER_LEN, PREAMBLE_LEN,
};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use crate::model::layout::{expected_tensors, TensorRole};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Header {
    config: ModelConfig,
    tensors: Vec<TensorEntry>,
    #[serde(default)]
    metadata: serde_json::Map<String, serde_json::Value>,
}

/// The bytes of a model file: mapped from disk, or owned in memory.
enum Storage {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Storage {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            Storage::Mapped(map) => map,
            Storage::Owned(bytes) => bytes,
        }
    }
}

/// An opened, fully validated `.tinyloop` file.
pub struct ModelFile {
    bytes: Storage,
    data_start: usize,
    pub config: ModelConfig,
    pub metadata: serde_json::Map<String, serde_json::Value>,
    tensors: HashMap<String, TensorEntry>,
}

impl std::fmt::Debug for ModelFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ModelFile")
            .field("config", &self.config)
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl ModelFile {
    /// Open, map and validate a model file: preamble, header, config, the tensor table against the
    /// architecture, bounds, checksums and values.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelFile> {
        Self::validate(Storage::Mapped(map_file(path.as_ref())?))
    }

    /// Validate a model file held in memory (for example one received over a network).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<ModelFile> {
        Self::validate(Storage::Owned(bytes))
    }

    fn validate(storage: Storage) -> Result<ModelFile> {
        let bytes: &[u8] = &storage;
        if bytes.len() < PREAMBLE_LEN {
            if bytes.len() >= 8 && &bytes[..8] != MAGIC {
                return Err(Error::format("bad magic: not a .tinyloop file"));
            }
            return Err(Error::format(format!(
                "truncated file: {} bytes, the preamble alone needs {PREAMBLE_LEN}",
                bytes.len()
            )));
        }
        if &bytes[..8] != MAGIC {
            return Err(Error::format("bad magic: not a .tinyloop file"));
        }
        let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap());
        if !(1..=FORMAT_VERSION).contains(&version) {
            return Err(Error::format(format!(
                "unsupported format version {version} (this reader supports 1 to {FORMAT_VERSION})"
            )));
        }
        let flags = u32::from_le_bytes(bytes[12..16].try_into().unwrap());
        if flags != 0 {
            return Err(Error::format(format!(
                "unsupported flags {flags:#x} (version {version} defines none)"
            )));
        }
        let header_len = u64::from_le_bytes(bytes[16..24].try_into().unwrap());
        if header_len > MAX_HEADER_LEN {
            return Err(Error::format(format!(
                "header length {header_len} exceeds the {MAX_HEADER_LEN}-byte limit"
            )));
        }
        let header_end = PREAMBLE_LEN as u64 + header_len;
        if header_end > bytes.len() as u64 {
            return Err(Error::format(format!(
                "truncated file: header needs {header_end} bytes, file has {}",
                bytes.len()
            )));
        }
        let header: Header = serde_json::from_slice(&bytes[PREAMBLE_LEN..header_end as usize])
            .map_err(|e| Error::format(format!("header JSON: {e}")))?;
        header.config.validate()?;
        if version < format_version(&header.config) {
            return Err(Error::format(
                "config: architecture needs format version 2 (the file says 1)",
            ));
        }

        let data_start = align_up(header_end);
        let data_len = (bytes.len() as u64).saturating_sub(data_start);
        let mut tensors = HashMap::with_capacity(header.tensors.len());
        for entry in header.tensors {
            check_entry(&entry, data_len)?;
            let name = entry.name.clone();
            if tensors.insert(name.clone(), entry).is_some() {
                return Err(Error::format(format!("duplicate tensor {name}")));
            }
        }
        check_against_layout(&header.config, &tensors)?;

        let data = &bytes[data_start.min(bytes.len() as u64) as usize..];
        // Checksums and value checks read every byte once; tensors are independent.
        tensors.par_iter().try_for_each(|(name, entry)| {
            let range = entry.offset as usize..(entry.offset + entry.length) as usize;
            let bytes = &data[range];
            let actual = crc32fast::hash(bytes);
            if actual != entry.crc32 {
                return Err(Error::format(format!(
                    "checksum mismatch in tensor {name}: stored {:#010x}, computed {actual:#010x}",
                    entry.crc32
                )));
            }
            check_finite(entry, bytes)
        })?;

        Ok(ModelFile {
            bytes: storage,
            data_start: data_start as usize,
            config: header.config,
            metadata: header.metadata,
            tensors,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<(&TensorEntry, &[u8])> {
        let entry = self.tensors.get(name)?;
        let start = self.data_start + entry.offset as usize;
        Some((entry, &self.bytes[start..start + entry.length as usize]))
    }

    pub fn tensor_entries(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.values()
    }

    pub fn file_len(&self) -> usize {
        self.bytes.len()
    }
}

/// Map a regular file read-only.
pub(crate) fn map_file(path: &Path) -> Result<Mmap> {
    // Checked before opening: opening a FIFO would block, and a directory cannot be mapped.
    let kind = std::fs::metadata(path)
        .map_err(|e| Error::io(path, e))?
        .file_type();
    if !kind.is_file() {
        let what = if kind.is_dir() {
            "is a directory, not a file"
        } else {
            "is not a regular file"
        };
        return Err(Error::io(path, std::io::Error::other(what)));
    }
    let file = File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the map is read-only and never outlives its owner. Modifying the file while it is
    // mapped is outside the library's contract (as for any mmap reader).
    unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))
}

fn check_entry(entry: &TensorEntry, data_len: u64) -> Result<()> {
    let name = &entry.name;
    let expected = entry
        .expected_length()
        .map_err(|why| Error::format(format!("tensor {name}: {why}")))?;
    if entry.length != expected {
        return Err(Error::format(format!(
            "tensor {name}: length {} does not match dtype {} and shape {:?} ({expected} bytes)",
            entry.length,
            entry.dtype.name(),
            entry.shape
        )));
    }
    if !entry.offset.is_multiple_of(super::ALIGNMENT) {
        return Err(Error::format(format!(
            "tensor {name}: offset {} is not {}-byte aligned",
            entry.offset,
            super::ALIGNMENT
        )));
    }
    let end = entry.offset.checked_add(entry.length);
    if end.is_none_or(|end| end > data_len) {
        return Err(Error::format(format!(
            "tensor {name}: offset out of range ({}+{} past the {data_len}-byte data section; truncated file?)",
            entry.offset, entry.length
        )));
    }
    Ok(())
}

/// Reject NaN and infinite f16 values (whole f16 tensors; scales and zeros of quantized ones):
/// the forward pass would turn them into NaN logits.
fn check_finite(entry: &TensorEntry, bytes: &[u8]) -> Result<()> {
    let name = &entry.name;
    let value = |at: usize| f16::from_le_bytes([bytes[at], bytes[at + 1]]);
    let quantized = match entry.dtype {
        DType::F16 => false,
        DType::Int4 | DType::Int2 => true,
        DType::F32 => return Err(Error::format(format!("tensor {name}: f32 is reserved"))),
    };
    if !quantized {
        return match first_non_finite_f16(bytes) {
            None => Ok(()),
            Some(i) => Err(Error::format(format!(
                "tensor {name}: element {i} is {} (weights must be finite)",
                value(2 * i)
            ))),
        };
    }
    // Codes, then scales, then zeros.
    let (rows, cols) = (entry.shape[0], entry.shape[1]);
    let groups = cols / entry.group_size.unwrap_or(cols);
    let codes = (rows * cols / entry.dtype.codes_per_byte()) as usize;
    let Some(i) = first_non_finite_f16(&bytes[codes..]) else {
        return Ok(());
    };
    let n_params = (rows * groups) as usize;
    let (kind, p) = if i < n_params {
        ("scale", i)
    } else {
        ("zero", i - n_params)
    };
    Err(Error::format(format!(
        "tensor {name}: {kind} of row {}, group {} is {} (weights must be finite)",
        p as u64 / groups,
        p as u64 % groups,
        value(codes + 2 * i)
    )))
}

fn check_against_layout(
    config: &ModelConfig,
    tensors: &HashMap<String, TensorEntry>,
) -> Result<()> {
    let expected = expected_tensors(config);
    for spec in &expected {
        let entry = tensors
            .get(&spec.name)
            .ok_or_else(|| Error::format(format!("missing tensor {}", spec.name)))?;
        let dtype_ok = match spec.role {
            TensorRole::Vector | TensorRole::Table => entry.dtype == DType::F16,
            TensorRole::Linear => entry.dtype != DType::F32,
        };
        if !dtype_ok {
            return Err(Error::format(format!(
                "dtype mismatch in tensor {}: {} is not allowed for a {}",
                spec.name,
                entry.dtype.name(),
                spec.role.describe()
            )));
        }
        if entry.shape != spec.shape {
            return Err(Error::format(format!(
                "shape mismatch in tensor {}: file has {:?}, config implies {:?}",
                spec.name, entry.shape, spec.shape
            )));
        }
    }
    if tensors.len() != expected.len() {
        let unknown = tensors
            .keys()
            .find(|name| !expected.iter().any(|s| &s.name == *name))
            .cloned()
            .unwrap_or_default();
        return Err(Error::format(format!(
            "unexpected tensor {unknown} for this config"
        )));
    }
    Ok(())
}
