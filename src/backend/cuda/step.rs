//! The step block: the per-session device memory that holds the next step's token ids,
//! position, sampling choice and KV age-tier bounds, which kernels (and captured graphs) read; and
//! choosing the next token from it (argmax or sampling on the device).

use cudarc::driver::result;

use super::driver::{device_error, Arg, DevBuf};
use super::flash::FlashScratch;
use super::graph::Graph;
use super::{
    CudaBackend, ARGMAX_BLOCKS, SCRATCH_ARGMAX_INDICES, SCRATCH_ARGMAX_TICKETS,
    SCRATCH_ARGMAX_VALUES, SCRATCH_ENTROPY_PARTS, SCRATCH_ENTROPY_TICKET,
};
use crate::backend::{Choice, PooledRows, StepInput};
use crate::error::{Error, Result};
use crate::generate::sampling::inv_temperature;
use crate::kv::TierBounds;
use crate::model::forward::LOGIT_ROWS;

/// Step block header in i32 words (cuda/common.cuh `STEP_*`): start position, rows, chosen token,
/// the entropies of up to LOGIT_ROWS logits rows (f32), the sampling parameters and draw, the KV
/// age-tier bounds, and for a step over a KV pool its page size and where its places are. The
/// token ids follow (max_rows words), then the argmax of each row (max_rows words), then a pooled
/// step's places.
const STEP_HEADER: usize = 3 + LOGIT_ROWS + 9;
const STEP_RESULT: usize = 2;
/// Right after the chosen token, so that one copy reads the token and its row's entropy.
const STEP_ENTROPY: usize = 3;
const STEP_PAGE_SIZE: usize = STEP_HEADER - 2;
/// Threads of the single block of the sampling kernel (cuda/sample.cu).
const SAMPLE_THREADS: u32 = 1024;

/// The step block of one session: header (start position, rows, chosen token, sampling
/// parameters) and token ids in device memory, plus the decode graphs captured for it.
pub struct CudaStep {
    pub(super) buf: DevBuf,
    max_rows: usize,
    pub(super) rows: usize,
    /// The start position of the staged step (also in the device block).
    pub(super) start_pos: usize,
    /// For a step over a KV pool, the most positions a row attends to (the largest position plus
    /// one); none for a step of one sequence.
    pub(super) pooled: Option<usize>,
    choice: Choice,
    host: Vec<i32>,
    pub(super) graphs: Vec<(u64, Graph)>,
    /// The flash attention kernel's tickets and partial sums for steps of up to `max_rows`.
    pub(super) flash: Option<Box<FlashScratch>>,
    /// A capture was begun and not ended (only if a panic cut the ops short): the stream is still
    /// capturing and must be released before anything else runs on it.
    pub(super) capturing: bool,
}

impl CudaStep {
    /// Device bytes of the step block and the attention scratch.
    pub fn bytes(&self) -> usize {
        self.buf.bytes + self.flash.as_ref().map_or(0, |f| f.buf.bytes)
    }
}

impl CudaBackend {
    pub(super) fn new_step(&self, max_rows: usize) -> Result<CudaStep> {
        let flash = match self.attention_heads {
            Some((n_heads, hd)) => self.new_flash_scratch(max_rows, n_heads, hd)?,
            None => None,
        };
        Ok(CudaStep {
            buf: self
                .gpu
                .zeroed((STEP_HEADER + 2 * max_rows) * 4, "step inputs")?,
            max_rows,
            rows: 0,
            start_pos: 0,
            pooled: None,
            choice: Choice::Greedy,
            host: Vec::with_capacity(STEP_HEADER + max_rows),
            graphs: Vec::new(),
            flash,
            capturing: false,
        })
    }

