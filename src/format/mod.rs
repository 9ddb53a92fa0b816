//! The `.tinyloop` file format, version 1 (spec: docs/FORMAT.md).
//!
//! ```text
//! offset 0   magic "TINYLOOP" (8 bytes)
//!        8   u32 format version (major)      little-endian
//!       12   u32 flags (must be 0 in v1)
//!       16   u64 header length in bytes
//!       24   UTF-8 JSON header: {"config": {...}, "tensors": [...], "metadata": {...}}
//!  aligned   tensor data; data section starts at the next multiple of 64,
//!            each tensor's offset (relative to the data section) is a multiple of 64
//! ```

mod reader;
mod writer;

pub use reader::ModelFile;
pub use writer::FileWriter;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const MAGIC: &[u8; 8] = b"TINYLOOP";
pub const FORMAT_VERSION: u32 = 1;
pub const PREAMBLE_LEN: usize = 24;
pub const ALIGNMENT: u64 = 64;
/// Headers larger than this are rejected before parsing, so a corrupt length cannot exhaust memory.
pub const MAX_HEADER_LEN: u64 = 64 << 20;

/// Element type of a stored tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DType {
    F16,
    F32,
    /// Asymmetric group-quantized, 4-bit codes, two per byte (low nibble first).
    Int4,
    /// Asymmetric group-quantized, 2-bit codes, four per byte (lowest bits first).
    Int2,
}

impl DType {
    pub fn bits(self) -> u32 {
        match self {
            DType::F16 => 16,
            DType::F32 => 32,
            DType::Int4 => 4,
            DType::Int2 => 2,
        }
    }

    pub fn is_quantized(self) -> bool {
        matches!(self, DType::Int4 | DType::Int2)
    }

    pub fn from_bits(bits: u32) -> Result<DType> {
        match bits {
            16 => Ok(DType::F16),
            4 => Ok(DType::Int4),
            2 => Ok(DType::Int2),
            other => Err(Error::invalid(format!(
                "unsupported weight bit width {other} (expected 16, 4 or 2)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::F32 => "f32",
            DType::Int4 => "int4",
            DType::Int2 => "int2",
        }
    }
}

/// One row of the header's tensor table.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub dtype: DType,
    /// `[rows, cols]` for matrices, `[len]` for vectors.
    pub shape: Vec<u64>,
    /// Quantization group size along the last axis; present for int4 / int2 only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group_size: Option<u64>,
    /// Byte offset from the start of the data section.
    pub offset: u64,
    pub length: u64,
    pub crc32: u32,
}

impl TensorEntry {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// The byte length the dtype, shape and group size imply, or a message saying why they are inconsistent.
    pub fn expected_length(&self) -> Result<u64, String> {
        let numel = self.numel();
        match self.dtype {
            DType::F16 => Ok(numel * 2),
            DType::F32 => Ok(numel * 4),
            DType::Int4 | DType::Int2 => {
                let [rows, cols] = self.shape[..] else {
                    return Err(format!(
                        "quantized tensor must be 2-D, shape is {:?}",
                        self.shape
                    ));
                };
                let g = self
                    .group_size
                    .ok_or("quantized tensor has no group_size")?;
                if g == 0 || cols % g != 0 {
                    return Err(format!("group_size {g} does not divide {cols} columns"));
                }
                let per_byte = 8 / self.dtype.bits() as u64;
                if cols % per_byte != 0 {
                    return Err(format!(
                        "{cols} columns cannot be packed {per_byte} codes per byte"
                    ));
                }
                let codes = rows * cols / per_byte;
                let params = rows * (cols / g) * 2 * 2; // f16 scales + f16 zeros
                Ok(codes + params)
            }
        }
    }
}

/// Round `n` up to the next multiple of [`ALIGNMENT`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}
