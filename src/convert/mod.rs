//! `tinyloop convert`: a checkpoint → a `.tinyloop` file with block weights at f16, int4 or int2,
//! by round-to-nearest or GPTQ. The checkpoint is a safetensors file with the tensor names of
//! docs/FORMAT.md plus a config JSON, or a Hugging Face folder of a supported family ([`hf`]).

mod capture;
pub mod gptq;
pub mod hf;
pub mod requantize;

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;

use half::f16;
use safetensors::{Dtype, SafeTensors};

use crate::alloc;
use crate::backend::{Choice, StepInput};
use crate::error::{Error, Result};
use crate::format::{map_file, DType, FileWriter, ModelFile};
use crate::kv::{KvLayout, KvMode};
use crate::model::config::ModelConfig;
use crate::model::forward::{forward, Buffers};
use crate::model::layout::{
    block_name, blocks, expected_tensors, Stage, TensorRole, BLOCK_LINEARS,
};
use crate::model::quant::{group_size_for, quantize_rtn, LinearData, QuantizedMatrix};
use crate::model::state_init::StateInit;
use crate::model::weights::Weights;
use capture::CaptureBackend;

/// Tokens per GPTQ calibration window when [`ConvertOptions::window`] is 0 (and the model's
/// positions allow it).
pub const DEFAULT_CALIBRATION_WINDOW: usize = 512;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// Round to nearest, group by group.
    Rtn,
    /// GPTQ with input statistics from calibration text.
    Gptq,
}

/// What a conversion reads.
#[derive(Clone, Debug)]
pub enum Input {
    /// A safetensors checkpoint with the tensor names of docs/FORMAT.md, and a JSON file holding
    /// the `config` object.
    TinyLoop {
        safetensors: PathBuf,
        config: PathBuf,
    },
    /// A Hugging Face checkpoint folder of a supported family ([`hf::SUPPORTED`]).
    HuggingFace(PathBuf),
}

#[derive(Clone, Debug)]
pub struct ConvertOptions {
    pub input: Input,
    pub out: PathBuf,
    /// 16, 4 or 2: the encoding of the five block linears. Everything else stays f16.
    pub bits: u32,
    /// Quantization group size; it must divide the columns of every block linear (a size above a
    /// tensor's columns is an error, not clamped). 0 means one group per row.
    pub group_size: usize,
    pub method: Method,
    /// Token ids GPTQ calibrates on (required for GPTQ).
    pub calibration: Vec<u32>,
    /// Loop iterations used while calibrating (default: the config's `default_loops`).
    pub calibration_loops: Option<usize>,
    /// Tokens per calibration window; 0 means [`DEFAULT_CALIBRATION_WINDOW`], or the config's
    /// `max_position` when that is smaller.
    pub window: usize,
    /// Free-form metadata copied into the file (for example `tokenizer`).
    pub metadata: serde_json::Map<String, serde_json::Value>,
    pub progress: bool,
}

/// A checkpoint tensor widened to f32.
#[derive(Clone)]
struct Tensor {
    shape: Vec<usize>,
    values: Vec<f32>,
}

/// Where the tensors of the `.tinyloop` layout come from, one at a time.
trait Source {
    fn config(&self) -> &ModelConfig;
    /// The tensor `name` of the `.tinyloop` layout, of `shape`.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor>;
    /// Metadata the checkpoint brings (tokenizer, provenance).
    fn metadata(&self) -> serde_json::Map<String, serde_json::Value>;
}

pub fn convert(opts: &ConvertOptions) -> Result<()> {
    match &opts.input {
        Input::TinyLoop {
            safetensors,
            config,
        } => {
            let config = read_config(config)?;
            write_model(&read_checkpoint(safetensors, config)?, opts)
        }
        Input::HuggingFace(dir) => write_model(&hf::HfCheckpoint::open(dir)?, opts),
    }
}