    pub(super) fn stage_step(
        &self,
        step: &mut CudaStep,
        input: StepInput,
        tiers: TierBounds,
    ) -> Result<()> {
        if step.capturing {
            self.abandon_capture(step);
        }
        self.check()?;
        let rows = input.tokens.len();
        if rows > step.max_rows {
            return Err(Error::invalid(format!(
                "step of {rows} rows exceeds the {} the buffers hold",
                step.max_rows
            )));
        }
        let start = i32::try_from(input.start_pos)
            .map_err(|_| Error::invalid("start position exceeds i32"))?;
        step.host.clear();
        step.host.extend_from_slice(&[start, rows as i32, 0]);
        step.host.extend_from_slice(&[0; LOGIT_ROWS]);
        step.host.extend_from_slice(&sampling_words(&input.choice));
        let bound = |b: usize| i32::try_from(b).expect("tier bounds are below max_seq_len");
        step.host
            .extend_from_slice(&[bound(tiers.mid_end), bound(tiers.old_end), 0, 0]);
        step.choice = input.choice;
        step.host.extend(input.tokens.iter().map(|&t| t as i32));
        step.rows = rows;
        step.start_pos = input.start_pos;
        step.pooled = None;
        self.gpu.bind()?;
        // SAFETY: the destination holds STEP_HEADER + max_rows i32 values and rows <= max_rows.
        // The source is pageable host memory, which the driver stages before returning, so
        // `step.host` may be reused at once; the copy is ordered before later work on the stream.
        unsafe { result::memcpy_htod_async(step.buf.ptr, &step.host, self.stream.cu_stream()) }
            .map_err(|e| device_error("staging the step", e))
    }

    /// [`crate::backend::Backend::set_places`]: the places of the rows of the step just staged,
    /// after its token ids and row results: each row's position, then each row's offset (from
    /// the places' start) of its page table, then the tables, one per run of rows of the same
    /// sequence. The block grows to hold them (dropping the graphs, which keep its address).
    /// Returns the attention splits of the step's longest row: the grids of its attention
    /// launches.
    pub(super) fn stage_places(&self, step: &mut CudaStep, places: PooledRows) -> Result<u64> {
        let rows = places.rows.len();
        if rows != step.rows || places.page_size == 0 {
            return Err(Error::invalid(format!(
                "places of {rows} rows (page size {}) for a step of {} rows",
                places.page_size, step.rows
            )));
        }
        let word = |v: usize, what: &str| {
            i32::try_from(v).map_err(|_| Error::invalid(format!("{what} {v} exceeds i32")))
        };
        let mut image = Vec::with_capacity(2 * rows);
        for row in places.rows {
            image.push(word(row.position, "position")?);
        }
        image.resize(2 * rows, 0);
        let mut last: Option<&[u32]> = None;
        for (r, row) in places.rows.iter().enumerate() {
            if row.table.len() * places.page_size <= row.position {
                return Err(Error::invalid(format!(
                    "row {r}: position {} lies past its page table of {} pages",
                    row.position,
                    row.table.len()
                )));
            }
            if last != Some(row.table) {
                last = Some(row.table);
                for &page in row.table {
                    image.push(word(page as usize, "page")?);
                }
            }
            image[rows + r] = word(image.len() - row.table.len(), "table offset")?;
        }
        let start = STEP_HEADER + 2 * step.max_rows;
        let words = start + image.len();
        if words * 4 > step.buf.bytes {
            step.buf = self
                .gpu
                .zeroed(words.next_power_of_two() * 4, "step inputs")?;
            step.graphs.clear();
            self.gpu.bind()?;
            // SAFETY: the new block holds at least the header and token ids just staged.
            unsafe { result::memcpy_htod_async(step.buf.ptr, &step.host, self.stream.cu_stream()) }
                .map_err(|e| device_error("staging the step", e))?;
        }
        let header = [word(places.page_size, "page size")?, word(start, "places")?];
        step.pooled = places.rows.iter().map(|r| r.position + 1).max();
        self.gpu.bind()?;
        let at = |w: usize| step.buf.ptr + (w * 4) as u64;
        // SAFETY: both ranges lie inside the block (its size was checked above); pageable
        // sources are staged by the driver before the calls return.
        unsafe {
            result::memcpy_htod_async(at(STEP_PAGE_SIZE), &header, self.stream.cu_stream())
                .and_then(|()| {
                    result::memcpy_htod_async(at(start), &image, self.stream.cu_stream())
                })
        }
        .map_err(|e| device_error("staging the step's places", e))?;
        Ok(self.pooled_splits(step) as u64)
    }

