//! Hugging Face checkpoint folders of the supported looped model families: the architecture is
//! recognized from `config.json`, the family's config keys become a [`ModelConfig`], and each
//! tensor of the `.tinyloop` layout is assembled from the family's tensors on demand (one at a
//! time, from memory-mapped safetensors shards), so converting never holds the checkpoint.
//!
//! * `OuroForCausalLM` (Ouro): every decoder layer is a loop block (`total_ut_steps` loops),
//!   separate Q/K/V projections are concatenated, the four sandwich norms map in order.
//! * `RavenForCausalLM` (Huginn): prelude / core / coda blocks are pre / loop / post blocks; its
//!   RoPE rotates adjacent pairs, so the Q and K rows of each head (and their biases) are permuted
//!   to the halves pairing of docs/FORMAT.md, which leaves every attention score unchanged.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::TensorInfo;
use safetensors::SafeTensors;
use serde_json::{Map, Value};

use super::{widen, Source, Tensor};
use crate::error::{Error, Result};
use crate::format::map_file;
use crate::model::architecture::{Architecture, BlockNorms, LoopInput, LoopNorm, LoopState};
use crate::model::config::{HeadKind, ModelConfig, NormKind};
use crate::tokenizer;

/// The families `convert --hf` reads, by their `architectures` entry in config.json.
pub const SUPPORTED: [&str; 2] = ["OuroForCausalLM", "RavenForCausalLM"];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Ouro,
    Huginn,
}

/// A checkpoint folder: its config, its shards, and the files stored beside the weights.
pub struct HfCheckpoint {
    dir: PathBuf,
    family: Family,
    config: ModelConfig,
    shards: Vec<Mmap>,
    /// Tensor name → (shard, its entry).
    index: HashMap<String, (usize, TensorInfo)>,
    metadata: Map<String, Value>,
}

