//! Writer for `.tinyloop` files. Tensors are collected in memory, then written in one pass.

use std::io::{BufWriter, Write};
use std::path::Path;

use half::f16;
use serde_json::json;

use super::{align_up, format_version, DType, TensorEntry, MAGIC, PREAMBLE_LEN};
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use crate::model::quant::{f16_to_bytes, LinearData};

pub struct FileWriter {
    config: ModelConfig,
    metadata: serde_json::Map<String, serde_json::Value>,
    entries: Vec<TensorEntry>,
    blobs: Vec<Vec<u8>>,
    data_len: u64,
}

impl FileWriter {
    pub fn new(config: ModelConfig) -> FileWriter {
        FileWriter {
            config,
            metadata: serde_json::Map::new(),
            entries: Vec::new(),
            blobs: Vec::new(),
            data_len: 0,
        }
    }

    pub fn set_metadata(&mut self, key: &str, value: serde_json::Value) {
        self.metadata.insert(key.to_string(), value);
    }

    /// Add an f16 tensor of the given shape.
    pub fn add_f16(&mut self, name: &str, shape: &[usize], values: &[f16]) {
        assert_eq!(shape.iter().product::<usize>(), values.len());
        self.push(name, DType::F16, shape, None, f16_to_bytes(values));
    }

    /// Add a linear weight `[rows, cols]` in any stored encoding.
    pub fn add_linear(&mut self, name: &str, rows: usize, cols: usize, data: &LinearData) {
        match data {
            LinearData::F16(values) => self.add_f16(name, &[rows, cols], values),
            LinearData::Quantized(m) => {
                assert_eq!((m.rows, m.cols), (rows, cols));
                let group = Some(m.group_size as u64);
                self.push(name, m.dtype, &[rows, cols], group, m.to_bytes());
            }
        }
    }

    /// Add a tensor exactly as another file stores it (same dtype, shape, group size and bytes).
    pub fn add_stored(&mut self, entry: &TensorEntry, bytes: &[u8]) {
        let shape: Vec<usize> = entry.shape.iter().map(|&d| d as usize).collect();
        self.push(
            &entry.name,
            entry.dtype,
            &shape,
            entry.group_size,
            bytes.to_vec(),
        );
    }

    fn push(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        group_size: Option<u64>,
        bytes: Vec<u8>,
    ) {
        let offset = align_up(self.data_len);
        self.entries.push(TensorEntry {
            name: name.to_string(),
            dtype,
            shape: shape.iter().map(|&d| d as u64).collect(),
            group_size,
            offset,
            length: bytes.len() as u64,
            crc32: crc32fast::hash(&bytes),
        });
        self.data_len = offset + bytes.len() as u64;
        self.blobs.push(bytes);
    }

    /// Serialize the header (used by tests that need to craft corrupt files too).
    pub fn header_json(&self) -> Vec<u8> {
        serde_json::to_vec(&json!({
            "config": self.config,
            "tensors": self.entries,
            "metadata": self.metadata,
        }))
        .expect("header is always serializable")
    }

    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let fail = |e| Error::Write {
            path: path.to_path_buf(),
            source: e,
        };
        let file = std::fs::File::create(path).map_err(fail)?;
        let mut out = BufWriter::new(file);
        self.write_to(&mut out).map_err(fail)?;
        out.flush().map_err(fail)
    }

    /// The file's bytes, in memory.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out)
            .expect("writing to a Vec cannot fail");
        out
    }

    fn write_to(&self, out: &mut impl Write) -> std::io::Result<()> {
        let header = self.header_json();
        let header_end = (PREAMBLE_LEN + header.len()) as u64;
        out.write_all(MAGIC)?;
        out.write_all(&format_version(&self.config).to_le_bytes())?;
        out.write_all(&0u32.to_le_bytes())?;
        out.write_all(&(header.len() as u64).to_le_bytes())?;
        out.write_all(&header)?;
        let mut written = header_end;
        let data_start = align_up(header_end);
        for (entry, blob) in self.entries.iter().zip(&self.blobs) {
            let target = data_start + entry.offset;
            out.write_all(&vec![0u8; (target - written) as usize])?;
            out.write_all(blob)?;
            written = target + blob.len() as u64;
        }
        Ok(())
    }
}
