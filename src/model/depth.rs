//! Keeping the KV cache's depth mask ([`crate::kv::Depths`]) in step with the sequence:
//! positions that stop early record their depth, every other step's positions count as reached
//! at every depth, and a new sequence starts with the mask off.
//!
//! Captured decode graphs hold the mask's address (or its absence), so they are dropped whenever
//! the mask turns on or off.

use crate::backend::Backend;
use crate::error::Result;
use crate::kv::{DepthMask, ALL_DEPTHS};
use crate::model::forward::Buffers;

impl<B: Backend> Buffers<B> {
    /// Before a step of `rows` rows from `start`: a step from position 0 starts a new sequence,
    /// in which no position stopped early yet; otherwise the step's positions reach every depth
    /// until [`Buffers::stop_depths`] says otherwise.
    pub fn begin_depths(&mut self, backend: &B, start: usize, rows: usize) -> Result<()> {
        if start == 0 {
            self.clear_depths(backend);
            return Ok(());
        }
        if self.kv.depths.mask().is_some() {
            self.write_depths(backend, start, &vec![ALL_DEPTHS; rows])?;
        }
        Ok(())
    }

    /// Positions `start..start + rows` stopped after loop iteration `depth`: attention in deeper
    /// iterations leaves them out from now on.
    pub fn stop_depths(
        &mut self,
        backend: &B,
        start: usize,
        rows: usize,
        depth: u32,
    ) -> Result<()> {
        if self.kv.depths.mask().is_none() {
            if self.kv.depths.mask.is_none() {
                let storage = backend.alloc_kv(4 * self.kv.layout.capacity)?;
                self.kv.depths.mask = Some(DepthMask { storage, on: false });
            }
            // Every earlier position of the sequence ran every iteration.
            self.write_depths(backend, 0, &vec![ALL_DEPTHS; start])?;
            self.turn_depths(backend, true);
        }
        self.write_depths(backend, start, &vec![depth; rows])
    }

    /// Turn the mask off: the sequence starts again (from position 0, or from entries restored
    /// out of a handle, which reached every depth).
    pub fn clear_depths(&mut self, backend: &B) {
        self.turn_depths(backend, false);
    }

    fn turn_depths(&mut self, backend: &B, on: bool) {
        if let Some(mask) = &mut self.kv.depths.mask {
            if mask.on != on {
                mask.on = on;
                self.reset_graphs(backend);
            }
        }
    }

    fn write_depths(&mut self, backend: &B, first: usize, depths: &[u32]) -> Result<()> {
        let Some(mask) = &mut self.kv.depths.mask else {
            unreachable!("the depth mask is allocated before it is written");
        };
        let bytes: Vec<u8> = depths.iter().flat_map(|d| d.to_le_bytes()).collect();
        backend.kv_write(&mut mask.storage, 4 * first, &bytes)
    }
}