impl HfCheckpoint {
    pub fn open(dir: &Path) -> Result<HfCheckpoint> {
        let json = read_json(&dir.join("config.json"))?;
        let architectures = json["architectures"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let family = match architectures.first().and_then(Value::as_str) {
            Some("OuroForCausalLM") => Family::Ouro,
            Some("RavenForCausalLM") => Family::Huginn,
            Some(other) => {
                return Err(Error::format(format!(
                    "{}: architecture {other} is not supported (supported: {})",
                    dir.join("config.json").display(),
                    SUPPORTED.join(", ")
                )))
            }
            None => {
                return Err(Error::format(format!(
                    "{}: no \"architectures\" entry naming the model class",
                    dir.join("config.json").display()
                )))
            }
        };
        let keys = Keys {
            json: &json,
            file: dir.join("config.json"),
        };
        let config = match family {
            Family::Ouro => ouro_config(&keys)?,
            Family::Huginn => huginn_config(&keys)?,
        };
        config.validate()?;
        let (shards, index) = open_shards(dir)?;
        // The tokenizer files, checked (a folder without tokenizer.json has none).
        let mut metadata = if dir.join("tokenizer.json").exists() {
            let metadata = tokenizer::metadata_from_dir(dir)?;
            let words = tokenizer::vocab_size(&metadata)?;
            if words > config.vocab_size {
                return Err(Error::format(format!(
                    "{}: the tokenizer has {words} tokens, the model's vocab_size is {}",
                    dir.display(),
                    config.vocab_size
                )));
            }
            metadata
        } else {
            Map::new()
        };
        metadata.insert(
            "source".into(),
            Value::String(format!(
                "huggingface {}",
                architectures[0].as_str().unwrap_or("")
            )),
        );
        let checkpoint = HfCheckpoint {
            dir: dir.to_path_buf(),
            family,
            config,
            shards,
            index,
            metadata,
        };
        checkpoint.check_tensor_set()?;
        Ok(checkpoint)
    }

    /// Every checkpoint tensor is used, or ignorable (a buffer, a tied head's copy).
    fn check_tensor_set(&self) -> Result<()> {
        let mut used: Vec<String> = self
            .recipes()
            .into_values()
            .flat_map(|r| r.sources())
            .collect();
        used.sort();
        used.dedup();
        for name in &used {
            if !self.index.contains_key(name) {
                return Err(Error::format(format!(
                    "{}: missing tensor {name}",
                    self.dir.display()
                )));
            }
        }
        let ignorable = |name: &str| match self.family {
            // A persistent RoPE buffer, and the head a tied model may also store.
            Family::Huginn => {
                name == "freqs_cis"
                    || (name == "lm_head.weight" && self.config.head == HeadKind::Tied)
            }
            Family::Ouro => name == "lm_head.weight" && self.config.head == HeadKind::Tied,
        };
        let mut unused: Vec<&str> = self
            .index
            .keys()
            .map(String::as_str)
            .filter(|n| used.binary_search_by(|u| u.as_str().cmp(n)).is_err() && !ignorable(n))
            .collect();
        unused.sort();
        if !unused.is_empty() {
            return Err(Error::format(format!(
                "{}: tensors this converter does not map: {}",
                self.dir.display(),
                unused.join(", ")
            )));
        }
        Ok(())
    }

    /// The recipe of every tensor of the `.tinyloop` layout.
    fn recipes(&self) -> HashMap<String, Recipe> {
        match self.family {
            Family::Ouro => ouro_recipes(&self.config),
            Family::Huginn => huginn_recipes(&self.config),
        }
    }

    /// A checkpoint tensor widened to f32, with its shape checked.
    fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (shard, info) = self
            .index
            .get(name)
            .ok_or_else(|| Error::format(format!("missing tensor {name}")))?;
        if info.shape != shape {
            return Err(Error::format(format!(
                "tensor {name}: shape {:?}, the config implies {shape:?}",
                info.shape
            )));
        }
        let bytes = &self.shards[*shard];
        let start = 8 + u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let (a, b) = info.data_offsets;
        let data = bytes
            .get(start + a..start + b)
            .ok_or_else(|| Error::format(format!("tensor {name}: data outside its shard")))?;
        let values = widen(name, info.dtype, data)?;
        if values.len() != shape.iter().product::<usize>() {
            return Err(Error::format(format!(
                "tensor {name}: {} bytes for shape {shape:?}",
                data.len()
            )));
        }
        if let Some(i) = values.iter().position(|v| !v.is_finite()) {
            return Err(Error::format(format!(
                "tensor {name}: element {i} is {} (weights must be finite)",
                values[i]
            )));
        }
        Ok(values)
    }
}

impl Source for HfCheckpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let recipe = self
            .recipes()
            .remove(name)
            .ok_or_else(|| Error::format(format!("no recipe for tensor {name}")))?;
        let values = recipe.build(self, shape)?;
        Ok(Tensor {
            shape: shape.to_vec(),
            values,
        })
    }

    fn metadata(&self) -> Map<String, Value> {
        self.metadata.clone()
    }
}

/// How one `.tinyloop` tensor is made from checkpoint tensors.
enum Recipe {
    /// The tensor as stored.
    Same(String),
    /// Row blocks stacked in order: `(name, rows)`.
    Rows(Vec<(String, usize)>),
    /// Rows `[from, from + rows)` of a `[_, cols]` tensor of `total` rows.
    RowSlice {
        name: String,
        total: usize,
        from: usize,
    },
    /// Columns `[from, from + cols)` of a tensor with `total` columns.
    ColumnSlice {
        name: String,
        total: usize,
        from: usize,
    },
    /// Huginn's fused `[Q; K; V]` rows with each Q and K head's rows reordered from adjacent
    /// RoPE pairs to halves.
    HuginnQkv {
        name: String,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    },
    /// Huginn's `qk_bias [2, 1, heads, head_dim]` as a `[Q; K; V]` bias: Q and K permuted as
    /// their rows, V zero.
    HuginnQkvBias {
        name: String,
        heads: usize,
        kv_heads: usize,
        head_dim: usize,
    },
}

