//! Model weights uploaded to one backend. Immutable after load, shared by every session.

use crate::backend::{rope_table, Backend, HostLinear};
use crate::error::{Error, Result};
use crate::format::{DType, ModelFile};
use crate::kv::Application;
use crate::model::architecture::LoopInput;
use crate::model::body::{BlockLinears, BodyStore, LoopBody};
use crate::model::config::{HeadKind, ModelConfig};
use crate::model::layout::{block_name, blocks, Stage, ADAPTER_LINEARS, BLOCK_LINEARS};
use crate::model::quant::{f16_from_bytes, f16_values};

pub struct Norm<B: Backend> {
    pub weight: B::Vector,
    pub bias: Option<B::Vector>,
}

/// The vectors of one block: its norms and biases (the same at every precision of its linears).
pub struct BlockVectors<B: Backend> {
    pub attn_norm: Norm<B>,
    /// After attention, in the sandwich layouts.
    pub attn_out_norm: Option<Norm<B>>,
    pub mlp_norm: Norm<B>,
    /// After the MLP, in the sandwich layouts.
    pub mlp_out_norm: Option<Norm<B>>,
    /// Added to the QKV projection before RoPE.
    pub qkv_bias: Option<B::Vector>,
}

/// What one block application runs: its vectors and its linears.
pub struct Block<'a, B: Backend> {
    pub vectors: &'a BlockVectors<B>,
    pub linears: &'a BlockLinears<B>,
}

/// The loop input `adapter.state · x + adapter.input · e` ([`LoopInput::Adapter`]).
pub struct Adapter<B: Backend> {
    pub state: B::Linear,
    pub input: B::Linear,
}

/// The exit gate: λ = σ(weight · state + bias), one value per row, evaluated on the host from
/// the state (it decides which iteration's output a position takes).
pub struct ExitGate {
    pub weight: Vec<f32>,
    pub bias: f32,
}

pub enum Head<B: Backend> {
    Untied(B::Linear),
    /// Logits are `embed · h`.
    Tied,
    /// Logits are `embed · (embed_projᵀ · h)`; holds `embed_projᵀ` as an `[r, D]` linear.
    TiedFactorized(B::Linear),
}

pub struct Weights<B: Backend> {
    pub config: ModelConfig,
    /// `[vocab, D]` or `[vocab, r]`, always f16.
    pub embed: B::Linear,
    pub embed_proj: Option<B::Linear>,
    /// Vectors of the pre blocks, then the loop blocks, then the post blocks.
    pub vectors: Vec<BlockVectors<B>>,
    /// Linears of the pre blocks, then the post blocks.
    pub unshared: Vec<BlockLinears<B>>,
    /// Linears of the loop blocks, at the precisions the sessions run.
    pub body: BodyStore<B>,
    pub adapter: Option<Adapter<B>>,
    pub final_norm: Norm<B>,
    pub exit_gate: Option<ExitGate>,
    pub head: Head<B>,
    /// RoPE (cos, sin) table for every position a session may use.
    pub rope: B::Float,
    /// Bytes of device memory the weights outside the loop body occupy (the body's own are
    /// [`BodyStore::live_bytes`]).
    pub bytes: usize,
}

