//! `tinyloop MODEL requantize`: a copy of a model whose loop-block linears are re-quantized to
//! another bit width by [`QuantizedMatrix::requantize`] (dequantize, then round-to-nearest at the
//! same group size: what the runtime's CTX-TIER re-pack computes). Every other tensor is copied
//! byte for byte, so the copy differs from its source only in the loop body.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::json;

use crate::error::{Error, Result};
use crate::format::{DType, FileWriter, ModelFile, TensorEntry};
use crate::model::layout::{block_name, expected_tensors, Stage, BLOCK_LINEARS};
use crate::model::quant::{LinearData, QuantizedMatrix};

/// Metadata key that records the re-quantization in the written file.
pub const METADATA_KEY: &str = "loop_body_requantized";

/// The bit widths a loop body can be re-quantized to.
pub fn loop_body_dtype(bits: u32) -> Result<DType> {
    match bits {
        4 => Ok(DType::Int4),
        2 => Ok(DType::Int2),
        other => Err(Error::invalid(format!(
            "the loop body bit width must be 2 or 4, got {other}"
        ))),
    }
}

/// Names of the loop-block linears of `file`, in layout order.
pub fn loop_body_linears(file: &ModelFile) -> Vec<String> {
    (0..file.config.n_loop_blocks)
        .flat_map(|index| {
            let block = block_name(Stage::Loop, index);
            BLOCK_LINEARS.map(|linear| format!("{block}.{linear}"))
        })
        .collect()
}

/// A writer holding `file` with its loop-block linears re-quantized to `dtype`.
pub fn requantize_loop_body(file: &ModelFile, dtype: DType) -> Result<FileWriter> {
    let loop_linears = loop_body_linears(file);
    let mut writer = FileWriter::new(file.config.clone());
    for (key, value) in &file.metadata {
        writer.set_metadata(key, value.clone());
    }
    let mut from = BTreeSet::new();
    for spec in expected_tensors(&file.config) {
        let (entry, bytes) = file
            .tensor(&spec.name)
            .expect("a validated file holds every tensor of its layout");
        if loop_linears.contains(&spec.name) {
            let matrix = requantized(entry, bytes, dtype)?;
            writer.add_linear(
                &spec.name,
                matrix.rows,
                matrix.cols,
                &LinearData::Quantized(matrix),
            );
            from.insert(entry.dtype.name());
        } else {
            writer.add_stored(entry, bytes);
        }
    }
    writer.set_metadata(
        METADATA_KEY,
        json!({
            "from": from.into_iter().collect::<Vec<_>>().join(", "),
            "to": dtype.name(),
            "tensors": loop_linears,
            "method": "dequantize, then round-to-nearest at the same group size",
        }),
    );
    Ok(writer)
}

/// The stored quantized tensor `entry` (data `bytes`) re-quantized to `dtype`.
fn requantized(entry: &TensorEntry, bytes: &[u8], dtype: DType) -> Result<QuantizedMatrix> {
    let (name, stored) = (&entry.name, entry.dtype);
    if !stored.is_quantized() {
        return Err(Error::invalid(format!(
            "loop-body tensor {name} is {}: only int4 or int2 weights can be re-quantized \
             (convert the checkpoint with --bits instead)",
            stored.name()
        )));
    }
    if stored == dtype {
        return Err(Error::invalid(format!(
            "loop-body tensor {name} is already {}",
            dtype.name()
        )));
    }
    let [rows, cols] = [entry.shape[0], entry.shape[1]].map(|d| d as usize);
    let group_size = entry
        .group_size
        .expect("a validated quantized tensor has a group size") as usize;
    let matrix = QuantizedMatrix::from_bytes(stored, rows, cols, group_size, bytes)?;
    let requantized = matrix.requantize(dtype)?;
    let params = requantized.scales.iter().chain(&requantized.zeros);
    if params.into_iter().any(|p| !p.is_finite()) {
        return Err(Error::format(format!(
            "tensor {name}: a re-quantized group spans more than the f16 range"
        )));
    }
    Ok(requantized)
}

/// Read `input`, re-quantize its loop body to `bits` and write the result to `out`.
pub fn requantize_file(input: &Path, out: &Path, bits: u32) -> Result<()> {
    let dtype = loop_body_dtype(bits)?;
    let file = ModelFile::open(input)?;
    // Writing over the input would truncate the file that is mapped for reading.
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    };
    if same(input, out) {
        return Err(Error::invalid(format!(
            "the output {} is the input model; write the copy to another file",
            out.display()
        )));
    }
    requantize_loop_body(&file, dtype)?.write(out)
}