    pub(super) fn choose_token(&self, logits: &DevBuf, len: usize, step: &mut CudaStep) {
        let result = step.buf.ptr + (STEP_RESULT * 4) as u64;
        match step.choice {
            Choice::Greedy => self.argmax_into(logits.ptr, 1, len, result),
            Choice::Sample { .. } => self.run(
                "sample_token",
                self.gpu.kernels.sample_token,
                (1, 1, 1),
                SAMPLE_THREADS,
                0,
                &[Arg::P(logits.ptr), Arg::usize(len), Arg::P(step.buf.ptr)],
            ),
        }
    }

    pub(super) fn read_chosen(&self, step: &CudaStep) -> Result<u32> {
        let mut out = [0u32; 1];
        self.read_header(step, STEP_RESULT, &mut out)?;
        Ok(out[0])
    }

    /// The chosen token and the entropy of logits row 0, in one copy.
    pub(super) fn read_chosen_measured(&self, step: &CudaStep) -> Result<(u32, f32)> {
        let mut out = [0u32; 2];
        self.read_header(step, STEP_RESULT, &mut out)?;
        Ok((out[0], f32::from_bits(out[1])))
    }

    pub(super) fn read_entropies(&self, step: &CudaStep, rows: usize) -> Result<Vec<f32>> {
        assert!(rows <= LOGIT_ROWS, "entropies of more rows than measured");
        let mut out = vec![0u32; rows];
        self.read_header(step, STEP_ENTROPY, &mut out)?;
        Ok(out.into_iter().map(f32::from_bits).collect())
    }

    /// Copy `out.len()` words of the step header from word `first` (waits for the device).
    fn read_header(&self, step: &CudaStep, first: usize, out: &mut [u32]) -> Result<()> {
        assert!(
            first + out.len() <= STEP_HEADER,
            "read past the step header"
        );
        self.gpu.bind()?;
        // SAFETY: reads words first..first + out.len() of the step block (inside its header, as
        // asserted) into `out`; the copy is stream-ordered after the work that wrote them.
        unsafe {
            result::memcpy_dtoh_async(
                out,
                step.buf.ptr + (first * 4) as u64,
                self.stream.cu_stream(),
            )
        }
        .map_err(|e| device_error("copying to the host", e))?;
        self.sync()
    }

    /// The entropy in bits of each of `rows` rows of `len` logits into the step's entropy words.
    pub(super) fn measure_rows(&self, logits: &DevBuf, rows: usize, len: usize, step: &CudaStep) {
        assert!(
            rows <= LOGIT_ROWS,
            "entropy of more rows than the logits buffer holds"
        );
        let results = step.buf.ptr + (STEP_ENTROPY * 4) as u64;
        let blocks = len.div_ceil(1024).clamp(1, ARGMAX_BLOCKS);
        let s = self.scratch.ptr;
        for r in 0..rows {
            self.run(
                "entropy",
                self.gpu.kernels.entropy_f32,
                (blocks as u32, 1, 1),
                256,
                0,
                &[
                    Arg::P(logits.ptr + (r * len * 4) as u64),
                    Arg::usize(len),
                    Arg::P(s + SCRATCH_ENTROPY_PARTS as u64),
                    Arg::P(s + SCRATCH_ENTROPY_TICKET as u64),
                    Arg::P(results + (r * 4) as u64),
                ],
            );
        }
    }

