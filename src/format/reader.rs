//! Memory-mapped reader. Everything is validated before any tensor is handed out.

use std::collections::HashMap;
use std::fs::File;
use std::path::Path;

use memmap2::Mmap;
use rayon::prelude::*;
use serde::Deserialize;

use super::{align_up, DType, TensorEntry, FORMAT_VERSION, MAGIC, MAX_HEADER_LEN, PREAMBLE_LEN};
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

/// An opened, fully validated `.tinyloop` file.
pub struct ModelFile {
    mmap: Mmap,
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
    /// architecture, bounds and checksums.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelFile> {
        let path = path.as_ref();
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; we never hand out references that outlive `self`.
        // Modifying the file while it is open is outside the library's contract (as for any mmap reader).
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::from_mmap(mmap)
    }

    fn from_mmap(mmap: Mmap) -> Result<ModelFile> {
        let bytes: &[u8] = &mmap;
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
        if version != FORMAT_VERSION {
            return Err(Error::format(format!(
                "unsupported format version {version} (this reader supports {FORMAT_VERSION})"
            )));
        }
        let flags = u32::from_le_bytes(bytes[12..16].try_into().unwrap());
        if flags != 0 {
            return Err(Error::format(format!(
                "unsupported flags {flags:#x} (version 1 defines none)"
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
        tensors.par_iter().try_for_each(|(name, entry)| {
            let range = entry.offset as usize..(entry.offset + entry.length) as usize;
            let actual = crc32fast::hash(&data[range]);
            if actual != entry.crc32 {
                return Err(Error::format(format!(
                    "checksum mismatch in tensor {name}: stored {:#010x}, computed {actual:#010x}",
                    entry.crc32
                )));
            }
            Ok(())
        })?;

        Ok(ModelFile {
            mmap,
            data_start: data_start as usize,
            config: header.config,
            metadata: header.metadata,
            tensors,
        })
    }

    pub fn tensor(&self, name: &str) -> Option<(&TensorEntry, &[u8])> {
        let entry = self.tensors.get(name)?;
        let start = self.data_start + entry.offset as usize;
        Some((entry, &self.mmap[start..start + entry.length as usize]))
    }

    pub fn tensor_entries(&self) -> impl Iterator<Item = &TensorEntry> {
        self.tensors.values()
    }

    pub fn file_len(&self) -> usize {
        self.mmap.len()
    }
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