impl Recipe {
    fn sources(&self) -> Vec<String> {
        match self {
            Recipe::Same(n) => vec![n.clone()],
            Recipe::Rows(parts) => parts.iter().map(|(n, _)| n.clone()).collect(),
            Recipe::RowSlice { name, .. }
            | Recipe::ColumnSlice { name, .. }
            | Recipe::HuginnQkv { name, .. }
            | Recipe::HuginnQkvBias { name, .. } => vec![name.clone()],
        }
    }

    /// The values of a tensor of `shape` (its rows first when 2-D).
    fn build(&self, ckpt: &HfCheckpoint, shape: &[usize]) -> Result<Vec<f32>> {
        let cols = if shape.len() == 2 { shape[1] } else { 1 };
        match self {
            Recipe::Same(name) => ckpt.read(name, shape),
            Recipe::Rows(parts) => {
                let mut out = Vec::new();
                for (name, rows) in parts {
                    let wanted: &[usize] = &[*rows, cols];
                    out.extend(ckpt.read(name, wanted)?);
                }
                Ok(out)
            }
            Recipe::RowSlice { name, total, from } => {
                let all = ckpt.read(name, &[*total, cols])?;
                Ok(all[from * cols..(from + shape[0]) * cols].to_vec())
            }
            Recipe::ColumnSlice { name, total, from } => {
                let all = ckpt.read(name, &[shape[0], *total])?;
                let rows = all.chunks_exact(*total);
                Ok(rows
                    .flat_map(|r| r[*from..from + cols].iter().copied())
                    .collect())
            }
            Recipe::HuginnQkv {
                name,
                heads,
                kv_heads,
                head_dim,
            } => {
                let all = ckpt.read(name, shape)?;
                let mut out = all.clone();
                for head in 0..heads + kv_heads {
                    for (to, from) in halves_from_pairs(*head_dim) {
                        let (to, from) = (head * head_dim + to, head * head_dim + from);
                        out[to * cols..(to + 1) * cols]
                            .copy_from_slice(&all[from * cols..(from + 1) * cols]);
                    }
                }
                Ok(out)
            }
            Recipe::HuginnQkvBias {
                name,
                heads,
                kv_heads,
                head_dim,
            } => {
                let (heads, kv_heads, hd) = (*heads, *kv_heads, *head_dim);
                if heads != kv_heads {
                    return Err(Error::format(format!(
                        "tensor {name}: a Q/K bias with {heads} query and {kv_heads} KV heads"
                    )));
                }
                let bias = ckpt.read(name, &[2, 1, heads, hd])?;
                let mut out = vec![0.0; (heads + 2 * kv_heads) * hd];
                for head in 0..2 * heads {
                    for (to, from) in halves_from_pairs(hd) {
                        out[head * hd + to] = bias[head * hd + from];
                    }
                }
                Ok(out)
            }
        }
    }
}

/// `(to, from)` row pairs that turn a head rotated in adjacent pairs `(2i, 2i + 1)` into one
/// rotated in halves `(i, i + hd/2)`: row `i` takes row `2i`, row `i + hd/2` takes row `2i + 1`.
fn halves_from_pairs(head_dim: usize) -> impl Iterator<Item = (usize, usize)> {
    let half = head_dim / 2;
    (0..half).flat_map(move |i| [(i, 2 * i), (i + half, 2 * i + 1)])
}

/// Typed access to config.json keys, with the family's defaults for absent ones.
struct Keys<'a> {
    json: &'a Value,
    file: PathBuf,
}

impl Keys<'_> {
    fn bad(&self, key: &str, why: &str) -> Error {
        Error::format(format!("{}: {key} {why}", self.file.display()))
    }

    fn usize(&self, key: &str, default: Option<usize>) -> Result<usize> {
        match &self.json[key] {
            Value::Null => default.ok_or_else(|| self.bad(key, "is missing")),
            v => v
                .as_u64()
                .and_then(|n| usize::try_from(n).ok())
                .ok_or_else(|| self.bad(key, &format!("must be a non-negative integer, is {v}"))),
        }
    }

    fn f64(&self, key: &str, default: f64) -> Result<f64> {
        match &self.json[key] {
            Value::Null => Ok(default),
            v => v
                .as_f64()
                .ok_or_else(|| self.bad(key, &format!("must be a number, is {v}"))),
        }
    }

    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        match &self.json[key] {
            Value::Null => Ok(default),
            v => v
                .as_bool()
                .ok_or_else(|| self.bad(key, &format!("must be true or false, is {v}"))),
        }
    }

    /// A key whose value must be `expected` (or absent) for the forward pass to be right.
    fn require(&self, key: &str, expected: &Value, meaning: &str) -> Result<()> {
        match &self.json[key] {
            Value::Null => Ok(()),
            v if v == expected => Ok(()),
            v => Err(self.bad(
                key,
                &format!("{v} is not supported ({meaning}: {expected})"),
            )),
        }
    }
}

