//! `tinyloop MODEL requantize`: a copy of a model whose loop-block linears are re-quantized to
//! another bit width by [`QuantizedMatrix::requantize`] (dequantize, then round-to-nearest at the
//! same group size: what the runtime's CTX-TIER re-pack computes), and/or whose f16 head is
//! quantized by round-to-nearest ([`quantize_rtn`]). Every other tensor is copied byte for byte.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::json;

use crate::error::{Error, Result};
use crate::format::{DType, FileWriter, ModelFile, TensorEntry};
use crate::model::config::HeadKind;
use crate::model::layout::{block_name, expected_tensors, Stage, BLOCK_LINEARS};
use crate::model::quant::{f16_values, group_size_for, quantize_rtn, LinearData, QuantizedMatrix};

/// Metadata key that records the re-quantization of the loop body in the written file.
pub const METADATA_KEY: &str = "loop_body_requantized";

/// Metadata key that records the quantization of the head.
pub const HEAD_METADATA_KEY: &str = "head_quantized";

/// What a re-quantized copy changes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Requantization {
    /// The loop body's new bit width.
    pub loop_body: Option<DType>,
    /// The f16 head's bit width and group size (0: one group per row).
    pub head: Option<(DType, usize)>,
}

/// The bit widths a loop body or a head can be quantized to.
pub fn quantized_dtype(bits: u32) -> Result<DType> {
    match bits {
        4 => Ok(DType::Int4),
        2 => Ok(DType::Int2),
        other => Err(Error::invalid(format!(
            "the bit width must be 2 or 4, got {other}"
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

/// A writer holding `file` with the changes of `plan`.
pub fn requantize_model(file: &ModelFile, plan: &Requantization) -> Result<FileWriter> {
    if plan.loop_body.is_none() && plan.head.is_none() {
        return Err(Error::invalid(
            "nothing to re-quantize: name a loop body or a head bit width",
        ));
    }
    if plan.head.is_some() && file.config.head == HeadKind::Tied {
        return Err(Error::invalid(
            "the model's head is tied to the embedding: it has no head tensor to quantize",
        ));
    }
    let loop_linears = match plan.loop_body {
        Some(_) => loop_body_linears(file),
        None => Vec::new(),
    };
    let mut writer = FileWriter::new(file.config.clone());
    for (key, value) in &file.metadata {
        writer.set_metadata(key, value.clone());
    }
    let mut from = BTreeSet::new();
    let mut head_group = None;
    for spec in expected_tensors(&file.config) {
        let (entry, bytes) = file
            .tensor(&spec.name)
            .expect("a validated file holds every tensor of its layout");
        let matrix = match (plan.loop_body, plan.head) {
            (Some(dtype), _) if loop_linears.contains(&spec.name) => {
                from.insert(entry.dtype.name());
                requantized(entry, bytes, dtype)?
            }
            (_, Some((dtype, group_size))) if spec.name == "head" => {
                let matrix = quantized_head(entry, bytes, dtype, group_size)?;
                head_group = Some(matrix.group_size);
                matrix
            }
            _ => {
                writer.add_stored(entry, bytes);
                continue;
            }
        };
        writer.add_linear(
            &spec.name,
            matrix.rows,
            matrix.cols,
            &LinearData::Quantized(matrix),
        );
    }
    if let Some(dtype) = plan.loop_body {
        writer.set_metadata(
            METADATA_KEY,
            json!({
                "from": from.into_iter().collect::<Vec<_>>().join(", "),
                "to": dtype.name(),
                "tensors": loop_linears,
                "method": "dequantize, then round-to-nearest at the same group size",
            }),
        );
    }
    if let (Some((dtype, _)), Some(group_size)) = (plan.head, head_group) {
        writer.set_metadata(
            HEAD_METADATA_KEY,
            json!({
                "from": DType::F16.name(),
                "to": dtype.name(),
                "group_size": group_size,
                "method": "round-to-nearest",
            }),
        );
    }
    Ok(writer)
}

/// The f16 head `entry` (data `bytes`) quantized to `dtype` by round-to-nearest.
fn quantized_head(
    entry: &TensorEntry,
    bytes: &[u8],
    dtype: DType,
    group_size: usize,
) -> Result<QuantizedMatrix> {
    if entry.dtype != DType::F16 {
        return Err(Error::invalid(format!(
            "the head is {} already: only an f16 head can be quantized",
            entry.dtype.name()
        )));
    }
    let [rows, cols] = [entry.shape[0], entry.shape[1]].map(|d| d as usize);
    let group_size = group_size_for("head", dtype, cols, group_size)?;
    let values: Vec<f32> = f16_values(bytes).map(|v| v.to_f32()).collect();
    let matrix = quantize_rtn(&values, rows, cols, dtype, group_size)?;
    finite_params(&entry.name, &matrix)?;
    Ok(matrix)
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
    finite_params(name, &requantized)?;
    Ok(requantized)
}

/// Every scale and zero of a quantized `matrix` (tensor `name`) is finite in f16.
fn finite_params(name: &str, matrix: &QuantizedMatrix) -> Result<()> {
    let params = matrix.scales.iter().chain(&matrix.zeros);
    if params.into_iter().any(|p| !p.is_finite()) {
        return Err(Error::format(format!(
            "tensor {name}: a quantized group spans more than the f16 range"
        )));
    }
    Ok(())
}

/// Read `input`, apply `plan` and write the result to `out`.
pub fn requantize_file(input: &Path, out: &Path, plan: &Requantization) -> Result<()> {
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
    requantize_model(&file, plan)?.write(out)
}