impl<B: Backend> Weights<B> {
    /// Upload every tensor of `file`; the RoPE table covers `positions` positions.
    pub fn load(backend: &B, file: &ModelFile, positions: usize) -> Result<Weights<B>> {
        let config = file.config.clone();
        // Sized by the caller's max_seq_len: the allocation most likely to fail goes first.
        let table = rope_table(positions, config.head_dim(), config.rope_theta)?;
        let linear = |name: &str| backend.upload_linear(&host_linear(file, name)?);
        let embed = linear("embed")?;
        let embed_proj = if config.embed_factor_dim > 0 {
            Some(linear("embed_proj")?)
        } else {
            None
        };
        let (mut vectors, mut unshared, mut body) = (Vec::new(), Vec::new(), Vec::new());
        let mut vector_values = 0;
        for (stage, index) in blocks(&config) {
            let b = block_name(stage, index);
            let norm = |name: &str| load_norm(backend, file, &format!("{b}.{name}"));
            let out_norm = |name: &str| -> Result<_> {
                let sandwich = config.architecture.block_norms.has_out_norms();
                sandwich.then(|| norm(name)).transpose()
            };
            let qkv_bias = match file.tensor(&format!("{b}.attn_qkv.bias")) {
                Some((_, bytes)) => Some(backend.upload_vector(&f16_from_bytes(bytes))?),
                None => None,
            };
            let block = BlockVectors {
                attn_norm: norm("attn_norm")?,
                attn_out_norm: out_norm("attn_out_norm")?,
                mlp_norm: norm("mlp_norm")?,
                mlp_out_norm: out_norm("mlp_out_norm")?,
                qkv_bias,
            };
            vector_values += block.values(&config);
            vectors.push(block);
            let [qkv, out, gate, up, down] = BLOCK_LINEARS.map(|n| format!("{b}.{n}"));
            let block = BlockLinears::from_array([
                linear(&qkv)?,
                linear(&out)?,
                linear(&gate)?,
                linear(&up)?,
                linear(&down)?,
            ]);
            match stage {
                // The body store prepares the loop body (and counts what that adds).
                Stage::Loop => body.push(block),
                Stage::Pre | Stage::Post => {
                    for w in block.all() {
                        backend.prepare_block_weight(w, false)?;
                    }
                    unshared.push(block);
                }
            }
        }
        let head = match (config.head, config.embed_factor_dim) {
            (HeadKind::Untied, _) => Head::Untied(linear("head")?),
            (HeadKind::Tied, 0) => Head::Tied,
            (HeadKind::Tied, _) => Head::TiedFactorized(linear_transposed(backend, file)?),
        };
        let final_norm = load_norm(backend, file, "final_norm")?;
        let adapter = match config.architecture.loop_input {
            LoopInput::None => None,
            LoopInput::Adapter => {
                let [state, input] = ADAPTER_LINEARS.map(linear);
                let adapter = Adapter {
                    state: state?,
                    input: input?,
                };
                for w in [&adapter.state, &adapter.input] {
                    backend.prepare_block_weight(w, true)?;
                }
                Some(adapter)
            }
        };
        let exit_gate = if config.architecture.exit_gate {
            let (_, bias) = file
                .tensor("exit_gate.bias")
                .ok_or_else(|| Error::format("missing tensor exit_gate.bias"))?;
            let (_, weight) = file
                .tensor("exit_gate")
                .ok_or_else(|| Error::format("missing tensor exit_gate"))?;
            Some(ExitGate {
                weight: f16_from_bytes(weight).iter().map(|v| v.to_f32()).collect(),
                bias: f16_from_bytes(bias)[0].to_f32(),
            })
        } else {
            None
        };
        let mut rope = backend.alloc_float(table.len())?;
        backend.write_float(&mut rope, &table)?;
        // The body store counts the loop body; these are the other weights' bytes.
        let head_linear = match &head {
            Head::Untied(w) | Head::TiedFactorized(w) => Some(w),
            Head::Tied => None,
        };
        let adapter_linears = adapter.iter().flat_map(|a| [&a.state, &a.input]);
        let linears = [Some(&embed), embed_proj.as_ref(), head_linear]
            .into_iter()
            .flatten()
            .chain(adapter_linears)
            .chain(unshared.iter().flat_map(|b| b.all()));
        let norm_values = config.dim * if final_norm.bias.is_some() { 2 } else { 1 };
        let bytes = linears.map(|w| backend.linear_bytes(w)).sum::<usize>()
            + table.len() * 4
            + 2 * (vector_values + norm_values);
        let body = BodyStore::new(backend, body)?;
        Ok(Weights {
            config,
            embed,
            embed_proj,
            vectors,
            unshared,
            body,
            adapter,
            final_norm,
            exit_gate,
            head,
            rope,
            bytes,
        })
    }
}