/// Ouro's config.json (the defaults of its `OuroConfig`).
fn ouro_config(k: &Keys) -> Result<ModelConfig> {
    let dim = k.usize("hidden_size", None)?;
    let n_heads = k.usize("num_attention_heads", None)?;
    k.require("hidden_act", &"silu".into(), "supported activation")?;
    k.require("rope_scaling", &Value::Null, "RoPE without scaling")?;
    k.require(
        "use_sliding_window",
        &false.into(),
        "full attention in every layer",
    )?;
    if let Some(types) = k.json["layer_types"].as_array() {
        if types.iter().any(|t| t != "full_attention") {
            return Err(k.bad("layer_types", "has a layer other than full_attention"));
        }
    }
    if k.json["head_dim"].is_number() && k.usize("head_dim", None)? * n_heads != dim {
        return Err(k.bad("head_dim", "must equal hidden_size / num_attention_heads"));
    }
    let threshold = k.f64("early_exit_threshold", 1.0)?;
    Ok(ModelConfig {
        dim,
        n_heads,
        n_kv_heads: k.usize("num_key_value_heads", Some(n_heads))?,
        ffn_dim: k.usize("intermediate_size", None)?,
        vocab_size: k.usize("vocab_size", None)?,
        embed_factor_dim: 0,
        n_pre_blocks: 0,
        n_loop_blocks: k.usize("num_hidden_layers", None)?,
        n_post_blocks: 0,
        default_loops: k.usize("total_ut_steps", Some(4))?,
        norm: NormKind::RmsNorm,
        norm_eps: k.f64("rms_norm_eps", 1e-6)?,
        rope_theta: k.f64("rope_theta", 10000.0)?,
        max_position: k.usize("max_position_embeddings", None)?,
        head: if k.bool("tie_word_embeddings", false)? {
            HeadKind::Tied
        } else {
            HeadKind::Untied
        },
        architecture: Architecture {
            block_norms: BlockNorms::Sandwich,
            loop_norm: LoopNorm::EachIteration,
            head_norm: false,
            exit_gate: true,
            exit_threshold: Some(threshold),
            ..Architecture::default()
        },
    })
}

fn ouro_recipes(c: &ModelConfig) -> HashMap<String, Recipe> {
    let same = |n: &str| Recipe::Same(n.to_string());
    let mut out = HashMap::new();
    out.insert("embed".into(), same("model.embed_tokens.weight"));
    for i in 0..c.n_loop_blocks {
        let (ours, theirs) = (format!("loop.{i}"), format!("model.layers.{i}"));
        for (a, b) in [
            ("attn_norm", "input_layernorm"),
            ("attn_out_norm", "input_layernorm_2"),
            ("mlp_norm", "post_attention_layernorm"),
            ("mlp_out_norm", "post_attention_layernorm_2"),
            ("attn_out", "self_attn.o_proj"),
            ("mlp_gate", "mlp.gate_proj"),
            ("mlp_up", "mlp.up_proj"),
            ("mlp_down", "mlp.down_proj"),
        ] {
            out.insert(format!("{ours}.{a}"), same(&format!("{theirs}.{b}.weight")));
        }
        let proj = |p: &str, rows| (format!("{theirs}.self_attn.{p}_proj.weight"), rows);
        let (q, kv) = (c.dim, c.kv_dim());
        out.insert(
            format!("{ours}.attn_qkv"),
            Recipe::Rows(vec![proj("q", q), proj("k", kv), proj("v", kv)]),
        );
    }
    out.insert("final_norm".into(), same("model.norm.weight"));
    out.insert("exit_gate".into(), same("model.early_exit_gate.weight"));
    out.insert("exit_gate.bias".into(), same("model.early_exit_gate.bias"));
    if c.head == HeadKind::Untied {
        out.insert("head".into(), same("lm_head.weight"));
    }
    out
}

