//! Where the KV cache keeps what: the slot of each block application, the tiers of a mode, the
//! regions of a slot, and the bytes. The CPU and CUDA backends both allocate and address exactly
//! this layout (cuda/kv.cuh reads it from [`KvLayout::descriptor`]).
//!
//! Storage is slot-major: slot s occupies bytes `s · slot_bytes ..`, and inside a slot each tier
//! has, per tensor (K and V, or h), a codes region `[ring][row_bytes]` and a scales region
//! `[ring][groups · scale_bytes]`, each padded to 256 bytes. Growing the cache by more slots
//! therefore keeps the old bytes as a prefix. Position t of a tier lives at ring index
//! `t mod ring`.
//!
//! Slots are keyed by (stage, block, iteration): pre blocks first, then post blocks, then the loop
//! body, iteration by iteration. So iteration i has the same slot at every loop count, post-block
//! slots never move, and running more iterations only appends slots.

use super::{AgeTiers, KvMode};
use crate::backend::AttentionShape;
use crate::error::{Error, Result};
use crate::model::config::ModelConfig;
use crate::model::layout::Stage;

/// Positions per age block: tier boundaries move in whole blocks.
pub const AGE_BLOCK: usize = 64;

/// Rows of h reconstructed into K and V per pass in the h modes (bounds the scratch).
pub const H_TILE: usize = 1024;

const ALIGN: usize = 256;

/// Words of [`KvLayout::descriptor`].
pub const KV_DESC_WORDS: usize = 6 + 3 * 9;

/// One block application: a (stage, block, loop iteration) triple. `iteration` counts from 1
/// for loop blocks and is 0 for pre and post blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Application {
    pub stage: Stage,
    pub block: usize,
    pub iteration: usize,
}

/// The slots whose entries make up one application's K and V: `count` slots from `first`,
/// `stride` apart. Only the delta modes chain more than one (iterations 1..=i of a loop block);
/// the application writes its own entry into the last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvSlot {
    pub first: usize,
    pub count: usize,
    pub stride: usize,
}

impl KvSlot {
    /// The slot this application writes.
    pub fn own(&self) -> usize {
        self.first + (self.count - 1) * self.stride
    }

    /// Every slot of the chain, oldest first.
    pub fn slots(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.count).map(move |j| self.first + j * self.stride)
    }
}

/// How entry values are stored (the discriminants are cuda/kv.cuh's `KV_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codes {
    F16 = 0,
    /// Symmetric INT8 in [−127, 127].
    I8 = 1,
    /// Symmetric INT4 in [−7, 7], stored as q + 8, two per byte, the even element in the low
    /// nibble.
    I4 = 2,
}

impl Codes {
    /// Largest code magnitude of a quantized encoding.
    pub fn qmax(self) -> i32 {
        match self {
            Codes::F16 => 0,
            Codes::I8 => 127,
            Codes::I4 => 7,
        }
    }

    fn row_bytes(self, width: usize) -> usize {
        match self {
            Codes::F16 => 2 * width,
            Codes::I8 => width,
            Codes::I4 => width / 2,
        }
    }
}

/// How the per-group scales of a quantized entry are stored (the discriminants are
/// cuda/kv.cuh's `SCALE_*`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scales {
    None = 0,
    F16 = 1,
    /// FP8 E4M3, rounded up so that no code clips (kv::codec).
    E4m3 = 2,
}

impl Scales {
    fn bytes(self) -> usize {
        match self {
            Scales::None => 0,
            Scales::F16 => 2,
            Scales::E4m3 => 1,
        }
    }
}

/// Byte offsets (within a slot) of one tensor's regions in one tier.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Regions {
    pub codes: usize,
    pub scales: usize,
}

/// One precision tier: its encoding, how many positions it holds (a ring), and its regions for
/// each tensor (K, V; or h in `[0]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tier {
    pub codes: Codes,
    pub scales: Scales,
    pub ring: usize,
    pub regions: [Regions; 2],
    pub row_bytes: usize,
    pub scale_row_bytes: usize,
}

