//! A deliberately plain forward pass in f64, written from docs/FORMAT.md alone.
//! It shares no code with the crate: it parses the file itself, dequantizes every weight to a
//! dense f64 matrix, and recomputes all positions from scratch (no KV cache). It rounds to f16
//! exactly where the numerics contract says the runtime does, so the remaining difference to the
//! runtime is f32-versus-f64 accumulation only.

use std::collections::HashMap;

use half::f16;
use serde_json::Value;

pub struct Reference {
    cfg: Value,
    tensors: HashMap<String, (Vec<usize>, Vec<f64>)>,
}

fn r16(x: f64) -> f64 {
    f16::from_f64(x).to_f64()
}

fn read_f16(bytes: &[u8]) -> Vec<f64> {
    bytes
        .chunks_exact(2)
        .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f64())
        .collect()
}

impl Reference {
    pub fn load(bytes: &[u8]) -> Reference {
        assert_eq!(&bytes[..8], b"TINYLOOP");
        let header_len = u64::from_le_bytes(bytes[16..24].try_into().unwrap()) as usize;
        let header: Value = serde_json::from_slice(&bytes[24..24 + header_len]).unwrap();
        let data_start = (24 + header_len).div_ceil(64) * 64;
        let mut tensors = HashMap::new();
        for t in header["tensors"].as_array().unwrap() {
            let shape: Vec<usize> = t["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            let offset = data_start + t["offset"].as_u64().unwrap() as usize;
            let raw = &bytes[offset..offset + t["length"].as_u64().unwrap() as usize];
            let values = match t["dtype"].as_str().unwrap() {
                "f16" => read_f16(raw),
                "int4" => dequantize(raw, &shape, 4, t["group_size"].as_u64().unwrap() as usize),
                "int2" => dequantize(raw, &shape, 2, t["group_size"].as_u64().unwrap() as usize),
                other => panic!("reference does not handle dtype {other}"),
            };
            tensors.insert(t["name"].as_str().unwrap().to_string(), (shape, values));
        }
        Reference {
            cfg: header["config"].clone(),
            tensors,
        }
    }

    fn c(&self, key: &str) -> usize {
        self.cfg[key].as_u64().unwrap() as usize
    }

    fn t(&self, name: &str) -> &[f64] {
        &self.tensors[name].1
    }

    /// `W · x` for a `[rows, cols]` tensor.
    fn matvec(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let (shape, w) = &self.tensors[name];
        assert_eq!(shape[1], x.len(), "{name}");
        w.chunks_exact(shape[1])
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    /// The architecture choice `key` (docs/FORMAT.md version 2), or its version-1 default.
    fn arch(&self, key: &str, default: Value) -> Value {
        let arch = &self.cfg["architecture"];
        if arch.is_null() {
            default
        } else {
            arch[key].clone()
        }
    }

    /// A norm whose output feeds a linear: rounded to f16.
    fn norm(&self, name: &str, x: &[f64]) -> Vec<f64> {
        self.norm_exact(name, x).into_iter().map(r16).collect()
    }

    /// A norm whose output stays in the residual stream: not rounded.
    fn norm_exact(&self, name: &str, x: &[f64]) -> Vec<f64> {
        let n = x.len() as f64;
        let eps = self.cfg["norm_eps"].as_f64().unwrap();
        let w = self.t(name);
        let layer = self.cfg["norm"] == "layernorm";
        let mean = if layer {
            x.iter().sum::<f64>() / n
        } else {
            0.0
        };
        let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
        let inv = 1.0 / (var + eps).sqrt();
        let bias_name = format!("{name}.bias");
        (0..x.len())
            .map(|i| {
                let b = if layer { self.t(&bias_name)[i] } else { 0.0 };
                (x[i] - mean) * inv * w[i] + b
            })
            .collect()
    }

    fn rope(&self, v: &mut [f64], pos: usize, hd: usize) {
        let theta = self.cfg["rope_theta"].as_f64().unwrap();
        for head in v.chunks_exact_mut(hd) {
            for i in 0..hd / 2 {
                let angle = pos as f64 * theta.powf(-2.0 * i as f64 / hd as f64);
                // The contract rounds cos and sin to f32.
                let (c, s) = (angle.cos() as f32 as f64, angle.sin() as f32 as f64);
                let (a, b) = (head[i], head[i + hd / 2]);
                head[i] = a * c - b * s;
                head[i + hd / 2] = a * s + b * c;
            }
        }
    }

    fn block(&self, name: &str, xs: &mut [Vec<f64>]) {
        let (d, h, hkv) = (self.c("dim"), self.c("n_heads"), self.c("n_kv_heads"));
        let hd = d / h;
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        let layout = self.arch("block_norms", "pre".into());
        // x ← x + f (pre), x + norm_out(f) (sandwich) or norm_out(x + f) (sandwich_residual).
        let update = |x: &mut Vec<f64>, f: Vec<f64>, out_norm: &str| match layout.as_str() {
            Some("pre") => x.iter_mut().zip(f).for_each(|(a, b)| *a += b),
            Some("sandwich") => {
                let n = self.norm_exact(&format!("{name}.{out_norm}"), &f);
                x.iter_mut().zip(n).for_each(|(a, b)| *a += b);
            }
            Some("sandwich_residual") => {
                x.iter_mut().zip(f).for_each(|(a, b)| *a += b);
                *x = self.norm_exact(&format!("{name}.{out_norm}"), x);
            }
            other => panic!("block_norms {other:?}"),
        };
        for (pos, x) in xs.iter().enumerate() {
            let mut qkv = self.matvec(
                &format!("{name}.attn_qkv"),
                &self.norm(&format!("{name}.attn_norm"), x),
            );
            if let Some((_, bias)) = self.tensors.get(&format!("{name}.attn_qkv.bias")) {
                qkv.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
            }
            let mut q = qkv[..h * hd].to_vec();
            let mut k = qkv[h * hd..(h + hkv) * hd].to_vec();
            self.rope(&mut q, pos, hd);
            self.rope(&mut k, pos, hd);
            qs.push(q.iter().map(|&v| r16(v)).collect::<Vec<_>>());
            ks.push(k.iter().map(|&v| r16(v)).collect::<Vec<_>>());
            vs.push(
                qkv[(h + hkv) * hd..]
                    .iter()
                    .map(|&v| r16(v))
                    .collect::<Vec<_>>(),
            );
        }
        for (pos, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0.0; d];
            for head in 0..h {
                let kvh = head / (h / hkv);
                let q = &qs[pos][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=pos)
                    .map(|t| {
                        let k = &ks[t][kvh * hd..(kvh + 1) * hd];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = e.iter().sum();
                for (t, w) in e.iter().enumerate() {
                    for i in 0..hd {
                        att[head * hd + i] += w / total * vs[t][kvh * hd + i];
                    }
                }
            }
            let att: Vec<f64> = att.iter().map(|&v| r16(v)).collect();
            let o = self.matvec(&format!("{name}.attn_out"), &att);
            update(x, o, "attn_out_norm");
            let hn = self.norm(&format!("{name}.mlp_norm"), x);
            let g = self.matvec(&format!("{name}.mlp_gate"), &hn);
            let u = self.matvec(&format!("{name}.mlp_up"), &hn);
            let a: Vec<f64> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| r16(g / (1.0 + (-g).exp()) * u))
                .collect();
            let down = self.matvec(&format!("{name}.mlp_down"), &a);
            update(x, down, "mlp_out_norm");
        }
    }

    /// Logits `[n][vocab]` for every position of `tokens` at `loops` iterations (a random loop
    /// state starts from zeros: open the runtime with `state_init` zeros).
    pub fn logits(&self, tokens: &[u32], loops: usize) -> Vec<Vec<f64>> {
        let r = self.c("embed_factor_dim");
        let width = if r > 0 { r } else { self.c("dim") };
        let scale = self.arch("embed_scale", 1.0.into()).as_f64().unwrap();
        let mut xs: Vec<Vec<f64>> = tokens
            .iter()
            .map(|&t| {
                let e = self.t("embed")[t as usize * width..(t as usize + 1) * width].to_vec();
                let e = if r > 0 {
                    self.matvec("embed_proj", &e)
                } else {
                    e
                };
                // The product is rounded to f32, as the runtime's stream holds it.
                e.iter().map(|v| (v * scale) as f32 as f64).collect()
            })
            .collect();
        for i in 0..self.c("n_pre_blocks") {
            self.block(&format!("pre.{i}"), &mut xs);
        }
        // The loop's input (adapter) and initial state.
        let adapter = self.arch("loop_input", "none".into()) == "adapter";
        let inputs: Vec<Vec<f64>> = if adapter {
            let r16s = |x: &Vec<f64>| x.iter().map(|&v| r16(v)).collect::<Vec<_>>();
            xs.iter()
                .map(|e| self.matvec("adapter.input", &r16s(e)))
                .collect()
        } else {
            Vec::new()
        };
        if self.arch("loop_state", "carry".into()) == "random" {
            xs.iter_mut().for_each(|x| x.fill(0.0));
        }
        let loop_norm = self.arch("loop_norm", "none".into());
        for _ in 0..loops {
            if adapter {
                for (x, input) in xs.iter_mut().zip(&inputs) {
                    let h: Vec<f64> = x.iter().map(|&v| r16(v)).collect();
                    let s = self.matvec("adapter.state", &h);
                    *x = input.iter().zip(s).map(|(a, b)| a + b).collect();
                }
            }
            for j in 0..self.c("n_loop_blocks") {
                self.block(&format!("loop.{j}"), &mut xs);
            }
            if loop_norm == "each_iteration" {
                xs.iter_mut()
                    .for_each(|x| *x = self.norm_exact("final_norm", x));
            }
        }
        if loop_norm == "after_loop" {
            xs.iter_mut()
                .for_each(|x| *x = self.norm_exact("final_norm", x));
        }
        for i in 0..self.c("n_post_blocks") {
            self.block(&format!("post.{i}"), &mut xs);
        }
        let head_norm = self.arch("head_norm", true.into()).as_bool().unwrap();
        xs.iter()
            .map(|x| {
                let h = if head_norm {
                    self.norm("final_norm", x)
                } else {
                    x.iter().map(|&v| r16(v)).collect()
                };
                if self.cfg["head"] == "untied" {
                    self.matvec("head", &h)
                } else if r > 0 {
                    // embed · (embed_projᵀ · h), the projection rounded to f16.
                    let (_, p) = &self.tensors["embed_proj"];
                    let t: Vec<f64> = (0..r)
                        .map(|j| r16((0..h.len()).map(|i| p[i * r + j] * h[i]).sum()))
                        .collect();
                    self.matvec("embed", &t)
                } else {
                    self.matvec("embed", &h)
                }
            })
            .collect()
    }
}

fn dequantize(raw: &[u8], shape: &[usize], bits: usize, group: usize) -> Vec<f64> {
    let (rows, cols) = (shape[0], shape[1]);
    let code_bytes = rows * cols * bits / 8;
    let groups = cols / group;
    let scales = read_f16(&raw[code_bytes..code_bytes + rows * groups * 2]);
    let zeros = read_f16(&raw[code_bytes + rows * groups * 2..]);
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let flat = r * cols + c;
            let byte = raw[flat * bits / 8];
            let q = (byte >> ((flat * bits) % 8)) & ((1 << bits) - 1) as u8;
            let p = r * groups + c / group;
            out.push(scales[p] * q as f64 + zeros[p]);
        }
    }
    out
}