fn write_model(source: &dyn Source, opts: &ConvertOptions) -> Result<()> {
    let config = source.config();
    let dtype = DType::from_bits(opts.bits)?;
    let specs = expected_tensors(config);
    if dtype.is_quantized() {
        for spec in specs.iter().filter(|s| s.is_quantizable()) {
            check_group_fits(&spec.name, spec.shape[1] as usize, opts.group_size)?;
            group_size_for(&spec.name, dtype, spec.shape[1] as usize, opts.group_size)?;
        }
    }
    let hessians = match (opts.method, dtype.is_quantized()) {
        (Method::Gptq, true) => Some(calibrate(source, opts)?),
        _ => None,
    };

    let mut writer = FileWriter::new(config.clone());
    let brought = source.metadata();
    if config.vocab_size == 256 && !brought.contains_key("tokenizer") {
        writer.set_metadata("tokenizer", serde_json::json!("bytes"));
    }
    for (key, value) in brought.iter().chain(&opts.metadata) {
        writer.set_metadata(key, value.clone());
    }
    // Every block linear has the group size asked for (check_group_fits), or one group per row.
    let groups = match opts.group_size {
        0 => "per-row".to_string(),
        g => format!("g{g}"),
    };
    let method = match (opts.method, dtype.is_quantized()) {
        (_, false) => "f16".to_string(),
        (Method::Rtn, true) => format!("{} {groups} rtn", dtype.name()),
        (Method::Gptq, true) => format!("{} {groups} gptq", dtype.name()),
    };
    writer.set_metadata("quantization", serde_json::json!(method));
    let mut progress = Progress::new(opts.progress, specs.len(), "convert");
    for spec in &specs {
        let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
        let t = source.tensor(&spec.name, &shape)?;
        if !spec.is_quantizable() || !dtype.is_quantized() {
            let values = to_f16(&spec.name, &t.values)?;
            match spec.role {
                TensorRole::Linear => {
                    writer.add_linear(&spec.name, t.shape[0], t.shape[1], &LinearData::F16(values))
                }
                _ => writer.add_f16(&spec.name, &t.shape, &values),
            }
        } else {
            let (rows, cols) = (t.shape[0], t.shape[1]);
            let rtn = quantize_rtn(&t.values, rows, cols, dtype, opts.group_size)?;
            // GPTQ calibrates the block linears; the loop adapter is rounded to nearest.
            let q = match hessians.as_ref().and_then(|h| h.get(&spec.name)) {
                Some(h) => best_of_gptq_and_rtn(&spec.name, &t.values, rtn, h, opts)?,
                None => rtn,
            };
            for params in [&q.scales, &q.zeros] {
                if params.iter().any(|p| !p.is_finite()) {
                    return Err(Error::format(format!(
                        "tensor {}: a quantization group spans more than the f16 range",
                        spec.name
                    )));
                }
            }
            writer.add_linear(&spec.name, rows, cols, &LinearData::Quantized(q));
        }
        progress.step(&spec.name);
    }
    progress.finish();
    writer.write(&opts.out)
}

/// Values rounded to f16, which must hold them (a file never stores NaN or infinity).
fn to_f16(name: &str, values: &[f32]) -> Result<Vec<f16>> {
    let mut out = alloc::with_capacity(values.len(), &format!("tensor {name} as f16"))?;
    out.extend(values.iter().map(|&v| f16::from_f32(v)));
    match out.iter().position(|v| !v.is_finite()) {
        None => Ok(out),
        Some(i) => Err(Error::format(format!(
            "tensor {name}: element {i} ({}) is outside the f16 range",
            values[i]
        ))),
    }
}

/// GPTQ's result, unless round-to-nearest has the lower layer-output error on the calibration
/// statistics (GPTQ can lose when a layer's inputs span few directions of the calibration set).
fn best_of_gptq_and_rtn(
    name: &str,
    w: &[f32],
    rtn: QuantizedMatrix,
    h: &[f64],
    opts: &ConvertOptions,
) -> Result<QuantizedMatrix> {
    let g = gptq::quantize_gptq(w, rtn.rows, rtn.cols, h, rtn.dtype, opts.group_size)?;
    let (e_gptq, e_rtn) = (gptq::output_error(w, &g, h), gptq::output_error(w, &rtn, h));
    if e_gptq <= e_rtn {
        return Ok(g);
    }
    if opts.progress {
        eprintln!("\n[gptq] {name}: round-to-nearest has the lower output error ({e_rtn:.3e} < {e_gptq:.3e}); keeping it");
    }
    Ok(rtn)
}

