//! The `.tinyloop` file format, versions 1 and 2 (spec: docs/FORMAT.md).
//!
//! ```text
//! offset 0   magic "TINYLOOP" (8 bytes)
//!        8   u32 format version (major)      little-endian
//!       12   u32 flags (must be 0)
//!       16   u64 header length in bytes
//!       24   UTF-8 JSON header: {"config": {...}, "tensors": [...], "metadata": {...}}
//!  aligned   tensor data; data section starts at the next multiple of 64,
//!            each tensor's offset (relative to the data section) is a multiple of 64
//! ```

mod reader;
mod writer;

pub(crate) use reader::map_file;
pub use reader::ModelFile;
pub use writer::FileWriter;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::model::config::ModelConfig;

pub const MAGIC: &[u8; 8] = b"TINYLOOP";
/// The newest version; a file is written at the oldest version that describes its model
/// ([`format_version`]).
pub const FORMAT_VERSION: u32 = 2;
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

    /// Codes packed into one byte (quantized types only).
    pub fn codes_per_byte(self) -> u64 {
        u64::from(8 / self.bits())
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
    /// Number of elements, or `None` when the product of the dimensions overflows.
    pub fn numel(&self) -> Option<u64> {
        self.shape.iter().try_fold(1u64, |n, &d| n.checked_mul(d))
    }

    /// The byte length the dtype, shape and group size imply, or a message saying why they are
    /// inconsistent (including sizes too large to compute).
    pub fn expected_length(&self) -> Result<u64, String> {
        let too_large = || format!("shape {:?} is too large", self.shape);
        let numel = self.numel().ok_or_else(too_large)?;
        if !self.dtype.is_quantized() {
            if let Some(g) = self.group_size {
                return Err(format!(
                    "group_size {g} given for an unquantized {} tensor",
                    self.dtype.name()
                ));
            }
            let width = u64::from(self.dtype.bits() / 8);
            return numel.checked_mul(width).ok_or_else(too_large);
        }
        let [rows, cols] = self.shape[..] else {
            return Err(format!(
                "quantized tensor must be 2-D, shape is {:?}",
                self.shape
            ));
        };
        let g = self
            .group_size
            .ok_or("quantized tensor has no group_size")?;
        check_group_size(self.dtype, cols, g)?;
        // Exact: `cols` is a multiple of the codes per byte.
        let codes = numel / self.dtype.codes_per_byte();
        let params = rows
            .checked_mul(cols / g)
            .and_then(|n| n.checked_mul(2 * 2)) // f16 scales + f16 zeros
            .ok_or_else(too_large)?;
        codes.checked_add(params).ok_or_else(too_large)
    }
}

/// The group sizes every backend supports for a quantized `[rows, cols]` weight: a group divides
/// `cols` and starts on a byte boundary of the packed codes, so it is a multiple of the codes per
/// byte (2 for int4, 4 for int2), as is `cols` itself.
pub fn check_group_size(dtype: DType, cols: u64, group_size: u64) -> Result<(), String> {
    let per_byte = dtype.codes_per_byte();
    if !cols.is_multiple_of(per_byte) {
        return Err(format!(
            "{cols} columns cannot be packed {per_byte} codes per byte"
        ));
    }
    if group_size == 0 || !group_size.is_multiple_of(per_byte) {
        return Err(format!(
            "group_size {group_size} is not a positive multiple of {per_byte} ({} packs {per_byte} \
             codes per byte and a group must start on a byte boundary)",
            dtype.name()
        ));
    }
    if !cols.is_multiple_of(group_size) {
        return Err(format!(
            "group_size {group_size} does not divide {cols} columns"
        ));
    }
    Ok(())
}

/// Index of the first value of little-endian f16 data that is NaN or infinite.
pub fn first_non_finite_f16(bytes: &[u8]) -> Option<usize> {
    // NaN and ±Inf have every exponent bit set: bits 10..14 of the value, 2..6 of its high byte.
    let bad = |pair: &[u8]| pair[1] & 0x7c == 0x7c;
    // Four values per u64: adding 0x0400 to a value's exponent bits carries into its top bit
    // exactly when they are all set. Blocks are scanned without branches (this vectorizes);
    // a block with a hit is then searched value by value.
    const EXPONENTS: u64 = 0x7c00_7c00_7c00_7c00;
    const CARRY: u64 = 0x0400_0400_0400_0400;
    const TOP: u64 = 0x8000_8000_8000_8000;
    const BLOCK: usize = 4096;
    bytes.chunks(BLOCK).enumerate().find_map(|(b, block)| {
        let (words, tail) = block.as_chunks::<8>();
        let carries = words.iter().fold(0, |acc, w| {
            acc | ((u64::from_le_bytes(*w) & EXPONENTS) + CARRY)
        });
        if carries & TOP == 0 && !tail.chunks_exact(2).any(bad) {
            return None;
        }
        let i = block.chunks_exact(2).position(bad)?;
        Some(b * BLOCK / 2 + i)
    })
}

/// The version a file of `config` is written at: 1 for TinyLoop's own architecture (so that
/// older readers keep reading such files), 2 when `config.architecture` describes another.
pub fn format_version(config: &ModelConfig) -> u32 {
    if config.architecture.is_default() {
        1
    } else {
        2
    }
}

/// Round `n` up to the next multiple of [`ALIGNMENT`].
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGNMENT) * ALIGNMENT
}

#[cfg(test)]
mod tests {
    use half::f16;

    use super::first_non_finite_f16;

    #[test]
    fn finds_the_first_nan_or_infinity_anywhere() {
        let specials = [f16::NAN, f16::INFINITY, f16::NEG_INFINITY];
        let finite = [
            f16::MAX,
            f16::MIN,
            f16::MIN_POSITIVE_SUBNORMAL,
            f16::ZERO,
            f16::NEG_ZERO,
        ];
        // Lengths around the u64 words and the 4096-byte blocks, a special value at each place.
        for len in [1, 3, 4, 5, 2047, 2048, 2049, 5000] {
            let clean: Vec<u8> = (0..len)
                .flat_map(|i| finite[i % finite.len()].to_le_bytes())
                .collect();
            assert_eq!(first_non_finite_f16(&clean), None, "len {len}");
            for at in [0, len / 2, len - 1] {
                for (k, special) in specials.iter().enumerate() {
                    let mut bytes = clean.clone();
                    bytes[2 * at..2 * at + 2].copy_from_slice(&special.to_le_bytes());
                    if at + 1 < len {
                        // A later one must not hide the first.
                        let later = specials[(k + 1) % specials.len()];
                        bytes[2 * len - 2..].copy_from_slice(&later.to_le_bytes());
                    }
                    assert_eq!(first_non_finite_f16(&bytes), Some(at), "len {len} at {at}");
                }
            }
        }
    }
}
