//! A KV pool: one KV cache whose positions are shared out in fixed-size pages to many sequences.
//!
//! The cache keeps the layout of a session's ([`super::KvLayout`]: slot-major, a slot per
//! (stage, block, iteration)); its capacity counts pool positions instead of the positions of one
//! sequence. A page is `page_size` consecutive pool positions in every slot, so a sequence's page
//! table maps its positions to pool positions for all its block applications at once, and
//! running more loop iterations adds slots to the pool, not pages to a sequence.

use crate::error::{Error, Result};

/// The pages of a pool: which are free. Every page belongs to one sequence at a time.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    pages: usize,
    /// Free pages, the lowest last (handed out first, so a quiet pool reuses the same memory).
    free: Vec<u32>,
}

impl PagePool {
    /// A pool of `pages` pages of `page_size` positions.
    pub fn new(page_size: usize, pages: usize) -> Result<PagePool> {
        if page_size == 0 || pages == 0 {
            return Err(Error::invalid(format!(
                "a KV pool needs pages of at least one position and at least one page \
                 (got {pages} pages of {page_size})"
            )));
        }
        if u32::try_from(pages).is_err() {
            return Err(Error::invalid(format!(
                "a KV pool of {pages} pages (at most {})",
                u32::MAX
            )));
        }
        Ok(PagePool {
            page_size,
            pages,
            free: (0..pages as u32).rev().collect(),
        })
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }

    /// Pages in the pool.
    pub fn pages(&self) -> usize {
        self.pages
    }

    /// Pages not held by any sequence.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Pages a sequence of `positions` positions needs.
    pub fn pages_for(&self, positions: usize) -> usize {
        positions.div_ceil(self.page_size)
    }

    /// Give `table` pages until it holds `positions` positions; false (and nothing taken) when
    /// too few pages are free.
    pub fn grow(&mut self, table: &mut Vec<u32>, positions: usize) -> bool {
        let needed = self.pages_for(positions).saturating_sub(table.len());
        if needed > self.free.len() {
            return false;
        }
        let at = self.free.len() - needed;
        table.extend(self.free.drain(at..).rev());
        true
    }

    /// Return every page of `table` to the pool.
    pub fn release(&mut self, table: &mut Vec<u32>) {
        self.free.extend(table.drain(..).rev());
        debug_assert!(self.free.len() <= self.pages, "a page was released twice");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_handed_out_and_returned() {
        let mut pool = PagePool::new(16, 4).unwrap();
        let (mut a, mut b) = (Vec::new(), Vec::new());
        assert!(pool.grow(&mut a, 17));
        assert_eq!(a, [0, 1]);
        assert!(
            pool.grow(&mut a, 32),
            "a page already holds positions 16..32"
        );
        assert_eq!(a.len(), 2);
        assert!(pool.grow(&mut b, 1));
        assert_eq!(b, [2]);
        assert!(!pool.grow(&mut b, 33), "three more pages are not free");
        assert_eq!((b.len(), pool.free_pages()), (1, 1));
        pool.release(&mut a);
        assert!(a.is_empty());
        assert_eq!(pool.free_pages(), 3);
        assert!(pool.grow(&mut b, 48));
        assert_eq!(b, [2, 0, 1]);
        pool.release(&mut b);
        assert_eq!(pool.free_pages(), 4);
    }

    #[test]
    fn empty_pools_are_refused() {
        for (size, pages) in [(0, 4), (16, 0)] {
            let e = PagePool::new(size, pages).unwrap_err().to_string();
            assert!(e.contains("at least one"), "{e}");
        }
    }
}