impl<B: Backend> Weights<B> {
    /// The weights an application runs: loop iterations share theirs, from `body` (the loop
    /// body of the session's tier).
    pub fn block<'a>(&'a self, app: Application, body: &'a LoopBody<B>) -> Block<'a, B> {
        let c = &self.config;
        let (vectors, linears) = match app.stage {
            Stage::Pre => (app.block, &self.unshared[app.block]),
            Stage::Loop => (c.n_pre_blocks + app.block, &body.blocks[app.block]),
            Stage::Post => (
                c.n_pre_blocks + c.n_loop_blocks + app.block,
                &self.unshared[c.n_pre_blocks + app.block],
            ),
        };
        Block {
            vectors: &self.vectors[vectors],
            linears,
        }
    }

    /// Device bytes of the weights now: those outside the loop body, and the live bodies.
    pub fn live_bytes(&self) -> usize {
        self.bytes + self.body.live_bytes()
    }
}

impl<B: Backend> BlockVectors<B> {
    /// Values held (each stored as f16 on the device), for the memory count.
    fn values(&self, config: &ModelConfig) -> usize {
        let norm = |n: &Norm<B>| config.dim * if n.bias.is_some() { 2 } else { 1 };
        let out_norms = [&self.attn_out_norm, &self.mlp_out_norm];
        norm(&self.attn_norm)
            + norm(&self.mlp_norm)
            + out_norms
                .iter()
                .filter_map(|n| n.as_ref())
                .map(norm)
                .sum::<usize>()
            + self.qkv_bias.as_ref().map_or(0, |_| config.qkv_dim())
    }
}

pub(crate) fn host_linear<'f>(file: &'f ModelFile, name: &str) -> Result<HostLinear<'f>> {
    let (entry, bytes) = file
        .tensor(name)
        .ok_or_else(|| Error::format(format!("missing tensor {name}")))?;
    let (rows, cols) = (entry.shape[0] as usize, entry.shape[1] as usize);
    Ok(HostLinear {
        rows,
        cols,
        dtype: entry.dtype,
        group_size: entry.group_size.map_or(cols, |g| g as usize),
        bytes,
    })
}

fn load_norm<B: Backend>(backend: &B, file: &ModelFile, name: &str) -> Result<Norm<B>> {
    let vector = |name: &str| -> Result<Option<B::Vector>> {
        match file.tensor(name) {
            Some((_, bytes)) => Ok(Some(backend.upload_vector(&f16_from_bytes(bytes))?)),
            None => Ok(None),
        }
    };
    Ok(Norm {
        weight: vector(name)?.ok_or_else(|| Error::format(format!("missing tensor {name}")))?,
        bias: vector(&format!("{name}.bias"))?,
    })
}

/// `embed_projᵀ` as an f16 `[r, D]` linear, for the factorized tied head.
fn linear_transposed<B: Backend>(backend: &B, file: &ModelFile) -> Result<B::Linear> {
    let proj = host_linear(file, "embed_proj")?;
    let (d, r) = (proj.rows, proj.cols);
    // Linear weights are f16 or quantized (the loader admits nothing else).
    let quantized = match proj.dtype {
        DType::F16 => None,
        _ => Some(proj.to_quantized()?),
    };
    let mut row = vec![0f32; r];
    let mut bytes = crate::alloc::zeroed(2 * r * d, "the transposed embed_proj")?;
    for i in 0..d {
        match &quantized {
            Some(q) => q.dequantize_row(i, &mut row),
            None => {
                let values = f16_values(&proj.bytes[2 * i * r..2 * (i + 1) * r]);
                row.iter_mut()
                    .zip(values)
                    .for_each(|(o, x)| *o = x.to_f32());
            }
        }
        for (j, &x) in row.iter().enumerate() {
            let at = 2 * (j * d + i);
            bytes[at..at + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
        }
    }
    backend.upload_linear(&HostLinear {
        rows: r,
        cols: d,
        dtype: DType::F16,
        group_size: d,
        bytes: &bytes,
    })
}