/// Byte offsets of the h modes' reconstruction scratch (after all slots): f16 K and V for every
/// position, the f32 product of an h tile with the K and V weights, and (INT h modes) the tile's
/// h dequantized to f16.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scratch {
    pub k: usize,
    pub v: usize,
    pub product: usize,
    pub h: usize,
    pub bytes: usize,
}

#[derive(Clone, Debug, PartialEq)]
pub struct KvLayout {
    pub mode: KvMode,
    /// Positions per sequence (max_seq_len).
    pub capacity: usize,
    pub heads: AttentionShape,
    /// Model width D (the width of h).
    pub dim: usize,
    n_pre: usize,
    n_loop: usize,
    n_post: usize,
    /// 1 tier, or 3 in `age` mode (INT8, INT4, INT4 with FP8 scales).
    pub tiers: Vec<Tier>,
    pub slot_bytes: usize,
    pub scratch: Scratch,
}

fn align(n: usize) -> usize {
    n.div_ceil(ALIGN) * ALIGN
}

impl KvLayout {
    pub fn new(config: &ModelConfig, mode: KvMode, capacity: usize) -> Result<KvLayout> {
        let heads = AttentionShape {
            n_heads: config.n_heads,
            n_kv_heads: config.n_kv_heads,
            head_dim: config.head_dim(),
        };
        if matches!(mode, KvMode::Int8H | KvMode::Int4H) && !heads.head_dim.is_multiple_of(2) {
            return Err(Error::invalid(format!(
                "KV mode {mode} needs an even head_dim (h is quantized per head-sized group); \
                 this model has head_dim {}",
                heads.head_dim
            )));
        }
        if mode.stores_input() && config.architecture.qkv_bias {
            return Err(Error::invalid(format!(
                "KV mode {mode} recomputes K and V from the cached attention input without the \
                 model's QKV bias; use a mode that caches K and V (fp16, int8, delta, age)"
            )));
        }
        if let KvMode::Age(tiers) = mode {
            tiers.validate()?;
            tiers.check_reachable(config.max_position)?;
        }
        Ok(KvLayout {
            mode,
            capacity,
            heads,
            dim: config.dim,
            n_pre: config.n_pre_blocks,
            n_loop: config.n_loop_blocks,
            n_post: config.n_post_blocks,
            tiers: Vec::new(),
            slot_bytes: 0,
            scratch: Scratch::default(),
        }
        .place())
    }

    /// The same mode and model for `capacity` positions (a handle holding a sequence's entries).
    pub fn with_capacity(&self, capacity: usize) -> KvLayout {
        KvLayout {
            capacity,
            tiers: Vec::new(),
            slot_bytes: 0,
            scratch: Scratch::default(),
            ..self.clone()
        }
        .place()
    }

    /// Lay out the tiers, regions and scratch of a checked mode and shape.
    fn place(mut self) -> KvLayout {
        let (mode, capacity, heads) = (self.mode, self.capacity, self.heads);
        let plain = |codes, scales| vec![(codes, scales, capacity)];
        let tiers = match mode {
            KvMode::Fp16 | KvMode::Fp16H => plain(Codes::F16, Scales::None),
            KvMode::Int8H | KvMode::Int8 | KvMode::Delta => plain(Codes::I8, Scales::F16),
            KvMode::Int4H => plain(Codes::I4, Scales::F16),
            KvMode::Age(t) => age_tiers(t, capacity),
        };
        let (width, groups) = self.entry_shape();
        let mut offset = 0;
        for (codes, scales, ring) in tiers {
            let row_bytes = codes.row_bytes(width);
            let scale_row_bytes = groups * scales.bytes();
            let mut regions = [Regions::default(); 2];
            for r in regions.iter_mut().take(self.tensors()) {
                r.codes = offset;
                offset += align(ring * row_bytes);
                r.scales = offset;
                offset += align(ring * scale_row_bytes);
            }
            self.tiers.push(Tier {
                codes,
                scales,
                ring,
                regions,
                row_bytes,
                scale_row_bytes,
            });
        }
        self.slot_bytes = offset;
        if mode.stores_input() {
            let kv = align(capacity * heads.kv_dim() * 2);
            let rows = capacity.min(H_TILE);
            let product = align(rows * 2 * heads.kv_dim() * 4);
            let h = if mode == KvMode::Fp16H {
                0
            } else {
                align(rows * self.dim * 2)
            };
            self.scratch = Scratch {
                k: 0,
                v: kv,
                product: 2 * kv,
                h: 2 * kv + product,
                bytes: 2 * kv + product + h,
            };
        }
        self
    }