/// Huginn's config.json (the keys of its `RavenConfig`; it derives the KV heads from n_heads).
fn huginn_config(k: &Keys) -> Result<ModelConfig> {
    for (key, value, meaning) in [
        ("block_class_name", "SandwichBlock", "block"),
        ("norm_class_name", "RMSNorm_llama", "norm"),
        ("mlp_class_name", "GatedMLP", "MLP"),
        ("nonlin_name", "SiLU", "activation"),
        ("injection_type", "linear", "loop input"),
        ("state_init", "like-init", "initial state"),
    ] {
        k.require(key, &value.into(), &format!("supported {meaning}"))?;
    }
    k.require("bias", &false.into(), "an adapter without bias")?;
    k.require("test_time_noise", &0.into(), "no test-time noise")?;
    let dim = k.usize("n_embd", None)?;
    let n_heads = k.usize("n_heads", None)?;
    if k.usize("num_key_value_heads", Some(n_heads))? != n_heads {
        return Err(k.bad(
            "num_key_value_heads",
            "must equal n_heads (the code derives it)",
        ));
    }
    let vocab_size = k
        .usize("padded_vocab_size", None)
        .or_else(|_| k.usize("vocab_size", None))?;
    let d = dim as f64;
    // RavenConfig derives init_values.std = √(2 / 5D), which config.json may override; the
    // state is drawn with that std, then scaled by the embedding scale √D (not overridable).
    let std = match &k.json["init_values"]["std"] {
        Value::Null => (2.0 / (5.0 * d)).sqrt(),
        v => v
            .as_f64()
            .ok_or_else(|| k.bad("init_values.std", &format!("must be a number, is {v}")))?,
    };
    Ok(ModelConfig {
        dim,
        n_heads,
        n_kv_heads: n_heads,
        ffn_dim: k.usize("intermediate_size", None)?,
        vocab_size,
        embed_factor_dim: 0,
        n_pre_blocks: k.usize("n_layers_in_prelude", None)?,
        n_loop_blocks: k.usize("n_layers_in_recurrent_block", None)?,
        n_post_blocks: k.usize("n_layers_in_coda", None)?,
        default_loops: k.usize("mean_recurrence", None)?,
        norm: NormKind::RmsNorm,
        norm_eps: k.f64("norm_eps", 1e-6)?,
        rope_theta: k.f64("rope_base", 50000.0)?,
        max_position: k.usize("block_size", None)?,
        head: if k.bool("tie_embeddings", true)? {
            HeadKind::Tied
        } else {
            HeadKind::Untied
        },
        architecture: Architecture {
            block_norms: BlockNorms::SandwichResidual,
            qkv_bias: k.bool("qk_bias", true)?,
            embed_scale: d.sqrt(),
            loop_input: LoopInput::Adapter,
            loop_state: LoopState::Random,
            state_std: std * d.sqrt(),
            loop_norm: LoopNorm::AfterLoop,
            ..Architecture::default()
        },
    })
}