/// A group of `group_size` columns must fit in the tensor's `cols`: the file would otherwise hold
/// a smaller group than the one asked for (and recorded in the metadata).
fn check_group_fits(name: &str, cols: usize, group_size: usize) -> Result<()> {
    if group_size > cols {
        return Err(Error::invalid(format!(
            "tensor {name}: group_size {group_size} exceeds its {cols} columns (use a group size \
             that divides {cols}, or 0 for one group per row)"
        )));
    }
    Ok(())
}

fn read_config(path: &Path) -> Result<ModelConfig> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    let config: ModelConfig = serde_json::from_str(&text)
        .map_err(|e| Error::format(format!("config {}: {e}", path.display())))?;
    config.validate()?;
    Ok(config)
}

fn read_checkpoint(path: &Path, config: ModelConfig) -> Result<Checkpoint> {
    let bytes = map_file(path)?;
    Checkpoint::parse(&bytes, &config).map_err(|e| match e {
        Error::Format(why) => Error::format(format!("checkpoint {}: {why}", path.display())),
        other => other,
    })
}

/// The tensors of a safetensors checkpoint, widened to f32 and checked against a config.
pub struct Checkpoint {
    config: ModelConfig,
    tensors: HashMap<String, Tensor>,
}

impl Checkpoint {
    /// Parse safetensors `bytes`: exactly the tensors `config` implies (docs/FORMAT.md names),
    /// with their shapes, in F32, F16 or BF16, every value finite.
    pub fn parse(bytes: &[u8], config: &ModelConfig) -> Result<Checkpoint> {
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| Error::format(format!("safetensors: {e}")))?;
        let specs = expected_tensors(config);
        let mut tensors = HashMap::new();
        for spec in &specs {
            let name = &spec.name;
            let view = st.tensor(name).map_err(|_| {
                Error::format(format!(
                    "no tensor {name} (docs/FORMAT.md lists the expected names)"
                ))
            })?;
            let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
            if shape != spec.shape {
                return Err(Error::format(format!(
                    "tensor {name}: checkpoint shape {shape:?}, config implies {:?}",
                    spec.shape
                )));
            }
            let values = widen(name, view.dtype(), view.data())?;
            if let Some(i) = values.iter().position(|v| !v.is_finite()) {
                return Err(Error::format(format!(
                    "tensor {name}: element {i} is {} (weights must be finite)",
                    values[i]
                )));
            }
            let shape = view.shape().to_vec();
            tensors.insert(name.clone(), Tensor { shape, values });
        }
        let unknown: Vec<&str> = st
            .names()
            .into_iter()
            .filter(|n| !tensors.contains_key(*n))
            .collect();
        if !unknown.is_empty() {
            return Err(Error::format(format!(
                "tensors the config does not use: {}",
                unknown.join(", ")
            )));
        }
        Ok(Checkpoint {
            config: config.clone(),
            tensors,
        })
    }
}

impl Source for Checkpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor(&self, name: &str, _shape: &[usize]) -> Result<Tensor> {
        // `parse` checked every name and shape.
        Ok(self.tensors[name].clone())
    }

    fn metadata(&self) -> serde_json::Map<String, serde_json::Value> {
        serde_json::Map::new()
    }
}