    /// Entries per position: 2 (K and V) or 1 (h).
    pub fn tensors(&self) -> usize {
        if self.mode.stores_input() {
            1
        } else {
            2
        }
    }

    /// (values, scale groups) of one entry: (kv_dim, n_kv_heads), or (dim, n_heads) for h.
    pub fn entry_shape(&self) -> (usize, usize) {
        if self.mode.stores_input() {
            (self.dim, self.heads.n_heads)
        } else {
            (self.heads.kv_dim(), self.heads.n_kv_heads)
        }
    }

    /// Slots of one sequence at `loops` iterations.
    pub fn slots(&self, loops: usize) -> usize {
        self.n_pre + self.n_post + self.n_loop * loops
    }

    /// The slot of an application (see the module doc for the order).
    pub fn slot(&self, app: Application) -> usize {
        match app.stage {
            Stage::Pre => app.block,
            Stage::Post => self.n_pre + app.block,
            Stage::Loop => self.n_pre + self.n_post + (app.iteration - 1) * self.n_loop + app.block,
        }
    }

    /// The slots an application reads (its own last; a chain over iterations in delta modes).
    pub fn at(&self, app: Application) -> KvSlot {
        let own = self.slot(app);
        if app.stage == Stage::Loop && self.mode.is_delta() {
            let first = self.slot(Application {
                iteration: 1,
                ..app
            });
            KvSlot {
                first,
                count: app.iteration,
                stride: self.n_loop,
            }
        } else {
            KvSlot {
                first: own,
                count: 1,
                stride: self.n_loop,
            }
        }
    }

    /// The depth a position must have reached for attention at `at` to read its entry
    /// ([`super::Depths`]): the loop iteration of a loop slot, 0 for pre and post slots.
    pub fn depth_needed(&self, at: KvSlot) -> u32 {
        let own = at.own();
        if own < self.single_slots() {
            0
        } else {
            ((own - self.single_slots()) / self.n_loop + 1) as u32
        }
    }

    /// Slots that never chain: the pre and post blocks' (slots `0..single_slots()`).
    pub fn single_slots(&self) -> usize {
        self.n_pre + self.n_post
    }

    /// Loop blocks, and so loop-iteration chains.
    pub fn loop_blocks(&self) -> usize {
        self.n_loop
    }

    /// Loop iterations the first `slots` slots hold.
    pub fn iterations(&self, slots: usize) -> usize {
        (slots - self.single_slots()) / self.n_loop
    }

    /// The chains of every slot among the first `slots`, for re-quantizing them together: each
    /// pre and post slot alone, and each loop block over its allocated iterations. Chain c
    /// starts at slot c.
    pub fn chains(&self, slots: usize) -> Vec<KvSlot> {
        let single = |s| KvSlot {
            first: s,
            count: 1,
            stride: 1,
        };
        let mut out: Vec<KvSlot> = (0..self.single_slots()).map(single).collect();
        let iterations = self.iterations(slots);
        if iterations > 0 {
            out.extend((0..self.n_loop).map(|block| KvSlot {
                first: self.single_slots() + block,
                count: iterations,
                stride: self.n_loop,
            }));
        }
        out
    }

    /// Bytes of a cache with `slots` slots: the slots plus the reconstruction scratch.
    pub fn bytes(&self, slots: usize) -> usize {
        slots * self.slot_bytes + self.scratch.bytes
    }

    /// Byte offset of the scratch (after the slots).
    pub fn scratch_offset(&self, slots: usize) -> usize {
        slots * self.slot_bytes
    }

