//! The KV cache on the CPU, the reference for every mode: storing the entries of a step,
//! reading them back (summing delta chains), attention over them, recomputing K and V from
//! cached h, and moving entries between age tiers. The storage is the byte layout of
//! [`KvLayout`], identical to the GPU's.

use half::f16;
use rayon::prelude::*;

use super::{round_f16, CpuLinear, CpuStep};
use crate::kv::{codec, Codes, KvCache, KvLayout, KvSlot, Scales, TierMove};

pub type CpuKv = KvCache<Vec<u8>>;

/// Tensor indices of an entry: K and V, or h alone (index 0) in the h modes.
const K: usize = 0;
const V: usize = 1;

fn f16_at(bytes: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]])).to_f32()
}

/// Store one group (`values.len()` values: a head, or a head-sized group of h) of the entry of
/// (tier, tensor, slot, position t).
#[allow(clippy::too_many_arguments)]
fn encode(
    layout: &KvLayout,
    arena: &mut [u8],
    tier: usize,
    tensor: usize,
    slot: usize,
    t: usize,
    group: usize,
    values: &[f32],
) {
    let tr = &layout.tiers[tier];
    let n = values.len();
    let row = layout.codes_at(tier, tensor, slot, t);
    if tr.codes == Codes::F16 {
        for (i, &v) in values.iter().enumerate() {
            let at = row + 2 * (group * n + i);
            arena[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
        }
        return;
    }
    let mut codes = vec![0i8; n];
    let bits = codec::quantize(values, tr.codes.qmax(), tr.scales, &mut codes);
    let bytes = if tr.codes == Codes::I8 { n } else { n / 2 };
    codec::pack(&codes, tr.codes, &mut arena[row + group * bytes..][..bytes]);
    let scales = layout.scales_at(tier, tensor, slot, t);
    match tr.scales {
        Scales::F16 => arena[scales + 2 * group..][..2].copy_from_slice(&bits.to_le_bytes()),
        Scales::E4m3 => arena[scales + group] = bits as u8,
        Scales::None => unreachable!("quantized entries have scales"),
    }
}

/// `out += ` the stored values of one group of (tier, tensor, slot, t).
#[allow(clippy::too_many_arguments)]
fn accumulate(
    layout: &KvLayout,
    arena: &[u8],
    tier: usize,
    tensor: usize,
    slot: usize,
    t: usize,
    group: usize,
    out: &mut [f32],
) {
    let tr = &layout.tiers[tier];
    let n = out.len();
    let row = &arena[layout.codes_at(tier, tensor, slot, t)..][..tr.row_bytes];
    if tr.codes == Codes::F16 {
        for (i, o) in out.iter_mut().enumerate() {
            *o += f16_at(row, group * n + i);
        }
        return;
    }
    let scales = &arena[layout.scales_at(tier, tensor, slot, t)..][..tr.scale_row_bytes];
    let bits = match tr.scales {
        Scales::F16 => u16::from_le_bytes([scales[2 * group], scales[2 * group + 1]]),
        Scales::E4m3 => scales[group] as u16,
        Scales::None => unreachable!("quantized entries have scales"),
    };
    let s = codec::scale_value(bits, tr.scales);
    for (i, o) in out.iter_mut().enumerate() {
        *o += s * codec::code(row, group * n + i, tr.codes) as f32;
    }
}

/// The value of one group of the entry at `slots` (summed in chain order) and position t.
#[allow(clippy::too_many_arguments)]
fn decode(
    layout: &KvLayout,
    arena: &[u8],
    tier: usize,
    tensor: usize,
    slots: impl Iterator<Item = usize>,
    t: usize,
    group: usize,
    out: &mut [f32],
) {
    out.fill(0.0);
    for slot in slots {
        accumulate(layout, arena, tier, tensor, slot, t, group, out);
    }
}

/// Rotate each `hd`-wide head of `heads` by the RoPE table row of one position.
fn rotate(heads: &mut [f32], hd: usize, table: &[f32]) {
    let half = hd / 2;
    for head in heads.chunks_exact_mut(hd) {
        for i in 0..half {
            let (cos, sin) = (table[2 * i], table[2 * i + 1]);
            let (a, b) = (head[i], head[i + half]);
            head[i] = a * cos - b * sin;
            head[i + half] = a * sin + b * cos;
        }
    }
}

pub fn store(
    qkv: &mut [f32],
    h: &[f32],
    step: &CpuStep,
    rows: usize,
    rope: &[f32],
    kv: &mut CpuKv,
    at: KvSlot,
) {
    let KvCache {
        layout,
        bounds,
        storage,
        ..
    } = kv;
    let heads = layout.heads;
    let (hd, q_dim, kv_dim) = (heads.head_dim, heads.q_dim(), heads.kv_dim());
    let by_h = layout.mode.stores_input();
    for r in 0..rows {
        let pos = step.position(r);
        let row = &mut qkv[r * heads.qkv_dim()..(r + 1) * heads.qkv_dim()];
        let rotated = if by_h { q_dim } else { q_dim + kv_dim };
        rotate(&mut row[..rotated], hd, &rope[pos * hd..(pos + 1) * hd]);
        let tier = layout.tier_of(pos, bounds);
        // Where the entry goes: the position itself, or its place in a pool.
        let pos = step.index(r, pos);
        if by_h {
            let h_row = &h[r * layout.dim..(r + 1) * layout.dim];
            for (g, values) in h_row.chunks_exact(hd).enumerate() {
                encode(layout, storage, tier, K, at.own(), pos, g, values);
            }
            continue;
        }
        let mut prev = vec![0f32; hd];
        for (tensor, part) in [
            (K, &row[q_dim..q_dim + kv_dim]),
            (V, &row[q_dim + kv_dim..]),
        ] {
            for (g, head) in part.chunks_exact(hd).enumerate() {
                let mut values = head.to_vec();
                if at.count > 1 {
                    let earlier = at.slots().take(at.count - 1);
                    decode(layout, storage, tier, tensor, earlier, pos, g, &mut prev);
                    values.iter_mut().zip(&prev).for_each(|(v, p)| *v -= p);
                }
                encode(layout, storage, tier, tensor, at.own(), pos, g, &values);
            }
        }
    }
}

/// Recompute K and V of positions `0..positions` from the h cached in `at`, into the scratch
/// (f16, like the fp16 mode's entries): `h` dequantized and rounded to f16, times the K and V
/// rows of the QKV weight (the same dot products as the QKV projection), RoPE on K.
fn rebuild_from_h(kv: &mut CpuKv, at: KvSlot, positions: usize, w: &CpuLinear, rope: &[f32]) {
    let layout = &kv.layout;
    let heads = layout.heads;
    let (hd, dim, q_dim, kv_dim) = (heads.head_dim, layout.dim, heads.q_dim(), heads.kv_dim());
    let mut h = vec![0f32; positions * dim];
    for (t, row) in h.chunks_exact_mut(dim).enumerate() {
        for (g, values) in row.chunks_exact_mut(hd).enumerate() {
            decode(layout, &kv.storage, 0, K, at.slots(), t, g, values);
            values.iter_mut().for_each(|v| *v = round_f16(*v));
        }
    }
    let mut k_v = vec![0f32; positions * 2 * kv_dim];
    w.matmul_rows(&h, positions, q_dim..q_dim + 2 * kv_dim, &mut k_v, false);
    let base = layout.scratch_offset(kv.slots);
    let (k_at, v_at) = (base + layout.scratch.k, base + layout.scratch.v);
    for (t, row) in k_v.chunks_exact_mut(2 * kv_dim).enumerate() {
        rotate(&mut row[..kv_dim], hd, &rope[t * hd..(t + 1) * hd]);
        for (i, &value) in row.iter().enumerate() {
            let (region, index) = if i < kv_dim {
                (k_at, t * kv_dim + i)
            } else {
                (v_at, t * kv_dim + i - kv_dim)
            };
            let at = region + 2 * index;
            kv.storage[at..at + 2].copy_from_slice(&f16::from_f32(value).to_le_bytes());
        }
    }
}

/// One head (`out.len()` values) of K (tensor 0) or V (1) at position t, as attention reads it:
/// summed over the chain `at`, or recomputed from h in the h modes (after an attention call).
pub fn read(kv: &CpuKv, tensor: usize, at: KvSlot, t: usize, group: usize, out: &mut [f32]) {
    let layout = &kv.layout;
    if layout.mode.stores_input() {
        let base = layout.scratch_offset(kv.slots)
            + if tensor == K {
                layout.scratch.k
            } else {
                layout.scratch.v
            };
        let n = out.len();
        let row = &kv.storage[base + 2 * (t * layout.heads.kv_dim() + group * n)..][..2 * n];
        for (i, o) in out.iter_mut().enumerate() {
            *o = f16_at(row, i);
        }
    } else {
        let tier = layout.tier_of(t, &kv.bounds);
        decode(layout, &kv.storage, tier, tensor, at.slots(), t, group, out);
    }
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    qkv: &[f32],
    step: &CpuStep,
    rows: usize,
    kv: &mut CpuKv,
    at: KvSlot,
    w: &CpuLinear,
    rope: &[f32],
    out: &mut [f32],
) {
    if kv.layout.mode.stores_input() {
        rebuild_from_h(kv, at, step.start_pos + rows, w, rope);
    }
    let kv = &*kv;
    // Positions that stopped before this slot's iteration have no entry here (kv::Depths).
    let need = kv.layout.depth_needed(at);
    let mask = kv.depths.mask().filter(|_| need > 0);
    let reached = |t: usize| mask.is_none_or(|m| depth_at(m, t) >= need);
    let heads = kv.layout.heads;
    let hd = heads.head_dim;
    let group = heads.n_heads / heads.n_kv_heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let q_dim = heads.q_dim();
    out[..rows * q_dim]
        .par_chunks_mut(hd)
        .enumerate()
        .for_each(|(index, out)| {
            let (r, h) = (index / heads.n_heads, index % heads.n_heads);
            let pos = step.position(r);
            let q: Vec<f32> = qkv[r * heads.qkv_dim() + h * hd..][..hd]
                .iter()
                .map(|&v| round_f16(v))
                .collect();
            let kvh = h / group;
            let mut entry = vec![0f32; hd];
            let mut scores: Vec<(usize, f32)> = (0..=pos)
                .map(|t| step.index(r, t))
                .filter(|&t| reached(t))
                .map(|t| {
                    read(kv, K, at, t, kvh, &mut entry);
                    let dot = q.iter().zip(&entry).map(|(a, b)| a * b).sum::<f32>();
                    (t, dot * scale)
                })
                .collect();
            let max = scores.iter().map(|s| s.1).fold(f32::NEG_INFINITY, f32::max);
            let mut total = 0.0;
            for (_, s) in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            let mut acc = vec![0f32; hd];
            for &(t, s) in &scores {
                read(kv, V, at, t, kvh, &mut entry);
                for (a, &b) in acc.iter_mut().zip(&entry) {
                    *a += s * b;
                }
            }
            for (o, a) in out.iter_mut().zip(acc) {
                *o = round_f16(a / total);
            }
        });
}

/// The depth of position `t` in a depth mask's bytes.
fn depth_at(mask: &[u8], t: usize) -> u32 {
    u32::from_le_bytes(mask[4 * t..4 * t + 4].try_into().expect("four bytes"))
}

/// Re-encode positions `mv.first..mv.end` from tier `mv.from` into tier `mv.to`, each chain in
/// iteration order against the new encoding of the earlier iterations (closed loop), so the
/// error of iteration i is that of one quantization, not the sum of i of them.
pub fn move_tier(kv: &mut CpuKv, mv: &TierMove) {
    let KvCache {
        layout,
        slots,
        storage,
        ..
    } = kv;
    let (hd, groups) = (layout.heads.head_dim, layout.heads.n_kv_heads);
    let (mut old, mut new, mut delta) = (vec![0f32; hd], vec![0f32; hd], vec![0f32; hd]);
    for chain in layout.chains(*slots) {
        for t in mv.first..mv.end {
            for tensor in [K, V] {
                for g in 0..groups {
                    old.fill(0.0);
                    new.fill(0.0);
                    for slot in chain.slots() {
                        accumulate(layout, storage, mv.from, tensor, slot, t, g, &mut old);
                        for ((d, o), n) in delta.iter_mut().zip(&old).zip(&new) {
                            *d = o - n;
                        }
                        encode(layout, storage, mv.to, tensor, slot, t, g, &delta);
                        accumulate(layout, storage, mv.to, tensor, slot, t, g, &mut new);
                    }
                }
            }
        }
    }
}