/// Checkpoint values as f32.
fn widen(name: &str, dtype: Dtype, data: &[u8]) -> Result<Vec<f32>> {
    let (width, value): (usize, fn(&[u8]) -> f32) = match dtype {
        Dtype::F32 => (4, |b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        Dtype::F16 => (2, |b| f16::from_le_bytes([b[0], b[1]]).to_f32()),
        Dtype::BF16 => (2, |b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
        other => {
            return Err(Error::format(format!(
                "tensor {name}: dtype {other:?} is not supported (use F32, F16 or BF16)"
            )))
        }
    };
    let mut values = alloc::with_capacity(data.len() / width, &format!("tensor {name}"))?;
    values.extend(data.chunks_exact(width).map(value));
    Ok(values)
}

/// Run the calibration tokens through the f16 model and return, per block linear, the dense
/// input second moment `E[x xᵀ]`.
fn calibrate(source: &dyn Source, opts: &ConvertOptions) -> Result<HashMap<String, Vec<f64>>> {
    let config = source.config();
    if opts.calibration.len() < 2 {
        return Err(Error::invalid("GPTQ needs calibration text (--calib FILE)"));
    }
    if let Some(&bad) = opts
        .calibration
        .iter()
        .find(|&&t| t as usize >= config.vocab_size)
    {
        return Err(Error::invalid(format!(
            "calibration token {bad} is out of range for vocab_size {}",
            config.vocab_size
        )));
    }
    let window = match opts.window {
        0 => DEFAULT_CALIBRATION_WINDOW.min(config.max_position),
        n => n,
    }
    .max(2);
    if window > config.max_position {
        return Err(Error::invalid(format!(
            "calibration window {window} exceeds the model's max_position {}",
            config.max_position
        )));
    }
    let loops = opts.calibration_loops.unwrap_or(config.default_loops);
    if loops == 0 {
        return Err(Error::invalid("calibration loops must be >= 1"));
    }
    config.check_session(window, loops.max(config.default_loops))?;
    // The f16 model, written once to a temporary file and loaded through the capture backend.
    let mut writer = FileWriter::new(config.clone());
    for spec in expected_tensors(config) {
        let shape: Vec<usize> = spec.shape.iter().map(|&d| d as usize).collect();
        let t = source.tensor(&spec.name, &shape)?;
        writer.add_f16(&spec.name, &t.shape, &to_f16(&spec.name, &t.values)?);
    }
    let tmp = opts.out.with_extension("calibration.tmp");
    writer.write(&tmp)?;
    let file = ModelFile::open(&tmp);
    std::fs::remove_file(&tmp).map_err(|e| Error::io(&tmp, e))?;
    let file = file?;

    let backend = CaptureBackend;
    let weights = Weights::load(&backend, &file, window)?;
    let layout = KvLayout::new(config, KvMode::Fp16, window)?;
    let body = weights
        .body
        .loaded()
        .expect("a freshly loaded model holds its loop body");
    let mut buffers = Buffers::new(
        &backend,
        config,
        window,
        layout,
        body.clone(),
        StateInit::Model,
    )?;
    let never = AtomicBool::new(false);
    let loops = opts.calibration_loops.unwrap_or(config.default_loops);
    let windows: Vec<&[u32]> = opts.calibration.chunks(window).collect();
    let mut progress = Progress::new(opts.progress, windows.len(), "calibrate");
    for (i, tokens) in windows.iter().enumerate() {
        forward(
            &backend,
            &weights,
            &mut buffers,
            StepInput {
                tokens,
                start_pos: 0,
                choice: Choice::Greedy,
            },
            loops,
            &never,
        )?;
        progress.step(&format!("window {}", i + 1));
    }
    progress.finish();

    let mut out = HashMap::new();
    let (mut unshared, mut looped) = (weights.unshared.iter(), body.blocks.iter());
    for (stage, index) in blocks(config) {
        let name = block_name(stage, index);
        let block = match stage {
            Stage::Loop => looped.next(),
            Stage::Pre | Stage::Post => unshared.next(),
        }
        .expect("one set of linears per block");
        let linears = block.all();
        for (linear, suffix) in linears.into_iter().zip(BLOCK_LINEARS) {
            let h = linear
                .hessian
                .lock()
                .expect("hessian lock is never poisoned");
            out.insert(format!("{name}.{suffix}"), h.to_dense()?);
        }
    }
    Ok(out)
}

/// A one-line progress bar on stderr.
struct Progress {
    enabled: bool,
    total: usize,
    done: usize,
    label: &'static str,
}

impl Progress {
    fn new(enabled: bool, total: usize, label: &'static str) -> Progress {
        Progress {
            enabled,
            total,
            done: 0,
            label,
        }
    }

    fn step(&mut self, what: &str) {
        self.done += 1;
        if self.enabled {
            let width = 30;
            let filled = width * self.done / self.total.max(1);
            eprint!(
                "\r[{}] [{}{}] {}/{} {:<28}",
                self.label,
                "#".repeat(filled),
                " ".repeat(width - filled),
                self.done,
                self.total,
                what
            );
            std::io::stderr().flush().ok();
        }
    }

    fn finish(&self) {
        if self.enabled {
            eprintln!();
        }
    }
}