    /// The argmax of each of `rows` rows of `len` logits into the step's row results (after the
    /// token ids), in one launch.
    pub(super) fn choose_rows(
        &self,
        logits: &DevBuf,
        rows: usize,
        len: usize,
        step: &mut CudaStep,
    ) {
        assert!(
            rows <= step.max_rows,
            "argmax of more rows than the step holds"
        );
        let results = step.buf.ptr + ((STEP_HEADER + step.max_rows) * 4) as u64;
        self.argmax_into(logits.ptr, rows, len, results);
    }

    /// The tokens of the last `choose_rows` (waits for the device).
    pub(super) fn read_chosen_rows(&self, step: &CudaStep, rows: usize) -> Result<Vec<u32>> {
        assert!(rows <= step.max_rows, "more rows than the step holds");
        let mut out = vec![0i32; rows];
        self.gpu.bind()?;
        let results = step.buf.ptr + ((STEP_HEADER + step.max_rows) * 4) as u64;
        // SAFETY: reads `rows` <= max_rows i32 results of the step block into `out`.
        unsafe { result::memcpy_dtoh_async(&mut out, results, self.stream.cu_stream()) }
            .map_err(|e| device_error("copying to the host", e))?;
        self.sync()?;
        Ok(out.into_iter().map(|t| t as u32).collect())
    }

    /// Enqueue the argmax of each of `rows` rows of `len` values at `x` into the i32s at device
    /// address `results`. A row splits across blocks while the scratch holds the candidates of
    /// every row (ARGMAX_BLOCKS; so a row that splits is one of at most ARGMAX_BLOCKS / 2, each
    /// with a ticket).
    pub(super) fn argmax_into(&self, x: u64, rows: usize, len: usize, results: u64) {
        let per_row = (ARGMAX_BLOCKS / rows.max(1)).max(1);
        let blocks = len.div_ceil(1024).clamp(1, per_row);
        let s = self.scratch.ptr;
        self.run(
            "argmax",
            self.gpu.kernels.argmax_f32,
            (blocks as u32, rows as u32, 1),
            256,
            0,
            &[
                Arg::P(x),
                Arg::usize(len),
                Arg::P(s + SCRATCH_ARGMAX_VALUES as u64),
                Arg::P(s + SCRATCH_ARGMAX_INDICES as u64),
                Arg::P(s + SCRATCH_ARGMAX_TICKETS as u64),
                Arg::P(results),
            ],
        );
    }
}

/// The sampling words of the step header (`STEP_TOP_K` .. `STEP_DRAW_HI`); zero when greedy.
fn sampling_words(choice: &Choice) -> [i32; 5] {
    match choice {
        Choice::Greedy => [0; 5],
        Choice::Sample { params, draw } => [
            params.top_k.min(i32::MAX as usize) as i32,
            inv_temperature(params).to_bits() as i32,
            params.top_p.to_bits() as i32,
            *draw as u32 as i32,
            (*draw >> 32) as u32 as i32,
        ],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The step layout here is the one the kernels read (cuda/common.cuh `STEP_*`).
    #[test]
    fn step_layout_matches_the_kernels() {
        let common = include_str!("../../../cuda/common.cuh");
        let define = |name: &str| -> usize {
            let prefix = format!("#define {name} ");
            let line = common.lines().find_map(|l| l.strip_prefix(&prefix));
            let value = line.and_then(|rest| rest.split_whitespace().next());
            value
                .unwrap_or_else(|| panic!("{name} is not defined"))
                .parse()
                .unwrap()
        };
        assert_eq!(define("STEP_RESULT"), STEP_RESULT);
        assert_eq!(define("STEP_ENTROPY"), STEP_ENTROPY);
        assert_eq!(define("STEP_TOP_K"), STEP_ENTROPY + LOGIT_ROWS);
        assert_eq!(define("STEP_PAGE_SIZE"), STEP_PAGE_SIZE);
        assert_eq!(define("STEP_PLACES"), STEP_PAGE_SIZE + 1);
        assert_eq!(define("STEP_TOKENS"), STEP_HEADER);
    }
}