    /// Bytes one position of one tier takes in one slot, without padding (docs/QUALITY.md).
    pub fn bytes_per_token(&self, tier: usize) -> usize {
        let t = &self.tiers[tier];
        self.tensors() * (t.row_bytes + t.scale_row_bytes)
    }

    /// The tier position `t` is in, given the age-tier bounds.
    pub fn tier_of(&self, t: usize, bounds: &super::TierBounds) -> usize {
        if t < bounds.old_end {
            2
        } else if t < bounds.mid_end {
            1
        } else {
            0
        }
    }

    /// Byte offset of the codes of (tensor, slot, position) in tier `tier`.
    pub fn codes_at(&self, tier: usize, tensor: usize, slot: usize, t: usize) -> usize {
        let tr = &self.tiers[tier];
        slot * self.slot_bytes + tr.regions[tensor].codes + (t % tr.ring) * tr.row_bytes
    }

    /// The byte ranges `(from, to, len)` that copy the entries of positions `first..first + n`
    /// from slot `from` to slot `to` (exit policy skip). Only single-tier modes whose entries
    /// stand alone qualify: a delta entry depends on its chain, an age entry on its tier.
    pub fn entry_copies(
        &self,
        from: usize,
        to: usize,
        first: usize,
        n: usize,
    ) -> Result<Vec<(usize, usize, usize)>> {
        self.check_entry_copies()?;
        let tier = &self.tiers[0];
        let mut out = Vec::new();
        for t in first..first + n {
            for tensor in 0..self.tensors() {
                out.push((
                    self.codes_at(0, tensor, from, t),
                    self.codes_at(0, tensor, to, t),
                    tier.row_bytes,
                ));
                if tier.scale_row_bytes > 0 {
                    out.push((
                        self.scales_at(0, tensor, from, t),
                        self.scales_at(0, tensor, to, t),
                        tier.scale_row_bytes,
                    ));
                }
            }
        }
        Ok(out)
    }

    /// Whether [`KvLayout::entry_copies`] applies to this mode.
    pub fn check_entry_copies(&self) -> Result<()> {
        if self.mode.is_delta() || matches!(self.mode, KvMode::Age(_)) {
            return Err(Error::invalid(format!(
                "exit_policy skip copies KV entries between iterations, which KV mode {} cannot \
                 (use fp16, fp16-h, int8-h, int4-h or int8)",
                self.mode
            )));
        }
        Ok(())
    }

    /// Byte offset of the scales of (tensor, slot, position) in tier `tier`.
    pub fn scales_at(&self, tier: usize, tensor: usize, slot: usize, t: usize) -> usize {
        let tr = &self.tiers[tier];
        slot * self.slot_bytes + tr.regions[tensor].scales + (t % tr.ring) * tr.scale_row_bytes
    }

    /// The layout as i64 words for the CUDA kernels (cuda/kv.cuh `KvDesc`): slot bytes, entry
    /// width, groups, group size, tiers, tensors; then per tier (three, unused ones zero): ring,
    /// codes, scales, row bytes, scale-row bytes, the codes offsets of K (or h) and V, and their
    /// scales offsets.
    pub fn descriptor(&self) -> [i64; KV_DESC_WORDS] {
        let (width, groups) = self.entry_shape();
        let mut d = [0i64; KV_DESC_WORDS];
        let head = [
            self.slot_bytes,
            width,
            groups,
            width / groups,
            self.tiers.len(),
            self.tensors(),
        ];
        for (w, v) in d.iter_mut().zip(head) {
            *w = v as i64;
        }
        for (i, t) in self.tiers.iter().enumerate() {
            let words = [
                t.ring,
                t.codes as usize,
                t.scales as usize,
                t.row_bytes,
                t.scale_row_bytes,
                t.regions[0].codes,
                t.regions[1].codes,
                t.regions[0].scales,
                t.regions[1].scales,
            ];
            for (w, v) in d[6 + 9 * i..].iter_mut().zip(words) {
                *w = v as i64;
            }
        }
        d
    }
}