fn huginn_recipes(c: &ModelConfig) -> HashMap<String, Recipe> {
    let same = |n: &str| Recipe::Same(n.to_string());
    let hd = c.head_dim();
    let mut out = HashMap::new();
    out.insert("embed".into(), same("transformer.wte.weight"));
    let stages = [
        ("pre", "prelude", c.n_pre_blocks),
        ("loop", "core_block", c.n_loop_blocks),
        ("post", "coda", c.n_post_blocks),
    ];
    for (ours, theirs, n) in stages {
        for i in 0..n {
            let (ours, theirs) = (format!("{ours}.{i}"), format!("transformer.{theirs}.{i}"));
            for (a, b) in [
                ("attn_norm", "norm_1"),
                ("attn_out_norm", "norm_2"),
                ("mlp_norm", "norm_3"),
                ("mlp_out_norm", "norm_4"),
                ("attn_out", "attn.proj"),
                ("mlp_down", "mlp.proj"),
            ] {
                out.insert(format!("{ours}.{a}"), same(&format!("{theirs}.{b}.weight")));
            }
            out.insert(
                format!("{ours}.attn_qkv"),
                Recipe::HuginnQkv {
                    name: format!("{theirs}.attn.Wqkv.weight"),
                    heads: c.n_heads,
                    kv_heads: c.n_kv_heads,
                    head_dim: hd,
                },
            );
            if c.architecture.qkv_bias {
                out.insert(
                    format!("{ours}.attn_qkv.bias"),
                    Recipe::HuginnQkvBias {
                        name: format!("{theirs}.attn.qk_bias"),
                        heads: c.n_heads,
                        kv_heads: c.n_kv_heads,
                        head_dim: hd,
                    },
                );
            }
            // The fused `fc` holds the gate rows, then the up rows.
            for (part, from) in [("mlp_gate", 0), ("mlp_up", c.ffn_dim)] {
                out.insert(
                    format!("{ours}.{part}"),
                    Recipe::RowSlice {
                        name: format!("{theirs}.mlp.fc.weight"),
                        total: 2 * c.ffn_dim,
                        from,
                    },
                );
            }
        }
    }
    // adapter · concat(state, e): the first D columns act on the state.
    for (part, from) in [("adapter.state", 0), ("adapter.input", c.dim)] {
        out.insert(
            part.into(),
            Recipe::ColumnSlice {
                name: "transformer.adapter.weight".into(),
                total: 2 * c.dim,
                from,
            },
        );
    }
    out.insert("final_norm".into(), same("transformer.ln_f.weight"));
    if c.head == HeadKind::Untied {
        out.insert("head".into(), same("lm_head.weight"));
    }
    out
}

/// The safetensors shards of `dir`: those `model.safetensors.index.json` lists, else
/// `model.safetensors`; and where each tensor lives.
#[allow(clippy::type_complexity)]
fn open_shards(dir: &Path) -> Result<(Vec<Mmap>, HashMap<String, (usize, TensorInfo)>)> {
    let index_path = dir.join("model.safetensors.index.json");
    let files: Vec<String> = match read_optional(&index_path)? {
        Some(_) => {
            let index = read_json(&index_path)?;
            let map = index["weight_map"].as_object().ok_or_else(|| {
                Error::format(format!("{}: no weight_map object", index_path.display()))
            })?;
            let mut files: Vec<String> = map
                .values()
                .map(|v| v.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(|| {
                    Error::format(format!(
                        "{}: a weight_map value is not a file name",
                        index_path.display()
                    ))
                })?;
            files.sort();
            files.dedup();
            files
        }
        None => vec!["model.safetensors".into()],
    };
    let mut shards = Vec::new();
    let mut index = HashMap::new();
    for file in &files {
        if file.contains('/') || file.contains('\\') || file == ".." {
            return Err(Error::format(format!(
                "shard name {file:?} is not a file in the folder"
            )));
        }
        let path = dir.join(file);
        let bytes = map_file(&path)?;
        let (_, metadata) = SafeTensors::read_metadata(&bytes)
            .map_err(|e| Error::format(format!("{}: safetensors: {e}", path.display())))?;
        for (name, info) in metadata.tensors() {
            let entry = (shards.len(), info.clone());
            if index.insert(name.clone(), entry).is_some() {
                return Err(Error::format(format!("tensor {name} is in two shards")));
            }
        }
        shards.push(bytes);
    }
    Ok((shards, index))
}

fn read_optional(path: &Path) -> Result<Option<String>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(Some(text)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io(path, e)),
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| Error::format(format!("{}: {e}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::halves_from_pairs;

    #[test]
    fn pairs_become_halves() {
        let map: Vec<(usize, usize)> = halves_from_pairs(6).collect();
        assert_eq!(map, [(0, 0), (3, 1), (1, 2), (4, 3), (2, 4), (5, 5)]);
    }
}