/// The three AGE-KV tiers for `capacity` positions: (encoding, ring size). A position enters the
/// INT4 tier once its whole block is at least `int4_from` old, so at most `int4_from +
/// AGE_BLOCK` positions are young at a time; likewise for the middle tier.
fn age_tiers(t: AgeTiers, capacity: usize) -> Vec<(Codes, Scales, usize)> {
    let blocks = capacity.div_ceil(AGE_BLOCK) * AGE_BLOCK;
    let young = blocks.min(t.int4_from + AGE_BLOCK);
    let mid = blocks
        .saturating_sub(t.int4_from)
        .min(t.fp8_from - t.int4_from + AGE_BLOCK);
    let old = blocks.saturating_sub(t.fp8_from);
    vec![
        (Codes::I8, Scales::F16, young),
        (Codes::I4, Scales::F16, mid),
        (Codes::I4, Scales::E4m3, old),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::synth::preset;

    fn app(stage: Stage, block: usize, iteration: usize) -> Application {
        Application {
            stage,
            block,
            iteration,
        }
    }

    #[test]
    fn iteration_slots_do_not_depend_on_the_loop_count() {
        let config = preset("tiny-gqa").unwrap(); // pre, 2 loop blocks, post
        let layout = KvLayout::new(&config, KvMode::Fp16, 16).unwrap();
        let (n_pre, k, n_post) = (
            config.n_pre_blocks,
            config.n_loop_blocks,
            config.n_post_blocks,
        );
        assert!(k == 2 && n_post == 1);
        // Post slots come right after the pre slots, for any L.
        assert_eq!(layout.slot(app(Stage::Post, 0, 0)), n_pre);
        // Iteration i of block b: the same slot whatever L is; slots are dense and distinct.
        let mut seen = std::collections::HashSet::new();
        for b in 0..n_pre {
            assert!(seen.insert(layout.slot(app(Stage::Pre, b, 0))));
        }
        assert!(seen.insert(layout.slot(app(Stage::Post, 0, 0))));
        for i in 1..=8 {
            for b in 0..k {
                assert!(seen.insert(layout.slot(app(Stage::Loop, b, i))));
            }
            assert_eq!(seen.len(), layout.slots(i));
            assert!(seen.iter().all(|&s| s < layout.slots(i)));
        }
    }

    #[test]
    fn loop_slots_need_their_iteration_as_depth() {
        let config = preset("tiny-gqa").unwrap(); // pre, 2 loop blocks, post
        for mode in [KvMode::Fp16, KvMode::Delta] {
            let layout = KvLayout::new(&config, mode, 16).unwrap();
            for i in 1..=5 {
                for b in 0..2 {
                    let at = layout.at(app(Stage::Loop, b, i));
                    assert_eq!(layout.depth_needed(at), i as u32, "{mode} block {b}");
                }
            }
            assert_eq!(layout.depth_needed(layout.at(app(Stage::Pre, 0, 0))), 0);
            assert_eq!(layout.depth_needed(layout.at(app(Stage::Post, 0, 0))), 0);
        }
    }

    #[test]
    fn delta_chains_run_over_earlier_iterations() {
        let config = preset("tiny-gqa").unwrap();
        let layout = KvLayout::new(&config, KvMode::Delta, 16).unwrap();
        let at = layout.at(app(Stage::Loop, 1, 3));
        let slots: Vec<usize> = at.slots().collect();
        let expect: Vec<usize> = (1..=3)
            .map(|i| layout.slot(app(Stage::Loop, 1, i)))
            .collect();
        assert_eq!(slots, expect);
        assert_eq!(at.own(), layout.slot(app(Stage::Loop, 1, 3)));
        // Pre blocks never chain.
        assert_eq!(layout.at(app(Stage::Pre, 0, 0)).count, 1);
        let int8 = KvLayout::new(&config, KvMode::Int8, 16).unwrap();
        assert_eq!(int8.at(app(Stage::Loop, 1, 3)).count, 1);
    }

    #[test]
    fn bytes_per_token_per_slot() {
        let config = preset("tl-407m").unwrap(); // kv_dim 2048, 16 heads of 128
        let per = |mode: &str| {
            let l = KvLayout::new(&config, mode.parse().unwrap(), 4096).unwrap();
            (0..l.tiers.len())
                .map(|t| l.bytes_per_token(t))
                .collect::<Vec<_>>()
        };
        assert_eq!(per("fp16"), [8192]);
        assert_eq!(per("fp16-h"), [4096]);
        assert_eq!(per("int8-h"), [2048 + 32]);
        assert_eq!(per("int4-h"), [1024 + 32]);
        assert_eq!(per("int8"), [2 * (2048 + 32)]);
        assert_eq!(per("delta"), [2 * (2048 + 32)]);
        assert_eq!(
            per("age"),
            [2 * (2048 + 32), 2 * (1024 + 32), 2 * (1024 + 16)]
        );
    }

    #[test]
    fn age_tiers_follow_the_table() {
        let config = preset("tiny").unwrap();
        let mode = KvMode::Age(AgeTiers {
            int4_from: 1024,
            fp8_from: 4096,
        });
        let rings = |cap| {
            let l = KvLayout::new(&config, mode, cap).unwrap();
            l.tiers.iter().map(|t| t.ring).collect::<Vec<_>>()
        };
        assert_eq!(rings(512), [512, 0, 0]);
        assert_eq!(rings(2048), [1088, 1024, 0]);
        assert_eq!(rings(4096), [1088, 3072, 0]);
        assert_eq!(rings(32768), [1088, 3136, 28672]);
    }

    #[test]
    fn age_boundaries_are_bounded_by_max_position() {
        let config = preset("tiny").unwrap(); // max_position 2048
        let open = |mode: &str| KvLayout::new(&config, mode.parse().unwrap(), 64);
        let err = open("age:64:18446744073709551552").unwrap_err().to_string();
        assert_eq!(
            err,
            "invalid argument: KV mode age:64:18446744073709551552: the FP8 boundary 18446744073709551552 is above \
             the model's max_position 2048 (age boundaries must be at most 2048)"
        );
        let err = open("age:2112:4096").unwrap_err().to_string();
        assert!(err.contains("the INT4 boundary 2112"), "{err}");
        // A boundary at max_position is the end of every sequence: its tier is never reached.
        assert!(open("age:1024:2048").is_ok());
        assert!(open("age:2048:2112").is_err());
        // Plain `age` keeps the seed table's 1024 and 4096 on every model.
        assert!(open("age").is_ok());
    }

    #[test]
    fn regions_do_not_overlap() {
        let config = preset("tiny-gqa").unwrap();
        for mode in [
            "fp16",
            "fp16-h",
            "int8-h",
            "int4-h",
            "int8",
            "delta",
            "age:64:128",
        ] {
            let l = KvLayout::new(&config, mode.parse().unwrap(), 300).unwrap();
            let mut spans = Vec::new();
            for t in &l.tiers {
                for r in t.regions.iter().take(l.tensors()) {
                    spans.push((r.codes, t.ring * t.row_bytes));
                    spans.push((r.scales, t.ring * t.scale_row_bytes));
                }
            }
            spans.sort();
            for w in spans.windows(2) {
                assert!(w[0].0 + w[0].1 <= w[1].0, "{mode}: {spans:?}");
            }
            let last = spans.last().unwrap();
            assert!(last.0 + last.1 <= l.slot_bytes, "{mode}");
            assert_eq!(l.bytes(3), 3 * l.slot_bytes + l.scratch.bytes);
        }
    }

    #[test]
    fn h_quantization_needs_an_even_head_dim() {
        // Config validation already requires an even head_dim (RoPE); the cache checks its own
        // constraint independently, and names it.
        let config = ModelConfig {
            dim: 15,
            n_heads: 5,
            n_kv_heads: 5,
            ..preset("tiny").unwrap()
        };
        for mode in [KvMode::Int8H, KvMode::Int4H] {
            let err = KvLayout::new(&config, mode, 8).unwrap_err().to_string();
            assert!(err.contains("even head_dim") && err.contains('3'), "{err}");
        }
        assert!(KvLayout::new(&config, KvMode::Fp16H, 8).is_ok());
    }
}
